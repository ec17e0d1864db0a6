"""The knobs a live run can change, and the rules that change them (`monitor.adjust: auto`).

Knobs (only these; each is honoured from a step boundary on, on every worker at the same step):

- `data.prefetch_depth`: batches the worker's loader keeps ready (`ShardLoader.set_prefetch_depth`:
  from the next batch on).
- `memory.max_forward_tokens`: padded tokens one forward/backward pass may hold; a batch above
  it is split into pieces whose gradients are accumulated inside the same optimizer step (the
  out-of-memory backoff's ceiling, `data.backoff.OOMBackoff`); `null` = whole batches. Steps,
  samples and the update are unchanged; only peak memory and speed change. The dynamic batch
  plan itself (`data.dynamic_batch.max`) is fixed for the run: it sets the number of steps per
  epoch, which every rank and the trainer's schedule have already agreed on.

- `optimizer.params.compression.grad` (only in `communication.mode: allreduce_compressed`): the
  gradient codec, one of none, fp16, 2bit, 1bit. Every rank switches at the same step boundary;
  the compressed hook regroups the parameters under the new codec and carries each parameter's
  error-feedback residual over by name (to fp16/none, which keep no residual, it is dropped).
  Not in `monitor.allowed` by default: a stronger codec changes what the run optimises.

Not live: the parameter server's staleness bound (shards and clients check it against each
other), and the codec of the other modes (rapidfire_adamw's compressed momentum state depends
on it). For those the comm-latency rule gives advice (logged with the reason, in the run
summary) instead of a change.

Rules (`evaluate`), over the records of the last `window_steps` steps of every rank, each knob
at most once per window after its last change took effect:

1. data wait above `data_wait_fraction` of step time -> prefetch depth x2 (at least 1), up to
   `max_prefetch_depth`.
2. `oom_splits` or more out-of-memory splits in the window -> max_forward_tokens halves (from
   the largest batch's padded tokens in the window when it was unset).
3. no out-of-memory split, max_forward_tokens set, and every rank's peak memory below
   `memory_headroom` x its memory limit -> max_forward_tokens x2 (back to `null` once that
   covers the largest batch seen): rule 2 reverted as memory allows.
4. comm latency p99 above `comm_latency_p99_s` -> in allreduce_compressed with the codec knob
   allowed, the next stronger codec (none -> fp16 -> 2bit -> 1bit); otherwise advice: a stronger
   codec (with allreduce_compressed) or a larger `communication.ps.max_staleness`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KNOBS = {
    "data.prefetch_depth": "batches the loader keeps ready (from the next batch on)",
    "memory.max_forward_tokens": "padded tokens per forward/backward pass; larger batches are split and "
                                 "accumulated in the same step (null: whole batches)",
    "optimizer.params.compression.grad": "the gradient codec of communication.mode allreduce_compressed "
                                         "(none, fp16, 2bit, 1bit); error feedback carries over",
}
CODEC_KNOB = "optimizer.params.compression.grad"
CODEC_ORDER = ("none", "fp16", "2bit", "1bit")  # weaker -> stronger compression


def codec_is_live(mode: str, codec: str, optimizer: str = "adamw") -> bool:
    """Whether a run can change its gradient codec while it trains: only the compressed hook of
    allreduce_compressed regroups per step, and `auto` already chooses per bucket. (With
    rapidfire_adamw, allreduce_compressed means its momentum exchange: the codec is fixed.)"""
    return mode == "allreduce_compressed" and codec != "auto" and optimizer != "rapidfire_adamw"


def check_knob_value(knob: str, value) -> None:
    """ValueError naming the knob and what it takes, for a value a worker could not apply."""
    if knob == "data.prefetch_depth":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{knob} takes an integer >= 0, got {value!r}")
    elif knob == "memory.max_forward_tokens":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{knob} takes an integer >= 1 or null (whole batches), got {value!r}")
    elif knob == CODEC_KNOB and value not in CODEC_ORDER:
        raise ValueError(f"{knob} takes one of {', '.join(CODEC_ORDER)}, got {value!r}")


def knob_gauge(knob: str, value) -> float:
    """A knob's value as a number for the metrics endpoint: null -> -1, a codec -> its position
    in none, fp16, 2bit, 1bit (0-3)."""
    if value is None:
        return -1.0
    if knob == CODEC_KNOB:
        return float(CODEC_ORDER.index(value))
    return float(value)


@dataclass
class Settings:
    """The `monitor` config section, as the rules use it."""

    adjust: str = "off"
    allowed: tuple[str, ...] = ("data.prefetch_depth", "memory.max_forward_tokens")
    window_steps: int = 4
    data_wait_fraction: float = 0.05
    max_prefetch_depth: int = 16
    oom_splits: int = 2
    memory_headroom: float = 0.5
    comm_latency_p99_s: float = 0.5

    @classmethod
    def from_config(cls, cfg) -> Settings:
        m = cfg["monitor"]
        return cls(adjust=m["adjust"], allowed=tuple(m["allowed"]), window_steps=m["window_steps"],
                   data_wait_fraction=m["data_wait_fraction"], max_prefetch_depth=m["max_prefetch_depth"],
                   oom_splits=m["oom_splits"], memory_headroom=m["memory_headroom"],
                   comm_latency_p99_s=m["comm_latency_p99_s"])


@dataclass
class Proposal:
    knob: str
    new: object
    reason: str
    advice: bool = False  # a recommendation only (no live knob for it)


@dataclass
class RuleState:
    """What the rules remember between evaluations."""

    quiet_until: dict = field(default_factory=dict)  # knob -> the step after which it may change again
    advised: set = field(default_factory=set)


def window(records: list[dict], steps: int) -> list[dict]:
    """The records of the last `steps` steps that every rank has reported."""
    if not records:
        return []
    ranks = {r["rank"] for r in records}
    newest = min(max(r["step"] for r in records if r["rank"] == k) for k in ranks)
    return [r for r in records if newest - steps < r["step"] <= newest]


def evaluate(records: list[dict], knobs: dict, settings: Settings, state: RuleState,
             memory_limits: dict | None = None, codec: str | None = None, mode: str | None = None) -> list[Proposal]:
    """Proposals from the rules for the steps in `records` (every rank's step records)."""
    recent = window(records, settings.window_steps)
    if not recent:
        return []
    newest = max(r["step"] for r in recent)
    span = f"steps {min(r['step'] for r in recent)}-{newest}"
    out: list[Proposal] = []

    def ready(knob: str) -> bool:
        first = min(r["step"] for r in recent)
        return knob in settings.allowed and knob in knobs and first > state.quiet_until.get(knob, -1)

    # 1. data wait -> deeper prefetch
    step_s = sum(r["phases"]["step"] for r in recent)
    wait_s = sum(r["phases"]["data_wait"] for r in recent)
    depth = knobs.get("data.prefetch_depth")
    if step_s > 0 and wait_s / step_s > settings.data_wait_fraction and ready("data.prefetch_depth") \
            and depth is not None and depth < settings.max_prefetch_depth:
        out.append(Proposal("data.prefetch_depth", min(settings.max_prefetch_depth, max(1, depth * 2)),
                            f"data wait {wait_s / step_s:.1%} of step time > {settings.data_wait_fraction:.0%} "
                            f"({span})"))

    # 2./3. out-of-memory splits -> smaller forward passes; headroom -> larger again
    splits = sum(r.get("oom_splits", 0) or 0 for r in recent)
    cap = knobs.get("memory.max_forward_tokens")
    largest = max(r["padded_tokens"] for r in recent)
    if splits >= settings.oom_splits and ready("memory.max_forward_tokens"):
        base = cap if cap is not None else largest
        out.append(Proposal("memory.max_forward_tokens", max(1, base // 2),
                            f"{splits} out-of-memory batch splits >= {settings.oom_splits} ({span})"))
    elif splits == 0 and cap is not None and memory_limits and ready("memory.max_forward_tokens"):
        peaks = {}
        for r in recent:
            peaks[r["rank"]] = max(peaks.get(r["rank"], 0), r.get("peak_memory_bytes") or 0)
        shares = [peaks[k] / memory_limits[k] for k in peaks if memory_limits.get(k)]
        if shares and len(shares) == len(peaks) and max(shares) < settings.memory_headroom:
            new = cap * 2 if cap * 2 < largest else None
            out.append(Proposal("memory.max_forward_tokens", new,
                                f"peak memory at most {max(shares):.0%} of the workers' memory < "
                                f"{settings.memory_headroom:.0%}, no out-of-memory split ({span})"))

    # 4. comm latency -> a stronger codec where it is live, advice otherwise
    p99 = max((r.get("comm_latency_p99_s") or 0.0) for r in recent)
    if p99 > settings.comm_latency_p99_s:
        why = f"comm latency p99 {p99:.3f} s > {settings.comm_latency_p99_s} s ({span})"
        live = knobs.get(CODEC_KNOB)
        if live is not None and live in CODEC_ORDER and live != CODEC_ORDER[-1]:
            if ready(CODEC_KNOB):
                out.append(Proposal(CODEC_KNOB, CODEC_ORDER[CODEC_ORDER.index(live) + 1], why))
                return out
            if CODEC_KNOB in settings.allowed:
                return out  # it may change again once its last change has had a window
        if mode == "parameter_server":
            knob, hint = "communication.ps.max_staleness", "a larger communication.ps.max_staleness"
        else:
            codec = live if live is not None else codec
            stronger = CODEC_ORDER[min(len(CODEC_ORDER) - 1, CODEC_ORDER.index(codec) + 1)] \
                if codec in CODEC_ORDER else "1bit"
            if stronger == codec:  # 1bit already
                knob, hint = CODEC_KNOB, "communication.mode parameter_server (the codec is the strongest, 1bit)"
            else:
                knob, hint = CODEC_KNOB, (f"{CODEC_KNOB} {stronger} with communication.mode allreduce_compressed"
                                          + (f" (or add {CODEC_KNOB} to monitor.allowed)" if live is not None
                                             else ""))
        if knob not in state.advised:
            state.advised.add(knob)
            out.append(Proposal(knob, None, f"{why}; not switchable in this live run: restart with {hint}",
                                advice=True))
    return out

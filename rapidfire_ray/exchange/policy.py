"""Which codec each parameter's gradient uses on the wire.

    policy = CompressionPolicy("1bit")
    policy.codec_for("model.layers.0.mlp.up_proj.weight", param)    # "1bit"
    policy.codec_for("model.layers.0.self_attn.o_proj.weight", param)  # "fp16" (kept)
    policy.codec_for("model.norm.weight", param)                      # "fp16" (kept)

Rules, in order:
1. `grad` "none" or "fp16": every tensor uses it.
2. Kept in fp16: the name matches a `keep_fp16` pattern (fnmatch, case-insensitive, on the full
   parameter name, so "*norm*" also matches "LayerNorm"), or the tensor has fewer than
   `min_numel` elements (default 4096: per-chunk scales and the fixed cost of a collective
   would eat the savings; such tensors are a tiny share of the bytes anyway).
   Default patterns: attention output projections (`*o_proj*`, `*out_proj*`, `*c_proj*`),
   norms (`*norm*`, `*ln_*`), biases (`*.bias`). `keep_fp16=[]` compresses every tensor
   (the size rule still applies unless `min_numel=0`). Under `auto` too.
3. `grad` "1bit" or "2bit": that codec.
4. `grad` "auto": per DDP bucket, the codec with the smallest predicted exchange time
   (exchange/auto.py) for the bucket's tensors that rule 2 does not keep.

Auto. The hook measures the link between the workers and the codecs' speed on this device
(`auto.measure`, agreed over the ranks) when training starts and every `auto_interval` steps;
after each measurement every bucket is decided again: `decide_bucket` gives `auto.choose_codec`
none, fp16, 1bit and 2bit and takes the fastest. On a fast link the answer is none or fp16, on
a slow one 1bit (2bit sends ~2.6x its bytes and costs more to encode, so it wins only where
its codec is measured faster). The concentration statistic below no longer takes part: it
chose 2bit for concentrated gradients, which on the shaped netns link made `auto` 1.6x slower
than fixed 1bit (bench/results/comm_bound_auto.json, 2026-12-04); it stays for analysis.

Every decision is one line through our logger (rank 0: `announce`) with the predicted time of
each candidate, and is kept in `decisions` (bucket index -> record) and `choices` (parameter
name -> codec); `report()` gives the measurements and decisions for the run summary.
`state_dict()` / `load_state_dict()` carry the choices through checkpoints; the
measurement is not saved: a resumed run measures again (its link may differ).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch

from ..compression import CODECS, Codec, get_codec
from ..compression.twobit import top_magnitude_indices
from ..log import say
from .auto import Measurement, choose_codec

log = logging.getLogger(__name__)

DEFAULT_KEEP_FP16 = ("*o_proj*", "*out_proj*", "*c_proj*", "*norm*", "*ln_*", "*.bias")
GRAD_MODES = ("none", "fp16", "1bit", "2bit", "auto")
STATE_FORMAT = "rapidfire_ray.comm.policy/2"  # the saved format's name (checkpoints)
OLD_STATE_FORMATS = ("rapidfire_ray.comm.policy/1",)  # per-tensor auto: its choices load, then are re-decided
#: Share of the entries whose L2 mass the concentration statistic measures.
TOP_FRACTION = 0.01
#: Measurements kept for the run summary (the first and the latest ones).
KEPT_MEASUREMENTS = 20


def concentration(grad: torch.Tensor, top_fraction: float = TOP_FRACTION) -> float:
    """Share of sum(grad**2) held by the ceil(top_fraction * n) largest |entries|, in [0, 1]
    (0.0 for an all-zero or empty tensor, nan for a non-finite one)."""
    flat = grad.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0
    magnitudes = flat.abs().to(torch.float32)
    peak = magnitudes.max()
    if not bool(torch.isfinite(peak)):
        return float("nan")
    if float(peak) == 0.0:
        return 0.0
    squares = (magnitudes / peak).square_()  # in (0, 1]: no overflow, no underflow of the largest
    k = min(n, max(1, math.ceil(round(top_fraction * n, 9))))
    top = squares[top_magnitude_indices(squares, k)].sum()
    return min(1.0, float(top / squares.sum()))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _gbps(seconds_per_element: float) -> str:
    return f"{4 / seconds_per_element / 1e9:.3g} GB/s" if seconds_per_element > 0 else "inf GB/s"


def _rate(bytes_s: float) -> str:
    return "inf" if math.isinf(bytes_s) else f"{bytes_s * 8 / 1e9:.3g} Gbit/s"


class CompressionPolicy:
    """Per-parameter codec choice (see the module docstring)."""

    def __init__(self, grad: str = "1bit", keep_fp16: Iterable[str] | None = None, min_numel: int = 4096,
                 chunk_size: int = 2048, auto_interval: int = 100,
                 onebit_scale: str = "mean_abs"):
        if grad not in GRAD_MODES:
            raise ValueError(f"compression policy: grad must be one of {', '.join(GRAD_MODES)}, got {grad!r}")
        if isinstance(keep_fp16, str):
            raise TypeError("compression policy: keep_fp16 is a list of patterns, not one string")
        if min_numel < 0:
            raise ValueError(f"compression policy: min_numel must be >= 0, got {min_numel}")
        if auto_interval < 1:
            raise ValueError(f"compression policy: auto_interval must be >= 1, got {auto_interval}")
        self.grad = grad
        self.keep_fp16 = list(DEFAULT_KEEP_FP16 if keep_fp16 is None else keep_fp16)
        self._patterns = [p.lower() for p in self.keep_fp16]
        self.min_numel = int(min_numel)
        self.chunk_size = int(chunk_size)
        self.auto_interval = int(auto_interval)
        self.onebit_scale = onebit_scale
        self.announce = True  # log decisions (the hook sets it on rank 0 only)
        self.choices: dict[str, str] = {}
        self.decisions: dict[int, dict] = {}  # bucket index -> the latest decision record
        self.new_decisions: list[dict] = []  # made since the exchange last took them (steps.jsonl)
        self.measurement: Measurement | None = None
        self.measured_at = -1  # the step of the latest measurement
        self.measurements: list[dict] = []  # each measurement's numbers, for the summary
        self.new_measurement: dict | None = None
        self.round = 0  # measurements so far: a bucket is decided once per round
        self._decided_round: dict[str, int] = {}
        self._codecs: dict[str, Codec] = {}
        self.codec("1bit")  # check chunk_size now, not on the first gradient

    # --- the rules ---------------------------------------------------------------------------

    def kept(self, name: str, numel: int) -> bool:
        """True when the tensor stays in fp16 under a compressing mode (pattern or size rule)."""
        if numel < self.min_numel:
            return True
        lowered = name.lower()
        return any(fnmatchcase(lowered, p) for p in self._patterns)

    def rule(self, name: str, numel: int) -> str:
        """The codec by the static rules, or "auto" when the measured link and codecs decide."""
        if self.grad in ("none", "fp16"):
            return self.grad
        if self.kept(name, numel):
            return "fp16"
        return self.grad

    def codec_for(self, name: str, param: torch.Tensor) -> str:
        """"none", "fp16", "1bit" or "2bit" for parameter `name`; under "auto" the codec its
        bucket was last given ("none" before the first decision: nothing is compressed unmeasured)."""
        codec = self.rule(name, param.numel())
        return self.choices.get(name, "none") if codec == "auto" else codec

    # --- auto decisions ----------------------------------------------------------------------

    def measurement_due(self, step: int) -> bool:
        """No measurement yet, or `auto_interval` steps since the latest."""
        return self.measurement is None or step - self.measured_at >= self.auto_interval

    def set_measurement(self, measurement: Measurement, step: int) -> None:
        """A new agreed measurement (auto.measure): every bucket is decided again with it."""
        self.measurement = measurement
        self.measured_at = step
        self.round += 1
        record = {"step": step, **measurement.to_dict()}
        self.new_measurement = record
        self.measurements.append(record)
        if len(self.measurements) > KEPT_MEASUREMENTS:
            del self.measurements[1]  # keep the first (the run's start) and the latest ones
        if self.announce:
            link, sp = measurement.link, measurement.speeds
            codecs = ", ".join(f"{c} {_gbps(sp[c].roundtrip_s)}" for c in sp)
            say(f"compression auto: measured at step {step} on {measurement.world_size} worker(s): "
                + (f"allreduce {_rate(link.allreduce_bytes_s)} + {_ms(link.allreduce_latency_s)}, "
                   f"two-phase exchange {_rate(link.exchange_bytes_s)} + {_ms(link.exchange_latency_s)}; "
                   if measurement.world_size > 1 else "no link; ")
                + f"codecs (fp32 input, round trip) {codecs}")

    def decision_due(self, names: Iterable[str]) -> bool:
        """Some of these auto-ruled tensors have not been decided since the latest measurement."""
        return any(self._decided_round.get(name) != self.round for name in names)

    def decide_bucket(self, bucket: int, names: list[str], numel: int, step: int) -> str:
        """Decide the codec of bucket `bucket`'s auto-ruled tensors (`names`, `numel` elements in
        all) from the latest measurement; records, logs and returns it. The same measurement gives
        the same codec on every rank."""
        m = self.measurement
        if m is None:
            raise RuntimeError("compression auto: decide_bucket before any measurement")
        codec, predicted = choose_codec(numel, m.world_size, m.link, m.speeds, self.chunk_size)
        previous = self.decisions.get(bucket, {}).get("codec")
        for name in names:
            self.choices[name] = codec
            self._decided_round[name] = self.round
        record = {"step": step, "bucket": bucket, "tensors": len(names), "numel": numel, "codec": codec,
                  "predicted_s": predicted}
        self.decisions[bucket] = record
        self.new_decisions.append(record)
        line = (f"compression auto: bucket {bucket} ({len(names)} tensors, {numel:,} elements) -> {codec} "
                f"(predicted {', '.join(f'{c} {_ms(t)}' for c, t in predicted.items())}; step {step})")
        if self.announce and codec != previous:
            say(line)
        else:
            log.debug(line)
        return codec

    def report(self) -> dict:
        """The measurements and each bucket's latest decision, for the run summary."""
        return {"auto_interval": self.auto_interval, "measurements": list(self.measurements),
                "decisions": [self.decisions[b] for b in sorted(self.decisions)]}

    def take_new(self) -> tuple[dict | None, list[dict]]:
        """The measurement and decisions made since the last call (for this step's record)."""
        out = (self.new_measurement, self.new_decisions)
        self.new_measurement, self.new_decisions = None, []
        return out

    # --- codecs and state --------------------------------------------------------------------

    def codec(self, name: str) -> Codec:
        """The codec object for a codec name (1bit/2bit with this policy's chunk_size), cached."""
        if name not in self._codecs:
            if name not in CODECS:
                raise ValueError(f"compression policy: unknown codec {name!r}")
            opts = {"chunk_size": self.chunk_size} if name in ("1bit", "2bit") else {}
            if name == "1bit":
                opts["scale"] = self.onebit_scale
            self._codecs[name] = get_codec(name, **opts)
        return self._codecs[name]

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "grad": self.grad, "choices": dict(self.choices)}

    def load_state_dict(self, state: dict) -> None:
        """The choices (also from the older per-tensor format); the next step measures and decides
        every bucket again."""
        if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, *OLD_STATE_FORMATS):
            raise ValueError(f"compression policy: not a policy state dict (expected format {STATE_FORMAT!r})")
        self.choices = dict(state.get("choices", {}))
        self.measurement = None
        self._decided_round = {}

    def __repr__(self) -> str:
        return (f"CompressionPolicy(grad={self.grad!r}, keep_fp16={self.keep_fp16!r}, min_numel={self.min_numel}, "
                f"chunk_size={self.chunk_size}, auto_interval={self.auto_interval}, onebit_scale={self.onebit_scale!r})")

"""`ParameterShard`: one parameter-server shard, a Ray actor owning a partition of the model.

It holds the partition's master copy in float32 and its AdamW state, and a version counter
(the number of updates its state contains). Workers talk to it with two calls:

- `push(worker_id, seq, base_version, encoded, lr=None, kind="grad")`: one worker's gradients for
  this partition, each an `Encoded` from the configured codec (worker-side error feedback is the
  worker's). The shard decodes them and applies one optimizer step at once (asynchronous SGD:
  it never waits for other workers). With `optimizer.type: rapidfire_adamw` a worker pushes
  uncompressed gradients for its warm-up, then (`kind="update"`) its own compressed AdamW update
  m_hat / (sqrt(v_hat) + eps) preconditioned with the variance it took from `preconditioner()`,
  which the shard applies with the scheduled lr and decoupled weight decay (see client.py).
  Staleness = version before this update - base_version (the version the worker's gradient was
  computed on) is recorded for every applied update.
  `seq` numbers a worker's pushes to this shard 1, 2, 3...: a retried push (Ray retries tasks
  across an actor restart) is applied at most once, and a gap after a restart counts the
  worker's acknowledged pushes that the restored snapshot does not contain (`lost_updates`).
- `pull(worker_id, have_version, admit=True, full=False)`: the parameters as compressed deltas
  from what that worker holds to the current state. The shard keeps, per worker, a float32
  mirror of exactly what the worker holds (the worker applies the same decoded deltas), and
  sends codec(params - mirror): the mirror's gap to the parameters is the server-side
  error-feedback residual, so nothing a lossy codec drops is lost, only delayed; with codec
  "none" the worker's copy equals the server's exactly. A worker without a mirror here (its
  first pull, a restarted worker, a restarted shard) or whose `have_version` does not match
  its mirror gets the full parameters in float32 ("full"), as does `full=True` (`sync`). A
  lossless codec ("none") sends the encoded values themselves ("values": the same bytes as a
  float32 delta, and bit-exact where mirror + delta could differ by a rounding).

Bounded staleness (`max_staleness` = s, in versions). A pull with `admit=True` is the start of
the worker's next step: it admits the worker (its gradient will be computed on the version it
receives) only if every update that can land before each admitted worker's push keeps that
push's staleness <= s: for the newcomer, the number of other admitted workers must be <= s;
for each admitted worker u, (version - base_u) + (other admitted workers) <= s. A push leaves
the admitted set, which never raises that sum for anyone else (the version goes up by one, the
count of others down by one), so the admitted workers always finish and admission never
deadlocks; shards are acquired in index order by every client, so several shards cannot
deadlock each other either. A refused pull returns no parameters (`admitted: False`); the
client retries after a short wait. Refused workers are served first come, first served, so a
slow worker is not starved by fast ones. s >= (workers - 1) never refuses anyone; s = 0
serialises the workers. An admitted worker that does not push within `lease_s` (it died) is
dropped from the admitted set, and a push applied without admission (after a lease expiry or a
shard restart) is still applied; if its staleness exceeds s that is counted as a
`bound_violation`.

Snapshots: every `snapshot_every` applied updates the shard writes parameters, optimizer state,
version and per-worker push sequence numbers to `<snapshot_dir>/shard-<index>.pt` (temporary
file, fsync, rename: a crash never leaves half a snapshot). `__init__` restores the latest
snapshot when there is one, so when Ray restarts the actor after a crash (it re-runs
`__init__` with the same arguments) the shard resumes from it; the updates applied after that
snapshot are gone, and are counted when their workers next push (see `seq`). The per-worker
mirrors are not snapshotted (one model-sized tensor per worker): after a restart every worker
gets a full pull.

Learning rate: `lr` in a push overrides the configured one (the worker's scheduler); with
`lr_staleness_scaling="inverse"` each update uses lr / (1 + staleness).
"""
from __future__ import annotations

import os
import time
from collections import Counter, deque
from collections.abc import Mapping

import torch

from ..exchange.stats import _percentile
from ..compression import Encoded, get_codec
from ..optim import frozen_denom

SNAPSHOT_FORMAT = "rapidfire_ray.ps.shard/1"
LR_SCALINGS = ("none", "inverse")
PUSH_KINDS = ("grad", "update")
_LATENCY_WINDOW = 10_000


def snapshot_path(snapshot_dir: str, index: int) -> str:
    return os.path.join(snapshot_dir, f"shard-{index}.pt")


class ParameterShard:
    """The shard's logic; `remote_shard()` wraps it as a Ray actor. Usable without Ray too."""

    def __init__(self, index: int, params: Mapping[str, torch.Tensor], *, codec: str = "none",
                 codec_opts: Mapping | None = None, max_staleness: int | None = None,
                 snapshot_every: int = 0, snapshot_dir: str | None = None,
                 optimizer: Mapping | None = None, lr_staleness_scaling: str = "none",
                 lease_s: float = 600.0, wait_expiry_s: float = 5.0):
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"communication.ps.max_staleness must be an integer >= 0 (or None for no "
                             f"bound), got {max_staleness!r}")
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 0:
            raise ValueError(f"communication.ps.snapshot_every must be an integer >= 0 (0: never), "
                             f"got {snapshot_every!r}")
        if snapshot_every and not snapshot_dir:
            raise ValueError("communication.ps.snapshot_every needs a snapshot directory (the run's storage)")
        if lr_staleness_scaling not in LR_SCALINGS:
            raise ValueError(f"communication.ps.lr_staleness_scaling must be one of {', '.join(LR_SCALINGS)}, "
                             f"got {lr_staleness_scaling!r}")
        if not params:
            raise ValueError(f"parameter shard {index}: no parameters to own")
        self.index = index
        self.codec = get_codec(codec, **dict(codec_opts or {}))
        self.full_codec = get_codec("none")
        self.max_staleness = max_staleness
        self.snapshot_every = snapshot_every
        self.snapshot_dir = snapshot_dir
        self.lr_staleness_scaling = lr_staleness_scaling
        self.lease_s = lease_s
        self.wait_expiry_s = wait_expiry_s
        self.names = list(params)
        self.params = {n: torch.nn.Parameter(t.detach().to("cpu", torch.float32, copy=True)) for n, t in params.items()}
        opt = dict(optimizer or {})
        self.base_lr = float(opt.pop("lr", 1e-3))
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=self.base_lr, **opt)

        self.version = 0
        self.last_seq: dict[str, int] = {}
        self.lost_updates = 0            # acknowledged updates lost to restarts, over the run
        self.lost_this_restart: dict[str, int] = {}
        self.restarts = 0
        self.restored_from_version: int | None = None
        self.mirrors: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self.admitted: dict[str, tuple[int, float]] = {}   # worker -> (base version, admitted at)
        self.waiting: dict[str, tuple[float, float]] = {}  # worker -> (first refused at, last asked at)

        self._reset_stats()
        self._metrics = _shard_metrics(index)  # Ray's metrics endpoint, when running as a run's named actor
        path = snapshot_path(snapshot_dir, index) if snapshot_dir else None
        if path and os.path.exists(path):
            self._restore(path)
        if _reconstructed():
            self.restarts += 1

    # --- the two calls workers make ------------------------------------------------------

    def push(self, worker_id: str, seq: int, base_version: int, encoded: Mapping[str, Encoded],
             lr: float | None = None, kind: str = "grad") -> dict:
        """Apply one worker's update now. `kind` "grad": `encoded` are gradients, one AdamW
        step; "update": preconditioned updates (rapidfire_adamw's compressed stage, computed by
        the worker), applied as p -= lr * (weight_decay * p + update). Returns status ("applied"
        or "duplicate"), version (after), staleness (of this update; None for a duplicate), lost
        (this worker's acknowledged pushes found missing after a restart)."""
        if kind not in PUSH_KINDS:
            raise ValueError(f"parameter shard {self.index}: push kind must be one of {', '.join(PUSH_KINDS)}, "
                             f"got {kind!r}")
        start = time.perf_counter()
        self.pushes += 1
        last = self.last_seq.get(worker_id, 0)
        if seq <= last:
            self.duplicates += 1
            return {"status": "duplicate", "version": self.version, "staleness": None, "lost": 0}
        lost = seq - last - 1
        if lost:
            # Pushes last+1..seq-1 were acknowledged to this worker by an earlier incarnation
            # and are not in the snapshot this one restored.
            self.lost_updates += lost
            self.lost_this_restart[worker_id] = self.lost_this_restart.get(worker_id, 0) + lost
        unknown = sorted(set(encoded) - set(self.params))
        if unknown:
            raise ValueError(f"parameter shard {self.index}: push for parameters it does not own: "
                             f"{', '.join(unknown[:5])}")
        staleness = self.version - base_version
        if staleness < 0:
            # The worker's copy came from an incarnation that got further than our snapshot.
            self.base_ahead += 1
            staleness = 0
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.bound_violations += 1
        received = 0
        for name, p in self.params.items():
            enc = encoded.get(name)
            if enc is None:
                p.grad = None
                continue
            grad = self.codec.decode(enc) if enc.codec == self.codec.name else get_codec(enc.codec).decode(enc)
            if tuple(grad.shape) != tuple(p.shape):
                raise ValueError(f"parameter shard {self.index}: gradient for {name!r} has shape "
                                 f"{tuple(grad.shape)}, the parameter {tuple(p.shape)}")
            p.grad = grad
            received += enc.nbytes
        step_lr = self.base_lr if lr is None else float(lr)
        if self.lr_staleness_scaling == "inverse":
            step_lr /= 1 + staleness
        if kind == "grad":
            for group in self.optimizer.param_groups:
                group["lr"] = step_lr
            self.optimizer.step()
        else:
            self._apply_updates(step_lr)
        for p in self.params.values():
            p.grad = None
        self.version += 1
        self.applied += 1
        self.applied_by_kind[kind] += 1
        self.last_seq[worker_id] = seq
        self.admitted.pop(worker_id, None)
        self.staleness_hist[staleness] += 1
        self.bytes_in += received
        now = time.perf_counter()
        if self.first_apply is None:
            self.first_apply = now
        self.last_apply = now
        if self.snapshot_every and self.applied % self.snapshot_every == 0:
            self.snapshot()
        self.push_latencies.append(time.perf_counter() - start)
        if self._metrics is not None:
            self._metrics.update(self.version, staleness)
        return {"status": "applied", "version": self.version, "staleness": staleness, "lost": lost}

    @torch.no_grad()
    def _apply_updates(self, lr: float) -> None:
        """p -= lr * (weight_decay * p + update): the step AdamW would take with that update as
        its m_hat / (sqrt(v_hat) + eps) (decay first, as AdamW). The update arrived in .grad.
        The AdamW state is left as it is (its variance is what the workers froze)."""
        wd = self.optimizer.param_groups[0]["weight_decay"]
        for p in self.params.values():
            if p.grad is None:
                continue
            if wd:
                p.mul_(1 - lr * wd)
            st = self.optimizer.state.get(p)
            if not st:  # no gradient in any warm-up push: v == 0 everywhere, held still
                continue
            # Elements whose variance is 0 are held still (1-bit codes cannot send a zero).
            p.add_(p.grad.masked_fill_(st["exp_avg_sq"] == 0, 0.0), alpha=-lr)

    def preconditioner(self) -> dict:
        """What a worker entering rapidfire_adamw's compressed stage needs from this shard's AdamW
        state: per parameter `exp_avg` (its momentum starts from it) and `denom` = sqrt(v_hat) +
        eps (the frozen preconditioner), with `step` (updates in that state) and betas. A
        parameter without state (no gradient yet) gets zeros: its denom is eps and its mask
        (v == 0) holds it still."""
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        exp_avg, denom, zero, steps = {}, {}, {}, []
        for name, p in self.params.items():
            st = self.optimizer.state.get(p)
            if not st:
                exp_avg[name] = torch.zeros_like(p, dtype=torch.float32)
                denom[name] = torch.full_like(p, eps, dtype=torch.float32)
                zero[name] = torch.ones_like(p, dtype=torch.bool)
                continue
            t = int(st["step"])
            steps.append(t)
            denom[name] = frozen_denom(st["exp_avg_sq"], t, beta2, eps)
            exp_avg[name] = st["exp_avg"].detach().clone()
            zero[name] = st["exp_avg_sq"] == 0
        return {"step": max(steps, default=0), "betas": (beta1, beta2), "eps": eps,
                "exp_avg": exp_avg, "denom": denom, "zero_variance": zero}

    def pull(self, worker_id: str, have_version: int | None, admit: bool = True, full: bool = False) -> dict:
        """The parameters since what `worker_id` holds. Returns admitted (False: nothing else,
        ask again shortly), version, kind ("delta", "values" for a lossless codec, or "full"), tensors (name -> Encoded for a
        delta or values, name -> float32 tensor for full), nbytes (payload bytes sent)."""
        start = time.perf_counter()
        now = time.monotonic()
        if admit and not self._admit(worker_id, now):
            self.refusals += 1
            return {"admitted": False, "version": self.version, "kind": None, "tensors": {}, "nbytes": 0}
        mirror = self.mirrors.get(worker_id)
        if full or mirror is None or mirror[0] != have_version:
            held = {n: p.detach().clone() for n, p in self.params.items()}
            self.mirrors[worker_id] = (self.version, held)
            out = {n: t.clone() for n, t in held.items()}
            nbytes = sum(4 * t.numel() for t in out.values())
            kind = "full"
            self.full_pulls += 1
        elif self.codec.lossless:
            # A lossless delta costs what the values cost, and the values are exact where
            # mirror + (params - mirror) can be off by a rounding.
            held = mirror[1]
            out = {}
            nbytes = 0
            for name, p in self.params.items():
                held[name].copy_(p.detach())
                out[name] = self.codec.encode(p.detach(), name=name)
                nbytes += out[name].nbytes
            self.mirrors[worker_id] = (self.version, held)
            kind = "values"
        else:
            held = mirror[1]
            out = {}
            nbytes = 0
            for name, p in self.params.items():
                enc = self.codec.encode(p.detach() - held[name], name=name)
                held[name] += self.codec.decode(enc)  # exactly what the worker will add
                out[name] = enc
                nbytes += enc.nbytes
            self.mirrors[worker_id] = (self.version, held)
            kind = "delta"
        self.bytes_out += nbytes
        self.pulls += 1
        self.pull_latencies.append(time.perf_counter() - start)
        return {"admitted": True, "version": self.version, "kind": kind, "tensors": out, "nbytes": nbytes,
                "last_seq": self.last_seq.get(worker_id, 0)}

    def _admit(self, worker_id: str, now: float) -> bool:
        s = self.max_staleness
        self.admitted.pop(worker_id, None)  # a new pull re-bases a worker already admitted
        if s is None:
            self.admitted[worker_id] = (self.version, now)
            return True
        for w, (_, since) in list(self.admitted.items()):
            if now - since > self.lease_s:
                del self.admitted[w]
                self.expired_leases += 1
        for w, (_, asked) in list(self.waiting.items()):
            if now - asked > self.wait_expiry_s:
                del self.waiting[w]
        first, _ = self.waiting.get(worker_id, (now, now))
        self.waiting[worker_id] = (first, now)
        # First come, first served among the refused: someone refused earlier goes first.
        ahead = any(t < first or (t == first and w < worker_id)
                    for w, (t, _) in self.waiting.items() if w != worker_id)
        n = len(self.admitted)  # others already admitted (worker_id was removed above)
        fits = n <= s and all(self.version - base + n <= s for base, _ in self.admitted.values())
        if ahead or not fits:
            self.queue_depth_max = max(self.queue_depth_max, len(self.waiting))
            return False
        del self.waiting[worker_id]
        self.admitted[worker_id] = (self.version, now)
        return True

    def withdraw(self, worker_id: str) -> None:
        """Give back an admission, or a place in the queue, without pushing: a client that was
        refused by shard i gives back everything it asked of shards after i and takes them
        again in index order (holding a queue place on a later shard while waiting on an
        earlier one would deadlock with a worker doing the opposite)."""
        self.admitted.pop(worker_id, None)
        self.waiting.pop(worker_id, None)

    def release(self, worker_id: str) -> None:
        """Forget a worker (it stopped or will `sync` again): its admission, queue place, mirror."""
        self.admitted.pop(worker_id, None)
        self.waiting.pop(worker_id, None)
        self.mirrors.pop(worker_id, None)

    # --- snapshots -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"format": SNAPSHOT_FORMAT, "index": self.index, "names": list(self.names),
                "params": {n: p.detach().clone() for n, p in self.params.items()},
                "optimizer": self.optimizer.state_dict(), "version": self.version,
                "last_seq": dict(self.last_seq), "lost_updates": self.lost_updates,
                "restarts": self.restarts, "base_lr": self.base_lr}

    def snapshot(self, path: str | None = None) -> str:
        """Write the state to `path` (default: this shard's file in snapshot_dir) atomically."""
        if path is None:
            if not self.snapshot_dir:
                raise ValueError(f"parameter shard {self.index}: no snapshot_dir and no path given")
            os.makedirs(self.snapshot_dir, exist_ok=True)
            path = snapshot_path(self.snapshot_dir, self.index)
        start = time.perf_counter()
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.snapshots += 1
        self.snapshot_version = self.version
        self.snapshot_seconds += time.perf_counter() - start
        return path

    def load_state_dict(self, state: Mapping) -> None:
        if not isinstance(state, Mapping) or state.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"parameter shard {self.index}: not a shard snapshot "
                             f"(format {state.get('format') if isinstance(state, Mapping) else None!r})")
        if list(state["names"]) != self.names:
            raise ValueError(f"parameter shard {self.index}: snapshot holds parameters {state['names'][:3]}..., "
                             f"this shard owns {self.names[:3]}... (different model or num_shards?)")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state["params"][n])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.last_seq = dict(state["last_seq"])
        self.lost_updates = int(state.get("lost_updates", 0))
        self.restarts = int(state.get("restarts", 0))
        self.base_lr = float(state.get("base_lr", self.base_lr))
        self.mirrors.clear()
        self.admitted.clear()

    def _restore(self, path: str) -> None:
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.restored_from_version = self.version
        self.snapshot_version = self.version

    # --- what the run reads --------------------------------------------------------------

    def state(self) -> dict:
        """Full float32 parameters (copies) and the version they are at."""
        return {"version": self.version, "params": {n: p.detach().clone() for n, p in self.params.items()}}

    def describe(self) -> dict:
        return {"index": self.index, "names": list(self.names), "codec": self.codec.name,
                "max_staleness": self.max_staleness, "version": self.version}

    def stats(self) -> dict:
        push = sorted(self.push_latencies)
        pull = sorted(self.pull_latencies)
        span = (self.last_apply - self.first_apply) if self.first_apply is not None else 0.0
        hist = dict(sorted(self.staleness_hist.items()))
        return {
            "shard": self.index, "version": self.version, "pushes": self.pushes, "applied": self.applied,
            "applied_by_kind": dict(self.applied_by_kind), "duplicates": self.duplicates, "pulls": self.pulls,
            "full_pulls": self.full_pulls,
            "push_latency_p50_s": _percentile(push, 0.5), "push_latency_p99_s": _percentile(push, 0.99),
            "pull_latency_p50_s": _percentile(pull, 0.5), "pull_latency_p99_s": _percentile(pull, 0.99),
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "updates_per_s": (self.applied - 1) / span if span > 0 else 0.0,
            "staleness_hist": hist, "staleness_max": max(hist) if hist else 0,
            "staleness_mean": (sum(k * v for k, v in hist.items()) / sum(hist.values())) if hist else 0.0,
            "bound_violations": self.bound_violations, "base_ahead": self.base_ahead,
            "admitted": len(self.admitted), "waiting": len(self.waiting), "refusals": self.refusals,
            "queue_depth_max": self.queue_depth_max,
            "expired_leases": self.expired_leases,
            "snapshots": self.snapshots, "snapshot_version": self.snapshot_version,
            "snapshot_seconds": self.snapshot_seconds,
            "restarts": self.restarts, "restored_from_version": self.restored_from_version,
            "lost_updates": self.lost_updates, "lost_by_worker": dict(self.lost_this_restart),
        }

    def _reset_stats(self) -> None:
        self.pushes = self.applied = self.duplicates = self.pulls = self.full_pulls = 0
        self.applied_by_kind: Counter[str] = Counter()
        self.bytes_in = self.bytes_out = 0
        self.bound_violations = self.base_ahead = self.refusals = self.expired_leases = 0
        self.queue_depth_max = 0  # most workers refused and waiting for admission at once
        self.snapshots = 0
        self.snapshot_version: int | None = None
        self.snapshot_seconds = 0.0
        self.staleness_hist: Counter[int] = Counter()
        self.push_latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self.pull_latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self.first_apply: float | None = None
        self.last_apply: float | None = None

    def ping(self) -> int:
        return self.version


def _shard_metrics(index: int):
    """`telemetry.metrics.ShardMetrics` for a shard actor named `rapidfire-ps-<run>-<index>`
    (what `ps.driver` starts for a run), else None (tests, other callers)."""
    try:
        import ray

        name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    except Exception:
        return None
    prefix, suffix = "rapidfire-ps-", f"-{index}"
    if not name or not name.startswith(prefix) or not name.endswith(suffix):
        return None
    from ..telemetry.metrics import ShardMetrics

    return ShardMetrics(name[len(prefix):-len(suffix)], index)


def _reconstructed() -> bool:
    try:
        import ray
        if not ray.is_initialized():
            return False
        import warnings
        with warnings.catch_warnings():  # ray reads its own deprecated actor_id property here
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 -- not inside an actor
        return False


def remote_shard(*, num_cpus: float = 0.25, max_restarts: int = -1, max_task_retries: int = -1, **options):
    """`ParameterShard` as a Ray actor class. Restarts are unlimited by default (a shard is
    state the run cannot go on without; it comes back from its snapshot), and calls in flight
    when it dies are retried on the restarted actor (pushes are deduplicated by `seq`; pulls
    are safe to repeat)."""
    import ray

    return ray.remote(ParameterShard).options(num_cpus=num_cpus, max_restarts=max_restarts,
                                              max_task_retries=max_task_retries, **options)


def launch_shards(named_parameters, num_shards: int, *, snapshot_dir: str | None = None,
                  scheduling_strategy="SPREAD", num_cpus: float = 0.25, name_prefix: str | None = None,
                  **shard_kwargs):
    """Partition `named_parameters` and start one actor per shard, spread across nodes.
    Returns (handles, partition, pinned). `shard_kwargs` go to `ParameterShard` (codec,
    codec_opts, max_staleness, snapshot_every, optimizer, lr_staleness_scaling, lease_s).

    Keep `pinned` (object-store references to each shard's initial parameters) as long as the
    shards may restart: Ray re-runs `__init__` with the same arguments, and arguments that left
    the object store make the restart fail (ray-project/ray#53727)."""
    import ray

    from .partition import partition_parameters

    params = dict(named_parameters)
    partition = partition_parameters(params, num_shards)
    handles, pinned = [], []
    for i, names in enumerate(partition):
        opts = {"scheduling_strategy": scheduling_strategy}
        if name_prefix:
            opts["name"] = f"{name_prefix}-{i}"
        cls = remote_shard(num_cpus=num_cpus, **opts)
        pinned.append(ray.put({n: params[n].detach().to("cpu", torch.float32) for n in names}))
        handles.append(cls.remote(i, pinned[-1], snapshot_dir=snapshot_dir, **shard_kwargs))
    return handles, partition, pinned


__all__ = ["LR_SCALINGS", "PUSH_KINDS", "ParameterShard", "launch_shards", "remote_shard", "snapshot_path"]

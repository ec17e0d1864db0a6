"""`ParameterShard`: one parameter-server shard, a Ray actor owning a partition of the model:
its float32 master copy, its AdamW state and a version counter. Workers `push` gradients (or
rapidfire_adamw updates), applied at once, and `pull` compressed deltas since what they hold,
which also admits them to their next step under bounded staleness (`max_staleness`).

The protocol (exactly-once pushes, per-worker mirrors, admission, snapshots, learning rate):
docs/parameter_server.md. Snapshots: snapshots.py; counters: shard_stats.py; the rapidfire_adamw
update math: adam_updates.py; starting the actors: launch.py.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

import torch

from ..compression import Encoded, get_codec
from .actor_context import reconstructed, shard_metrics
from .adam_updates import apply_updates, preconditioner
from .shard_stats import ShardStats
from .snapshots import ShardSnapshots, snapshot_path

LR_SCALINGS = ("none", "inverse")
PUSH_KINDS = ("grad", "update")


class ParameterShard(ShardSnapshots, ShardStats):
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
        self._metrics = shard_metrics(index)  # Ray's metrics endpoint, when running as a run's named actor
        path = snapshot_path(snapshot_dir, index) if snapshot_dir else None
        if path and os.path.exists(path):
            self._restore(path)
        if reconstructed():
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
            apply_updates(self.optimizer, self.params, step_lr)
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

    def preconditioner(self) -> dict:
        """What a worker entering rapidfire_adamw's compressed stage needs from this shard's AdamW
        state (see `adam_updates.preconditioner`)."""
        return preconditioner(self.optimizer, self.params)

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

    # --- what the run reads --------------------------------------------------------------

    def state(self) -> dict:
        """Full float32 parameters (copies) and the version they are at."""
        return {"version": self.version, "params": {n: p.detach().clone() for n, p in self.params.items()}}

    def describe(self) -> dict:
        return {"index": self.index, "names": list(self.names), "codec": self.codec.name,
                "max_staleness": self.max_staleness, "version": self.version}

    def ping(self) -> int:
        return self.version


__all__ = ["LR_SCALINGS", "PUSH_KINDS", "ParameterShard"]

"""What a `ParameterShard` counts (pushes, pulls, bytes, latencies, staleness histogram,
admission, snapshots, restarts) and `stats()`, the summary the run reads."""
from __future__ import annotations

from collections import Counter, deque

from ..exchange.stats import _percentile

_LATENCY_WINDOW = 10_000


class ShardStats:
    """Mixin of `ParameterShard`: its counters (`_reset_stats`) and `stats()`."""

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

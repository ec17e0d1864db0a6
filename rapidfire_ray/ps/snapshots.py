"""Snapshots of a `ParameterShard`: parameters, optimizer state, version and per-worker push
sequence numbers, written atomically to `<snapshot_dir>/shard-<index>.pt` and restored when Ray
restarts the actor. What survives a restart and what is counted lost: docs/parameter_server.md."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

import torch

SNAPSHOT_FORMAT = "rapidfire_ray.ps.shard/1"


def snapshot_path(snapshot_dir: str, index: int) -> str:
    return os.path.join(snapshot_dir, f"shard-{index}.pt")


class ShardSnapshots:
    """Mixin of `ParameterShard`: `state_dict`, `snapshot`, `load_state_dict`. Uses the shard's
    index, names, params, optimizer, version, last_seq, counters and snapshot_dir."""

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

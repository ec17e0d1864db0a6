"""Which (config, chunk) pair a free slot trains next, and which configs successive halving stops.

Pure bookkeeping (no Ray), so its decisions are tested on their own. Every config trains chunk 0,
1, 2, ... in that order; a free slot takes the live config with the fewest chunks done (ties: the
oldest config), so configs move through the data together and are compared on the same chunks.
Under successive halving nobody starts chunk k (a cut boundary) until every live config has
finished chunk k-1 and the cut is made: keep the best max(1, n // eta), stop the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

RUNNING, STOPPED, FAILED, DELETED, DONE = "running", "stopped", "failed", "deleted", "done"


@dataclass
class ConfigEntry:
    id: str
    state: str = RUNNING
    chunks_done: int = 0
    in_flight: bool = False
    scores: list = field(default_factory=list)  # the metric after each chunk trained
    reason: Optional[str] = None
    order: int = 0

    @property
    def score(self) -> float:
        return self.scores[-1] if self.scores else math.inf


class ChunkScheduler:
    def __init__(self, num_chunks: int, policy: str = "none", eta: int = 2, min_chunks: int = 1):
        self.num_chunks, self.policy, self.eta, self.min_chunks = num_chunks, policy, eta, min_chunks
        self.configs: dict[str, ConfigEntry] = {}
        self.cuts_made: set[int] = set()  # boundaries successive halving has decided
        self.cuts: list[dict] = []

    def add(self, cid: str, chunks_done: int = 0, state: str = RUNNING, scores: list | None = None,
            reason: str | None = None) -> ConfigEntry:
        entry = ConfigEntry(cid, state, chunks_done, scores=list(scores or []), reason=reason,
                            order=len(self.configs))
        if entry.state == RUNNING and chunks_done >= self.num_chunks:
            entry.state = DONE
        self.configs[cid] = entry
        return entry

    def live(self) -> list[ConfigEntry]:
        return [c for c in self.configs.values() if c.state == RUNNING]

    def next_pair(self) -> tuple[str, int] | None:
        """The config a free slot trains now and its chunk, or None (nothing runnable yet)."""
        ready = [c for c in self.live() if not c.in_flight and not self._held(c)]
        if not ready:
            return None
        c = min(ready, key=lambda c: (c.chunks_done, c.order))
        c.in_flight = True
        return c.id, c.chunks_done

    def _held(self, c: ConfigEntry) -> bool:
        # a cut boundary not yet decided holds everybody who reached it
        return self.policy == "successive_halving" and self._is_cut(c.chunks_done) and c.chunks_done not in self.cuts_made

    def _is_cut(self, boundary: int) -> bool:
        return self.min_chunks <= boundary < self.num_chunks

    def finished(self, cid: str, score: float) -> None:
        c = self.configs[cid]
        c.in_flight = False
        c.chunks_done += 1
        c.scores.append(score if score == score else math.inf)  # NaN ranks last
        if c.state == RUNNING and c.chunks_done >= self.num_chunks:
            c.state = DONE

    def failed(self, cid: str, reason: str) -> None:
        c = self.configs[cid]
        c.in_flight, c.state, c.reason = False, FAILED, reason

    def returned(self, cid: str) -> None:
        """Its chunk did not finish (a lost slot): it trains that chunk again from its last boundary."""
        self.configs[cid].in_flight = False

    def cut(self) -> list[str]:
        """Successive halving: make every cut whose boundary all live configs have reached; the ids stopped."""
        stopped: list[str] = []
        if self.policy != "successive_halving":
            return stopped
        while True:
            live = self.live() + [c for c in self.configs.values() if c.state == DONE]
            pending = sorted({c.chunks_done for c in self.live()
                              if self._is_cut(c.chunks_done) and c.chunks_done not in self.cuts_made})
            if not pending:
                return stopped
            boundary = pending[0]
            if any(c.chunks_done < boundary or c.in_flight for c in self.live()):
                return stopped  # someone is still on its way to this boundary
            group = [c for c in live if c.chunks_done == boundary]
            keep = max(1, len(group) // self.eta)
            ranked = sorted(group, key=lambda c: (c.score, c.order))
            for rank, c in enumerate(ranked[keep:], start=keep + 1):
                c.state, c.reason = STOPPED, (f"successive_halving after chunk {boundary}: rank {rank} of "
                                              f"{len(group)} (kept the best {keep})")
                stopped.append(c.id)
            self.cuts_made.add(boundary)
            self.cuts.append({"after_chunk": boundary, "kept": [c.id for c in ranked[:keep]],
                              "stopped": [c.id for c in ranked[keep:]]})

    def idle(self) -> bool:
        """Nothing in flight and nothing left to hand out (call `cut` first)."""
        return not any(c.in_flight for c in self.configs.values()) and \
            not any(not self._held(c) for c in self.live())

"""Which (config, chunk) pair a free slot trains next, and which configs a policy stops or replaces.

Pure bookkeeping (no Ray), so its decisions are tested on their own. Every config trains chunk 0,
1, 2, ... in that order; a free slot takes the live config with the fewest chunks done (ties: the
oldest config), so configs move through the data together and are compared on the same chunks.
Under a policy (successive_halving, pbt) nobody starts chunk k (a decided boundary, k >=
min_chunks) until every live config has finished chunk k-1 and the decision is made:
successive halving keeps the best max(1, n // eta) and stops the rest; pbt (population-based
training) stops the worst ceil(quantile * n) (at most n // 2) and asks for each a warm clone of
one of the best as many, the worst replaced by the best (`take_exploits`: the driver clones them
with perturbed values, spec.perturb). The population keeps its size; clones join at the boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

RUNNING, STOPPED, FAILED, DELETED, DONE = "running", "stopped", "failed", "deleted", "done"
DECIDING = ("successive_halving", "pbt")  # policies that decide at chunk boundaries


@dataclass
class ConfigEntry:
    id: str
    state: str = RUNNING
    chunks_done: int = 0
    in_flight: bool = False
    scores: list = field(default_factory=list)  # the metric after each chunk trained
    reason: Optional[str] = None
    order: int = 0
    solo: bool = False  # trains alone from now on (its co-batched group failed)

    @property
    def score(self) -> float:
        return self.scores[-1] if self.scores else math.inf


class ChunkScheduler:
    def __init__(self, num_chunks: int, policy: str = "none", eta: int = 2, min_chunks: int = 1,
                 quantile: float = 0.25):
        self.num_chunks, self.policy, self.eta, self.min_chunks = num_chunks, policy, eta, min_chunks
        self.quantile = quantile
        self.configs: dict[str, ConfigEntry] = {}
        self.cuts_made: set[int] = set()  # boundaries the policy has decided
        self.cuts: list[dict] = []
        self.exploits: list[dict] = []  # pbt: clones asked for and not yet taken by the driver

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

    def next_pair(self, prefer=None) -> tuple[str, int] | None:
        """The config a free slot trains now and its chunk, or None (nothing runnable yet). Among
        those with the fewest chunks done, one that `prefer(id)` (its state is on the slot's node)
        comes first, then the oldest."""
        ready = [c for c in self.live() if not c.in_flight and not self._held(c)]
        if not ready:
            return None
        c = min(ready, key=lambda c: (c.chunks_done, not (prefer and prefer(c.id)), c.order))
        c.in_flight = True
        return c.id, c.chunks_done

    def next_group(self, size: int = 1, key=None, prefer=None) -> tuple[list[str], int] | None:
        """Up to `size` configs a free slot trains together now (co-batching) and their chunk: the
        config `next_pair` picks, joined by ready ones at the same chunk with the same `key(id)`
        (configs that can share a pass; preferred ones, then the oldest); a config marked solo
        trains alone. Or None."""
        pair = self.next_pair(prefer)
        if pair is None:
            return None
        cid, chunk = pair
        group = [cid]
        if size > 1 and not self.configs[cid].solo:
            want = key(cid) if key else None
            for c in sorted(self.live(), key=lambda c: (not (prefer and prefer(c.id)), c.order)):
                if len(group) >= size:
                    break
                if (not c.in_flight and not c.solo and c.chunks_done == chunk and not self._held(c)
                        and (key(c.id) if key else None) == want):
                    c.in_flight = True
                    group.append(c.id)
        return group, chunk

    def _held(self, c: ConfigEntry) -> bool:
        # a boundary not yet decided holds everybody who reached it
        return self.policy in DECIDING and self._is_cut(c.chunks_done) and c.chunks_done not in self.cuts_made

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
        """Make every decision whose boundary all live configs have reached; the ids stopped."""
        stopped: list[str] = []
        if self.policy not in DECIDING:
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
            ranked = sorted(group, key=lambda c: (c.score, c.order))
            if self.policy == "pbt":
                stopped += self._exploit(boundary, ranked)
                continue
            keep = max(1, len(group) // self.eta)
            for rank, c in enumerate(ranked[keep:], start=keep + 1):
                c.state, c.reason = STOPPED, (f"successive_halving after chunk {boundary}: rank {rank} of "
                                              f"{len(group)} (kept the best {keep})")
                stopped.append(c.id)
            self.cuts_made.add(boundary)
            self.cuts.append({"after_chunk": boundary, "kept": [c.id for c in ranked[:keep]],
                              "stopped": [c.id for c in ranked[keep:]]})

    def _exploit(self, boundary: int, ranked: list[ConfigEntry]) -> list[str]:
        """pbt at `boundary`: the worst k replaced by warm clones of the best k (the worst by the best)."""
        n = len(ranked)
        k = min(n // 2, math.ceil(self.quantile * n))
        best, worst = ranked[:k], ranked[n - k:][::-1]  # worst[0] is the last of all
        for loser, winner in zip(worst, best):
            loser.state, loser.reason = STOPPED, (f"pbt after chunk {boundary}: rank {n - worst.index(loser)} of {n}, "
                                                  f"replaced by a warm clone of {winner.id}")
            self.exploits.append({"after_chunk": boundary, "parent": winner.id, "replaces": loser.id})
        self.cuts_made.add(boundary)
        self.cuts.append({"after_chunk": boundary, "kept": [c.id for c in ranked[:n - k]],
                          "stopped": [c.id for c in worst], "cloned": [c.id for c in best]})
        return [c.id for c in worst]

    def take_exploits(self) -> list[dict]:
        """pbt: the clones asked for since the last call ({after_chunk, parent, replaces})."""
        out, self.exploits = self.exploits, []
        return out

    def idle(self) -> bool:
        """Nothing in flight and nothing left to hand out (call `cut` first)."""
        return not any(c.in_flight for c in self.configs.values()) and \
            not any(not self._held(c) for c in self.live())

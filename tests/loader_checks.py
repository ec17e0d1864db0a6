"""Shared check for the loader tests: one epoch over every rank's loader."""
from __future__ import annotations

from collections import Counter


def epoch_sources(loaders, epoch: int, max_padded: int | None = None) -> Counter:
    """Iterate `epoch` on every rank; check each yields len() batches (within `max_padded` tokens);
    return how often each row source was seen across ranks."""
    seen = Counter()
    for loader in loaders:
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader)
        for b in batches:
            assert b["input_ids"].shape == b["labels"].shape
            assert max_padded is None or b["input_ids"].numel() <= max_padded
            seen.update(b["sources"])
    return seen

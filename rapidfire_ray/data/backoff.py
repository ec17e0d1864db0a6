"""Out-of-memory backoff: a batch that does not fit is split and retried, and the rank's budget
is lowered so later batches of that size are split before they fail.

The split happens inside the optimizer step (the pieces are accumulated like micro-batches, all
but the last under DDP's `no_sync`), so every rank still takes the same number of steps and
every sample is trained on once. With the loss normalised by the step's token count
(transformers' `num_items_in_batch`), the pieces' gradients add up to the whole batch's.
"""
from __future__ import annotations

import torch

from ..errors import RapidfireError


class BatchDoesNotFit(RapidfireError):
    """Raised when a batch of one row runs out of memory: nothing is left to split."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a plain RuntimeError)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def batch_cost(batch: dict) -> int:
    """Padded tokens of a batch: what its activations scale with."""
    return int(batch["input_ids"].numel())


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Split by rows into `parts` pieces (sizes differ by at most one), each trimmed to its own
    longest row. Tensors with a batch dimension are split; other values are kept whole."""
    rows = batch["input_ids"].shape[0]
    parts = max(1, min(parts, rows))
    bounds = [(i * rows // parts, (i + 1) * rows // parts) for i in range(parts)]
    pieces = []
    for start, end in bounds:
        piece = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows:
                piece[key] = value[start:end]
            elif isinstance(value, list) and len(value) == rows:
                piece[key] = value[start:end]
            else:
                piece[key] = value
        if "attention_mask" in piece:
            width = int(piece["attention_mask"].sum(dim=1).max())
            for key, value in piece.items():
                if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == batch["input_ids"].shape[1]:
                    piece[key] = value[:, :width]
        pieces.append(piece)
    return pieces


class OOMBackoff:
    """Per-rank record of out-of-memory events and the lowered budget (padded tokens per piece)."""

    def __init__(self):
        self.ceiling: int | None = None  # pieces above this many padded tokens are split up front
        self.events: list[dict] = []

    def pieces_for(self, batch: dict) -> int:
        if self.ceiling is None:
            return 1
        return max(1, -(-batch_cost(batch) // self.ceiling))

    def lower(self, batch: dict, step: int) -> None:
        """A batch of this cost did not fit: from now on, pieces stay at half of it."""
        cost = batch_cost(batch)
        self.ceiling = max(1, cost // 2) if self.ceiling is None else min(self.ceiling, max(1, cost // 2))
        self.events.append({"step": step, "rows": int(batch["input_ids"].shape[0]),
                            "width": int(batch["input_ids"].shape[1]), "ceiling_tokens": self.ceiling})

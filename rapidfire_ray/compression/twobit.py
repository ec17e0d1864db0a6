"""`2bit`: four levels per element and a float32 scale per chunk, plus the largest entries
sent exactly. For dense gradients, whose mass is spread over many entries, where 1 bit loses
too much.

Dense part: per chunk a float32 scale (mean |x| over the non-sparse elements) and a 2-bit
code per element, decoding to +-A*s or +-B*s (the Lloyd-Max 4-level quantiser for a
Gaussian). Sparse part: the largest `sparse_fraction` of entries sent exactly. The levels'
derivation and why the sparse part exists: docs/compression.md.

Payload: n_chunks float32 scales, k int32 indices, k float32 values, then ceil(n / 4) bytes of
2-bit codes (unused bits zero).
Size: 4 * ceil(n / chunk_size) + 8 * k + ceil(n / 4) bytes (about 12x fewer than float32 at the
defaults). Tensors of 2**31 elements or more cannot be indexed by int32 and are refused.
NaN/inf input raises NonFiniteGradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import torch

from .codec import (
    FLOAT32_MAX,
    Codec,
    NonFiniteGradient,
    check_chunk_size,
    chunk_counts,
    chunk_mean_abs,
    num_chunks,
    pack_bits,
    pad_to,
    unpack_bits,
    view_as_dtype,
)

THRESHOLD = 1.2302517  # T: |x| > T * s takes the outer level
INNER = 0.5674756  # A
OUTER = 1.8930277  # B
MAX_NUMEL = 2**31 - 1

# Above this size, find the top-k among candidates above a sampled threshold (see below).
_SAMPLED_TOPK_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 14


def top_magnitude_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of `k` largest entries of the non-negative `magnitudes`.

    Exact, but faster than one `torch.topk` over a large tensor: a strided sample gives a
    threshold a little below the k-th largest value; every entry at or above it is a
    candidate, and when there are at least k candidates the top k of the whole tensor are among
    them (all entries >= the threshold are candidates, and the k-th largest is >= the
    threshold). Otherwise it falls back to a full topk. Ties at the k-th value are broken in
    whatever way `torch.topk` breaks them."""
    n = magnitudes.numel()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=magnitudes.device)
    if k >= n:
        return torch.arange(n, device=magnitudes.device)
    indices = None
    if n >= _SAMPLED_TOPK_MIN_NUMEL:
        sample = magnitudes[:: n // _SAMPLE_SIZE]
        # Keep 1.5x the sample's share of the top k, plus a margin for small fractions.
        keep = min(sample.numel(), math.ceil(sample.numel() * k / n * 1.5) + 32)
        threshold = torch.topk(sample, keep, sorted=False).values.min()
        candidates = (magnitudes >= threshold).nonzero().view(-1)
        if k <= candidates.numel() < n:
            indices = candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    if indices is None:
        indices = torch.topk(magnitudes, k, sorted=False).indices
    return indices.sort().values


@dataclass(frozen=True)
class TwoBitCodec(Codec):
    chunk_size: int = 2048
    sparse_fraction: float = 0.01

    name: ClassVar[str] = "2bit"

    def __post_init__(self):
        check_chunk_size(self.chunk_size, self.name)
        f = self.sparse_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"2bit codec: sparse_fraction must be a number in [0, 1], got {f!r}")

    def sparse_count(self, numel: int) -> int:
        """k = ceil(sparse_fraction * numel), computed on the decimal value of the fraction so
        that e.g. 0.07 * 100 is 7, not 8 (in binary floating point it is 7.000000000000001)."""
        return min(numel, math.ceil(Fraction(str(self.sparse_fraction)) * numel))

    def wire_bytes(self, numel: int) -> int:
        return 4 * num_chunks(numel, self.chunk_size) + 8 * self.sparse_count(numel) + -(-numel // 4)

    def _encode(self, flat: torch.Tensor, name: str | None) -> torch.Tensor:
        n = flat.numel()
        if n > MAX_NUMEL:
            raise ValueError(f"2bit codec: {name or 'tensor'} has {n} elements; int32 indices reach {MAX_NUMEL}")
        k = self.sparse_count(n)
        n_chunks = num_chunks(n, self.chunk_size)
        padded_len = n_chunks * self.chunk_size

        padded = pad_to(flat, padded_len)
        magnitudes = padded.abs()  # a new tensor: the sparse entries are zeroed in it below
        indices = top_magnitude_indices(magnitudes[:n], k)
        values = flat[indices]
        if k and not bool(torch.isfinite(values).all()):
            raise NonFiniteGradient(name, self.name)
        counts = chunk_counts(n, self.chunk_size, flat.device)
        if k:
            magnitudes.index_fill_(0, indices, 0.0)
            counts -= torch.bincount(indices // self.chunk_size, minlength=n_chunks).to(counts.dtype)
        dense = magnitudes.view(n_chunks, self.chunk_size)
        scales = chunk_mean_abs(dense, counts, flat, name, self.name)

        n_code_bytes = -(-n // 4)
        outer = dense > (THRESHOLD * scales)[:, None]
        codes = (padded >= 0).view(torch.uint8) << 1
        codes |= outer.view(-1).view(torch.uint8)
        codes = codes[: 4 * n_code_bytes]  # chunk_size % 8 == 0: long enough
        codes[n:] = 0  # padding codes are zero

        payload = torch.empty(self.wire_bytes(n), dtype=torch.uint8, device=flat.device)
        at = 4 * n_chunks
        payload[:at].view(torch.float32).copy_(scales)
        payload[at: at + 4 * k].view(torch.int32).copy_(indices)
        payload[at + 4 * k: at + 8 * k].view(torch.float32).copy_(values)
        pack_bits(codes, 2, out=payload[at + 8 * k:])
        return payload

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        k = self.sparse_count(numel)
        n_chunks = num_chunks(numel, self.chunk_size)
        at = 4 * n_chunks
        scales = view_as_dtype(payload[:at], torch.float32)
        indices = view_as_dtype(payload[at: at + 4 * k], torch.int32)
        values = view_as_dtype(payload[at + 4 * k: at + 8 * k], torch.float32)
        packed = pad_to(payload[at + 8 * k:], n_chunks * self.chunk_size // 4)
        codes = unpack_bits(packed, 2).view(n_chunks, self.chunk_size)

        inner = (INNER * scales)[:, None]
        outer = (OUTER * scales).clamp(max=FLOAT32_MAX)[:, None]
        magnitude = torch.where((codes & 1).view(torch.bool), outer, inner)
        out = torch.where(codes >= 2, magnitude, -magnitude).view(-1)[:numel]
        if k:
            out[indices.long()] = values
        return out

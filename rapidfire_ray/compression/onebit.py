"""`1bit`: the sign of each element plus one float32 scale per chunk, as in 1-bit Adam.

Bits LSB-first, set for x >= 0 (an exact zero decodes to +scale). `scale`: "mean_abs"
(default, contractive) or "rms" (1-bit Adam's; its error-feedback residual settles under a
persistent bias). Why and the measurements: docs/compression.md.

Payload: n_chunks float32 scales, then ceil(n / 8) bytes of sign bits (unused bits zero).
Size: 4 * ceil(n / chunk_size) + ceil(n / 8) bytes: 31.5x fewer than float32 at 2048.
NaN/inf input raises NonFiniteGradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .codec import (
    Codec,
    check_chunk_size,
    chunk_counts,
    chunk_mean_abs,
    chunk_rms,
    num_chunks,
    pack_bits,
    pad_to,
    unpack_bits,
    view_as_dtype,
)

SCALES = {"mean_abs": chunk_mean_abs, "rms": chunk_rms}


@dataclass(frozen=True)
class OneBitCodec(Codec):
    chunk_size: int = 2048
    scale: str = "mean_abs"

    name: ClassVar[str] = "1bit"

    def __post_init__(self):
        check_chunk_size(self.chunk_size, self.name)
        if self.scale not in SCALES:
            raise ValueError(f"1bit codec: scale must be one of {', '.join(SCALES)}, got {self.scale!r}")

    def wire_bytes(self, numel: int) -> int:
        return 4 * num_chunks(numel, self.chunk_size) + -(-numel // 8)

    def _encode(self, flat: torch.Tensor, name: str | None) -> torch.Tensor:
        n = flat.numel()
        n_chunks = num_chunks(n, self.chunk_size)
        chunks = pad_to(flat, n_chunks * self.chunk_size).view(n_chunks, self.chunk_size)
        counts = chunk_counts(n, self.chunk_size, flat.device)
        scales = SCALES[self.scale](chunks, counts, flat, name, self.name)

        payload = torch.empty(self.wire_bytes(n), dtype=torch.uint8, device=flat.device)
        payload[: 4 * n_chunks].view(torch.float32).copy_(scales)
        n_sign_bytes = -(-n // 8)
        signs = chunks.view(-1)[: 8 * n_sign_bytes] >= 0  # chunk_size % 8 == 0: long enough
        signs[n:] = False  # padding bits are zero
        pack_bits(signs, 1, out=payload[4 * n_chunks:])
        return payload

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        n_chunks = num_chunks(numel, self.chunk_size)
        scales = view_as_dtype(payload[: 4 * n_chunks], torch.float32)[:, None]
        packed = pad_to(payload[4 * n_chunks:], n_chunks * self.chunk_size // 8)
        positive = unpack_bits(packed, 1).view(torch.bool).view(n_chunks, self.chunk_size)
        return torch.where(positive, scales, -scales).view(-1)[:numel]

"""`fp16`: IEEE half precision, 2 bytes per element, as torch's `fp16_compress_hook` sends.

Kept for the tensors that the per-layer policy does not trust to 1- or 2-bit codes (attention
output projections, norms, biases, small tensors). Values beyond the fp16 range are clamped to
+-65504 instead of becoming inf: an inf would turn the averaged gradient into inf or NaN on
every worker, while a clamped value is a bounded error that error feedback carries to the next
step. Values below the fp16 subnormal range round to zero (likewise carried by error feedback).
NaN/inf input raises NonFiniteGradient."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .codec import Codec, raise_if_nonfinite, view_as_dtype

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@dataclass(frozen=True)
class Fp16Codec(Codec):
    name: ClassVar[str] = "fp16"

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def _encode(self, flat: torch.Tensor, name: str | None) -> torch.Tensor:
        # A signed sum is finite only if every term is (or finite terms overflowed: then look).
        if not bool(torch.isfinite(flat.sum())):
            raise_if_nonfinite(flat, name, self.name)
        half = flat.to(torch.float16)
        # The input is finite, so any inf here is an out-of-range value: clamping after the cast
        # equals clamping before it (everything >= 65520 rounds to inf, the rest to <= 65504).
        half.clamp_(-FP16_MAX, FP16_MAX)
        return half.view(torch.uint8)

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return view_as_dtype(payload, torch.float16).to(torch.float32)

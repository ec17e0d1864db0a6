"""`none`: float32 gradients as they are, 4 bytes per element.

The baseline every other codec is measured against, and the codec for tensors that must not be
approximated. It is lossless, so error feedback keeps no residual for it, and it passes NaN/inf
through untouched: its output is what a plain allreduce would send, and non-finite gradients
are the caller's to detect and skip, as they are without compression."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .codec import Codec, view_as_dtype


@dataclass(frozen=True)
class NoneCodec(Codec):
    name: ClassVar[str] = "none"
    lossless: ClassVar[bool] = True

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def _encode(self, flat: torch.Tensor, name: str | None) -> torch.Tensor:
        # A copy, so that the payload never aliases the gradient it came from.
        return flat.clone().view(torch.uint8)

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return view_as_dtype(payload, torch.float32).clone()

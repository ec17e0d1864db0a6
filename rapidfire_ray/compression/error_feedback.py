"""Error feedback: what a lossy codec failed to send this step is added to the next step's
tensor, so nothing is lost, only delayed.

One float32 residual per tensor name on the tensor's device; `state_dict()` /
`load_state_dict()` save and restore them with a checkpoint. Why it keeps convergence and the
per-step identity: docs/compression.md.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch

from .codec import Codec, Encoded

STATE_FORMAT = "rapidfire_ray.compression.error_feedback/1"

DeviceLike = torch.device | str | int


class ErrorFeedback:
    """Per-tensor residual buffers and the compress-with-feedback step."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, tensor: torch.Tensor, codec: Codec) -> Encoded:
        """Encode `tensor` plus its stored residual with `codec` and keep the new residual.

        NaN/inf raise NonFiniteGradient naming `name` (for every codec but "none") and leave the
        stored residual as it was, so a skipped step changes nothing. A lossless codec sends the
        residual in full, so none is kept for it (a residual left by a lossy codec that this
        tensor used before is sent now)."""
        residual = self._residuals.get(name)
        if residual is None:
            corrected = tensor.detach()  # the caller's tensor: never written to
        else:
            if residual.shape != tensor.shape:
                raise ValueError(f"error feedback: residual for {name!r} has shape {tuple(residual.shape)}, "
                                 f"the tensor has {tuple(tensor.shape)} (two tensors under one name?)")
            if residual.device != tensor.device:
                residual = residual.to(tensor.device)
            corrected = tensor.detach().to(torch.float32) + residual  # a new tensor, ours
        encoded = codec.encode(corrected, name=name)
        if codec.lossless:
            self._residuals.pop(name, None)
        elif residual is None:
            self._residuals[name] = corrected.to(torch.float32) - codec.decode(encoded)
        else:
            # Reuse our own buffer for the new residual: one full-size allocation less per step.
            self._residuals[name] = corrected.sub_(codec.decode(encoded))
        # The corrected tensor is float32 once a residual exists; report the gradient's own dtype.
        return replace(encoded, dtype=tensor.dtype)

    def residual(self, name: str) -> torch.Tensor | None:
        """The stored residual for `name` (float32, the tensor's shape), or None."""
        return self._residuals.get(name)

    def names(self) -> list[str]:
        return list(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)

    def __contains__(self, name: object) -> bool:
        return name in self._residuals

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Drop all residuals, or those of `names` (e.g. after a parameter changes codec or
        shape, or when a run deliberately restarts compression from scratch)."""
        if names is None:
            self._residuals.clear()
        else:
            for name in names:
                self._residuals.pop(name, None)

    def state_dict(self) -> dict:
        """Residuals copied to CPU (a checkpoint must not hold device memory or alias live
        buffers), under a format tag that `load_state_dict` checks."""
        return {"format": STATE_FORMAT,
                "residuals": {name: r.detach().to("cpu", copy=True) for name, r in self._residuals.items()}}

    def load_state_dict(self, state: Mapping,
                        device: DeviceLike | Mapping[str, DeviceLike] | None = None) -> None:
        """Replace all residuals with those in `state`.

        `device` places them: one device for all, or a mapping name -> device (e.g. each
        parameter's device). Residuals without a given device stay on CPU and move to the
        gradient's device the first time that tensor is compressed, and stay there."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"error feedback: not an ErrorFeedback state dict (format {found!r}, "
                             f"expected {STATE_FORMAT!r})")
        residuals = state.get("residuals")
        if not isinstance(residuals, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in residuals.items()):
            raise ValueError("error feedback: state['residuals'] must map names to tensors")
        loaded = {}
        for name, r in residuals.items():
            target = device.get(name) if isinstance(device, Mapping) else device
            loaded[name] = r.detach().to(device=target if target is not None else r.device,
                                         dtype=torch.float32, copy=True)
        self._residuals = loaded

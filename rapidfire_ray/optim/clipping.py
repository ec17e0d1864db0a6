"""Global-norm gradient clipping for `RapidfireAdamW`, whose ranks in the compressed stage
each hold only their local gradient: `GlobalNormClipping.clip_grad_norm_` clips the averaged
gradient exactly in the warm-up and against an estimate of its norm afterwards (the ratio rho
measured in the warm-up). Why and how: docs/optim.md, "Gradient clipping"."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .control import comm_device

#: Weight of the running mean of (||averaged gradient|| / RMS of local gradient norms)^2 over the warm-up.
NORM_RATIO_BETA = 0.9


class GlobalNormClipping:
    """Mixin of `RapidfireAdamW`: the clip and the norm ratio it measures. Uses the optimizer's
    `world()`, `in_compressed_stage`, `_count_control()` and the attributes `_local_grad_sq`,
    `_norm_ratio_sq`, `_norm_ratio_samples` (set in its __init__, saved in its state dict)."""

    @property
    def grad_norm_ratio(self) -> float:
        """rho: ||averaged gradient|| / sqrt(mean over ranks of ||local gradient||^2), measured
        in the warm-up (bias-corrected running mean of rho^2, square-rooted); 1.0 unmeasured."""
        if not self._norm_ratio_samples:
            return 1.0
        return (self._norm_ratio_sq / (1 - NORM_RATIO_BETA**self._norm_ratio_samples)) ** 0.5

    def note_local_grads(self, flat: torch.Tensor) -> None:
        """Add this rank's local (not yet averaged) gradient elements to the step's local norm;
        `local_gradient_hook` calls it for each bucket in the warm-up."""
        sq = torch.linalg.vector_norm(flat, dtype=torch.float32).square()
        self._local_grad_sq = sq if self._local_grad_sq is None else self._local_grad_sq + sq.to(self._local_grad_sq)

    @torch.no_grad()
    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clip the gradients of `parameters` for the next step() (docs/optim.md, Gradient clipping);
        returns the norm clipped against: the averaged gradients' in the warm-up (exactly
        torch.nn.utils.clip_grad_norm_), the estimate of it in the compressed stage."""
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params]
        group, world = self.world()
        # every rank takes part in the all_reduces below, even one without a gradient
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.tensor(0.0)
        if not self.in_compressed_stage:
            if world > 1 and self._local_grad_sq is not None:
                self._sample_norm_ratio(local, group, world)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, local)
            return local
        sq = local.detach().to(torch.float32).square().reshape(1)
        if world > 1:
            sq = sq.to(comm_device(group))
            dist.all_reduce(sq, group=group)
            self._count_control(sq)
        estimate = self.grad_norm_ratio * (sq.cpu()[0] / world).sqrt()
        if torch.isfinite(estimate):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, estimate.to(local.device))
        return estimate

    def _sample_norm_ratio(self, averaged_norm: torch.Tensor, group, world: int) -> None:
        local_sq = self._local_grad_sq.detach().to(comm_device(group), torch.float32).reshape(1)
        self._local_grad_sq = None
        dist.all_reduce(local_sq, group=group)
        self._count_control(local_sq)
        rms_local = float((local_sq.cpu()[0] / world).sqrt())
        averaged = float(averaged_norm)
        if rms_local > 0 and averaged == averaged and abs(averaged) != float("inf") and rms_local != float("inf"):
            rho = min(averaged / rms_local, 1.0)  # <= 1 up to rounding (the norm of a mean)
            self._norm_ratio_sq = NORM_RATIO_BETA * self._norm_ratio_sq + (1 - NORM_RATIO_BETA) * rho * rho
            self._norm_ratio_samples += 1

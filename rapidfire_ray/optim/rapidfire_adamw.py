"""`RapidfireAdamW`: AdamW whose momentum, not the gradient, crosses the wire in 1 bit per
element after a full-precision warm-up. The project's 1-bit Adam (Tang et al., arXiv
2102.02888); DeepSpeed 0.19.8 dropped its 1-bit optimizers, which were CUDA-only. This one runs
on gloo and NCCL with the same code.

Two stages, decided by the number of optimizer steps applied so far (t):

- Warm-up, steps 1..freeze_step: exactly torch.optim.AdamW (bias correction, decoupled weight
  decay, the same operations in the same order), on gradients the caller already averaged in
  full precision (plain DDP allreduce; `local_gradient_hook` does that during warm-up).
- Compressed, steps > freeze_step: the second moment v is frozen at its last warm-up value and
  with it v's bias correction 1 - beta2**t_freeze, so the preconditioner sqrt(v_hat) + eps is
  the one the last warm-up step used. Each rank updates the momentum from its LOCAL gradient,
  m_local = lerp(m, g_local, 1 - beta1), and the ranks average m_local / denom (denom =
  sqrt(v_hat) + eps, frozen: the same on every rank) with `compressed_allreduce` (1-bit Adam's
  two-phase exchange with worker and server error feedback): one flat float32 buffer per (param
  group, device), each with its own `AllreduceState`. Sending the preconditioned momentum rather
  than m itself puts the codec's per-chunk error where the update is: a chunk's elements all come
  back at one magnitude, and for m that magnitude is then divided by each element's own denom,
  which blows up small-variance elements' error; for m / denom it is the update's own scale
  (measured in issue 4's note). Averaging is linear, so the average times denom is the averaged
  momentum, which becomes every rank's m, then
      p -= lr * (m / (1 - beta1**t) / (sqrt(v) / sqrt(1 - beta2**t_freeze) + eps) + weight_decay * p)
  (decay applied first, as AdamW: p *= 1 - lr * weight_decay). m's bias correction is the
  one AdamW would use at step t: m is still the same zero-started running average of
  gradients, only averaged after instead of before; by the usual freeze steps it is ~1.
  DDP exchanges nothing in this stage (`local_gradient_hook` returns the local gradient), so
  the only gradient-sized traffic is the compressed momentum.

Update bound. In the compressed stage every element of a chunk carries the chunk's scale, so
an element whose frozen variance is tiny but not zero (an embedding row of a token seen once in
the warm-up) gets m / sqrt(v) far above anything Adam would produce (Adam's per-element ratio
|m_hat| / sqrt(v_hat) stays around 1 or below for beta1^2 <= beta2). Without a bound, SFT of
smollm2-135m with a 8-step warm-up diverged (loss 0.86 -> 291 two steps after the freeze;
bench/convergence.py). The update m_hat / (sqrt(v_hat) + eps) is therefore clamped elementwise
to [-max_update, max_update] (default 1.0; None turns it off) in the compressed stage only;
the warm-up stays exactly AdamW. Deterministic in (m, v), so all ranks stay identical.

Zero-variance mask. An element whose frozen v is exactly 0 received an exact-zero gradient in
every warm-up step (an embedding row of a token not seen yet, a padding row). 1-bit codes
cannot send 0 (a sign of 0 counts as +1), so its momentum would come back as +-scale, and
divided by sqrt(0) + eps that is a step of ~lr * scale / eps. Like 1-bit Adam's mask, such
elements are zeroed in the local momentum before the exchange and in the averaged momentum
after it: they keep zero momentum and move by weight decay only for the rest of the run. The
mask is `v == 0`, the same on every rank (v comes from averaged gradients), so it needs no
state and no communication.

Parameters without a gradient. Every rank must put the same elements in the same places of
each flat buffer, and error feedback needs the layout to stay put from step to step: a buffer
always holds all parameters of its group on its device, in group order. Whether a parameter
takes part in a step is agreed: it does if it has a gradient on at least one rank (a rank
without one contributes a zero gradient, exactly what the averaged gradient would contain);
one with no gradient on any rank is skipped everywhere as AdamW skips it (its slot is sent as
zeros and its state, step count included, is left alone). During warm-up the caller's
averaged gradients are the same on every rank, so no agreement is needed.

Non-finite gradients. In the compressed stage a NaN/inf local gradient would be encoded into
every rank's momentum (and into error feedback for good). Before the exchange the ranks do one
small all_reduce(MAX) of [any non-finite gradient here, which parameters have a gradient
here] (uint8, counted in `stats` as control bytes). If any rank found one, every rank skips the
step entirely: no state changes, the step is not counted, `skipped_steps` goes up by one and
`nonfinite` lists the parameter names that were non-finite on this rank ([] on the others).
The warm-up does what AdamW does (no check): its gradients are the caller's averaged ones.

Gradient clipping. Clipping the averaged gradient to a global norm (what a trainer's
`max_grad_norm` does with AdamW) cannot be done as such in the compressed stage: no rank sees
the averaged gradient, and clipping each rank's local gradient by its own norm shortens the
step whenever clipping is active (two clipped local gradients with cosine c average to a norm
of sqrt((1 + c) / 2) of the limit; with c ~ 0.4-0.5, measured between two ranks' SFT gradients
of smollm2-135m, ~15% short). `clip_grad_norm_(parameters, max_norm)` (what the trainer seam
calls instead of torch's) therefore: in the warm-up clips the averaged gradients exactly as
`torch.nn.utils.clip_grad_norm_` and measures rho = ||averaged gradient|| / sqrt(mean over ranks
of ||local gradient||^2) (the local norms are taken by `local_gradient_hook` before it
averages; one float all_reduce), kept as a bias-corrected running mean of rho^2 with weight
`NORM_RATIO_BETA`; in the compressed stage it estimates the averaged gradient's norm as
rho * sqrt(mean of the ranks' local ||g||^2) (one float all_reduce) and scales every rank's
local gradient by the same min(1, max_norm / (estimate + 1e-6)). rho is frozen with the
variance (it moves with the gradients' signal-to-noise ratio) and saved in the checkpoint;
without a measurement (world of 1, or gradients averaged by other means than the hook) it is 1.
A non-finite estimate leaves the gradients alone: the step's own check then skips the step and
names the parameters.

Checkpoints. `state_dict()` is torch's (per-parameter step, exp_avg, exp_avg_sq as AdamW names
them, plus `variance_step`, the step at which v froze) with one more key, "rapidfire_adamw":
steps applied, the frozen flag, skipped steps and `allreduce_state_dict()`, the calling rank's
error-feedback buffers (CPU copies, tagged with rank and world size). Only plain types and
tensors, so `torch.load(..., weights_only=True)` reads it (as transformers' Trainer reads
optimizer.pt). Everything but the error feedback is the same on every rank; the error
feedback is per rank, and the Trainer saves rank 0's optimizer only. So: a state dict loads
its error feedback only on the rank (and world size) that saved it; elsewhere that starts from
zero (what the reference does on every load: a one-off perturbation of one step's compression
error), unless the rank's own `allreduce_state_dict()`, saved per rank beside the checkpoint,
is loaded with `load_allreduce_state_dict()` (before or after, either order). With it a resumed
run continues exactly as an uninterrupted one. A plain torch AdamW state dict loads too
(warm-up continues from its step count).

With a trainer. In the compressed stage each rank's .grad is its own: clip with
`clip_grad_norm_` (the project's trainers do, stages/base.py), not torch's, which would clip
each rank by its own norm; the grad norm it returns (and the trainer logs) is the estimate of
the averaged gradient's. Loss scaling with
torch.amp.GradScaler must not be used: it skips optimizer.step() on ranks whose LOCAL gradient
overflowed, so ranks would disagree on calling the exchange (bf16 or fp32 need no scaler).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ..exchange.allreduce import AllreduceState, compressed_allreduce, layout
from ..exchange.stats import CommStats, fp32_allreduce_bytes
from ..compression import Codec, get_codec

STATE_KEY = "rapidfire_adamw"
#: Weight of the running mean of (||averaged gradient|| / RMS of local gradient norms)^2 over the warm-up.
NORM_RATIO_BETA = 0.9
STATE_FORMAT = "rapidfire_ray.optim.rapidfire_adamw/1"
ALLREDUCE_FORMAT = "rapidfire_ray.optim.rapidfire_adamw.allreduce/1"


def default_freeze_step(total_steps: int) -> int:
    """Warm-up length for a run of `total_steps` optimizer steps: 20% of the run (1-bit Adam
    suggests 15-25%: the variance must have settled before it is frozen), at least 1 (the
    compressed stage needs a variance to precondition with)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
        raise ValueError(f"total_steps must be a non-negative int, got {total_steps!r}")
    return max(1, total_steps // 5)


def frozen_denom(exp_avg_sq: torch.Tensor, variance_step: int, beta2: float, eps: float) -> torch.Tensor:
    """Adam's preconditioner sqrt(v_hat) + eps for a variance frozen after `variance_step` steps
    (its bias correction frozen with it). Also what a parameter shard hands its workers."""
    bias_correction2 = 1 - beta2**variance_step if variance_step > 0 else 1.0  # v == 0 there: masked
    return (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)


def _codec(name: str | Codec, chunk_size: int) -> Codec:
    if isinstance(name, Codec):
        return name
    if name == "1bit":
        # RMS scale (1-bit Adam's): momentum is a persistent bias, where it keeps the
        # error-feedback residual small (see compression/onebit.py).
        return get_codec("1bit", chunk_size=chunk_size, scale="rms")
    if name == "2bit":
        return get_codec("2bit", chunk_size=chunk_size)
    return get_codec(name)


class RapidfireAdamW(torch.optim.Optimizer):
    """AdamW for `freeze_step` steps, then 1-bit Adam's compressed momentum exchange.

    params: parameters or param groups (named parameters give `nonfinite` real names).
    lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled decay), per group.
    freeze_step: warm-up steps (>= 1); `default_freeze_step(total_steps)` gives 20% of a run.
    codec: "1bit" (default), "2bit", "fp16", "none" (or a Codec); chunk_size: elements per
        scale of 1bit/2bit.
    group: the process group (None: the default group when torch.distributed is initialised,
        else a world of 1: compress and decompress with error feedback, no communication).
    stats: a CommStats that counts the bytes this optimizer and its hook send.

    Per step, read `in_compressed_stage`, `skipped_steps`, `nonfinite` and `stats.take()`."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, freeze_step: int, codec: str | Codec = "1bit",
                 chunk_size: int = 2048, group: dist.ProcessGroup | None = None,
                 stats: CommStats | None = None, max_update: float | None = 1.0):
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}; both must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step must be an int >= 1 (the compressed stage needs a warm-up variance), "
                             f"got {freeze_step!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        if max_update is not None and not max_update > 0:
            raise ValueError(f"max_update must be > 0 or None, got {max_update!r}")
        self.max_update = max_update
        self.codec = _codec(codec, chunk_size)
        self.group = group
        self.stats = stats
        #: Steps applied (skipped ones not counted); decides the stage.
        self.steps = 0
        #: Compressed steps skipped because some rank had a non-finite gradient.
        self.skipped_steps = 0
        #: Parameter names with a non-finite gradient on this rank in the last step() ([] otherwise).
        self.nonfinite: list[str] = []
        self._frozen = False
        self._allreduce_states: dict[str, AllreduceState] = {}
        self._own_allreduce_loaded = False
        #: Sum of this rank's local squared gradient norms, from `local_gradient_hook` (warm-up).
        self._local_grad_sq: torch.Tensor | None = None
        self._norm_ratio_sq = 0.0  # running mean of rho^2 (not bias-corrected)
        self._norm_ratio_samples = 0

    # --- stage ------------------------------------------------------------------------------

    @property
    def in_compressed_stage(self) -> bool:
        """True when the next step() is a compressed one (steps applied >= freeze_step), and
        from then on. The DDP hook asks during the backward of that step."""
        return self._frozen or self.steps >= self.freeze_step

    def world(self) -> tuple[dist.ProcessGroup | None, int]:
        """(process group, its size); (None, 1) when torch.distributed is not initialised."""
        if self.group is not None:
            return self.group, dist.get_world_size(self.group)
        if dist.is_available() and dist.is_initialized():
            return None, dist.get_world_size()
        return None, 1

    # --- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One optimizer step: AdamW on the (averaged) gradients in warm-up; in the compressed
        stage, the agreement all_reduce, then one compressed allreduce per (group, device).
        Every rank of the group must call it, in the same stage."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.nonfinite = []
        self._local_grad_sq = None  # measured for this step's clip (or unused)
        if self.in_compressed_stage:
            if not self._compressed_step():
                return loss
            self._frozen = True
        else:
            self._warmup_step()
        self.steps += 1
        return loss

    # --- gradient clipping ------------------------------------------------------------------

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
        """Clip the gradients of `parameters` for the next step() (see the module docstring);
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
            sq = sq.to(_comm_device(group))
            dist.all_reduce(sq, group=group)
            self._count_control(sq)
        estimate = self.grad_norm_ratio * (sq.cpu()[0] / world).sqrt()
        if torch.isfinite(estimate):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, estimate.to(local.device))
        return estimate

    def _sample_norm_ratio(self, averaged_norm: torch.Tensor, group, world: int) -> None:
        local_sq = self._local_grad_sq.detach().to(_comm_device(group), torch.float32).reshape(1)
        self._local_grad_sq = None
        dist.all_reduce(local_sq, group=group)
        self._count_control(local_sq)
        rms_local = float((local_sq.cpu()[0] / world).sqrt())
        averaged = float(averaged_norm)
        if rms_local > 0 and averaged == averaged and abs(averaged) != float("inf") and rms_local != float("inf"):
            rho = min(averaged / rms_local, 1.0)  # <= 1 up to rounding (the norm of a mean)
            self._norm_ratio_sq = NORM_RATIO_BETA * self._norm_ratio_sq + (1 - NORM_RATIO_BETA) * rho * rho
            self._norm_ratio_samples += 1

    def _count_control(self, t: torch.Tensor) -> None:
        if self.stats is not None:
            _, world = self.world()
            control = 2.0 * (world - 1) * t.numel() * t.element_size() / world
            self.stats.add_bytes(control, control, 0.0)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _warmup_step(self) -> None:
        # torch.optim.AdamW's single-tensor path, operation for operation.
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("RapidfireAdamW does not support sparse gradients")
                grad = p.grad
                state = self._state(p)
                exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                step_t += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

    def _buckets(self) -> list[tuple[str, int, torch.device, list[int]]]:
        """(key, group index, device, indices into the flat parameter list) per (group,
        device), in a fixed order: the flat-buffer layout every rank shares."""
        out, flat_index = [], 0
        for g, group in enumerate(self.param_groups):
            by_device: dict[torch.device, list[int]] = {}
            for p in group["params"]:
                by_device.setdefault(p.device, []).append(flat_index)
                flat_index += 1
            out.extend((f"{g}.{k}", g, device, idx) for k, (device, idx) in enumerate(by_device.items()))
        return out

    def _names(self) -> list[str]:
        names = []
        for g, group in enumerate(self.param_groups):
            given = group.get("param_names")
            names.extend(given if given else (f"param_groups[{g}][{i}]" for i in range(len(group["params"]))))
        return names

    def _agree(self, params: list[torch.Tensor]) -> tuple[bool, list[bool], list[int]]:
        """One all_reduce(MAX) of [non-finite anywhere here, has-gradient per parameter]:
        (some rank has a non-finite gradient, which parameters take part, local non-finite indices)."""
        group, world = self.world()
        present = [p.grad is not None for p in params]
        checks = [(i, torch.linalg.vector_norm(p.grad, float("inf")))
                  for i, p in enumerate(params) if present[i] and p.grad.numel()]
        device = _comm_device(group) if world > 1 else torch.device("cpu")
        flags = torch.tensor([0, *present], dtype=torch.uint8, device=device)
        if checks:
            bad = ~torch.isfinite(torch.stack([norm.to(device, torch.float32) for _, norm in checks]))
            flags[0] = bad.any()
        if world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            self._count_control(flags)
        flags = flags.cpu()
        local_bad = []
        if checks and bool(bad.any()):
            local_bad = [i for (i, _), b in zip(checks, bad.cpu().tolist()) if b]
        return bool(flags[0]), [bool(f) for f in flags[1:]], local_bad

    def _compressed_step(self) -> bool:
        """One compressed step; False (and nothing changed) when it was skipped."""
        group, world = self.world()
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError("RapidfireAdamW does not support sparse gradients")
        any_bad, takes_part, local_bad = self._agree(params)
        if any_bad:
            names = self._names()
            self.nonfinite = [names[i] for i in local_bad]
            self.skipped_steps += 1
            return False

        for key, g, device, indices in self._buckets():
            if not any(takes_part[i] for i in indices):
                continue
            hp = self.param_groups[g]
            lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
            members = [params[i] for i in indices]
            sizes = [p.numel() for p in members]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
            denoms = {}
            for i, p, out in zip(indices, members, flat.split(sizes)):
                if not takes_part[i]:
                    continue  # sent as zeros; its state stays as it is
                state = self._state(p)
                state.setdefault("variance_step", int(state["step"].item()))
                m = state["exp_avg"].reshape(-1).to(torch.float32)
                if p.grad is not None:
                    torch.lerp(m, p.grad.reshape(-1).to(torch.float32), 1 - beta1, out=out)
                else:  # no gradient on this rank: it contributes a zero gradient
                    torch.lerp(m, m.new_zeros(()).expand_as(m), 1 - beta1, out=out)
                out.masked_fill_((state["exp_avg_sq"] == 0).reshape(-1), 0.0)
                denoms[i] = frozen_denom(state["exp_avg_sq"], state["variance_step"], beta2, eps)
                out.div_(denoms[i].reshape(-1))  # the codec sees m / denom
            ar_state = self._allreduce_state(key, device, flat.numel(), world)
            averaged = compressed_allreduce(flat, self.codec, ar_state, group=group, stats=self.stats)
            for i, p, avg in zip(indices, members, averaged.reshape(-1).split(sizes)):
                if takes_part[i]:
                    self._apply(p, avg.view(p.shape) * denoms[i], denoms[i], lr, beta1, wd)
        return True

    def _apply(self, p: torch.Tensor, averaged: torch.Tensor, denom: torch.Tensor, lr: float, beta1: float,
               wd: float) -> None:
        state = self.state[p]
        exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        exp_avg.copy_(averaged.view(p.shape))
        exp_avg.masked_fill_(exp_avg_sq == 0, 0.0)
        step_t += 1
        if wd != 0:
            p.mul_(1 - lr * wd)
        bias_correction1 = 1 - beta1**step_t.item()
        if self.max_update is None:
            p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        else:  # the per-element trust bound of the compressed stage (see the module docstring)
            update = (exp_avg / bias_correction1).div_(denom).clamp_(-self.max_update, self.max_update)
            p.add_(update, alpha=-lr)

    def _allreduce_state(self, key: str, device: torch.device, numel: int, world: int) -> AllreduceState:
        state = self._allreduce_states.get(key)
        if state is None:
            state = self._allreduce_states[key] = AllreduceState()
        m, padded = layout(numel, world)
        if ((state.worker_error is not None and state.worker_error.numel() != padded)
                or (state.server_error is not None and state.server_error.numel() != m)):
            # Another world size (an elastic restart) or another parameter set: the buffers
            # cannot be reused; start error feedback afresh, as the reference does on every load.
            warnings.warn(f"RapidfireAdamW: error-feedback buffers of slot {key} do not fit {numel} elements "
                          f"over {world} ranks; starting them from zero", stacklevel=3)
            state.reset()
        for attr in ("worker_error", "server_error"):
            buf = getattr(state, attr)
            if buf is not None and buf.device != device:
                setattr(state, attr, buf.to(device))
        return state

    # --- checkpoints ------------------------------------------------------------------------

    def rank(self) -> int:
        group, world = self.world()
        return dist.get_rank(group) if world > 1 else 0

    def allreduce_state_dict(self) -> dict:
        """This rank's error-feedback buffers (CPU copies), tagged with the rank and world size.
        They differ between ranks; `state_dict()` embeds the calling rank's. Save this on every
        rank when only one rank saves `state_dict()` (transformers' Trainer: rank 0)."""
        _, world = self.world()
        return {"format": ALLREDUCE_FORMAT, "rank": self.rank(), "world_size": world,
                "states": {key: s.state_dict() for key, s in self._allreduce_states.items()}}  # CPU copies

    def load_allreduce_state_dict(self, state: Mapping) -> None:
        """Restore this rank's error-feedback buffers saved by `allreduce_state_dict()` on the
        same rank. Before or after `load_state_dict()`, either order: a state dict saved by
        another rank does not replace what this loads."""
        if not isinstance(state, Mapping) or state.get("format") != ALLREDUCE_FORMAT:
            raise ValueError(f"RapidfireAdamW: not an allreduce_state_dict() (format "
                             f"{state.get('format') if isinstance(state, Mapping) else type(state).__name__!r})")
        if state["rank"] != self.rank():
            raise ValueError(f"RapidfireAdamW: error-feedback state of rank {state['rank']} loaded on rank "
                             f"{self.rank()}; load each rank's own file")
        self._set_allreduce_states(state["states"])
        self._own_allreduce_loaded = True

    def _set_allreduce_states(self, saved: Mapping) -> None:
        devices = {key: device for key, _, device, _ in self._buckets()}
        self._allreduce_states = {}
        for key, d in saved.items():
            state = AllreduceState()
            state.load_state_dict(d)
            if key in devices:  # move them now: the first step should not pay for it
                for attr in ("worker_error", "server_error"):
                    buf = getattr(state, attr)
                    if buf is not None:
                        setattr(state, attr, buf.to(devices[key]))
            self._allreduce_states[key] = state

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd[STATE_KEY] = {"format": STATE_FORMAT, "steps": self.steps, "frozen": self._frozen,
                         "skipped_steps": self.skipped_steps, "freeze_step": self.freeze_step,
                         "codec": self.codec.name, "allreduce": self.allreduce_state_dict(),
                         "grad_norm_ratio_sq": self._norm_ratio_sq, "grad_norm_ratio_samples": self._norm_ratio_samples}
        return sd

    def load_state_dict(self, state_dict: Mapping) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        super().load_state_dict(state_dict)
        own_loaded, self._own_allreduce_loaded = self._own_allreduce_loaded, False
        if ours is None:  # a plain torch AdamW state: continue its warm-up
            steps = [int(s["step"]) for s in self.state.values() if "step" in s]
            self.steps, self._frozen, self.skipped_steps = max(steps, default=0), False, 0
            self._allreduce_states = {}
            self._norm_ratio_sq, self._norm_ratio_samples = 0.0, 0
            return
        if not isinstance(ours, Mapping) or ours.get("format") != STATE_FORMAT:
            found = ours.get("format") if isinstance(ours, Mapping) else type(ours).__name__
            raise ValueError(f"RapidfireAdamW: state_dict[{STATE_KEY!r}] has format {found!r}, "
                             f"expected {STATE_FORMAT!r}")
        self.steps = int(ours["steps"])
        self._frozen = bool(ours["frozen"])
        self.skipped_steps = int(ours["skipped_steps"])
        # absent in checkpoints written before clipping was estimated: unmeasured (rho = 1)
        self._norm_ratio_sq = float(ours.get("grad_norm_ratio_sq", 0.0))
        self._norm_ratio_samples = int(ours.get("grad_norm_ratio_samples", 0))
        saved = ours["allreduce"]
        _, world = self.world()
        if saved["rank"] == self.rank() and saved["world_size"] == world:
            self._set_allreduce_states(saved["states"])
        elif not own_loaded:
            # Another rank's buffers (the Trainer saves rank 0's optimizer only) would feed that
            # rank's residuals into this rank's exchange: start from zero instead, as the
            # reference does, unless load_allreduce_state_dict() brought this rank's own.
            self._allreduce_states = {}


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small control tensor must live for this group's backend."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _unwrap(optimizer) -> RapidfireAdamW:
    # accelerate's AcceleratedOptimizer (what Trainer.optimizer is after prepare) wraps ours.
    while not isinstance(optimizer, RapidfireAdamW) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, RapidfireAdamW):
        raise TypeError(f"local_gradient_hook needs a RapidfireAdamW as its state, got {type(optimizer).__name__}")
    return optimizer


def local_gradient_hook(optimizer, bucket):  # no annotations: DDP rejects string ones (postponed evaluation)
    """DDP communication hook for RapidfireAdamW:
    `ddp_model.register_comm_hook(optimizer, local_gradient_hook)`.

    It runs during the backward of step t + 1, t = optimizer steps applied so far. Warm-up
    (t + 1 <= freeze_step): the plain averaging allreduce, as DDP's default. Compressed stage
    (t + 1 > freeze_step, `optimizer.in_compressed_stage`): no communication at all; the bucket
    comes back as this rank's local gradient, because the optimizer exchanges momentum instead.
    Use the optimizer's process group for DDP too. `optimizer`: the RapidfireAdamW (or a
    wrapper with `.optimizer`, such as accelerate's); `bucket`: a dist.GradBucket; returns a
    torch.futures.Future[torch.Tensor]."""
    optimizer = _unwrap(optimizer)
    buffer = bucket.buffer()
    if optimizer.in_compressed_stage:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    group, world = optimizer.world()
    optimizer.note_local_grads(buffer)  # before averaging: the clip's norm ratio (module docstring)
    stats = optimizer.stats
    start = time.perf_counter()
    if stats is not None:
        wire = 2.0 * (world - 1) * buffer.numel() * buffer.element_size() / world if world > 1 else 0.0
        stats.add_bytes(wire, wire, fp32_allreduce_bytes(buffer.numel(), world))
    buffer.div_(world)
    work = dist.all_reduce(buffer, group=group, async_op=True)

    def done(f):
        if stats is not None:
            stats.add_call(time.perf_counter() - start)
        return f.value()[0]

    return work.get_future().then(done)


"""`RapidfireAdamW`: AdamW whose momentum, not the gradient, crosses the wire in 1 bit per
element after a full-precision warm-up (1-bit Adam, Tang et al., arXiv 2102.02888), on gloo and
NCCL. Warm-up: exactly torch.optim.AdamW on averaged gradients; then the variance freezes and
the ranks average their preconditioned local momentum with `compressed_allreduce`.

The derivation, the update bound, the zero-variance mask, non-finite gradients and how it is
used with a trainer: docs/optim.md. Clipping: clipping.py; checkpoints: state_dict.py; the DDP
hook: ddp_hook.py.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..exchange.allreduce import AllreduceState, compressed_allreduce, layout
from ..exchange.stats import CommStats
from ..compression import Codec, get_codec
from .clipping import GlobalNormClipping
from .control import comm_device
from .state_dict import AdamWStateDict


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


class _StepBuffers:
    """One bucket's compressed-stage buffers, kept from step to step: `flat` (the preconditioned
    momentum sent, then the average received, then the float32 parameters' updates), and per
    parameter the frozen preconditioner frozen_denom(exp_avg_sq) with its zero-variance mask
    (exp_avg_sq == 0). The variance does not change in the compressed stage, so they are
    computed once per parameter and again only when its exp_avg_sq changes (loaded, replaced or
    written: its version) or beta2/eps do. Fresh large tensors every step cost page faults on
    CPU and allocator churn on GPUs; these are reused."""

    def __init__(self, numel: int, device: torch.device):
        self.flat = torch.empty(numel, dtype=torch.float32, device=device)
        self._frozen: dict[int, tuple] = {}  # parameter index -> (exp_avg_sq, made from, denom, zero_v)

    def precondition(self, index: int, state: dict, beta2: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(denom, zero_v) of the parameter at `index` (its shape and dtype)."""
        v = state["exp_avg_sq"]
        made_from = (v._version, state["variance_step"], beta2, eps)
        held = self._frozen.get(index)
        if held is None or held[0] is not v or held[1] != made_from:  # v held: its address is not reused
            held = self._frozen[index] = (v, made_from, frozen_denom(v, state["variance_step"], beta2, eps), v == 0)
        return held[2], held[3]


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


class RapidfireAdamW(GlobalNormClipping, AdamWStateDict, torch.optim.Optimizer):
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
        #: Per CPU bucket: the flat buffer the momentum is exchanged in and the frozen
        #: preconditioner (not saved: rebuilt from the state). Reused step to step.
        self._buffers: dict[str, _StepBuffers] = {}
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
        device = comm_device(group) if world > 1 else torch.device("cpu")
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
            buffers = self._step_buffers(key, sum(sizes), device)
            frozen = {}
            for i, p, out in zip(indices, members, buffers.flat.split(sizes)):
                if not takes_part[i]:
                    out.zero_()  # sent as zeros; its state stays as it is
                    continue
                state = self._state(p)
                state.setdefault("variance_step", int(state["step"].item()))
                denom, zero_v = frozen[i] = buffers.precondition(i, state, beta2, eps)
                m = state["exp_avg"].reshape(-1).to(torch.float32)
                if p.grad is not None:
                    torch.lerp(m, p.grad.reshape(-1).to(torch.float32), 1 - beta1, out=out)
                else:  # no gradient on this rank: it contributes a zero gradient
                    torch.lerp(m, m.new_zeros(()).expand_as(m), 1 - beta1, out=out)
                out.masked_fill_(zero_v.reshape(-1), 0.0)
                out.div_(denom.reshape(-1))  # the codec sees m / denom
            ar_state = self._allreduce_state(key, device, buffers.flat.numel(), world)
            compressed_allreduce(buffers.flat, self.codec, ar_state, group=group, stats=self.stats, out=buffers.flat)
            for i, p, avg in zip(indices, members, buffers.flat.split(sizes)):
                if takes_part[i]:
                    denom, zero_v = frozen[i]
                    self._apply(p, avg.view(p.shape), denom, zero_v, lr, beta1, wd)
        return True

    def _step_buffers(self, key: str, numel: int, device: torch.device) -> "_StepBuffers":
        if device.type != "cpu":
            # On a GPU the caching allocator hands out a step's buffers without page faults, and
            # memory kept between steps is memory the next forward's activations (and
            # memory_aware's estimate, which does not count it) cannot use: fresh each step.
            return _StepBuffers(numel, device)
        buffers = self._buffers.get(key)
        if buffers is None or buffers.flat.numel() != numel or buffers.flat.device != device:
            buffers = self._buffers[key] = _StepBuffers(numel, device)
        return buffers

    def _apply(self, p: torch.Tensor, averaged: torch.Tensor, denom: torch.Tensor, zero_v: torch.Tensor,
               lr: float, beta1: float, wd: float) -> None:
        """`averaged`: the average of the preconditioned momenta, this parameter's slice of the
        step buffer (overwritten here)."""
        state = self.state[p]
        exp_avg, step_t = state["exp_avg"], state["step"]
        torch.mul(averaged, denom, out=exp_avg)  # the momentum back from m / denom
        exp_avg.masked_fill_(zero_v, 0.0)
        step_t += 1
        if wd != 0:
            p.mul_(1 - lr * wd)
        bias_correction1 = 1 - beta1**step_t.item()
        if self.max_update is None:
            p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        else:  # the per-element trust bound of the compressed stage (docs/optim.md, Update bound)
            if exp_avg.dtype == torch.float32:  # into the step buffer: no fresh tensor
                update = torch.div(exp_avg, bias_correction1, out=averaged)
            else:
                update = exp_avg / bias_correction1
            update.div_(denom).clamp_(-self.max_update, self.max_update)
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

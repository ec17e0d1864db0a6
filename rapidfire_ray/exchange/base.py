"""`GradientExchange`: how a worker's trainer exchanges gradients, one subclass per mode.

The stage mixin (stages/base.py) builds the optimizer through it, lets it guard the optimizer
step, registers it on the DDP model and asks it to clip; the step recorder calls the run's
course hooks and `take_stats()` every step. A step with a NaN/inf gradient is skipped on every
worker in agreement (how depends on the mode) and counted here, or fails the run
(`communication.on_nonfinite`). Per-rank state is saved as `comm_state_rank<r>.pt`.
"""
from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod

import torch

from ..errors import RapidfireError
from ..log import warn
from .stats import CommStats


class NonFiniteStep(RapidfireError):
    """A non-finite gradient under `communication.on_nonfinite: fail`; `names`: the parameters."""

    def __init__(self, msg: str, names: list[str]):
        super().__init__(msg)
        self.names = names


class GradientExchange(ABC):
    has_process_group = True  # False: workers without a torch process group (no collectives at all)

    def __init__(self, *, rank: int, on_nonfinite: str = "skip", timer=None):
        self.rank = rank
        self.on_nonfinite = on_nonfinite
        self.timer = timer  # telemetry.timing.StepTimer: told the exchange's in-flight intervals
        self.stats = CommStats()
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient
        self._pending_state: dict | None = None  # loaded before `_state_part()` existed

    # --- the trainer's seams ----------------------------------------------------------------

    @abstractmethod
    def register(self, ddp_model) -> None:
        """Install this mode's communication hook on the DDP model (first training step)."""

    def build_optimizer(self, named_groups: list[dict], args) -> torch.optim.Optimizer | None:
        """This mode's optimizer; None: the trainer's default AdamW. `named_groups`: param groups
        with `params` and `param_names`; `args`: the trainer's arguments (lr, betas, ...)."""
        return None

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
        """Clip the gradients this mode's way; None: the trainer's default clip."""
        return None

    def guard(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        """Make `optimizer.step()` skip a step with a non-finite gradient (in agreement on every
        rank) and count it: `_nonfinite_before_step` decides before the step, and
        `_nonfinite_after_step` reports a step the optimizer skipped itself."""
        step = optimizer.step

        def guarded_step(*args, **kwargs):
            names = self._nonfinite_before_step(optimizer, model)
            if names is not None:
                self.skip_step(names)
                return None
            out = step(*args, **kwargs)
            names = self._nonfinite_after_step()
            if names is not None:
                self.skip_step(names)
            return out

        optimizer.step = guarded_step

    def _nonfinite_before_step(self, optimizer, model) -> list[str] | None:
        return None

    def _nonfinite_after_step(self) -> list[str] | None:
        return None

    def skip_step(self, names: list[str]) -> None:
        """A step was not applied for a non-finite gradient in `names` ([] if only on another
        rank): count it, or fail under `communication.on_nonfinite: fail`."""
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") or "(on another rank)"
        if self.on_nonfinite == "fail":
            raise NonFiniteStep(f"non-finite gradient in {shown}; the step was not applied "
                                "(communication.on_nonfinite: fail); lower optimizer.params.lr or check the data", names)
        self.skipped_steps += 1
        warn(f"rank {self.rank}: step skipped, non-finite gradient in {shown}")

    def live_codec(self) -> str | None:
        """The gradient codec a run may change while it trains (`set_codec`); None: not here."""
        return None

    # --- the run's course -------------------------------------------------------------------

    def begin(self) -> None:
        """Training starts (or resumes)."""

    def before_save(self) -> None:
        """The trainer is about to write a checkpoint."""

    def around_report(self, last: bool):
        """Context for `ray.train.report`, which waits for every worker."""
        return contextlib.nullcontext()

    def finish(self) -> dict | None:
        """This worker trained its last step; a report for the run summary (or None)."""
        return None

    # --- telemetry --------------------------------------------------------------------------

    def take_stats(self) -> dict:
        """This step's bytes, latency percentiles and compression ratio, `skipped_steps`, and
        `untimed_comm_phase`: the phase holding exchange time no hook told the step timer about."""
        out = self.stats.take()
        out["untimed_comm_phase"] = self._untimed_phase()
        out.update(self._step_stats())
        out["skipped_steps"] = self.skipped_steps
        return out

    def _untimed_phase(self) -> str | None:
        return None

    def _step_stats(self) -> dict:
        return {}

    # --- checkpoints ------------------------------------------------------------------------

    #: Key of this mode's state in `state_dict()`; None: nothing to save.
    state_key: str | None = None

    def _state_part(self):
        """The part whose state this mode saves under `state_key` (hook state, optimizer, PS
        client), or None while it is not built yet."""
        return None

    def _save_part(self, part) -> dict:
        return part.state_dict()

    def _load_part(self, part, state: dict) -> None:
        part.load_state_dict(state)

    def _part_built(self) -> None:
        """`_state_part()` exists now: apply a state loaded before it did."""
        pending, self._pending_state = self._pending_state, None
        if pending is not None:
            self._load_part(self._state_part(), pending)

    def state_dict(self) -> dict:
        """This rank's state (error feedback); {}: nothing to save."""
        part = self._state_part()
        return {self.state_key: self._save_part(part)} if self.state_key and part is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s key this mode knows (applied once its part exists)."""
        if self.state_key is None or self.state_key not in state:
            return
        part = self._state_part()
        if part is not None:
            self._load_part(part, state[self.state_key])
        else:
            self._pending_state = state[self.state_key]  # applied by `_part_built()`

    def state_file(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, f"comm_state_rank{self.rank}.pt")

    def save(self, checkpoint_dir: str) -> str:
        """Write this rank's state beside the trainer's checkpoint; return the folder this rank
        hands to Ray Train."""
        state = self.state_dict()
        if state:
            torch.save(state, self.state_file(checkpoint_dir))
        return checkpoint_dir

    def load(self, checkpoint_dir: str) -> None:
        path = self.state_file(checkpoint_dir)
        if os.path.exists(path):
            self.load_state_dict(torch.load(path, weights_only=True))

"""Checkpoints of `RapidfireAdamW`: torch's optimizer state dict plus one "rapidfire_adamw" entry
(steps, stage, skipped steps, norm ratio, this rank's error-feedback buffers), and the per-rank
`allreduce_state_dict()` that lets every rank resume its own error feedback. Which rank's
buffers load where: docs/optim.md, "Checkpoints"."""
from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from ..exchange.allreduce import AllreduceState

STATE_KEY = "rapidfire_adamw"
STATE_FORMAT = "rapidfire_ray.optim.rapidfire_adamw/1"
ALLREDUCE_FORMAT = "rapidfire_ray.optim.rapidfire_adamw.allreduce/1"


class AdamWStateDict:
    """Mixin of `RapidfireAdamW` (before torch.optim.Optimizer in its bases): `state_dict`,
    `load_state_dict` and the per-rank error-feedback state. Uses the optimizer's `world()`,
    `_buckets()` and its step, stage, norm-ratio and `_allreduce_states` attributes."""

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


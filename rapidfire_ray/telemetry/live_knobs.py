"""The trainer callback that applies live knob changes on a worker (kept apart from the control
actor's module, so the actor's process does not import transformers and torch)."""
from __future__ import annotations

from transformers import TrainerCallback

from .control import KnobClient


class LiveKnobs(TrainerCallback):
    """The trainer callback of a worker's `KnobClient`: every change so far at the start, due
    changes after each step (they apply to the next one)."""

    def __init__(self, knobs: KnobClient, memory_limit_bytes: int | None = None):
        self.knobs = knobs
        self.memory_limit_bytes = memory_limit_bytes

    def on_train_begin(self, args, state, control, **kwargs):
        self.knobs.begin(state.global_step, self.memory_limit_bytes)

    def on_step_end(self, args, state, control, **kwargs):
        self.knobs.step_end(state.global_step)
        return control

"""What workers report to the driver: a `StepRecord` per rank per optimizer step, and a
`WorkerReport` per rank when it has trained its last step.

A step record becomes one line of `steps.jsonl` (`to_dict`); the progress line, the run summary,
the metrics endpoint and the live-control rules read those same dicts.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    rank: int
    step: int
    phases: dict[str, float]  # seconds per phase (telemetry.timing.PHASES, "step", "other"; RL adds its own)
    samples: int  # rows trained on (RL: completions)
    tokens: int  # real tokens (RL: generated tokens)
    padded_tokens: int  # tokens the model computed on, padding included
    peak_memory_bytes: int
    time: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    world: int | None = None  # workers in this worker group
    attempt: int | None = None  # which worker group of the run (0: the first; None without a process group)
    oom_splits: int = 0
    # Flat counters of the parts that measure the step: the gradient exchange's (bytes, latency,
    # skipped steps), memory's (saved-activation bytes), the reward pool's; each key once.
    counters: dict = field(default_factory=dict)
    knobs: dict | None = None  # live knob values in force (rapidfire monitor)
    rl: dict | None = None  # an RL step's numbers (reward, kl, ...)

    def to_dict(self) -> dict:
        out = asdict(self)
        counters = out.pop("counters")
        for key in ("knobs", "rl"):
            if out[key] is None:
                del out[key]
        clash = counters.keys() & out.keys()
        if clash:
            raise ValueError(f"step record counters shadow fields: {sorted(clash)}")
        return {**out, **counters}


@dataclass
class WorkerReport:
    """One rank's end-of-training facts, for the run summary."""
    rank: int
    held_bytes: dict | None = None  # parameters, gradients, optimizer state held (memory.zero.held_bytes)
    exchange: dict | None = None  # the gradient exchange's own report (the parameter-server client's)
    skipped_steps: int = 0  # steps skipped for non-finite gradients (the NaN guard's count)
    memory: dict | None = None  # rank 0: the memory levels' report
    reward_pool: dict | None = None  # RL: completions scored by the pool from this rank
    eval_before: dict | None = None  # RL, rank 0: held-out evaluation of the starting policy
    eval_after: dict | None = None  # RL, rank 0: of the trained policy

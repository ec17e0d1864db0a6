"""Experiments: many LoRA configs trained side by side on training slots, chunk by chunk, compared on
a held-out set at every chunk boundary, steered live (README, "Experiments")."""
from __future__ import annotations

from .spec import load_experiment

__all__ = ["load_experiment", "run_experiment", "ctl"]


def run_experiment(profile, overrides=(), *, address=None, resume=False) -> dict:
    from .driver import run_experiment as run

    return run(profile, overrides, address=address, resume=resume)


def ctl(op: str, run: str, overrides: dict | None = None, *, warm: bool = False, experiment: str | None = None,
        address: str | None = None) -> dict:
    """Queue stop/resume/delete/clone on a running experiment (joins its cluster unless connected)."""
    from .cli import connect_to
    from .control import ctl as queue

    connect_to(address)
    return queue(op, run, overrides, warm, experiment)

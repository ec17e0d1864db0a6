"""rapidfire-ray: fast, reliable TRL fine-tuning (SFT, reward model, RL) on Ray Train workers."""
from __future__ import annotations

from typing import Any, Mapping

from .errors import RapidfireError, RunFailed

__version__ = "0.1.0"
__all__ = ["RapidfireError", "RunFailed", "experiment", "experiment_ctl", "optimized_graph", "train", "__version__"]


def __getattr__(name: str):
    # `import rapidfire_ray` stays light: optimized_graph pulls in torch and transformers when first used.
    if name == "optimized_graph":
        from .memory.activations import optimized_graph

        return optimized_graph
    raise AttributeError(f"module 'rapidfire_ray' has no attribute {name!r}")


def train(profile: Any = None, *, address: str | None = None, resume: bool = False,
          overrides: Mapping[str, Any] | None = None, **more: Any) -> dict:
    """Run a training job and return its summary (the contents of `run_summary.json`).

    `profile` is a train_config.yaml path, a mapping or None (defaults). Override keys dotted
    (`overrides={"train.max_steps": 10}` or `**{"train.max_steps": 10}`) or by section
    (`train={"max_steps": 10}`).
    """
    from .config import load_config
    from .driver import run, run_pipeline

    cfg = load_config(profile, {**more, **(overrides or {})})
    return (run_pipeline if cfg.train.stage == "pipeline" else run)(cfg, address=address, resume=resume)


def experiment(profile: Any, *, address: str | None = None, resume: bool = False,
               overrides: Mapping[str, Any] | None = None, **more: Any) -> dict:
    """Run an experiment (a profile with an `experiment` section: many configs side by side, chunk by
    chunk) and return its summary (the contents of `experiment_summary.json`). Overrides as in
    `train`; `experiment.*` keys reach the experiment section."""
    from .experiments import run_experiment

    return run_experiment(profile, {**more, **(overrides or {})}, address=address, resume=resume)


def experiment_ctl(op: str, run: str, overrides: Mapping[str, Any] | None = None, *, warm: bool = False,
                   experiment: str | None = None, address: str | None = None) -> dict:
    """stop / resume / delete / clone (`overrides`, `warm`) a config of a running experiment."""
    from .experiments import ctl

    return ctl(op, run, dict(overrides or {}), warm=warm, experiment=experiment, address=address)

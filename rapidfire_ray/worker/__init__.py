"""The Ray Train worker side of a run: `loop` (the entry: assemble, train, report), `parts` (each
part from its config section), `resume` (where a worker group starts), `elastic` (a worker
group's batch policy and data position at its worker count)."""
from __future__ import annotations

__all__ = ["train_loop_per_worker"]


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry on every worker of the sft and reward stages (`loop.train_loop_per_worker`).
    The driver hands Ray this function, pickled by reference, without importing the loop: the loop
    needs torch, transformers, TRL and PEFT (about 8 s of imports on a small CPU), which only the
    workers use."""
    from .loop import train_loop_per_worker as run

    run(config)

"""The Ray Train worker side of a run: `loop` (the entry: assemble, train, report), `parts` (each
part from its config section), `resume` (where a worker group starts), `elastic` (a worker
group's batch policy and data position at its worker count)."""
from .loop import train_loop_per_worker

__all__ = ["train_loop_per_worker"]

"""A preempted spot node's grace period becomes a checkpoint.

A cloud's preemption notice (AWS's two-minute spot interruption warning, GCP's preemption
notice) reaches Ray as a node drain with reason PREEMPTION and a deadline: Ray's autoscaler
(v2) or KubeRay drain the node, or by hand `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds 120 ...`. Ray Train 2.60 watches drains on the run's nodes and
tells every worker (`ray.train.get_preemption_info`). At each step boundary every rank asks;
at the first notice the run saves a checkpoint right after that step (all ranks agree on the
step: the call is a barrier) and trains on. When the node then goes, Ray Train restarts the
worker group from that checkpoint (FailureConfig.max_preemption_failures, unlimited by default,
not counted against scaling.max_failures), so at most the step in flight is trained twice.

Not under communication.mode parameter_server: there the workers run without lockstep, and the
per-step barrier would impose one.
"""
from __future__ import annotations

import time

import ray.train
from transformers import TrainerCallback

from .log import say


class PreemptionCheck(TrainerCallback):
    """Asks Ray Train at every step's end; the first notice makes the trainer save (placed
    before the checkpoint saver among the trainer's callbacks)."""

    def __init__(self, board, rank: int):
        self.board = board
        self.rank = rank
        self.saved_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps:  # the last step saves anyway
            self.step_end(state.global_step, control)
        return control

    def step_end(self, step: int, control) -> None:
        if self.saved_at is not None:  # one just-in-time checkpoint per notice is enough
            return
        info = ray.train.get_preemption_info()
        if info is None:
            return
        self.saved_at = step
        control.should_save = True
        if self.rank == 0:
            left = (info.deadline_ms / 1000 - time.time()) if info.deadline_ms else None
            nodes = ", ".join(n[:8] for n in sorted(info.preempted_node_to_ranks))
            ranks = sorted(r for rs in info.preempted_node_to_ranks.values() for r in rs)
            msg = (f"node(s) {nodes} (ranks {ranks}) are being preempted"
                   + (f", {left:.0f} s left" if left is not None else "")
                   + f": saving a checkpoint after step {step}")
            say(msg)
            self.board.note_preemption.remote({"step": step, "nodes": sorted(info.preempted_node_to_ranks),
                                                 "ranks": ranks, "seconds_left": left, "message": msg})

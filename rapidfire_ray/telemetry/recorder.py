"""The trainer callback that measures each step: its `StepRecord` (phases, rows, tokens, memory,
the exchange's and memory's counters, knobs in force) to the run board and Ray's metrics
endpoint, and rank 0's logged losses."""
from __future__ import annotations

from transformers import TrainerCallback

from .records import StepRecord
from .timing import StepTimer, peak_memory_bytes


def exchange_counters(exchange, phases: dict) -> dict:
    """The gradient exchange's counters of this step (bytes, latency, compression, skipped steps);
    exchange time the step timer could not see is moved from its phase into `communication`."""
    if exchange is None:
        return {}
    counters = exchange.take_stats()
    where = counters.pop("untimed_comm_phase", None)
    if where is not None:
        moved = min(counters["comm_seconds"], phases[where])
        phases[where] -= moved
        phases["communication"] += moved
    timer = getattr(exchange, "timer", None)
    if timer is not None and "comm_seconds" in counters:
        # in flight (hidden behind backward included); communication_summary's hidden share
        counters["comm_in_flight_s"] = max(timer.comm_in_flight, phases["communication"])
    return counters


class OptimizerClock(TrainerCallback):
    """Times the optimizer step into `self.timer`'s `optimizer` phase."""

    timer: StepTimer
    _in_step = False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timer.begin("optimizer")
        self._in_step = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._in_step:
            self.timer.end("optimizer")
            self._in_step = False


class StepRecorder(OptimizerClock):
    def __init__(self, *, board, timer: StepTimer, loader, rank: int, world: int, attempt: int | None,
                 backoff=None, exchange=None, memory=None, metrics=None, knobs=None):
        self.board = board
        self.timer = timer
        self.loader = loader
        self.rank, self.world, self.attempt = rank, world, attempt
        self.backoff = backoff  # data.backoff.OOMBackoff: the step's out-of-memory splits
        self.exchange = exchange  # exchange.GradientExchange: bytes, latency, compression, skipped steps
        self.memory = memory  # memory.setup.WorkerMemory: saved-activation bytes per step
        self.metrics = metrics  # telemetry.metrics.WorkerMetrics: Ray's metrics endpoint
        self.knobs = knobs  # telemetry.control.KnobClient: the knob values in force
        self._oom_seen = 0
        self._counts = (0, 0, 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.take()  # start the first step's clock here, after model and optimizer set-up
        self.loader.wait_s = 0.0
        self._counts = self._loader_counts()
        if self.rank == 0:
            self.board.set_plan.remote(state.max_steps, state.global_step)

    def _loader_counts(self) -> tuple[int, int, int]:
        loader = self.loader
        return loader.rows_yielded, loader.tokens_yielded, loader.padded_tokens_yielded

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.add("data_wait", self.loader.wait_s)
        self.loader.wait_s = 0.0
        phases = self.timer.take()
        counters = exchange_counters(self.exchange, phases)
        if self.memory is not None:
            counters.update(self.memory.take_step(state.global_step))
        counts = self._loader_counts()
        samples, tokens, padded = (now - before for now, before in zip(counts, self._counts))
        self._counts = counts
        record = StepRecord(rank=self.rank, step=state.global_step, phases=phases, samples=samples, tokens=tokens,
                            padded_tokens=padded, peak_memory_bytes=peak_memory_bytes(), world=self.world,
                            attempt=self.attempt, oom_splits=self._new_oom_splits(), counters=counters,
                            knobs=dict(self.knobs.values) if self.knobs is not None else None).to_dict()
        self.board.push_step.remote(record)
        if self.metrics is not None:
            self.metrics.step(record)
        return control

    def _new_oom_splits(self) -> int:
        if self.backoff is None:
            return 0
        new = len(self.backoff.events) - self._oom_seen
        self._oom_seen = len(self.backoff.events)
        return new

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.metrics is not None and logs:
            self.metrics.log(logs)
        if self.rank == 0 and logs and "loss" in logs:
            self.board.push_log.remote({"step": state.global_step, "loss": float(logs["loss"]),
                                        "learning_rate": logs.get("learning_rate"),
                                        "grad_norm": logs.get("grad_norm"),
                                        # the reward stage's training pairs (TRL's RewardTrainer logs them)
                                        **{k: float(logs[k]) for k in ("accuracy", "margin") if k in logs}})

"""Step records of an RL run: the step-time breakdown with rollout and reward apart from the
update, and the RL numbers of each step (mean reward, KL, losses), pushed to the run's progress
board like SFT's (`telemetry.recorder`).

Phases: `rollout` (sampling completions, plus the old/reference log-probabilities and, for PPO,
values: everything that makes the experience except scoring it), `reward` (the reward pool and
rule functions), and the update: `forward`, `backward`, `optimizer`, `communication` (gradient
all-reduce in flight). `generate_s` is the sampling alone, for rollout tokens/s.
"""
from __future__ import annotations


from ..telemetry.records import StepRecord
from ..telemetry.recorder import OptimizerClock, exchange_counters
from ..telemetry.timing import StepTimer, peak_memory_bytes
from .summary import RL_PHASES, UPDATE_PHASES


class RLStepTimer(StepTimer):
    """StepTimer with the rollout and reward phases beside the update's."""

    phases = StepTimer.phases + RL_PHASES

    def __init__(self):
        super().__init__()
        self.generate_s = 0.0
        self.generated_tokens = 0

    def take(self) -> dict[str, float]:
        out = super().take()
        out["generate"] = self.generate_s
        self.generate_s = 0.0
        return out


def step_record(*, rank: int, step: int, phases: dict, completions: int, tokens: int, rl: dict,
                pool_counts: dict) -> dict:
    """One rank's record of one step, in the shape `driver.outputs.summarise` reads plus an `rl` part."""
    return StepRecord(rank=rank, step=step, phases=phases, samples=completions, tokens=tokens, padded_tokens=tokens,
                      peak_memory_bytes=peak_memory_bytes(), rl=rl, counters=dict(pool_counts)).to_dict()


def publish(board, metrics, record: dict, log: dict) -> None:
    """A finished step: its record to the progress board and Ray's metrics endpoint, and (rank 0)
    its logged loss, reward and KL (the progress line, the run summary's loss curve)."""
    board.push_step.remote(record)
    if metrics is not None:
        metrics.log(log)
        metrics.step(record)
    if record["rank"] == 0:
        board.push_log.remote(log)


class TRLStepCallback(OptimizerClock):
    """For GRPO/RLOO: times the optimizer, and at each step's end pushes this rank's record with
    the step's RL metrics (TRL's `_metrics`, gathered over ranks by TRL), then drops them so the
    next step starts clean."""

    KEYS = {"reward": "reward", "reward_std": "reward_std", "kl": "kl", "entropy": "entropy",
            "clip_ratio/region_mean": "clip_fraction", "completions/mean_length": "completion_length",
            "frac_reward_zero_std": "frac_reward_zero_std"}

    def __init__(self, *, board, timer: RLStepTimer, pool, rank: int, metrics=None, exchange=None):
        self.board = board
        self.metrics = metrics  # telemetry.metrics.WorkerMetrics
        self.timer = timer
        self.pool = pool
        self.rank = rank
        self.exchange = exchange  # exchange.GradientExchange: its counters go into each step record
        self.trainer = None  # set after the trainer is built
        self._completions = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.take()
        self.timer.generated_tokens = 0
        if self.rank == 0:
            self.board.set_plan.remote(state.max_steps, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        metrics = self.trainer._metrics["train"]
        rl = {}
        for key, name in self.KEYS.items():
            values = [v for v in metrics.get(key, []) if v == v]  # NaN-free
            if values:
                rl[name] = sum(values) / len(values)
        for key, values in metrics.items():
            if key.startswith("rewards/") and key.endswith("/mean") and values:
                rl[key[len("rewards/"):-len("/mean")]] = sum(values) / len(values)
        tokens, self.timer.generated_tokens = self.timer.generated_tokens, 0
        completions, self.trainer.rf_completions = self.trainer.rf_completions, 0
        phases = self.timer.take()
        counters = {**self.pool.take(), **exchange_counters(self.exchange, phases)}
        record = step_record(rank=self.rank, step=state.global_step, phases=phases,
                             completions=completions, tokens=tokens, rl=rl, pool_counts=counters)
        publish(self.board, self.metrics, record, {"step": state.global_step, "loss": self.trainer.rf_last_loss,
                                                   "reward": rl.get("reward"), "kl": rl.get("kl")})
        return control

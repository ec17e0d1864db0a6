"""The run's board: one small Ray actor per run where workers leave what the driver and the
other workers need (step records, logged losses, the shard plan, end-of-training reports), each
through its own method.

It is an async actor: `gather_min` waits for every rank without polling, and the other methods
return at once.
"""
from __future__ import annotations

import asyncio

import ray

from .records import WorkerReport


@ray.remote(num_cpus=0)
class RunBoard:
    def __init__(self):
        self.steps: list[dict] = []
        self.logs: list[dict] = []
        self.plan = {"total_steps": None, "start_step": 0}
        self._shard_plan: dict | None = None
        self._attempts = 0
        self._elastic_starts: dict[int, dict] = {}
        self._memory_model: dict | None = None
        self._checkpoint_fallback: str | None = None
        self._preemption: dict | None = None
        self._reports: dict[int, WorkerReport] = {}
        self._rounds: dict[str, list[tuple[dict[int, int], asyncio.Event]]] = {}

    # --- progress ---------------------------------------------------------------------------

    async def set_plan(self, total_steps: int, start_step: int) -> None:
        self.plan = {"total_steps": total_steps, "start_step": start_step}

    async def push_step(self, record: dict) -> None:
        """A `StepRecord.to_dict()`."""
        self.steps.append(record)

    async def push_log(self, record: dict) -> None:
        """Rank 0's logged loss (and learning rate, grad norm, reward, ...) at a step."""
        self.logs.append(record)

    async def snapshot(self) -> dict:
        return {"plan": self.plan, "steps": self.steps, "logs": self.logs}

    async def since(self, index: int) -> list[dict]:
        """Step records from position `index` on (the control actor reads them incrementally)."""
        return self.steps[index:]

    async def latest(self) -> dict:
        """What `rapidfire monitor` shows: the plan, every rank's newest step record, the newest
        logged loss, and the step count."""
        newest: dict[int, dict] = {}
        for r in reversed(self.steps):
            newest.setdefault(r["rank"], r)
            if len(newest) >= 1024 or r["step"] < max(x["step"] for x in newest.values()) - 64:
                break
        return {"plan": self.plan, "workers": [newest[k] for k in sorted(newest)],
                "log": self.logs[-1] if self.logs else None, "records": len(self.steps),
                "recent": self.steps[-256:]}

    async def line(self) -> str | None:
        from .progress import progress_line

        return progress_line({"plan": self.plan, "steps": self.steps, "logs": self.logs})

    # --- facts of the run -------------------------------------------------------------------

    async def publish_shard_plan(self, plan: dict) -> None:
        """The shard plan in use (`ShardPlan.to_json()`), made when the shards are handed out."""
        self._shard_plan = plan

    async def shard_plan(self) -> dict | None:
        return self._shard_plan

    async def start_attempt(self) -> int:
        """A worker group starts: how many started before it (0: the first)."""
        self._attempts += 1
        return self._attempts - 1

    async def report_elastic_start(self, attempt: int, start: dict) -> None:
        """An elastic worker group's start: its worker count, step, batch policy and position."""
        self._elastic_starts[attempt] = start

    async def elastic_starts(self) -> list[dict | None]:
        return [self._elastic_starts.get(a) for a in range(self._attempts)]

    async def report_memory_model(self, report: dict) -> None:
        """memory_aware batching's estimate for rank 0's largest planned batch."""
        self._memory_model = report

    async def memory_model(self) -> dict | None:
        return self._memory_model

    async def note_checkpoint_fallback(self, message: str) -> None:
        """A damaged checkpoint was skipped at resume (what was said, for the summary)."""
        self._checkpoint_fallback = message

    async def checkpoint_fallback(self) -> str | None:
        return self._checkpoint_fallback

    async def note_preemption(self, notice: dict) -> None:
        """A node's preemption notice and the step saved for it (kept with the run's facts)."""
        self._preemption = notice

    async def report_worker_end(self, report: WorkerReport) -> None:
        """A rank has trained its last step (a restarted rank's report replaces its earlier one)."""
        self._reports[report.rank] = report

    async def worker_reports(self) -> list[WorkerReport]:
        return [self._reports[r] for r in sorted(self._reports)]

    # --- coordination without a process group ----------------------------------------------

    async def gather_min(self, key: str, rank: int, world: int, value: int) -> int:
        """The smallest `value` of `world` ranks, returned to each once all have called. A rank
        joins the oldest round of `key` it has not joined yet (a restarted worker group starts
        the next round)."""
        rounds = self._rounds.setdefault(key, [])
        for values, done in rounds:
            if rank not in values:
                break
        else:
            values, done = {}, asyncio.Event()
            rounds.append((values, done))
        values[rank] = value
        if len(values) >= world:
            done.set()
        await done.wait()
        return min(values.values())

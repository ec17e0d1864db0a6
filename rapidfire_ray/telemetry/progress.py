"""Live progress of a run: workers push step records to a small Ray actor, the driver prints them.

The same records become the run summary (`summary.summarise`), so what the progress line shows
and what `run_summary.json` reports are one measurement.
"""
from __future__ import annotations

import sys
import threading

import ray


@ray.remote(num_cpus=0)
class ProgressBoard:
    """Holds per-rank step records and rank 0's logged losses for one run."""

    def __init__(self):
        self.steps: list[dict] = []
        self.logs: list[dict] = []
        self.plan = {"total_steps": None, "start_step": 0}
        self.values: dict = {}

    def set_plan(self, total_steps: int, start_step: int) -> None:
        self.plan = {"total_steps": total_steps, "start_step": start_step}

    def push_step(self, record: dict) -> None:
        self.steps.append(record)

    def push_log(self, record: dict) -> None:
        self.logs.append(record)

    def snapshot(self) -> dict:
        return {"plan": self.plan, "steps": self.steps, "logs": self.logs}

    def since(self, index: int) -> list[dict]:
        """Step records from position `index` on (the control actor reads them incrementally)."""
        return self.steps[index:]

    def latest(self) -> dict:
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

    def line(self) -> str | None:
        return progress_line(self.snapshot())

    def put(self, key: str, value) -> None:
        """Publish a run fact (e.g. the data layer's "shard_plan") for the workers and the driver."""
        self.values[key] = value

    def get(self, key: str):
        """A fact published with `put` (None if none was)."""
        return self.values.get(key)


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def progress_line(snap: dict) -> str | None:
    steps = snap["steps"]
    if not steps:
        return None
    plan = snap["plan"]
    step = max(r["step"] for r in steps[-64:])
    recent = [r for r in steps[-64:] if r["step"] > step - 10]
    wall = sum(r["phases"]["step"] for r in recent if r["rank"] == 0) or 1e-9
    tokens = sum(r["tokens"] for r in recent)
    steps_timed = len({r["step"] for r in recent if r["rank"] == 0}) or 1
    loss = next((r["loss"] for r in reversed(snap["logs"]) if r.get("loss") is not None), None)
    total = plan["total_steps"]
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    parts.append(f"{tokens / wall:.1f} tok/s")
    if total:
        parts.append(f"eta {_fmt_duration((total - step) * wall / steps_timed)}")
    return " | ".join(parts)


class Poller:
    """A driver thread that calls `poll()` every `interval_s` while the run trains and once more
    at the end (the run's last lines). `poll` must not raise: what it reports is best-effort and
    training must not fail for a printed line."""

    def __init__(self, interval_s: float, stream=None, name: str = "rapidfire-poll"):
        self.interval_s = interval_s
        self.stream = stream or sys.stdout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()

    def poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()


class ProgressPrinter(Poller):
    """Polls the board and prints a progress line whenever the step moves."""

    def __init__(self, board, interval_s: float = 2.0, stream=None):
        super().__init__(interval_s, stream, name="rapidfire-progress")
        self.board = board
        self._last = None

    def poll(self) -> None:
        try:
            line = ray.get(self.board.line.remote(), timeout=10)
        except Exception:  # the board is best-effort; training must not fail for a progress line
            return
        if line and line != self._last:
            print(f"[rapidfire] {line}", file=self.stream, flush=True)
            self._last = line

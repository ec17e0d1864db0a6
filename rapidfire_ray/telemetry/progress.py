"""Live progress of a run: workers push step records to the run board (`telemetry/board.py`),
the driver prints a line from them.

The same records become the run summary (`driver.outputs.summarise`), so what the progress line
shows and what `run_summary.json` reports are one measurement.
"""
from __future__ import annotations

import sys
import threading

import ray


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
            print(f"[rapidfire] {line}", file=self.stream, flush=True)  # (self.stream: tests read it)
            self._last = line

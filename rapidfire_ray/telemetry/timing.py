"""Measured step-time breakdown: data wait, forward, backward, optimizer, communication.

Each phase is timed where it happens (the loader, the trainer's loss and step, the optimizer
callbacks, a DDP communication hook), with a device sync on CUDA so GPU work is counted in
the phase that launched it. Gradient all-reduce overlaps the backward pass; the time any
bucket was in flight counts as communication and is taken out of backward.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

PHASES = ("data_wait", "forward", "backward", "optimizer", "communication")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepTimer:
    """Accumulates seconds per phase between two `take()` calls (one optimizer step)."""

    def __init__(self):
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._comm: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._step_start = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        _sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self._acc[name] += time.perf_counter() - t0

    def seconds(self, name: str) -> float:
        """Seconds accumulated in phase `name` since the last `take()`."""
        return self._acc[name]

    def add(self, name: str, seconds: float) -> None:
        self._acc[name] += seconds

    def comm_interval(self, start: float, end: float) -> None:
        with self._lock:
            self._comm.append((start, end))

    def comm_seconds_since(self, t0: float) -> float:
        """Seconds of communication in flight since `t0` (a `time.perf_counter()` value), so far."""
        with self._lock:
            spans = sorted((max(s, t0), e) for s, e in self._comm if e > t0)
        return _union_length(spans)

    def _comm_seconds(self) -> float:
        with self._lock:
            spans, self._comm = sorted(self._comm), []
        return _union_length(spans)

    def take(self) -> dict[str, float]:
        """Seconds per phase for the step that just ended, plus `step` (wall) and `other`."""
        now = time.perf_counter()
        out = dict(self._acc)
        comm = self._comm_seconds()
        out["communication"] += comm
        out["backward"] = max(0.0, out["backward"] - comm)
        out["step"] = now - self._step_start
        out["other"] = max(0.0, out["step"] - sum(out[p] for p in PHASES))
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._step_start = now
        return out


def timed_allreduce_hook(timer: StepTimer, bucket):
    """DDP communication hook: the default averaging all-reduce, with its in-flight time recorded.
    Register with `ddp_model.register_comm_hook(timer, timed_allreduce_hook)`."""
    import torch.distributed as dist

    start = time.perf_counter()
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()

    def done(f):
        timer.comm_interval(start, time.perf_counter())
        return f.value()[0]

    return fut.then(done)


def peak_memory_bytes() -> int:
    """Peak accelerator memory on GPU, peak resident set size of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of sorted (start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total

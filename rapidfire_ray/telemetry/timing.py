"""Measured step-time breakdown: data wait, forward, backward, optimizer, communication.

Each phase is timed where it happens (the loader, the trainer's loss and step, the optimizer
callbacks, a DDP communication hook). A phase's time excludes the phases nested in it (the
trainer's `training_step` holds its forward: backward is what is left), so phases never count
twice. On CUDA the marks are CUDA events on the current stream, read once per step at `take()`
(one wait for the step's last event instead of a device sync at every phase boundary), so GPU
work is counted in the phase that launched it without stalling the launch queue.

Gradient exchange overlaps the backward pass. A DDP hook reports two intervals per bucket: the
time it held the backward thread (`comm_call`: launching, or the whole exchange for a hook that
works synchronously) and the time the bucket was in flight (`comm_interval`, until its result
was ready). The `communication` phase is the exposed part: the union of the held intervals plus
the wait after the last bucket was handed off (DDP waits for every bucket at the end of
backward), taken out of backward. `comm_in_flight` is the union of the in-flight intervals, so
`1 - communication / comm_in_flight` is the share of communication hidden behind compute. A hook
that reports only in-flight intervals counts them as exposed.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

PHASES = ("data_wait", "forward", "backward", "optimizer", "communication")


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class _Frame:
    """An open phase: its name, start mark and the (start, end) marks of the phases nested in it."""

    __slots__ = ("name", "start", "children")

    def __init__(self, name: str, start):
        self.name, self.start, self.children = name, start, []


class StepTimer:
    """Accumulates seconds per phase between two `take()` calls (one optimizer step)."""

    phases: tuple[str, ...] = PHASES

    def __init__(self):
        self._acc = dict.fromkeys(self.phases, 0.0)
        self._open: list[_Frame] = []
        self._spans: list[tuple[str, object, object, list]] = []  # closed phases, resolved at take()
        self._comm: list[tuple[float, float]] = []  # in flight, per bucket
        self._calls: list[tuple[float, float]] = []  # the backward thread held, per bucket
        self._lock = threading.Lock()
        self._step_start = time.perf_counter()
        self._events = _cuda_active()  # CUDA events this step, host clock otherwise
        self.comm_in_flight = 0.0  # the last taken step's exchange seconds in flight

    def _mark(self):
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0 if self._events else end - start

    def begin(self, name: str) -> None:
        """Start phase `name` (closed by `end(name)`); for seams with separate before/after calls."""
        self._open.append(_Frame(name, self._mark()))

    def end(self, name: str) -> None:
        frame = self._open.pop()
        if frame.name != name:
            raise RuntimeError(f"step timer: phase {name!r} ended while {frame.name!r} is open")
        stop = self._mark()
        self._spans.append((name, frame.start, stop, frame.children))
        if self._open:
            self._open[-1].children.append((frame.start, stop))

    @contextmanager
    def phase(self, name: str):
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def add(self, name: str, seconds: float) -> None:
        """Host-measured seconds (e.g. the loader's wait) into phase `name`."""
        self._acc[name] += seconds

    def comm_interval(self, start: float, end: float) -> None:
        """A bucket's exchange was in flight from `start` to `end` (host clock); any thread."""
        with self._lock:
            self._comm.append((start, end))

    def comm_call(self, start: float, end: float) -> None:
        """A hook held the backward thread from `start` to `end` for a bucket whose exchange goes
        on after it returned (its in-flight interval comes through `comm_interval`)."""
        with self._lock:
            self._calls.append((start, end))

    def comm_seconds_since(self, t0: float) -> float:
        """Seconds of communication in flight since `t0` (a `time.perf_counter()` value), so far."""
        with self._lock:
            spans = sorted((max(s, t0), e) for s, e in self._comm if e > t0)
        return _union_length(spans)

    def _comm_seconds(self) -> tuple[float, float]:
        """(exposed, in flight) seconds of this step's exchange."""
        with self._lock:
            spans, self._comm = sorted(self._comm), []
            calls, self._calls = sorted(self._calls), []
        in_flight = _union_length(spans)
        if not calls:
            return in_flight, in_flight
        tail = max(0.0, max(e for _, e in spans) - max(e for _, e in calls)) if spans else 0.0
        return min(in_flight, _union_length(calls) + tail), in_flight

    def _resolve(self) -> None:
        spans, self._spans = self._spans, []
        if self._events and spans:
            spans[-1][2].synchronize()  # the step's last mark: every earlier one has completed
        for name, start, stop, children in spans:
            inner = sum(self._elapsed(s, e) for s, e in children)
            self._acc[name] += max(0.0, self._elapsed(start, stop) - inner)

    def take(self) -> dict[str, float]:
        """Seconds per phase for the step that just ended, plus `step` (wall) and `other`. The
        exchange's in-flight seconds of that step (hidden part included) are left in
        `self.comm_in_flight`."""
        self._resolve()
        now = time.perf_counter()
        out = dict(self._acc)
        comm, in_flight = self._comm_seconds()
        out["communication"] += comm
        out["backward"] = max(0.0, out["backward"] - comm)
        out["step"] = now - self._step_start
        out["other"] = max(0.0, out["step"] - sum(out[p] for p in self.phases))
        self.comm_in_flight = in_flight
        self._acc = dict.fromkeys(self.phases, 0.0)
        self._step_start = now
        self._events = _cuda_active()
        return out


def timed_allreduce_hook(timer: StepTimer, bucket):
    """DDP communication hook: the default averaging all-reduce, with its in-flight time recorded.
    Register with `ddp_model.register_comm_hook(timer, timed_allreduce_hook)`."""
    import torch.distributed as dist

    start = time.perf_counter()
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    timer.comm_call(start, time.perf_counter())

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

"""StepTimer: nested phases counted once, the breakdown sums to the step, CUDA marks are events."""
from __future__ import annotations

import time

import pytest
import torch

from rapidfire_ray.telemetry.timing import PHASES, StepTimer


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_nested_phase_is_taken_out_of_the_phase_around_it():
    timer = StepTimer()
    timer.take()
    with timer.phase("backward"):  # as the trainer's training_step holds compute_loss
        busy(0.02)
        with timer.phase("forward"):
            busy(0.05)
        busy(0.02)
    out = timer.take()
    assert 0.05 <= out["forward"] < 0.09
    assert 0.04 <= out["backward"] < 0.08  # the 0.04 s around the forward, not 0.09
    assert out["forward"] + out["backward"] <= out["step"]


def test_the_breakdown_sums_to_the_step_time():
    timer = StepTimer()
    timer.take()
    t0 = time.perf_counter()
    busy(0.01)  # the loader's wait, measured by the loader and added
    timer.add("data_wait", time.perf_counter() - t0)
    with timer.phase("forward"):
        busy(0.01)
    timer.begin("optimizer")
    busy(0.01)
    timer.end("optimizer")
    with timer.phase("backward"):  # a bucket's allreduce in flight during backward
        t0 = time.perf_counter()
        busy(0.01)
        timer.comm_interval(t0, time.perf_counter())
        busy(0.01)
    busy(0.01)  # untimed: "other"
    out = timer.take()
    assert set(PHASES) | {"step", "other"} == set(out)
    assert sum(out[p] for p in PHASES) + out["other"] == pytest.approx(out["step"], rel=1e-9, abs=1e-9)
    assert out["other"] >= 0.009 and out["communication"] >= 0.009 and out["backward"] >= 0.009
    # the next step starts from zero
    again = timer.take()
    assert all(again[p] == 0.0 for p in PHASES)


@pytest.mark.parametrize("calls, flights, exposed, in_flight", [
    # a synchronous hook: only in-flight intervals, all exposed
    ([], [(0.0, 1.0), (2.0, 3.0)], 2.0, 2.0),
    # overlapped: the launches held backward 0.1 s each; the last bucket ran 0.5 s past its launch
    ([(0.0, 0.1), (1.0, 1.1)], [(0.0, 0.9), (1.0, 1.6)], 0.7, 1.5),
    # everything hidden but the launches
    ([(0.0, 0.1), (1.0, 1.1)], [(0.0, 0.5), (1.0, 1.1)], 0.2, 0.6),
    # exposed never exceeds in flight (overlapping launch and flight intervals)
    ([(0.0, 1.0)], [(0.0, 0.5)], 0.5, 0.5),
])
def test_exposed_communication_is_the_launches_plus_the_wait_after_the_last(calls, flights, exposed, in_flight):
    timer = StepTimer()
    for s, e in calls:
        timer.comm_call(s, e)
    for s, e in flights:
        timer.comm_interval(s, e)
    assert timer._comm_seconds() == pytest.approx((exposed, in_flight))


def test_hidden_communication_leaves_backward_and_is_kept_in_flight():
    timer = StepTimer()
    timer.take()
    with timer.phase("backward"):
        t0 = time.perf_counter()
        timer.comm_call(t0, t0 + 0.001)  # the first bucket: launched, in flight while backward computes
        busy(0.03)
        t1 = time.perf_counter()
        timer.comm_interval(t0, t1)
        timer.comm_call(t1, t1 + 0.001)  # the last bucket, when the gradients are all computed
        busy(0.002)  # DDP waits for it
        timer.comm_interval(t1, time.perf_counter())
    out = timer.take()
    assert out["communication"] < 0.01 < 0.025 < timer.comm_in_flight
    assert out["backward"] >= 0.025
    assert sum(out[p] for p in PHASES) + out["other"] == pytest.approx(out["step"], rel=1e-9, abs=1e-9)


def test_phases_must_close_in_order():
    timer = StepTimer()
    timer.begin("backward")
    timer.begin("forward")
    with pytest.raises(RuntimeError, match="'backward' ended while 'forward' is open"):
        timer.end("backward")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_phases_are_measured_with_events_and_no_sync_before_take():
    torch.cuda.init()
    timer = StepTimer()
    timer.take()
    x = torch.randn(4096, 4096, device="cuda")
    with timer.phase("forward"):
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
    assert timer._events and timer._spans  # marks are events, resolved only at take()
    out = timer.take()
    assert out["forward"] > 0 and out["forward"] <= out["step"] + 1e-3

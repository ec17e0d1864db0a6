"""CommStats: per-step counters, percentiles, the compression ratio, nested timing."""
from __future__ import annotations

import threading

import pytest

from rapidfire_ray.exchange import CommStats, fp32_allreduce_bytes


def test_take_returns_and_resets():
    stats = CommStats()
    stats.add_bytes(100, 80, fp32_equivalent=1600)
    stats.add_bytes(50, 70, fp32_equivalent=800)
    for s in [0.01 * i for i in range(1, 101)]:
        stats.add_call(s)
    out = stats.take()
    assert out["bytes_sent"] == 150 and out["bytes_received"] == 150
    assert out["compression_ratio"] == pytest.approx(2400 / 150)
    assert out["comm_calls"] == 100 and out["comm_seconds"] == pytest.approx(50.5)
    assert out["comm_latency_p50_s"] == pytest.approx(0.505)
    assert out["comm_latency_p99_s"] == pytest.approx(0.9901)
    empty = stats.take()
    assert empty == {"bytes_sent": 0, "bytes_received": 0, "comm_seconds": 0.0, "comm_calls": 0,
                     "comm_latency_p50_s": 0.0, "comm_latency_p99_s": 0.0, "compression_ratio": 1.0}
    assert stats.total_bytes_sent == 150 and stats.total_calls == 100


def test_nested_timed_blocks_count_once():
    stats = CommStats()
    with stats.timed():
        with stats.timed():
            pass
        with stats.timed():
            pass
    with stats.timed():
        pass
    assert stats.take()["comm_calls"] == 2


def test_timed_counts_on_error_too():
    stats = CommStats()
    with pytest.raises(RuntimeError), stats.timed():
        raise RuntimeError("x")
    assert stats.calls == 1


def test_threads():
    stats = CommStats()

    def work():
        for _ in range(1000):
            with stats.timed():
                stats.add_bytes(1, 2, 4)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = stats.take()
    assert out["bytes_sent"] == 4000 and out["bytes_received"] == 8000 and out["comm_calls"] == 4000


def test_fp32_allreduce_bytes():
    assert fp32_allreduce_bytes(1000, 1) == 0
    assert fp32_allreduce_bytes(1000, 2) == 4000
    assert fp32_allreduce_bytes(1000, 4) == 6000

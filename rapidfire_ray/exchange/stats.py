"""Bytes and latency of gradient communication, per optimizer step.

The code that sends a payload counts it (`add_bytes`): the `numel()` of each uint8 payload that
goes into a collective, per rank, once per peer it reaches, for sends and for receives. The
counts are logical bytes, the same on every backend: a point-to-point send of B bytes counts B;
an all_gather of a B-byte payload over n ranks counts (n-1)*B sent and (n-1)*B received (what a
ring all-gather moves per rank); an allreduce of B bytes counts 2*(n-1)*B/n each way (a ring
allreduce: reduce-scatter then all-gather).

`compression_ratio` compares with what a plain float32 ring allreduce of the same elements
would have moved (2*(n-1)/n * 4 bytes per element sent): 1.0 for the uncompressed path, ~31.5
for the 1-bit two-phase allreduce at the default chunk of 2048 (its two phases move the same
2*(n-1)/n share of the data, at 1 bit + 4 bytes per 2048 elements instead of 32 bits), ~2 for
fp16, 1.0 when nothing was sent (world size 1).

Latency: one entry per top-level call (a compressed allreduce, or one DDP bucket in the hook;
calls nested inside a timed call are not counted twice), wall time including encode/decode, with
a device sync on CUDA so the GPU work is inside the interval.
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager

import torch


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def fp32_allreduce_bytes(numel: int, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a float32 ring allreduce of `numel` elements."""
    return 2.0 * (world_size - 1) * 4 * numel / world_size if world_size > 1 else 0.0


class CommStats:
    """Per-step communication counters; `take()` returns them and starts the next step.

    Attributes (this step so far): bytes_sent, bytes_received, fp32_bytes (what float32 would
    have sent), seconds (sum of call latencies), calls, latencies (seconds per call). The
    `total_*` attributes keep the whole run's sums. Thread-safe: DDP runs hooks on autograd
    threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.total_bytes_sent = 0
        self.total_bytes_received = 0
        self.total_seconds = 0.0
        self.total_calls = 0
        self._reset()

    def _reset(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.fp32_bytes = 0.0
        self.seconds = 0.0
        self.calls = 0
        self.latencies: list[float] = []

    def add_bytes(self, sent: int, received: int, fp32_equivalent: float = 0.0) -> None:
        """Count `sent`/`received` payload bytes, and the float32 bytes they stand in for (0 for
        control messages such as the non-finite flag, which plain DDP would not send)."""
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_received += int(received)
            self.fp32_bytes += float(fp32_equivalent)
            self.total_bytes_sent += int(sent)
            self.total_bytes_received += int(received)

    def add_call(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds
            self.calls += 1
            self.latencies.append(seconds)
            self.total_seconds += seconds
            self.total_calls += 1

    @contextmanager
    def timed(self, device: torch.device | None = None):
        """Time the enclosed block as one call, unless it is nested in another timed block of
        this object on the same thread (then the outer block is the call). With a CUDA `device`
        the current stream (the exchange's: the side stream of an overlapped hook) is
        synchronised before the clock stops, not the whole device."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                if device is not None and device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                self.add_call(time.perf_counter() - start)

    def take(self) -> dict:
        """This step's counters (then reset): bytes_sent, bytes_received, comm_seconds,
        comm_calls, comm_latency_p50_s, comm_latency_p99_s, compression_ratio."""
        with self._lock:
            lat = sorted(self.latencies)
            sent = self.bytes_sent
            ratio = self.fp32_bytes / sent if sent else 1.0
            out = {
                "bytes_sent": sent,
                "bytes_received": self.bytes_received,
                "comm_seconds": self.seconds,
                "comm_calls": self.calls,
                "comm_latency_p50_s": _percentile(lat, 0.50),
                "comm_latency_p99_s": _percentile(lat, 0.99),
                "compression_ratio": ratio,
            }
            self._reset()
        return out

    def __repr__(self) -> str:
        return (f"CommStats(bytes_sent={self.bytes_sent}, bytes_received={self.bytes_received}, "
                f"calls={self.calls}, seconds={self.seconds:.6f})")

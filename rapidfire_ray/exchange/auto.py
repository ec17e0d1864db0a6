"""`compression.grad: auto`: compress a bucket only where that makes its exchange faster.

    link, speeds = measure(group, device, policy, elements=2**21)     # every rank, same call
    codec, predicted = choose_codec(numel, world_size, link, speeds)  # pure: same inputs -> same codec

The prediction per codec (seconds, one bucket of `numel` float32 gradient elements, one rank):

    none, fp16   prepare * numel + allreduce_latency + 2 (n-1)/n * 4 or 2 bytes * numel / allreduce_bytes_s
    1bit, 2bit   roundtrip * (padded + m) + decode * 2 (n-1) m                       (codec work)
                 + exchange_latency + 2 (n-1) * wire_bytes(m) / exchange_bytes_s     (two phases)

with m, padded = layout(numel, n): the two-phase compressed allreduce (allreduce.py) encodes and
decodes the whole padded tensor with worker error feedback, then, as server of one chunk of m,
decodes the n-1 chunks it received, encodes and decodes their average (server error feedback)
and decodes the n-1 chunks all-gathered back; it sends n-1 chunks in phase 1 and its server chunk
to n-1 peers in phase 2. `prepare` is what the hook does to a plain allreduce's input (divide;
fp16 also clamps and casts, and copies the result back).

The link is measured twice, once per pattern, because the two travel differently (a ring or
tree allreduce vs point-to-point chunks to every peer, which on nodes with several GPUs share
the node's NIC): a timed allreduce and a timed two-phase exchange of uint8 payloads of known
size, each also at 8 bytes for the fixed cost. Sizes grow 4x from 16 KiB until one call takes
50 ms (or the cap): enough to see the rate on a slow link, not minutes.

Agreement: every rank must pick the same codec per bucket, or the collectives that follow do
not match and the run hangs. So every number the choice depends on is agreed before anyone
chooses: every timing (the codecs' in one allreduce, each link probe's as it is taken) is
reduced with MAX over the group, and `choose_codec` is a pure function of those numbers. The
hook also checks the result (a MIN/MAX allreduce of the codec indices) and stops the run with a
clear error instead of hanging if ranks ever disagree.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..compression import Codec, get_codec
from .allreduce import AllreduceState, layout, local_decode, local_roundtrip

#: Least lossy first: on equal predicted times the less lossy codec wins.
PREFERENCE = ("none", "fp16", "2bit", "1bit")
FP16_MAX = torch.finfo(torch.float16).max

#: Link probe: first payload, growth factor, the time one call should reach, largest payload.
PROBE_START_BYTES = 16 * 1024
PROBE_GROWTH = 4
PROBE_TARGET_S = 0.05
PROBE_MAX_BYTES = 64 * 2**20
PROBE_REPEATS = 2
#: Codec probe: elements of the buffer the codecs are timed on (the model's trainable size, at
#: most this; a GPU needs a larger buffer than a CPU core to reach its streaming rate).
CODEC_PROBE_MAX_ELEMENTS = {"cpu": 2**20, "cuda": 2**23}
CODEC_REPEATS = 2


@dataclass(frozen=True)
class LinkRate:
    """What the link between the workers moves, per rank: payload bytes per second and the fixed
    cost of one call, for a plain allreduce and for the two-phase compressed exchange."""

    allreduce_bytes_s: float  # ring convention: 2 (n-1)/n * payload bytes / time
    allreduce_latency_s: float
    exchange_bytes_s: float  # bytes one rank sends in both phases / time
    exchange_latency_s: float


@dataclass(frozen=True)
class CodecSpeed:
    """Seconds per float32 element on this device."""

    roundtrip_s: float  # none/fp16: the hook's preparation; 1bit/2bit: encode + decode + error feedback
    decode_s: float = 0.0  # decode alone (received chunks); 0 for none/fp16


def fp16_prepare(flat: torch.Tensor, world_size: int) -> torch.Tensor:
    """The hook's fp16 payload: the mean's share, clamped into fp16's range, cast."""
    limit = 0.99 * FP16_MAX / world_size
    return (flat.to(torch.float32) / world_size).clamp_(-limit, limit).to(torch.float16)


# --- the choice (pure) -----------------------------------------------------------------------------


def predict_s(codec: str, numel: int, world_size: int, link: LinkRate, speed: CodecSpeed,
              chunk_size: int = 2048) -> float:
    """Predicted seconds for one rank to average `numel` float32 elements with `codec` (see the
    module docstring for the formula)."""
    if numel <= 0:
        return 0.0
    n = world_size
    if codec in ("none", "fp16"):
        work = speed.roundtrip_s * numel
        if n <= 1:
            return work
        wire = 2 * (n - 1) / n * (4 if codec == "none" else 2) * numel
        return work + link.allreduce_latency_s + wire / link.allreduce_bytes_s
    m, padded = layout(numel, n)
    if n <= 1:
        return speed.roundtrip_s * padded
    work = speed.roundtrip_s * (padded + m) + speed.decode_s * 2 * (n - 1) * m
    wire = 2 * (n - 1) * wire_bytes(codec, m, chunk_size)
    return work + link.exchange_latency_s + wire / link.exchange_bytes_s


def wire_bytes(codec: str, numel: int, chunk_size: int = 2048) -> int:
    """Bytes of `numel` elements encoded with `codec` (the codec's own formula)."""
    return _codec(codec, chunk_size).wire_bytes(numel)


def choose_codec(numel: int, world_size: int, link: LinkRate, speeds: Mapping[str, CodecSpeed],
                 chunk_size: int = 2048) -> tuple[str, dict[str, float]]:
    """The codec among `speeds`' keys with the smallest predicted time for one bucket of `numel`
    elements on `world_size` ranks, and every candidate's predicted seconds. Ties go to the less
    lossy codec (`PREFERENCE`). Pure: the same numbers give the same codec on every rank."""
    unknown = sorted(set(speeds) - set(PREFERENCE))
    if unknown or not speeds:
        raise ValueError(f"choose_codec: candidates must be among {PREFERENCE}, got {sorted(speeds)}")
    predicted = {c: predict_s(c, numel, world_size, link, speeds[c], chunk_size) for c in PREFERENCE if c in speeds}
    best = min(predicted, key=lambda c: (predicted[c], PREFERENCE.index(c)))
    return best, predicted


# --- measuring (collective: every rank of the group calls it, at the same point) -------------------


_CODECS: dict[tuple[str, int], Codec] = {}


def _codec(name: str, chunk_size: int) -> Codec:
    key = (name, chunk_size if name in ("1bit", "2bit") else 0)
    if key not in _CODECS:
        _CODECS[key] = get_codec(name, **({"chunk_size": chunk_size} if name in ("1bit", "2bit") else {}))
    return _CODECS[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Shortest wall time of `repeats` calls of `fn`, after one untimed call (first-call costs)."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def codec_times(codecs: Mapping[str, Codec], elements: int, device: torch.device, world_size: int,
                repeats: int = CODEC_REPEATS) -> dict[str, tuple[float, float]]:
    """This rank's (roundtrip, decode) seconds per element for each codec, timed on a buffer of
    `elements` float32 values biased away from zero: 1bit/2bit through the worker phase on the
    path training takes (`local_roundtrip`: error added, encoded, decoded, error kept; the fused
    kernels, native ones where built) and its decode (`local_decode`), none/fp16 through the
    hook's own preparation of a plain allreduce."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(elements, generator=g).to(device)
    x = torch.where(x < 0, x - 0.5, x + 0.5)
    out = {}
    for name, codec in codecs.items():
        if name == "none":
            buf = x.clone()
            t = _best_of(lambda: buf.div_(world_size), device, repeats)
            out[name] = (t / elements, 0.0)
        elif name == "fp16":
            buf = x.clone()
            t = _best_of(lambda: buf.copy_(fp16_prepare(buf, world_size)), device, repeats)
            out[name] = (t / elements, 0.0)
        else:
            state = AllreduceState()
            roundtrip = _best_of(lambda: local_roundtrip(x, codec, state), device, repeats)
            payload = codec.encode(x).payload  # the same bytes on every path
            decode = _best_of(lambda: local_decode(codec, payload, elements), device, repeats)
            out[name] = (roundtrip / elements, decode / elements)
    return out


def _allreduce_call(group, device, nbytes: int) -> Callable[[], None]:
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    return lambda: dist.all_reduce(buf, group=group)


def _exchange_call(group, device, nbytes: int, ws: int, rank: int) -> Callable[[], None]:
    """The compressed allreduce's traffic pattern with `nbytes`-byte uint8 chunks: one chunk to
    every peer point to point, then an all_gather of one chunk."""
    send = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=device)
    recv = {i: torch.empty_like(send) for i in range(ws) if i != rank}
    gathered = [torch.empty_like(send) for _ in range(ws)]

    def call():
        ops = [dist.P2POp(dist.isend, send, group=group, group_peer=j) for j in range(ws) if j != rank]
        ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=i) for i, buf in recv.items()]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        dist.all_gather(gathered, send, group=group)

    return call


def _agreed_max(values: list[float], group, device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _probe(make_call: Callable[[int], Callable[[], None]], group, device, max_bytes: int) -> tuple[float, float, int]:
    """(seconds at 8 bytes, seconds at the final payload, that payload in bytes), agreed (MAX)."""
    latency = _agreed_max([_best_of(make_call(8), device, PROBE_REPEATS + 1)], group, device)[0]
    nbytes = min(PROBE_START_BYTES, max_bytes)
    while True:
        t = _agreed_max([_best_of(make_call(nbytes), device, PROBE_REPEATS)], group, device)[0]
        if t >= PROBE_TARGET_S or nbytes >= max_bytes:
            return latency, t, nbytes
        nbytes = min(nbytes * PROBE_GROWTH, max_bytes)


def _rate(payload_bytes: float, seconds: float, latency: float) -> float:
    # The fixed cost is taken out; at least 5% of the call is left to the bytes (noise at small sizes).
    return payload_bytes / max(seconds - latency, 0.05 * seconds, 1e-9)


@dataclass(frozen=True)
class Measurement:
    """One agreed measurement: the link, the codecs' speeds, and the probes' raw numbers."""

    world_size: int
    link: LinkRate
    speeds: dict[str, CodecSpeed]
    probe: dict  # payload sizes and times behind `link`; codec buffer size
    seconds: float  # how long the measurement itself took on this rank

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "link": asdict(self.link) if self.world_size > 1 else None,
                "speeds": {k: asdict(v) for k, v in self.speeds.items()}, "probe": dict(self.probe),
                "measure_s": round(self.seconds, 4)}


def measure(codecs: Mapping[str, Codec], device: torch.device, group=None, elements: int = 2**23,
            max_link_bytes: int = PROBE_MAX_BYTES) -> Measurement:
    """Time the link (over `group`) and `codecs` (on `device`, `elements` values, at most
    CODEC_PROBE_MAX_ELEMENTS for the device type), agreed over the group: every rank returns the same numbers (the
    MAX over ranks of each). Collective: every rank of the group calls it at the same point. Not
    in a process group (or alone in it): no link, the codecs only."""
    start = time.perf_counter()
    ws, rank = 1, 0
    if dist.is_available() and dist.is_initialized():
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
    elements = max(1, min(int(elements), CODEC_PROBE_MAX_ELEMENTS.get(device.type, 2**20)))
    names = [c for c in PREFERENCE if c in codecs]
    local = codec_times({c: codecs[c] for c in names}, elements, device, ws)
    flat = [v for c in names for v in local[c]]
    probe: dict = {"codec_elements": elements}
    if ws > 1:
        flat = _agreed_max(flat, group, device)  # also lines the ranks up before the link probes
        max_link_bytes = max(PROBE_START_BYTES, min(int(max_link_bytes), PROBE_MAX_BYTES))
        ar_lat, ar_t, ar_bytes = _probe(lambda b: _allreduce_call(group, device, b), group, device, max_link_bytes)
        chunk_cap = max(1, max_link_bytes // ws)
        ex_lat, ex_t, ex_chunk = _probe(lambda b: _exchange_call(group, device, b, ws, rank), group, device, chunk_cap)
        ring = 2 * (ws - 1) / ws * 4 * max(1, ar_bytes // 4)
        sent = 2 * (ws - 1) * ex_chunk
        link = LinkRate(allreduce_bytes_s=_rate(ring, ar_t, ar_lat), allreduce_latency_s=ar_lat,
                        exchange_bytes_s=_rate(sent, ex_t, ex_lat), exchange_latency_s=ex_lat)
        probe.update({"allreduce_bytes": ar_bytes, "allreduce_s": ar_t, "exchange_chunk_bytes": ex_chunk,
                      "exchange_s": ex_t})
    else:
        link = LinkRate(math.inf, 0.0, math.inf, 0.0)
    speeds = {c: CodecSpeed(flat[2 * i], flat[2 * i + 1]) for i, c in enumerate(names)}
    return Measurement(ws, link, speeds, probe, time.perf_counter() - start)

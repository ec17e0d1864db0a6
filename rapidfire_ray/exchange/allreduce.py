"""The two-phase compressed allreduce of 1-bit Adam (arXiv 2102.02888), for any codec.

Every rank holds a tensor of the same size and gets back the same approximation of the mean:
phase 1 each rank encodes its chunks (worker error feedback) and sends chunk j to rank j;
phase 2 rank j averages chunk j, encodes it (server error feedback) and all ranks all-gather
the results. 2 * (n-1) * codec.wire_bytes(m) bytes sent per rank and call. Non-finite input
raises NonFiniteGradient before any communication. World size 1: phase 1 alone.

Layout, padding, the error-feedback identity and overflow handling: docs/exchange.md.
By default the codecs run on the whole bucket in a few fused kernels (compression/fused.py);
`fused=False` or RAPIDFIRE_CODEC_PATH=reference runs the per-chunk reference path, which gives
the same bytes, results and error buffers.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..compression import Codec, Encoded, NonFiniteGradient
from ..compression import fused as fused_codecs
from .stats import CommStats, fp32_allreduce_bytes

#: Each rank's chunk is a multiple of this many elements.
ALIGN = 8

_F32_MAX = torch.finfo(torch.float32).max


@dataclass
class AllreduceState:
    """Error feedback of one compressed allreduce "slot" (a tensor of fixed numel, one codec,
    one group). `worker_error`: float32, the padded flat size, on the tensor's device.
    `server_error`: float32, this rank's server chunk (m elements). None until first used, and
    None for a lossless codec."""

    worker_error: torch.Tensor | None = None
    server_error: torch.Tensor | None = None
    #: Scratch of worker_error's size that the one-pass native kernel writes the new residual
    #: into (then the two swap), so a NaN found mid-pass leaves worker_error as it was without
    #: a separate NaN/inf pass first. Not saved.
    spare: torch.Tensor | None = field(default=None, repr=False)
    #: Buffers the fused path reuses from call to call (received and gathered payloads, the
    #: server's average): on CPU a fresh large tensor costs a page fault per 4 KiB on first
    #: touch, more than the codec's own pass. Not saved.
    scratch: dict = field(default_factory=dict, repr=False)

    def buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The scratch buffer `key` of this shape, dtype and device (contents undefined)."""
        t = self.scratch.get(key)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
            t = self.scratch[key] = torch.empty(shape, dtype=dtype, device=device)
        return t

    def state_dict(self) -> dict:
        """CPU copies of the error buffers (None where there is none)."""
        return {"worker_error": _cpu_copy(self.worker_error), "server_error": _cpu_copy(self.server_error)}

    def load_state_dict(self, d: dict) -> None:
        """Replace both buffers with copies of those in `d` (kept on their device, CPU from a
        checkpoint; moved to the tensor's device on first use)."""
        for key in ("worker_error", "server_error"):
            value = d.get(key)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"AllreduceState: {key} must be a tensor or None, got {type(value).__name__}")
            setattr(self, key, None if value is None else value.detach().to(torch.float32, copy=True).reshape(-1))

    def reset(self) -> None:
        self.worker_error = None
        self.server_error = None
        self.spare = None
        self.scratch.clear()


def _cpu_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


def layout(numel: int, world_size: int) -> tuple[int, int]:
    """(m, padded): elements per rank chunk and the padded flat size for `numel` elements."""
    step = world_size * ALIGN
    padded = -(-numel // step) * step
    return padded // world_size, padded


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    ws = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("compressed_allreduce: this process is not a member of `group`")
    return ws, rank


def _buffer(t: torch.Tensor | None, size: int, device: torch.device, what: str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.numel() != size:
        raise ValueError(f"compressed_allreduce: state.{what} has {t.numel()} elements, this call needs {size} "
                         f"(a different tensor size, codec or world size uses this state; reset it)")
    return t.to(device=device, dtype=torch.float32).reshape(-1)


def _finite_(t: torch.Tensor) -> torch.Tensor:
    # Finite inputs can only leave the float32 range by overflow; clamp instead of producing inf.
    return t.clamp_(-_F32_MAX, _F32_MAX)


def _check_finite(flat: torch.Tensor, codec: Codec) -> None:
    # A sum is finite unless a term is not (or finite terms overflow: then look at each): one
    # fast pass instead of isfinite's three.
    if not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):
        raise NonFiniteGradient(None, codec.name)


def _worker_phase(flat: torch.Tensor, codec: Codec, state: AllreduceState, ws: int, m: int, padded: int):
    """Phase 1 on one rank: (encoded chunks, decoded padded tensor, new worker error)."""
    n = flat.numel()
    corrected = torch.zeros(padded, dtype=torch.float32, device=flat.device)
    corrected[:n] = flat
    err = _buffer(state.worker_error, padded, flat.device, "worker_error")
    if err is not None:
        corrected += err
    _finite_(corrected)
    encoded = [codec.encode(corrected[j * m:(j + 1) * m]) for j in range(ws)]
    if codec.lossless:
        return encoded, corrected, None
    decoded = torch.cat([codec.decode(e) for e in encoded])
    new_err = corrected.sub_(decoded)
    new_err[n:] = 0
    return encoded, decoded, _finite_(new_err)


def _server_phase(chunks: list[torch.Tensor], codec: Codec, server_error: torch.Tensor | None, valid: int):
    """Phase 2 on the server of one chunk: (encoded, decoded, new server error). `chunks`: the
    decoded copies from every rank, in rank order; `valid`: real (not padding) elements."""
    m = chunks[0].numel()
    avg = chunks[0].clone()
    for c in chunks[1:]:
        avg += c
    avg /= len(chunks)
    if valid < m:
        avg[valid:] = 0
    err = _buffer(server_error, m, avg.device, "server_error")
    if err is not None:
        avg += err
    _finite_(avg)
    encoded = codec.encode(avg)
    if codec.lossless:
        return encoded, avg, None
    decoded = codec.decode(encoded)
    new_err = avg.sub_(decoded)
    new_err[valid:] = 0
    return encoded, decoded, _finite_(new_err)


def _as_encoded(codec: Codec, payload: torch.Tensor, m: int) -> Encoded:
    return Encoded(codec.name, payload, m, (m,), torch.float32)


def compressed_allreduce(tensor: torch.Tensor, codec: Codec, state: AllreduceState, group=None,
                         stats: CommStats | None = None, fused: bool | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Average of `tensor` over the ranks of `group`, through the two-phase compressed allreduce of
    1-bit Adam with worker and server error feedback. Returns a float32 tensor of tensor's shape
    (identical on every rank): `out` where given (a contiguous float32 tensor of tensor's numel on
    its device; it may be `tensor` itself, which is read in full before `out` is written), else a
    new one. World size 1: compress + decompress with error feedback, no collective.

    Every rank must call it with the same numel, codec and group, in the same order. `state`
    holds this slot's error feedback and is updated only when the call succeeds. NaN/inf in
    `tensor` raise NonFiniteGradient before any communication (docs/exchange.md)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"compressed_allreduce: expected a floating-point tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    if out is not None and not (out.dtype == torch.float32 and out.is_contiguous()
                                and out.numel() == tensor.numel() and out.device == tensor.device):
        raise ValueError(f"compressed_allreduce: out must be a contiguous float32 tensor of {tensor.numel()} "
                         f"elements on {tensor.device}")
    ws, rank = _world(group)
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device) if out is None else out
    m, padded = layout(n, ws)
    if fused if fused is not None else fused_codecs.use_fused(codec):
        with (stats.timed(tensor.device) if stats is not None else nullcontext()):
            result = _fused_allreduce(flat, codec, state, group, stats, ws, rank, m, padded,
                                      None if out is None else out.view(-1))
            return result.view(tensor.shape)
    _check_finite(flat, codec)
    with (stats.timed(tensor.device) if stats is not None else nullcontext()):
        result = _reference_allreduce(flat, codec, state, group, stats, ws, rank, m, padded)
        if out is None:
            return result.reshape(tensor.shape)
        return out.copy_(result.view(out.shape))


def _reference_allreduce(flat: torch.Tensor, codec: Codec, state: AllreduceState, group, stats, ws: int,
                         rank: int, m: int, padded: int) -> torch.Tensor:
    """compressed_allreduce on the per-chunk reference path: a new flat float32 tensor."""
    n = flat.numel()
    encoded, decoded, worker_error = _worker_phase(flat, codec, state, ws, m, padded)
    if ws == 1:
        state.worker_error = worker_error
        return decoded[:n].clone()

    # Phase 1: chunk j to rank j, point to point.
    nbytes = codec.wire_bytes(m)
    received = {i: torch.empty(nbytes, dtype=torch.uint8, device=flat.device) for i in range(ws) if i != rank}
    ops = [dist.P2POp(dist.isend, encoded[j].payload, group=group, group_peer=j) for j in range(ws) if j != rank]
    ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=i) for i, buf in received.items()]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    sent = sum(encoded[j].payload.numel() for j in range(ws) if j != rank)
    got = sum(buf.numel() for buf in received.values())

    # Phase 2: this rank serves chunk `rank`.
    chunks = [decoded[rank * m:(rank + 1) * m] if i == rank else codec.decode(_as_encoded(codec, received[i], m))
              for i in range(ws)]
    valid = min(max(n - rank * m, 0), m)
    server_encoded, server_decoded, server_error = _server_phase(chunks, codec, state.server_error, valid)
    payload = server_encoded.payload
    gathered = [torch.empty_like(payload) for _ in range(ws)]
    dist.all_gather(gathered, payload, group=group)
    sent += (ws - 1) * payload.numel()
    got += sum(gathered[j].numel() for j in range(ws) if j != rank)

    out = torch.cat([server_decoded if j == rank else codec.decode(_as_encoded(codec, gathered[j], m))
                     for j in range(ws)])[:n]
    state.worker_error = worker_error
    state.server_error = server_error
    if stats is not None:
        stats.add_bytes(sent, got, fp32_allreduce_bytes(n, ws))
    return out


def _fused_allreduce(flat: torch.Tensor, codec: Codec, state: AllreduceState, group, stats, ws: int, rank: int,
                     m: int, padded: int, out: torch.Tensor | None) -> torch.Tensor:
    """compressed_allreduce on the fused codecs, flat in and out: each phase encodes all its
    chunks in one call; the server decodes and averages the received chunks in one call, every
    rank decodes the gathered ones in one call into `out` (or a new tensor); the payload and
    average buffers are the state's scratch, reused call to call. Same bytes and results as
    the reference."""
    n = flat.numel()
    device = flat.device
    lossy = not codec.lossless
    err = _buffer(state.worker_error, padded, device, "worker_error")
    # The one-pass native kernel finds NaN/inf itself and writes the residual into the spare
    # buffer; otherwise the input is checked first and the error buffer updated in place (a
    # failed collective leaves the process group unusable anyway).
    one_pass = fused_codecs.native_encodes(codec, flat, err)
    spare = None
    if one_pass:
        spare = state.spare
        if spare is None or spare.numel() != padded or spare.device != device:
            spare = torch.empty(padded, dtype=torch.float32, device=device)
    else:
        _check_finite(flat, codec)
    payload, decoded, worker_error = fused_codecs.encode_segments(
        codec, flat, ws, m, error=err, residual=lossy, valid=n, clamp=True, finite=not one_pass,
        decoded=ws == 1, in_place=not one_pass, residual_out=spare)
    worker_error = None if worker_error is None else worker_error.view(-1)

    def commit():
        state.worker_error = worker_error
        if one_pass:
            state.spare = err  # the old residual, free now (None at the first step)

    if ws == 1:
        commit()
        result = decoded.view(-1)[:n]  # a fresh buffer of ours: no copy needed
        return result if out is None else out.copy_(result)

    # Phase 1: chunk j to rank j, received into the rows of one buffer (ours copied in, so that
    # one call decodes them all: decoding our own bytes gives exactly our decoded chunk).
    row_bytes = payload.shape[1]
    received = state.buffer("received", (ws, row_bytes), torch.uint8, device)
    received[rank].copy_(payload[rank])
    ops = [dist.P2POp(dist.isend, payload[j], group=group, group_peer=j) for j in range(ws) if j != rank]
    ops += [dist.P2POp(dist.irecv, received[i], group=group, group_peer=i) for i in range(ws) if i != rank]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    sent = got = (ws - 1) * row_bytes

    # Phase 2: this rank serves chunk `rank`: the mean of the decoded chunks (padding excluded).
    valid = min(max(n - rank * m, 0), m)
    # Into a reused buffer where the native kernel writes it directly (elsewhere: a new tensor, no copy).
    reuse = fused_codecs.native_decoder(codec, device) is not None
    avg = fused_codecs.decode_mean(codec, received, m,
                                   out=state.buffer("average", (valid,), torch.float32, device) if reuse else None)
    avg = avg[:valid]
    server_err = _buffer(state.server_error, m, device, "server_error")
    server_payload, _, server_error = fused_codecs.encode_segments(
        codec, avg, 1, m, error=server_err, residual=lossy, valid=valid, clamp=True, finite=True,
        decoded=False, in_place=True)
    gathered = state.buffer("gathered", (ws, row_bytes), torch.uint8, device)
    dist.all_gather(list(gathered.unbind(0)), server_payload[0], group=group)
    sent += (ws - 1) * row_bytes
    got += (ws - 1) * row_bytes

    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=device)
    fused_codecs.decode_segments(codec, gathered, m, out=out)
    commit()
    state.server_error = None if server_error is None else server_error.view(-1)
    if stats is not None:
        stats.add_bytes(sent, got, fp32_allreduce_bytes(n, ws))
    return out


def local_roundtrip(flat: torch.Tensor, codec: Codec, state: AllreduceState) -> torch.Tensor:
    """One rank's worker phase without a collective: `flat` plus `state`'s error feedback,
    encoded and decoded as a world of one on the path training takes (fused, with the native
    kernel where it applies, or the reference per RAPIDFIRE_CODEC_PATH); `state` is updated.
    What exchange/auto.py times."""
    flat = flat.detach().reshape(-1)
    m, padded = layout(flat.numel(), 1)
    if fused_codecs.use_fused(codec):
        return _fused_allreduce(flat, codec, state, None, None, 1, 0, m, padded, None)
    return simulate_compressed_allreduce([flat], codec, [state])[0]


def local_decode(codec: Codec, payload: torch.Tensor, numel: int) -> torch.Tensor:
    """Decoding one received chunk's bytes on the path training takes (fused or reference)."""
    if fused_codecs.use_fused(codec):
        return fused_codecs.decode_segments(codec, payload.view(1, -1), numel)[0]
    return codec.decode(Encoded(codec.name, payload, numel, (numel,), torch.float32))


def simulate_compressed_allreduce(tensors: list[torch.Tensor], codec: Codec,
                                  states: list[AllreduceState]) -> list[torch.Tensor]:
    """The same algorithm in one process on a list of per-rank tensors (the reference the tests compare to).

    `tensors[r]` and `states[r]` play rank r; returns one output per rank (equal tensors)."""
    ws = len(tensors)
    if ws == 0 or len(states) != ws:
        raise ValueError(f"simulate_compressed_allreduce: {ws} tensors and {len(states)} states")
    shape = tuple(tensors[0].shape)
    if any(tuple(t.shape) != shape for t in tensors):
        raise ValueError("simulate_compressed_allreduce: all ranks' tensors must have one shape")
    flats = [t.detach().reshape(-1) for t in tensors]
    n = flats[0].numel()
    if n == 0:
        return [torch.zeros(shape, dtype=torch.float32, device=t.device) for t in tensors]
    for flat in flats:
        _check_finite(flat, codec)
    m, padded = layout(n, ws)
    phases = [_worker_phase(flat, codec, state, ws, m, padded) for flat, state in zip(flats, states)]
    if ws == 1:
        out = phases[0][1][:n]
        states[0].worker_error = phases[0][2]
        return [out.reshape(shape).clone()]
    servers = []
    for j in range(ws):
        chunks = [decoded[j * m:(j + 1) * m] for _, decoded, _ in phases]
        servers.append(_server_phase(chunks, codec, states[j].server_error, min(max(n - j * m, 0), m)))
    out = torch.cat([decoded for _, decoded, _ in servers])[:n].reshape(shape)
    for r in range(ws):
        states[r].worker_error = phases[r][2]
        states[r].server_error = servers[r][2]
    return [out.clone() for _ in range(ws)]

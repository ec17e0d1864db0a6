"""The codecs on flat buckets in a few fused kernels: the fast path the training path uses.

One call handles a whole bucket split into `S` equal segments of `m` elements (the two-phase
allreduce's rank chunks; S = 1 for a plain bucket), each segment encoded exactly as
`codec.encode(segment)` would encode it: the same wire bytes, the same decoded values and the
same residuals, bit for bit (tests/compression/test_fused.py). The plain per-tensor codec
methods stay the reference; `RAPIDFIRE_CODEC_PATH=reference` makes the training path use them.

How each step stays bit-identical while getting faster:
- per-chunk scales (and the NaN/inf check they double as): mean_abs sums each chunk in
  `codec.pairwise_sum`'s fixed order, which is elementwise at every level, so a compiled kernel
  (or the native one, native.py) gives the reference's bits; rms uses the reference's own
  function on the same padded (chunks, chunk_size) tensor per segment (ATen's reduction layout
  depends on the row count);
- everything else (padding, error feedback add, signs/levels, bit packing, payload assembly,
  decode, residual) is elementwise or integer arithmetic, which any backend computes exactly;
  it is written as one function per step that `torch.compile` fuses (inductor: C++ on CPU,
  Triton on CUDA), or that runs eagerly where compiling does not pay;
- 2bit's sparse top-k uses the reference's selection itself (ties broken the same way).

Compiling: lazily, once per (kernel, codec options, device type), with dynamic shapes so new
bucket sizes do not recompile. `RAPIDFIRE_CODEC_COMPILE`: "auto" (default: compile for
segments of at least `RAPIDFIRE_CODEC_COMPILE_MIN_NUMEL` elements, default 1M on CPU and 64K
on CUDA; if compiling fails, one warning and the same functions run eagerly), "off" (always
eager), "always" (compile at every size and raise on failure: what the tests use).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import native
from .codec import (FLOAT32_MAX, Codec, NonFiniteGradient, chunk_counts, chunk_mean_abs, num_chunks,
                    pairwise_sum, raise_if_nonfinite, view_as_dtype)
from .fp16 import FP16_MAX
from .onebit import SCALES
from .twobit import INNER, MAX_NUMEL, OUTER, THRESHOLD, top_magnitude_indices

PATH_ENV = "RAPIDFIRE_CODEC_PATH"
COMPILE_ENV = "RAPIDFIRE_CODEC_COMPILE"
MIN_NUMEL_ENV = "RAPIDFIRE_CODEC_COMPILE_MIN_NUMEL"
PATHS = ("fused", "reference")
COMPILE_MODES = ("auto", "off", "always")
#: Segment size (elements) from which compiling pays, by device type. CPU: measured with
#: bench/codecs.py (below ~1M elements the eager functions are within a few percent and a
#: compile costs seconds); CUDA: eager launches ~20 small kernels per call, so compile sooner.
DEFAULT_MIN_NUMEL = {"cpu": 1 << 20, "cuda": 1 << 16}
#: Kernels left eager on CPU under "auto": inductor's C++ for the 2-bit codes (uint8 levels,
#: 4 codes a byte) measured 1.5x slower than the eager functions here (bench/codecs.py).
EAGER_ON_CPU = frozenset({"2bit", "2bit-decode"})


def _env_choice(env: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(env, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{env}={value!r}: choose one of {', '.join(choices)}")
    return value


def codec_path() -> str:
    """"fused" (default) or "reference", from RAPIDFIRE_CODEC_PATH."""
    return _env_choice(PATH_ENV, PATHS, "fused")


def use_fused(codec: Codec) -> bool:
    """Whether the training path runs `codec` through this module (only the built-in codecs)."""
    return codec_path() == "fused" and type(codec).name in _KINDS


# --- compiling ------------------------------------------------------------------------------

_compiled: dict[tuple, Callable] = {}
_failed: dict[str, str] = {}  # device type -> why compiling failed there (eager from then on)


def compile_failures() -> dict[str, str]:
    """Device types where compiling failed in this process, with the reason (empty: none)."""
    return dict(_failed)


def _min_numel(device: torch.device) -> int:
    raw = os.environ.get(MIN_NUMEL_ENV)
    if raw is None:
        return DEFAULT_MIN_NUMEL.get(device.type, 1 << 16)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{MIN_NUMEL_ENV}={raw!r}: expected an integer number of elements") from None


def _run(key: tuple, fn: Callable, device: torch.device, numel: int, *args):
    """`fn(*args)`, compiled when that pays (see the module docstring), else eagerly."""
    mode = _env_choice(COMPILE_ENV, COMPILE_MODES, "auto")
    if mode == "off" or (mode == "auto" and (numel < _min_numel(device) or device.type in _failed
                                             or (device.type == "cpu" and key[0] in EAGER_ON_CPU))):
        return fn(*args)
    full_key = key + (device.type,)
    compiled = _compiled.get(full_key)
    if compiled is None:
        # emulate_precision_casts: fp16 rounding must happen where the reference rounds, not
        # be skipped because inductor computes half values in float32.
        compiled = _compiled[full_key] = torch.compile(fn, dynamic=None, fullgraph=True,
                                                       options={"emulate_precision_casts": True})
    # Bucket sizes of 1 (segments, whole chunks) and the optional outputs each make a graph.
    with torch._dynamo.config.patch(recompile_limit=64):
        if mode == "always":
            return compiled(*args)
        try:
            return compiled(*args)
        except Exception as e:  # no compiler, unsupported backend, ...: the same function, eagerly
            _failed[device.type] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"rapidfire_ray codecs: torch.compile failed on {device.type} "
                          f"({_failed[device.type]}); using the eager codec functions (slower, same results)",
                          RuntimeWarning, stacklevel=3)
    return fn(*args)


# --- the steps -------------------------------------------------------------------------------
# Kernels work on (S, m) rows with no padded copy and no masks: inductor's CPU code for masked
# (padded) loads ran 3x slower than plain ones here. Each element's chunk scale is a broadcast
# of the (S, n_chunks) scales; the few codes past the last whole byte are packed eagerly.


def _prepare(flat: torch.Tensor, error: torch.Tensor | None, total: int, clamp: bool,
             in_place: bool) -> torch.Tensor:
    """flat zero-padded to `total` elements plus `error`, clamped to the float32 range when
    asked (eager ops, each at memory speed). Written into `error` itself when `in_place` (one
    fresh full-size buffer less per call: on CPU a fresh buffer costs page faults, measured 4x
    the kernel's time); `flat` itself when there is nothing to do (it is only read then)."""
    n = flat.numel()
    if error is None and not clamp and n == total and flat.dtype == torch.float32:
        return flat
    if error is not None and in_place:
        out = error
        out[:n].add_(flat)
        out[n:].add_(0.0)  # 0 + e, as the reference computes it
    elif error is None:
        out = torch.empty(total, dtype=torch.float32, device=flat.device)
        out[:n].copy_(flat)
        out[n:].zero_()
    else:
        out = torch.empty(total, dtype=torch.float32, device=flat.device)
        torch.add(flat.to(torch.float32), error[:n], out=out[:n])
        torch.add(error[n:], 0.0, out=out[n:])
    if clamp:
        out.clamp_(-FLOAT32_MAX, FLOAT32_MAX)
    return out


def _pack_whole(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(S, L) uint8 codes, L a multiple of 8 // bits -> (S, L * bits // 8) bytes, LSB-first."""
    per_byte = 8 // bits
    columns = codes.view(codes.shape[0], -1, per_byte)
    packed = columns[:, :, 0]
    for position in range(1, per_byte):
        packed = packed | (columns[:, :, position] << (position * bits))
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(S, B) bytes -> (S, B * 8 // bits) uint8 codes, LSB-first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).view(packed.shape[0], -1)


def _residual(corrected, decoded, clamp: bool):
    res = corrected - decoded
    return res.clamp(-FLOAT32_MAX, FLOAT32_MAX) if clamp else res


def _onebit_chunks(x, s):
    """(..., cs) values, (..., 1) scales -> (signs as uint8, decoded)."""
    positive = x >= 0
    return positive.to(torch.uint8), torch.where(positive, s, -s)


def _onebit_kernel(chunk_size: int, residual: bool, clamp: bool) -> Callable:
    # Whole chunks only, as (S, w, chunk_size) views with a static inner size: inductor then
    # vectorises along it (with a symbolic chunk index it emitted scalar loops, 10x slower).
    # The residual overwrites x (what the reference does too: corrected.sub_(decoded)).
    def kernel(x, scales, decoded_out, bits_out):
        signs, decoded = _onebit_chunks(x, scales[:, :, None])
        if decoded_out is not None:
            decoded_out.copy_(decoded)
        bits_out.copy_(_pack_whole(signs.view(x.shape[0], -1), 1).view(bits_out.shape))
        if residual:
            x.copy_(_residual(x, decoded, clamp))
    return kernel


def _onebit_decode_kernel(chunk_size: int) -> Callable:
    def kernel(bits, scales, out):
        positive = _unpack(bits.reshape(bits.shape[0], -1), 1).view(out.shape) != 0
        s = scales[:, :, None]
        out.copy_(torch.where(positive, s, -s))
    return kernel


def _twobit_levels(codes, scales):
    """(..., cs) codes, (..., 1) scales -> decoded dense values."""
    inner = INNER * scales
    outer = (OUTER * scales).clamp(max=FLOAT32_MAX)
    magnitude = torch.where((codes & 1) != 0, outer, inner)
    return torch.where(codes >= 2, magnitude, -magnitude)


def _twobit_codes(x, dense, scales):
    outer = dense > THRESHOLD * scales
    return ((x >= 0).to(torch.uint8) << 1) | outer.to(torch.uint8)


def _twobit_kernel(chunk_size: int, residual: bool, clamp: bool) -> Callable:
    def kernel(x, dense, scales, decoded_out, bits_out):
        s = scales[:, :, None]
        codes = _twobit_codes(x, dense, s)
        decoded = _twobit_levels(codes, s)  # sparse values: put by the caller
        if decoded_out is not None:
            decoded_out.copy_(decoded)
        bits_out.copy_(_pack_whole(codes.view(x.shape[0], -1), 2).view(bits_out.shape))
        if residual:
            x.copy_(_residual(x, decoded, clamp))
    return kernel


def _twobit_decode_kernel(chunk_size: int) -> Callable:
    def kernel(bits, scales, out):
        codes = _unpack(bits.reshape(bits.shape[0], -1), 2).view(out.shape)
        out.copy_(_twobit_levels(codes, scales[:, :, None]))
    return kernel


def _fp16_kernel(residual: bool, clamp: bool) -> Callable:
    def kernel(corrected):
        # Clamping after the cast equals clamping before it for finite input (fp16.py).
        half = corrected.to(torch.float16).clamp(-FP16_MAX, FP16_MAX)
        decoded = half.to(torch.float32)
        res = None
        if residual:
            res = corrected - decoded
            if clamp:
                res = res.clamp(-FLOAT32_MAX, FLOAT32_MAX)
        return half, decoded, res
    return kernel


# --- per codec: encode (+ decode, + residual) of S segments -----------------------------------


def _pairwise_abs(chunks):
    """(..., chunk_size) -> (...) sums of magnitudes in codec.pairwise_sum's order (every level
    is elementwise: inductor fuses them, bit-identical to the eager reference)."""
    return pairwise_sum(chunks.abs())


def _scales(codec: Codec, rows: torch.Tensor, counts: torch.Tensor, scale_fn, name: str | None) -> torch.Tensor:
    """(S, n_chunks) scales of (S, m) `rows`, equal to the reference's `scale_fn` on the chunk
    rows `codec.encode` reduces. mean_abs: the whole chunks of all segments in one (compiled)
    call, a partial last chunk apart (pairwise_sum makes each chunk's sum depend on that chunk
    alone); if a sum is not finite (NaN/inf, or an overflowing sum) the reference function does
    it all again, raising or taking its overflow-safe path. rms (ATen's reductions, whose
    rounding depends on the row count): the reference function per segment on the same
    (n_chunks, chunk_size) tensor it reduces."""
    segments, m = rows.shape
    cs = codec.chunk_size
    whole = m // cs
    split = whole * cs
    if scale_fn is chunk_mean_abs:
        sums = []
        if whole:
            body = rows[:, :split].unflatten(1, (whole, cs))
            sums.append(_run(("pairwise-abs", cs), _pairwise_abs, rows.device, segments * split, body))
        if split < m:
            sums.append(pairwise_sum(rows[:, split:].abs()).view(segments, 1))
        sums = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]
        if bool(torch.isfinite(sums).all()):
            return sums / counts.clamp(min=1)
    padded_m = num_chunks(m, cs) * cs
    out = []
    for j in range(segments):
        row = rows[j]
        padded = row if padded_m == m else F.pad(row, (0, padded_m - m))
        out.append(scale_fn(padded.view(-1, cs), counts[j], row, name, codec.name))
    return torch.stack(out)


def _float_bytes(t: torch.Tensor) -> torch.Tensor:
    """(S, k) float32/int32 -> (S, 4k) uint8, the same bytes."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


def _pack_eager(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(S, r) codes -> (S, ceil(r * bits / 8)) bytes: a partial chunk's few codes, eagerly."""
    per_byte = 8 // bits
    return _pack_whole(F.pad(codes, (0, -codes.shape[1] % per_byte)), bits)


def encode_segments(codec: Codec, flat: torch.Tensor, segments: int, m: int, *, error: torch.Tensor | None = None,
                    residual: bool = False, valid: int | None = None, clamp: bool = False,
                    finite: bool = False, decoded: bool = True, in_place: bool = False,
                    residual_out: torch.Tensor | None = None, name: str | None = None):
    """Encode `flat` (+ `error`), zero-padded to `segments * m` elements, as `segments` tensors
    of `m` elements, each as `codec.encode` would.

    Returns (payload (S, codec.wire_bytes(m)) uint8, decoded (S, m) float32, residual (S, m)
    float32 or None). `residual`: also compute corrected - decoded (None for a lossless codec),
    zero from flat index `valid` (default: all of it) on. `clamp`: clamp the corrected input and
    the residual to the float32 range (the compressed allreduce's overflow rule). `finite`: the
    caller has checked the input for NaN/inf, so the fp16 check is skipped (1bit/2bit's scales do
    theirs anyway). `decoded=False`: the caller does not need the decoded values (None then).
    `in_place`: corrected values and the residual are written into `error` (the caller's state
    buffer). `residual_out`: where `native_encodes(codec, flat, error)`, a float32 buffer of
    `segments * m` elements the residual is written into instead (error is then only read).
    Raises NonFiniteGradient like the codec does, before writing anything."""
    if residual_out is not None and (in_place or not native_encodes(codec, flat, error)):
        raise ValueError("encode_segments: residual_out is for the native kernel (native_encodes), "
                         "without in_place")
    kind = type(codec).name
    device = flat.device
    total = segments * m
    valid = total if valid is None else valid
    want_decoded = decoded
    residual = residual and not codec.lossless
    if in_place and error is not None and kind != "none" and not finite:
        _raise_if_nonfinite_sum(flat, name, kind)  # before the caller's buffer changes
    if (ext := _native_kernels(codec, flat, error)) is not None:
        return _onebit_native(ext, codec, flat, error, segments, m, residual, valid, clamp, want_decoded,
                              in_place, residual_out, name)
    corrected = _prepare(flat, error, total, clamp, in_place).view(segments, m)
    if kind == "none":
        if corrected.data_ptr() == flat.data_ptr():
            corrected = corrected.clone()  # the payload never aliases the caller's tensor
        return _float_bytes(corrected), corrected, None
    if residual and corrected.data_ptr() == flat.data_ptr():
        corrected = corrected.clone()  # the caller's tensor is only read
    if kind == "fp16":
        if not finite:
            _raise_if_nonfinite_sum(corrected, name, kind)
        half, decoded, res = _run(("fp16", residual, clamp), _fp16_kernel(residual, clamp), device, total, corrected)
        payload = half.view(torch.uint8)
    else:
        payload, decoded, res = _encode_chunked(codec, kind, corrected, residual, clamp, want_decoded, name)
    if res is not None and valid < total:
        res.view(-1)[valid:] = 0
    return payload, decoded, res


def native_encodes(codec: Codec, flat: torch.Tensor, error: torch.Tensor | None) -> bool:
    """Whether encode_segments runs `codec` on `flat` (+ `error`) through the native one-pass
    kernel (which finds NaN/inf input itself, before writing anything the caller keeps)."""
    return use_fused(codec) and _native_kernels(codec, flat, error) is not None


def _native_kernels(codec: Codec, flat: torch.Tensor, error: torch.Tensor | None):
    """The built native module where it runs `codec` on `flat` (+ `error`): 1bit with the
    mean_abs scale on contiguous CPU float32; None otherwise (or while it is not built)."""
    if not (type(codec).name == "1bit" and codec.scale == "mean_abs" and flat.device.type == "cpu"
            and flat.dtype == torch.float32 and flat.is_contiguous()
            and (error is None or (error.dtype == torch.float32 and error.is_contiguous()))):
        return None
    return native.module()


_NONE = torch.empty(0)  # "absent" for the native kernels' optional tensors


def _onebit_native(ext, codec: Codec, flat: torch.Tensor, error: torch.Tensor | None, segments: int, m: int,
                   residual: bool, valid: int, clamp: bool, want_decoded: bool, in_place: bool,
                   residual_out: torch.Tensor | None, name: str | None):
    """encode_segments for 1bit (mean_abs) on CPU by the native one-pass kernel (native.py)."""
    total = segments * m
    error = None if error is None else error.view(-1)
    res = None
    if residual:
        if residual_out is not None:
            res = residual_out.view(-1)
        else:
            res = error if in_place and error is not None else torch.empty(total, dtype=torch.float32)
    decoded = torch.empty(segments, m, dtype=torch.float32) if want_decoded else None
    payload = torch.empty(segments, codec.wire_bytes(m), dtype=torch.uint8)
    left = ext.onebit_encode(flat.view(-1), _NONE if error is None else error, _NONE if res is None else res,
                             _NONE if decoded is None else decoded, payload, segments, m, codec.chunk_size,
                             valid, clamp)
    if left.numel():  # chunks whose sum is not finite: rare, by the reference functions
        _onebit_leftovers(codec, left.tolist(), flat.view(-1), error, res, decoded, payload, m, valid, clamp, name)
    return payload, decoded, None if res is None else res.view(segments, m)


def _onebit_leftovers(codec: Codec, jobs: list[int], flat, error, res, decoded, payload, m: int, valid: int,
                      clamp: bool, name: str | None) -> None:
    """The chunks the native kernel left untouched (their plain sum is not finite): NaN/inf
    input raises NonFiniteGradient (before any state changes: the kernel wrote none of these
    chunks, and in-place callers checked the input first); finite ones are clamped where asked
    and get the reference's overflow-safe mean."""
    cs = codec.chunk_size
    n_chunks = num_chunks(m, cs)
    n = flat.numel()
    for job in jobs:
        segment, c = divmod(job, n_chunks)
        start, length = segment * m + c * cs, min(cs, m - c * cs)
        x = torch.zeros(length, dtype=torch.float32)
        k = max(0, min(length, n - start))
        x[:k] = flat[start:start + k]
        raise_if_nonfinite(x, name, codec.name)
        if error is not None:
            x = x + error[start:start + length]
        if clamp:
            x = x.clamp(-FLOAT32_MAX, FLOAT32_MAX)
        counts = torch.tensor([float(length)])
        scale = chunk_mean_abs(F.pad(x, (0, cs - length)).view(1, cs), counts, x, name, codec.name)
        codes, dec = _onebit_chunks(x.view(1, -1), scale.view(1, 1))
        row = payload[segment]
        row[4 * c:4 * c + 4] = _float_bytes(scale.view(1, 1))[0]
        at = 4 * n_chunks + c * cs // 8
        packed = _pack_eager(codes, 1)[0]
        row[at:at + packed.numel()] = packed
        if decoded is not None:
            decoded.view(-1)[start:start + length] = dec[0]
        if res is not None:
            r = _residual(x, dec[0], clamp)
            r[max(0, min(length, valid - start)):] = 0
            res[start:start + length] = r


def _raise_if_nonfinite_sum(t: torch.Tensor, name: str | None, kind: str) -> None:
    # A sum is finite unless a term is not (or finite terms overflow: then look at each).
    if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
        raise NonFiniteGradient(name, kind)


def _encode_chunked(codec: Codec, kind: str, corrected: torch.Tensor, residual: bool, clamp: bool,
                    want_decoded: bool, name: str | None):
    """1bit/2bit on (S, m) corrected rows: (payload, decoded or None, residual or None); the
    residual overwrites `corrected`."""
    segments, m = corrected.shape
    device = corrected.device
    cs = codec.chunk_size
    n_chunks = num_chunks(m, cs)
    whole, bits = m // cs, (1 if kind == "1bit" else 2)
    split = whole * cs  # elements in whole chunks; the rest is one partial chunk per row
    counts = chunk_counts(m, cs, device).repeat(segments, 1)
    payload = torch.empty(segments, codec.wire_bytes(m), dtype=torch.uint8, device=device)
    decoded = torch.empty(segments, m, dtype=torch.float32, device=device) if want_decoded else None
    res = corrected if residual else None
    k = 0
    if kind == "1bit":
        scales = _scales(codec, corrected, counts, SCALES[codec.scale], name)
        inputs = (corrected,)
    else:
        # 2bit: the sparse part by the reference's own selection, then the dense part fused.
        if m > MAX_NUMEL:
            raise ValueError(f"2bit codec: {name or 'tensor'} has {m} elements; int32 indices reach {MAX_NUMEL}")
        k = codec.sparse_count(m)
        dense = corrected.abs()
        if k:
            index = torch.stack([top_magnitude_indices(dense[j], k) for j in range(segments)])
            values = torch.gather(corrected, 1, index)
            if not bool(torch.isfinite(values).all()):
                raise NonFiniteGradient(name, kind)
            for j in range(segments):
                counts[j] -= torch.bincount(index[j] // cs, minlength=n_chunks).to(counts.dtype)
            dense.scatter_(1, index, 0.0)
        scales = _scales(codec, dense, counts, chunk_mean_abs, name)
        inputs = (corrected, dense)
    at = 4 * n_chunks
    payload[:, :at] = _float_bytes(scales)
    if k:
        payload[:, at:at + 4 * k] = _float_bytes(index.to(torch.int32))
        payload[:, at + 4 * k:at + 8 * k] = _float_bytes(values)
        at += 8 * k
    split_bytes = split * bits // 8
    if whole:
        views = [t[:, :split].view(segments, whole, cs) for t in inputs]
        out = [None if decoded is None else decoded[:, :split].view(segments, whole, cs),
               payload[:, at:at + split_bytes].view(segments, whole, cs * bits // 8)]
        kernel = _onebit_kernel if kind == "1bit" else _twobit_kernel
        _run((kind, cs, residual, clamp), kernel(cs, residual, clamp), device, segments * m,
             *views, scales[:, :whole], *out)
    if split < m:
        s = scales[:, whole:whole + 1]
        x = corrected[:, split:]
        if kind == "1bit":
            codes, tail = _onebit_chunks(x, s)
        else:
            codes = _twobit_codes(x, dense[:, split:], s)
            tail = _twobit_levels(codes, s)
        payload[:, at + split_bytes:] = _pack_eager(codes, bits)
        if decoded is not None:
            decoded[:, split:] = tail
        if res is not None:
            res[:, split:] = _residual(x, tail, clamp)
    if k:
        if decoded is not None:
            decoded.scatter_(1, index, values)
        if res is not None:  # corrected - value == +0 exactly where the value was sent as it is
            res.scatter_(1, index, 0.0)
    return payload, decoded, res


def decode_segments(codec: Codec, payload: torch.Tensor, m: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(S, codec.wire_bytes(m)) uint8 payload rows -> (S, m) float32, each row as `codec.decode`.
    `out`: a contiguous float32 tensor of at most S * m elements that gets the first out.numel()
    values of the rows laid end to end (returned then): the native kernel writes them there
    directly, so a caller that reuses `out` touches no fresh memory."""
    if out is not None:
        if not (out.dtype == torch.float32 and out.is_contiguous() and out.numel() <= payload.shape[0] * m
                and out.device == payload.device):
            raise ValueError(f"decode_segments: out must be a contiguous float32 tensor of at most "
                             f"{payload.shape[0] * m} elements on {payload.device}")
        if (ext := native_decoder(codec, payload.device)) is not None:
            ext.onebit_decode(payload.contiguous(), out, payload.shape[0], m, codec.chunk_size)
            return out
        return out.copy_(decode_segments(codec, payload, m).view(-1)[:out.numel()].view(out.shape))
    kind = type(codec).name
    segments = payload.shape[0]
    if kind == "none":
        return torch.stack([view_as_dtype(payload[j], torch.float32) for j in range(segments)])
    if kind == "fp16":
        half = torch.stack([view_as_dtype(payload[j], torch.float16) for j in range(segments)])
        return half.to(torch.float32)
    cs = codec.chunk_size
    if (ext := native_decoder(codec, payload.device)) is not None:
        out = torch.empty(segments, m, dtype=torch.float32)
        ext.onebit_decode(payload.contiguous(), out, segments, m, cs)
        return out
    n_chunks = num_chunks(m, cs)
    whole, bits = m // cs, (1 if kind == "1bit" else 2)
    split = whole * cs
    at = 4 * n_chunks
    scales = torch.stack([view_as_dtype(payload[j, :at], torch.float32) for j in range(segments)])
    k = codec.sparse_count(m) if kind == "2bit" else 0
    out = torch.empty(segments, m, dtype=torch.float32, device=payload.device)
    start = at + 8 * k
    split_bytes = split * bits // 8
    if whole:
        kernel = _onebit_decode_kernel if kind == "1bit" else _twobit_decode_kernel
        _run((kind + "-decode", cs), kernel(cs), payload.device, segments * m,
             payload[:, start:start + split_bytes].view(segments, whole, cs * bits // 8), scales[:, :whole],
             out[:, :split].view(segments, whole, cs))
    if split < m:
        codes = _unpack(payload[:, start + split_bytes:], bits)[:, :m - split]
        s = scales[:, whole:whole + 1]
        out[:, split:] = torch.where(codes != 0, s, -s) if kind == "1bit" else _twobit_levels(codes, s)
    if k:
        indices = torch.stack([view_as_dtype(payload[j, at:at + 4 * k], torch.int32) for j in range(segments)])
        values = torch.stack([view_as_dtype(payload[j, at + 4 * k:at + 8 * k], torch.float32)
                              for j in range(segments)])
        out.scatter_(1, indices.long(), values)
    return out


def native_decoder(codec: Codec, device: torch.device):
    """The built native module where it decodes `codec`'s payloads on `device` (1bit, any
    scale, CPU), else None: decode_segments/decode_mean write straight into a caller's `out`
    there, elsewhere they compute into a new tensor and copy."""
    return native.module() if type(codec).name == "1bit" and device.type == "cpu" else None


def _server_sum(world: int):
    def server_sum(rows: torch.Tensor) -> torch.Tensor:
        # In row order, one add at a time, then one division: the reference's rounding.
        avg = rows[0]
        for i in range(1, world):
            avg = avg + rows[i]
        return avg / world
    return server_sum


def decode_mean(codec: Codec, payload: torch.Tensor, m: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of the decoded (S, codec.wire_bytes(m)) payload rows, as the reference server
    computes it (rows added in order, then divided by S): (m,) float32. `out`: a contiguous
    float32 tensor of at most m elements for the first out.numel() values (returned then). The
    native 1bit kernel decodes and averages in one pass, without the (S, m) decoded rows."""
    segments = payload.shape[0]
    if out is not None and not (out.dtype == torch.float32 and out.is_contiguous() and out.numel() <= m
                                and out.device == payload.device):
        raise ValueError(f"decode_mean: out must be a contiguous float32 tensor of at most {m} elements "
                         f"on {payload.device}")
    if (ext := native_decoder(codec, payload.device)) is not None:
        out = torch.empty(m, dtype=torch.float32) if out is None else out
        ext.onebit_decode_mean(payload.contiguous(), out, segments, m, codec.chunk_size)
        return out
    rows = decode_segments(codec, payload, m)
    avg = _run(("server-sum", segments), _server_sum(segments), payload.device, segments * m, rows)
    return avg if out is None else out.copy_(avg[:out.numel()].view(out.shape))


def roundtrip(codec: Codec, flat: torch.Tensor, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One flat bucket: (payload, decoded), equal to `codec.encode(flat).payload` and
    `codec.decode(codec.encode(flat))` (flattened)."""
    if not flat.is_floating_point():
        raise TypeError(f"{codec.name} codec: expected a floating-point tensor, got {flat.dtype}")
    flat = flat.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device), torch.empty(0, device=flat.device)
    payload, decoded, _ = encode_segments(codec, flat, 1, n, name=name)
    return payload.view(-1), decoded.view(-1)


_KINDS = frozenset({"none", "fp16", "1bit", "2bit"})

__all__ = ["COMPILE_ENV", "MIN_NUMEL_ENV", "PATH_ENV", "codec_path", "compile_failures", "decode_mean",
           "decode_segments", "encode_segments", "native_decoder", "native_encodes", "roundtrip", "use_fused"]

"""The codecs on flat buckets in a few fused kernels: the fast path the training path uses.

One call handles a whole bucket split into `S` equal segments of `m` elements (the two-phase
allreduce's rank chunks; S = 1 for a plain bucket), each segment encoded exactly as
`codec.encode(segment)` would encode it: the same wire bytes, the same decoded values and the
same residuals, bit for bit (tests/compression/test_fused.py). The plain per-tensor codec
methods stay the reference; `RAPIDFIRE_CODEC_PATH=reference` makes the training path use them.

How each step stays bit-identical while getting faster:
- per-chunk scales (and the NaN/inf check they double as) are computed by the reference's own
  functions on the same padded (chunks, chunk_size) rows, so the summation order is the same;
  on CPU all segments' rows go in one call (ATen reduces each row alone), on CUDA one call per
  segment (its reduction layout depends on the row count below 16 rows);
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

from .codec import FLOAT32_MAX, Codec, NonFiniteGradient, chunk_counts, chunk_mean_abs, num_chunks, view_as_dtype
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
    if mode == "off" or (mode == "auto" and (numel < _min_numel(device) or device.type in _failed)):
        return fn(*args)
    full_key = key + (device.type,)
    compiled = _compiled.get(full_key)
    if compiled is None:
        # emulate_precision_casts: fp16 rounding must happen where the reference rounds, not
        # be skipped because inductor computes half values in float32.
        compiled = _compiled[full_key] = torch.compile(fn, dynamic=True, fullgraph=True,
                                                       options={"emulate_precision_casts": True})
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


# --- the fused steps (plain torch; compiled by _run) ------------------------------------------


def _prepare(flat: torch.Tensor, error: torch.Tensor | None, segments: int, m: int, padded_m: int,
             clamp: bool) -> torch.Tensor:
    """(segments, padded_m) float32: flat zero-padded to segments*m, plus `error`, clamped to the
    float32 range when asked, each segment zero-padded to padded_m (the codec's chunk padding)."""
    x = F.pad(flat.to(torch.float32), (0, segments * m - flat.numel()))
    if error is not None:
        x = x + error
    if clamp:
        x = x.clamp(-FLOAT32_MAX, FLOAT32_MAX)
    return F.pad(x.view(segments, m), (0, padded_m - m))


def _masked_residual(corrected: torch.Tensor, decoded: torch.Tensor, valid: int, clamp: bool) -> torch.Tensor:
    """corrected - decoded with elements at flat index >= valid set to zero, clamped when asked
    (the order of the reference: zero the tail, then clamp)."""
    segments, m = decoded.shape
    residual = corrected - decoded
    index = torch.arange(segments * m, device=decoded.device).view(segments, m)
    residual = torch.where(index < valid, residual, torch.zeros_like(residual))
    if clamp:
        residual = residual.clamp(-FLOAT32_MAX, FLOAT32_MAX)
    return residual


def _pack(codes: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """(S, L) uint8 codes (L a multiple of 8 // bits) -> (S, ceil(m * bits / 8)) bytes, LSB-first,
    codes at positions >= m zeroed."""
    segments, length = codes.shape
    per_byte = 8 // bits
    index = torch.arange(length, device=codes.device)
    codes = torch.where(index < m, codes, torch.zeros_like(codes)).view(segments, length // per_byte, per_byte)
    packed = codes[:, :, 0]
    for position in range(1, per_byte):
        packed = packed | (codes[:, :, position] << (position * bits))
    return packed[:, : -(-m * bits // 8)]


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(S, B) bytes -> (S, B * 8 // bits) uint8 codes, LSB-first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).view(packed.shape[0], -1)


def _per_element(scales: torch.Tensor, m: int, chunk_size: int) -> torch.Tensor:
    """(S, n_chunks) -> (S, m): each element's chunk scale (an indexed load once compiled)."""
    return scales[:, torch.arange(m, device=scales.device) // chunk_size]


def _onebit_kernel(chunk_size: int, residual: bool, clamp: bool) -> Callable:
    def kernel(padded, scales, scale_bytes, m: int, valid: int):
        segments, padded_m = padded.shape
        positive = padded >= 0
        s = _per_element(scales, m, chunk_size)
        decoded = torch.where(positive[:, :m], s, -s)
        packed = _pack(positive.to(torch.uint8), 1, m)
        payload = torch.cat([scale_bytes, packed], dim=1)
        if not residual:
            return payload, decoded, None
        return payload, decoded, _masked_residual(padded[:, :m], decoded, valid, clamp)
    return kernel


def _onebit_decode_kernel(chunk_size: int) -> Callable:
    def kernel(packed, scales, m: int):
        positive = _unpack(packed, 1)[:, :m] != 0
        s = _per_element(scales, m, chunk_size)
        return torch.where(positive, s, -s)
    return kernel


def _twobit_levels(codes, scales, m: int, chunk_size: int):
    """(S, >= m) codes -> (S, m) decoded dense values."""
    codes = codes[:, :m]
    inner = _per_element(INNER * scales, m, chunk_size)
    outer = _per_element((OUTER * scales).clamp(max=FLOAT32_MAX), m, chunk_size)
    magnitude = torch.where((codes & 1) != 0, outer, inner)
    return torch.where(codes >= 2, magnitude, -magnitude)


def _twobit_kernel(chunk_size: int, residual: bool, clamp: bool) -> Callable:
    def kernel(padded, dense, scales, head_bytes, m: int, valid: int):
        segments, padded_m = padded.shape
        outer = dense.view(segments, -1, chunk_size) > (THRESHOLD * scales)[:, :, None]
        codes = ((padded >= 0).to(torch.uint8) << 1) | outer.view(segments, padded_m).to(torch.uint8)
        payload = torch.cat([head_bytes, _pack(codes, 2, m)], dim=1)
        decoded = _twobit_levels(codes, scales, m, chunk_size)  # sparse values: put by the caller
        if not residual:
            return payload, decoded, None
        return payload, decoded, _masked_residual(padded[:, :m], decoded, valid, clamp)
    return kernel


def _twobit_decode_kernel(chunk_size: int) -> Callable:
    def kernel(packed, scales, m: int):
        return _twobit_levels(_unpack(packed, 2), scales, m, chunk_size)
    return kernel


def _fp16_kernel(residual: bool, clamp: bool) -> Callable:
    def kernel(padded, m: int, valid: int):
        x = padded[:, :m]
        # Clamping after the cast equals clamping before it for finite input (fp16.py).
        half = x.to(torch.float16).clamp(-FP16_MAX, FP16_MAX)
        decoded = half.to(torch.float32)
        if not residual:
            return half, decoded, None
        return half, decoded, _masked_residual(x, decoded, valid, clamp)
    return kernel


# --- per codec: encode (+ decode, + residual) of S segments -----------------------------------


def _scales(codec: Codec, padded: torch.Tensor, m: int, scale_fn, name: str | None) -> torch.Tensor:
    """(S, n_chunks) scales by the reference's function on the same rows (see the docstring)."""
    segments, padded_m = padded.shape
    cs = codec.chunk_size
    counts = chunk_counts(m, cs, padded.device)
    if padded.device.type == "cpu":
        rows = padded.view(segments * (padded_m // cs), cs)
        return scale_fn(rows, counts.repeat(segments), padded, name, codec.name).view(segments, -1)
    return torch.stack([scale_fn(padded[j].view(-1, cs), counts, padded[j], name, codec.name)
                        for j in range(segments)])


def _float_bytes(t: torch.Tensor) -> torch.Tensor:
    """(S, k) float32/int32 -> (S, 4k) uint8, the same bytes."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


def encode_segments(codec: Codec, flat: torch.Tensor, segments: int, m: int, *, error: torch.Tensor | None = None,
                    residual: bool = False, valid: int | None = None, clamp: bool = False,
                    finite: bool = False, name: str | None = None):
    """Encode `flat` (+ `error`), zero-padded to `segments * m` elements, as `segments` tensors
    of `m` elements, each as `codec.encode` would.

    Returns (payload (S, codec.wire_bytes(m)) uint8, decoded (S, m) float32, residual (S, m)
    float32 or None). `residual`: also compute corrected - decoded (None for a lossless codec),
    zero from flat index `valid` (default: all of it) on. `clamp`: clamp the corrected input and
    the residual to the float32 range (the compressed allreduce's overflow rule). `finite`: the
    caller has checked the input for NaN/inf, so the fp16 check is skipped (1bit/2bit's scales do
    theirs anyway). Raises NonFiniteGradient like the codec does."""
    kind = type(codec).name
    device = flat.device
    valid = segments * m if valid is None else valid
    if kind == "none":
        decoded = _prepare(flat, error, segments, m, m, clamp)
        return _float_bytes(decoded), decoded, None
    if kind == "fp16":
        corrected = _run(("prepare", segments * m != flat.numel(), error is not None, clamp), _prepare, device,
                         segments * m, flat, error, segments, m, m, clamp)
        if not finite and not bool(torch.isfinite(corrected.sum())):
            if not bool(torch.isfinite(corrected).all()):
                raise NonFiniteGradient(name, kind)
        half, decoded, res = _run(("fp16", residual, clamp), _fp16_kernel(residual, clamp), device,
                                  segments * m, corrected, m, valid)
        return half.view(torch.uint8), decoded, res

    cs = codec.chunk_size
    n_chunks = num_chunks(m, cs)
    padded_m = n_chunks * cs
    padded = _run(("prepare", True, error is not None, clamp), _prepare, device, segments * m,
                  flat, error, segments, m, padded_m, clamp)
    if kind == "1bit":
        scales = _scales(codec, padded, m, SCALES[codec.scale], name)
        return _run(("1bit", cs, residual, clamp), _onebit_kernel(cs, residual, clamp), device, segments * m,
                    padded, scales, _float_bytes(scales), m, valid)

    # 2bit: the sparse part by the reference's own selection, then the dense part fused.
    if m > MAX_NUMEL:
        raise ValueError(f"2bit codec: {name or 'tensor'} has {m} elements; int32 indices reach {MAX_NUMEL}")
    k = codec.sparse_count(m)
    dense = padded.abs()
    counts = chunk_counts(m, cs, device).repeat(segments, 1)
    indices, values = [], []
    for j in range(segments):
        idx = top_magnitude_indices(dense[j, :m], k)
        indices.append(idx)
        values.append(padded[j, idx])
        if k:
            dense[j].index_fill_(0, idx, 0.0)
            counts[j] -= torch.bincount(idx // cs, minlength=n_chunks).to(counts.dtype)
    if k:
        values_t = torch.stack(values)
        if not bool(torch.isfinite(values_t).all()):
            raise NonFiniteGradient(name, kind)
    if device.type == "cpu":
        scales = chunk_mean_abs(dense.view(-1, cs), counts.view(-1), padded, name, kind).view(segments, -1)
    else:
        scales = torch.stack([chunk_mean_abs(dense[j].view(-1, cs), counts[j], padded[j], name, kind)
                              for j in range(segments)])
    head = [_float_bytes(scales)]
    if k:
        head += [_float_bytes(torch.stack(indices).to(torch.int32)), _float_bytes(values_t)]
    payload, decoded, res = _run(("2bit", cs, residual, clamp), _twobit_kernel(cs, residual, clamp), device,
                                 segments * m, padded, dense, scales, torch.cat(head, dim=1), m, valid)
    if k:
        decoded.scatter_(1, torch.stack(indices), values_t)
        if res is not None:  # corrected - value == +0 exactly where the value was sent as it is
            res.scatter_(1, torch.stack(indices), 0.0)
    return payload, decoded, res


def decode_segments(codec: Codec, payload: torch.Tensor, m: int) -> torch.Tensor:
    """(S, codec.wire_bytes(m)) uint8 payload rows -> (S, m) float32, each row as `codec.decode`."""
    kind = type(codec).name
    segments = payload.shape[0]
    if kind == "none":
        return torch.stack([view_as_dtype(payload[j], torch.float32) for j in range(segments)])
    if kind == "fp16":
        half = torch.stack([view_as_dtype(payload[j], torch.float16) for j in range(segments)])
        return half.to(torch.float32)
    cs = codec.chunk_size
    n_chunks = num_chunks(m, cs)
    at = 4 * n_chunks
    scales = torch.stack([view_as_dtype(payload[j, :at], torch.float32) for j in range(segments)])
    if kind == "1bit":
        return _run(("1bit-decode", cs), _onebit_decode_kernel(cs), payload.device, segments * m,
                    payload[:, at:], scales, m)
    k = codec.sparse_count(m)
    decoded = _run(("2bit-decode", cs), _twobit_decode_kernel(cs), payload.device, segments * m,
                   payload[:, at + 8 * k:], scales, m)
    if k:
        indices = torch.stack([view_as_dtype(payload[j, at:at + 4 * k], torch.int32) for j in range(segments)])
        values = torch.stack([view_as_dtype(payload[j, at + 4 * k:at + 8 * k], torch.float32)
                              for j in range(segments)])
        decoded.scatter_(1, indices.long(), values)
    return decoded


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

__all__ = ["COMPILE_ENV", "MIN_NUMEL_ENV", "PATH_ENV", "codec_path", "compile_failures", "decode_segments",
           "encode_segments", "roundtrip", "use_fused"]

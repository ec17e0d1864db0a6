"""The one interface every gradient codec implements, and the few pieces they share.

A codec's `encode` gives the exact bytes that go over the wire (a uint8 tensor on the
gradient's device), `decode` gives them back as float32, and `wire_bytes` says the size
beforehand. Why a uint8 tensor and the payload layout rule every codec follows:
docs/compression.md.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny


class NonFiniteGradient(ValueError):
    """A gradient holds NaN or inf. Quantising codecs cannot represent it (a NaN scale would
    poison a whole chunk and, through error feedback, every later step), so they refuse it and
    the caller skips the step (or fails the run) naming the parameter."""

    def __init__(self, name: str | None, codec: str):
        self.name = name
        self.codec = codec
        what = f"gradient {name!r}" if name is not None else "a gradient tensor (unnamed)"
        super().__init__(f"{what} contains NaN or inf; the {codec!r} codec cannot encode it "
                         f"(skip this step or fail the run)")

    def __reduce__(self):
        # Exceptions are rebuilt from their constructor arguments when they cross a Ray or
        # multiprocessing boundary; ours are not the message.
        return (type(self), (self.name, self.codec))


@dataclass(frozen=True, eq=False)
class Encoded:
    """One encoded tensor: the wire bytes plus what `decode` needs to rebuild it.

    `codec` is the producing codec's name, so decoding with the wrong codec fails loudly instead
    of returning garbage. `dtype` is the input's dtype (decode returns float32; the caller casts
    back if it needs to). Compared by identity: comparing payload tensors has no single answer."""

    codec: str
    payload: torch.Tensor
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for this tensor."""
        return self.payload.numel()

    @property
    def device(self) -> torch.device:
        return self.payload.device


class Codec(ABC):
    """Encode a gradient to wire bytes, decode them to float32, and state the wire size.

    Subclasses implement `_encode(flat, name)` on a flat float32 tensor and
    `_decode(payload, numel)` returning a flat float32 tensor; this base class does the
    flattening, the metadata and the checks, so every codec behaves the same at the edges.
    Inputs of any floating dtype are converted to float32 first."""

    name: ClassVar[str]
    #: True when decode(encode(t)) == t.float() exactly; error feedback keeps no residual then.
    lossless: ClassVar[bool] = False

    def encode(self, tensor: torch.Tensor, name: str | None = None) -> Encoded:
        """Encode `tensor`; `name` (the parameter's) only goes into error messages."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.name} codec: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} codec: expected a floating-point tensor, got {tensor.dtype}"
                            + (f" for {name!r}" if name is not None else ""))
        flat = tensor.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        payload = self._encode(flat, name)
        expected = self.wire_bytes(flat.numel())
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
            raise AssertionError(f"{self!r} produced {payload.numel()} bytes ({payload.dtype}) for "
                                 f"{flat.numel()} elements; wire_bytes says {expected}")
        return Encoded(self.name, payload, flat.numel(), tuple(tensor.shape), tensor.dtype)

    def decode(self, encoded: Encoded) -> torch.Tensor:
        """Rebuild a float32 tensor of the input's shape on the payload's device."""
        if encoded.codec != self.name:
            raise ValueError(f"{self!r} cannot decode a payload made by the {encoded.codec!r} codec")
        payload = encoded.payload
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"{self.name} codec: payload must be a 1-D uint8 tensor, got "
                             f"{payload.dim()}-D {payload.dtype}")
        if payload.numel() != self.wire_bytes(encoded.numel):
            raise ValueError(f"{self!r}: payload has {payload.numel()} bytes, but {encoded.numel} "
                             f"elements take {self.wire_bytes(encoded.numel)} (different codec options?)")
        if math.prod(encoded.shape) != encoded.numel:
            raise ValueError(f"{self.name} codec: shape {encoded.shape} does not hold {encoded.numel} elements")
        flat = self._decode(payload, encoded.numel)
        return flat.view(encoded.shape)

    @abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """Exact payload size in bytes for a tensor of `numel` elements."""

    @abstractmethod
    def _encode(self, flat: torch.Tensor, name: str | None) -> torch.Tensor:
        """Flat float32 in, 1-D uint8 payload of `wire_bytes(flat.numel())` bytes out."""

    @abstractmethod
    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Payload in, flat float32 tensor of `numel` elements out (never a view of the payload)."""


# --- shared by the quantising codecs ------------------------------------------------------


def check_chunk_size(chunk_size: int, codec: str) -> None:
    """Chunks are a multiple of 8 elements so that each chunk's packed bits are whole bytes:
    the two-phase compressed allreduce can then split a payload per chunk without bit shifts."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 8:
        raise ValueError(f"{codec} codec: chunk_size must be a positive multiple of 8, got {chunk_size!r}")


def num_chunks(numel: int, chunk_size: int) -> int:
    return -(-numel // chunk_size)


def pad_to(flat: torch.Tensor, length: int) -> torch.Tensor:
    """`flat` followed by zeros up to `length` elements (no copy when it is already that long)."""
    n = flat.numel()
    if n == length:
        return flat
    out = flat.new_empty(length)
    out[:n] = flat
    out[n:] = 0
    return out


def chunk_counts(numel: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    """Number of real (not padding) elements in each chunk, as float32."""
    n_chunks = num_chunks(numel, chunk_size)
    counts = torch.full((n_chunks,), float(chunk_size), dtype=torch.float32, device=device)
    if n_chunks:
        counts[-1] = numel - (n_chunks - 1) * chunk_size
    return counts


def raise_if_nonfinite(flat: torch.Tensor, name: str | None, codec: str) -> None:
    if not bool(torch.isfinite(flat).all()):
        raise NonFiniteGradient(name, codec)


def pairwise_sum(rows: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in one fixed order: zero-padded to a power-of-two width, then
    the right half added to the left half until one column is left.

    Every backend computes the same float32 result in this order (each level is elementwise, and
    a + 0 = a), unlike ATen's reductions, whose accumulation layout depends on the CPU's vector
    width and the row count: the native and compiled codec kernels compute their chunk scales
    this way in one pass and stay bit-identical to this reference (compression/fused.py)."""
    width = rows.shape[-1]
    padded = 1
    while padded < width:  # (int.bit_length would break a torch.compile graph)
        padded *= 2
    if padded != width:
        rows = torch.nn.functional.pad(rows, (0, padded - width))
    while rows.shape[-1] > 1:
        half = rows.shape[-1] // 2
        rows = rows[..., :half] + rows[..., half:]
    return rows[..., 0]


def chunk_mean_abs(chunks: torch.Tensor, counts: torch.Tensor, flat: torch.Tensor,
                   name: str | None, codec: str) -> torch.Tensor:
    """Mean |x| per row of `chunks` (n_chunks, chunk_size; padding is zero) over `counts` real
    elements (0 for a chunk with none), summed by `pairwise_sum`. Finite for any finite input;
    raises NonFiniteGradient (naming `name`) for NaN/inf input.

    It doubles as the NaN/inf check, so a clean gradient costs no extra pass: a sum of
    magnitudes is finite exactly when every term is finite, unless finite terms overflow float32
    (values near 1e38). The full `isfinite` pass over `flat` runs only when a sum is not finite;
    for finite input the chunks whose sum overflowed (only they: each row's scale depends on that
    row alone) get the mean relative to their largest magnitude."""
    sums = pairwise_sum(chunks.abs())
    means = sums / counts.clamp(min=1)
    overflowed = ~torch.isfinite(sums)
    if not bool(overflowed.any()):
        return means
    raise_if_nonfinite(flat, name, codec)
    rows = overflowed.nonzero().view(-1)
    return means.index_copy(0, rows, overflow_mean_abs(chunks[rows], counts[rows]))


def overflow_mean_abs(chunks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean |x| of finite rows whose plain sum overflows float32: peak * mean(|x| / peak) <= peak."""
    magnitudes = chunks.abs()
    peak = magnitudes.amax(dim=1).clamp(min=FLOAT32_TINY)
    return pairwise_sum(magnitudes / peak[:, None]) / counts.clamp(min=1) * peak


def chunk_rms(chunks: torch.Tensor, counts: torch.Tensor, flat: torch.Tensor,
              name: str | None, codec: str) -> torch.Tensor:
    """Root mean square per row of `chunks` over `counts` real elements (0 for a chunk with
    none), as 1-bit Adam's reference uses (||x||_2 / sqrt(n)). Raises NonFiniteGradient for
    NaN/inf input; finite for any finite input.

    Squares leave the float32 range at both ends (|x| > 1.8e19 overflows, |x| < 1e-19 underflows
    to zero), so chunks whose norm is not finite or below 1e-18 (squares summing under ~1e-36,
    where underflow loses precision) are recomputed relative to their largest magnitude. Those
    are rare, and only they pay for the extra passes."""
    roots = counts.clamp(min=1).sqrt()
    norms = torch.linalg.vector_norm(chunks, ord=2, dim=1)
    suspect = ~torch.isfinite(norms) | (norms < 1e-18)
    if not bool(suspect.any()):
        return norms / roots
    if not bool(torch.isfinite(norms[suspect]).all()):
        raise_if_nonfinite(flat, name, codec)
    rows = suspect.nonzero().view(-1)
    sub = chunks[rows]
    peak = sub.abs().amax(dim=1).clamp(min=FLOAT32_TINY)
    # Divide by sqrt(count) before scaling back: the norm may exceed float32 where the RMS does not.
    rms = torch.linalg.vector_norm(sub / peak[:, None], ord=2, dim=1) / roots[rows] * peak
    return (norms / roots).index_copy(0, rows, rms)


_FEW_CODES = 1 << 16


def pack_bits(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack `bits`-wide codes (uint8 or bool, length a multiple of 8 // bits) LSB-first.

    Vectorised either way; which way is speed only (measured on CPU, 1 thread). Few codes: shift
    each to its place and sum a byte's (non-overlapping) codes, two ops, ~9 us for 40 codes
    against ~50 us for the loop below, which matters for the many small tensors (norms, biases).
    Many codes: OR in one bit position at a time over all bytes (a loop over the 8 or 4
    positions, never over elements), 2-3x faster than the sum at 16M codes."""
    if codes.dtype == torch.bool:
        codes = codes.view(torch.uint8)
    per_byte = 8 // bits
    columns = codes.view(-1, per_byte)
    if codes.numel() < _FEW_CODES:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return torch.sum(columns << shifts, dim=1, dtype=torch.uint8, out=out)
    if out is None:
        out = torch.empty(columns.shape[0], dtype=torch.uint8, device=codes.device)
    out.copy_(columns[:, 0])
    for position in range(1, per_byte):
        out |= columns[:, position] << (position * bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 codes, `8 // bits` per input byte."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return (packed[:, None] >> shifts).bitwise_and_(mask).view(-1)


def view_as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as `dtype`; copies only when the slice is not 4-byte aligned
    (a payload cut out of a larger receive buffer at an odd offset)."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.clone().view(dtype)

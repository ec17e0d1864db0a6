"""rapidfire_ray.compression codecs, each against a plain reference written here.

The references work one element at a time on Python floats and build/parse the bytes with
`struct`, straight from the layouts the codec modules document: slow, but obviously right.
Each codec is checked three ways on every case: (1) the reference decoder, reading the
codec's payload bytes, gives exactly the codec's own decode (the byte layout is as documented);
(2) the reference encoder gives the same bits and (to float32 summation tolerance) the same
scales; (3) the decoded tensor has the input's shape, float32 and the input's device, and the
payload size equals `wire_bytes` and the formula.
"""
from __future__ import annotations

import io
import math
import pickle
import struct

import pytest
import torch

from rapidfire_ray.compression import CODECS, Codec, Encoded, NonFiniteGradient, OneBitCodec, TwoBitCodec, get_codec
from rapidfire_ray.compression.twobit import INNER, OUTER, THRESHOLD, top_magnitude_indices

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
F32_MAX = 3.4028234663852886e38
F16_MAX = 65504.0
SHAPES = [(1,), (7,), (3, 683), (10007,)]  # 1, 7, 2049 and 10007 elements


def f32(v: float) -> float:
    """`v` rounded to float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def floats(raw: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def int32s(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def code_at(raw: bytes, i: int, bits: int) -> int:
    """Element i of a `bits`-wide field packed LSB-first."""
    return (raw[i * bits // 8] >> (i * bits % 8)) & ((1 << bits) - 1)


def pack_codes(codes: list[int], bits: int) -> bytes:
    out = bytearray(math.ceil(len(codes) * bits / 8))
    for i, c in enumerate(codes):
        out[i * bits // 8] |= c << (i * bits % 8)
    return bytes(out)


# --- references -----------------------------------------------------------------------------


def ref_none_encode(values: list[float]) -> bytes:
    return b"".join(struct.pack("<f", v) for v in values)


def ref_none_decode(raw: bytes, n: int) -> list[float]:
    return floats(raw)


def ref_fp16_encode(values: list[float]) -> bytes:
    return b"".join(struct.pack("<e", max(-F16_MAX, min(F16_MAX, v))) for v in values)


def ref_fp16_decode(raw: bytes, n: int) -> list[float]:
    return [struct.unpack("<e", raw[2 * i: 2 * i + 2])[0] for i in range(n)]


def ref_onebit_encode(values: list[float], chunk: int, scale: str) -> tuple[list[float], bytes]:
    """(scales, sign bytes): mean |x| or RMS per chunk in float64, bit set for x >= 0."""
    scales = []
    for start in range(0, len(values), chunk):
        part = values[start: start + chunk]
        if scale == "mean_abs":
            scales.append(sum(abs(v) for v in part) / len(part))
        else:
            scales.append(math.sqrt(sum(v * v for v in part) / len(part)))
    return scales, pack_codes([1 if v >= 0 else 0 for v in values], 1)


def ref_onebit_decode(raw: bytes, n: int, chunk: int) -> list[float]:
    n_chunks = math.ceil(n / chunk)
    scales, signs = floats(raw[: 4 * n_chunks]), raw[4 * n_chunks:]
    assert len(signs) == math.ceil(n / 8)
    out = []
    for i in range(n):
        s = scales[i // chunk]
        out.append(s if code_at(signs, i, 1) else -s)
    for i in range(n, 8 * len(signs)):
        assert code_at(signs, i, 1) == 0, "padding bits must be zero"
    return out


def ref_twobit_encode(values: list[float], chunk: int, sparse: set[int]) -> tuple[list[float], list[int]]:
    """(scales, codes) given the sparse index set: scale = mean |x| over the chunk's non-sparse
    elements (0 if none); code = 2*(x >= 0) + (not sparse and |x| > T*scale)."""
    scales = []
    for start in range(0, len(values), chunk):
        kept = [abs(values[i]) for i in range(start, min(start + chunk, len(values))) if i not in sparse]
        scales.append(sum(kept) / len(kept) if kept else 0.0)
    codes = []
    for i, v in enumerate(values):
        outer = i not in sparse and abs(v) > THRESHOLD * scales[i // chunk]
        codes.append(2 * (v >= 0) + outer)
    return scales, codes


def ref_twobit_decode(raw: bytes, n: int, chunk: int, k: int) -> list[float]:
    n_chunks = math.ceil(n / chunk)
    at = 4 * n_chunks
    scales = floats(raw[:at])
    indices = int32s(raw[at: at + 4 * k])
    values = floats(raw[at + 4 * k: at + 8 * k])
    codes = raw[at + 8 * k:]
    assert len(codes) == math.ceil(n / 4)
    out = []
    for i in range(n):
        c, s = code_at(codes, i, 2), scales[i // chunk]
        magnitude = min(f32(f32(OUTER) * s), F32_MAX) if c & 1 else f32(f32(INNER) * s)
        out.append(magnitude if c >= 2 else -magnitude)
    for i, v in zip(indices, values):
        out[i] = v
    for i in range(n, 4 * len(codes)):
        assert code_at(codes, i, 2) == 0, "padding codes must be zero"
    return out


def ref_decode(codec: Codec, raw: bytes, n: int) -> list[float]:
    if codec.name == "none":
        return ref_none_decode(raw, n)
    if codec.name == "fp16":
        return ref_fp16_decode(raw, n)
    if codec.name == "1bit":
        return ref_onebit_decode(raw, n, codec.chunk_size)
    return ref_twobit_decode(raw, n, codec.chunk_size, codec.sparse_count(n))


def formula(codec: Codec, n: int) -> int:
    """Wire size written out from the module docstrings."""
    if codec.name == "none":
        return 4 * n
    if codec.name == "fp16":
        return 2 * n
    if codec.name == "1bit":
        return math.ceil(n / 8) + 4 * math.ceil(n / codec.chunk_size)
    k = math.ceil(round(codec.sparse_fraction * n, 9))
    return math.ceil(n / 4) + 4 * math.ceil(n / codec.chunk_size) + 8 * k


# --- inputs ---------------------------------------------------------------------------------


def make(case: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if case == "random":
        return x
    if case == "zero":
        return torch.zeros(shape)
    if case == "constant":
        return torch.full(shape, -0.375)
    if case == "huge":
        return x * 1e30
    if case == "tiny":
        return x * 1e-30
    if case == "near_max":  # chunk sums overflow float32; values themselves are finite
        return x.sign() * 3.0e38 + x * 1e36
    if case == "biased":  # values biased away from zero, as DeepSpeed's torch_sim tests use
        return x.abs() + 0.5
    raise AssertionError(case)


CASES = ["random", "zero", "constant", "huge", "tiny", "near_max", "biased"]
CODEC_SETTINGS = [("none", {}), ("fp16", {}), ("1bit", {}), ("1bit", {"chunk_size": 64}),
                  ("1bit", {"scale": "rms"}), ("1bit", {"chunk_size": 64, "scale": "rms"}),
                  ("2bit", {}), ("2bit", {"chunk_size": 64, "sparse_fraction": 0.05})]
CODEC_IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in CODEC_SETTINGS]


def check_against_reference(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """The three checks of the module docstring; returns the decoded tensor."""
    n = x.numel()
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert isinstance(encoded, Encoded) and encoded.codec == codec.name
    assert encoded.numel == n and encoded.shape == tuple(x.shape) and encoded.dtype == x.dtype
    assert encoded.payload.dtype == torch.uint8 and encoded.payload.device == x.device
    assert encoded.payload.numel() == codec.wire_bytes(n) == formula(codec, n)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32 and decoded.device == x.device

    raw = bytes(encoded.payload.cpu().tolist())
    values = x.detach().cpu().float().reshape(-1).tolist()
    got = decoded.cpu().reshape(-1).tolist()
    # (1) the documented layout, read by the reference, is exactly what the codec decodes
    assert ref_decode(codec, raw, n) == got

    # (2) the reference encoder agrees
    if codec.name == "none":
        assert raw == ref_none_encode(values)
        assert got == values
    elif codec.name == "fp16":
        assert raw == ref_fp16_encode(values)
    elif codec.name == "1bit":
        scales, signs = ref_onebit_encode(values, codec.chunk_size, codec.scale)
        n_chunks = len(scales)
        assert raw[4 * n_chunks:] == signs
        assert floats(raw[: 4 * n_chunks]) == pytest.approx(scales, rel=1e-5, abs=0)
    else:
        check_twobit_encoding(codec, values, raw)
    return decoded


def check_twobit_encoding(codec: TwoBitCodec, values: list[float], raw: bytes) -> None:
    n, k = len(values), codec.sparse_count(len(values))
    at = 4 * math.ceil(n / codec.chunk_size)
    indices = int32s(raw[at: at + 4 * k])
    # The sparse part is a valid top-k (ties may be broken either way), ascending, exact values.
    assert len(indices) == k and indices == sorted(set(indices)) and all(0 <= i < n for i in indices)
    chosen = set(indices)
    if chosen and len(chosen) < n:
        assert min(abs(values[i]) for i in chosen) >= max(abs(v) for i, v in enumerate(values) if i not in chosen)
    assert floats(raw[at + 4 * k: at + 8 * k]) == [f32(values[i]) for i in indices]

    scales, codes = ref_twobit_encode(values, codec.chunk_size, chosen)
    assert floats(raw[:at]) == pytest.approx(scales, rel=1e-5, abs=0)
    packed = raw[at + 8 * k:]
    for i, want in enumerate(codes):
        got = code_at(packed, i, 2)
        if got != want:
            # Only the magnitude bit, and only for |x| within float32 rounding of the threshold.
            edge = THRESHOLD * scales[i // codec.chunk_size]
            assert got ^ want == 1 and abs(abs(values[i]) - edge) <= 1e-5 * edge, (i, got, want)


# --- round trips against the references -----------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: str(math.prod(s)))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name,opts", CODEC_SETTINGS, ids=CODEC_IDS)
def test_round_trip_matches_reference(name, opts, case, shape):
    codec = get_codec(name, **opts)
    x = make(case, shape)
    decoded = check_against_reference(codec, x)
    assert bool(torch.isfinite(decoded).all())
    if name == "fp16":
        assert decoded.abs().max() <= F16_MAX  # clamped, never inf
    if case in ("zero", "constant") and name in ("none", "1bit"):
        assert torch.equal(decoded, x)  # a constant chunk is its own mean |x|


@pytest.mark.parametrize("name,opts", CODEC_SETTINGS, ids=CODEC_IDS)
def test_large_tensor_matches_reference(name, opts):
    """Past the sizes where the codecs switch to their large-tensor paths (bit packing one
    position at a time, sampled top-k): 70001 elements, 2**16 + 4465."""
    check_against_reference(get_codec(name, **opts), make("random", (70001,), seed=6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CODECS))
def test_device_dtype_and_layout_of_inputs(name, device):
    """Non-contiguous, bf16/fp16/fp64 and multi-dimensional inputs; decoded float32 on the input's device."""
    codec = get_codec(name)
    base = make("random", (64, 33)).to(device)
    for x in (base.t(), base.to(torch.bfloat16), base.to(torch.float16), base.to(torch.float64), base[::2, 1:]):
        encoded = codec.encode(x)
        decoded = codec.decode(encoded)
        assert encoded.dtype == x.dtype and encoded.payload.device == x.device
        assert decoded.shape == x.shape and decoded.dtype == torch.float32 and decoded.device == x.device
        same = codec.decode(codec.encode(x.float().contiguous()))
        assert torch.equal(decoded, same)
        assert ref_decode(codec, bytes(encoded.payload.cpu().tolist()), x.numel()) == decoded.cpu().reshape(-1).tolist()


@pytest.mark.parametrize("name", list(CODECS))
def test_empty_tensor(name):
    codec = get_codec(name)
    encoded = codec.encode(torch.empty(0, 5))
    assert encoded.nbytes == codec.wire_bytes(0) == 0
    assert codec.decode(encoded).shape == (0, 5)


def test_fp16_clamps_out_of_range_values_instead_of_inf():
    x = torch.tensor([1e30, -1e30, 65519.0, 65520.0, -7e4, 65504.0, 1.5, 1e-30])
    codec = get_codec("fp16")
    got = codec.decode(codec.encode(x))
    assert got.tolist() == [F16_MAX, -F16_MAX, F16_MAX, F16_MAX, -F16_MAX, F16_MAX, 1.5, 0.0]


def test_onebit_rms_scale_by_hand():
    codec = OneBitCodec(chunk_size=8, scale="rms")
    x = torch.tensor([3.0, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-30, -1e-30])
    got = codec.decode(codec.encode(x)).tolist()
    s = math.sqrt(25 / 8)
    assert got[:8] == pytest.approx([s, -s] + [s] * 6, rel=1e-6)
    assert got[8:] == pytest.approx([1e-30, -1e-30], rel=1e-6)  # squares underflow float32: rescaled


def test_onebit_zero_is_positive_and_chunks_have_their_own_scale():
    codec = OneBitCodec(chunk_size=8)
    x = torch.tensor([0.0, -0.0, 1.0, -3.0, 0.0, 0.0, 0.0, 0.0] + [10.0, -10.0, 10.0])
    got = codec.decode(codec.encode(x)).tolist()
    assert got[:8] == [0.5, 0.5, 0.5, -0.5, 0.5, 0.5, 0.5, 0.5]  # mean |x| of chunk 0 is 4/8
    assert got[8:] == [10.0, -10.0, 10.0]  # the short last chunk averages its 3 real elements


def test_twobit_levels_and_sparse_part_by_hand():
    codec = TwoBitCodec(chunk_size=8, sparse_fraction=0.1)  # k = ceil(0.1 * 10) = 1
    x = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.0, 0.5, -0.5, 1.0, 100.0, 3.0])
    got = codec.decode(codec.encode(x))
    s0 = 8.0 / 8  # chunk 0: mean |x| over its 8 elements
    inner, outer = f32(INNER) * s0, f32(OUTER) * s0
    want0 = [inner, -inner, outer, -outer, inner, inner, -inner, inner]
    assert got[:8].tolist() == pytest.approx(want0, rel=1e-6)
    # chunk 1: 100.0 is the sparse entry (sent exactly); the scale is 3.0 over the one other element
    assert got[8].item() == 100.0
    assert got[9].item() == pytest.approx(f32(INNER) * 3.0, rel=1e-6)


def test_twobit_constants_are_the_gaussian_lloyd_max_quantiser():
    """Optimality conditions of a 4-level quantiser for N(0, 1), in mean-|x| units m: each level
    is the centroid of its cell, and the threshold is midway between the levels."""
    m = math.sqrt(2 / math.pi)
    def pdf(t):
        return math.exp(-t * t / 2) / math.sqrt(2 * math.pi)
    def cdf(t):
        return 0.5 * (1 + math.erf(t / math.sqrt(2)))
    t = THRESHOLD * m
    assert THRESHOLD == pytest.approx((INNER + OUTER) / 2, abs=2e-7)
    assert INNER * m == pytest.approx((pdf(0) - pdf(t)) / (cdf(t) - 0.5), abs=1e-6)
    assert OUTER * m == pytest.approx(pdf(t) / (1 - cdf(t)), abs=1e-6)


def test_twobit_error_on_gaussian_data_is_the_lloyd_max_error_and_beats_alternatives():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    plain = TwoBitCodec(sparse_fraction=0.0)
    mse = ((plain.decode(plain.encode(x)) - x) ** 2).mean().item()
    assert mse == pytest.approx(0.11748, abs=0.002)
    # The best uniform 4-level grid and the best ternary {-s, 0, +s}, with the same per-chunk scale.
    s = x.view(-1, 2048).abs().mean(1, keepdim=True) * math.sqrt(math.pi / 2)  # sigma estimate
    xs = x.view(-1, 2048)
    step = 0.9957 * s
    uniform = torch.where(xs.abs() > step, 1.5 * step, 0.5 * step) * xs.sign()
    ternary = torch.where(xs.abs() > 0.6120 * s, 1.2240 * s, torch.zeros_like(s)) * xs.sign()
    assert mse < ((uniform - xs) ** 2).mean().item()
    assert mse < ((ternary - xs) ** 2).mean().item()
    sparse = TwoBitCodec()  # the default 1% exact entries lower it further
    assert ((sparse.decode(sparse.encode(x)) - x) ** 2).mean().item() < 0.9 * mse


def test_twobit_outer_level_is_clamped_to_float32_range():
    codec = TwoBitCodec(chunk_size=8, sparse_fraction=0.0)
    x = torch.tensor([3.0e38, 3.0e38, 3.0e38, 3.0e38, 3.0e38, 3.0e38, 1.0e36, 1.0e36])
    got = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(got).all())


# --- sizes on the wire ----------------------------------------------------------------------


@pytest.mark.parametrize("name,opts", CODEC_SETTINGS, ids=CODEC_IDS)
def test_wire_bytes_formula_for_many_sizes(name, opts):
    codec = get_codec(name, **opts)
    for n in list(range(70)) + [2047, 2048, 2049, 4095, 4096, 4097, 10007, 65535, 65536, 65537]:
        assert codec.wire_bytes(n) == formula(codec, n), n
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 2049, 65537):
        assert codec.encode(torch.randn(n)).payload.numel() == codec.wire_bytes(n), n


def test_sparse_count_uses_the_decimal_fraction():
    assert TwoBitCodec(sparse_fraction=0.07).sparse_count(100) == 7  # 0.07 * 100 = 7.000000000000001
    assert TwoBitCodec(sparse_fraction=0.01).sparse_count(101) == 2
    assert TwoBitCodec(sparse_fraction=1).sparse_count(5) == 5
    assert TwoBitCodec(sparse_fraction=0).sparse_count(5) == 0


def test_onebit_sends_at_least_30x_fewer_bytes_than_fp32_for_10m_elements():
    n = 10_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    onebit, fp32 = get_codec("1bit"), get_codec("none")
    sent = onebit.encode(x).nbytes
    assert sent == math.ceil(n / 8) + 4 * math.ceil(n / 2048)
    ratio = fp32.wire_bytes(n) / sent
    assert ratio >= 30, ratio
    assert ratio <= 32


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("position", ["in a big chunk", "largest entry", "last"])
@pytest.mark.parametrize("name", ["fp16", "1bit", "2bit"])
def test_nonfinite_input_raises_naming_the_tensor(name, position, bad):
    codec = get_codec(name)
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(3))
    # "largest entry": +-inf (and, for torch.topk, NaN) is the largest magnitude, so the 2bit
    # codec meets it in its sparse part rather than in a chunk scale.
    x[{"in a big chunk": 5000, "largest entry": 123, "last": -1}[position]] = bad
    with pytest.raises(NonFiniteGradient, match="'model.layers.3.mlp.up_proj.weight'") as info:
        codec.encode(x, name="model.layers.3.mlp.up_proj.weight")
    assert isinstance(info.value, ValueError)
    assert info.value.name == "model.layers.3.mlp.up_proj.weight" and info.value.codec == name
    with pytest.raises(NonFiniteGradient, match="unnamed"):
        codec.encode(x)


def test_nonfinite_error_survives_pickling():
    err = pickle.loads(pickle.dumps(NonFiniteGradient("w", "1bit")))
    assert isinstance(err, NonFiniteGradient) and err.name == "w" and "'w'" in str(err)


def test_none_codec_passes_nonfinite_values_through():
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
    got = get_codec("none").decode(get_codec("none").encode(x))
    assert got[0].isnan() and got[1:].tolist() == [math.inf, -math.inf, 1.0]


@pytest.mark.parametrize("name", ["none", "fp16", "1bit", "2bit"])
def test_finite_values_near_float32_max_are_not_mistaken_for_inf(name):
    x = torch.full((4097,), 3.0e38)
    x[::3] = -3.0e38
    decoded = get_codec(name).decode(get_codec(name).encode(x))
    assert bool(torch.isfinite(decoded).all())


def test_payload_and_decode_never_alias_the_input():
    x = torch.randn(100)
    for name in CODECS:
        codec = get_codec(name)
        encoded = codec.encode(x)
        decoded = codec.decode(encoded)
        before = decoded.clone()
        x.add_(1.0)
        encoded.payload.zero_()
        assert torch.equal(decoded, before), name


def test_decode_from_an_unaligned_slice_of_a_receive_buffer():
    for name in CODECS:
        codec = get_codec(name)
        x = torch.randn(1001)
        encoded = codec.encode(x)
        buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), encoded.payload])
        moved = Encoded(encoded.codec, buffer[3:], encoded.numel, encoded.shape, encoded.dtype)
        assert torch.equal(codec.decode(moved), codec.decode(encoded)), name


def test_decode_rejects_a_payload_from_another_codec_or_options():
    x = torch.randn(5000)
    onebit = get_codec("1bit").encode(x)
    with pytest.raises(ValueError, match="made by the '1bit' codec"):
        get_codec("2bit").decode(onebit)
    with pytest.raises(ValueError, match="different codec options"):
        OneBitCodec(chunk_size=64).decode(onebit)
    with pytest.raises(ValueError, match="does not hold"):
        get_codec("1bit").decode(Encoded("1bit", onebit.payload, 5000, (5001,), torch.float32))


def test_encode_rejects_non_float_tensors():
    with pytest.raises(TypeError, match="floating-point"):
        get_codec("1bit").encode(torch.arange(10), name="step")
    with pytest.raises(TypeError, match="torch.Tensor"):
        get_codec("fp16").encode([1.0, 2.0])


def test_get_codec_names_and_options():
    assert list(CODECS) == ["none", "fp16", "1bit", "2bit"]
    assert get_codec("1bit") == OneBitCodec() and get_codec("1bit", chunk_size=256).chunk_size == 256
    assert get_codec("2bit", sparse_fraction=0.05).sparse_fraction == 0.05
    with pytest.raises(ValueError, match="unknown codec '3bit'; choose one of: none, fp16, 1bit, 2bit"):
        get_codec("3bit")
    with pytest.raises(ValueError, match="takes no options; got chunk_size"):
        get_codec("fp16", chunk_size=8)
    with pytest.raises(ValueError, match="takes options chunk_size, scale; got sparse_fraction"):
        get_codec("1bit", sparse_fraction=0.1)
    assert get_codec("1bit", scale="rms").scale == "rms"
    with pytest.raises(ValueError, match="scale must be one of mean_abs, rms"):
        get_codec("1bit", scale="l2")
    for bad in (0, -8, 12, 8.0, True):
        with pytest.raises(ValueError, match="multiple of 8"):
            get_codec("1bit", chunk_size=bad)
    for bad in (-0.1, 1.5, "0.1", None):
        with pytest.raises(ValueError, match="sparse_fraction"):
            get_codec("2bit", sparse_fraction=bad)


# --- the exact top-k used by the 2bit sparse part --------------------------------------------


@pytest.mark.parametrize("pattern", ["random", "ascending", "descending", "constant", "mostly zero", "spikes",
                                     "spikes on the sample"])
def test_top_magnitude_indices_is_an_exact_top_k(pattern):
    """Exact on any data, including data that fools its strided sample: 1000 (< k) spikes all on
    the sampled positions make the sampled threshold too high, so it must fall back."""
    n, k = 200_003, 2001
    g = torch.Generator().manual_seed(4)
    m = {"random": torch.rand(n, generator=g),
         "ascending": torch.arange(n, dtype=torch.float32),
         "descending": torch.arange(n, 0, -1, dtype=torch.float32),
         "constant": torch.ones(n),
         "mostly zero": (torch.rand(n, generator=g) > 0.999).float() * torch.rand(n, generator=g),
         "spikes": torch.where(torch.arange(n) % 12_207 == 0, 1e6, 1.0) * torch.rand(n, generator=g),
         "spikes on the sample": torch.rand(n, generator=g).index_fill_(0, torch.arange(0, 12_000, 12), 1e6)}[pattern]
    assert n // 16384 == 12  # the sampling stride the last pattern aims at
    got = top_magnitude_indices(m, k)
    assert got.dtype == torch.int64 and got.numel() == k
    assert torch.equal(got, got.unique())  # ascending, no repeats
    assert torch.equal(m[got].sort().values, torch.topk(m, k).values.sort().values)


def test_torch_save_of_an_encoded_payload_round_trips():
    """Payloads are ordinary tensors: they go through torch.save (or a process group) unchanged."""
    codec = get_codec("2bit")
    encoded = codec.encode(torch.randn(3000))
    buf = io.BytesIO()
    torch.save(encoded.payload, buf)
    buf.seek(0)
    again = Encoded(encoded.codec, torch.load(buf), encoded.numel, encoded.shape, encoded.dtype)
    assert torch.equal(codec.decode(again), codec.decode(encoded))

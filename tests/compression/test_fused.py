"""compression/fused.py against the per-chunk reference path, bit for bit: wire bytes, decoded
values and residuals, compiled (RAPIDFIRE_CODEC_COMPILE=always), eager, and with the native 1-bit
CPU kernels (RAPIDFIRE_CODEC_NATIVE=always), on odd sizes and edge values; and
compressed_allreduce's fused path against its reference path."""
from __future__ import annotations

import pytest
import torch

from rapidfire_ray.compression import Encoded, NonFiniteGradient, fused, get_codec, native
from rapidfire_ray.compression.codec import pairwise_sum
from rapidfire_ray.exchange.allreduce import AllreduceState, compressed_allreduce

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CODECS = [("none", {}), ("fp16", {}), ("1bit", {}), ("1bit", {"scale": "rms"}), ("1bit", {"chunk_size": 24}),
          ("2bit", {}), ("2bit", {"chunk_size": 64, "sparse_fraction": 0.05})]
IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in CODECS]
# 1, 7, one under and over a 2048 chunk, chunk multiples, and sizes that are neither
SIZES = [1, 7, 2047, 2048, 2049, 4096, 10007]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 differs from +0.0, and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def values(kind: str, n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 1e-3
    if kind == "edges":  # zeros, negative zeros, tiny and huge magnitudes, ties in magnitude
        x[::5] = 0.0
        x[1::7] = -0.0
        x[2::11] = 1e-38
        x[3::13] = -3e38
        x[4::17] = 0.5
        x[6::17] = -0.5
    elif kind == "zeros":
        x.zero_()
    elif kind == "negzero":
        x = torch.full((n,), -0.0)
    return x.to(device)


@pytest.fixture(params=["always", "off", "native"], ids=["compiled", "eager", "native"])
def compile_mode(request, monkeypatch):
    # Compiling costs seconds per kernel: the compiled runs cover the default options only.
    spec = request.node.callspec.params.get("codec_spec")
    if request.param == "always" and spec is not None and set(spec[1]) - {"scale"}:
        pytest.skip("compiled: default chunk options only (the eager run covers these)")
    if request.param == "native":
        if (spec is not None and spec[0] != "1bit") or request.node.callspec.params.get("device", "cpu") != "cpu":
            pytest.skip("native: the 1-bit codec on CPU only")
        # built once per machine (cached; see compression/native.py), eager for the rest
        monkeypatch.setenv(native.NATIVE_ENV, "always")
        monkeypatch.setenv(fused.COMPILE_ENV, "off")
        assert native.module() is not None
    else:
        monkeypatch.setenv(native.NATIVE_ENV, "off")
        monkeypatch.setenv(fused.COMPILE_ENV, request.param)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec_spec", CODECS, ids=IDS)
def test_roundtrip_equals_the_reference_bit_for_bit(codec_spec, device, compile_mode):
    codec = get_codec(codec_spec[0], **codec_spec[1])
    for kind in ("gauss", "edges", "zeros", "negzero"):
        for n in SIZES:
            x = values(kind, n, device)
            if codec.name == "fp16":
                x = x.clamp(-1e5, 1e5)  # the fp16 codec clamps; huge values tested via the allreduce below
            payload, decoded = fused.roundtrip(codec, x)
            encoded = codec.encode(x)
            assert torch.equal(payload, encoded.payload), (kind, n)
            assert same_bits(decoded, codec.decode(encoded).reshape(-1)), (kind, n)
            # decoding the bytes in one batched call gives the same values
            assert same_bits(fused.decode_segments(codec, payload.view(1, -1), n)[0], decoded), (kind, n)
    assert not fused.compile_failures()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec_spec", CODECS, ids=IDS)
@pytest.mark.parametrize("ws", [1, 3])
def test_segments_with_error_feedback_equal_the_reference(codec_spec, ws, device, compile_mode):
    """The allreduce's worker phase: ws segments of m, error added, residual zeroed past n."""
    codec = get_codec(codec_spec[0], **codec_spec[1])
    for n, kind in ((2049, "edges"), (10007, "gauss"), (7, "gauss")):
        m = -(-n // (8 * ws)) * 8
        flat = values(kind, n, device)
        error = values("gauss", ws * m, device) * 0.1
        error[n:] = 0
        corrected = torch.zeros(ws * m, device=device)
        corrected[:n] = flat
        corrected = (corrected + error).clamp(-3.4028234663852886e38, 3.4028234663852886e38)
        payload, decoded, residual = fused.encode_segments(codec, flat, ws, m, error=error.clone(),
                                                          residual=True, valid=n, clamp=True, finite=True,
                                                          in_place=True)
        for j in range(ws):
            part = corrected[j * m:(j + 1) * m]
            encoded = codec.encode(part)
            want = codec.decode(encoded)
            assert torch.equal(payload[j], encoded.payload), (n, j)
            assert same_bits(decoded[j], want), (n, j)
            if codec.lossless:
                assert residual is None
                continue
            res = (part - want).clamp(-3.4028234663852886e38, 3.4028234663852886e38)
            res[max(0, min(m, n - j * m)):] = 0
            assert same_bits(residual[j], res), (n, j)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec_spec", CODECS, ids=IDS)
@pytest.mark.parametrize("ws", [1, 2, 3])
def test_decode_mean_and_decode_into_out_equal_the_reference(codec_spec, ws, device, compile_mode):
    """The server's average of ws decoded rows (rows added in order, then divided: the
    reference's rounding, -0.0 included) and decoding into a caller's buffer shorter than the
    rows, for the whole rows, a cut mid-chunk and none."""
    codec = get_codec(codec_spec[0], **codec_spec[1])
    for n, kind in ((2049 * ws, "edges"), (7, "negzero"), (4096, "zeros")):
        m = -(-n // (8 * ws)) * 8
        payload, _, _ = fused.encode_segments(codec, values(kind, n, device), ws, m)
        rows = [codec.decode(Encoded(codec.name, payload[j], m, (m,), torch.float32)) for j in range(ws)]
        mean = rows[0].clone()
        for row in rows[1:]:
            mean += row
        mean /= ws
        assert same_bits(fused.decode_mean(codec, payload, m), mean), (n, kind)
        for keep in (m, m - 5, 0):
            out = torch.full((max(keep, 0),), 7.0, device=device)
            assert fused.decode_mean(codec, payload, m, out=out) is out
            assert same_bits(out, mean[:keep]), (n, kind, keep)
        flat = torch.cat(rows)
        for keep in (ws * m, max(ws * m - 11, 1), 1):
            out = torch.full((keep,), 7.0, device=device)
            assert fused.decode_segments(codec, payload, m, out=out) is out
            assert same_bits(out, flat[:keep]), (n, kind, keep)
    with pytest.raises(ValueError, match="out must be"):
        fused.decode_mean(codec, payload, m, out=torch.empty(m + 1, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec_spec", CODECS, ids=IDS)
def test_compressed_allreduce_fused_equals_reference_over_steps(codec_spec, device, compile_mode):
    """World size 1 (the collective-free path; tests/exchange compares ranks to the simulation):
    outputs and error buffers over 4 steps, with the huge values that need the clamp."""
    codec = get_codec(codec_spec[0], **codec_spec[1])
    fast, ref = AllreduceState(), AllreduceState()
    for step in range(4):
        x = values("edges" if step % 2 else "gauss", 10001, device).view(73, 137)
        got = compressed_allreduce(x, codec, fast, fused=True)
        want = compressed_allreduce(x, codec, ref, fused=False)
        assert got.shape == want.shape and same_bits(got, want), step
        assert (fast.worker_error is None) == (ref.worker_error is None)
        if ref.worker_error is not None:
            assert same_bits(fast.worker_error, ref.worker_error), step


@pytest.mark.parametrize("codec_name", ["fp16", "1bit", "2bit"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_raises_and_leaves_the_state_alone(codec_name, bad, compile_mode):
    codec = get_codec(codec_name)
    x = values("gauss", 4099, "cpu")
    with pytest.raises(NonFiniteGradient):
        fused.roundtrip(codec, torch.where(torch.arange(4099) == 4000, bad, x))
    state = AllreduceState()
    compressed_allreduce(x, codec, state, fused=True)
    before = state.worker_error.clone()
    x[17] = bad
    with pytest.raises(NonFiniteGradient):
        compressed_allreduce(x, codec, state, fused=True)
    assert same_bits(state.worker_error, before)


def test_pairwise_sum_adds_halves_in_a_fixed_order():
    rows = torch.tensor([[1e8, 1.0, -1e8, 1.0, 3.0]])
    # padded to 8, halves added: ((1e8 + 3) + (-1e8 + 0)) + ((1 + 0) + (1 + 0)) = 0 + 2 in float32
    # (1e8 + 3 rounds to 1e8); left to right it would be 4
    assert torch.equal(pairwise_sum(rows), torch.tensor([2.0]))
    assert torch.equal(pairwise_sum(torch.tensor([[2.5]])), torch.tensor([2.5]))
    x = torch.randn(37, 2048, generator=torch.Generator().manual_seed(3))
    # the same per row whatever the number of rows (ATen's reductions do not promise that)
    assert torch.equal(pairwise_sum(x)[5:6], pairwise_sum(x[5:6]))


@pytest.fixture
def fresh_native(monkeypatch):
    """native.py as in a new process (nothing built or tried yet)."""
    for attr in ("_module", "_thread", "_failure"):
        monkeypatch.setattr(native, attr, None)


def test_auto_builds_in_the_background_and_serves_the_same_bytes_meanwhile(monkeypatch, fresh_native):
    monkeypatch.setenv(native.NATIVE_ENV, "auto")
    codec = get_codec("1bit")
    x = values("edges", 10007, "cpu")
    payload, decoded = fused.roundtrip(codec, x)  # the build starts; the other kernels serve
    assert native._thread is not None
    assert native.wait(timeout=900) is not None, native.failure()
    assert fused.native_encodes(codec, x, None)
    again, decoded_again = fused.roundtrip(codec, x)
    assert torch.equal(payload, again) and same_bits(decoded, decoded_again)


def test_a_failed_build_warns_once_and_the_other_kernels_serve(monkeypatch, fresh_native):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setenv(native.NATIVE_ENV, "auto")
    codec = get_codec("1bit")
    x = values("gauss", 4099, "cpu")
    with pytest.warns(RuntimeWarning, match="building the native 1-bit CPU kernels failed .*Ninja is required"):
        fused.roundtrip(codec, x)
        native.wait(timeout=60)
    assert native.failure() == "RuntimeError: Ninja is required to load C++ extensions"
    payload, _ = fused.roundtrip(codec, x)  # not retried
    assert torch.equal(payload, codec.encode(x).payload) and not fused.native_encodes(codec, x, None)
    monkeypatch.setenv(native.NATIVE_ENV, "always")
    with pytest.raises(RuntimeError, match="Ninja is required"):
        native.module()


def test_a_bad_native_mode_is_one_line(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "sometimes")
    with pytest.raises(ValueError, match="RAPIDFIRE_CODEC_NATIVE='sometimes': choose one of auto, off, always"):
        native.module()


def test_the_reference_path_is_selectable_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.setenv(fused.PATH_ENV, "reference")
    assert not fused.use_fused(get_codec("1bit"))
    monkeypatch.setenv(fused.PATH_ENV, "fused")
    assert fused.use_fused(get_codec("1bit"))
    monkeypatch.setenv(fused.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="RAPIDFIRE_CODEC_PATH='fast': choose one of fused, reference"):
        fused.codec_path()

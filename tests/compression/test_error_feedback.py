"""rapidfire_ray.compression.ErrorFeedback: bounded residuals, nothing lost (the sum of what
was sent is the sum of the true tensors minus the final residual), NaN/inf refused without
touching state, and residuals that survive a checkpoint."""
from __future__ import annotations

import io

import pytest
import torch

from rapidfire_ray.compression import ErrorFeedback, NonFiniteGradient, get_codec
from rapidfire_ray.compression.error_feedback import STATE_FORMAT

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LOSSY = [("fp16", {}), ("1bit", {}), ("1bit", {"scale": "rms"}), ("2bit", {})]
LOSSY_IDS = ["fp16", "1bit", "1bit-rms", "2bit"]
N = 4099  # two full chunks and a short one


def gradients(steps: int, bias: float = 0.0, seed: int = 0, n: int = N):
    """`steps` gradients: a fixed per-element bias of std `bias` plus N(0, 1) noise."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=g) * bias
    for _ in range(steps):
        yield mean + torch.randn(n, generator=g)


def run(codec, grads, feedback=None, name="w"):
    """Compress every gradient with feedback; returns (feedback, residual norms, float64 sums of
    the sent and of the true tensors)."""
    feedback = feedback or ErrorFeedback()
    norms, sent, true = [], 0, 0
    for grad in grads:
        decoded = codec.decode(feedback.compress(name, grad, codec))
        sent = sent + decoded.double()
        true = true + grad.double()
        norms.append(feedback.residual(name).norm().item())
    return feedback, norms, sent, true


@pytest.mark.parametrize("name,opts", LOSSY, ids=LOSSY_IDS)
def test_residual_stays_bounded_over_200_steps(name, opts):
    codec = get_codec(name, **opts)
    _, norms, _, _ = run(codec, gradients(200))
    grad_norm = N ** 0.5
    # Level after warm-up, and no drift: a linear growth would double it between the windows.
    early, late = sum(norms[50:100]) / 50, sum(norms[150:200]) / 50
    assert late <= 1.1 * early, (early, late)
    assert max(norms) <= grad_norm  # below one gradient's norm; for 1bit ~0.77 of it
    if name == "fp16":
        assert max(norms) <= 1e-3 * grad_norm


@pytest.mark.parametrize("name,opts", [("fp16", {}), ("1bit", {"scale": "rms"}), ("2bit", {})],
                         ids=["fp16", "1bit-rms", "2bit"])
def test_residual_stays_bounded_under_a_persistent_bias(name, opts):
    """A steady per-element mean (like momentum's) on top of the noise. The 1bit "mean_abs" scale
    is left out on purpose: its residual keeps growing for hundreds of steps here (see onebit.py)."""
    codec = get_codec(name, **opts)
    _, norms, _, true = run(codec, gradients(400, bias=0.5))
    early, late = sum(norms[200:250]) / 50, sum(norms[350:400]) / 50  # 1bit-rms settles by ~250
    assert late <= 1.15 * early, (early, late)
    assert max(norms) <= 0.05 * true.norm().item()  # the true sum grows linearly; the residual does not


@pytest.mark.parametrize("name,opts", LOSSY, ids=LOSSY_IDS)
def test_sum_sent_is_sum_true_minus_final_residual(name, opts):
    codec = get_codec(name, **opts)
    feedback, _, sent, true = run(codec, gradients(200, bias=0.5))
    final = feedback.residual("w").double()
    # float32 rounding of (grad + residual) and (corrected - decoded): ~1e-7 relative per step
    assert torch.allclose(sent, true - final, rtol=0, atol=1e-4 * true.abs().max().item())
    # and the residual is what was not sent: without it the identity is far off
    assert (sent - true).abs().max() > 100 * (sent - (true - final)).abs().max()


def test_without_feedback_the_error_accumulates():
    """The point of the residual: the same codec without it loses a growing amount."""
    codec = get_codec("1bit")
    lost = 0
    for grad in gradients(200, bias=0.5):
        lost = lost + (grad - codec.decode(codec.encode(grad))).double()
    _, norms, _, _ = run(codec, gradients(200, bias=0.5))
    assert lost.norm() > 5 * norms[-1]


@pytest.mark.parametrize("device", DEVICES)
def test_residuals_live_on_the_tensor_device_in_float32(device):
    feedback = ErrorFeedback()
    codec = get_codec("2bit")
    grad = torch.randn(3, 700, device=device, dtype=torch.bfloat16)
    encoded = feedback.compress("layer.weight", grad, codec)
    residual = feedback.residual("layer.weight")
    assert residual.device == grad.device and residual.dtype == torch.float32 and residual.shape == grad.shape
    assert encoded.payload.device == grad.device
    assert torch.allclose(residual, grad.float() - codec.decode(encoded))
    again = feedback.compress("layer.weight", grad, codec)  # float32 inside now; still says bf16
    assert encoded.dtype == again.dtype == torch.bfloat16 and again.shape == (3, 700)


def test_nonfinite_gradient_names_the_tensor_and_leaves_the_residual_alone():
    feedback = ErrorFeedback()
    codec = get_codec("1bit")
    feedback.compress("model.norm.weight", torch.randn(N), codec)
    before = feedback.residual("model.norm.weight").clone()
    bad = torch.randn(N)
    bad[17] = float("nan")
    with pytest.raises(NonFiniteGradient, match="'model.norm.weight'"):
        feedback.compress("model.norm.weight", bad, codec)
    assert torch.equal(feedback.residual("model.norm.weight"), before)
    bad[17] = float("inf")
    with pytest.raises(NonFiniteGradient, match="'fresh'"):
        feedback.compress("fresh", bad, get_codec("2bit"))
    assert "fresh" not in feedback


def test_lossless_codec_keeps_no_residual_and_flushes_an_old_one():
    feedback = ErrorFeedback()
    grad = torch.randn(N)
    feedback.compress("w", grad, get_codec("1bit"))
    left = feedback.residual("w").clone()
    none = get_codec("none")
    sent = none.decode(feedback.compress("w", grad, none))
    assert torch.equal(sent, grad + left)  # the old residual goes out with this step
    assert "w" not in feedback and len(feedback) == 0
    nan = torch.full((3,), float("nan"))
    assert none.decode(feedback.compress("v", nan, none)).isnan().all()  # "none" passes NaN through


def test_shape_mismatch_under_one_name_is_an_error():
    feedback = ErrorFeedback()
    feedback.compress("w", torch.randn(10, 10), get_codec("1bit"))
    with pytest.raises(ValueError, match="'w' has shape \\(10, 10\\).*\\(100,\\)"):
        feedback.compress("w", torch.randn(100), get_codec("1bit"))


def test_reset_all_or_some():
    feedback = ErrorFeedback()
    for name in ("a", "b", "c"):
        feedback.compress(name, torch.randn(50), get_codec("1bit"))
    feedback.reset(["a", "missing"])
    assert feedback.names() == ["b", "c"]
    feedback.reset()
    assert len(feedback) == 0 and feedback.state_dict()["residuals"] == {}


@pytest.mark.parametrize("name,opts", LOSSY, ids=LOSSY_IDS)
def test_state_dict_round_trip_gives_identical_next_encodings(name, opts):
    codec = get_codec(name, **opts)
    shapes = {"embed.weight": (100, 41), "mlp.up.weight": (N,), "norm.weight": (7,)}
    g = torch.Generator().manual_seed(5)
    live = ErrorFeedback()
    for _ in range(10):
        for key, shape in shapes.items():
            live.compress(key, torch.randn(shape, generator=g), codec)

    state = live.state_dict()
    assert state["format"] == STATE_FORMAT
    assert all(t.device.type == "cpu" for t in state["residuals"].values())
    buf = io.BytesIO()
    torch.save(state, buf)  # as a checkpoint would
    buf.seek(0)
    restored = ErrorFeedback()
    restored.load_state_dict(torch.load(buf), device="cpu")

    for _ in range(3):
        for key, shape in shapes.items():
            grad = torch.randn(shape, generator=g)
            a, b = live.compress(key, grad, codec), restored.compress(key, grad, codec)
            assert torch.equal(a.payload, b.payload), key
    for key in shapes:
        assert torch.equal(live.residual(key), restored.residual(key))


def test_state_dict_is_a_copy_and_load_places_residuals():
    live = ErrorFeedback()
    live.compress("a", torch.randn(30), get_codec("1bit"))
    live.compress("b", torch.randn(30), get_codec("1bit"))
    state = live.state_dict()
    saved = state["residuals"]["a"].clone()
    live.compress("a", torch.randn(30), get_codec("1bit"))  # later steps do not change the saved state
    assert torch.equal(state["residuals"]["a"], saved)

    restored = ErrorFeedback()
    restored.load_state_dict(state, device={"a": "cpu"})  # "b" unlisted: stays on CPU until used
    state["residuals"]["a"].add_(1.0)  # nor does the caller's state dict alias the loaded buffers
    assert torch.equal(restored.residual("a"), saved)
    assert restored.residual("b").device.type == "cpu"
    assert set(restored.names()) == {"a", "b"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loaded_residual_moves_to_the_gradient_device():
    live = ErrorFeedback()
    codec = get_codec("1bit")
    live.compress("w", torch.randn(N, device="cuda"), codec)
    restored = ErrorFeedback()
    restored.load_state_dict(live.state_dict())  # no device given: CPU until first use
    assert restored.residual("w").device.type == "cpu"
    grad = torch.randn(N, device="cuda")
    assert torch.equal(live.compress("w", grad, codec).payload, restored.compress("w", grad, codec).payload)
    assert restored.residual("w").device.type == "cuda"


def test_load_rejects_something_else():
    feedback = ErrorFeedback()
    with pytest.raises(ValueError, match="not an ErrorFeedback state dict"):
        feedback.load_state_dict({"state": {}, "param_groups": []})  # an optimizer's, say
    with pytest.raises(ValueError, match="not an ErrorFeedback state dict"):
        feedback.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="map names to tensors"):
        feedback.load_state_dict({"format": STATE_FORMAT, "residuals": {"w": [1.0]}})

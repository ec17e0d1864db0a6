"""compressed_allreduce on 2- and 4-process gloo groups against simulate_compressed_allreduce
(bit for bit), against the exact mean (none, fp16), bytes against the codec's wire_bytes, the
world-size-1 path, error feedback (bounded, nothing lost), padding, NaN/inf, and state."""
from __future__ import annotations

import functools
import math

import _comm_workers as w
import pytest
import torch

from rapidfire_ray.exchange import (
    ALIGN,
    AllreduceState,
    CommStats,
    compressed_allreduce,
    layout,
    simulate_compressed_allreduce,
)
from rapidfire_ray.compression import NonFiniteGradient, get_codec

pytestmark = pytest.mark.timeout(120)

CODEC_IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in w.CODECS]


def codec_of(i: int):
    name, opts = w.CODECS[i]
    return get_codec(name, **opts)


@functools.cache
def simulate(ws: int, codec_index: int, steps: int = w.STEPS):
    """Per step: (simulated output, true mean); and the final simulated states (cached: read only)."""
    codec = codec_of(codec_index)
    states = [AllreduceState() for _ in range(ws)]
    out = []
    for step in range(steps):
        xs = [w.make_input(r, step, codec_index) for r in range(ws)]
        sim = simulate_compressed_allreduce(xs, codec, states)
        assert all(torch.equal(sim[0], s) for s in sim[1:])
        out.append((sim[0], torch.stack(xs).double().mean(0)))
    return out, states


def results(group, codec_index):
    return [r["allreduce"]["codecs"][codec_index] for r in group]


# --- multi-process -------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("codec_index", range(len(w.CODECS)), ids=CODEC_IDS)
def test_matches_simulation_bit_for_bit(ws, codec_index, group2, group4):
    ranks = results(group2 if ws == 2 else group4, codec_index)
    expected, states = simulate(ws, codec_index)
    for step, (sim, _) in enumerate(expected):
        for r, res in enumerate(ranks):
            got = res["outputs"][step]
            assert got.dtype == torch.float32 and got.shape == (w.N,)
            assert torch.equal(got, sim), (step, r, (got - sim).abs().max().item())
            assert res["aliased"][step] == bool(step % 2)  # out=x given on odd steps: written there
    # and the error-feedback state each rank ends with is the simulation's
    for r, res in enumerate(ranks):
        for key in ("worker_error", "server_error"):
            want = getattr(states[r], key)
            assert (res["state"][key] is None) == (want is None), key
            if want is not None:
                assert torch.equal(res["state"][key], want), (r, key)


@pytest.mark.parametrize("ws", [2, 4])
def test_none_is_the_exact_mean_and_fp16_within_its_rounding(ws, group2, group4):
    group = group2 if ws == 2 else group4
    for name, tol in (("none", 1e-6), ("fp16", 2.0 ** -8)):
        i = [n for n, _ in w.CODECS].index(name)
        for step, (_, mean) in enumerate(simulate(ws, i)[0]):
            for res in results(group, i):
                err = (res["outputs"][step].double() - mean).abs().max().item()
                # fp16: each value (|x| < ~5) rounds twice (worker, server) at 2**-11 relative,
                # plus the error fed back from the previous step
                assert err <= tol * mean.abs().max().item(), (name, step, err)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("codec_index", range(len(w.CODECS)), ids=CODEC_IDS)
def test_bytes_counted_equal_the_wire_formula(ws, codec_index, group2, group4):
    codec = codec_of(codec_index)
    m = math.ceil(w.N / (ws * ALIGN)) * ALIGN
    per_call = 2 * (ws - 1) * codec.wire_bytes(m)  # phase 1: (ws-1) chunks out; phase 2: all_gather
    fp32 = 2 * (ws - 1) / ws * 4 * w.N
    for res in results(group2 if ws == 2 else group4, codec_index):
        for taken in res["stats"]:
            assert taken["bytes_sent"] == taken["bytes_received"] == per_call
            assert taken["comm_calls"] == 1 and taken["comm_latency_p50_s"] > 0
            assert taken["compression_ratio"] == pytest.approx(fp32 / per_call)
    if codec.name == "1bit" and codec.chunk_size == 2048:
        assert fp32 / per_call > 31


def test_subgroup_with_non_contiguous_global_ranks(group4):
    """new_group([1, 3]): peers are group ranks, not global ranks."""
    got = [group4[r]["allreduce"]["subgroup"] for r in w.SUBGROUP]
    assert all("subgroup" not in group4[r]["allreduce"] for r in (0, 2))
    expected, _ = simulate(2, 0)
    for step, (sim, _) in enumerate(expected):
        for res in got:
            assert torch.equal(res["outputs"][step], sim)


@pytest.mark.parametrize("ws", [2, 4])
def test_multiprocess_sum_of_outputs_is_sum_of_means_minus_final_errors(ws, group2, group4):
    for i in range(len(w.CODECS)):
        ranks = results(group2 if ws == 2 else group4, i)
        expected, _ = simulate(ws, i)
        total_out = sum(ranks[0]["outputs"][s].double() for s in range(w.STEPS))
        total_true = sum(mean for _, mean in expected)
        check_identity(total_out, total_true, [r["state"] for r in ranks], w.N)


def test_restored_state_continues_like_the_live_one(group2, group4):
    for group in (group2, group4):
        for r in group:
            assert all(c["resumed_equal"] for c in r["allreduce"]["codecs"])


# --- one process ---------------------------------------------------------------------------------


def check_identity(total_out, total_true, states, n):
    """sum(outputs) == sum(true means) - (mean_r worker_error_r + concat_j server_error_j)[:n]."""
    ws = len(states)
    final = torch.zeros(n, dtype=torch.float64)
    for s in states:
        we = s["worker_error"] if isinstance(s, dict) else s.worker_error
        if we is not None:
            final += we[:n].double() / ws
    servers = [s["server_error"] if isinstance(s, dict) else s.server_error for s in states]
    if ws > 1 and servers[0] is not None:
        final += torch.cat(servers)[:n].double()
    scale = total_true.abs().max().item()
    assert torch.allclose(total_out, total_true - final, rtol=0, atol=2e-5 * scale)
    return final


def biased_gradients(ws, steps, n, seed=0, bias=0.0):
    g = torch.Generator().manual_seed(seed)
    means = [torch.randn(n, generator=g) * bias for _ in range(ws)]
    for _ in range(steps):
        yield [m + torch.randn(n, generator=g) for m in means]


@pytest.mark.parametrize("name,opts", [("1bit", {}), ("1bit", {"scale": "rms"}), ("2bit", {}), ("fp16", {})],
                         ids=["1bit", "1bit-rms", "2bit", "fp16"])
def test_error_bounded_and_nothing_lost_over_60_steps(name, opts):
    ws, n, steps = 4, 4099, 60
    codec = get_codec(name, **opts)
    states = [AllreduceState() for _ in range(ws)]
    total_out, total_true, norms = 0, 0, []
    for xs in biased_gradients(ws, steps, n):
        total_out = total_out + simulate_compressed_allreduce(xs, codec, states)[0].double()
        total_true = total_true + torch.stack(xs).double().mean(0)
        err = sum(s.worker_error[:n].double() for s in states) / ws + torch.cat([s.server_error for s in states])[:n]
        norms.append(err.norm().item())
    final = check_identity(total_out, total_true, states, n)
    # bounded: no drift between the windows, and below one averaged gradient's norm (~sqrt(n/ws))
    early, late = sum(norms[20:40]) / 20, sum(norms[40:60]) / 20
    assert late <= 1.15 * early, (early, late)
    assert max(norms) <= math.sqrt(n / ws) * (1e-3 if name == "fp16" else 1.5)
    # the errors are what was not sent: without them the identity is far off
    assert (total_out - total_true).abs().max() > 10 * (total_out - (total_true - final)).abs().max()


def test_world_size_one_compresses_with_error_feedback_and_no_collective():
    assert not torch.distributed.is_initialized()
    codec = get_codec("1bit", chunk_size=64)
    state, sim_state, stats = AllreduceState(), AllreduceState(), CommStats()
    previous = torch.zeros(1001)
    for step in range(3):
        x = w.make_input(0, step, 0, n=1001).view(7, 143)
        out = compressed_allreduce(x, codec, state, stats=stats)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert torch.equal(out, simulate_compressed_allreduce([x], codec, [sim_state])[0])
        assert torch.equal(state.worker_error, sim_state.worker_error)
        assert state.worker_error.numel() == layout(1001, 1)[1] == 1008
        # out = x + previous error - new error
        assert torch.allclose(out.reshape(-1), x.reshape(-1) + previous - state.worker_error[:1001], atol=1e-6)
        previous = state.worker_error[:1001].clone()
        assert state.server_error is None
        taken = stats.take()
        assert taken["bytes_sent"] == taken["bytes_received"] == 0 and taken["comm_calls"] == 1
        assert taken["compression_ratio"] == 1.0


@pytest.mark.parametrize("n", [1, 7, 33, 8 * 4 + 1])
def test_tiny_and_odd_sizes(n):
    """Padding to world_size * 8: tensors smaller than the padding, not a multiple of it."""
    xs = [w.make_input(r, 0, 0, n=n) for r in range(4)]
    mean = torch.stack(xs).mean(0)
    out = simulate_compressed_allreduce(xs, get_codec("none"), [AllreduceState() for _ in range(4)])[0]
    assert torch.allclose(out, mean, atol=1e-6)
    states = [AllreduceState() for _ in range(4)]
    for step in range(3):
        simulate_compressed_allreduce([w.make_input(r, step, 0, n=n) for r in range(4)], get_codec("1bit"), states)
    m, padded = layout(n, 4)
    for s in states:  # padding never carries error
        assert s.worker_error.numel() == padded and s.server_error.numel() == m
        assert not s.worker_error[n:].any()
    assert not torch.cat([s.server_error for s in states])[n:].any()


def test_empty_tensor():
    out = compressed_allreduce(torch.empty(0, 3), get_codec("1bit"), AllreduceState())
    assert out.shape == (0, 3)


def test_exact_zero_counts_as_positive():
    """1-bit Adam's convention, from the 1bit codec: sign(0) = +1, so a zero decodes to +scale."""
    xs = [torch.tensor([0.0, 1.0, -1.0, 2.0] * 4), torch.tensor([0.0, 3.0, -3.0, 2.0] * 4)]
    out = simulate_compressed_allreduce(xs, get_codec("1bit", chunk_size=8), [AllreduceState(), AllreduceState()])[0]
    assert (out[0::4] > 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["none", "fp16", "1bit", "2bit"])
def test_nonfinite_raises_and_leaves_state_alone(name, bad):
    codec = get_codec(name)
    state = AllreduceState()
    x = w.make_input(0, 0, 0, n=5000)
    compressed_allreduce(x, codec, state)
    before = state.state_dict()
    y = x.clone()
    y[1234] = bad
    with pytest.raises(NonFiniteGradient):
        compressed_allreduce(y, codec, state)
    with pytest.raises(NonFiniteGradient):
        simulate_compressed_allreduce([x, y], codec, [state, AllreduceState()])
    after = state.state_dict()
    for key in before:
        assert (before[key] is None and after[key] is None) or torch.equal(before[key], after[key])


def test_huge_values_stay_finite():
    """Near float32 max the sum with the error would overflow: clamped, never inf."""
    xs = [torch.full((64,), 3.0e38), torch.full((64,), 3.0e38)]
    states = [AllreduceState(), AllreduceState()]
    for _ in range(3):
        for name in ("2bit",):
            out = simulate_compressed_allreduce(xs, get_codec(name, chunk_size=8), states)[0]
            assert torch.isfinite(out).all()
            assert all(torch.isfinite(s.worker_error).all() and torch.isfinite(s.server_error).all() for s in states)


def test_state_of_another_size_is_refused():
    state = AllreduceState()
    compressed_allreduce(torch.ones(100), get_codec("1bit"), state)
    with pytest.raises(ValueError, match="reset it"):
        compressed_allreduce(torch.ones(200), get_codec("1bit"), state)
    state.reset()
    compressed_allreduce(torch.ones(200), get_codec("1bit"), state)


def test_state_dict_holds_cpu_copies():
    state = AllreduceState()
    compressed_allreduce(w.make_input(0, 0, 0, n=300), get_codec("2bit"), state)
    d = state.state_dict()
    assert d["worker_error"].device.type == "cpu" and d["server_error"] is None
    d["worker_error"].zero_()
    assert state.worker_error.any()  # a copy, not an alias
    fresh = AllreduceState()
    fresh.load_state_dict(state.state_dict())
    assert torch.equal(fresh.worker_error, state.worker_error)

"""int8 saved activations: the quantiser's error bound, what is kept exact (parameters first), gradients close to
uncompressed ones (a decoder layer, a whole model, with checkpointing, under DDP), the bytes saved, and hooks
that never outlive a forward that raised."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from rapidfire_ray.memory.activations import (ActivationStats, Int8Activations, Int8Payload, SavedBytesCounter,
                                              decoder_layers, dequantize_int8, int8_saved_tensors, optimized_graph,
                                              quantize_int8)
from rapidfire_ray.memory.checkpointing import apply_checkpointing, checkpointed_indices

# Gradient error bounds (norm of the difference / norm of the reference): 1% overall and for every parameter but
# the attention's q and k projections, whose gradients at random init come from near-uniform attention (small
# differences of scores, against the int8 error of q, k, v and the attention output): 1.0-1.15% here.
OVERALL, QK_PROJECTIONS = 0.01, 0.015
VOCAB, ROWS, WIDTH = 259, 4, 128


def config(layers: int = 2, hidden: int = 128, tie: bool = True) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    cfg._attn_implementation = "sdpa"
    return cfg


def small_llama(layers: int = 2, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config(layers, tie=tie)).train()


def batch() -> dict:
    ids = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def gradients(model, inputs, context=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with context if context is not None else contextlib.nullcontext():
        loss = model(**inputs).loss
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_errors(got: dict, ref: dict) -> tuple[dict[str, float], float]:
    assert got.keys() == ref.keys()
    per = {n: ((got[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref}
    overall = (sum(((got[n] - ref[n]) ** 2).sum() for n in ref).sqrt()
               / sum((ref[n] ** 2).sum() for n in ref).sqrt()).item()
    return per, overall


def assert_close_gradients(got: dict, ref: dict) -> None:
    per, overall = relative_errors(got, ref)
    assert overall <= OVERALL, overall
    over = {n: e for n, e in per.items() if e > OVERALL}
    assert all(("q_proj" in n or "k_proj" in n) and e <= QK_PROJECTIONS for n, e in over.items()), over


# ----------------------------------------------------------------------------------------------------------------
# the quantiser


@pytest.mark.parametrize("dtype, roundoff", [(torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)])
@pytest.mark.parametrize("width, scales", [(96, 3), (40, 1)])  # blocks of 32; a row when 32 does not divide it
def test_round_trip_stays_within_half_a_scale_and_zero_blocks_stay_zero(dtype, roundoff, width, scales):
    torch.manual_seed(0)
    x = (torch.randn(3, 40, width) * torch.rand(3, 40, 1) * 10).to(dtype)
    x[1, 5] = 0  # a zero row
    x[2, 7, :] = 0
    x[2, 7, 3] = -1e-30  # a block with one tiny value
    payload = quantize_int8(x)
    out = dequantize_int8(payload)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    assert payload.data.dtype == torch.int8 and payload.scale.shape == (3, 40, scales, 1)
    assert payload.nbytes == x.numel() + 2 * 3 * 40 * scales
    err = (out.float() - x.float()).abs()
    scale = payload.scale.float().expand(payload.data.shape).flatten(-2)
    bound = scale / 2 * (1 + 1e-6) + x.float().abs() * roundoff  # + rounding to the dtype
    assert (err <= bound).all(), (err - bound).max()
    assert (out[1, 5] == 0).all() and out[2, 7, 3] < 0
    assert (out - x).abs().max() > 0  # it is lossy: int8, not a copy


def test_a_block_holding_inf_or_nan_comes_back_non_finite():
    x = torch.randn(3, 64)
    x[0, 3], x[1, 40], x[2, 5] = float("inf"), float("nan"), -float("inf")
    finite = dequantize_int8(quantize_int8(x)).isfinite().view(3, 2, 32)
    assert finite.tolist() == [[[False] * 32, [True] * 32], [[True] * 32, [False] * 32], [[False] * 32, [True] * 32]]


def test_round_trip_keeps_the_strides_of_a_permuted_tensor():
    x = torch.randn(2, 64, 4, 32).transpose(1, 2)  # (B, H, T, D) laid out as (B, T, H, D), as sdpa saves it
    out = dequantize_int8(quantize_int8(x))
    assert out.stride() == x.stride() and torch.allclose(out, x, atol=x.abs().max().item() / 200)


# ----------------------------------------------------------------------------------------------------------------
# what is kept


def test_what_is_compressed_and_what_is_kept_as_it_is():
    stats = ActivationStats()
    linear = torch.nn.Linear(64, 64)
    hooks = int8_saved_tensors(stats=stats, exclude=[linear])
    pack, unpack = hooks.pack_hook, hooks.unpack_hook
    big = torch.randn(32, 64, requires_grad=True)
    emb = torch.nn.Embedding(300, 64)(torch.arange(32))  # from one parameter, but an activation (other size)
    assert isinstance(pack(big), Int8Payload) and isinstance(pack(emb), Int8Payload)
    kept = {
        "parameter": linear.weight,
        "view of a parameter": linear.weight.t(),
        "sharing a parameter's storage": linear.weight.detach().requires_grad_(),  # known through `exclude`
        "autocast-style copy of a parameter": linear.weight.to(torch.bfloat16).t(),
        "constant": torch.randn(32, 64),
        "small": torch.randn(8, 64, requires_grad=True),
        "fp64": torch.randn(32, 64, dtype=torch.float64, requires_grad=True),
        "last dim of 1 (int8 + scale is larger)": torch.randn(2048, 1, requires_grad=True),
        "broadcast wider than its storage": torch.randn(1, 64, requires_grad=True).expand(64, 64),
        "integer": torch.arange(4096),
    }
    for name, t in kept.items():
        assert pack(t) is t and unpack(t) is t, name
    assert stats.parameters == 4 and stats.kept == len(kept) - 4 and stats.compressed == 2


def test_saved_weights_stay_exact_so_input_gradients_are_bit_exact():
    """A linear layer's input gradient is grad_out @ W: bit-exact when the saved W is exact (fp32, and the bf16
    copy autocast saves), while the weight gradient (from the compressed input) is only close."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96)
    x, g = torch.randn(64, 128), torch.randn(64, 96)
    for autocast in (False, True):
        runs = []
        for context in (contextlib.nullcontext(), int8_saved_tensors(stats=(stats := ActivationStats()))):
            xi = (x * 1.0).requires_grad_()
            linear.zero_grad()
            with context, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                (linear(xi).float() * g).sum().backward()  # grad_out = g
            runs.append((xi.grad, linear.weight.grad.clone()))
        (dx_ref, dw_ref), (dx, dw) = runs
        assert torch.equal(dx, dx_ref)
        assert stats.parameters == 1 and stats.compressed == 1
        assert 0 < ((dw - dw_ref).norm() / dw_ref.norm()).item() < OVERALL


def test_a_tensor_saved_by_several_ops_is_compressed_once():
    stats = ActivationStats()
    model = small_llama()
    with optimized_graph(model, stats=stats):
        model(**batch())
    # Per layer: q, k, v projections read one input, gate and up another, and the norms read x twice.
    assert stats.shared >= 4 * len(decoder_layers(model))
    # 7 linear weights and 2 norm weights per layer; the head's weight is outside the layers.
    assert stats.parameters == 9 * len(decoder_layers(model))


# ----------------------------------------------------------------------------------------------------------------
# gradients


def test_decoder_layer_gradients_are_close_to_uncompressed():
    torch.manual_seed(0)
    cfg = config()
    layer = LlamaDecoderLayer(cfg, layer_idx=0).train()
    hidden = torch.randn(ROWS, WIDTH, cfg.hidden_size)
    position_embeddings = LlamaRotaryEmbedding(cfg)(hidden, torch.arange(WIDTH)[None])
    target = torch.randn(ROWS, WIDTH, cfg.hidden_size)

    def run(context):
        layer.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        with context:
            out = layer(h, position_embeddings=position_embeddings)
        (out - target).pow(2).mean().backward()
        return {"input": h.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}

    stats = ActivationStats()
    assert_close_gradients(run(int8_saved_tensors(stats=stats)), run(contextlib.nullcontext()))
    assert stats.compressed and stats.stored_bytes < 0.3 * stats.raw_bytes


def test_whole_model_gradients_are_close_to_uncompressed():
    model = small_llama()
    reference = gradients(model, batch())
    assert_close_gradients(gradients(model, batch(), optimized_graph(model)), reference)
    # Leaving the context detaches: the next step is the uncompressed one, bit for bit.
    assert all(torch.equal(g, reference[n]) for n, g in gradients(model, batch()).items())


def test_compressing_the_loss_head_too_ruins_a_peaked_softmax():
    """Why only the decoder layers: with a peaked output distribution (log-probabilities down to -50) the
    int8 error on the saved fp32 log-softmax moves the loss gradient by several percent."""
    model = small_llama(tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        logp = model(**batch()).logits.log_softmax(-1)
    assert logp.min() < -40
    reference = gradients(model, batch())
    _, layers_only = relative_errors(gradients(model, batch(), optimized_graph(model)), reference)
    _, everything = relative_errors(gradients(model, batch(), optimized_graph()), reference)
    assert layers_only <= OVERALL < 2 * OVERALL < everything, (layers_only, everything)


def test_composes_with_gradient_checkpointing_of_some_layers():
    model = small_llama(layers=3)
    reference = gradients(model, batch())
    full, ckpt = ActivationStats(), ActivationStats()
    gradients(model, batch(), optimized_graph(model, stats=full))
    apply_checkpointing(model, [0, 2])
    assert_close_gradients(gradients(model, batch(), optimized_graph(model, stats=ckpt)), reference)
    # A checkpointed layer saves only its input (compressed too); the recompute runs outside the hooks.
    assert ckpt.raw_bytes < 0.5 * full.raw_bytes and ckpt.stored_bytes < 0.3 * ckpt.raw_bytes
    apply_checkpointing(model, [])
    with optimized_graph(model, checkpoint=True):  # every layer, for the duration only
        assert checkpointed_indices(model) == [0, 1, 2]
        loss = model(**batch()).loss
    loss.backward()
    assert checkpointed_indices(model) == []


def test_attaches_through_ddp(tmp_path):
    model = small_llama()
    expected = gradients(model, batch(), optimized_graph(model))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        stats = ActivationStats()
        handle = Int8Activations(stats=stats).attach(ddp)
        got = {name.removeprefix("module."): g for name, g in gradients(ddp, batch()).items()}
        handle.remove()
    finally:
        dist.destroy_process_group()
    assert stats.compressed and stats.parameters == 9 * 2
    assert all(torch.allclose(got[n], expected[n], rtol=1e-5, atol=1e-7) for n in expected)


# ----------------------------------------------------------------------------------------------------------------
# memory


def saved_bytes(model, inputs, layers_stats: ActivationStats | None) -> tuple[int, int]:
    """(raw, stored) bytes of the distinct activations saved in one forward over the whole model: the layers through
    `Int8Activations` (when `layers_stats` is given), everything else through a hook that keeps all it sees."""
    outside = ActivationStats()
    handle = Int8Activations(stats=layers_stats).attach(model) if layers_stats is not None else None
    with int8_saved_tensors(min_numel=2**62, stats=outside):  # inside the layers, the layers' hooks come first
        model(**inputs)
    if handle is not None:
        handle.remove()
    inside = layers_stats or ActivationStats()
    return outside.raw_bytes + inside.raw_bytes, outside.stored_bytes + inside.stored_bytes


def test_saved_activation_bytes_fall_to_under_0_3x_in_the_layers():
    model = small_llama(layers=4)
    level0, _ = saved_bytes(model, batch(), None)
    layers = ActivationStats()
    raw, level2 = saved_bytes(model, batch(), layers)
    assert raw == level0  # the same activations, counted once each
    assert layers.stored_bytes <= 0.3 * layers.raw_bytes, layers.as_dict()
    # The head's fp32 log-softmax (vocab x 4 bytes per token) and the final norm stay: at this tiny size the
    # whole model lands above 0.3x; the ratio falls towards the layers' as layers outnumber the head.
    head = level0 - layers.raw_bytes
    assert level2 == head + layers.stored_bytes and level2 < 0.35 * level0, (level2 / level0, head / level0)


def test_the_workers_counter_sees_the_whole_model_at_every_level():
    model = small_llama(layers=4)
    raw, stored = saved_bytes(model, batch(), ActivationStats())
    for int8, expected in ((False, (raw, raw)), (True, (raw, stored))):
        stats = ActivationStats()
        handles = [SavedBytesCounter(stats).attach(model)]
        if int8:
            handles.append(Int8Activations(stats=stats).attach(model))
        model(**batch())
        for handle in handles:
            handle.remove()
        assert (stats.raw_bytes, stats.stored_bytes) == expected, (int8, stats.as_dict())
        assert stats.parameters > 0 and (stats.compressed > 0) == int8


def test_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="act: 'fp8'"), optimized_graph(act="fp8"):
        pass
    with pytest.raises(ValueError, match="checkpoint=True needs the model"), optimized_graph(checkpoint=True):
        pass
    with pytest.raises(ValueError, match="Linear: no decoder layers found"):
        Int8Activations().attach(torch.nn.Linear(4, 4))
    custom = torch.nn.Module()  # not a transformers model: its `model.layers` are the layers
    custom.model = torch.nn.Module()
    custom.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    assert decoder_layers(custom) == list(custom.model.layers)
    with pytest.raises(ValueError, match="no decoder layer supports gradient checkpointing"), \
            optimized_graph(custom, checkpoint=True):
        pass


# ----------------------------------------------------------------------------------------------------------------
# hooks never outlive their forward


def test_a_forward_that_raises_leaves_no_hooks_behind():
    model = small_llama()
    reference = gradients(model, batch())
    stats = ActivationStats()
    handle = Int8Activations(stats=stats).attach(model)

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    raiser = decoder_layers(model)[1].mlp.register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model(**batch())
    raiser.remove()
    assert stats.compressed  # the hooks were in place when it raised
    # A plain graph built now goes through no hooks: nothing is packed.
    stats.reset()
    a, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    (a * b).sum().backward()
    assert stats.as_dict() == ActivationStats().as_dict()
    # The retried step compresses as before; once removed, gradients are the uncompressed ones, bit for bit.
    assert_close_gradients(gradients(model, batch()), reference)
    handle.remove()
    assert all(torch.equal(g, reference[n]) for n, g in gradients(model, batch()).items())


def test_the_worker_counts_saved_activations_on_sampled_steps_only_and_compresses_on_every_step():
    from rapidfire_ray.config import load_config
    from rapidfire_ray.memory.setup import WorkerMemory

    model = small_llama(layers=2)
    cfg = load_config(None, ["memory.optim_level=level2", "train.log_every_steps=3"])
    memory = WorkerMemory.prepare(cfg, torch.device("cpu"), 1, sum(p.numel() for p in model.parameters()))
    assert memory.sample_every == 3
    memory.attach(model)
    packed = []  # what the int8 hooks hand to autograd, sampled or not
    layer_packer = memory._handles[1]._packer
    original_pack = layer_packer.pack
    layer_packer.pack = lambda t: packed.append(original_pack(t)) or packed[-1]
    layer_packer.hooks = torch.autograd.graph.saved_tensors_hooks(layer_packer.pack, layer_packer.unpack)
    records = {}
    for step in range(1, 8):
        packed.clear()
        model(**batch()).loss.backward()
        assert any(isinstance(p, Int8Payload) for p in packed), step  # compressed at every step
        records[step] = memory.take_step(step)
    memory.detach()
    sampled = [s for s, r in records.items() if r]
    assert sampled == [1, 3, 6]  # the first step, then every log_every_steps-th
    assert len({(r["saved_activation_raw_bytes"], r["saved_activation_bytes"]) for r in records.values() if r}) == 1
    assert 0 < records[1]["saved_activation_bytes"] < records[1]["saved_activation_raw_bytes"]
    assert memory.report()["saved_activation_bytes"] == records[1]["saved_activation_bytes"]

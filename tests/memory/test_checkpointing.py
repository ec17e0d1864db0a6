"""Selective gradient checkpointing: same gradients, less saved memory (as the memory model predicts), the plan
rule (fewest blocks that fit, spread evenly), and the per-layer switch (also through DDP)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from rapidfire_ray.memory.checkpointing import (CheckpointPlan, apply_checkpointing, checkpointed_indices,
                                                plan_checkpointing, plan_for_batches, spread_indices)
from rapidfire_ray.memory.estimate import GIB, MemoryModel

LAYERS, ROWS, WIDTH = 6, 2, 64


def small_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).train()


def batch(padded: bool = True) -> dict:
    ids = torch.randint(0, 300, (ROWS, WIDTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, WIDTH * 5 // 8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def gradients(model, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def saved_bytes(model, inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded); the inputs
    a checkpointed block keeps for its recompute are among them."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(seen.values())


@pytest.mark.parametrize("k", [0, 2, LAYERS])
def test_gradients_with_k_blocks_checkpointed_equal_no_checkpointing(k):
    reference = small_llama()
    model = copy.deepcopy(reference)
    assert apply_checkpointing(model, spread_indices(k, LAYERS)) == k
    ref_loss, ref_grads = gradients(reference, batch())
    loss, grads = gradients(model, batch())
    max_diff = max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))
    print(f"k={k}: loss {loss.item():.6f} vs {ref_loss.item():.6f}, max |grad diff| {max_diff:.3g}")
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6)
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, ref_grads)), max_diff


@pytest.mark.parametrize("padded", [True, False])
def test_saved_memory_drops_with_k_as_the_memory_model_predicts(padded):
    model = small_llama()
    mm = MemoryModel.for_model(model)
    ks = [0, 2, 3, LAYERS]
    measured = []
    for k in ks:
        apply_checkpointing(model, spread_indices(k, LAYERS))
        measured.append(saved_bytes(model, batch(padded)))
    assert measured == sorted(measured, reverse=True) and len(set(measured)) == len(ks), measured
    predicted = [replace(mm, checkpointed_layers=k).peak_bytes(ROWS, WIDTH) for k in ks]
    for i in range(1, len(ks)):
        saved, expected = measured[i - 1] - measured[i], predicted[i - 1] - predicted[i]
        print(f"padded={padded} k {ks[i - 1]}->{ks[i]}: measured -{saved} B, predicted -{expected} B "
              f"({saved / expected:.3f})")
        assert abs(saved - expected) / expected < 0.10, (ks[i - 1], ks[i], saved, expected)


def llama_8b_like() -> MemoryModel:
    return MemoryModel(num_layers=32, hidden=4096, kv_hidden=1024, intermediate=14336, heads=32, vocab=128256,
                       num_params=8_000_000_000, param_bytes=2, act_bytes=2)


def test_fewer_blocks_when_the_budget_is_larger_none_when_all_fits_and_no_fit_flagged():
    mm, rows, width = llama_8b_like(), 4, 2048
    peak = [replace(mm, checkpointed_layers=k).peak_bytes(rows, width) for k in range(mm.num_layers + 1)]
    assert peak == sorted(peak, reverse=True)
    for k in range(mm.num_layers + 1):  # exactly at a peak: that k, and it is the fewest (one less does not fit)
        plan = plan_checkpointing(mm, peak[k], rows, width)
        assert (plan.layers, plan.fits, plan.estimated_peak_bytes) == (k, True, peak[k])
        assert plan_checkpointing(mm, peak[k] - 1, rows, width).layers == min(k + 1, mm.num_layers)
    budgets = range(peak[-1] - GIB, peak[0] + GIB, (peak[0] - peak[-1]) // 97)
    layers = [plan_checkpointing(mm, b, rows, width).layers for b in budgets]
    assert layers == sorted(layers, reverse=True) and layers[-1] == 0 and len(set(layers)) > 20
    roomy = plan_checkpointing(mm, peak[0] * 2, rows, width)
    assert (roomy.layers, roomy.indices, roomy.fits) == (0, (), True)
    tight = plan_checkpointing(mm, peak[-1] - 1, rows, width)
    assert (tight.layers, tight.indices, tight.fits) == (32, tuple(range(32)), False)
    assert tight.estimated_peak_bytes == peak[-1] > tight.budget_bytes


def test_plan_for_batches_is_the_plan_of_the_worst_batch():
    mm = llama_8b_like()
    batches = [(16, 256), (4, 2048), (1, 8192), (8, 1024), (4, 2048)]
    budget = replace(mm, checkpointed_layers=20).peak_bytes(4, 2048)
    plan = plan_for_batches(mm, budget, batches)
    assert plan.layers == max(plan_checkpointing(mm, budget, r, w).layers for r, w in batches)
    at_k = replace(mm, checkpointed_layers=plan.layers)
    assert plan.estimated_peak_bytes == max(at_k.peak_bytes(r, w) for r, w in batches) <= budget
    assert plan.indices == spread_indices(plan.layers, mm.num_layers)
    with pytest.raises(ValueError, match="at least one"):
        plan_for_batches(mm, budget, [])


def test_placement_is_spread_evenly_unique_and_sorted():
    assert spread_indices(5, 30) == (0, 6, 12, 18, 24)
    assert spread_indices(3, 8) == (0, 2, 5)
    for n in range(1, 41):
        assert spread_indices(n, n) == tuple(range(n)) and spread_indices(0, n) == ()
        for k in range(1, n + 1):
            idx = spread_indices(k, n)
            gaps = {b - a for a, b in zip(idx, idx[1:] + (idx[0] + n,))}  # wrapping round: the gaps are even
            assert len(idx) == k and list(idx) == sorted(set(idx)) and 0 <= idx[0] and idx[-1] < n
            assert max(gaps) - min(gaps) <= 1, (k, n, idx)
    with pytest.raises(ValueError, match="cannot choose 7 of 6"):
        spread_indices(7, 6)


def test_describe_is_one_readable_line():
    plan = CheckpointPlan(30, 5, (0, 6, 12, 18, 24), True, int(3.1 * GIB), int(3.2 * GIB))
    assert plan.describe() == ("checkpointing 5 of 30 decoder blocks (layers 0, 6, 12, 18, 24): "
                               "estimated peak 3.1 GiB within budget 3.2 GiB")
    assert CheckpointPlan(4, 4, (0, 1, 2, 3), False, 3 * 2**20, 2**21).describe() == \
        "checkpointing 4 of 4 decoder blocks (all): estimated peak 3.0 MiB over budget 2.0 MiB"
    assert CheckpointPlan(4, 0, (), True, 2**20, 2**21).describe().startswith("checkpointing 0 of 4 decoder blocks:")


def test_apply_flips_only_the_chosen_layers_and_replaces_the_previous_choice():
    model = small_llama()
    assert model.config.use_cache and checkpointed_indices(model) == []
    assert apply_checkpointing(model, [4, 1, 4]) == 2
    assert checkpointed_indices(model) == [1, 4] and not model.config.use_cache
    assert model.model.gradient_checkpointing  # the model-level flag: HF drops the KV cache in training
    assert model(**batch()).cache is None
    assert apply_checkpointing(model, (0, 2, 5)) == 3 and checkpointed_indices(model) == [0, 2, 5]
    assert len(model.get_input_embeddings()._forward_hooks) == 1  # re-applying does not stack the input hook
    with pytest.raises(ValueError, match=r"\[-1, 6, 9\] out of range: the model has 6 decoder layers"):
        apply_checkpointing(model, [9, 2, 6, -1])
    assert checkpointed_indices(model) == [0, 2, 5]  # a bad request changes nothing
    assert apply_checkpointing(model, []) == 0
    assert checkpointed_indices(model) == [] and not model.is_activation_checkpointing


def test_the_choice_holds_under_ddp_with_the_same_gradients(tmp_path):
    reference, model = small_llama(), small_llama()
    apply_checkpointing(model, [1, 3])  # before the wrap, as the worker does
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model, find_unused_parameters=False)
        assert checkpointed_indices(ddp) == [1, 3]
        ref_loss, ref_grads = gradients(reference, batch())
        loss, grads = gradients(ddp, batch())
        assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6)
        assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, ref_grads))
        assert apply_checkpointing(ddp, [0, 5]) == 2 and checkpointed_indices(model) == [0, 5]  # through the wrap
        _, grads = gradients(ddp, batch())
        assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, ref_grads))
    finally:
        dist.destroy_process_group()

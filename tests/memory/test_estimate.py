"""The memory model against what autograd really saves, and the memory-aware batch rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rapidfire_ray.data.loader import DynamicBatches
from rapidfire_ray.memory.estimate import GIB, MemoryModel, free_memory_bytes, memory_in_use_bytes


def saved_activation_bytes(model, rows: int, width: int, padded: bool) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward (not parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (rows, width))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, width // 2:] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, labels=ids)
    return sum(seen.values())


def random_llama(hidden, inter, layers, heads, kv_heads, vocab, attn="sdpa"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("shape", [(64, 128, 2, 4, 2, 259), (96, 256, 3, 6, 2, 1000), (128, 320, 2, 8, 8, 500)])
@pytest.mark.parametrize("rows, width", [(2, 32), (3, 96)])
def test_activation_estimate_matches_what_autograd_saves(shape, rows, width):
    model = random_llama(*shape)
    measured = saved_activation_bytes(model, rows, width, padded=True)
    estimate = rows * width * MemoryModel.for_model(model).activation_bytes_per_token(width)
    assert abs(estimate - measured) / measured < 0.05, (estimate, measured)


def test_eager_attention_keeps_probabilities_and_the_estimate_follows():
    model = random_llama(64, 128, 2, 4, 2, 259, attn="eager")
    mm = MemoryModel.for_model(model)
    assert mm.attention == "eager"
    measured = saved_activation_bytes(model, 2, 96, padded=True)
    estimate = 2 * 96 * mm.activation_bytes_per_token(96)
    assert abs(estimate - measured) / measured < 0.10, (estimate, measured)
    assert mm.activation_bytes_per_token(96) > MemoryModel.for_model(random_llama(64, 128, 2, 4, 2, 259))\
        .activation_bytes_per_token(96)


def test_fixed_state_counts_weights_gradients_adam_once_and_ddp_buckets():
    mm = MemoryModel(num_layers=1, hidden=8, kv_hidden=8, intermediate=16, heads=2, vocab=10, num_params=1000)
    assert mm.static_bytes() == 1000 * (4 + 4 + 8)
    assert MemoryModel(**{**mm.__dict__, "world_size": 2}).static_bytes() == 1000 * (4 + 4 + 8 + 4)
    assert MemoryModel(**{**mm.__dict__, "param_bytes": 2}).static_bytes() == 1000 * (2 + 2 + 8 + 4)
    # Checkpointed layers keep only their input.
    ckpt = MemoryModel(**{**mm.__dict__, "checkpointed_layers": 1})
    assert ckpt.activation_bytes_per_token(16) < mm.activation_bytes_per_token(16)


def test_free_memory_on_cpu_is_shared_by_the_node_workers():
    one = free_memory_bytes(torch.device("cpu"), 1)
    assert one > 0
    assert free_memory_bytes(torch.device("cpu"), 4) <= one // 4 * 1.1
    assert memory_in_use_bytes(torch.device("cpu")) > 0


def memory_cfg(lo=None, hi=None, threshold=0.8):
    return {"data": {"max_length": 512, "dynamic_batch": {"strategy": "memory_aware", "min": lo, "max": hi,
                                                          "max_tokens": None, "window": 64, "max_padding": 0.05,
                                                          "memory_threshold": threshold}},
            "train": {"per_device_batch_size": 4}}


def test_memory_aware_rows_come_from_free_memory_clamped_to_min_max():
    mm = MemoryModel.for_model(random_llama(64, 128, 2, 4, 2, 259))
    free = mm.static_bytes() * 2 + 100 * mm.batch_bytes(1, 100)  # 0.5 x free leaves 50 rows of width 100
    plan = DynamicBatches.from_config(memory_cfg(threshold=0.5), [10], mm, free)
    assert plan.rows_fit(100) == 50
    assert plan.rows_fit(200) < 25  # longer rows cost more per token (masks) and more tokens per row
    assert DynamicBatches.from_config(memory_cfg(2, 8, 0.5), [10], mm, free).rows_fit(100) == 8
    small = mm.static_bytes() * 2 + 2 * mm.batch_bytes(1, 100)  # room for one row of 100 tokens, none of 400
    tight = DynamicBatches.from_config(memory_cfg(4, 8, 0.5), [10], mm, small)
    assert tight.rows_fit(400) == 4  # min wins over the memory model (the step's OOM backoff still guards it)
    with pytest.raises(ValueError, match="fixed state .* does not fit in 0.5 x"):
        DynamicBatches.from_config(memory_cfg(threshold=0.5), [10], mm, mm.static_bytes())
    with pytest.raises(ValueError, match="one row of 400 tokens needs .* lower data.max_length"):
        DynamicBatches.from_config(memory_cfg(threshold=0.5), [10], mm, small).rows_fit(400)
    assert GIB == 2**30


def test_memory_aware_plan_keeps_ranks_in_lockstep_within_min_max():
    mm = MemoryModel.for_model(random_llama(64, 128, 2, 4, 2, 259))
    lengths = np.clip(np.random.default_rng(0).lognormal(3.5, 0.9, 600).astype(int), 4, 256)
    free = mm.static_bytes() * 2 + 4000 * mm.batch_bytes(1, 64) // 64 * 2
    plan = DynamicBatches.from_config(memory_cfg(2, 24, 0.5), lengths, mm, free).plan(3)
    assert len({len(p) for p in plan}) == 1
    assert all(2 <= len(b) <= 24 for p in plan for b in p)


def test_int8_layer_estimate_matches_what_the_hooks_store():
    from rapidfire_ray.memory.activations import ActivationStats, Int8Activations, SavedBytesCounter

    model = random_llama(128, 320, 3, 8, 4, 500).train()
    stats = ActivationStats()
    handles = [SavedBytesCounter(stats).attach(model), Int8Activations(stats=stats).attach(model)]
    ids = torch.randint(0, 500, (3, 96))
    mask = torch.ones_like(ids)
    mask[0, 48:] = 0
    model(input_ids=ids, attention_mask=mask, labels=ids)
    for handle in handles:
        handle.remove()
    int8 = MemoryModel.for_model(model, int8_layers=True)
    estimate = 3 * 96 * int8.activation_bytes_per_token(96)
    assert abs(estimate - stats.stored_bytes) / stats.stored_bytes < 0.10, (estimate, stats.as_dict())

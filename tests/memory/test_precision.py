"""train.precision: the article's rule by parameter count, the hardware, and one-line refusals."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rapidfire_ray.config import load_config
from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.memory.precision import Hardware, choose, fp8_backend_missing

A100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0))
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
V100 = Hardware("cuda", "Tesla V100-SXM2-32GB", (7, 0))
CPU = Hardware("cpu", "CPU")
CPU_AMX = Hardware("cpu", "CPU", cpu_amx=True)


def llama_params(hidden: int, layers: int, inter: int, vocab: int = 32000) -> int:
    """Parameter count from a config alone: the model is built on the meta device (no memory)."""
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, vocab_size=vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# Llama-2-7B's shape (6.74B) and one layer-count either side of each boundary.
BELOW_7B = llama_params(4096, 32, 11008)
ABOVE_7B = llama_params(4096, 34, 11008)
BELOW_20B = llama_params(6144, 40, 16384)
ABOVE_20B = llama_params(6144, 44, 16384)


def test_the_sizes_straddle_the_boundaries():
    assert BELOW_7B < 7e9 < ABOVE_7B
    assert BELOW_20B < 20e9 < ABOVE_20B


@pytest.mark.parametrize("params, hw, expected", [
    (BELOW_7B, A100, "fp16"), (ABOVE_7B, A100, "bf16"), (BELOW_20B, A100, "bf16"),
    (ABOVE_20B, A100, "bf16"),  # A100 has no fp8: bf16, saying why
    (ABOVE_7B, V100, "fp16"),  # no bf16 before Ampere
    (BELOW_7B, CPU, "fp32"), (ABOVE_20B, CPU, "fp32"), (BELOW_7B, CPU_AMX, "bf16"),
])
def test_auto_follows_the_rule(params, hw, expected):
    choice = choose("auto", params, hw)
    assert choice.compute == expected
    assert f"{params / 1e9:.2f}B" in choice.reason


def test_auto_above_20b_on_fp8_hardware():
    choice = choose("auto", ABOVE_20B, H100)
    if fp8_backend_missing() is None:
        assert choice.compute == "fp8"
    else:  # without torchao, auto falls back and says why
        assert choice.compute == "bf16" and "torchao" in choice.reason


def test_fp16_has_dynamic_loss_scaling_and_trainer_flags():
    fp16 = choose("auto", BELOW_7B, A100)
    assert fp16.loss_scaling == "dynamic" and fp16.trainer_flags() == {"fp16": True, "bf16": False}
    assert choose("bf16", BELOW_7B, A100).trainer_flags() == {"fp16": False, "bf16": True}
    assert choose("fp32", BELOW_7B, CPU).trainer_flags() == {"fp16": False, "bf16": False}
    assert "dynamic loss scaling" in fp16.describe()


@pytest.mark.parametrize("requested, hw, words", [
    ("fp8", A100, "compute capability 8.9"), ("fp8", CPU, "compute capability 8.9"),
    ("fp16", CPU, "needs a CUDA GPU"), ("bf16", V100, "not supported"),
])
def test_explicit_requests_the_hardware_cannot_honour_fail(requested, hw, words):
    with pytest.raises(RapidfireError, match=words) as e:
        choose(requested, BELOW_7B, hw)
    assert str(e.value).startswith("train.precision:") and "\n" not in str(e.value)


def test_fp8_on_cpu_workers_fails_at_config_time():
    with pytest.raises(RapidfireError, match="train.precision: fp8 on CPU workers"):
        load_config(None, ["train.precision=fp8"])
    load_config(None, ["train.precision=fp8", "scaling.use_gpu=true"])  # the GPU is checked on the worker


def test_this_machine():
    hw = Hardware.detect()
    assert choose("auto", 135_000_000, hw).compute in ("fp32", "bf16", "fp16")

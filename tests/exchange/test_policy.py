"""CompressionPolicy: keep_fp16 patterns, the size rule, global modes, the concentration statistic
(auto's decisions: test_auto.py)."""
from __future__ import annotations

import pytest
import torch

from rapidfire_ray.exchange import DEFAULT_KEEP_FP16, CompressionPolicy, concentration

BIG = torch.empty(4096)
SMALL = torch.empty(4095)

KEPT = ["model.layers.0.self_attn.o_proj.weight", "encoder.layer.3.attention.out_proj.weight",
        "transformer.h.0.attn.c_proj.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight",
        "bert.encoder.layer.0.attention.output.LayerNorm.weight", "transformer.h.1.ln_1.weight",
        "transformer.ln_f.weight", "model.layers.0.mlp.up_proj.bias", "module.lm_head.bias"]
COMPRESSED = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.embed_tokens.weight", "transformer.h.0.mlp.c_fc.weight", "lm_head.weight"]


def test_default_keep_fp16_patterns():
    policy = CompressionPolicy("1bit")
    assert policy.keep_fp16 == list(DEFAULT_KEEP_FP16)
    for name in KEPT:
        assert policy.codec_for(name, BIG) == "fp16", name
    for name in COMPRESSED:
        assert policy.codec_for(name, BIG) == "1bit", name
    assert CompressionPolicy("2bit").codec_for(COMPRESSED[0], BIG) == "2bit"


def test_size_rule():
    policy = CompressionPolicy("1bit")
    assert policy.codec_for(COMPRESSED[0], SMALL) == "fp16"
    assert CompressionPolicy("1bit", min_numel=100).codec_for(COMPRESSED[0], torch.empty(100)) == "1bit"
    assert CompressionPolicy("1bit", keep_fp16=[]).codec_for(COMPRESSED[0], SMALL) == "fp16"  # still applies


def test_empty_keep_list_compresses_everything():
    policy = CompressionPolicy("1bit", keep_fp16=[])
    assert all(policy.codec_for(n, BIG) == "1bit" for n in KEPT)
    tiny = CompressionPolicy("2bit", keep_fp16=[], min_numel=0)
    assert all(tiny.codec_for(n, torch.empty(3)) == "2bit" for n in KEPT + COMPRESSED)


def test_custom_patterns_are_case_insensitive_fnmatch():
    policy = CompressionPolicy("1bit", keep_fp16=["*.Embed_Tokens.*"])
    assert policy.codec_for("model.embed_tokens.weight", BIG) == "fp16"
    assert policy.codec_for("model.norm.weight", BIG) == "1bit"  # defaults replaced


@pytest.mark.parametrize("mode", ["none", "fp16"])
def test_uncompressed_modes_apply_to_every_tensor(mode):
    policy = CompressionPolicy(mode)
    assert all(policy.codec_for(n, t) == mode for n in KEPT + COMPRESSED for t in (BIG, SMALL))


def test_bad_arguments():
    with pytest.raises(ValueError, match="grad must be one of"):
        CompressionPolicy("3bit")
    with pytest.raises(TypeError):
        CompressionPolicy("1bit", keep_fp16="*norm*")
    with pytest.raises(ValueError):
        CompressionPolicy("1bit", chunk_size=100)
    with pytest.raises(ValueError):
        CompressionPolicy("auto", auto_interval=0)


def test_codec_objects_use_the_chunk_size_and_scale():
    policy = CompressionPolicy("1bit", chunk_size=64)
    assert policy.codec("1bit").chunk_size == 64 and policy.codec("2bit").chunk_size == 64
    assert policy.codec("1bit") is policy.codec("1bit") and policy.codec("1bit").scale == "mean_abs"
    assert CompressionPolicy("1bit", onebit_scale="rms").codec("1bit").scale == "rms"
    with pytest.raises(ValueError):
        CompressionPolicy("1bit", onebit_scale="max")


def test_concentration_statistic():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(100_000, generator=g)
    assert 0.06 < concentration(dense) < 0.11  # the top 1% of a Gaussian holds ~8.5% of the variance
    sparse = torch.zeros(100_000)
    sparse[torch.randint(0, 100_000, (500,), generator=g)] = torch.randn(500, generator=g)
    assert concentration(sparse) == pytest.approx(1.0)
    outliers = dense.clone()
    outliers[:100] = 100.0
    assert concentration(outliers) > 0.9
    assert concentration(torch.zeros(10)) == 0.0 and concentration(torch.empty(0)) == 0.0
    assert concentration(torch.tensor([1.0, float("nan")])) != concentration(torch.tensor([1.0, float("nan")]))
    assert concentration(torch.tensor([3e38] + [1.0] * 99)) == pytest.approx(1.0)  # no overflow

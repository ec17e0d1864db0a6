"""LoRA adapters (`model.lora`): the PEFT config, the adapted model, what the summary says about
it, and the final model's export (merged into the base weights, or the adapter alone).

The base weights are frozen (`requires_grad` False), so everything that follows the trainable
parameters only (DDP buckets, the compressed hook, rapidfire_adamw's groups, the memory model's
gradients and optimizer state) sees the adapters alone; a trainer's save of a `PeftModel` writes
the adapter files only (`adapter_model.safetensors`, `adapter_config.json`), and its resume
loads them back into the adapted model.
"""
from __future__ import annotations

import os

import torch

# A causal LM's adapters, or a sequence-classification model's (whose `score` head is then
# trained in full and saved with the adapter: PEFT's modules_to_save for SEQ_CLS).
CAUSAL_LM, SEQ_CLS = "CAUSAL_LM", "SEQ_CLS"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def lora_config(lora, task: str):
    """peft.LoraConfig from the `model.lora` section."""
    from peft import LoraConfig

    targets = lora["target_modules"]
    targets = targets if isinstance(targets, str) else [str(t) for t in targets]
    config = LoraConfig(r=int(lora["r"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                        target_modules=targets, task_type=task, bias="none")
    return config


def base_name_of(name: str) -> str:
    """The base model as an exported adapter names it: a local directory's absolute path, else the name."""
    path = os.path.expanduser(name)
    return os.path.abspath(path) if os.path.isdir(path) else name


def apply_lora(model: torch.nn.Module, lora, task: str, base_name: str):
    """The model with LoRA adapters (a peft.PeftModel), its base weights frozen."""
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(lora, task))
    name_base(model, base_name)
    return model


def name_base(model, base_name: str) -> None:
    """The base model an exported adapter names (`adapter_config.json`); get_peft_model takes the
    model's own `name_or_path`, which a built-in model (tiny-random) lacks."""
    for config in model.peft_config.values():
        config.base_model_name_or_path = base_name_of(base_name)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; ZeRO-3 partitioned ones by their full size."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def lora_report(model: torch.nn.Module, lora) -> dict:
    """The run summary's `lora` section."""
    trainable, total = parameter_counts(model)
    targets = lora["target_modules"]
    return {"r": int(lora["r"]), "alpha": float(lora["alpha"]), "dropout": float(lora["dropout"]),
            "target_modules": targets if isinstance(targets, str) else list(targets), "export": lora["export"],
            "trainable_params": trainable, "total_params": total,
            "trainable_share": round(trainable / total, 6) if total else 0.0}


def lora_line(report: dict) -> str:
    return (f"LoRA on: r={report['r']}, alpha={report['alpha']:g}, {report['trainable_params']:,} trainable of "
            f"{report['total_params']:,} parameters ({100 * report['trainable_share']:.2f}%), exported "
            f"{report['export']}")


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def load_merged(base: torch.nn.Module, adapter_dir: str) -> torch.nn.Module:
    """`base` with the adapter saved in `adapter_dir` merged into its weights (a plain transformers model)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


def export_lora(checkpoint_dir: str, model_dir: str, *, stage: str, model_name: str, export: str,
                copy_model) -> str:
    """The final model of an sft or reward run with LoRA, from its adapter checkpoint: merged into
    the base weights and saved as a plain Hugging Face model (export merged), or the checkpoint's
    adapter and tokenizer files (export adapter, via `copy_model`, the plain export)."""
    if export == "adapter" or not is_adapter_dir(checkpoint_dir):
        return copy_model(checkpoint_dir, model_dir)
    from transformers import AutoTokenizer

    from .registry import load_model, load_reward_model, save_pretrained_atomic

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    base = load_reward_model(model_name, torch.float32, tokenizer.pad_token_id) if stage == "reward" \
        else load_model(model_name, torch.float32)
    merged = load_merged(base, checkpoint_dir)
    out = save_pretrained_atomic(merged, tokenizer, model_dir)
    for name in ADAPTER_FILES:  # (save_pretrained of the merged model writes none; a stale copy would mislead)
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    return out


def save_final_policy(policy, tokenizer, out_dir: str, export: str, base_name: str) -> str:
    """An RL run's final policy with LoRA: merged (a plain model) or the adapter alone."""
    from .registry import save_pretrained_atomic

    name_base(policy, base_name)
    if export == "merged":
        policy = policy.merge_and_unload()
    out = save_pretrained_atomic(policy, tokenizer, out_dir)
    return out

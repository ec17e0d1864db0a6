"""Reward models after training: the held-out evaluation (pairwise accuracy and mean margin of the
exported model) and the summary's `reward_eval` section. The driver uses this module; it imports
no TRL."""
from __future__ import annotations

import torch

from ..data.preference import collate_pairs

EVAL_BATCH_PAIRS = 16


@torch.no_grad()
def score_pairs(model, pairs: list[dict], pad_id: int, batch_pairs: int = EVAL_BATCH_PAIRS) -> dict:
    """Pairwise accuracy (reward(chosen) > reward(rejected)) and mean margin over `pairs`
    (dicts with `chosen_ids`, `rejected_ids`), scored by a sequence-classification `model`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, margins = 0, []
    try:
        for start in range(0, len(pairs), batch_pairs):
            batch = collate_pairs(pairs[start:start + batch_pairs], pad_id)
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device), use_cache=False).logits
            chosen, rejected = torch.chunk(logits.squeeze(-1).float(), chunks=2)
            correct += int((chosen > rejected).sum())
            margins += (chosen - rejected).tolist()
    finally:
        model.train(was_training)
    n = len(pairs)
    return {"pairs": n, "accuracy": round(correct / n, 4) if n else None,
            "margin_mean": round(sum(margins) / n, 4) if n else None}


def evaluate_model_dir(model_dir: str, pairs: list[dict], use_gpu: bool = False) -> dict:
    """Load an exported reward model the way its users will (AutoModelForSequenceClassification)
    and score the held-out pairs with it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    if use_gpu and torch.cuda.is_available():
        model = model.to("cuda")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
    return score_pairs(model, pairs, pad_id)


def train_metrics(logs: list[dict]) -> dict:
    """The training pairs' accuracy and margin as TRL logged them (rank 0's log records): the
    first and last logged values and the mean over the last quarter of the logs."""
    logged = [r for r in logs if r.get("accuracy") is not None]
    if not logged:
        return {}
    tail = logged[-max(1, len(logged) // 4):]
    return {"train_accuracy_first": round(logged[0]["accuracy"], 4),
            "train_accuracy_last": round(logged[-1]["accuracy"], 4),
            "train_accuracy_tail_mean": round(sum(r["accuracy"] for r in tail) / len(tail), 4),
            "train_margin_last": round(logged[-1]["margin"], 4) if logged[-1].get("margin") is not None else None}


# --------------------------------------------------------------------------------------------
# the driver's side (driver/stages.py)


def held_out_dataset(cfg, num_cpus: int):
    """(tokenised held-out pairs, DataReport) from `data.eval_path`, or None when it is null."""
    if cfg.data.eval_path is None:
        return None
    from ..data.prepare import build_sft_dataset

    return build_sft_dataset(cfg, num_cpus=num_cpus, path=cfg.data.eval_path, key="data.eval_path")


def _evaluate_task(model_dir: str, ds, use_gpu: bool) -> dict:
    pairs = [{"chosen_ids": r["chosen_ids"], "rejected_ids": r["rejected_ids"]} for r in ds.iter_rows()]
    return evaluate_model_dir(model_dir, pairs, use_gpu=use_gpu)


def reward_eval_section(cfg, held_out, model_dir: str | None, logs: list[dict]) -> dict:
    """The summary's `reward_eval` section: the training pairs' accuracy as logged, and, with
    `data.eval_path`, pairwise accuracy and mean margin of the exported model on the held-out pairs
    (a Ray task on the driver's node, where the exported model is: it loads `model/` with
    AutoModelForSequenceClassification, as the model's users will)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    section: dict = {"pairs": 0, "accuracy": None, "margin_mean": None, **train_metrics(logs)}
    if held_out is None or model_dir is None:
        return section
    ds, report = held_out
    node = ray.get_runtime_context().get_node_id()
    gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
    use_gpu = bool(cfg.scaling.use_gpu and gpus >= 1)
    task = ray.remote(_evaluate_task).options(
        num_cpus=cfg.scaling.cpus_per_worker, num_gpus=1 if use_gpu else 0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
    section.update(ray.get(task.remote(model_dir, ds, use_gpu)))
    section["eval_path"] = cfg.data.eval_path
    section["eval_bad_pairs_skipped"] = report.bad_rows + report.empty_after_truncation + report.dropped_overlong
    return section


def reward_eval_line(section: dict) -> str:
    """The held-out result for the final progress line ("" without held-out pairs)."""
    parts = []
    if section.get("pairs"):
        parts.append(f"held-out accuracy {section['accuracy']:.3f}, margin {section['margin_mean']:.3f} "
                     f"({section['pairs']} pairs)")
    if section.get("train_accuracy_tail_mean") is not None:
        parts.append(f"training-pair accuracy {section['train_accuracy_tail_mean']:.3f}")
    return "; ".join(parts)

"""Held-out loss for the convergence benchmarks: the last rows of the sample data are kept out
of training, and each run's final model is scored on them (mean cross-entropy per trained
token). A training run's logged loss is one batch's (and under a parameter server, one rank's);
the held-out loss is the same rows for every run."""
from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "jobs", "data", "sft_sample.jsonl")


def split_data(out: str, heldout: int, data: str = DATA) -> tuple[str, list[dict]]:
    """`data` without its last `heldout` rows (written to `out`/train.jsonl), and those rows."""
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not 0 <= heldout < len(rows):
        raise SystemExit(f"--heldout: {heldout} rows; the sample data has {len(rows)}")
    train = rows[: len(rows) - heldout]
    path = os.path.join(out, "train.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    return path, rows[len(rows) - heldout:]


def heldout_loss(model_dir: str, rows: list[dict], max_length: int) -> float:
    """Mean cross-entropy per trained token (the completion and its end token, as SFT trains
    them) of the model in `model_dir` over `rows`."""
    import torch

    from rapidfire_ray.data.tokenize import SFTTokenizer
    from rapidfire_ray.models import load_model

    n = len(rows)
    batch = {"source": [str(i) for i in range(n)], "messages": [""] * n, "text": [""] * n,
             "prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]}
    tokens = SFTTokenizer(model_dir, "prompt_completion", max_length)(batch)
    model = load_model(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in zip(tokens["input_ids"], tokens["loss_mask"]):
            ids = torch.as_tensor(ids, dtype=torch.long)[None]
            target = torch.as_tensor(mask[1:], dtype=torch.bool)
            logits = model(ids).logits[0, :-1]
            losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += float(losses[target].sum())
            count += int(target.sum())
    return total / count

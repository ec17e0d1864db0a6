"""Held-out evaluation of a policy (`rl.eval_path`): greedy completions of the held-out prompts,
their task score (mean `answer_match`, where rows carry an `answer`) and their mean reward from
the pool (the same weighted sum the policy is trained on)."""
from __future__ import annotations

import time

import torch

from .reward_pool import RewardPool
from .rules import answer_match


def _encode(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    return tokenizer(text=prompt)["input_ids"]


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Greedy completions, decoded without special tokens (as TRL decodes rollouts)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[str] = []
    try:
        for s in range(0, len(prompts), batch_size):
            ids = [_encode(tokenizer, p) for p in prompts[s:s + batch_size]]
            width = max(len(x) for x in ids)
            input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for i, x in enumerate(ids):  # left padding: generation continues every row at its end
                input_ids[i, width - len(x):] = torch.tensor(x)
                mask[i, width - len(x):] = 1
            gen = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            out += tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


def evaluate(model, tokenizer, rows: list[dict], pool: RewardPool, max_new_tokens: int) -> dict:
    t0 = time.perf_counter()
    prompts = [r["prompt"] for r in rows]
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens)
    saved = (pool.requested, pool.scored, pool.retries)  # evaluation is not a training step's scoring
    total, parts = pool.score(prompts, completions, rows)
    pool.requested, pool.scored, pool.retries = saved
    answered = [r for r in rows if r.get("answer") is not None]
    task = [answer_match(r["prompt"], c, r) for r, c in zip(rows, completions) if r.get("answer") is not None]

    def mean(xs):
        return round(sum(xs) / len(xs), 6) if xs else None

    return {
        "prompts": len(rows),
        "task_score": mean(task) if answered else None,
        "mean_reward": mean(total),
        **({"mean_model_reward": mean(parts["model"])} if "model" in parts else {}),
        "seconds": round(time.perf_counter() - t0, 3),
        "examples": [{"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": c,
                      **({"answer": r["answer"]} if "answer" in r else {})}
                     for p, c, r in list(zip(prompts, completions, rows))[:3]],
    }

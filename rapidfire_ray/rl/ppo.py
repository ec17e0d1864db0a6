"""Classic PPO for language models (`rl.algorithm: ppo`), once, on Ray Train workers.

TRL 1.16 no longer ships its `PPOTrainer`; this is the same algorithm, written as one loop:

1. rollout: each worker samples `rl.num_generations` completions for each of its
   `train.per_device_batch_size / rl.num_generations` prompts with the current policy, then
   computes, without gradients, the policy's and the frozen reference's log-probabilities of the
   sampled tokens and the value model's value of every completion position;
2. reward: the reward pool scores each (prompt, completion) (the reward model's actors plus the
   rule functions); the per-token reward is `-rl.kl_beta * (log pi - log pi_ref)`, with the
   score added on the completion's last token;
3. advantages by GAE (`rl.ppo.gamma`, `rl.ppo.lam`), whitened over the worker's batch; returns =
   advantages + values;
4. update: `rl.ppo.epochs` passes over the batch in minibatches of `rl.ppo.minibatch_size`,
   each an optimizer step on the clipped policy loss + `rl.ppo.vf_coef` x the clipped value loss.
   Policy and value model are DDP modules (gloo on CPU, NCCL on GPU): gradients are averaged
   over the workers, so every worker keeps the same weights.

The value model is a sequence classifier with one output, applied at every position: started
from the reward model (`rl.ppo.value_init: reward`, the default when one is set; it must share
the policy's tokenizer) or from the policy's own base model with a new head (`policy`).
TRL's pieces are reused where they exist: `selective_log_softmax` for the token log-probabilities,
`disable_dropout_in_model`. The math is in `ppo_math` (pure functions, tested by hand).
"""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForSequenceClassification, get_scheduler
from trl.trainer.utils import disable_dropout_in_model, selective_log_softmax

from ..errors import RapidfireError
from ..telemetry.timing import timed_allreduce_hook
from . import ppo_math
from .reward_pool import RewardPool
from .telemetry import RLStepTimer, publish, step_record


class ValueModel(nn.Module):
    """A sequence classifier's backbone and one-output head, read at every position: [B, T] values."""

    def __init__(self, classifier):
        super().__init__()
        head = getattr(classifier, "score", None)
        if head is None or classifier.config.num_labels != 1:
            raise RapidfireError("rl.ppo.value_init: the value model needs a sequence classifier with one output "
                                 "and a `score` head (Llama/Qwen/Mistral-style); use rl.ppo.value_init=policy")
        self.backbone = classifier.base_model
        self.head = head

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def build_value_model(policy, value_init: str, reward_model: str | None) -> ValueModel:
    if value_init == "reward":
        classifier = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32,
                                                                        num_labels=1)
    else:
        config = copy.deepcopy(policy.config)
        config.num_labels = 1
        config.architectures = None
        classifier = AutoModelForSequenceClassification.from_config(config)
        missing, _ = classifier.base_model.load_state_dict(policy.base_model.state_dict(), strict=False)
        if missing:
            raise RapidfireError(f"rl.ppo.value_init policy: the policy's base model does not fit a sequence "
                                 f"classifier of its own config ({len(missing)} weights missing)")
    return ValueModel(classifier.float())


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def _encode(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    return tokenizer(text=prompt)["input_ids"]


def token_logprobs(model, input_ids, attention_mask, context: int, completion_ids, temperature: float):
    """Log-probabilities of the completion tokens (positions `context:`) under `model`."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, context - 1:-1].float() / (temperature + 1e-7)
    return selective_log_softmax(logits, completion_ids)


class _Global:
    """Means over every worker (sums all-reduced), for the step's reported numbers."""

    def __init__(self, device):
        self.device = device

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        return dict(zip(keys, t.tolist()))


def train_ppo(cfg: dict, policy, tokenizer, rows: list[dict], pool: RewardPool, timer: RLStepTimer, board,
              rank: int, world: int, device, *, reward_model: str | None, value_init: str, worker_metrics=None):
    rl, ppo, t, o = cfg["rl"], cfg["rl"]["ppo"], cfg["train"], cfg["optimizer"]["params"]
    G = rl["num_generations"]
    batch = t["per_device_batch_size"]
    prompts_per_step = batch // G
    steps = t["max_steps"] if t["max_steps"] > 0 else max(1, math.ceil(t["epochs"] * len(rows) / prompts_per_step))
    updates_per_step = ppo["epochs"] * (batch // ppo["minibatch_size"])

    policy = policy.to(device)
    disable_dropout_in_model(policy)
    reference = None
    if rl["kl_beta"] > 0:
        reference = copy.deepcopy(policy).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    value = build_value_model(policy, value_init, reward_model).to(device)
    disable_dropout_in_model(value)
    policy.train()
    value.train()
    distributed = dist.is_available() and dist.is_initialized() and world > 1
    if distributed:
        ids = [device.index] if device.type == "cuda" else None
        policy_ddp = DistributedDataParallel(policy, device_ids=ids)
        value_ddp = DistributedDataParallel(value, device_ids=ids)
        for m in (policy_ddp, value_ddp):
            m.register_comm_hook(timer, timed_allreduce_hook)
    else:
        policy_ddp, value_ddp = policy, value
    params = [p for p in list(policy.parameters()) + list(value.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                  weight_decay=o["weight_decay"])
    scheduler = get_scheduler(t["lr_scheduler"], optimizer, num_warmup_steps=t["warmup_steps"],
                              num_training_steps=steps * updates_per_step)
    reduce = _Global(device)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    rng = np.random.default_rng(cfg["run"]["seed"] + rank)
    order: list[int] = []

    if rank == 0:
        board.set_plan.remote(steps, 0)
    timer.take()
    for step in range(1, steps + 1):
        if len(order) < prompts_per_step:
            order += list(rng.permutation(len(rows)))
        chosen = [rows[i] for i in order[:prompts_per_step]]
        del order[:prompts_per_step]
        group_rows = [r for r in chosen for _ in range(G)]
        prompts = [r["prompt"] for r in group_rows]

        # 1. rollout
        with timer.phase("rollout"):
            prompt_ids, prompt_mask = _left_pad([_encode(tokenizer, p) for p in prompts], pad_id)
            prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
            context = prompt_ids.shape[1]
            policy.eval()
            g0 = time.perf_counter()
            with torch.no_grad():
                out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                                      temperature=rl["temperature"], top_k=0, top_p=1.0,
                                      max_new_tokens=rl["max_new_tokens"], pad_token_id=pad_id, eos_token_id=eos_id)
            timer.generate_s += time.perf_counter() - g0
            completion_ids = out[:, context:]
            mask = ppo_math.completion_mask(completion_ids, eos_id)
            completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, pad_id))
            timer.generated_tokens += int(mask.sum())
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            full_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            full_mask = torch.cat([prompt_mask, mask.long()], dim=1)
            with torch.no_grad():
                old_logprobs = token_logprobs(policy, full_ids, full_mask, context, completion_ids, rl["temperature"])
                ref_logprobs = (token_logprobs(reference, full_ids, full_mask, context, completion_ids,
                                               rl["temperature"]) if reference is not None else None)
                old_values = value(full_ids, full_mask)[:, context - 1:-1]
            policy.train()

        # 2. reward
        with timer.phase("reward"):
            totals, parts = pool.score(prompts, texts, group_rows)
        scores = torch.tensor(totals, dtype=torch.float32, device=device)

        with timer.phase("rollout"):  # 3. advantages (part of making the experience)
            rewards, kl = ppo_math.token_rewards(scores, old_logprobs, ref_logprobs, mask, rl["kl_beta"])
            advantages, returns = ppo_math.gae(rewards, old_values, mask, ppo["gamma"], ppo["lam"])
            advantages = ppo_math.masked_whiten(advantages, mask)

        # 4. update
        stats: dict[str, list[float]] = {"policy_loss": [], "value_loss": [], "clip_fraction": [], "approx_kl": [],
                                         "value_clip_fraction": []}
        for _ in range(ppo["epochs"]):
            perm = torch.from_numpy(rng.permutation(batch))
            for s in range(0, batch, ppo["minibatch_size"]):
                idx = perm[s:s + ppo["minibatch_size"]].to(device)
                mb_mask = mask[idx]
                with timer.phase("forward"):
                    new_logprobs = token_logprobs(policy_ddp, full_ids[idx], full_mask[idx], context,
                                                  completion_ids[idx], rl["temperature"])
                    new_values = value_ddp(full_ids[idx], full_mask[idx])[:, context - 1:-1]
                    pg, pg_stats = ppo_math.policy_loss(new_logprobs, old_logprobs[idx], advantages[idx], mb_mask,
                                                        ppo["clip_range"])
                    vf, vf_stats = ppo_math.value_loss(new_values, old_values[idx], returns[idx], mb_mask,
                                                       ppo["value_clip_range"])
                    loss = pg + ppo["vf_coef"] * vf
                with timer.phase("backward"):
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                with timer.phase("optimizer"):
                    if t["grad_clip"] > 0:
                        torch.nn.utils.clip_grad_norm_(params, t["grad_clip"])
                    optimizer.step()
                    scheduler.step()
                for k, v in (("policy_loss", pg), ("value_loss", vf), *pg_stats.items(), *vf_stats.items()):
                    stats[k].append(float(v.detach()))

        local = {k: sum(v) / len(v) for k, v in stats.items()}
        local.update({"reward": float(scores.mean()), "kl": float((kl.sum(dim=1)).mean()),
                      "completion_length": float(mask.sum(dim=1).mean())})
        for name, values in parts.items():  # named as TRL names them: reward_model, answer_match, ...
            local["reward_model" if name == "model" else name] = sum(values) / len(values)
        metrics = reduce.mean(local)
        record = step_record(rank=rank, step=step, phases=timer.take(), completions=len(texts),
                             tokens=0, rl=metrics, pool_counts=pool.take())
        record["tokens"] = record["padded_tokens"] = timer.generated_tokens
        timer.generated_tokens = 0
        publish(board, worker_metrics, record, {"step": step, "reward": metrics["reward"], "kl": metrics["kl"],
                                             "loss": metrics["policy_loss"] + ppo["vf_coef"] * metrics["value_loss"]})
    return policy

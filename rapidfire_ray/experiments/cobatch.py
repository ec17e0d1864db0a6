"""Co-batching (`experiment.co_batch: k`): k LoRA configs on one base model trained in one
forward/backward pass, each batch row routed to its own config's adapter.

Every config of an experiment trains the same chunk rows in the same order, so the k configs'
micro-batches at a step are the same rows: the slot stacks them k times (block j of the batch is
config j's) and every adapted linear layer computes the frozen base projection once for all
k x b rows (one large matmul instead of k small ones) plus each block's own low-rank update, as two
batched matmuls over the k adapters (`RoutedLoRALinear`). Each config keeps its own parameters,
torch AdamW, LR schedule and gradient clipping: the summed loss's gradient with respect to config
j's adapter is exactly config j's own loss gradient (the adapters share no parameter), so a
co-batched step is the step each config would take alone, up to float rounding order.

The states it reads and writes are ConfigRun's (same adapter keys, optimizer state order,
schedule): a config moves between co-batched and solo chunks, and --resume, warm clones and the
state files work alike. Dropout draws one RNG stream for the group (restored from the group's
first config, saved into every member's state), so with lora.dropout > 0 a config's masks differ
from its solo run's (same distribution); with dropout 0 nothing random is drawn.

Configs co-batch when their configs are equal but for `COBATCH_FREE_KEYS` (the LoRA rank, alpha
and dropout; the optimizer's values; the schedule; grad clipping; the seed): the slot's step
depends on nothing else that may differ (batch sizes and target modules must match).
"""
from __future__ import annotations

import json

import torch

from ..data.loader import collate
from .slot import ConfigRun, Shard, _to_cpu, make_optimizer, make_scheduler, restore_optimizer

# Keys co-batched configs may differ in (dotted); everything else of their configs must be equal.
COBATCH_FREE_KEYS = ("model.lora.r", "model.lora.alpha", "model.lora.dropout", "optimizer.params.lr",
                     "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
                     "train.lr_scheduler", "train.warmup_steps", "train.grad_clip", "run.seed", "run.name")
ADAPTER_PREFIX, A_SUFFIX, B_SUFFIX = "base_model.model.", ".lora_A.weight", ".lora_B.weight"


def cobatch_key(cfg: dict) -> str:
    """Configs with the same key can be trained in one co-batched pass."""
    plain = json.loads(json.dumps(cfg, default=str))
    for dotted in COBATCH_FREE_KEYS:
        *parents, last = dotted.split(".")
        node = plain
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return json.dumps(plain, sort_keys=True)


class RoutedLoRALinear(torch.nn.Module):
    """A frozen linear layer with k LoRA adapters; the input's rows are k equal contiguous blocks,
    block j goes through adapter j: y = W x + s_j B_j A_j dropout_j(x). Ranks may differ (the
    smaller adapters are zero-padded in the batched matmul; padding gets no gradient)."""

    def __init__(self, base_layer: torch.nn.Linear, adapters: list[tuple[torch.Tensor, torch.Tensor, float, float]]):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = torch.nn.ParameterList([torch.nn.Parameter(a) for a, _, _, _ in adapters])
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(b) for _, b, _, _ in adapters])
        self.ranks = [a.shape[0] for a, _, _, _ in adapters]
        self.dropout = [float(p) for _, _, _, p in adapters]
        dtype = adapters[0][0].dtype
        self.register_buffer("scaling", torch.tensor([s for _, _, s, _ in adapters], dtype=dtype,
                                                     device=adapters[0][0].device).view(-1, 1, 1), persistent=False)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        rmax = max(self.ranks)
        if all(r == rmax for r in self.ranks):
            return torch.stack(list(self.lora_A)), torch.stack(list(self.lora_B))
        pad = torch.nn.functional.pad
        return (torch.stack([pad(a, (0, 0, 0, rmax - a.shape[0])) for a in self.lora_A]),
                torch.stack([pad(b, (0, rmax - b.shape[1])) for b in self.lora_B]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        k = len(self.ranks)
        a, b = self._stacked()  # [k, r, in], [k, out, r]
        xs = x.to(a.dtype).reshape(k, -1, x.shape[-1])  # block j: config j's rows
        if self.training and any(self.dropout):
            if len(set(self.dropout)) == 1:
                xs = torch.nn.functional.dropout(xs, self.dropout[0], True)
            else:
                xs = torch.stack([torch.nn.functional.dropout(xs[j], p, True) for j, p in enumerate(self.dropout)])
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)) * self.scaling
        return out + delta.reshape(out.shape).to(out.dtype)


def _module(root: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str]:
    parent, _, attr = dotted.rpartition(".")
    return (root.get_submodule(parent) if parent else root), attr


class CoBatchRun:
    """k configs on one base model, trained together (see the module's docstring). `state(j)` is
    config j's state in ConfigRun's format; `release()` hands the base back without adapters."""

    def __init__(self, base: torch.nn.Module, cfgs: list[dict], totals: list[int], states: list[dict | None],
                 device: str = "cpu"):
        if len(cfgs) < 2 or len({cobatch_key(c) for c in cfgs}) != 1:
            raise ValueError("co-batched configs must be two or more that differ only in "
                             + ", ".join(COBATCH_FREE_KEYS))
        self.cfgs, self.device, self.k = cfgs, device, len(cfgs)
        starts = []
        for cfg, total, state in zip(cfgs, totals, states):
            if state is None:  # a fresh adapter exactly as a solo chunk would initialise it
                run = ConfigRun(base, cfg, total, None, device)
                state = run.state()
                base = run.release()
            starts.append(state)
        names = [key[len(ADAPTER_PREFIX):-len(A_SUFFIX)] for key in starts[0]["adapter"] if key.endswith(A_SUFFIX)]
        for cfg, state in zip(cfgs, starts):
            found = [key[len(ADAPTER_PREFIX):-len(A_SUFFIX)] for key in state["adapter"] if key.endswith(A_SUFFIX)]
            if found != names:
                raise ValueError("adapter state does not fit this config's LoRA (other target modules)")
            r = state["adapter"][ADAPTER_PREFIX + names[0] + A_SUFFIX].shape[0]
            if r != int(cfg["model"]["lora"]["r"]):
                raise ValueError(f"adapter state does not fit this config's LoRA (rank {r}, the config's "
                                 f"{cfg['model']['lora']['r']})")
        for p in base.parameters():
            p.requires_grad_(False)
        self.base, self.names, self.layers = base, names, []
        for name in names:
            parent, attr = _module(base, name)
            adapters = []
            for cfg, state in zip(cfgs, starts):
                lora = cfg["model"]["lora"]
                a = state["adapter"][ADAPTER_PREFIX + name + A_SUFFIX].to(device, copy=True)
                b = state["adapter"][ADAPTER_PREFIX + name + B_SUFFIX].to(device, copy=True)
                adapters.append((a, b, float(lora["alpha"]) / int(lora["r"]), float(lora["dropout"])))
            layer = RoutedLoRALinear(getattr(parent, attr), adapters)
            setattr(parent, attr, layer)
            self.layers.append(layer)
        self.params = [[p for layer in self.layers for p in (layer.lora_A[j], layer.lora_B[j])] for j in range(self.k)]
        self.optimizers, self.schedulers, self.schedules, self.steps = [], [], [], []
        for j, (cfg, total, state) in enumerate(zip(cfgs, totals, starts)):
            opt = make_optimizer(self.params[j], cfg)
            restore_optimizer(opt, state, cfg)
            scheduler, schedule = make_scheduler(opt, cfg, total, state)
            self.optimizers.append(opt)
            self.schedulers.append(scheduler)
            self.schedules.append(schedule)
            self.steps.append(state["step"])
        torch.set_rng_state(starts[0]["rng"])
        base.train()

    def _block_losses(self, batch: dict) -> torch.Tensor:
        """Each config's summed cross entropy over the trained tokens of `batch`, all k in one pass ([k])."""
        batch = {key: v.to(self.device) for key, v in batch.items()}
        ids = batch["input_ids"].repeat(self.k, 1)
        logits = self.base(input_ids=ids, attention_mask=batch["attention_mask"].repeat(self.k, 1)).logits
        labels = batch["labels"][:, 1:].repeat(self.k, 1)
        per_token = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                                      labels.reshape(-1), ignore_index=-100, reduction="none")
        return per_token.view(self.k, -1).sum(dim=1)

    def train_rows(self, rows: list[dict], pad_id: int, shard: Shard | None = None) -> list[list[float]]:
        """Train every config on `rows` in order (ConfigRun.train_rows' steps); each config's step losses."""
        shard = shard or Shard()
        t = self.cfgs[0]["train"]
        every = [p for params in self.params for p in params]
        losses = []
        for batches, items in shard.step_batches(rows, t["per_device_batch_size"], t["gradient_accumulation_steps"],
                                                 pad_id):
            total = torch.zeros(self.k, dtype=torch.float64, device=self.device)
            for batch in batches:
                per = self._block_losses(batch) / max(1, items)
                per.sum().backward()  # config j's adapter only sees its own block's loss
                total += per.detach().double()
            shard.sum_grads(every)  # every config's gradients in one all-reduce
            for j, cfg in enumerate(self.cfgs):
                if cfg["train"]["grad_clip"] > 0:
                    torch.nn.utils.clip_grad_norm_(self.params[j], cfg["train"]["grad_clip"])
                self.optimizers[j].step()
                self.schedulers[j].step()
                self.optimizers[j].zero_grad(set_to_none=True)
                self.steps[j] += 1
            losses.append(total)
        if not losses:
            return [[] for _ in range(self.k)]
        return shard.sum(torch.stack(losses)).t().tolist()  # one host sync per chunk

    @torch.no_grad()
    def evaluate(self, rows: list[dict], pad_id: int, shard: Shard | None = None) -> list[float]:
        """Every config's held-out loss (ConfigRun.evaluate's), all k in one pass per batch."""
        shard = shard or Shard()
        self.base.eval()
        size = self.cfgs[0]["train"]["per_device_batch_size"]
        mine = shard.my_rows(rows)
        sums = torch.zeros(self.k + 1, dtype=torch.float64, device=self.device)  # k summed losses, trained tokens
        try:
            for i in range(0, len(mine), size):
                batch = collate(mine[i:i + size], pad_id)
                sums[:self.k] += self._block_losses(batch).double()
                sums[self.k] += int((batch["labels"][:, 1:] != -100).sum())
        finally:
            self.base.train()
        *totals, items = shard.sum(sums).tolist()
        return [v / max(1, items) for v in totals]

    def state(self, j: int) -> dict:
        adapter = {}
        for name, layer in zip(self.names, self.layers):
            adapter[ADAPTER_PREFIX + name + A_SUFFIX] = layer.lora_A[j].detach().to("cpu", copy=True)
            adapter[ADAPTER_PREFIX + name + B_SUFFIX] = layer.lora_B[j].detach().to("cpu", copy=True)
        return {"adapter": adapter, "optimizer": _to_cpu(self.optimizers[j].state_dict()),
                "scheduler": self.schedulers[j].state_dict(), "schedule": self.schedules[j],
                "rng": torch.get_rng_state(), "step": self.steps[j], "lora": dict(self.cfgs[j]["model"]["lora"])}

    def release(self) -> torch.nn.Module:
        """The base model with its plain linear layers back (for the next chunk's configs)."""
        for name, layer in zip(self.names, self.layers):
            parent, attr = _module(self.base, name)
            setattr(parent, attr, layer.base_layer)
        base, self.base, self.layers = self.base, None, []
        return base


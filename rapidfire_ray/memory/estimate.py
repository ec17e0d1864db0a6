"""A memory model of one training worker: what a batch of `rows x width` tokens costs.

`memory_aware` dynamic batching sizes batches from it (free memory x threshold, minus the
model's fixed state, divided by the cost of one sample at the batch's padded width), and the run
summary prints its estimate next to the memory actually used, so the model can be checked.

Fixed state (weights, gradients, AdamW moments, fp32 master copy, DDP buckets) is counted
once; activations per token follow what autograd saves in a Llama-style decoder. The
per-token formula and what it counts: docs/memory.md.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

GIB = 2**30
INT8_BYTES_PER_ELEMENT = 1 + 2 / 32  # int8 saved activations: a byte each and a bf16 scale per 32


@dataclass(frozen=True)
class MemoryModel:
    num_layers: int
    hidden: int
    kv_hidden: int
    intermediate: int
    heads: int
    vocab: int
    num_params: int
    param_bytes: int = 4  # bytes per weight (and gradient) element
    act_bytes: int = 4  # bytes per saved activation element
    attention: str = "sdpa"  # sdpa | eager | flash_attention_2
    checkpointed_layers: int = 0
    world_size: int = 1
    int8_layers: bool = False  # int8 saved activations inside the decoder layers (memory level2)
    zero_shards: int = 1  # ZeRO-3: weights, gradients and optimizer state split over this many workers
    trainable_params: int | None = None  # parameters that get gradients (LoRA: the adapters); None: all

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, world_size: int = 1, checkpointed_layers: int = 0,
                  act_bytes: int | None = None, int8_layers: bool = False, zero_shards: int = 1) -> MemoryModel:
        """`act_bytes`: bytes per saved activation element when autocast computes in a narrower type
        than the weights (2 for bf16/fp16); default: the weights' element size."""
        while not hasattr(model, "config") and hasattr(model, "module"):  # DDP / FSDP wrappers
            model = model.module
        c = model.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        dtype = next(model.parameters()).dtype
        return cls(num_layers=c.num_hidden_layers, hidden=c.hidden_size, kv_hidden=kv_heads * head_dim,
                   intermediate=c.intermediate_size, heads=heads, vocab=c.vocab_size,
                   num_params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
                   param_bytes=torch.finfo(dtype).bits // 8, act_bytes=act_bytes or torch.finfo(dtype).bits // 8,
                   attention=getattr(c, "_attn_implementation", None) or "sdpa",
                   checkpointed_layers=checkpointed_layers, world_size=world_size, int8_layers=int8_layers,
                   zero_shards=zero_shards,
                   trainable_params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
                                        if p.requires_grad))

    def static_bytes(self) -> int:
        """Weights + gradients + AdamW moments (+ fp32 master copy) (+ DDP buckets); under ZeRO-3 each
        worker holds its share of all that, and no DDP buckets. Gradients, moments, master copy and
        buckets are of the trainable parameters only (LoRA: the adapters; the frozen base has none)."""
        p, b = self.num_params, self.param_bytes
        t = p if self.trainable_params is None else self.trainable_params
        total = p * b + t * b + 2 * t * 4
        if b < 4:
            total += t * 4
        if self.zero_shards > 1:
            return -(-total // self.zero_shards)
        if self.world_size > 1:
            total += t * b
        return total

    def layer_elements_per_token(self, width: int) -> int:
        h, f = self.hidden, self.intermediate
        kv = self.kv_hidden if self.attention == "flash_attention_2" else h  # sdpa/eager repeat k, v
        attention = 2 * h + 2 * kv + self.heads
        if self.attention == "eager":
            attention += self.heads * width
        return (3 * h + 1) * 2 + attention + 4 * f

    def layer_bytes_per_token(self, width: int) -> int:
        """Bytes one (not checkpointed) decoder layer saves per token. With int8 layers every saved
        activation is one byte plus a bf16 scale per block of 32 (`memory/activations.py`), except
        what stays exact: the attention's log-sum-exp (one fp32 per head) and the norms' variances."""
        elements = self.layer_elements_per_token(width)
        if not self.int8_layers:
            return elements * self.act_bytes
        exact = self.heads + 2
        return math.ceil((elements - exact) * INT8_BYTES_PER_ELEMENT) + exact * 4

    def activation_bytes_per_token(self, width: int) -> int:
        """Bytes autograd saves for backward, per token of a batch padded to `width`."""
        full = self.num_layers - self.checkpointed_layers
        checkpointed = self.checkpointed_layers * self.hidden * (1 if self.int8_layers else self.act_bytes)
        masks = 0 if self.attention == "flash_attention_2" else 2 * width
        return (full * self.layer_bytes_per_token(width) + checkpointed + (3 * self.hidden + 1 + masks) * self.act_bytes
                + self.vocab * 4 + 16)

    def peak_bytes_per_token(self, width: int) -> int:
        """Saved activations plus what lives only around the loss (logits and their gradient)."""
        return self.activation_bytes_per_token(width) + self.vocab * (self.act_bytes + 4)

    def batch_bytes(self, rows: int, width: int) -> int:
        return rows * width * self.peak_bytes_per_token(width)

    def peak_bytes(self, rows: int, width: int) -> int:
        """The estimated peak of a step on a batch of `rows x width` (fixed state included)."""
        return self.static_bytes() + self.batch_bytes(rows, width)


def free_memory_bytes(device: torch.device, local_workers: int = 1) -> int:
    """Memory this worker may use: free accelerator memory on GPU; on CPU, what the process's
    memory limit (cgroup) or the machine still has available, shared by the node's workers."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    limit = _cgroup_remaining()
    if limit is not None:
        available = min(available, limit)
    return available // max(1, local_workers)


def _meminfo_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_remaining() -> int | None:
    """Bytes left under the cgroup v2 (or v1) memory limit, None when there is no limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file, encoding="ascii") as f:
                raw = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 2**60:
            return None
        return max(0, int(raw) - usage)
    return None


def memory_in_use_bytes(device: torch.device) -> int:
    """What this worker holds now: allocated accelerator memory, or the process's resident set."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

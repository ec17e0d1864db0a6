"""Which codec each parameter's gradient uses on the wire.

    policy = CompressionPolicy("1bit")
    policy.codec_for("model.layers.0.mlp.up_proj.weight", param)    # "1bit"
    policy.codec_for("model.layers.0.self_attn.o_proj.weight", param)  # "fp16" (kept)
    policy.codec_for("model.norm.weight", param)                      # "fp16" (kept)

Rules, in order:
1. `grad` "none" or "fp16": every tensor uses it.
2. Kept in fp16: the name matches a `keep_fp16` pattern (fnmatch, case-insensitive, on the full
   parameter name, so "*norm*" also matches "LayerNorm"), or the tensor has fewer than
   `min_numel` elements (default 4096: per-chunk scales and the fixed cost of a collective
   would eat the savings; such tensors are a tiny share of the bytes anyway).
   Default patterns: attention output projections (`*o_proj*`, `*out_proj*`, `*c_proj*`),
   norms (`*norm*`, `*ln_*`), biases (`*.bias`). `keep_fp16=[]` compresses every tensor
   (the size rule still applies unless `min_numel=0`).
3. `grad` "1bit" or "2bit": that codec.
4. `grad` "auto": per tensor, from its gradient, re-decided every `auto_interval` steps.

Auto choice: the concentration (share of the gradient's L2 mass in its largest 1% of
entries) at or above `auto_threshold` (default 0.5) gets `2bit`, else `1bit`. What the
statistic measures and why concentrated gradients get 2bit: docs/exchange.md.

Across ranks. Each rank measures its own gradient, so the choice must be agreed or ranks would
group tensors differently and the collectives would not match. The DDP hook sums the
statistics over ranks (one small allreduce, on the steps where a decision is due) and calls
`decide(name, mean_statistic)` on every rank with the same number; `decide_collectively` does
the same for other callers (an optimizer's own exchange). `codec_for(..., grad=...)` measures
locally and is meant for single-process use only.

Each decision is logged (logger "rapidfire_ray.exchange.policy": INFO when the codec changes, DEBUG
otherwise) and kept in `choices` (name -> codec) and `statistics` (name -> statistic).
`state_dict()` / `load_state_dict()` carry them (and the step counters) through checkpoints.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch

from ..compression import CODECS, Codec, get_codec
from ..compression.twobit import top_magnitude_indices

log = logging.getLogger(__name__)

DEFAULT_KEEP_FP16 = ("*o_proj*", "*out_proj*", "*c_proj*", "*norm*", "*ln_*", "*.bias")
GRAD_MODES = ("none", "fp16", "1bit", "2bit", "auto")
STATE_FORMAT = "rapidfire_ray.comm.policy/1"  # the saved format's name (checkpoints): kept
#: Share of the entries whose L2 mass the concentration statistic measures.
TOP_FRACTION = 0.01


def concentration(grad: torch.Tensor, top_fraction: float = TOP_FRACTION) -> float:
    """Share of sum(grad**2) held by the ceil(top_fraction * n) largest |entries|, in [0, 1]
    (0.0 for an all-zero or empty tensor, nan for a non-finite one)."""
    flat = grad.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0
    magnitudes = flat.abs().to(torch.float32)
    peak = magnitudes.max()
    if not bool(torch.isfinite(peak)):
        return float("nan")
    if float(peak) == 0.0:
        return 0.0
    squares = (magnitudes / peak).square_()  # in (0, 1]: no overflow, no underflow of the largest
    k = min(n, max(1, math.ceil(round(top_fraction * n, 9))))
    top = squares[top_magnitude_indices(squares, k)].sum()
    return min(1.0, float(top / squares.sum()))


class CompressionPolicy:
    """Per-parameter codec choice (see the module docstring)."""

    def __init__(self, grad: str = "1bit", keep_fp16: Iterable[str] | None = None, min_numel: int = 4096,
                 chunk_size: int = 2048, auto_interval: int = 100, auto_threshold: float = 0.5,
                 onebit_scale: str = "mean_abs"):
        if grad not in GRAD_MODES:
            raise ValueError(f"compression policy: grad must be one of {', '.join(GRAD_MODES)}, got {grad!r}")
        if isinstance(keep_fp16, str):
            raise TypeError("compression policy: keep_fp16 is a list of patterns, not one string")
        if min_numel < 0:
            raise ValueError(f"compression policy: min_numel must be >= 0, got {min_numel}")
        if auto_interval < 1:
            raise ValueError(f"compression policy: auto_interval must be >= 1, got {auto_interval}")
        if not 0 <= auto_threshold <= 1:
            raise ValueError(f"compression policy: auto_threshold must be in [0, 1], got {auto_threshold}")
        self.grad = grad
        self.keep_fp16 = list(DEFAULT_KEEP_FP16 if keep_fp16 is None else keep_fp16)
        self._patterns = [p.lower() for p in self.keep_fp16]
        self.min_numel = int(min_numel)
        self.chunk_size = int(chunk_size)
        self.auto_interval = int(auto_interval)
        self.auto_threshold = float(auto_threshold)
        self.onebit_scale = onebit_scale
        self.choices: dict[str, str] = {}
        self.statistics: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.decided_at: dict[str, int] = {}
        self._codecs: dict[str, Codec] = {}
        self.codec("1bit")  # check chunk_size now, not on the first gradient

    # --- the rules ---------------------------------------------------------------------------

    def kept(self, name: str, numel: int) -> bool:
        """True when the tensor stays in fp16 under a compressing mode (pattern or size rule)."""
        if numel < self.min_numel:
            return True
        lowered = name.lower()
        return any(fnmatchcase(lowered, p) for p in self._patterns)

    def rule(self, name: str, numel: int) -> str:
        """The codec by the static rules, or "auto" when the gradient statistics decide."""
        if self.grad in ("none", "fp16"):
            return self.grad
        if self.kept(name, numel):
            return "fp16"
        return self.grad

    def codec_for(self, name: str, param: torch.Tensor, grad: torch.Tensor | None = None) -> str:
        """"none", "fp16", "1bit" or "2bit" for parameter `name`. Under "auto", when a decision
        is due it is made from `grad` (or `param.grad`) measured here, on this process only;
        before any measurement the answer is "1bit"."""
        codec = self.rule(name, param.numel())
        if codec != "auto":
            return codec
        if self.due(name):
            g = grad if grad is not None else param.grad
            if g is not None:
                stat = concentration(g)
                if not math.isnan(stat):  # non-finite gradient: keep the previous choice
                    self.decide(name, stat)
        return self.choices.get(name, "1bit")

    # --- auto decisions ----------------------------------------------------------------------

    def due(self, name: str) -> bool:
        """An auto decision is due: none made yet, or `auto_interval` steps since the last."""
        if name not in self.choices:
            return True
        return self.steps.get(name, 0) - self.decided_at.get(name, 0) >= self.auto_interval

    def decide(self, name: str, statistic: float) -> str:
        """Record the auto choice for `name` from its concentration statistic; returns it."""
        codec = "2bit" if statistic >= self.auto_threshold else "1bit"
        previous = self.choices.get(name)
        self.choices[name] = codec
        self.statistics[name] = float(statistic)
        self.decided_at[name] = self.steps.get(name, 0)
        level = logging.INFO if codec != previous else logging.DEBUG
        log.log(level, "compression auto: %s -> %s (top-1%% L2 share %.3f, threshold %.2f, step %d)",
                name, codec, statistic, self.auto_threshold, self.steps.get(name, 0))
        return codec

    def decide_collectively(self, named_tensors: Iterable[tuple[str, torch.Tensor]], group=None) -> dict[str, str]:
        """Make the due auto decisions for `named_tensors` (each rank's local gradients or
        momenta, in the same order on every rank) from statistics averaged over `group`: one
        allreduce of the due statistics, then `decide` with the same numbers on every rank.
        For callers outside the DDP hook (e.g. an optimizer that runs its own compressed
        allreduce); never use `codec_for(..., grad=...)` under "auto" on several ranks, its
        local choice can differ between ranks and the collectives would then not match.
        A non-finite statistic on any rank skips that decision (the previous choice stays).
        Returns the decisions made (name -> codec)."""
        import torch.distributed as dist

        due = [(name, t) for name, t in named_tensors if self.rule(name, t.numel()) == "auto" and self.due(name)]
        if not due:
            return {}
        stats = torch.tensor([concentration(t) for _, t in due], dtype=torch.float64, device=due[0][1].device)
        ws = 1
        if dist.is_available() and dist.is_initialized():
            ws = dist.get_world_size(group)
            if ws > 1:
                dist.all_reduce(stats, group=group)
        out = {}
        for (name, _), total in zip(due, stats.tolist()):
            if not math.isnan(total):
                out[name] = self.decide(name, total / ws)
        return out

    def advance(self, name: str) -> None:
        """One more completed step for `name` (the hook calls it after each exchanged step)."""
        self.steps[name] = self.steps.get(name, 0) + 1

    # --- codecs and state --------------------------------------------------------------------

    def codec(self, name: str) -> Codec:
        """The codec object for a codec name (1bit/2bit with this policy's chunk_size), cached."""
        if name not in self._codecs:
            if name not in CODECS:
                raise ValueError(f"compression policy: unknown codec {name!r}")
            opts = {"chunk_size": self.chunk_size} if name in ("1bit", "2bit") else {}
            if name == "1bit":
                opts["scale"] = self.onebit_scale
            self._codecs[name] = get_codec(name, **opts)
        return self._codecs[name]

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "grad": self.grad, "choices": dict(self.choices),
                "statistics": dict(self.statistics), "steps": dict(self.steps),
                "decided_at": dict(self.decided_at)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"compression policy: not a policy state dict (expected format {STATE_FORMAT!r})")
        self.choices = dict(state.get("choices", {}))
        self.statistics = {k: float(v) for k, v in state.get("statistics", {}).items()}
        self.steps = {k: int(v) for k, v in state.get("steps", {}).items()}
        self.decided_at = {k: int(v) for k, v in state.get("decided_at", {}).items()}

    def __repr__(self) -> str:
        return (f"CompressionPolicy(grad={self.grad!r}, keep_fp16={self.keep_fp16!r}, min_numel={self.min_numel}, "
                f"chunk_size={self.chunk_size}, auto_interval={self.auto_interval}, "
                f"auto_threshold={self.auto_threshold}, onebit_scale={self.onebit_scale!r})")

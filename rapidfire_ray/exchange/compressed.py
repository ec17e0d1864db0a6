"""`communication.mode: allreduce_compressed`: `compressed_allreduce_hook` (hook.py) with the
per-parameter codec policy of `optimizer.params.compression.*`. A NaN/inf gradient zeroes the
bucket on every rank and names the parameters; the optimizer step is then skipped everywhere.
The codec is a live knob (`set_codec`, except under `auto`, which chooses per bucket from the measured link and codecs).
With `overlap` (`communication.overlap`, the default) each bucket is encoded and sent on the
hook's exchange thread while backward goes on, over a process group of its own (hook.py)."""
from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from ..log import say
from ..telemetry.rules import codec_is_live
from .base import GradientExchange
from .hook import HookState, compressed_allreduce_hook
from .policy import CompressionPolicy


class CompressedExchange(GradientExchange):
    state_key = "hook"

    def __init__(self, compression: dict, *, rank: int, on_nonfinite: str = "skip", timer=None,
                 overlap: bool = True):
        super().__init__(rank=rank, on_nonfinite=on_nonfinite, timer=timer)
        self.compression = dict(compression)
        self.overlap = overlap
        self.hook_state: HookState | None = None
        self._auto_counts: dict | None = None

    def register(self, ddp_model) -> None:
        c = self.compression
        policy = CompressionPolicy(c["grad"], keep_fp16=list(c["keep_fp16"]), min_numel=c["min_numel"],
                                   chunk_size=c["chunk_size"], auto_interval=c["auto_interval"])
        group = None
        if self.overlap and dist.is_available() and dist.is_initialized():
            # every rank registers at the same point of its first step: the group is created alike
            group = dist.new_group(ranks=list(range(dist.get_world_size())))
        self.hook_state = HookState(ddp_model.module.named_parameters(), policy, stats=self.stats, timer=self.timer,
                                    group=group, overlap=self.overlap)
        self._part_built()  # a state loaded before the first step
        ddp_model.register_comm_hook(self.hook_state, compressed_allreduce_hook)

    def _nonfinite_before_step(self, optimizer, model) -> list[str] | None:
        # The hook already zeroed the offending buckets on every rank.
        if self.hook_state is None or not self.hook_state.nonfinite:
            return None
        names = sorted(set(self.hook_state.nonfinite))
        self.hook_state.nonfinite.clear()
        return names

    def live_codec(self) -> str | None:
        codec = self.compression["grad"]
        return codec if codec_is_live("allreduce_compressed", codec) else None

    def set_codec(self, codec: str) -> None:
        """From the next gradient exchange on, the hook groups the parameters by the new codec
        (error feedback carries over by parameter name, hook.py). Before the hook exists, the
        codec it will be built with."""
        self.compression = {**self.compression, "grad": codec}
        if self.hook_state is not None:
            self.hook_state.policy.grad = codec

    def take_stats(self) -> dict:
        out = super().take_stats()
        if self.hook_state is not None and self.hook_state.policy.grad == "auto":
            policy = self.hook_state.policy
            counts = dict(Counter(policy.choices.values()))
            out["auto_codecs"] = counts  # tensors per chosen codec, in steps.jsonl
            measurement, decisions = policy.take_new()
            if measurement is not None:  # the step it was measured: the numbers behind the decisions
                out["auto_measurement"] = measurement
            if decisions:
                out["auto_decisions"] = decisions
            if counts != self._auto_counts and self.rank == 0:
                say(f"compression.grad auto: tensors per codec {counts}")
            self._auto_counts = counts
        return out

    def finish(self) -> dict | None:
        """Under auto: the measurements and each bucket's latest decision (run summary)."""
        if self.hook_state is not None:
            self.hook_state.close()
        if self.hook_state is None or self.hook_state.policy.grad != "auto":
            return None
        return {"auto": self.hook_state.policy.report()}

    def _state_part(self) -> HookState | None:
        return self.hook_state

"""How a worker's trainer exchanges gradients, per `communication.mode` and `optimizer.type`:

- `allreduce` + `adamw`: DDP's averaging allreduce in fp32 (bytes and time counted);
- `allreduce_compressed`: `compressed_allreduce_hook` with the configured per-parameter codec
  policy (`optimizer.params.compression.*`); a NaN/inf gradient zeroes the bucket on every rank
  and the optimizer step is skipped (or the run fails, `communication.on_nonfinite`);
- `rapidfire_adamw`: the optimizer exchanges compressed momentum itself after its warm-up;
  DDP's hook averages gradients during the warm-up and sends nothing afterwards;
- `parameter_server`: no process group and no DDP; the optimizer step pushes gradients to the
  shard actors and pulls parameters (`ps.training.ParameterServerComm`, which this delegates to).

`TrainerComm` is built once per worker; the stage mixin registers its hook on the DDP model,
builds the optimizer through it, and the telemetry callback reads `take()` every step.
Error-feedback state (per rank) is saved with every checkpoint and restored on resume.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import Counter

import torch
import torch.distributed as dist

from ..errors import RapidfireError
from .hook import HookState, compressed_allreduce_hook
from .policy import CompressionPolicy
from .stats import CommStats, fp32_allreduce_bytes


def counted_allreduce_hook(comm: TrainerComm, bucket):  # no annotations: DDP checks them at runtime
    """DDP's default averaging allreduce, with its in-flight time and bytes recorded."""
    buffer = bucket.buffer()
    world = dist.get_world_size()
    start = time.perf_counter()
    fp32 = fp32_allreduce_bytes(buffer.numel(), world)
    wire = fp32 * buffer.element_size() / 4  # a ring allreduce of this buffer, per rank
    comm.stats.add_bytes(wire, wire, fp32)
    buffer.div_(world)
    fut = dist.all_reduce(buffer, async_op=True).get_future()

    def done(f):
        end = time.perf_counter()
        comm.stats.add_call(end - start)
        if comm.timer is not None:
            comm.timer.comm_interval(start, end)
        return f.value()[0]

    return fut.then(done)


class TrainerComm:
    def __init__(self, cfg: dict, *, rank: int, total_steps: int, timer=None, shards: list | None = None):
        self.mode = cfg["communication"]["mode"]
        self.optimizer_type = cfg["optimizer"]["type"]
        self.on_nonfinite = cfg["communication"]["on_nonfinite"]
        self.compression = dict(cfg["optimizer"]["params"]["compression"])
        self.freeze_step = cfg["optimizer"]["params"]["freeze_step"]
        self.total_steps = total_steps
        self.rank = rank
        self.timer = timer
        self.stats = CommStats()
        self.hook_state: HookState | None = None
        self.optimizer = None
        self.skipped_steps = 0
        self._pending_state: dict | None = None
        self._pending_optimizer_state: dict | None = None
        self._skipped_before = 0
        self._auto_counts: dict | None = None
        self.ps = None
        if self.mode == "parameter_server":
            from ..ps.training import ParameterServerComm

            self.ps = ParameterServerComm(cfg, shards, rank=rank, stats=self.stats, total_steps=total_steps)

    # --- optimizer --------------------------------------------------------------------------

    def build_optimizer(self, named_groups: list[dict], args) -> torch.optim.Optimizer | None:
        """The optimizer for `optimizer.type: rapidfire_adamw` (None: the trainer's default AdamW).
        `named_groups`: param groups with `params` and `param_names`."""
        if self.ps is not None:
            self.optimizer = self.ps.build_optimizer(named_groups, args.learning_rate)
            return self.optimizer
        if self.optimizer_type != "rapidfire_adamw":
            return None
        from ..optim import RapidfireAdamW, default_freeze_step

        freeze = self.freeze_step or default_freeze_step(self.total_steps)
        self.optimizer = RapidfireAdamW(named_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                        eps=args.adam_epsilon, weight_decay=args.weight_decay, freeze_step=freeze,
                                        codec=self.compression["grad"], chunk_size=self.compression["chunk_size"],
                                        stats=self.stats)
        if self._pending_optimizer_state is not None:
            self.optimizer.load_allreduce_state_dict(self._pending_optimizer_state)
            self._pending_optimizer_state = None
        return self.optimizer

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` skip a step whose gradients the compressed hook zeroed."""
        if self.mode != "allreduce_compressed":
            return
        step = optimizer.step

        def guarded_step(*args, **kwargs):
            if self.hook_state is not None and self.hook_state.nonfinite:
                names = sorted(set(self.hook_state.nonfinite))
                self.hook_state.nonfinite.clear()
                self._fail_or_count(names)
                return None
            return step(*args, **kwargs)

        optimizer.step = guarded_step

    def after_optimizer_step(self) -> None:
        """rapidfire_adamw and the parameter server skip non-finite steps themselves; count them
        (or fail)."""
        opt = self.optimizer
        if opt is not None and opt.skipped_steps > self._skipped_before:
            self._skipped_before = opt.skipped_steps
            self._fail_or_count(list(opt.nonfinite))

    def _fail_or_count(self, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") or "(on another rank)"
        if self.on_nonfinite == "fail":
            raise RapidfireError(f"non-finite gradient in {shown}; the step was not applied "
                                 "(communication.on_nonfinite: fail); lower optimizer.params.lr or check the data")
        self.skipped_steps += 1
        print(f"[rapidfire] rank {self.rank}: step skipped, non-finite gradient in {shown}", flush=True)

    # --- DDP hook ---------------------------------------------------------------------------

    def set_codec(self, codec: str) -> None:
        """The live codec knob (allreduce_compressed): from the next gradient exchange on, the
        compressed hook groups the parameters by the new codec (error feedback carries over by
        parameter name, comm/hook.py). Before the hook exists, the codec it will be built with."""
        self.compression = {**self.compression, "grad": codec}
        if self.hook_state is not None:
            self.hook_state.policy.grad = codec

    def register(self, ddp_model) -> None:
        if self.optimizer_type == "rapidfire_adamw":
            from ..optim import local_gradient_hook

            ddp_model.register_comm_hook(self.optimizer, local_gradient_hook)
        elif self.mode == "allreduce_compressed":
            c = self.compression
            policy = CompressionPolicy(c["grad"], keep_fp16=list(c["keep_fp16"]), min_numel=c["min_numel"],
                                       chunk_size=c["chunk_size"], auto_interval=c["auto_interval"])
            self.hook_state = HookState(ddp_model.module.named_parameters(), policy, stats=self.stats,
                                        timer=self.timer)
            if self._pending_state is not None:
                self.hook_state.load_state_dict(self._pending_state)
                self._pending_state = None
            ddp_model.register_comm_hook(self.hook_state, compressed_allreduce_hook)
        else:
            ddp_model.register_comm_hook(self, counted_allreduce_hook)

    # --- the run's course (parameter server) -----------------------------------------------

    def begin(self) -> None:
        """Training starts (or resumes): the parameter server's workers take the shards' parameters."""
        if self.ps is not None:
            self.ps.begin()

    def before_save(self) -> None:
        if self.ps is not None:
            self.ps.before_save()

    def around_report(self, last: bool):
        """Context for `ray.train.report`, which waits for every worker."""
        return self.ps.around_report(last) if self.ps is not None else contextlib.nullcontext()

    def finish(self) -> dict | None:
        """This worker trained its last step; the parameter server client's report."""
        return self.ps.finish() if self.ps is not None else None

    # --- telemetry and checkpoints ----------------------------------------------------------

    def take(self) -> dict:
        """This step's bytes, latency percentiles and compression ratio; the optimizer's own
        exchange time (rapidfire_adamw) as `optimizer_comm_seconds`."""
        out = self.stats.take()
        # Where the exchange time sits that no hook told the step timer about: rapidfire_adamw
        # exchanges momentum inside the optimizer step (compressed stage), and its warm-up hook
        # allreduces during backward.
        out["untimed_comm_phase"] = None
        if self.ps is not None:
            out["untimed_comm_phase"] = "optimizer"  # push and pull are the optimizer step
            out.update(self.ps.take())
        elif self.optimizer is not None:
            out["untimed_comm_phase"] = "optimizer" if self.optimizer.steps > self.optimizer.freeze_step else "backward"
        out["skipped_steps"] = self.skipped_steps
        if self.hook_state is not None and self.hook_state.policy.grad == "auto":
            counts = dict(Counter(self.hook_state.policy.choices.values()))
            out["auto_codecs"] = counts  # tensors per chosen codec, in steps.jsonl
            if counts != self._auto_counts and self.rank == 0:
                print(f"[rapidfire] compression.grad auto: tensors per codec {counts}", flush=True)
            self._auto_counts = counts
        return out

    def state_file(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, f"comm_state_rank{self.rank}.pt")

    def save(self, checkpoint_dir: str) -> str:
        """This rank's error-feedback state: the compressed hook's, and rapidfire_adamw's (the
        trainer's optimizer.pt holds rank 0's only; every rank's buffers differ); the parameter
        server client's. Returns the folder this rank hands to Ray Train."""
        if self.ps is not None:
            return self.ps.save(checkpoint_dir, os.path.basename(self.state_file(checkpoint_dir)))
        state = {}
        if self.hook_state is not None:
            state["hook"] = self.hook_state.state_dict()
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.allreduce_state_dict()
        if state:
            torch.save(state, self.state_file(checkpoint_dir))
        return checkpoint_dir

    def load(self, checkpoint_dir: str) -> None:
        """Restore this rank's error feedback; applied as the hook and optimizer come to exist."""
        path = self.state_file(checkpoint_dir)
        if not os.path.exists(path):
            return
        state = torch.load(path, weights_only=True)
        if "ps_client" in state and self.ps is not None:
            self.ps.load(state)
        if "hook" in state:
            if self.hook_state is not None:
                self.hook_state.load_state_dict(state["hook"])
            else:
                self._pending_state = state["hook"]  # applied when the hook is registered (first step)
        if "optimizer" in state:
            if self.optimizer is not None:
                self.optimizer.load_allreduce_state_dict(state["optimizer"])
            else:
                self._pending_optimizer_state = state["optimizer"]

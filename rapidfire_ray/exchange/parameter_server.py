"""`communication.mode: parameter_server`: no torch process group and no DDP (the launcher starts
Ray Train without its torch backend); the only exchange is the optimizer step, which pushes this
worker's gradients to the shard actors and pulls the new parameters (`PSClient.push_and_pull`).

`ParameterServerOptimizer` keeps `param_groups` with `lr`, so the trainer's scheduler works as
with AdamW; each push carries the scheduled lr, divided by the number of workers under
`communication.ps.lr_per_push: mean` (together the workers move as far as one synchronous step).
With `optimizer.type: rapidfire_adamw` the client pushes exact gradients for `freeze_step` steps,
then its own compressed AdamW update (1-bit Adam on the parameter server; ps/client.py).

Checkpoints: rank 0 fetches the shards' state right before the trainer saves and installs it in
the model, so the checkpoint's model equals the shard states saved beside it (`ps_shard_<i>.pt`);
every rank saves its client state as `comm_state_rank<r>.pt`, ranks other than 0 in a folder of
their own. `ray.train.report` waits for every worker, so a worker leaves the admission set around
it (else one waiting at the report and one waiting for admission would wait for each other).
"""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from ..compression import NonFiniteGradient
from ..optim import default_freeze_step
from ..ps.client import PSClient
from .base import GradientExchange

SHARD_STATE_FILE = "ps_shard_{}.pt"


def shard_state_files(checkpoint_dir: str, num_shards: int) -> list[str]:
    return [os.path.join(checkpoint_dir, SHARD_STATE_FILE.format(i)) for i in range(num_shards)]


def codec_options(cfg: dict) -> dict:
    """The configured codec's options for pushes and pulls (`push_codec_options`)."""
    return push_codec_options(cfg["optimizer"]["params"]["compression"])


def push_codec_options(compression: dict) -> dict:
    """The chunk size of 1bit/2bit, and the RMS scale for 1bit (what is pushed and pulled carries
    a persistent bias, under which a mean-|x| scale lets the error-feedback residual grow for
    hundreds of steps; see compression/onebit.py)."""
    c = compression
    if c["grad"] == "1bit":
        return {"chunk_size": c["chunk_size"], "scale": "rms"}
    return {"chunk_size": c["chunk_size"]} if c["grad"] == "2bit" else {}


class ParameterServerOptimizer(torch.optim.Optimizer):
    """`step()` = push gradients, pull parameters. `named_groups`: param groups with `params`
    and `param_names` (the names the shards know). A NaN/inf gradient is not sent: the step is
    skipped and counted (`skipped_steps`, `nonfinite`)."""

    def __init__(self, named_groups: list[dict], client: PSClient, *, lr: float, lr_divisor: int = 1):
        super().__init__(named_groups, {"lr": lr})
        self.client = client
        self.lr_divisor = lr_divisor  # communication.ps.lr_per_push mean: the number of workers
        self.last: dict | None = None  # the latest step's push_and_pull report
        self.skipped_steps = 0
        self.nonfinite: list[str] = []

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = {}
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                if p.grad is not None:  # Ray moves CPU tensors; a GPU gradient goes via the host
                    grads[name] = p.grad if p.grad.device.type == "cpu" else p.grad.to("cpu", torch.float32)
        try:
            self.last = self.client.push_and_pull(grads, lr=self.param_groups[0]["lr"] / self.lr_divisor)
        except NonFiniteGradient as e:
            self.skipped_steps += 1
            self.nonfinite = [e.name]
        return loss


class ParameterServerExchange(GradientExchange):
    has_process_group = False
    state_key = "ps_client"

    def __init__(self, communication: dict, optimizer: dict, shards: list, *, num_workers: int, rank: int,
                 total_steps: int, timer=None):
        super().__init__(rank=rank, on_nonfinite=communication["on_nonfinite"], timer=timer)
        params = optimizer["params"]
        # optimizer.type rapidfire_adamw: uncompressed warm-up pushes, then compressed updates
        self.freeze_step = None
        if optimizer["type"] == "rapidfire_adamw":
            self.freeze_step = params["freeze_step"] or default_freeze_step(total_steps)
        self.shards = shards
        self.codec = params["compression"]["grad"]
        self.codec_opts = push_codec_options(params["compression"])
        ps = communication["ps"]
        self.max_staleness = ps["max_staleness"]
        self.lr_divisor = int(num_workers) if ps["lr_per_push"] == "mean" else 1
        self.client: PSClient | None = None
        self.optimizer: ParameterServerOptimizer | None = None
        self._states: list[dict] | None = None  # rank 0: shard states installed for the next checkpoint
        self._skipped_before = 0

    def register(self, ddp_model) -> None:
        """Never called: this mode's trainer has no DDP model."""

    def build_optimizer(self, named_groups: list[dict], args) -> ParameterServerOptimizer:
        named = [(n, p) for g in named_groups for n, p in zip(g["param_names"], g["params"])]
        # A stable id per rank: a restarted worker is the same worker to the shards (its push
        # counts continue; see PSClient.sync).
        self.client = PSClient(named, self.shards, codec=self.codec, codec_opts=self.codec_opts,
                               max_staleness=self.max_staleness, worker_id=f"rank{self.rank}", stats=self.stats,
                               freeze_step=self.freeze_step)
        self._part_built()
        self.optimizer = ParameterServerOptimizer(named_groups, self.client, lr=args.learning_rate,
                                                  lr_divisor=self.lr_divisor)
        return self.optimizer

    def _nonfinite_before_step(self, optimizer, model) -> None:
        self._skipped_before = self.optimizer.skipped_steps
        return None

    def _nonfinite_after_step(self) -> list[str] | None:
        return list(self.optimizer.nonfinite) if self.optimizer.skipped_steps > self._skipped_before else None

    # --- the run's course -------------------------------------------------------------------

    def begin(self) -> None:
        """Before the first step (also after a resume): the model takes the shards' parameters."""
        self.client.sync()

    def before_save(self) -> None:
        """Rank 0, before the trainer writes a checkpoint: the model becomes the shards' state."""
        if self.rank == 0:
            self._states = self.client.pull_states()

    @contextlib.contextmanager
    def around_report(self, last: bool):
        """Out of the admission set while `ray.train.report` waits for every worker; back in
        (a pull) afterwards unless this was the last step."""
        self.client.finish()
        yield
        if not last:
            self.client.pull()

    def finish(self) -> dict:
        """Give back the admission (others must not wait for this worker); the client's report."""
        self.client.finish()
        return self.client.report()

    # --- telemetry and checkpoints ----------------------------------------------------------

    def _untimed_phase(self) -> str:
        return "optimizer"  # push and pull are the optimizer step

    def _step_stats(self) -> dict:
        """This step's push and pull: seconds, bytes each way, admission wait, staleness of the
        update it pushed (the largest over shards); None for a skipped step."""
        last, self.optimizer.last = self.optimizer.last, None
        if last is None:
            return {"ps_push_s": None, "ps_pull_s": None, "ps_wait_s": None, "ps_bytes_pushed": 0,
                    "ps_bytes_pulled": 0, "ps_staleness": None, "ps_push_kind": None}
        return {"ps_push_s": last["push_s"], "ps_pull_s": self.client.pull_latencies[-1],
                "ps_wait_s": last["wait_s"], "ps_bytes_pushed": last["bytes_sent"],
                "ps_bytes_pulled": last["bytes_received"], "ps_staleness": last["staleness"],
                "ps_push_kind": last["kind"]}

    def _state_part(self) -> PSClient | None:
        return self.client

    def save(self, checkpoint_dir: str) -> str:
        """Rank 0 writes the shard states and its client state into the trainer's checkpoint;
        another rank hands Ray Train a folder with its client state only (its trainer believes
        it is alone and saved a whole checkpoint too)."""
        if self.rank == 0:
            if self._states is not None:
                for path, state in zip(shard_state_files(checkpoint_dir, len(self._states)), self._states):
                    torch.save(state, path)
                self._states = None
            return super().save(checkpoint_dir)
        own = f"{checkpoint_dir}-rank{self.rank}"
        os.makedirs(own, exist_ok=True)
        torch.save(self.state_dict(), self.state_file(own))
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # this rank's trainer's own copy
        return own

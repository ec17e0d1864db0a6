"""A worker's trainer in `communication.mode: parameter_server`.

The workers of this mode have no torch process group (the launcher starts Ray Train without its
torch backend), so nothing can run a collective: not DDP (the trainer never wraps the model),
not the trainer's loss gather, not TRL's token counts. The only exchange is the optimizer step:

- `ParameterServerOptimizer.step()` pushes this worker's gradients to the shards and pulls the
  new parameters into the model (`PSClient.push_and_pull`). It keeps `param_groups` with `lr`,
  so the trainer's learning-rate scheduler and warm-up work as with AdamW, and sends the
  scheduled lr with each push (divided by the number of workers under
  `communication.ps.lr_per_push: mean`, the default: every worker pushes once per global step,
  so together they move the parameters as far as one synchronous step; `full` applies each
  push with the whole lr); the shards run AdamW with it. It holds no state of its own.
  With `optimizer.type: rapidfire_adamw` the client pushes exact gradients for
  `optimizer.params.freeze_step` steps (null: 20% of the run), then its own compressed AdamW
  update on the frozen variance (1-bit Adam on the parameter server; see client.py).
- `ParameterServerComm` is what `comm.training.TrainerComm` delegates to in this mode: it
  builds the client and the optimizer, syncs before the first step (every gradient is computed
  on the shards' parameters), reports per-step push/pull numbers, and handles checkpoints.

Checkpoints. Rank 0 fetches the shards' whole state right before the trainer saves and installs
its parameters in the model, so the checkpoint's model equals the shard states saved beside it
(`ps_shard_<i>.pt`, the snapshot format: a resumed run restores the shards from them). Every
rank saves its client state (error feedback, push counts) as `comm_state_rank<r>.pt`; ranks
other than 0 hand Ray Train only that file (their trainer believes it is alone and would save a
whole checkpoint too). `ray.train.report` waits for every worker, so a worker gives back its
admission to the next step before it and takes it again after (else a worker waiting at the
report and one waiting for admission would wait for each other).
"""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from ..compression import NonFiniteGradient
from .client import PSClient

SHARD_STATE_FILE = "ps_shard_{}.pt"


def shard_state_files(checkpoint_dir: str, num_shards: int) -> list[str]:
    return [os.path.join(checkpoint_dir, SHARD_STATE_FILE.format(i)) for i in range(num_shards)]


def codec_options(cfg: dict) -> dict:
    """The configured codec's options for pushes and pulls: the chunk size of 1bit/2bit, and the
    RMS scale for 1bit (what is pushed and pulled carries a persistent bias, a gradient's mean
    or a run of updates in one direction, under which a mean-|x| scale lets the error-feedback
    residual grow for hundreds of steps; see compression/onebit.py)."""
    c = cfg["optimizer"]["params"]["compression"]
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


class ParameterServerComm:
    def __init__(self, cfg: dict, shards: list, *, rank: int, stats, total_steps: int):
        c = cfg["optimizer"]["params"]["compression"]
        # optimizer.type rapidfire_adamw: uncompressed warm-up pushes, then compressed updates
        self.freeze_step = None
        if cfg["optimizer"]["type"] == "rapidfire_adamw":
            from ..optim import default_freeze_step

            self.freeze_step = cfg["optimizer"]["params"]["freeze_step"] or default_freeze_step(total_steps)
        self.shards = shards
        self.rank = rank
        self.stats = stats  # comm.stats.CommStats: bytes and call latency, as in the other modes
        self.codec = c["grad"]
        self.codec_opts = codec_options(cfg)
        self.max_staleness = cfg["communication"]["ps"]["max_staleness"]
        self.lr_divisor = int(cfg["scaling"]["num_workers"]) if cfg["communication"]["ps"]["lr_per_push"] == "mean" else 1
        self.client: PSClient | None = None
        self.optimizer: ParameterServerOptimizer | None = None
        self._pending_state: dict | None = None
        self._states: list[dict] | None = None  # rank 0: shard states installed for the next checkpoint

    def build_optimizer(self, named_groups: list[dict], lr: float) -> ParameterServerOptimizer:
        named = [(n, p) for g in named_groups for n, p in zip(g["param_names"], g["params"])]
        # A stable id per rank: a restarted worker is the same worker to the shards (its push
        # counts continue; see PSClient.sync).
        self.client = PSClient(named, self.shards, codec=self.codec, codec_opts=self.codec_opts,
                               max_staleness=self.max_staleness, worker_id=f"rank{self.rank}", stats=self.stats,
                               freeze_step=self.freeze_step)
        if self._pending_state is not None:
            self.client.load_state_dict(self._pending_state)
            self._pending_state = None
        self.optimizer = ParameterServerOptimizer(named_groups, self.client, lr=lr, lr_divisor=self.lr_divisor)
        return self.optimizer

    def begin(self) -> None:
        """Before the first step (also after a resume): the model takes the shards' parameters."""
        self.client.sync()

    def take(self) -> dict:
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

    def save(self, checkpoint_dir: str, state_file: str) -> str:
        """Write this rank's part of a checkpoint; return the folder to hand to Ray Train."""
        if self.rank == 0 and self._states is not None:
            for path, state in zip(shard_state_files(checkpoint_dir, len(self._states)), self._states):
                torch.save(state, path)
            self._states = None
        if self.rank == 0:
            torch.save({"ps_client": self.client.state_dict()}, os.path.join(checkpoint_dir, state_file))
            return checkpoint_dir
        own = f"{checkpoint_dir}-rank{self.rank}"
        os.makedirs(own, exist_ok=True)
        torch.save({"ps_client": self.client.state_dict()}, os.path.join(own, state_file))
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # this rank's trainer's own copy
        return own

    def load(self, state: dict) -> None:
        if self.client is not None:
            self.client.load_state_dict(state["ps_client"])
        else:
            self._pending_state = state["ps_client"]

    def finish(self) -> dict:
        """End of training: give back the admission (others must not wait for this worker) and
        return the client's report for the run summary."""
        self.client.finish()
        return self.client.report()

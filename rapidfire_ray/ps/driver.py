"""The driver's side of `communication.mode: parameter_server`: start a run's shard actors, turn
their final state into the run's final checkpoint, stop them.

Initial parameters from one model built on the driver; one shard per node (SPREAD), actors
named `rapidfire-ps-<run name>-<i>`; snapshots under `<run dir>/ps_snapshots/`; at the end the
final checkpoint gets the shards' final state. Details: docs/parameter_server.md.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from ..capacity import SHARD_CPUS
from ..errors import RapidfireError
from ..models import load_model
from ..checkpoints import refresh_manifest_entries
from ..checkpoints.ledger import resume_folder
from .launch import launch_shards
from .snapshots import snapshot_path
from ..exchange.parameter_server import codec_options, shard_state_files




def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


class ParameterServer:
    def __init__(self, cfg: DictConfig, run_dir: str, *, resume: bool):
        ps, o = cfg.communication.ps, cfg.optimizer.params
        torch.manual_seed(cfg.run.seed)
        if cfg.train.stage == "reward":  # the reward model: the base weights under a one-output head
            from ..models import load_reward_model, load_tokenizer

            self.model = load_reward_model(cfg.model.name, torch.float32, load_tokenizer(cfg.model.name).pad_token_id)
        else:
            self.model = load_model(cfg.model.name, dtype=torch.float32)
        from ..driver.cluster import cpu_share

        named = dict(self.model.named_parameters())
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        self.num_shards = ps.num_shards or max(1, nodes)
        if self.num_shards > len(named):
            raise RapidfireError(f"communication.ps.num_shards: {self.num_shards} is more than the {len(named)} "
                                 f"parameter tensors of {cfg.model.name}; choose at most {len(named)} (null: one "
                                 "per node)")
        self.snapshot_dir = os.path.join(run_dir, "ps_snapshots")
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        if resume:
            self._seed_snapshots(run_dir)
        self.handles, self.partition, self._pinned = launch_shards(
            named.items(), self.num_shards, snapshot_dir=self.snapshot_dir, num_cpus=cpu_share(SHARD_CPUS),
            name_prefix=f"rapidfire-ps-{cfg.run.name}", codec=cfg.optimizer.params.compression.grad,
            codec_opts=codec_options(OmegaConf.to_container(cfg, resolve=True)), max_staleness=ps.max_staleness,
            snapshot_every=ps.snapshot_every, lr_staleness_scaling=ps.lr_staleness_scaling,
            optimizer={"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay})
        ray.get([h.ping.remote() for h in self.handles])  # up (and restored) before any worker asks

    def _seed_snapshots(self, run_dir: str) -> None:
        """The shard states of the checkpoint a resumed run continues from become the snapshots
        the shards start from."""
        latest = resume_folder(run_dir)  # the one the workers resume from (a damaged one is set aside)
        files = shard_state_files(latest, self.num_shards) if latest else []
        if not files or not all(os.path.exists(f) for f in files):
            raise RapidfireError(f"--resume: the latest checkpoint ({latest}) holds no parameter-server state for "
                                 f"{self.num_shards} shards; resume with the communication.mode and "
                                 "communication.ps.num_shards it was trained with")
        os.makedirs(self.snapshot_dir, exist_ok=True)
        for i, f in enumerate(files):
            shutil.copyfile(f, snapshot_path(self.snapshot_dir, i))

    def finalize(self, checkpoint_dir: str) -> None:
        """Write the shards' final state into the final checkpoint: shard states and model weights."""
        states = ray.get([h.state_dict.remote() for h in self.handles])
        params = {n: t for st in states for n, t in st["params"].items()}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])
        for path, state in zip(shard_state_files(checkpoint_dir, len(states)), states):
            _atomic_torch_save(state, path)
        rewritten = [os.path.basename(p) for p in shard_state_files(checkpoint_dir, len(states))]
        tmp = tempfile.mkdtemp(prefix=".ps-final-", dir=checkpoint_dir)
        try:
            self.model.save_pretrained(tmp)
            for name in os.listdir(tmp):
                if name.endswith((".safetensors", ".safetensors.index.json")):
                    os.replace(os.path.join(tmp, name), os.path.join(checkpoint_dir, name))
                    rewritten.append(name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # The checkpoint's manifests must describe its files as they are now, or a resume would
        # reject this final checkpoint as corrupt and fall back to an older one.
        refresh_manifest_entries(checkpoint_dir, rewritten)

    def stats(self) -> list[dict]:
        return ray.get([h.stats.remote() for h in self.handles])

    def stop(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)

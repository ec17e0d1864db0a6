"""What each rank runs in the multi-process RapidfireAdamW tests, and the spawner.

Lives in its own module (not the test file) because `spawn` children import the target
function by module name; `tests/` is on sys.path (pyproject `pythonpath`), so this is
`optim.adamw_ranks` in the parent and in the children alike."""
from __future__ import annotations

import copy
import io
import os
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rapidfire_ray.exchange.stats import CommStats
from rapidfire_ray.optim import RapidfireAdamW, local_gradient_hook

# --- spawning ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(scenarios: dict, rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    results, name = {}, None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        for name, kwargs in scenarios.items():
            results[name] = SCENARIOS[name](rank, world, **kwargs)
        torch.save({"results": results}, path)
    except BaseException:
        torch.save({"results": results, "error": f"in scenario {name!r}:\n{traceback.format_exc()}"}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(scenarios: dict[str, dict], out_dir, world: int = 2, timeout: float = 120.0) -> dict[str, list]:
    """Run each SCENARIOS[name](rank, world, **kwargs) of `scenarios`, in order, in `world`
    spawned processes joined by one gloo group on 127.0.0.1 (one start-up for them all: most
    of the time is importing torch); return {name: [result of rank 0, rank 1, ...]}. A rank's
    exception fails with its traceback; ranks still running after `timeout` s are killed."""
    for r in range(world):  # never read a result left by an earlier run
        path = os.path.join(str(out_dir), f"rank{r}.pt")
        if os.path.exists(path):
            os.remove(path)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(scenarios, r, world, port, str(out_dir)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    per_rank, errors = [], []
    for r in range(world):
        path = os.path.join(str(out_dir), f"rank{r}.pt")
        saved = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result written"}
        if "error" in saved:
            errors.append(f"rank {r}: {saved['error']}")
        per_rank.append(saved.get("results", {}))
    if hung:
        errors.append(f"ranks {hung} still running after {timeout} s (killed)")
    if errors:
        raise AssertionError("\n".join(errors))
    return {name: [results[name] for results in per_rank] for name in scenarios}


# --- models and data shared with the single-process reference ---------------------------------


class RankNet(nn.Module):
    """A small regression net; `rank0_head` is used only by rank 0 (no gradient on rank 1)
    and `unused` by nobody (no gradient anywhere)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(6, 24)
        self.head = nn.Linear(24, 1)
        self.rank0_head = nn.Linear(24, 1)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return out + self.rank0_head(h) if rank == 0 else out


def rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 6, generator=g)
    y = torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * (1 + rank)
    return x, y


def rank_loss(model: RankNet, rank: int, step: int) -> torch.Tensor:
    x, y = rank_batch(rank, step)
    return ((model(x, rank) - y) ** 2).mean()


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with different hyperparameters: matrices (decayed) and biases/vectors."""
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.dim() > 1 or n == "unused"]
    vecs = [(n, p) for n, p in named if not (p.dim() > 1 or n == "unused")]
    return [{"params": [p for _, p in mats], "param_names": [n for n, _ in mats], "weight_decay": 0.1},
            {"params": [p for _, p in vecs], "param_names": [n for n, _ in vecs], "weight_decay": 0.0, "lr": 2e-2}]


def _average_grads(model: RankNet, world: int) -> None:
    """What DDP does in warm-up: average every used parameter's gradient (zeros where a rank has none)."""
    for name, p in model.named_parameters():
        if name == "unused":
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


SIM = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "freeze_step": 3, "chunk_size": 16, "steps": 9, "reload_at": 6}


# --- scenarios ----------------------------------------------------------------------------------


def _make_sim_optimizer(model: RankNet) -> RapidfireAdamW:
    return RapidfireAdamW(param_groups(model), lr=SIM["lr"], betas=SIM["betas"], eps=SIM["eps"],
                          freeze_step=SIM["freeze_step"], chunk_size=SIM["chunk_size"])


def _resume_like_trainer(rank: int, model: RankNet, opt: RapidfireAdamW, per_rank_files: bool):
    """A checkpoint as transformers' Trainer writes it: model and optimizer.pt from rank 0 only
    (every rank loads those), plus, when `per_rank_files`, each rank's own error feedback
    (`allreduce_state_dict()`), loaded after the optimizer on rank 0 and before it on rank 1."""
    objects = [(model.state_dict(), opt.state_dict()) if rank == 0 else None]
    buf = io.BytesIO()
    torch.save(opt.allreduce_state_dict(), buf)
    dist.broadcast_object_list(objects, src=0)  # "rank 0 wrote optimizer.pt"
    buf_opt = io.BytesIO()
    torch.save(objects[0], buf_opt)
    buf_opt.seek(0)
    model_sd, opt_sd = torch.load(buf_opt, weights_only=True, map_location="cpu")
    buf.seek(0)
    own = torch.load(buf, weights_only=True, map_location="cpu")

    model = RankNet(seed=123)  # other values: everything must come from the checkpoint
    model.load_state_dict(model_sd)
    opt = _make_sim_optimizer(model)
    if per_rank_files and rank == 1:
        opt.load_allreduce_state_dict(own)
    opt.load_state_dict(opt_sd)
    if per_rank_files and rank == 0:
        opt.load_allreduce_state_dict(own)
    return model, opt


def compressed_vs_simulation(rank: int, world: int) -> dict:
    """Warm-up with averaged gradients (zeros where a rank has none, as DDP fills them), then
    compressed steps on local gradients; after step `reload_at` both ranks resume from rank 0's
    checkpoint plus their own error-feedback files. Returns the parameters after every step."""
    model = RankNet()
    opt = _make_sim_optimizer(model)
    history, stages, reloaded = [], [], None
    for step in range(1, SIM["steps"] + 1):
        opt.zero_grad(set_to_none=True)
        rank_loss(model, rank, step).backward()
        stages.append(opt.in_compressed_stage)
        if not opt.in_compressed_stage:
            _average_grads(model, world)
        opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if step == SIM["reload_at"]:
            model, opt = _resume_like_trainer(rank, model, opt, per_rank_files=True)
            reloaded = {k: (s.worker_error is not None, s.server_error is not None)
                        for k, s in opt._allreduce_states.items()}
    return {"history": history, "stages": stages, "reloaded_errors": reloaded,
            "unused_state": len(opt.state[model.unused]), "steps": opt.steps}


def resume_from_rank0_only(rank: int, world: int) -> dict:
    """The Trainer's optimizer.pt alone (rank 0's): rank 1 must not take rank 0's error
    feedback; it starts its own from zero, and training goes on in step on both ranks."""
    model = RankNet()
    opt = _make_sim_optimizer(model)
    out = {}
    for step in range(1, SIM["steps"] + 1):
        opt.zero_grad(set_to_none=True)
        rank_loss(model, rank, step).backward()
        if not opt.in_compressed_stage:
            _average_grads(model, world)
        opt.step()
        if step == SIM["reload_at"]:
            model, opt = _resume_like_trainer(rank, model, opt, per_rank_files=False)
            out["slots_after_load"] = sorted(opt._allreduce_states)
            out["steps_after_load"] = opt.steps
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["slots_at_end"] = sorted(opt._allreduce_states)
    return out


def _regression_data(rank: int, n: int = 256):
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(16, 8, generator=g), torch.randn(8, 1, generator=g)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def _regression_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def _full_loss(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        loss = ((model(x) - y) ** 2).mean().reshape(1)
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _train(rank: int, optimizer: str, steps: int, freeze_step: int, lr: float, probe: bool) -> dict:
    x, y = _regression_data(rank)
    module = _regression_model()
    ddp = nn.parallel.DistributedDataParallel(module)
    stats = CommStats()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.01)
    else:
        opt = RapidfireAdamW(ddp.named_parameters(), lr=lr, weight_decay=0.01, freeze_step=freeze_step,
                             codec=optimizer, chunk_size=64, stats=stats)
        ddp.register_comm_hook(opt, local_gradient_hook)
    per_step, initial = [], _full_loss(module, x, y)
    for step in range(steps):
        idx = torch.arange(step * 32, step * 32 + 32) % x.shape[0]
        xb, yb = x[idx], y[idx]
        opt.zero_grad(set_to_none=True)
        compressed = getattr(opt, "in_compressed_stage", False)
        ((ddp(xb) - yb) ** 2).mean().backward()
        record = {}
        if probe and optimizer != "adamw":
            hook = stats.take()
            # The gradient DDP left: equal to this rank's own (local) gradient, or to the average?
            local = torch.autograd.grad(((module(xb) - yb) ** 2).mean(), list(module.parameters()))
            flat_grad = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
            flat_local = torch.cat([g.reshape(-1) for g in local])
            gathered = [torch.empty_like(flat_grad) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flat_grad)
            record = {"compressed": compressed, "hook_bytes_sent": hook["bytes_sent"],
                      "hook_calls": hook["comm_calls"],
                      "grad_is_local": torch.equal(flat_grad, flat_local),
                      "grad_same_on_ranks": all(torch.equal(gathered[0], t) for t in gathered[1:])}
        opt.step()
        if probe and optimizer != "adamw":
            record["step_bytes_sent"] = stats.take()["bytes_sent"]
        per_step.append(record)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {"loss": _full_loss(module, x, y), "initial_loss": initial, "per_step": per_step,
            "params_same_on_ranks": all(torch.equal(gathered[0], t) for t in gathered[1:]),
            "numel": flat.numel(), "total_bytes_sent": stats.total_bytes_sent}


def ddp_training(rank: int, world: int, steps: int, freeze_step: int, lr: float) -> dict:
    """The regression net trained with DDP: torch AdamW, then RapidfireAdamW (1bit) with
    `local_gradient_hook`, probing what the hook left in .grad at every step."""
    return {"adamw": _train(rank, "adamw", steps, freeze_step, lr, probe=False),
            "1bit": _train(rank, "1bit", steps, freeze_step, lr, probe=True)}


def clip_with_ddp(rank: int, world: int, steps: int, freeze_step: int, max_norm: float) -> list[dict]:
    """RapidfireAdamW.clip_grad_norm_ under DDP with `local_gradient_hook`: per step, this rank's
    local gradient (computed apart, without DDP), what DDP left in .grad, the norm clip returned,
    the gradients after the clip and the norm ratio before and after."""
    x, y = _regression_data(rank)
    module = _regression_model()
    ddp = nn.parallel.DistributedDataParallel(module)
    opt = RapidfireAdamW(ddp.named_parameters(), lr=1e-2, weight_decay=0.01, freeze_step=freeze_step,
                         chunk_size=64, stats=CommStats())
    ddp.register_comm_hook(opt, local_gradient_hook)
    out = []
    for step in range(steps):
        idx = torch.arange(step * 32, step * 32 + 32) % x.shape[0]
        xb, yb = x[idx], y[idx]
        opt.zero_grad(set_to_none=True)
        local = torch.autograd.grad(((module(xb) - yb) ** 2).mean(), list(module.parameters()))
        compressed = opt.in_compressed_stage
        ((ddp(xb) - yb) ** 2).mean().backward()
        before = torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone()
        ratio_before = opt.grad_norm_ratio
        norm = opt.clip_grad_norm_(ddp.parameters(), max_norm)
        after = torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone()
        out.append({"compressed": compressed, "local": torch.cat([g.reshape(-1) for g in local]),
                    "before": before, "after": after, "norm": float(norm), "ratio_before": ratio_before,
                    "ratio_after": opt.grad_norm_ratio})
        opt.step()
    return out


def nonfinite_skip(rank: int, world: int) -> dict:
    """Step 3 is compressed (freeze_step 2); rank 1 puts a NaN in `head.weight`'s gradient
    there. Returns what each rank saw before and after that step, and after a clean step 4."""
    model = RankNet()
    opt = RapidfireAdamW(model.named_parameters(), lr=1e-2, freeze_step=2, chunk_size=16)

    def snapshot():
        sd = opt.state_dict()
        return copy.deepcopy({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                              "state": sd["state"], "ours": sd["rapidfire_adamw"]})

    out = {}
    for step in range(1, 5):
        opt.zero_grad(set_to_none=True)
        rank_loss(model, rank, step).backward()
        if not opt.in_compressed_stage:
            _average_grads(model, world)
        if step == 3:
            if rank == 1:
                model.head.weight.grad[0, 3] = float("nan")
            out["before"] = snapshot()
        opt.step()
        if step == 3:
            out["after"] = snapshot()
            out["skipped_steps"], out["nonfinite"] = opt.skipped_steps, list(opt.nonfinite)
            out["steps_after_skip"] = opt.steps
    out["final_nonfinite"], out["final_steps"] = list(opt.nonfinite), opt.steps
    out["final_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


SCENARIOS = {f.__name__: f for f in (compressed_vs_simulation, resume_from_rank0_only, ddp_training,
                                     nonfinite_skip, clip_with_ddp)}

"""Multi-process scenarios for tests/exchange: each runs in a gloo group of spawned processes and
saves what it saw (tensors, byte counts, state) for the test process to check.

Imported by module name from the spawned children (the tests put this folder on sys.path), so
it holds no pytest code. `launch` fails instead of hanging: gloo gets a 30 s timeout, and the
launcher kills the group after `timeout` seconds."""
from __future__ import annotations

import datetime
import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rapidfire_ray.exchange import (
    AllreduceState,
    CommStats,
    CompressionPolicy,
    HookState,
    compressed_allreduce,
    compressed_allreduce_hook,
)
from rapidfire_ray.compression import get_codec
from rapidfire_ray.exchange.auto import _agreed_max, measure

N = 100_003
STEPS = 3
CODECS = [("1bit", {}), ("2bit", {}), ("none", {}), ("fp16", {}), ("1bit", {"chunk_size": 64, "scale": "rms"})]
SUBGROUP = [1, 3]  # in the 4-rank run: a subgroup with non-contiguous global ranks


def make_input(rank: int, step: int, codec_index: int, n: int = N) -> torch.Tensor:
    """Rank- and step-dependent values biased away from zero: random sign times (|N(0,1)| + 0.5)."""
    g = torch.Generator().manual_seed(1_000_003 * codec_index + 1009 * rank + step)
    x = torch.randn(n, generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) * (x.abs() + 0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, scenarios: list[str], out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=30))
        results = {name: SCENARIOS[name](rank, world_size) for name in scenarios}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def launch(scenarios: list[str], world_size: int, out_dir: str, timeout: float = 90.0) -> list[dict]:
    """Run `scenarios` in a `world_size`-process gloo group; returns each rank's results."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, scenarios, out_dir), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for p in procs:
        p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"rank {r}:\n{f.read()}")
    if hung or errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{scenarios} on {world_size} ranks failed (hung ranks: {hung}, exit codes: "
                           f"{[p.exitcode for p in procs]})\n" + "\n".join(errors))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


# --- compressed_allreduce ---------------------------------------------------------------------


def _run_codec(rank: int, codec_index: int, group=None) -> dict:
    name, opts = CODECS[codec_index]
    codec = get_codec(name, **opts)
    state, stats = AllreduceState(), CommStats()
    outputs, taken, aliased = [], [], []
    for step in range(STEPS):
        x = make_input(rank, step, codec_index)
        # odd steps write the result over the input (out=x), as the DDP hook and rapidfire_adamw do
        out = compressed_allreduce(x, codec, state, group, stats, out=x if step % 2 else None)
        outputs.append(out.clone())
        aliased.append(out.data_ptr() == x.data_ptr())
        taken.append(stats.take())
    # A checkpoint round trip: the restored state gives the same next output as the live one.
    restored = AllreduceState()
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    restored.load_state_dict(torch.load(buf))
    final_state = state.state_dict()
    x = make_input(rank, STEPS, codec_index)
    live = compressed_allreduce(x, codec, state, group)
    again = compressed_allreduce(x, codec, restored, group)
    return {"outputs": outputs, "stats": taken, "state": final_state, "resumed_equal": torch.equal(live, again),
            "aliased": aliased}


def allreduce_scenario(rank: int, world_size: int) -> dict:
    out = {"codecs": [_run_codec(rank, i) for i in range(len(CODECS))]}
    if world_size == 4:
        group = dist.new_group(SUBGROUP)  # every rank must call new_group
        if rank in SUBGROUP:
            out["subgroup"] = _run_codec(SUBGROUP.index(rank), 0, group)
        dist.barrier()
    return out


# --- the DDP hook -------------------------------------------------------------------------------


def _mlp(seed: int = 0, d_in: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))


def _ddp(module: nn.Module, policy: CompressionPolicy | None, bucket_cap_mb: float = 0.04,
         overlap: bool = False, timer=None):
    model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    state = None
    if policy is not None:
        group = dist.new_group(ranks=list(range(dist.get_world_size()))) if overlap else None
        state = HookState(module.named_parameters(), policy, group=group, overlap=overlap, timer=timer)
        model.register_comm_hook(state, compressed_allreduce_hook)
    return model, state


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def _plain_parity(rank: int) -> dict:
    """policy none vs plain DDP (no hook): gradients over 3 iterations (buckets rebuild after the first)."""
    plain, _ = _ddp(_mlp(), None)
    hooked, state = _ddp(_mlp(), CompressionPolicy("none"))
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(3):
        x = torch.randn(16, 64, generator=g)
        for model in (plain, hooked):
            model.zero_grad()
            model(x).square().mean().backward()
        out.append((_grads(plain.module), _grads(hooked.module)))
    return {"grads": out, "stats": state.stats.take()}


def _regression_data(rank: int, steps: int, batch: int = 64, d_in: int = 32):
    g = torch.Generator().manual_seed(123)
    w = torch.randn(d_in, 1, generator=g)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=g)
        yield x, x @ w + 0.01 * torch.randn(batch, 1, generator=g)


def _train(rank: int, policy: CompressionPolicy, steps: int = 50) -> dict:
    model, state = _ddp(_mlp(1, d_in=32), policy, bucket_cap_mb=25)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, taken = [], []
    for x, y in _regression_data(rank, steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        assert not state.nonfinite
        opt.step()
        losses.append(loss.item())
        taken.append(state.stats.take())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    return {"losses": losses, "stats": taken, "params": params, "hook_state": buf.getvalue(),
            "codecs": {n: policy.codec_for(n, p) for n, p in model.module.named_parameters()}}


def _nonfinite(rank: int) -> dict:
    """A NaN in one parameter's gradient on rank 1 only, at step 1 of 0..2."""
    module = _mlp(2)
    model, state = _ddp(module, CompressionPolicy("1bit", keep_fp16=[], min_numel=0))
    bad = module[2].weight
    poison = {"on": False}
    if rank == 1:
        bad.register_hook(lambda grad: grad * float("nan") if poison["on"] else grad)
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(3):
        poison["on"] = step == 1
        before = state.state_dict()
        model.zero_grad()
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        out.append({"grads": _grads(module), "nonfinite": list(state.nonfinite), "before": before,
                    "after": state.state_dict()})
        state.nonfinite.clear()
    return {"steps": out, "skipped_buckets": state.skipped_buckets}


class _EmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(2000, 16)
        self.proj = nn.Linear(16, 512)
        self.head = nn.Linear(512, 1)

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.embed(tokens).mean(1))))


def _auto(rank: int) -> dict:
    """grad: auto on 2 real gloo ranks, measured and decided every 2 steps; the agreement primitives."""
    module = _EmbeddingModel()
    policy = CompressionPolicy("auto", auto_interval=2)
    model, state = _ddp(module, policy, bucket_cap_mb=25)
    g = torch.Generator().manual_seed(50 + rank)
    seen = []
    for _ in range(5):
        model.zero_grad()
        tokens = torch.randint(0, 2000, (4, 3), generator=g)
        model(tokens).square().mean().backward()
        seen.append((dict(policy.choices), policy.round, policy.measured_at))
    cpu = torch.device("cpu")
    # every rank's own numbers differ; each gets the largest of each
    agreed = _agreed_max([float(rank), 10.0 - rank], None, cpu)
    # measure() alone, with small probes: its codec timings differ per rank before agreement
    alone = measure({c: policy.codec(c) for c in ("none", "fp16", "1bit")}, cpu, None, elements=4096,
                    max_link_bytes=64 * 1024)
    checks = {}
    for label, codec in (("same", "fp16"), ("different", "none" if rank == 0 else "1bit")):
        try:
            state._check_agreed(codec, 7, 2, cpu)
            checks[label] = None
        except RuntimeError as e:
            checks[label] = str(e)
    return {"seen": seen, "grads": _grads(module), "report": policy.report(), "agreed": agreed,
            "alone": alone.to_dict(), "checks": checks, "steps": state.step,
            "auto_names": sorted(n for n, p in module.named_parameters() if policy.rule(n, p.numel()) == "auto")}


def _overlap(rank: int) -> dict:
    """The exchange thread (overlap) against the synchronous hook: the same model, data and policy
    side by side for 6 steps with several buckets; a NaN on rank 1 at step 3; a step timer."""
    from rapidfire_ray.telemetry.timing import StepTimer

    out = {}
    for label, policy_args in (("1bit", dict(grad="1bit", keep_fp16=["4.*"], min_numel=0)),
                               ("2bit", dict(grad="2bit", min_numel=0))):
        runs = {}
        for overlap in (False, True):
            module = _mlp(4)
            timer = StepTimer() if overlap else None
            model, state = _ddp(module, CompressionPolicy(**policy_args), bucket_cap_mb=0.02, overlap=overlap,
                                timer=timer)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            poison = {"on": False}
            if rank == 1:
                module[2].weight.register_hook(lambda grad: grad * float("nan") if poison["on"] else grad)
            g = torch.Generator().manual_seed(70 + rank)
            steps, phases = [], []
            for step in range(6):
                poison["on"] = step == 3
                opt.zero_grad()
                if timer is not None:
                    with timer.phase("forward"):
                        loss = model(torch.randn(32, 64, generator=g)).square().mean()
                    with timer.phase("backward"):
                        loss.backward()
                else:
                    model(torch.randn(32, 64, generator=g)).square().mean().backward()
                steps.append({"grads": _grads(module), "nonfinite": list(state.nonfinite)})
                if not state.nonfinite:
                    opt.step()
                state.nonfinite.clear()
                if timer is not None:
                    phases.append((timer.take(), timer.comm_in_flight))
            state.close()
            runs[overlap] = {"steps": steps, "phases": phases, "stats": state.stats.take(),
                             "skipped": state.skipped_buckets, "state": state.state_dict(),
                             "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()])}
        out[label] = runs
    return out


def ddp_scenario(rank: int, world_size: int) -> dict:
    return {"plain": _plain_parity(rank),
            "overlap": _overlap(rank),
            "train_1bit": _train(rank, CompressionPolicy("1bit")),
            "train_none": _train(rank, CompressionPolicy("none")),
            "nonfinite": _nonfinite(rank),
            "auto": _auto(rank)}


SCENARIOS = {"allreduce": allreduce_scenario, "ddp": ddp_scenario}

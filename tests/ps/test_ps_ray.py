"""The parameter server on real Ray actors: 2 worker threads x 2 shard actors training a small
regression model (each thread has its own model copy and `PSClient`)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rapidfire_ray.optim import RapidfireAdamW
from rapidfire_ray.ps import PSClient, launch_shards

pytestmark = pytest.mark.timeout(180)

STEPS = 40


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    w = torch.linspace(-1, 1, 8)[:, None]
    return x, x @ w + 0.05 * torch.randn(512, 1, generator=g)


def _loss(model, data):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(data[0]), data[1]).item()


def _train(shards, codec, max_staleness, *, delays=(0.0, 0.0), on_step=None, **client_options):
    """Two worker threads, STEPS steps each; returns their clients and models."""
    clients, models, errors = [], [], []
    for w in range(2):
        m = _model(seed=100 + w)  # deliberately not the server's init: sync() must overwrite it
        clients.append(PSClient(m.named_parameters(), shards, codec=codec, max_staleness=max_staleness,
                                worker_id=f"w{w}", **client_options))
        models.append(m)

    def run(w):
        try:
            torch.set_num_threads(1)
            x, y = _data(seed=w)
            clients[w].sync()
            for step in range(STEPS):
                batch = slice((step * 32) % 512, (step * 32) % 512 + 32)
                models[w].zero_grad()
                torch.nn.functional.mse_loss(models[w](x[batch]), y[batch]).backward()
                time.sleep(delays[w])
                clients[w].push_and_pull({n: p.grad for n, p in models[w].named_parameters()})
                if on_step is not None:
                    on_step(w, step)
            clients[w].finish()  # else the other worker waits for a push that never comes
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
            raise

    threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return clients, models


def _server_params(ray, shards):
    out = {}
    for st in ray.get([s.state.remote() for s in shards]):
        out.update(st["params"])
    return out


def _stop(ray, shards):
    for s in shards:
        ray.kill(s, no_restart=True)


def test_two_workers_two_shards_async_1bit_bounded_staleness(ray_cluster):
    ray = ray_cluster
    model = _model()
    eval_data = _data(seed=7)
    initial = _loss(model, eval_data)
    shards, _, _pinned = launch_shards(model.named_parameters(), 2, codec="1bit", max_staleness=1,
                                      optimizer={"lr": 0.03})
    try:
        # Worker 1 is slowed 3x-ish: worker 0 must wait for it rather than outrun the bound.
        clients, models = _train(shards, "1bit", 1, delays=(0.0, 0.03))
        stats = ray.get([s.stats.remote() for s in shards])
        for st in stats:
            assert st["pushes"] == st["applied"] == 2 * STEPS  # every push applied exactly once
            assert st["duplicates"] == 0 and st["version"] == 2 * STEPS
            assert st["staleness_max"] <= 1 and st["bound_violations"] == 0
            assert sum(st["staleness_hist"].values()) == 2 * STEPS
            assert st["bytes_in"] > 0 and st["bytes_out"] > 0 and st["updates_per_s"] > 0
            assert st["push_latency_p99_s"] >= st["push_latency_p50_s"] > 0
        for c in clients:
            r = c.report()
            assert r["applied"] == 2 * STEPS and r["staleness_max"] <= 1 and r["bound_exceeded"] == 0
        assert sum(st["staleness_hist"].get(1, 0) for st in stats) > 0  # it really was asynchronous
        # 1-bit both ways: far fewer bytes than float32 (after the initial full pulls).
        fp32_per_push = 4 * sum(p.numel() for p in model.parameters())
        assert clients[0].report()["bytes_sent"] < fp32_per_push * STEPS / 4
        server = _server_params(ray, shards)
        model.load_state_dict(server)
        final = _loss(model, eval_data)
        assert final < 0.2 * initial, (initial, final)
        # The workers' copies are within the codec's error of the server; a full pull is exact.
        for c, m in zip(clients, models):
            c.sync()
            assert all(torch.equal(p.detach(), server[n]) for n, p in m.named_parameters())
    finally:
        _stop(ray, shards)


def test_killed_shard_restarts_from_snapshot(ray_cluster, tmp_path):
    ray = ray_cluster
    model = _model()
    eval_data = _data(seed=7)
    initial = _loss(model, eval_data)
    shards, _, _pinned = launch_shards(model.named_parameters(), 2, codec="none", max_staleness=1,
                              optimizer={"lr": 0.03}, snapshot_every=7, snapshot_dir=str(tmp_path))
    killed = threading.Event()

    def kill_once(w, step):
        if w == 0 and step == 15 and not killed.is_set():
            killed.set()
            ray.kill(shards[0], no_restart=False)

    try:
        clients, models = _train(shards, "none", 1, on_step=kill_once)
        stats = ray.get([s.stats.remote() for s in shards])
        dead, alive = stats
        assert dead["restarts"] == 1 and dead["restored_from_version"] is not None
        assert alive["restarts"] == 0 and alive["lost_updates"] == 0
        assert alive["version"] == 2 * STEPS
        # Every acknowledged push is in the state or counted as lost (never both, never twice).
        acked = sum(c.seq[0] for c in clients)
        assert acked == 2 * STEPS
        assert dead["version"] + dead["lost_updates"] == acked
        assert dead["lost_updates"] < 7 + 2  # at most the updates since the last snapshot
        assert dead["bound_violations"] == 0
        server = _server_params(ray, shards)
        for c, m in zip(clients, models):
            c.sync()
            assert all(torch.equal(p.detach(), server[n]) for n, p in m.named_parameters())
        model.load_state_dict(server)
        assert _loss(model, eval_data) < 0.2 * initial
    finally:
        _stop(ray, shards)


def test_rapidfire_adamw_on_the_shards_is_rapidfire_adamw(ray_cluster):
    """One worker, lossless codec: warm-up pushes are AdamW on the shards, then the worker's own
    update on the frozen variance; step for step what RapidfireAdamW does on one process."""
    ray = ray_cluster
    model, reference = _model(), _model()
    opts = {"lr": 0.02, "weight_decay": 0.1}
    shards, _, _pinned = launch_shards(model.named_parameters(), 2, codec="none", max_staleness=0, optimizer=opts)
    ref_opt = RapidfireAdamW(reference.parameters(), **opts, freeze_step=4, codec="none")
    client = PSClient(model.named_parameters(), shards, codec="none", max_staleness=0, worker_id="w",
                      freeze_step=4)
    x, y = _data(seed=3)
    try:
        client.sync()
        for step in range(12):
            batch = slice(32 * step, 32 * step + 32)
            for m in (model, reference):
                m.zero_grad()
                torch.nn.functional.mse_loss(m(x[batch]), y[batch]).backward()
            assert client.in_compressed_stage == (step >= 4)
            report = client.push_and_pull({n: p.grad for n, p in model.named_parameters()}, lr=opts["lr"])
            assert report["kind"] == ("update" if step >= 4 else "grad")
            ref_opt.step()
            for (n, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"{n} at step {step}")
        stats = ray.get([s.stats.remote() for s in shards])
        assert all(st["applied_by_kind"] == {"grad": 4, "update": 8} for st in stats)
        # A restarted worker that loads the client state goes on in the compressed stage.
        again = PSClient(model.named_parameters(), shards, codec="none", max_staleness=0, worker_id="w",
                         freeze_step=4)
        again.load_state_dict(client.state_dict())
        assert again.in_compressed_stage and again.compressed_steps == 8
        assert all(torch.equal(again.momentum[n], t) for n, t in client.momentum.items())
    finally:
        _stop(ray, shards)


def test_rapidfire_adamw_1bit_two_workers(ray_cluster):
    ray = ray_cluster
    model = _model()
    eval_data = _data(seed=7)
    initial = _loss(model, eval_data)
    shards, _, _pinned = launch_shards(model.named_parameters(), 2, codec="1bit", codec_opts={"scale": "rms"},
                                      max_staleness=1, optimizer={"lr": 0.03})
    try:
        clients, _ = _train(shards, "1bit", 1, codec_opts={"scale": "rms"}, freeze_step=8)
        stats = ray.get([s.stats.remote() for s in shards])
        for st in stats:
            assert st["applied_by_kind"] == {"grad": 2 * 8, "update": 2 * (STEPS - 8)}
            assert st["staleness_max"] <= 1
        model.load_state_dict(_server_params(ray, shards))
        assert _loss(model, eval_data) < 0.2 * initial
        # Warm-up pushes are float32; compressed pushes 1 bit per element plus scales.
        fp32_per_push = 4 * sum(p.numel() for p in model.parameters())
        for c in clients:
            assert c.in_compressed_stage and c.compressed_steps == STEPS - 8
            assert c.report()["bytes_sent"] < fp32_per_push * (8 + (STEPS - 8) / 4)
    finally:
        _stop(ray, shards)

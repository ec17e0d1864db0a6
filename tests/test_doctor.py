"""`rapidfire doctor` and the NaN checklist (`rapidfire_ray.diagnose`): no Ray cluster is started."""
from __future__ import annotations

import json
import socket

import pytest
import torch
from paths import TINY_PROFILE

from rapidfire_ray import doctor
from rapidfire_ray.config import load_config
from rapidfire_ray.diagnose import Finding, check_config, check_grad_clip, check_token_rows

TINY_VOCAB = 259  # tiny-random: 256 bytes + 3 special tokens


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("RAY_ADDRESS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _codes(findings, severity=None):
    return [f.code for f in findings if severity is None or f.severity == severity]


def test_abnormal_data_and_bad_address(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "What is 2+2?", "completion": "4"},
        {"prompt": "Say nothing", "completion": ""},                # empty completion: bad row
        {"prompt": "Scream", "completion": "A" * 3000},             # one token 3000 times, overlong
        '{"prompt": "broken", ',                                    # invalid JSON: bad row
        {"prompt": "The quick brown fox. " * 30, "completion": "lost"},  # completion beyond max_length
        {"prompt": "Hi", "completion": "Hello there."},
    ])
    rc = doctor.main(["--profile", TINY_PROFILE, "--address", "127.0.0.1:1", "--json",
                      f"data.path={data}", "optimizer.params.lr=1e-3", "train.grad_clip=0"])
    assert rc == 1
    out = json.loads(capsys.readouterr().out)
    findings = [Finding(**f) for f in out["findings"]]
    by_code = {}
    for f in findings:
        by_code.setdefault(f.code, []).append(f)
    assert not out["ok"] and out["errors"] == 1
    assert _codes(findings, "error") == ["cluster_unreachable"]
    assert [f.where for f in by_code["bad_row"]] == ["bad.jsonl:2", "bad.jsonl:4"]
    assert "empty text in 'completion'" in by_code["bad_row"][0].message
    assert "invalid JSON" in by_code["bad_row"][1].message
    (run,) = by_code["token_run"]
    assert run.where == "bad.jsonl:3" and run.severity == "warning" and "repeats" in run.message
    assert "2 of 4 sampled rows are longer than 128 tokens (longest 3007)" in by_code["overlong"][0].message
    assert by_code["nothing_trained"][0].severity == "warning"
    assert "(e.g. bad.jsonl:5)" in by_code["nothing_trained"][0].message
    assert by_code["lr_high"][0].severity == "warning" and "200x" in by_code["lr_high"][0].message
    assert by_code["clip_missing"][0].where == "train.grad_clip"
    assert "127.0.0.1:1" in by_code["cluster_unreachable"][0].where


def test_clean_run_passes_and_prints_one_line_per_finding(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": f"Q{i}?", "completion": f"A{i}."} for i in range(10)])
    rc = doctor.main(["--profile", TINY_PROFILE, "--sample", "5", f"data.path={data}", "optimizer.params.lr=5e-6"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[-1] == "doctor: 0 error(s), 0 warning(s)"
    assert any(line.startswith("info: ") and "5 rows read (0 bad)" in line for line in out)
    assert all(line.split(":")[0] in ("info", "doctor") for line in out)


def test_config_error_is_an_error_finding(capsys):
    assert doctor.main(["--profile", TINY_PROFILE, "train.no_such_key=1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"error: {TINY_PROFILE}: override train.no_such_key=1: unknown key")
    assert doctor.main(["--profile", "/nonexistent.yaml", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["findings"][0]["code"] == "config"


def test_learning_rate_and_clipping_checklist():
    high = check_config(load_config(TINY_PROFILE, ["optimizer.params.lr=1e-3", "train.grad_clip=1.0"]))
    assert _codes(high) == ["lr_high"]
    assert "optimizer.params.lr=5e-06" in high[0].fix
    assert check_config(load_config(TINY_PROFILE, ["optimizer.params.lr=5e-6", "train.grad_clip=0.5"])) == []
    assert _codes(check_config(load_config(TINY_PROFILE, ["optimizer.params.lr=5e-6", "train.grad_clip=0"]))) \
        == ["clip_missing"]
    (wide,) = check_grad_clip(5.0)
    assert wide.code == "clip_range" and wide.fix == "set train.grad_clip=1"
    assert str(wide) == "warning: train.grad_clip: 5 is outside the recommended 0.5-1 -> fix: set train.grad_clip=1"


def test_token_rows_in_a_padded_batch():
    pad = 256
    ids = torch.tensor([
        [5, 6, 7, 8, 9, pad, pad, pad],     # fine
        [3, 999, 4, -1, pad, pad, pad, pad],  # ids outside the vocabulary
        [pad] * 8,                           # all padding
        [65] * 8,                            # a run of 8 (threshold 6 below)
    ])
    mask = (ids != pad).long()
    found = check_token_rows(ids, vocab_size=TINY_VOCAB, attention_mask=mask, max_run=6)
    assert [(f.code, f.where, f.severity) for f in found] == [
        ("token_out_of_vocab", "row 1", "error"), ("empty_row", "row 2", "warning"), ("token_run", "row 3", "warning")]
    assert "-1, 999" in found[0].message and "all padding" in found[1].message
    # without a mask, trailing pad ids are padding; labels all -100 mean nothing to learn
    found = check_token_rows([[1, 2, pad, pad], []], vocab_size=TINY_VOCAB, pad_token_id=pad,
                             labels=[[-100] * 4, []], sources=["a.jsonl:1", "a.jsonl:2"])
    assert [(f.code, f.where) for f in found] == [("nothing_trained", "a.jsonl:1"), ("empty_row", "a.jsonl:2"),
                                                  ("batch_untrained", "batch")]
    assert found[-1].severity == "error" and "NaN" in found[-1].message


def test_interfaces():
    ifaces = ["lo", "eth0", "ib0"]
    assert doctor.check_interfaces(True, {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0"}, ifaces) == []
    assert doctor.check_interfaces(True, {"NCCL_SOCKET_IFNAME": "^lo,docker"}, ifaces) == []
    (bad,) = doctor.check_interfaces(True, {"NCCL_SOCKET_IFNAME": "=eth"}, ifaces)
    assert bad.code == "nccl_ifname" and bad.severity == "error" and "lo, eth0, ib0" in bad.message
    assert doctor.check_interfaces(False, {"NCCL_SOCKET_IFNAME": "enp"}, ifaces)[0].severity == "warning"
    (gloo,) = doctor.check_interfaces(False, {"GLOO_SOCKET_IFNAME": "eth0,eth9"}, ifaces)
    assert gloo.code == "gloo_ifname" and gloo.severity == "error" and gloo.message.startswith("eth9 ")


def test_cluster_auth_and_resources(monkeypatch, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    try:
        assert _codes(doctor.check_cluster_address(address)) == ["auth_mode"]
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        assert _codes(doctor.check_cluster_address(address), "error") == ["auth_token"]
        monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
        assert doctor.check_cluster_address(address) == []
    finally:
        listener.close()
    assert doctor.check_cluster_address("auto") == []
    nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 3.0, "GPU": 4.0}, {"CPU": 16.0}]
    assert doctor.workers_that_fit(nodes, 2, use_gpu=False) == 4 + 1 + 8
    assert doctor.workers_that_fit(nodes, 2, use_gpu=True) == 1 + 1

"""Config schema and validation: every rule and its one-line message."""
from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from rapidfire_ray.config import load_config, to_yaml
from rapidfire_ray.errors import RapidfireError
from paths import TINY_PROFILE as TINY

ARTICLE_YAML = """
optimizer:
  type: adamw
  params:
    lr: 5e-6
    compression:
      grad: none
      act: none
data:
  prefetch_depth: 3
"""


def write(tmp_path, text, name="train_config.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(RapidfireError) as e:
        load_config(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_are_valid_and_documented_keys_exist():
    cfg = load_config()
    for key in ("run.name", "run.output_dir", "run.seed", "model.name", "data.path", "data.format",
                "data.max_length", "train.stage", "train.max_steps", "train.epochs", "train.per_device_batch_size",
                "train.grad_clip", "scaling.num_workers", "scaling.use_gpu", "checkpoint.every_steps",
                "optimizer.type", "optimizer.params.lr", "optimizer.params.compression.grad",
                "optimizer.params.compression.act", "data.prefetch_depth", "data.dynamic_batch.min",
                "data.dynamic_batch.max", "data.dynamic_batch.strategy"):
        parent, _, leaf = key.rpartition(".")
        assert leaf in OmegaConf.select(cfg, parent), key
    assert cfg.train.max_steps == -1 and cfg.train.stage == "sft" and cfg.data.prefetch_depth == 3


def test_article_keys_parse_including_yaml_1_1_exponent(tmp_path):
    cfg = load_config(write(tmp_path, ARTICLE_YAML))
    assert cfg.optimizer.params.lr == pytest.approx(5e-6)  # "5e-6" is a string in YAML 1.1
    assert isinstance(cfg.optimizer.params.lr, float)


def test_overrides_win_over_profile_and_accept_dotted_and_nested(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 3\n")
    cfg = load_config(path, ["train.max_steps=7", "model.name=tiny-random"])
    assert cfg.train.max_steps == 7 and cfg.model.name == "tiny-random"
    cfg = load_config({"train.max_steps": 5, "data": {"max_length": 64}}, {"scaling.num_workers": 3})
    assert (cfg.train.max_steps, cfg.data.max_length, cfg.scaling.num_workers) == (5, 64, 3)


@pytest.mark.parametrize("override, expected", [
    ("run.foo=1", "unknown key 'run.foo'; known keys under 'run': name, output_dir, seed"),
    ("nope.x=1", "unknown key 'nope'"),
    ("train.max_steps=abc", "train.max_steps: 'abc' is not a valid int"),
    ("scaling.use_gpu=maybe", "scaling.use_gpu: 'maybe' is not a valid bool"),
    ("data.format=csv", "data.format: 'csv' is not one of: text, prompt_completion, messages, oasst"),
    ("train.per_device_batch_size=0", "train.per_device_batch_size: 0 is out of range; allowed: >= 1"),
    ("data.prefetch_depth=100", "data.prefetch_depth: 100 is out of range; allowed: between 0 and 64"),
    ("train.max_steps=0", "train.max_steps: 0 is out of range; allowed: -1"),
    ("optimizer.params.lr=2", "optimizer.params.lr: 2.0 is out of range"),
    ("optimizer.params.betas=[0.9]", "optimizer.params.betas: [0.9] is invalid"),
    ("run.name=a/b", "run.name: 'a/b' is invalid"),
    ("data.dynamic_batch.max=8", "data.dynamic_batch.max: only used by a dynamic strategy"),
    ("bad", "override 'bad': expected key=value"),
])
def test_bad_values_name_key_value_and_allowed(override, expected):
    assert expected in error_of(None, [override])


@pytest.mark.parametrize("overrides, expected", [
    (["memory.optim_level=level3", "scaling.num_workers=1"], "meaningless with scaling.num_workers 1"),
    (["scaling.hybrid_parallel=true", "scaling.num_workers=1"], "scaling.hybrid_parallel shards parameters"),
    (["memory.optim_level=level3", "communication.mode=allreduce_compressed",
      "optimizer.params.compression.grad=1bit"], "cannot be combined with communication.mode allreduce_compressed"),
    (["memory.optim_level=level3", "optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit"],
     "cannot be combined with optimizer.type rapidfire_adamw"),
    (["memory.offload_optimizer=true"], "memory.offload_optimizer: only used with ZeRO-3"),
    (["memory.offload_optimizer=true", "memory.optim_level=level3"], "in CPU memory already"),
    (["train.precision=fp8"], "train.precision: fp8 on CPU workers"),
    (["train.precision=fp16"], "train.precision: fp16 on CPU workers"),
    (["optimizer.params.compression.act=int4"], "not one of: none, int8, null"),
])
def test_memory_combinations_that_cannot_work(overrides, expected):
    assert expected in error_of(None, overrides)


def test_memory_levels_resolve():
    from rapidfire_ray.memory.levels import MemoryOptions

    level = {n: MemoryOptions.from_config(load_config(None, [f"memory.optim_level={n}"]))
             for n in ("level0", "level1", "level2", "level3")}
    assert (level["level0"].checkpointing, level["level0"].act, level["level0"].zero_stage) == (False, "none", 0)
    assert (level["level1"].checkpointing, level["level1"].act) == (True, "none")
    assert (level["level2"].act, level["level2"].defragment, level["level2"].zero_stage) == ("int8", True, 0)
    assert level["level3"].zero_stage == 3 and level["level3"].act == "int8"
    explicit = MemoryOptions.from_config(load_config(None, ["memory.optim_level=level2",
                                                            "optimizer.params.compression.act=none"]))
    assert explicit.act == "none" and explicit.checkpointing
    assert "ZeRO-3 within each node" in MemoryOptions.from_config(
        load_config(None, ["scaling.hybrid_parallel=true"])).describe()


def test_token_budget_rules():
    cfg = load_config(None, ["data.dynamic_batch.strategy=token_budget", "data.dynamic_batch.max_tokens=4096"])
    assert cfg.data.dynamic_batch.max_tokens == 4096
    tb = "data.dynamic_batch.strategy=token_budget"
    assert "smaller than one row of data.max_length 512" in error_of(None, [tb, "data.dynamic_batch.max_tokens=100"])
    assert "data.dynamic_batch.min: not used by token_budget" in error_of(None, [tb, "data.dynamic_batch.min=2"])


def test_memory_aware_rules():
    ma = "data.dynamic_batch.strategy=memory_aware"
    cfg = load_config(None, [ma, "data.dynamic_batch.min=2", "data.dynamic_batch.max=16"])
    assert (cfg.data.dynamic_batch.min, cfg.data.dynamic_batch.max, cfg.data.dynamic_batch.memory_threshold) == (2, 16, 0.8)
    assert ("data.dynamic_batch.min: 8 is larger than data.dynamic_batch.max 4; make min <= max"
            in error_of(None, [ma, "data.dynamic_batch.min=8", "data.dynamic_batch.max=4"]))
    for bad in ("0", "0.0", "1.5", "-0.2"):
        assert "data.dynamic_batch.memory_threshold" in error_of(None, [ma, f"data.dynamic_batch.memory_threshold={bad}"])
    assert load_config(None, [ma, "data.dynamic_batch.memory_threshold=1.0"]).data.dynamic_batch.memory_threshold == 1.0
    assert "max_tokens: not used by memory_aware" in error_of(None, [ma, "data.dynamic_batch.max_tokens=4096"])
    assert "only used by a dynamic strategy" in error_of(None, ["data.dynamic_batch.min=2"])


def test_profile_errors(tmp_path):
    assert "not found" in error_of(str(tmp_path / "missing.yaml"))
    assert "line 2: not valid YAML" in error_of(write(tmp_path, "a: [\n"))
    assert "top level must be a mapping" in error_of(write(tmp_path, "- 1\n- 2\n"))
    msg = error_of(write(tmp_path, "train:\n  max_stepz: 3\n"))
    assert msg.startswith(f"{tmp_path / 'train_config.yaml'}: unknown key 'train.max_stepz'")


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["train.max_steps=9"])
    again = load_config(write(tmp_path, to_yaml(cfg)))
    assert again == cfg


def test_cli_config_error_is_one_line_exit_2_before_ray(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile",
                           write(tmp_path, "train:\n  stage: rl\n")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "data.format: 'prompt_completion' cannot feed train.stage rl" in proc.stderr
    assert "Traceback" not in proc.stderr and "ray" not in proc.stdout.lower()


def test_cli_dry_run_and_config_print_resolved_yaml(tmp_path):
    for cmd in (["train", "--profile", write(tmp_path, "run:\n  name: x\n"), "--dry-run", "train.max_steps=4"],
                ["config", "--profile", write(tmp_path, "run:\n  name: x\n"), "train.max_steps=4"]):
        proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", *cmd], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "max_steps: 4" in proc.stdout and "name: x" in proc.stdout


def test_docs_config_reference_is_current():
    import os

    from rapidfire_ray.cli import REFERENCE_HEADER
    from rapidfire_ray.config.schema import reference_markdown

    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                        "config.md")
    with open(docs, encoding="utf-8") as f:
        assert f.read() == REFERENCE_HEADER + reference_markdown(), "run: rapidfire config --reference > docs/config.md"


def test_communication_combinations():
    ok = load_config(None, ["communication.mode=allreduce_compressed", "optimizer.params.compression.grad=1bit"])
    assert ok.communication.mode == "allreduce_compressed"
    assert load_config(None, ["optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit",
                              "optimizer.params.freeze_step=5"]).optimizer.params.freeze_step == 5
    assert "needs communication.mode allreduce_compressed" in error_of(None, ["optimizer.params.compression.grad=2bit"])
    # the article's pairing: with rapidfire_adamw, allreduce_compressed is its compressed momentum exchange
    article = load_config(None, ["optimizer.type=rapidfire_adamw", "optimizer.params.compression.grad=1bit",
                                 "communication.mode=allreduce_compressed"])
    from rapidfire_ray.exchange.factory import build_exchange
    from rapidfire_ray.exchange.onebit_adam import OneBitAdamExchange
    from rapidfire_ray.telemetry.rules import codec_is_live

    plain = OmegaConf.to_container(article, resolve=True)
    assert isinstance(build_exchange(plain["communication"], plain["optimizer"], rank=0, total_steps=10),
                      OneBitAdamExchange)
    assert not codec_is_live("allreduce_compressed", "1bit", "rapidfire_adamw")
    assert "leaves rapidfire_adamw nothing to compress" in error_of(None, ["optimizer.type=rapidfire_adamw"])
    assert load_config(None, ["communication.mode=parameter_server"]).communication.ps.max_staleness == 2
    assert "communication.on_nonfinite: 'warn' is not one of: skip, fail" in error_of(
        None, ["communication.on_nonfinite=warn"])


def test_cli_communication_flag_sets_the_mode(capsys):
    from rapidfire_ray.cli import main

    assert main(["train", "--profile", TINY, "--communication", "allreduce_compressed", "--dry-run",
                 "optimizer.params.compression.grad=1bit"]) == 0
    assert "mode: allreduce_compressed" in capsys.readouterr().out


def test_from_plain_rebuilds_the_typed_read_only_config_a_worker_gets():
    import glob
    import os

    from omegaconf.errors import ReadonlyConfigError

    from paths import REPO
    from rapidfire_ray.config import from_plain, worker_range

    from rapidfire_ray.experiments import load_experiment

    for path in sorted(glob.glob(os.path.join(REPO, "jobs", "configs", "*.yaml"))):
        if os.path.basename(path).startswith("experiment_"):  # an experiment profile: every config it expands to
            assert all(c.error is None for c in load_experiment(path).candidates), path
            with pytest.raises(RapidfireError, match="has an experiment section.*rapidfire experiment --profile"):
                load_config(path)
            continue
        cfg = load_config(path)
        again = from_plain(OmegaConf.to_container(cfg, resolve=True))
        assert again == cfg and OmegaConf.get_type(again.train).__name__ == "TrainSection", path
    elastic = load_config(None, ["scaling.num_workers=[1,4]"])
    again = from_plain(OmegaConf.to_container(elastic, resolve=True))
    assert worker_range(again) == (1, 4) and again.optimizer.params.lr == pytest.approx(2e-5)
    with pytest.raises(ReadonlyConfigError):
        again.train.max_steps = 3
    # The rules are not run again (the driver validated), but types still are, in one line.
    assert from_plain({"train": {"stage": "rl"}}).data.format == "prompt_completion"
    with pytest.raises(RapidfireError, match="plain config: train.max_steps: 'x' is not a valid int"):
        from_plain({"train": {"max_steps": "x"}})

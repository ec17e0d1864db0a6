"""Load, override and validate a run's config before anything expensive (Ray) starts.

Sources, later ones winning: the schema's defaults, the profile YAML, `key=value` overrides.
Every problem is a `RapidfireError` with one line naming the key path, the bad value and what
is allowed.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable, Mapping, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from ..errors import RapidfireError
from .schema import CHOICES, RANGES, RapidfireConfig

ProfileLike = Union[str, os.PathLike, Mapping[str, Any], DictConfig, None]


def load_config(profile: ProfileLike = None, overrides: Iterable[str] | Mapping[str, Any] = ()) -> DictConfig:
    """Return the validated, typed config. `profile` is a YAML path, a mapping or None (defaults);
    `overrides` are `key=value` strings (CLI) or a {dotted.key: value} mapping (Python API)."""
    cfg = OmegaConf.structured(RapidfireConfig)
    where = "defaults"
    if profile is not None:
        if isinstance(profile, (str, os.PathLike)):
            where = str(profile)
            _merge(cfg, _read_yaml(where), where)
        else:
            where = "the config mapping"
            data = OmegaConf.to_container(profile) if isinstance(profile, DictConfig) else dict(profile)
            _merge(cfg, _nest(data, where), where)
    if overrides:
        items = overrides.items() if isinstance(overrides, Mapping) else parse_overrides(overrides)
        for key, value in items:
            _merge(cfg, _nest({key: value}, "override"), f"override {key}={value!r}")
    validate(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    from ..secrets import redact_text  # a secret from the environment is never printed or written

    return redact_text(OmegaConf.to_yaml(cfg, resolve=True))


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise RapidfireError(f"profile '{path}' not found; pass --profile PATH to a train_config.yaml "
                             "(examples in jobs/configs/)")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise RapidfireError(f"profile '{path}'{at}: not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError:
        raise RapidfireError(f"profile '{path}': not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RapidfireError(f"profile '{path}': the top level must be a mapping of sections "
                             f"(run, model, data, train, ...), got {type(data).__name__}")
    return data


def parse_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """`key=value` strings -> (key, value) with the value read as YAML (numbers, lists, null)."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise RapidfireError(f"override '{item}': expected key=value, e.g. train.max_steps=10")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def _nest(data: Mapping[str, Any], where: str) -> dict:
    """Expand dotted keys ({"a.b": 1} -> {"a": {"b": 1}}) so YAML and overrides may use either."""
    out: dict = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise RapidfireError(f"{where}: key {key!r} must be a string")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RapidfireError(f"{where}: key '{key}' conflicts with a value set for '{p}'")
        last = parts[-1]
        if isinstance(value, Mapping):
            value = _nest(value, where)
            if isinstance(node.get(last), dict):
                node[last].update(value)
                continue
        node[last] = value
    return out


def _merge(cfg: DictConfig, data: dict, where: str) -> None:
    try:
        cfg.merge_with(data)
    except ConfigKeyError as e:
        key = e.full_key or e.key
        parent = str(key).rpartition(".")[0]
        raise RapidfireError(f"{where}: unknown key '{key}'; known keys{_under(parent)}: "
                             f"{', '.join(_known_keys(parent))}") from None
    except ValidationError as e:
        key = e.full_key or e.key
        expected = _expected_type(str(key))
        raise RapidfireError(f"{where}: {key}: {_show(e.value)} is not a valid {expected}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise RapidfireError(f"{where}: {key}: {str(e).splitlines()[0]}") from None


def _under(parent: str) -> str:
    return f" under '{parent}'" if parent else ""


def _section_type(path: str):
    t = RapidfireConfig
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f for f in dataclasses.fields(t)}
        if part not in fields or not dataclasses.is_dataclass(fields[part].default_factory()
                                                              if fields[part].default_factory is not dataclasses.MISSING
                                                              else None):
            return None
        t = type(fields[part].default_factory())
    return t


def _known_keys(parent: str) -> list[str]:
    t = _section_type(parent)
    return [f.name for f in dataclasses.fields(t)] if t else []


def _expected_type(key: str) -> str:
    parent, _, name = key.rpartition(".")
    t = _section_type(parent)
    if t is None:
        return "value"
    hint = {f.name: f.type for f in dataclasses.fields(t)}.get(name, "value")
    return str(hint).replace("Optional[int]", "integer or null").replace("List[float]", "list of numbers")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _listed(values) -> str:
    return ", ".join("null" if v is None else str(v) for v in values)


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key)


def worker_range(cfg) -> tuple[int, int]:
    """(min, max) workers of a validated config: `scaling.num_workers` n is (n, n)."""
    n = cfg["scaling"]["num_workers"]
    if isinstance(n, int):
        return n, n
    return int(n[0]), int(n[1])


def is_elastic(cfg) -> bool:
    lo, hi = worker_range(cfg)
    return lo != hi


def validate(cfg: DictConfig) -> None:
    """Check choices, ranges and cross-key rules; raise RapidfireError on the first problem."""
    _check_scaling(cfg)
    if cfg.monitor.adjust == "False":  # YAML reads a bare `off` as false
        cfg.monitor.adjust = "off"
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise RapidfireError(f"{key}: {_show(value)} is not one of: {_listed(allowed)}")
    for key, (low, high) in RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        if value < low or (high is not None and value > high):
            allowed = f">= {low}" if high is None else f"between {low} and {high}"
            raise RapidfireError(f"{key}: {_show(value)} is out of range; allowed: {allowed}")
    steps = cfg.train.max_steps
    if steps != -1 and steps < 1:
        raise RapidfireError(f"train.max_steps: {steps} is out of range; allowed: -1 (run train.epochs "
                             "epochs) or >= 1")
    betas = list(cfg.optimizer.params.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise RapidfireError(f"optimizer.params.betas: {betas} is invalid; allowed: two numbers in [0, 1), "
                             "e.g. [0.9, 0.999]")
    db = cfg.data.dynamic_batch
    if db.strategy == "fixed":
        for key in ("min", "max", "max_tokens"):
            if db[key] is not None:
                raise RapidfireError(f"data.dynamic_batch.{key}: only used by a dynamic strategy (token_budget, "
                                     "memory_aware); remove it with strategy 'fixed' (the batch is "
                                     "train.per_device_batch_size rows)")
    if db.strategy == "token_budget" and db.min is not None:
        raise RapidfireError("data.dynamic_batch.min: not used by token_budget (the budget sets the batch); "
                             "remove it, or cap rows with data.dynamic_batch.max")
    if db.strategy == "memory_aware" and db.max_tokens is not None:
        raise RapidfireError("data.dynamic_batch.max_tokens: not used by memory_aware (free memory sets the "
                             "batch); remove it, or use strategy token_budget")
    if db.min is not None and db.max is not None and db.min > db.max:
        raise RapidfireError(f"data.dynamic_batch.min: {db.min} is larger than data.dynamic_batch.max {db.max}; "
                             "make min <= max")
    if db.memory_threshold <= 0.0:
        raise RapidfireError(f"data.dynamic_batch.memory_threshold: {db.memory_threshold} is out of range; "
                             "allowed: above 0 and at most 1 (e.g. 0.8)")
    if db.max_tokens is not None and db.max_tokens < cfg.data.max_length:
        raise RapidfireError(f"data.dynamic_batch.max_tokens: {db.max_tokens} is smaller than one row of "
                             f"data.max_length {cfg.data.max_length} tokens; raise it to >= {cfg.data.max_length}")
    _check_communication(cfg)
    _check_memory(cfg)
    _check_monitor(cfg)
    _check_worker_resources(cfg)
    _check_rl(cfg)
    _check_reward(cfg)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", cfg.run.name):
        raise RapidfireError(f"run.name: {_show(cfg.run.name)} is invalid; allowed: letters, digits, '.', "
                             "'_', '-' (it names a folder), at most 100 characters")
    if not cfg.model.name.strip():
        raise RapidfireError("model.name: '' is empty; use smollm2-135m, tiny-random, a local model "
                             "directory or a Hugging Face id")
    if not cfg.data.path.strip():
        raise RapidfireError("data.path: '' is empty; point it at a .jsonl/.parquet file or a folder")


def _check_scaling(cfg: DictConfig) -> None:
    """scaling.num_workers: a count, or [min, max] for an elastic run (and what elastic runs exclude)."""
    n = cfg.scaling.num_workers
    if isinstance(n, bool) or not (isinstance(n, int) or (OmegaConf.is_list(n) or isinstance(n, (list, tuple)))):
        raise RapidfireError(f"scaling.num_workers: {_show(n)} is invalid; allowed: a number of workers >= 1, "
                             "or [min, max] for an elastic run (e.g. [1, 4])")
    if isinstance(n, int):
        if n < 1:
            raise RapidfireError(f"scaling.num_workers: {n} is out of range; allowed: >= 1")
        return
    n = list(n)
    if len(n) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in n) or not 1 <= n[0] <= n[1]:
        raise RapidfireError(f"scaling.num_workers: {n} is invalid; allowed: [min, max] with 1 <= min <= max "
                             "(e.g. [1, 4]), or one number for a fixed worker count")
    if n[0] == n[1]:
        cfg.scaling.num_workers = n[0]
        return
    cfg.scaling.num_workers = n  # a plain list, whatever node type the merge made
    why = None
    if cfg.train.stage in ("rl", "pipeline"):
        why = (f"train.stage {cfg.train.stage} runs its policy workers with a fixed count; use an elastic "
               "scaling.num_workers for the sft and reward stages, one number here")
    elif cfg.communication.mode == "parameter_server":
        why = "communication.mode parameter_server keeps per-worker push state on its shards; use allreduce or " \
              "allreduce_compressed, or one number of workers"
    elif cfg.optimizer.type == "rapidfire_adamw":
        why = "rapidfire_adamw's error-feedback buffers are laid out for one worker count; use optimizer.type " \
              "adamw (with communication.mode allreduce_compressed to compress), or one number of workers"
    elif cfg.memory.optim_level == "level3" or cfg.scaling.hybrid_parallel:
        why = "ZeRO-3 checkpoints are partitioned per worker and load only into the same count; use " \
              "memory.optim_level level2 or lower, or one number of workers"
    elif cfg.train.max_steps == -1 and float(cfg.train.epochs) != int(cfg.train.epochs):
        why = f"elastic runs count whole epochs (train.epochs {cfg.train.epochs}); use a whole number of epochs " \
              "or train.max_steps"
    if why:
        raise RapidfireError(f"scaling.num_workers: {n} (elastic): {why}")


def _check_communication(cfg: DictConfig) -> None:
    """Which optimizer, codec and communication mode go together."""
    grad, mode, optimizer = cfg.optimizer.params.compression.grad, cfg.communication.mode, cfg.optimizer.type
    if mode == "parameter_server":
        if optimizer == "rapidfire_adamw" and grad == "none":
            raise RapidfireError("optimizer.params.compression.grad: 'none' leaves rapidfire_adamw nothing to "
                                 "compress in the pushes; set it to 1bit (or 2bit, fp16), or use optimizer.type adamw")
        if grad == "auto":
            raise RapidfireError("optimizer.params.compression.grad: 'auto' chooses per tensor inside the compressed "
                                 "allreduce; communication.mode parameter_server uses one codec for every tensor: "
                                 "use none, fp16, 1bit or 2bit")
        return
    if optimizer == "rapidfire_adamw":
        if mode != "allreduce":
            raise RapidfireError(f"communication.mode: {_show(mode)} cannot be combined with optimizer.type "
                                 "rapidfire_adamw (it exchanges compressed momentum itself, after a full-precision "
                                 "warm-up); use communication.mode allreduce")
        if grad == "none":
            raise RapidfireError("optimizer.params.compression.grad: 'none' leaves rapidfire_adamw nothing to "
                                 "compress; set it to 1bit (the 1-bit Adam variant), 2bit or fp16, or use "
                                 "optimizer.type adamw")
        if grad == "auto":
            raise RapidfireError("optimizer.params.compression.grad: 'auto' chooses per gradient tensor and is not "
                                 "available for rapidfire_adamw's momentum; use 1bit, 2bit or fp16")
    elif grad != "none" and mode == "allreduce":
        raise RapidfireError(f"optimizer.params.compression.grad: {_show(grad)} needs communication.mode "
                             "allreduce_compressed (plain allreduce sends fp32); set communication.mode="
                             "allreduce_compressed, or optimizer.type=rapidfire_adamw to compress momentum")


def _check_memory(cfg: DictConfig) -> None:
    """Memory level, sharding and precision combinations that cannot work."""
    level, workers, mem = cfg.memory.optim_level, worker_range(cfg)[0], cfg.memory
    sharded = level == "level3" or cfg.scaling.hybrid_parallel
    what = "scaling.hybrid_parallel" if cfg.scaling.hybrid_parallel else "memory.optim_level: level3"
    if sharded and workers < 2:
        raise RapidfireError(f"{what} shards parameters across workers, which is meaningless with "
                             "scaling.num_workers 1; use memory.optim_level level2, or 2 or more workers")
    if sharded and cfg.communication.mode == "parameter_server":
        raise RapidfireError(f"{what}: ZeRO-3 shards parameters across the workers, and communication.mode "
                             "parameter_server keeps them on its shard actors instead; choose one: "
                             "memory.optim_level level2 (or lower) with parameter_server, or communication.mode "
                             "allreduce with ZeRO-3")
    if sharded and (cfg.communication.mode != "allreduce" or cfg.optimizer.type == "rapidfire_adamw"):
        chosen = (f"communication.mode {cfg.communication.mode}" if cfg.communication.mode != "allreduce"
                  else "optimizer.type rapidfire_adamw")
        raise RapidfireError(f"{what}: ZeRO-3 exchanges gradients inside DeepSpeed (reduce-scatter), so it cannot "
                             f"be combined with {chosen}; use communication.mode allreduce with optimizer.type "
                             "adamw, or memory.optim_level level2")
    if mem.offload_optimizer and not sharded:
        raise RapidfireError("memory.offload_optimizer: only used with ZeRO-3 (memory.optim_level level3 or "
                             "scaling.hybrid_parallel); set memory.optim_level=level3 or remove it")
    if mem.offload_optimizer and not cfg.scaling.use_gpu:
        raise RapidfireError("memory.offload_optimizer: the workers are CPU workers (scaling.use_gpu false), so "
                             "their optimizer state is in CPU memory already; remove it")
    precision = cfg.train.precision
    if not cfg.scaling.use_gpu and precision in ("fp16", "fp8"):
        why = "fp8 needs an NVIDIA GPU with compute capability 8.9+ (H100, H200, L40S)" if precision == "fp8" \
            else "fp16 needs a CUDA GPU (its loss scaling and kernels are GPU-only)"
        raise RapidfireError(f"train.precision: {precision} on CPU workers (scaling.use_gpu false): {why}; "
                             "use bf16 or fp32, or scaling.use_gpu=true on a GPU cluster")


def _check_rl(cfg: DictConfig) -> None:
    """The RL stage's keys (train.stage rl) and the prompt format that feeds it."""
    rl, stage, fmt = cfg.rl, cfg.train.stage, cfg.data.format
    if stage != "rl":
        if fmt == "prompt":
            raise RapidfireError(f"data.format: 'prompt' rows (prompts without completions) only feed train.stage rl; "
                                 f"set train.stage=rl, or use prompt_completion/messages rows for {stage}")
        return
    if fmt != "prompt":
        raise RapidfireError(f"data.format: {_show(fmt)} cannot feed train.stage rl, which samples its own completions; "
                             "set data.format=prompt (rows with `prompt` and columns such as `answer`)")
    from ..rl.rules import RULES  # noqa: PLC0415 - the rule names live with the rules

    for name in rl.reward.functions:
        if name not in RULES:
            raise RapidfireError(f"rl.reward.functions: unknown reward function {_show(name)}; built-in: "
                                 f"{', '.join(RULES)}")
    if rl.reward.model is None and not rl.reward.functions:
        raise RapidfireError("rl.reward: no reward: set rl.reward.model to a sequence-classification checkpoint "
                             "and/or rl.reward.functions (e.g. [answer_match])")
    for name in rl.reward.weights:
        if name != "model" and name not in rl.reward.functions:
            raise RapidfireError(f"rl.reward.weights: {_show(name)} names no reward; use 'model' or one of "
                                 f"rl.reward.functions ({_listed(rl.reward.functions) or 'none'})")
    workers_batch = cfg.train.per_device_batch_size
    if workers_batch % rl.num_generations:
        raise RapidfireError(f"train.per_device_batch_size: {workers_batch} completions per worker is not a multiple "
                             f"of rl.num_generations {rl.num_generations} (each worker samples whole groups); "
                             f"use {max(1, workers_batch // rl.num_generations) * rl.num_generations}")
    if rl.algorithm in ("grpo", "rloo") and rl.num_generations < 2:
        raise RapidfireError(f"rl.num_generations: {rl.algorithm} compares the completions of one prompt, so it "
                             "needs at least 2; set rl.num_generations=4 (or use rl.algorithm=ppo)")
    budget = cfg.data.max_length - rl.max_new_tokens
    if budget < 8:
        raise RapidfireError(f"rl.max_new_tokens: {rl.max_new_tokens} leaves {budget} tokens of data.max_length "
                             f"{cfg.data.max_length} for the prompt; raise data.max_length or lower rl.max_new_tokens")
    if rl.algorithm == "ppo":
        if workers_batch % rl.ppo.minibatch_size:
            raise RapidfireError(f"rl.ppo.minibatch_size: {rl.ppo.minibatch_size} does not divide "
                                 f"train.per_device_batch_size {workers_batch} (the rollout batch per worker)")
        if cfg.train.gradient_accumulation_steps != 1:
            raise RapidfireError("train.gradient_accumulation_steps: ppo updates on rl.ppo.minibatch_size minibatches "
                                 "of each rollout; leave gradient_accumulation_steps at 1")
        if rl.ppo.value_init == "reward" and rl.reward.model is None:
            raise RapidfireError("rl.ppo.value_init: 'reward' needs rl.reward.model; set it, or value_init=policy")
    unsupported = [(cfg.communication.mode != "allreduce", f"communication.mode {cfg.communication.mode}"),
                   (cfg.optimizer.type != "adamw", f"optimizer.type {cfg.optimizer.type}"),
                   (cfg.memory.optim_level != "level0", f"memory.optim_level {cfg.memory.optim_level}"),
                   (cfg.scaling.hybrid_parallel, "scaling.hybrid_parallel"),
                   (cfg.data.dynamic_batch.strategy != "fixed", f"data.dynamic_batch.strategy "
                                                                f"{cfg.data.dynamic_batch.strategy}")]
    for bad, what in unsupported:
        if bad:
            raise RapidfireError(f"{what}: train.stage rl runs with plain DDP allreduce, adamw, memory level0 and fixed "
                                 "batches in this release; remove it for the RL stage")


def _check_reward(cfg: DictConfig) -> None:
    """The reward stage (train.stage reward) and the preference pairs that feed it."""
    stage, fmt, d = cfg.train.stage, cfg.data.format, cfg.data
    if stage == "reward" and fmt != "preference":
        raise RapidfireError(f"data.format: {_show(fmt)} cannot feed train.stage reward, which learns from pairs; "
                             "set data.format=preference (rows with prompt, chosen, rejected)")
    if fmt == "preference" and stage != "reward":
        raise RapidfireError(f"data.format: 'preference' pairs only feed train.stage reward; set train.stage=reward, "
                             f"or use prompt_completion/messages rows for {stage}")
    if d.eval_path is not None:
        if stage != "reward":
            raise RapidfireError(f"data.eval_path: only used by train.stage reward (held-out pairs scored after "
                                 f"training); remove it for train.stage {stage}")
        if not d.eval_path.strip():
            raise RapidfireError(f"data.eval_path: {_show(d.eval_path)} is empty; point it at a .jsonl/.parquet file "
                                 "of held-out pairs, or set it to null")
    max_tokens = d.dynamic_batch.max_tokens
    if fmt == "preference" and max_tokens is not None and max_tokens < 2 * d.max_length:
        raise RapidfireError(f"data.dynamic_batch.max_tokens: {max_tokens} cannot hold one preference pair (two rows "
                             f"of up to data.max_length {d.max_length} tokens); raise it to >= {2 * d.max_length}")


def _check_worker_resources(cfg: DictConfig) -> None:
    """scaling.resources_per_worker: extra Ray resources; CPUs and the GPU switch have their own keys."""
    for name, amount in cfg.scaling.resources_per_worker.items():
        key = f"scaling.resources_per_worker.{name}"
        if name == "CPU":
            raise RapidfireError(f"{key}: set CPUs with scaling.cpus_per_worker (it is also the workers' torch "
                                 "thread count); remove CPU here")
        if name == "GPU" and not cfg.scaling.use_gpu:
            raise RapidfireError(f"{key}: {amount:g} GPUs per worker need scaling.use_gpu=true (the workers run on "
                                 "CPU otherwise); set it, or remove GPU here")
        if not (amount > 0 and amount < float("inf")):
            raise RapidfireError(f"{key}: {amount} is out of range; allowed: a number above 0 (e.g. 1, or 0.5 to "
                                 "share one between two workers)")


def _check_monitor(cfg: DictConfig) -> None:
    """monitor.allowed names live knobs only."""
    from ..telemetry.rules import KNOBS  # noqa: PLC0415 - the knobs live with the rules

    for knob in cfg.monitor.allowed:
        if knob not in KNOBS:
            raise RapidfireError(f"monitor.allowed: {_show(knob)} is not a knob a live run can change; use some of: "
                                 f"{', '.join(KNOBS)} (the parameter server's staleness bound is fixed per run)")

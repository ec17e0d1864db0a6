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
from .schema import CHOICES, PLANNED_IN, RANGES, RapidfireConfig

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
    return OmegaConf.to_yaml(cfg, resolve=True)


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


def validate(cfg: DictConfig) -> None:
    """Check choices, ranges and cross-key rules; raise RapidfireError on the first problem."""
    for key, (now, later) in CHOICES.items():
        value = _get(cfg, key)
        if value in now:
            continue
        if value in later:
            raise RapidfireError(f"{key}: {_show(value)} is not available yet (it comes with "
                                 f"{PLANNED_IN[key]}); use one of: {_listed(now)}")
        raise RapidfireError(f"{key}: {_show(value)} is not one of: {_listed(now + later)}")
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
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", cfg.run.name):
        raise RapidfireError(f"run.name: {_show(cfg.run.name)} is invalid; allowed: letters, digits, '.', "
                             "'_', '-' (it names a folder), at most 100 characters")
    if not cfg.model.name.strip():
        raise RapidfireError("model.name: '' is empty; use smollm2-135m, tiny-random, a local model "
                             "directory or a Hugging Face id")
    if not cfg.data.path.strip():
        raise RapidfireError("data.path: '' is empty; point it at a .jsonl/.parquet file or a folder")


def _check_communication(cfg: DictConfig) -> None:
    """Which optimizer, codec and communication mode go together."""
    grad, mode, optimizer = cfg.optimizer.params.compression.grad, cfg.communication.mode, cfg.optimizer.type
    if mode == "parameter_server":
        if optimizer == "rapidfire_adamw":
            raise RapidfireError("optimizer.type: rapidfire_adamw exchanges compressed momentum by allreduce, and "
                                 "communication.mode parameter_server has no allreduce (its shards run AdamW on the "
                                 "pushed gradients); use optimizer.type adamw with optimizer.params.compression.grad "
                                 "1bit to compress the pushes and pulls")
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
    level, workers, mem = cfg.memory.optim_level, cfg.scaling.num_workers, cfg.memory
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

"""Load, override and validate a run's config before anything expensive (Ray) starts.

Sources, later ones winning: the schema's defaults, the profile YAML, `key=value` overrides.
Every problem is a `RapidfireError` with one line naming the key path, the bad value and what
is allowed.
"""
from __future__ import annotations

import os
from dataclasses import fields
from typing import Any, Iterable, Mapping, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from ..errors import RapidfireError
from .rules import cross_checks
from .schema import RapidfireConfig, listed, show, subsection

ProfileLike = Union[str, os.PathLike, Mapping[str, Any], DictConfig, None]


def load_config(profile: ProfileLike = None, overrides: Iterable[str] | Mapping[str, Any] = ()) -> DictConfig:
    """Return the validated, typed config. `profile` is a YAML path, a mapping or None (defaults);
    `overrides` are `key=value` strings (CLI) or a {dotted.key: value} mapping (Python API)."""
    cfg = OmegaConf.structured(RapidfireConfig)
    where = "defaults"
    if profile is not None:
        if isinstance(profile, (str, os.PathLike)):
            where = str(profile)
            data = _read_yaml(where)
            if "experiment" in data:
                raise RapidfireError(f"profile '{where}' has an experiment section (many configs); run it with "
                                     f"rapidfire experiment --profile {where}")
            _merge(cfg, data, where)
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
        raise RapidfireError(f"{where}: {key}: {show(e.value)} is not a valid {expected}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise RapidfireError(f"{where}: {key}: {str(e).splitlines()[0]}") from None


def _under(parent: str) -> str:
    return f" under '{parent}'" if parent else ""


def _section_type(path: str) -> type | None:
    t = RapidfireConfig
    for part in [p for p in path.split(".") if p]:
        f = {f.name: f for f in fields(t)}.get(part)
        t = subsection(f) if f is not None else None
        if t is None:
            return None
    return t


def _known_keys(parent: str) -> list[str]:
    t = _section_type(parent)
    return [f.name for f in fields(t)] if t else []


def _expected_type(key: str) -> str:
    parent, _, name = key.rpartition(".")
    t = _section_type(parent)
    if t is None:
        return "value"
    hint = {f.name: f.type for f in fields(t)}.get(name, "value")
    return str(hint).replace("Optional[int]", "integer or null").replace("List[float]", "list of numbers")


def validate(cfg: DictConfig) -> None:
    """Check each key against its field's choices and range, then each section's `check()`, then the
    rules across sections (`rules.cross_checks`); raise RapidfireError on the first problem."""
    if cfg.monitor.adjust == "False":  # YAML reads a bare `off` as false
        cfg.monitor.adjust = "off"
    _check_section(cfg, RapidfireConfig, "")
    cross_checks(cfg)


def _check_section(node: DictConfig, cls: type, prefix: str) -> None:
    for f in fields(cls):
        key, value = f"{prefix}{f.name}", node[f.name]
        if subsection(f):
            if value is not None:  # an optional section (model.lora) is off when null
                _check_section(value, subsection(f), f"{key}.")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            raise RapidfireError(f"{key}: {show(value)} is not one of: {listed(f.metadata['choices'])}")
        elif "range" in f.metadata and value is not None:
            low, high = f.metadata["range"]
            if value < low or (high is not None and value > high):
                allowed = f">= {low}" if high is None else f"between {low} and {high}"
                raise RapidfireError(f"{key}: {show(value)} is out of range; allowed: {allowed}")
    if hasattr(cls, "check"):
        cls.check(node)  # the section's own rules, run on its DictConfig node


def from_plain(data: Mapping[str, Any]) -> DictConfig:
    """The typed, read-only config back from the plain dict a driver hands its Ray workers
    (`OmegaConf.to_container(cfg, resolve=True)` of a validated config); the rules are not run again."""
    cfg = OmegaConf.structured(RapidfireConfig)
    _merge(cfg, dict(data), "plain config")
    OmegaConf.set_readonly(cfg, True)
    return cfg

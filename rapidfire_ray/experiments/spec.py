"""An experiment profile: a base config (the usual sections) plus an `experiment` section, and the
configs it expands to.

`experiment.search` maps config keys to a list (grid values) or a range `{low, high, log, int}`
(sampled). Without `num_samples` the search is the full grid (ranges refused); with it, every
sample draws each key (a list uniformly, a range uniformly or log-uniformly), seeded. Every
expanded config is validated on its own with the project's loader: a bad one is reported and
marked failed, the others run.
"""
from __future__ import annotations

import itertools
import math
import os
import random
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..config import load_config
# The config loader's own YAML reading, override parsing and per-key checks (choices, ranges):
# the experiment section is validated exactly like the rest of the config.
from ..config.load import _check_section, _known_keys, _nest, _read_yaml, _section_type, parse_overrides
from ..config.schema import field, section, show
from ..errors import RapidfireError

# Every config trains the same tokenised chunks and shares one base model per slot.
FIXED_PREFIXES = ("data.", "model.name", "train.stage", "run.", "experiment.", "scaling.")


@dataclass
class SlotResources:
    cpus: float = field(1.0, "CPUs each worker of a training slot reserves (also its torch thread count)",
                        range=(0.01, None))
    gpus: float = field(0.0, "GPUs each worker of a training slot reserves (0: CPU)", range=(0.0, None))
    workers: int = field(1, "processes one slot trains a config with (data parallel: a step's rows dealt "
                            "to them, gradients summed; a step is per_device_batch_size x accumulation "
                            "x workers rows)", range=(1, None))


@dataclass
class ExperimentSection:
    search: Dict[str, Any] = field({}, "config keys to vary: a list (grid values) or {low, high, log, int} "
                                       "(a range, sampled; needs num_samples)")
    num_samples: Optional[int] = field(None, "null: the full grid of the lists; N: N configs sampled from the "
                                             "lists and ranges", range=(1, None))
    seed: Optional[int] = field(None, "seed of the sampling (null: run.seed)", range=(0, 2**32 - 1))
    num_chunks: int = field(4, "chunks the training rows are cut into; configs are evaluated and compared "
                               "after each", range=(1, None))
    rows: Optional[int] = field(None, "training rows used, the first in the seeded order (null: all but the "
                                      "held-out ones)", range=(1, None))
    eval_path: Optional[str] = field(None, "held-out file in data.format (null: the last eval_rows rows of "
                                           "data.path, kept out of training)")
    eval_rows: int = field(64, "held-out rows taken from data.path when eval_path is null", range=(1, None))
    metric: str = field("eval_loss", "what every config is scored on at each chunk boundary (lower is better)",
                        choices=("eval_loss", "perplexity"))
    policy: str = field("none", "none: every config trains every chunk; successive_halving: at each boundary "
                                "from min_chunks on keep the best 1/eta, stop the rest; pbt: at each boundary "
                                "from min_chunks on replace the worst quantile by warm clones of the best with "
                                "perturbed values",
                        choices=("none", "successive_halving", "pbt"))
    eta: int = field(2, "successive_halving: keep the best max(1, n // eta) configs at each boundary",
                     range=(2, None))
    min_chunks: int = field(1, "successive_halving, pbt: chunks every config trains before the first decision",
                            range=(1, None))
    quantile: float = field(0.25, "pbt: share of the configs replaced at each boundary (ceil(quantile * n), at "
                                  "most n // 2)", range=(0.01, 0.5))
    perturb_factors: List[float] = field([0.8, 1.2], "pbt: a searched range's value is multiplied by one of these "
                                                     "(kept inside low..high); a searched list's moves to a "
                                                     "neighbouring entry")
    num_slots: Optional[int] = field(None, "training slots (one process each, keeping the base model loaded; "
                                           "null: as many as the cluster's CPUs/GPUs hold, at most one per "
                                           "config, or per co_batch configs)", range=(1, None))
    co_batch: int = field(1, "LoRA configs one slot trains at once, in one forward/backward pass over the same "
                             "rows (each row routed to its own config's adapter); configs share a pass when "
                             "they differ only in LoRA r/alpha/dropout, optimizer values, LR schedule, grad "
                             "clipping and seed", range=(1, None))
    tracking: str = field("auto", "each config as an MLflow run (MLFLOW_TRACKING_URI, else mlflow.db in the "
                                  "experiment folder); auto: when MLflow is installed", choices=("auto", "mlflow", "none"))
    resources: SlotResources = section(SlotResources)


@dataclass
class Candidate:
    """One expanded config: its id, the searched values, and its validated config or why it failed."""
    id: str
    values: dict
    cfg: Any = None  # DictConfig when valid
    error: Optional[str] = None
    parent: Optional[str] = None


@dataclass
class Experiment:
    name: str
    folder: str
    spec: Any  # the validated ExperimentSection (DictConfig)
    base: dict  # the base config, plain (no experiment section)
    candidates: list


def read_profile(profile: Any, overrides=()) -> tuple[dict, dict]:
    """(base config mapping, experiment mapping) from a YAML path or mapping plus key=value overrides."""
    if isinstance(profile, (str, os.PathLike)):
        data = _read_yaml(str(profile))
    else:
        data = dict(profile or {})
    exp = data.pop("experiment", None)  # before nesting: search keys stay dotted
    for key in [k for k in data if isinstance(k, str) and k.startswith("experiment.")]:
        exp = exp if isinstance(exp, dict) else {}
        _nest_into(exp, key[len("experiment."):], data.pop(key))
    data = _nest(data, "profile")
    if exp is None:
        raise RapidfireError(f"profile {show(str(profile))}: no 'experiment' section; add one with experiment.search "
                             "(see jobs/configs/experiment_tiny.yaml), or run it with rapidfire train")
    if not isinstance(exp, Mapping):
        raise RapidfireError(f"experiment: {show(exp)} must be a mapping of keys (search, num_chunks, ...)")
    items = overrides.items() if isinstance(overrides, Mapping) else parse_overrides(overrides)
    base_over = {}
    for key, value in items:
        if key.startswith("experiment."):
            _nest_into(exp, key[len("experiment."):], value)
        else:
            base_over[key] = value
    exp = dict(exp)
    if isinstance(exp.get("search"), Mapping):
        exp["search"] = flat_search(exp["search"])
    return _merge_plain(data, base_over), exp


def flat_search(search: Mapping, prefix: str = "") -> dict:
    """{optimizer: {params: {lr: [..]}}} and {optimizer.params.lr: [..]} alike -> dotted keys
    (a mapping with low/high is a range, not a section)."""
    out = {}
    for key, value in search.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not ({"low", "high"} & set(value)):
            out.update(flat_search(value, f"{name}."))
        else:
            out[name] = value
    return out


def _nest_into(node: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    if parents and parents[0] == "search":  # a search key is itself dotted: experiment.search.optimizer.params.lr
        node.setdefault("search", {})[".".join(parents[1:] + [last])] = value
        return
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def _merge_plain(data: dict, overrides: dict) -> dict:
    out = OmegaConf.create(data)
    for key, value in overrides.items():
        out.merge_with(_nest({key: value}, "override"))
    return OmegaConf.to_container(out)


def load_section(exp: Mapping) -> Any:
    """The typed, validated experiment section (one-line errors naming experiment.<key>)."""
    node = OmegaConf.structured(ExperimentSection)
    try:
        node.merge_with(dict(exp))
    except ConfigKeyError as e:
        known = ", ".join(f.name for f in fields(ExperimentSection))
        raise RapidfireError(f"experiment: unknown key 'experiment.{e.full_key or e.key}'; known keys: {known}") from None
    except OmegaConfBaseException as e:
        raise RapidfireError(f"experiment.{getattr(e, 'full_key', '') or '?'}: {show(getattr(e, 'value', None))} "
                             f"is not valid ({str(e).splitlines()[0]})") from None
    _check_section(node, ExperimentSection, "experiment.")
    _check_search(node)
    return node


def _check_search(node) -> None:
    search = OmegaConf.to_container(node.search)
    if not search:
        raise RapidfireError("experiment.search: empty; give at least one config key with a list of values, e.g. "
                             "optimizer.params.lr: [1.0e-4, 3.0e-4]")
    for key, values in search.items():
        where = f"experiment.search.{key}"
        if any(key == p.rstrip(".") or key.startswith(p) for p in FIXED_PREFIXES):
            raise RapidfireError(f"{where}: cannot be searched (every config trains the same chunks of the same "
                                 "data on the same base model); set it in the base config")
        parent, _, name = key.rpartition(".")
        if _section_type(parent) is None or name not in _known_keys(parent):
            known = ", ".join(_known_keys(parent)) if _section_type(parent) is not None else "see rapidfire config"
            raise RapidfireError(f"{where}: unknown config key '{key}'; known keys under '{parent}': {known}")
        if isinstance(values, list):
            if not values:
                raise RapidfireError(f"{where}: an empty list; give the values to try")
        elif isinstance(values, dict):
            extra = set(values) - {"low", "high", "log", "int"}
            if extra or not {"low", "high"} <= set(values):
                raise RapidfireError(f"{where}: a range is {{low, high, log, int}}; got keys {sorted(values)}")
            low, high = values["low"], values["high"]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or low > high:
                raise RapidfireError(f"{where}: low {show(low)} and high {show(high)} must be numbers, low <= high")
            if values.get("log") and low <= 0:
                raise RapidfireError(f"{where}: log: true needs low > 0, got {show(low)}")
            if node.num_samples is None:
                raise RapidfireError(f"{where}: a range is sampled; set experiment.num_samples (how many configs)")
        else:
            raise RapidfireError(f"{where}: {show(values)} is neither a list of values nor a range {{low, high}}")


def expand(search: Mapping[str, Any], num_samples: int | None, seed: int) -> list[dict]:
    """The searched values of every config: the grid (in key order, the last key varying fastest), or
    `num_samples` draws seeded by `seed`."""
    keys = list(search)
    if num_samples is None:
        return [dict(zip(keys, combo)) for combo in itertools.product(*(search[k] for k in keys))]
    rng = random.Random(seed)
    return [{k: _draw(search[k], rng) for k in keys} for _ in range(num_samples)]


def _draw(values, rng: random.Random):
    if isinstance(values, list):
        return values[rng.randrange(len(values))]
    low, high = values["low"], values["high"]
    x = math.exp(rng.uniform(math.log(low), math.log(high))) if values.get("log") else rng.uniform(low, high)
    return int(round(x)) if values.get("int") else float(f"{x:.6g}")


# A warm clone keeps its parent's adapter, so its shape stays the parent's.
ADAPTER_SHAPE_KEYS = ("model.lora.r", "model.lora.target_modules")


def perturb(values: dict, search: Mapping[str, Any], rng: random.Random, factors=(0.8, 1.2)) -> dict:
    """pbt's explore step: the searched values of a clone of a config whose values are `values`.
    A range's value is multiplied by one of `factors` and kept inside low..high (rounded for int);
    a list's moves to the entry before or after it (at an end: its only neighbour; a value not in the list,
    e.g. a clone's override, is drawn again). The adapter's shape keys are not changed."""
    out = dict(values)
    for key, spec in search.items():
        if key in ADAPTER_SHAPE_KEYS or key not in values:
            continue
        value = values[key]
        if isinstance(spec, list):
            if value in spec:
                i, shift = spec.index(value), rng.choice((-1, 1))
                if not 0 <= i + shift < len(spec):
                    shift = -shift  # at an end of the list: its only neighbour
                out[key] = spec[min(len(spec) - 1, max(0, i + shift))]
            else:
                out[key] = spec[rng.randrange(len(spec))]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            x = min(spec["high"], max(spec["low"], value * rng.choice(tuple(factors))))
            out[key] = int(round(x)) if spec.get("int") else float(f"{x:.6g}")
    return out


def validate_candidate(base: dict, values: dict, cid: str, parent: str | None = None) -> Candidate:
    """One config: the base with `values` applied, validated like any run's config; the experiment's
    own needs (LoRA, the SFT stage) on top. An error marks it failed, it never stops the others."""
    cand = Candidate(id=cid, values=dict(values), parent=parent)
    try:
        cfg = load_config(base, values)
        check_runnable(cfg)
        cand.cfg = cfg
    except RapidfireError as e:
        cand.error = str(e)
    return cand


def check_runnable(cfg) -> None:
    if cfg.train.stage != "sft":
        raise RapidfireError(f"train.stage: {show(cfg.train.stage)}: an experiment trains sft configs; set train.stage sft")
    if cfg.model.lora is None:
        raise RapidfireError("model.lora: null; an experiment swaps LoRA adapters over one loaded base model, set "
                             "model.lora (e.g. model.lora.r: 8)")
    if cfg.data.format == "preference":
        raise RapidfireError("data.format: 'preference' is for train.stage reward; an experiment trains sft rows")


def load_experiment(profile: Any, overrides=()) -> Experiment:
    """Read, validate and expand an experiment profile. Raises RapidfireError when the experiment
    itself is wrong (its section, the base config, or every config failing alike)."""
    base, exp = read_profile(profile, overrides)
    spec = load_section(exp)
    base_cfg = load_config(base)  # the base must stand on its own: run.name, data, model.name
    seed = base_cfg.run.seed if spec.seed is None else spec.seed
    values = expand(OmegaConf.to_container(spec.search), spec.num_samples, seed)
    candidates = [validate_candidate(base, v, f"c{i}") for i, v in enumerate(values)]
    errors = {c.error for c in candidates}
    if all(c.error for c in candidates) and len(errors) == 1:
        raise RapidfireError(f"experiment.search: every config fails: {errors.pop()}")
    folder = os.path.join(base_cfg.run.output_dir, base_cfg.run.name)
    return Experiment(name=base_cfg.run.name, folder=folder, spec=spec, base=base, candidates=candidates)


def short_values(values: dict) -> str:
    """`lr=0.001 r=8`: each searched key by its last part."""
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v:g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k, v in values.items())

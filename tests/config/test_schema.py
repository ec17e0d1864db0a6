"""The schema's field metadata is what validation and the reference use: each key's choices and range."""
from __future__ import annotations

import dataclasses

import pytest

from rapidfire_ray.config import load_config
from rapidfire_ray.config.schema import RapidfireConfig, listed, reference_markdown, subsection
from rapidfire_ray.errors import RapidfireError


def keys(cls=RapidfireConfig, prefix=""):
    for f in dataclasses.fields(cls):
        if subsection(f):
            yield from keys(subsection(f), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


KEYS = dict(keys())
CHOICE_KEYS = [k for k, f in KEYS.items() if "choices" in f.metadata]
RANGE_KEYS = [k for k, f in KEYS.items() if "range" in f.metadata]


def error_of(overrides) -> str:
    with pytest.raises(RapidfireError) as e:
        load_config(None, overrides)
    return str(e.value)


def test_every_key_has_a_doc_and_a_default_it_accepts():
    assert len(KEYS) > 100 and len(CHOICE_KEYS) == 21 and len(RANGE_KEYS) == 60
    for key, f in KEYS.items():
        assert f.metadata.get("doc"), key
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if "choices" in f.metadata:
            assert default in f.metadata["choices"], key
        if "range" in f.metadata and default is not None:
            low, high = f.metadata["range"]
            assert low <= default and (high is None or default <= high), key


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_a_value_outside_the_choices_is_refused_with_them(key):
    assert error_of([f"{key}=bogus"]) == f"{key}: 'bogus' is not one of: {listed(KEYS[key].metadata['choices'])}"


@pytest.mark.parametrize("key", RANGE_KEYS)
def test_a_value_outside_the_range_is_refused_with_it(key):
    low, high = KEYS[key].metadata["range"]
    allowed = f">= {low}" if high is None else f"between {low} and {high}"
    bad = low - 1 if isinstance(low, int) else low - 0.5
    assert error_of([f"{key}={bad}"]) == f"{key}: {bad} is out of range; allowed: {allowed}"
    if high is not None:
        assert error_of([f"{key}={high + 1}"]).endswith(f"is out of range; allowed: {allowed}")


def test_the_reference_shows_each_keys_choices_and_range():
    rows = {line.split(" | ")[0].strip("| `"): line for line in reference_markdown().splitlines()[2:]}
    assert set(rows) == set(KEYS)
    assert "| `data.prefetch_depth` | `3` | 0 .. 64 |" in rows["data.prefetch_depth"]
    assert "| >= 8 |" in rows["data.max_length"]
    assert "`none`, `int8`, `null`" in rows["optimizer.params.compression.act"]
    assert "| `dict` |" not in reference_markdown() and "| `{}` |" in rows["scaling.resources_per_worker"]

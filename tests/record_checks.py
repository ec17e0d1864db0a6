"""Invariants every normalised data record must hold (shared by the data tests)."""
from __future__ import annotations

from rapidfire_ray.data.formats import RECORD_KEYS


def check_records(records: list[dict]) -> list[dict]:
    for rec in records:
        assert tuple(rec) == RECORD_KEYS
        assert all(type(v) is str for v in rec.values()), rec
        if rec["error"]:
            assert all(rec[k] == "" for k in RECORD_KEYS[2:])
    return records

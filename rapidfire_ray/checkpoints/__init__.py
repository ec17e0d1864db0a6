"""Checkpoints: what each rank saves and reports to Ray Train (`saver`), and the manifests that
let a resume skip a damaged one (`manifest`), and Ray Train's record of them kept in agreement
with the folders on disk (`ledger`)."""
from .manifest import (MANIFEST_PREFIX, SHARD_PLAN_FILE, complete, refresh_manifest_entries, step_of,
                       usable_checkpoint, verify, write_manifest)

__all__ = ["MANIFEST_PREFIX", "SHARD_PLAN_FILE", "complete", "refresh_manifest_entries", "step_of",
           "usable_checkpoint", "verify", "write_manifest"]

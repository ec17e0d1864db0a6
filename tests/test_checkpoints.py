"""Manifests after a deliberate rewrite of a finished checkpoint (the parameter server's final
state): the rewritten checkpoint still verifies; an unrecorded change still does not."""
from __future__ import annotations

from rapidfire_ray.checkpoints import refresh_manifest_entries, verify, write_manifest


def test_refreshed_manifest_verifies_after_a_rewrite(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    (tmp_path / "ps_shard_0.pt").write_bytes(b"b" * 5)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "comm_state_rank1.pt").write_bytes(b"c")
    write_manifest(str(tmp_path), 0)
    assert verify(str(tmp_path)) is None
    (tmp_path / "model.safetensors").write_bytes(b"z" * 12)  # the final state replaces the weights
    (tmp_path / "ps_shard_1.pt").write_bytes(b"new")          # and adds a file
    assert "model.safetensors" in verify(str(tmp_path))
    refresh_manifest_entries(str(tmp_path), ["model.safetensors", "ps_shard_1.pt"])
    assert verify(str(tmp_path)) is None
    (tmp_path / "ps_shard_0.pt").write_bytes(b"b" * 4)        # anything else changed is still caught
    assert "ps_shard_0.pt" in verify(str(tmp_path))


def test_refresh_without_manifests_leaves_the_folder_alone(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a")
    refresh_manifest_entries(str(tmp_path), ["model.safetensors"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

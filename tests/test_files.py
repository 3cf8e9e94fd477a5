"""Files and folders written under a temporary name and renamed over their place (rstar_jax.files)."""

from __future__ import annotations

import os

import pytest

from rstar_jax.files import atomic_path, atomic_write_text


def test_a_file_appears_whole_and_no_temporary_is_left(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with atomic_path(target) as temporary:
        temporary.write_text("new")
        assert target.read_text() == "old" and temporary.parent == tmp_path  # same folder: os.replace is atomic
    assert target.read_text() == "new"
    assert atomic_write_text(target, "newer") == target and target.read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_path(target) as temporary:
            temporary.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_folder_appears_whole_and_a_killed_writers_leftover_is_cleared(tmp_path):
    target = tmp_path / "weights"
    leftover = tmp_path / f".weights.{os.getpid()}.tmp"  # what a writer of this pid killed mid-write left
    leftover.mkdir()
    (leftover / "stale").write_text("half")
    with atomic_path(target) as temporary:
        assert temporary == leftover and not temporary.exists()
        temporary.mkdir()
        (temporary / "shard").write_text("x")
    assert [p.name for p in target.iterdir()] == ["shard"]
    with pytest.raises(ValueError):
        with atomic_path(tmp_path / "other") as temporary:
            temporary.mkdir()
            (temporary / "shard").write_text("x")
            raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]

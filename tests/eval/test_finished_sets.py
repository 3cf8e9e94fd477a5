"""Finished benchmark sets (rstar_jax.eval.finished_sets): reused under the same identity, refused under another."""

from pathlib import Path

import pytest

from rstar_jax.eval.finished_sets import finished_rows, mark_finished, row_path

IDENTITY = {"model": "HF folder /m", "settings": {"samples": 2, "stop": ("a", "b")}, "limit": 3}


def test_only_sets_marked_finished_are_returned_with_their_rows(tmp_path: Path) -> None:
    assert finished_rows(tmp_path / "problems", ["gsm8k"], IDENTITY) == {}
    mark_finished(tmp_path / "problems", "gsm8k", IDENTITY, {"benchmark": "gsm8k", "avg_at_k": 0.5})
    assert finished_rows(tmp_path / "problems", ["aime24", "gsm8k"], IDENTITY) == {
        "gsm8k": {"benchmark": "gsm8k", "avg_at_k": 0.5}}
    assert not list((tmp_path / "problems").glob("*.tmp"))


def test_a_set_finished_under_other_settings_is_refused_by_name(tmp_path: Path) -> None:
    mark_finished(tmp_path, "amc23", IDENTITY, {"benchmark": "amc23"})
    other = {**IDENTITY, "settings": {"samples": 4, "stop": ("a", "b")}}
    with pytest.raises(ValueError, match=r"amc23\.row\.json was evaluated with another settings .*'samples': 2.*"
                                         r"'samples': 4"):
        finished_rows(tmp_path, ["amc23"], other)
    with pytest.raises(ValueError, match="another limit \\(3, now None\\)"):
        finished_rows(tmp_path, ["amc23"], {**IDENTITY, "limit": None})
    assert row_path(tmp_path, "amc23").exists()  # nothing deleted

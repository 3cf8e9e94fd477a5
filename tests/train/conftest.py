"""Session fixture of the train tests: the format-SFT'd tiny model, built once (see sft_fixture.py) and started in
the background as soon as collection shows that a selected test needs it, so it trains while earlier tests run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_fixture import BackgroundSFT, start_fixture_sft

FIXTURE_RUN = pytest.StashKey[BackgroundSFT]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the session's format SFT if a selected test uses `sft_model_dir`."""
    if session.config.option.collectonly:
        return
    if any("sft_model_dir" in getattr(item, "fixturenames", ()) for item in session.items):
        session.config.stash[FIXTURE_RUN] = start_fixture_sft()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the run if it still goes (an interrupted session) and delete its folder."""
    run = session.config.stash.get(FIXTURE_RUN, None)
    if run is not None:
        run.remove()


@pytest.fixture(scope="session")
def sft_model_dir(pytestconfig: pytest.Config) -> Path:
    """HF folder of the tiny model after `python -m experiments.sft` with gin/sft/tiny_format.gin."""
    run = pytestconfig.stash.get(FIXTURE_RUN, None)
    if run is None:  # requested only dynamically (request.getfixturevalue): start it now
        run = pytestconfig.stash[FIXTURE_RUN] = start_fixture_sft()
    return run.model_dir()

"""experiments.sweep --executor slurm on a real one-node SLURM cluster (tests/slurm_cluster.py: Debian's slurm-wlm and
munge, installed when missing, daemons started as root): the 2-point sweep of test_sweep_end_to_end (shrunken random
model, one RL step, 2 held-out problems) submitted as one job array of 2 tasks of 1 CPU, each task claiming its
point under its SLURM job id and running experiments.grid_point (with its own sandbox server); then both points'
results and the report, and a rerun that submits nothing.

Without root, or without SLURM and apt-get to install it, the cluster fixture skips this test saying why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rstar_jax.grid.claims import current_claim
from tests.grid.test_sweep_end_to_end import TINY_RUN, random_model  # noqa: F401 - the fixture
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_two_point_sweep_runs_as_a_slurm_job_array(slurm_cluster: SlurmCluster, random_model: Path,  # noqa: F811
                                                     tmp_path: Path, capfd: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.sweep import main

    monkeypatch.setenv("XLA_FLAGS", "")  # the tasks' points (sbatch exports this environment): one CPU device
    grid = tmp_path / "sweep"
    arguments = ["--model", str(random_model), "--out", str(grid), "--grid", "short/Stage.max_response_tokens=[48, 64]",
                 *(arg for p in TINY_RUN for arg in ("--gin_param", p)), "--executor", "slurm",
                 "--slurm_partition", slurm_cluster.partition, "--slurm_cpus", "1", "--slurm_time_min", "20",
                 "--slurm_poll_s", "2"]
    capfd.readouterr()
    status = main(arguments)
    output = capfd.readouterr().out
    logs = "".join(f"\n--- {path}:\n{path.read_text()[-3000:]}" for path in sorted(grid.glob("slurm/*/*_log.*")))
    assert status == 0, output[-3000:] + logs
    array = re.search(r"submitted 2 points as slurm job array (\d+)", output)
    assert array is not None, output[-3000:]
    names = ["short.Stage.max_response_tokens=48", "short.Stage.max_response_tokens=64"]
    task_ids = set()
    for length, name in zip((48, 64), names):
        point = grid / "points" / name
        summary = json.loads((point / "summary.json").read_text())
        assert summary["after"]["sampled"]["problems"] == 2 and summary["start"]["sampled"]["samples"] == 1
        assert [entry["step"] for entry in map(json.loads, (point / "metrics.jsonl").read_text().splitlines())] == [1]
        assert f"short/Stage.max_response_tokens = {length}" in (point / "operative_config.gin").read_text()
        assert (point / "model" / "config.json").is_file()
        claim = current_claim(point)
        assert claim.released and claim.host == slurm_cluster.node
        assert re.fullmatch(rf"{array.group(1)}_[01]", claim.job_id), claim.job_id
        task_ids.add(claim.job_id)
        assert f"{name}: finished (task {claim.job_id}" in output
    assert len(task_ids) == 2, "each point ran in its own array task"
    assert not slurm_cluster.command("squeue", "-h").strip(), "the array has left the queue"
    report = (grid / "report.md").read_text()
    assert "2 of 2 runs finished" in report and all(f"| {name} | 1 |" in report for name in names)
    assert (grid / "curves.png").is_file() and (grid / "heldout.png").is_file()

    assert main(arguments) == 0
    output = capfd.readouterr().out
    assert output.count("finished before, skipped") == 2 and "submitted" not in output


def test_without_root_or_apt_the_cluster_fixture_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import slurm_cluster as module

    monkeypatch.setattr(module.os, "geteuid", lambda: 1000)
    assert "needs root" in module.why_no_cluster() and "uid 1000" in module.why_no_cluster()
    monkeypatch.setattr(module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(module.shutil, "which", lambda name: None)
    reason = module.why_no_cluster()
    assert "SLURM is not installed (munged, slurmctld" in reason and "no apt-get to install" in reason
    monkeypatch.setattr(module.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert module.why_no_cluster() is None

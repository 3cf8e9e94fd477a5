"""The SLURM executor's code path (rstar_jax/grid/slurm.py) on submitit's local executor: unfinished points become
one job array of PointTasks, each claims its point under its task's job id and runs the point command; finished
points are not submitted, a point another worker holds is left to it, a failing point is reported. The real SLURM
run of a sweep is tests/grid/test_sweep_slurm.py. Point commands are the runner tests' fake runs."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from rstar_jax.grid.claims import current_claim, try_claim
from rstar_jax.grid.points import GridError, expand, parse_grid_arg
from rstar_jax.grid.runner import SUMMARY_FILE, ClaimTiming, point_status, run_dir
from rstar_jax.grid.slurm import PointTask, SlurmSettings, run_points_on_slurm
from tests.grid.test_grid_runner import FAKE_RUN

LOCAL = SlurmSettings(cluster="local", poll_s=0.2, cpus_per_task=1)


def test_unfinished_points_run_as_array_tasks_under_their_claims(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    points = expand([parse_grid_arg("RLSettings.seed=[1, 2, 3, 4]")], "model")
    behaviour = {points[0].name: "ok", points[1].name: "fail", points[2].name: "ok", points[3].name: "ok"}
    run_dir(tmp_path, points[2]).mkdir(parents=True)
    (run_dir(tmp_path, points[2]) / SUMMARY_FILE).write_text("{}")  # finished before: not submitted
    holder = try_claim(run_dir(tmp_path, points[3]), "4242_0")  # another worker runs it right now

    def command(point, directory: Path) -> list[str]:
        return [sys.executable, "-c", FAKE_RUN, str(directory), behaviour[point.name]]

    outcome = run_points_on_slurm(points, tmp_path, command, base={"gin_files": ["a.gin"]}, settings=LOCAL)
    assert outcome.finished == [points[0].name] and outcome.failed == [points[1].name]
    assert outcome.skipped == [points[2].name] and outcome.busy == [points[3].name]
    assert [point_status(run_dir(tmp_path, point)) for point in points] == ["finished", "interrupted", "finished",
                                                                            "interrupted"]
    output = capsys.readouterr().out
    assert "submitted 3 points as local job array" in output
    task_ids = []
    for point in points[:2]:
        claim = current_claim(run_dir(tmp_path, point))
        assert claim.released and claim.job_id.split("_")[0] != "4242"
        task_ids.append(claim.job_id)
        assert json.loads((run_dir(tmp_path, point) / "point.json").read_text())["base"] == {"gin_files": ["a.gin"]}
    assert len(set(task_ids)) == 2, "each point ran in its own task"
    assert current_claim(run_dir(tmp_path, points[3])) == holder.record, "the busy point's claim is untouched"
    assert f"{points[3].name}: busy (task" in output and f"{points[1].name}: failed (task" in output
    logs = "".join(path.read_text() for path in (tmp_path / "slurm").glob("*/*_log.out"))
    assert f"{points[3].name}: running elsewhere (job 4242_0 on host" in logs, "the task said why it left it"
    assert len(list((tmp_path / "slurm").glob("*/*_submitted.pkl"))) == 3, "submitit's folder is under the grid"

    holder.release()
    behaviour[points[1].name] = "ok"
    again = run_points_on_slurm(points, tmp_path, command, base={"gin_files": ["a.gin"]}, settings=LOCAL)
    assert again.finished == [points[1].name, points[3].name] and again.skipped == [points[0].name, points[2].name]
    assert json.loads((run_dir(tmp_path, points[1]) / SUMMARY_FILE).read_text()) == {"resumed_after": 0}


def test_other_settings_are_refused_before_anything_is_submitted(tmp_path: Path) -> None:
    points = expand([parse_grid_arg("RLSettings.seed=[1]")], "model")
    run_points_on_slurm(points, tmp_path, lambda p, d: [sys.executable, "-c", FAKE_RUN, str(d), "ok"],
                        settings=LOCAL)
    with pytest.raises(GridError, match="holds a run of other settings"):
        run_points_on_slurm(points, tmp_path, lambda p, d: [sys.executable, "-c", ""], base={"gin_files": ["b"]},
                            settings=LOCAL)
    assert len(list((tmp_path / "slurm").glob("*/*_submitted.pkl"))) == 1, "nothing more was submitted"


def test_a_point_task_pickles_and_the_sbatch_parameters() -> None:
    point = expand([parse_grid_arg("RLSettings.seed=[1]")], "model")[0]
    task = pickle.loads(pickle.dumps(PointTask(point, "/grid", ["python", "-c", ""], None, None, ClaimTiming())))
    assert task.point == point.to_json() and task.command == ["python", "-c", ""]
    parameters = SlurmSettings(partition="gpu", time_min=60, cpus_per_task=8, mem_gb=64, gpus_per_task=1,
                               parallel=4, setup=("module load cuda",)).parameters("sweep-x")
    assert parameters == {"name": "sweep-x", "timeout_min": 60, "cpus_per_task": 8, "nodes": 1, "tasks_per_node": 1,
                          "mem_gb": 64, "gpus_per_node": 1, "slurm_partition": "gpu", "slurm_array_parallelism": 4,
                          "slurm_setup": ["module load cuda"]}

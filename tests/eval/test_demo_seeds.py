"""`python -m experiments.demo_seeds`: the range and table aggregated from hand-made seed run folders (--from-runs),
the refusals, each seed's demo command, resuming and running seeds side by side (with a stand-in for the demo), and
the lines the demo ends with."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from demo_summaries import CONFIG, summary, write_run
from experiments import demo_seeds
from rstar_jax.eval.seed_range import config_fingerprint


def fake_runs(out: Path, seeds: tuple[int, ...] = (0, 1, 2)) -> None:
    for seed in seeds:
        write_run(out / f"seed{seed}", summary(seed, sft=0.2 + 0.05 * seed, rl=0.4 + 0.02 * seed))


def test_from_runs_writes_the_range_and_the_table_beside_it(tmp_path: Path) -> None:
    fake_runs(tmp_path / "runs")
    range_file = tmp_path / "reports" / "range.json"
    status = demo_seeds.main(["--from-runs", "--out", str(tmp_path / "runs"), "--seeds", "0", "1", "2",
                              "--write-range", str(range_file)])
    assert status == 0
    record = json.loads(range_file.read_text())
    assert record["seeds"] == [0, 1, 2] and record["fingerprint"] == config_fingerprint(CONFIG.format(seed=0))
    sft = record["figures"]["sft_t1"]
    assert sft["values"] == pytest.approx([0.2, 0.25, 0.3]) and sft["mean"] == pytest.approx(0.25)
    assert (sft["min"], sft["max"]) == (pytest.approx(0.2), pytest.approx(0.3))
    table = (tmp_path / "reports" / "table.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in table[-4:]] == ["| 0", "| 1", "| 2", "| mean"]
    assert table[-1].split(" | ")[1] == "25.0%"


def test_missing_runs_and_mixed_configs_write_no_range(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fake_runs(tmp_path / "runs", seeds=(0, 1))
    range_file = tmp_path / "range.json"
    arguments = ["--from-runs", "--out", str(tmp_path / "runs"), "--write-range", str(range_file), "--seeds"]
    assert demo_seeds.main([*arguments, "0", "1", "2"]) == 1
    assert f"no demo_summary.json in {tmp_path / 'runs' / 'seed2'}" in capsys.readouterr().out
    write_run(tmp_path / "runs" / "seed2", summary(2), CONFIG.replace("train_sft.steps = 300", "train_sft.steps = 3"))
    assert demo_seeds.main([*arguments, "0", "1", "2"]) == 1
    assert "different configs" in capsys.readouterr().out and not range_file.exists()


def test_a_seed_demo_alone_keeps_the_environment_and_side_by_side_gets_one_core(monkeypatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    command, env = demo_seeds.seed_command(3, "runs/x", ["RLSettings.group_size = 2"], core=None)
    assert command == [sys.executable, "-m", "experiments.demo", "--out", str(Path("runs/x/seed3")), "--seed", "3",
                       "--gin_param", "RLSettings.group_size = 2"]
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    pinned, env = demo_seeds.seed_command(3, "runs/x", [], core=1)
    assert pinned[-7:] == command[:7]
    if shutil.which("taskset"):
        assert Path(pinned[0]).name == "taskset" and pinned[1:3] == ["--cpu-list", "1"]
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    assert env["OMP_NUM_THREADS"] == "1"


def test_seeds_run_side_by_side_skip_finished_ones_and_report_failures(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "runs"
    fake_runs(out, seeds=(0,))
    cores = []

    def stand_in(seed: int, out_dir: str | Path, gin_params, core: int | None):  # the demo: writes its summary
        cores.append(core)
        folder = demo_seeds.seed_dir(out_dir, seed)
        script = (f"import sys, time; time.sleep(0.2); sys.exit(3) if {seed} == 2 else "
                  f"open({str(folder / 'demo_summary.json')!r}, 'w').write('{{}}')")
        return [sys.executable, "-c", script], {}

    monkeypatch.setattr(demo_seeds, "seed_command", stand_in)
    monkeypatch.setattr(demo_seeds, "POLL_S", 0.05)
    assert demo_seeds.run_seeds([0, 1, 2, 3], out, [], parallel=2) == [2]
    assert len(cores) == 3 and set(cores) == {0, 1 % (os.cpu_count() or 1)}  # slots 0 and 1, each its core
    assert all((out / f"seed{seed}" / "demo_summary.json").is_file() for seed in (1, 3))
    assert json.loads((out / "seed0" / "demo_summary.json").read_text())["seed"] == 0  # finished: not run again
    assert not (out / "seed2" / "demo_summary.json").exists()


def test_the_demo_ends_with_the_range_or_how_to_make_it(tmp_path: Path) -> None:
    missing = demo_seeds.against_seed_range(summary(9), "x", tmp_path / "range.json")
    assert len(missing) == 1 and "range.json is missing" in missing[0]
    assert "python -m experiments.demo_seeds --seeds 0 1 2 3 4" in missing[0]
    fake_runs(tmp_path / "runs")
    range_file = tmp_path / "range.json"
    demo_seeds.main(["--from-runs", "--out", str(tmp_path / "runs"), "--seeds", "0", "1", "2",
                     "--write-range", str(range_file)])
    lines = demo_seeds.against_seed_range(summary(9, sft=0.05), config_fingerprint(CONFIG.format(seed=9)),
                                          range_file)
    assert lines[0] == f"this run beside the demo's range over 3 seeds ({range_file}):"
    assert lines[1] == "SFT start, T=1: 5.0%   (3 seeds: 20.0-30.0%)   below the range"
    assert any("weak SFT draw" in line for line in lines)

"""Exclusive claims on grid points (rstar_jax/grid/claims.py): of many concurrent claimers (threads, processes)
exactly one wins; a live claim is respected; a stale one (old heartbeat, dead pid on this host, or this same SLURM
task requeued) is taken over by exactly one claimer; a holder whose claim was taken over finds out at its next
heartbeat; and run_point leaves a point that another worker holds alone, and kills its point when its claim is lost."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rstar_jax.grid import claims
from rstar_jax.grid.claims import Claim, Heartbeat, current_claim, try_claim
from rstar_jax.grid.points import expand, parse_grid_arg
from rstar_jax.grid.runner import ClaimTiming, run_dir, run_point

CLAIMERS = 16


def _race(directory: Path, job_ids: list[str], now: float | None = None) -> list[Claim | None]:
    """Every job id claims `directory` from its own thread, all released at once by a barrier."""
    barrier = threading.Barrier(len(job_ids))
    results: list[Claim | None] = [None] * len(job_ids)

    def claimer(index: int) -> None:
        barrier.wait()
        results[index] = try_claim(directory, job_ids[index], stale_after_s=60, now=now)

    threads = [threading.Thread(target=claimer, args=(index,)) for index in range(len(job_ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_of_concurrent_claimers_in_threads_exactly_one_wins(tmp_path: Path) -> None:
    for round_ in range(5):
        directory = tmp_path / f"point{round_}"
        results = _race(directory, [f"{100 + i}_{round_}" for i in range(CLAIMERS)])
        winners = [claim for claim in results if claim is not None]
        assert len(winners) == 1
        held = current_claim(directory)
        assert held == winners[0].record and held.version == 0 and held.job_id == winners[0].record.job_id
        assert held.host == claims.HOST and winners[0].took_over is None


CLAIM_IN_PROCESS = r"""
import sys, time
from rstar_jax.grid.claims import try_claim
directory, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
claim = try_claim(directory, "job" + sys.argv[3], stale_after_s=60)
print("won" if claim is not None else "lost", flush=True)
if claim is not None:
    sys.stdin.read()  # hold the claim (this process stays alive) until the test closes stdin
"""


def test_of_concurrent_claimers_in_processes_exactly_one_wins(tmp_path: Path) -> None:
    directory = tmp_path / "point"
    start = time.time() + 3.0  # every process is up and spinning by then
    processes = [subprocess.Popen([sys.executable, "-c", CLAIM_IN_PROCESS, str(directory), str(start), str(i)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(6)]
    answers = [process.stdout.readline().strip() for process in processes]
    try:
        assert sorted(answers) == ["lost"] * 5 + ["won"], answers
        winner = processes[answers.index("won")]
        held = current_claim(directory)
        assert held.pid == winner.pid and held.job_id == f"job{answers.index('won')}"
        assert try_claim(directory, "another", stale_after_s=60) is None, "a live holder's claim is respected"
    finally:
        for process in processes:
            process.stdin.close()
            process.wait()
    # the winner exited without releasing: its pid is gone on this host, so its claim is stale at once
    taken = try_claim(directory, "another", stale_after_s=60)
    assert taken is not None and taken.took_over.pid == winner.pid


def test_a_live_claim_is_respected_and_a_stale_one_taken_over_by_exactly_one(tmp_path: Path) -> None:
    directory = tmp_path / "point"
    first = try_claim(directory, "1_0", stale_after_s=60)
    assert first is not None
    assert try_claim(directory, "2_0", stale_after_s=60) is None, "live (fresh heartbeat, pid alive)"
    assert try_claim(directory, "2_0", stale_after_s=60, now=time.time() + 59) is None, "not yet stale"
    assert first.refresh() and current_claim(directory).version == 1
    later = time.time() + 61  # the holder missed its heartbeats for longer than the timeout
    results = _race(directory, [f"{10 + i}_0" for i in range(CLAIMERS)], now=later)
    winners = [claim for claim in results if claim is not None]
    assert len(winners) == 1, "a stale claim is taken over by exactly one claimer"
    assert winners[0].took_over == first.record and current_claim(directory) == winners[0].record
    assert current_claim(directory).version == 2
    assert not first.refresh(), "the old holder finds at its next heartbeat that its claim was taken over"
    assert first.lost and current_claim(directory) == winners[0].record
    assert not first.release(), "and cannot release the new holder's claim"
    assert winners[0].release() and current_claim(directory).released
    again = try_claim(directory, "3_0", stale_after_s=60)
    assert again is not None and again.took_over is None, "a released claim is free at once"


def test_a_requeued_slurm_task_takes_its_own_claim_over_and_old_versions_are_pruned(tmp_path: Path) -> None:
    directory = tmp_path / "point"
    claim = try_claim(directory, "77_3", stale_after_s=60)
    for _ in range(5):
        assert claim.refresh()
    assert sorted(path.name for path in directory.glob("claim.*.json")) == ["claim.4.json", "claim.5.json"]
    assert not list(directory.glob(".claim.*")), "no temporary file left behind"
    record = json.loads((directory / "claim.5.json").read_text())
    assert {"job_id", "host", "pid", "heartbeat", "token"} <= set(record) and record["job_id"] == "77_3"
    # the same array task, requeued after a preemption, runs in another process: it resumes its own point
    stored = json.loads((directory / "claim.5.json").read_text())
    (directory / "claim.5.json").write_text(json.dumps({**stored, "pid": 1, "host": "othernode"}))
    assert try_claim(directory, "78_3", stale_after_s=60) is None, "another task waits"
    requeued = try_claim(directory, "77_3", stale_after_s=60)
    assert requeued is not None and requeued.took_over.host == "othernode"


def test_an_unreadable_claim_counts_as_live_until_its_file_is_stale(tmp_path: Path) -> None:
    directory = tmp_path / "point"
    directory.mkdir()
    (directory / "claim.0.json").write_text("")  # a writer killed mid-write on a file system without hard links
    assert try_claim(directory, "1", stale_after_s=60) is None
    taken = try_claim(directory, "1", stale_after_s=60, now=time.time() + 61)
    assert taken is not None and taken.record.version == 1


def _point(tmp_path: Path):
    return expand([parse_grid_arg("RLSettings.seed=[1]")], str(tmp_path / "model"))[0]


def test_run_point_leaves_a_point_held_elsewhere_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    point = _point(tmp_path)
    directory = run_dir(tmp_path, point)
    holder = try_claim(directory, "555_1")
    ran: list[str] = []
    outcome = run_point(point, tmp_path, lambda p, d: ran.append(p.name) or [sys.executable, "-c", ""])
    assert outcome == "busy" and not ran
    assert "running elsewhere (job 555_1 on host" in capsys.readouterr().out
    holder.release()
    script = "import pathlib, sys; pathlib.Path(sys.argv[1], 'summary.json').write_text('{}')"
    assert run_point(point, tmp_path, lambda p, d: [sys.executable, "-c", script, str(d)]) == "finished"
    assert current_claim(directory).released, "a finished point's claim is released"


def test_a_running_point_heartbeats_and_is_killed_when_its_claim_is_lost(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    point = _point(tmp_path)
    directory = run_dir(tmp_path, point)
    sleeper = "import time; time.sleep(2)"
    start = time.monotonic()
    assert run_point(point, tmp_path, lambda p, d: [sys.executable, "-c", sleeper],
                     timing=ClaimTiming(heartbeat_s=0.2, stale_after_s=60)) == "failed"
    assert current_claim(directory).version >= 5, "heartbeats were published while it ran"
    assert time.monotonic() - start >= 2

    # another worker takes the claim over while the point runs (as if our heartbeats had stopped): it is killed
    def thief() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            held = current_claim(directory)
            if held is not None and not held.released and held.job_id == claims.local_job_id():
                if try_claim(directory, "999_0", stale_after_s=0.05, now=time.time() + 1) is not None:
                    return
            time.sleep(0.02)

    forever = "import time; time.sleep(600)"
    capsys.readouterr()
    thread = threading.Thread(target=thief)
    start = time.monotonic()
    thread.start()
    outcome = run_point(point, tmp_path, lambda p, d: [sys.executable, "-c", forever],
                        timing=ClaimTiming(heartbeat_s=0.1, stale_after_s=60))
    thread.join()
    assert outcome == "failed" and time.monotonic() - start < 30
    assert "its claim was taken over by job 999_0" in capsys.readouterr().out
    assert current_claim(directory).job_id == "999_0" and not current_claim(directory).released


def test_heartbeat_stops_with_its_block(tmp_path: Path) -> None:
    claim = try_claim(tmp_path / "point", "1")
    with Heartbeat(claim, every_s=0.05) as heartbeat:
        time.sleep(0.3)
    version = claim.record.version
    time.sleep(0.2)
    assert version >= 2 and claim.record.version == version and not heartbeat.lost

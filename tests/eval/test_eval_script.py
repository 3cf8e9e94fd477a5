"""`python -m experiments.eval` (SPEC 7's evaluation, scaled down): bad arguments stop it before any work, and a run
over the first problems of every set writes per-problem records and a summary whose numbers agree with them."""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest

from experiments import eval as eval_script
from rstar_jax.eval.benchmarks import BENCHMARKS, load_benchmark
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model.folder import seeded_model

SMALL = ("ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128",
         "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 2")
# k = 2 sampled at T = 1, 24 tokens, and few engine shapes (the 12 prompts are at most 1,338 tokens).
FAST = ("BenchmarkEval.samples = 2", "BenchmarkEval.temperature = 1.0", "BenchmarkEval.max_turns = 2",
        "BenchmarkEval.max_response_tokens = 24", "RolloutBackend.slots = 8", "RolloutBackend.max_len = 1536",
        "JaxEngine.prefill_buckets = (512, 1024, 1536)", "JaxEngine.decode_windows = (1536,)")


@pytest.fixture(autouse=True)
def _fresh_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("eval_model") / "model"
    parse_gin(["model/tiny.gin"], SMALL)
    try:
        seeded_model(folder, seed=0)
    finally:
        gin.clear_config()
    return folder


@pytest.mark.parametrize("extra, message", [
    (["--benchmarks", "aime24,aime2025"], "unknown benchmark(s) ['aime2025']"),
    (["--gin_param", "BenchmarkEval.sample = 4"], "doesn't have a parameter named 'sample'"),
    (["--gin_param", "NoSuchThing.samples = 4"], "NoSuchThing"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--gin_param", "RolloutBackend.max_len = 600"], "exceeds the engine's 600 tokens"),
])
def test_bad_arguments_stop_before_any_work(extra, message, model_dir: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        eval_script.main(["--model", str(model_dir), "--out", str(tmp_path / "out"), *extra])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_model_folder(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        eval_script.main(["--model", str(tmp_path / "no_model"), "--out", str(tmp_path / "out")])
    assert f"model folder {tmp_path / 'no_model'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # ~20-40 s: engine compilation, a sandbox server, 24 trajectories
def test_two_problems_of_every_set(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--out", str(out), "--limit", "2"]
    for binding in FAST:
        argv += ["--gin_param", binding]
    summary = eval_script.main(argv)

    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert [row["benchmark"] for row in written["benchmarks"]] == list(BENCHMARKS)
    assert written["settings"]["samples"] == 2 and written["limit"] == 2
    markdown = (out / "summary.md").read_text()
    for row in written["benchmarks"]:
        records = [json.loads(line) for line in (out / "problems" / f"{row['benchmark']}.jsonl").read_text()
                   .splitlines()]
        assert [r["id"] for r in records] == [p.id for p in load_benchmark(row["benchmark"], 2)]
        assert [r["answer"] for r in records] == [p.answer for p in load_benchmark(row["benchmark"], 2)]
        assert all(len(r["correct"]) == len(r["response_lengths"]) == len(r["tool_calls"]) == 2 for r in records)
        assert all(0 < length <= 24 for r in records for length in r["response_lengths"])
        assert (row["problems"], row["k"]) == (2, 2)
        # avg@2 and pass@2 from the records, by hand.
        assert row["avg_at_k"] == pytest.approx(sum(sum(r["correct"]) for r in records) / 4)
        assert row["pass_at_k"] == pytest.approx(sum(any(r["correct"]) for r in records) / 2)
        assert f"| {row['title']} | 2 | 2 |" in markdown
    assert "| rStar2-Agent-14B (paper) | 97.8 | 80.6 | 69.8 | 52.7 | — | — |" in markdown
    assert (out / "operative_config.gin").read_text().count("BenchmarkEval.max_response_tokens = 24") == 1


@pytest.mark.slow  # ~40 s: two runs of one set each
def test_a_rerun_skips_finished_sets_and_refuses_other_settings(model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--out", str(out), "--limit", "1"]
    for binding in FAST:
        argv += ["--gin_param", binding]
    first = eval_script.main([*argv, "--benchmarks", "gsm8k"])
    records = (out / "problems" / "gsm8k.jsonl").stat().st_mtime_ns
    # Extended by one set: the finished one is reused (its records untouched), only the new one runs.
    extended = eval_script.main([*argv, "--benchmarks", "amc23,gsm8k"])
    assert (out / "problems" / "gsm8k.jsonl").stat().st_mtime_ns == records
    assert [row["benchmark"] for row in extended["benchmarks"]] == ["amc23", "gsm8k"]
    assert extended["benchmarks"][1] == first["benchmarks"][0]
    assert f"already evaluated in {out}: gsm8k" in (out / "eval.log").read_text()
    with pytest.raises(SystemExit) as stopped:
        eval_script.main([*argv, "--benchmarks", "gsm8k", "--gin_param", "BenchmarkEval.samples = 3"])
    assert stopped.value.code == 2
    assert "gsm8k.row.json was evaluated with another settings" in capsys.readouterr().err

"""The six benchmark sets of SPEC 7's evaluation: every row of every shared-data file is loaded, in file order."""

from __future__ import annotations

import csv
import json

import pytest

from rstar_jax.data.registry import DATASETS
from rstar_jax.eval.benchmarks import BENCHMARKS, load_benchmark, parse_benchmark_names
from rstar_jax.paths import shared_data_dir

EXPECTED = {"aime24": 30, "aime25": 30, "hmmt25": 30, "math500": 500, "amc23": 40, "gsm8k": 1319}


def _file_rows(name: str) -> int:
    """Rows counted straight from the files: non-blank JSONL lines, or answers.csv rows of each MathArena part."""
    path = shared_data_dir() / DATASETS[name].relative_path
    if path.is_file():
        return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    parts = [path] if (path / "answers.csv").is_file() else sorted(p for p in path.iterdir() if p.is_dir())
    return sum(len(list(csv.DictReader((part / "answers.csv").open(encoding="utf-8")))) for part in parts)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_set_loads_every_row_of_its_file(name: str) -> None:
    problems = load_benchmark(name)
    assert len(problems) == _file_rows(name) == EXPECTED[name]
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.question and p.answer for p in problems)
    assert load_benchmark(name, limit=2) == problems[:2]


def test_first_rows_match_the_files() -> None:
    aime24 = json.loads((shared_data_dir() / "eval/aime24/test.jsonl").read_text().splitlines()[0])
    assert load_benchmark("aime24", 1)[0].answer == str(aime24["answer"]).strip()
    gsm8k = json.loads((shared_data_dir() / "eval/gsm8k/test.jsonl").read_text().splitlines()[0])
    assert load_benchmark("gsm8k", 1)[0].answer == gsm8k["answer"].rsplit("####", 1)[1].strip()


def test_names() -> None:
    assert list(BENCHMARKS) == list(EXPECTED) and set(BENCHMARKS) <= set(DATASETS)
    assert parse_benchmark_names("all") == list(EXPECTED)
    assert parse_benchmark_names("MATH500, aime24,math500") == ["math500", "aime24"]
    with pytest.raises(ValueError, match=r"unknown benchmark\(s\) \['aime26'\]"):
        parse_benchmark_names("aime24,aime26")
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("aime24", limit=0)

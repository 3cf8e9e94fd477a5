"""Loaders for every format in shared/data, and bad rows skipped and counted (issue 4, item 3)."""

from __future__ import annotations

import json
import pathlib

import pytest

from rstar_jax.data.loaders import BadRow, answer_text
from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import load_problems
from rstar_jax.paths import DATA_DIR_ENV, shared_data_dir

EXPECTED_COUNTS = {
    "aime24": 30,
    "amc23": 40,
    "aime25": 30,
    "hmmt25": 30,
    "math500": 500,
    "gsm8k": 1319,
    "math_train": 7470,  # 7474 rows, 4 without an answer (2 null, 2 empty strings)
}


@pytest.mark.parametrize(("name", "count"), EXPECTED_COUNTS.items())
def test_named_data_sets_load_whole(name: str, count: int) -> None:
    loaded = load_problems(name)
    assert len(loaded.problems) == count
    assert len({p.id for p in loaded.problems}) == count
    assert all(p.source == name and p.question and p.answer == p.answer.strip() and p.answer for p in loaded.problems)


def test_skipped_rows_are_counted_by_reason() -> None:
    assert dict(load_problems("math_train").skipped.by_reason) == {"empty answer": 4}
    assert load_problems("math500").skipped.total == 0


@pytest.mark.parametrize(
    ("name", "index", "expected"),
    [
        ("aime24", 0, Problem("aime24/60", "", "204", "aime24")),
        ("amc23", 0, Problem("amc23/0", "", "27", "amc23")),  # stored as the float 27.0
        ("aime25", 0, Problem("aime25/aime_2025_I/1", "", "70", "aime25")),
        ("aime25", 15, Problem("aime25/aime_2025_II/1", "", "468", "aime25")),
        ("hmmt25", 2, Problem("hmmt25/3", "", "\\frac{1}{576}", "hmmt25")),
        (
            "math500",
            0,
            Problem("math500/test/precalculus/807.json", "", "\\left( 3, \\frac{\\pi}{2} \\right)", "math500"),
        ),
        ("gsm8k", 0, Problem("gsm8k/0", "", "18", "gsm8k")),
        ("math_train", 0, Problem("math_train/0", "", "0", "math_train")),
    ],
)
def test_records_carry_id_answer_and_source(name: str, index: int, expected: Problem) -> None:
    problem = load_problems(name).problems[index]
    assert (problem.id, problem.answer, problem.source) == (expected.id, expected.answer, expected.source)


def test_questions_come_from_the_right_field() -> None:
    assert load_problems("hmmt25").problems[0].question.startswith("Compute the sum of the positive divisors")
    assert load_problems("gsm8k").problems[0].question.startswith("Janet")
    assert load_problems("aime24").problems[0].question.startswith("Every morning Aya")


def test_amc_float_answers_become_integer_strings() -> None:
    answers = [p.answer for p in load_problems("amc23").problems]
    assert all(a.lstrip("-").isdigit() for a in answers), answers


@pytest.mark.parametrize(
    ("value", "text"), [(27.0, "27"), (-3.0, "-3"), (0.5, "0.5"), (12, "12"), ("  \\frac{1}{2} ", "\\frac{1}{2}")]
)
def test_answer_text(value: object, text: str) -> None:
    assert answer_text(value) == text


@pytest.mark.parametrize("value", [None, "", "   ", float("nan"), True, [1]])
def test_answer_text_rejects_unusable_answers(value: object) -> None:
    with pytest.raises(BadRow):
        answer_text(value)


def test_bad_jsonl_rows_are_skipped_and_counted(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "mixed.jsonl"
    rows = [
        json.dumps({"id": 1, "problem": "What is 1+1?", "answer": 2.0}),
        json.dumps({"id": 2, "problem": "What is 2+2?", "answer": ""}),
        json.dumps({"id": 3, "answer": "5"}),
        "{not json",
        json.dumps([1, 2]),
        "",
        json.dumps({"id": 6, "question": "What is 3+3?", "answer": "6"}),
    ]
    path.write_text("\n".join(rows) + "\n")
    loaded = load_problems(path)
    assert [(p.id, p.question, p.answer) for p in loaded.problems] == [
        ("mixed/1", "What is 1+1?", "2"),
        ("mixed/6", "What is 3+3?", "6"),
    ]
    assert dict(loaded.skipped.by_reason) == {
        "empty answer": 1,
        "missing field 'problem' or 'question'": 1,
        "invalid json": 1,
        "row is not an object": 1,
    }
    assert loaded.skipped.total == 4


def test_gsm8k_rows_without_the_answer_mark_are_skipped(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text(
        json.dumps({"question": "Q1", "answer": "2+2=<<2+2=4>>4\n#### 4"}) + "\n"
        + json.dumps({"question": "Q2", "answer": "no final mark"}) + "\n"
        + json.dumps({"question": "Q3", "answer": "#### 1,250"}) + "\n"
    )
    loaded = load_problems(path)
    assert [(p.id, p.answer) for p in loaded.problems] == [("gsm/0", "4"), ("gsm/2", "1,250")]
    assert dict(loaded.skipped.by_reason) == {"answer without '####'": 1}


def test_matharena_rows_without_a_problem_file_are_skipped(tmp_path: pathlib.Path) -> None:
    (tmp_path / "problems").mkdir()
    (tmp_path / "problems" / "1.tex").write_text("Find $x$.")
    (tmp_path / "problems" / "3.tex").write_text("Find $y$.")
    (tmp_path / "answers.csv").write_text('id,answer\n1,5\n2,7\n3,""\n')
    loaded = load_problems(tmp_path)
    assert [(p.id, p.question, p.answer) for p in loaded.problems] == [(f"{tmp_path.name}/1", "Find $x$.", "5")]
    assert dict(loaded.skipped.by_reason) == {"missing problem .tex": 1, "empty answer": 1}


def test_json_list_loader(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "mathset.json"
    path.write_text(json.dumps([{"problem": "P", "answer": "1"}, {"problem": "Q", "answer": None}, "junk"]))
    loaded = load_problems(path)
    assert [p.id for p in loaded.problems] == ["mathset/0"]
    assert dict(loaded.skipped.by_reason) == {"empty answer": 1, "row is not an object": 1}


def test_paths_load_like_names_with_the_folder_as_source_for_split_files() -> None:
    by_path = load_problems(shared_data_dir() / "eval" / "math500" / "test.jsonl")
    assert by_path.problems == load_problems("math500").problems
    assert load_problems(shared_data_dir() / "eval" / "gsm8k" / "test.jsonl").problems[0].answer == "18"
    assert load_problems(shared_data_dir() / "eval" / "hmmt25").problems == load_problems("hmmt25").problems


def test_data_dir_can_be_overridden(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "eval" / "aime24").mkdir(parents=True)
    (tmp_path / "eval" / "aime24" / "test.jsonl").write_text(json.dumps({"id": 9, "problem": "P", "answer": "3"}))
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert shared_data_dir() == tmp_path
    assert load_problems("aime24").problems == (Problem("aime24/9", "P", "3", "aime24"),)
    with pytest.raises(FileNotFoundError, match="data set 'gsm8k' not found"):
        load_problems("gsm8k")


def test_unknown_names_and_formats_are_clear_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a known data set"):
        load_problems("aime2099")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="unknown problem file format"):
        load_problems(tmp_path / "notes.txt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="not a MathArena directory"):
        load_problems(tmp_path / "empty_dir")

"""Readers for every problem format in shared/data, each turning rows into `Problem` records (issue 4, item 3).

Row parsers are pure functions (dict -> Problem) that raise `BadRow` with the reason a row cannot be used; the file
readers around them skip and count such rows, so a bad row is never fatal.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rstar_jax.data.problem import LoadedProblems, Problem, SkippedRows

RowParser = Callable[[Mapping[str, Any], int, str], Problem]

_GSM8K_ANSWER_MARK = "####"
_INVALID_JSON = object()  # stands in for a line that is not JSON, so it is counted like any other bad row


class BadRow(ValueError):
    """A row that cannot become a Problem; its message is the reason counted in `SkippedRows`."""


def answer_text(value: Any) -> str:
    """Writes a reference answer as the string the verifier compares against.

    Numbers stored as floats (the Qwen2.5-Math AMC file has 27.0) become "27"; strings are stripped. Raises
    `BadRow` for a missing or empty answer.
    """
    if value is None or isinstance(value, bool):
        raise BadRow("empty answer")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRow("non-finite answer")
        text = str(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise BadRow(f"answer of type {type(value).__name__}")
    if not text:
        raise BadRow("empty answer")
    return text


def _required_text(row: Mapping[str, Any], *names: str) -> str:
    """The first of `names` present in `row` as a non-empty string (questions may be under either key)."""
    for name in names:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise BadRow(f"missing field {' or '.join(repr(n) for n in names)}")


def parse_qwen_math_row(row: Mapping[str, Any], index: int, source: str) -> Problem:
    """A Qwen2.5-Math eval row (aime24: string answers; amc23: float answers, both with `id` and `problem`)."""
    row_id = row.get("id", index)
    return Problem(
        id=f"{source}/{row_id}",
        question=_required_text(row, "problem", "question"),
        answer=answer_text(row.get("answer")),
        source=source,
    )


def parse_math500_row(row: Mapping[str, Any], index: int, source: str) -> Problem:
    """A MATH-500 row: `problem`, LaTeX `answer`, and `unique_id` such as "test/precalculus/807.json"."""
    row_id = row.get("unique_id", index)
    return Problem(
        id=f"{source}/{row_id}",
        question=_required_text(row, "problem"),
        answer=answer_text(row.get("answer")),
        source=source,
    )


def parse_gsm8k_row(row: Mapping[str, Any], index: int, source: str) -> Problem:
    """A GSM8K row: the reference is what follows the last '####' of the worked `answer`."""
    worked = _required_text(row, "answer")
    if _GSM8K_ANSWER_MARK not in worked:
        raise BadRow("answer without '####'")
    return Problem(
        id=f"{source}/{index}",
        question=_required_text(row, "question"),
        answer=answer_text(worked.rsplit(_GSM8K_ANSWER_MARK, 1)[1]),
        source=source,
    )


def parse_math_train_row(row: Mapping[str, Any], index: int, source: str) -> Problem:
    """A MATH-train row (`problem`, `answer`, `difficulty`, `type`); two rows of the shared copy have no answer."""
    return Problem(
        id=f"{source}/{index}",
        question=_required_text(row, "problem"),
        answer=answer_text(row.get("answer")),
        source=source,
    )


def _parse_rows(rows: Iterator[tuple[int, Any]], parse: RowParser, source: str) -> LoadedProblems:
    """Applies `parse` to each (index, row), keeping good rows and counting bad ones by reason."""
    problems: list[Problem] = []
    skipped = SkippedRows()
    for index, row in rows:
        if not isinstance(row, Mapping):
            skipped.add("row is not an object" if row is not _INVALID_JSON else "invalid json")
            continue
        try:
            problems.append(parse(row, index, source))
        except BadRow as reason:
            skipped.add(str(reason))
    return LoadedProblems(problems=tuple(problems), skipped=skipped)


def _jsonl_rows(path: pathlib.Path) -> Iterator[tuple[int, Any]]:
    """(line index, decoded row) for each non-blank line; undecodable lines yield a marker counted as bad."""
    with path.open(encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError:
                yield index, _INVALID_JSON


def load_jsonl(path: str | pathlib.Path, parse: RowParser, source: str) -> LoadedProblems:
    """Loads a JSON-lines file with the row parser of its format."""
    return _parse_rows(_jsonl_rows(pathlib.Path(path)), parse, source)


def load_json_list(path: str | pathlib.Path, parse: RowParser, source: str) -> LoadedProblems:
    """Loads a file holding one JSON list of rows (the MATH-train layout)."""
    path = pathlib.Path(path)
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of problems, found {type(rows).__name__}")
    return _parse_rows(iter(enumerate(rows)), parse, source)


def _numeric_suffix(problem_id: str) -> tuple[int, str]:
    """Orders MathArena ids 1, 2, ..., 10 numerically rather than as text."""
    last = problem_id.rsplit("/", 1)[-1]
    return (int(last), last) if last.isdigit() else (0, last)


def _matharena_competition(directory: pathlib.Path, source: str, id_prefix: str) -> LoadedProblems:
    """One MathArena competition: answers.csv (id,answer) joined with problems/<id>.tex, ids `id_prefix/<id>`."""
    problems: list[Problem] = []
    skipped = SkippedRows()
    with (directory / "answers.csv").open(encoding="utf-8", newline="") as table:
        for row in csv.DictReader(table):
            problem_id = (row.get("id") or "").strip()
            tex = directory / "problems" / f"{problem_id}.tex"
            if not problem_id:
                skipped.add("missing field 'id'")
                continue
            if not tex.is_file():
                skipped.add("missing problem .tex")
                continue
            try:
                problems.append(
                    Problem(
                        id=f"{id_prefix}/{problem_id}",
                        question=_required_text({"problem": tex.read_text(encoding="utf-8")}, "problem"),
                        answer=answer_text(row.get("answer")),
                        source=source,
                    )
                )
            except BadRow as reason:
                skipped.add(str(reason))
    problems.sort(key=lambda p: _numeric_suffix(p.id))
    return LoadedProblems(problems=tuple(problems), skipped=skipped)


def load_matharena(directory: str | pathlib.Path, source: str) -> LoadedProblems:
    """Loads a MathArena directory: itself a competition (has answers.csv) or a parent of several (AIME I and II)."""
    directory = pathlib.Path(directory)
    if (directory / "answers.csv").is_file():
        return _matharena_competition(directory, source, id_prefix=source)
    parts = sorted(d for d in directory.iterdir() if (d / "answers.csv").is_file())
    if not parts:
        raise ValueError(f"{directory}: no answers.csv here or in any subdirectory (not a MathArena directory)")
    loaded = [_matharena_competition(part, source, id_prefix=f"{source}/{part.name}") for part in parts]
    skipped = SkippedRows()
    for part in loaded:
        skipped.by_reason.update(part.skipped.by_reason)
    return LoadedProblems(problems=tuple(p for part in loaded for p in part.problems), skipped=skipped)

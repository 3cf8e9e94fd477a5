"""`load_problems(name_or_path)`: one entry point that finds a data set and picks its format's loader.

Named data sets resolve under the shared data directory: `$RSTAR_DATA_DIR` if set, else `../shared/data` beside
the repository root. Any other argument is a path whose format is recognised from its layout and fields.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Callable

from rstar_jax.data import loaders
from rstar_jax.data.problem import LoadedProblems
from rstar_jax.paths import DATA_DIR_ENV, shared_data_dir

_log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class _Dataset:
    relative_path: str
    load: Callable[[pathlib.Path, str], LoadedProblems]


def _jsonl(parse: loaders.RowParser) -> Callable[[pathlib.Path, str], LoadedProblems]:
    return lambda path, source: loaders.load_jsonl(path, parse, source)


DATASETS: dict[str, _Dataset] = {
    "aime24": _Dataset("eval/aime24/test.jsonl", _jsonl(loaders.parse_qwen_math_row)),
    "amc23": _Dataset("eval/amc23/test.jsonl", _jsonl(loaders.parse_qwen_math_row)),
    "aime25": _Dataset("eval/aime25", loaders.load_matharena),
    "hmmt25": _Dataset("eval/hmmt25", loaders.load_matharena),
    "math500": _Dataset("eval/math500/test.jsonl", _jsonl(loaders.parse_math500_row)),
    "gsm8k": _Dataset("eval/gsm8k/test.jsonl", _jsonl(loaders.parse_gsm8k_row)),
    "math_train": _Dataset(
        "train/math/math.json", lambda path, source: loaders.load_json_list(path, loaders.parse_math_train_row, source)
    ),
}


def _first_jsonl_row(path: pathlib.Path) -> dict:
    """The first decodable object of a JSON-lines file, used to recognise its format."""
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                return row
    raise ValueError(f"{path}: no JSON object on any line, cannot tell its format")


def _jsonl_parser_for(path: pathlib.Path) -> loaders.RowParser:
    """GSM8K rows carry a worked answer ending in '####', MATH-500 rows a `unique_id`; others are Qwen2.5-Math."""
    row = _first_jsonl_row(path)
    if isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return loaders.parse_gsm8k_row
    if "unique_id" in row:
        return loaders.parse_math500_row
    return loaders.parse_qwen_math_row


_SPLIT_NAMES = frozenset({"test", "train", "dev", "validation"})


def _source_name(path: pathlib.Path) -> str:
    """A data set's name from its path: the file's stem, or its folder's name for split files like test.jsonl."""
    if path.is_dir():
        return path.name
    return path.parent.name if path.stem in _SPLIT_NAMES else path.stem


def _load_path(path: pathlib.Path) -> LoadedProblems:
    source = _source_name(path)
    if path.is_dir():
        return loaders.load_matharena(path, source)
    if path.suffix == ".jsonl":
        return loaders.load_jsonl(path, _jsonl_parser_for(path), source)
    if path.suffix == ".json":
        return loaders.load_json_list(path, loaders.parse_math_train_row, source)
    raise ValueError(f"{path}: unknown problem file format (expected .jsonl, .json or a MathArena directory)")


def load_problems(name_or_path: str | os.PathLike) -> LoadedProblems:
    """Loads a named data set (one of `DATASETS`) or a file/directory in any supported format (issue 4, item 3).

    Bad rows are skipped and counted in the result's `skipped` (and logged); a missing data set raises
    FileNotFoundError naming where it was looked for.
    """
    name = str(name_or_path)
    if name in DATASETS:
        dataset = DATASETS[name]
        path = shared_data_dir() / dataset.relative_path
        if not path.exists():
            raise FileNotFoundError(f"data set {name!r} not found at {path} (set ${DATA_DIR_ENV} to the data dir)")
        loaded = dataset.load(path, name)
    else:
        path = pathlib.Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(f"{name!r} is neither a known data set ({', '.join(DATASETS)}) nor a path")
        loaded = _load_path(path)
    if loaded.skipped.total:
        _log.warning("%s: skipped %d bad rows %s", name, loaded.skipped.total, dict(loaded.skipped.by_reason))
    return loaded

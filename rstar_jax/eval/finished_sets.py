"""Which benchmark sets an evaluation folder already holds, so an interrupted or extended run skips them (SPEC 7).

A set is finished when OUT/problems/<set>.row.json exists: written after the set's per-problem records, it holds the
set's summary row and the identity of the run that made it (model, protocol settings, problem limit). A rerun reuses
a finished set only under the same identity; under another it refuses, rather than mix two protocols in one table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from rstar_jax.files import atomic_write_text

ROW_SUFFIX = ".row.json"


def row_path(problems_dir: Path, name: str) -> Path:
    """Where set `name`'s finished marker (its summary row and run identity) lives."""
    return problems_dir / f"{name}{ROW_SUFFIX}"


def mark_finished(problems_dir: Path, name: str, identity: Mapping[str, Any], row: Mapping[str, Any]) -> None:
    """Record set `name` as finished with its summary `row` (call after its per-problem records are written)."""
    problems_dir.mkdir(parents=True, exist_ok=True)
    # atomic: a killed run leaves no half-written marker
    atomic_write_text(row_path(problems_dir, name), json.dumps({"identity": identity, "row": row}, indent=1) + "\n")


def finished_rows(problems_dir: Path, names: Sequence[str], identity: Mapping[str, Any]) -> dict[str, dict]:
    """The summary rows of the sets among `names` already finished in `problems_dir` under `identity`.

    Raises ValueError naming the set and the first differing field when one was finished under another identity.
    """
    rows = {}
    for name in names:
        path = row_path(problems_dir, name)
        if not path.exists():
            continue
        saved = json.loads(path.read_text())
        wanted = json.loads(json.dumps(identity))  # the form it takes once written (tuples become lists)
        if saved["identity"] != wanted:
            field = next(key for key in sorted({*saved["identity"], *wanted})
                         if saved["identity"].get(key) != wanted.get(key))
            raise ValueError(f"{path} was evaluated with another {field} ({saved['identity'].get(field)!r}, now "
                             f"{wanted.get(field)!r}): use another --out, or delete it to evaluate that set again")
        rows[name] = saved["row"]
    return rows

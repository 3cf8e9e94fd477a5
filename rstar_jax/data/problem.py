"""The one problem record every loader produces, and the tally of rows a loader had to skip."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """A math problem with its reference answer (SPEC 3: the answer the verifier compares against).

    `id` is unique within a source (e.g. "aime24/60"), `source` names the data set it came from, `answer` is always
    a non-empty string (numbers read as floats such as 27.0 are written back as "27").
    """

    id: str
    question: str
    answer: str
    source: str


@dataclasses.dataclass
class SkippedRows:
    """Rows a loader dropped, counted by reason, so bad data is visible without ever being fatal."""

    by_reason: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def add(self, reason: str) -> None:
        """Counts one skipped row under `reason` (e.g. "empty answer", "missing field 'problem'")."""
        self.by_reason[reason] += 1

    @property
    def total(self) -> int:
        """How many rows were skipped for any reason."""
        return sum(self.by_reason.values())


@dataclasses.dataclass(frozen=True)
class LoadedProblems:
    """What a loader returns: the problems it kept and the rows it skipped."""

    problems: tuple[Problem, ...]
    skipped: SkippedRows

"""Synthetic tool tasks for the CPU demo: exact-integer problems a tiny model cannot do in its head (issue 4.5).

Each task is a `Problem` plus a short correct Python program that prints exactly its answer, so a tiny model can
learn to solve it by calling the tool (SPEC section 2) and the verifier can check the boxed result (SPEC section 3).
`difficulty` (1 = easy) scales the numbers; generation is deterministic given (seed, index), so the first N
problems of a seed never change when more are requested. `split` keeps training and held-out problems apart by
construction: a question belongs to one split by a hash of its text, and a task of a split is redrawn until its
question is in it, so no held-out question can ever appear in a training set, whatever the seeds (some kinds have
only a few hundred distinct questions at difficulty 1, so disjoint seeds alone would not do).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import gin

from rstar_jax.data.problem import Problem

SOURCE = "synthetic"


@dataclass(frozen=True)
class SyntheticTask:
    """A problem, the kind of computation it asks for, and a program that prints its answer."""

    problem: Problem
    kind: str
    solution_code: str


@dataclass(frozen=True)
class _Draft:
    question: str
    answer: int
    code: str


def _digits(rng: random.Random, count: int) -> int:
    return rng.randint(10 ** (count - 1), 10**count - 1)


def _multiply(rng: random.Random, difficulty: int) -> _Draft:
    a, b = _digits(rng, difficulty + 2), _digits(rng, difficulty + 1)
    return _Draft(f"Compute {a} * {b}.", a * b, f"result = {a} * {b}\nprint(result)")


def _modpow(rng: random.Random, difficulty: int) -> _Draft:
    base, exponent, modulus = _digits(rng, difficulty + 1), _digits(rng, difficulty + 2), _digits(rng, difficulty + 1)
    return _Draft(
        f"What is the remainder when {base}^{exponent} is divided by {modulus}?",
        pow(base, exponent, modulus),
        f"result = pow({base}, {exponent}, {modulus})\nprint(result)",
    )


def _digit_sum(rng: random.Random, difficulty: int) -> _Draft:
    base, exponent = rng.randint(2, 99), rng.randint(5 * difficulty, 15 * difficulty)
    return _Draft(
        f"What is the sum of the digits of {base}^{exponent}?",
        sum(int(digit) for digit in str(base**exponent)),
        f"result = sum(int(digit) for digit in str({base} ** {exponent}))\nprint(result)",
    )


def _digit_count(rng: random.Random, difficulty: int) -> _Draft:
    n, digit = rng.randint(10 * difficulty, 30 * difficulty), rng.randint(0, 9)
    return _Draft(
        f"How many times does the digit {digit} appear in {n}! (the factorial of {n})?",
        str(math.factorial(n)).count(str(digit)),
        f"import math\nresult = str(math.factorial({n})).count('{digit}')\nprint(result)",
    )


_KIND_BUILDERS: dict[str, Callable[[random.Random, int], _Draft]] = {
    "multiply": _multiply,
    "modpow": _modpow,
    "digit_sum": _digit_sum,
    "digit_count": _digit_count,
}
KINDS: tuple[str, ...] = tuple(_KIND_BUILDERS)
SPLITS = ("train", "heldout")
HELDOUT_SHARE = 8  # one question in 8 is held out


def question_split(question: str) -> str:
    """"heldout" for one question in `HELDOUT_SHARE` (by a hash of its text), else "train"."""
    digest = hashlib.sha256(question.encode()).digest()
    return "heldout" if digest[0] % HELDOUT_SHARE == 0 else "train"


def _draft_in_split(index: int, seed: int, difficulty: int, kind: str, split: str | None) -> _Draft:
    for attempt in range(10_000):
        name = f"{seed}:{index}:{kind}:{difficulty}" + (f":{attempt}" if attempt else "")
        draft = _KIND_BUILDERS[kind](random.Random(name), difficulty)
        if split is None or question_split(draft.question) == split:
            return draft
    raise RuntimeError(f"no {split} question of kind {kind!r} in 10,000 draws")


def synthetic_task(index: int, seed: int, difficulty: int, kind: str, split: str | None = None) -> SyntheticTask:
    """Task number `index` of `seed` (in `split` when given): the same arguments always give the same task."""
    if kind not in _KIND_BUILDERS:
        raise ValueError(f"unknown synthetic task kind {kind!r}; choose from {KINDS}")
    if not isinstance(difficulty, int) or difficulty < 1:
        raise ValueError(f"difficulty must be an integer >= 1, got {difficulty!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS} or None")
    draft = _draft_in_split(index, seed, difficulty, kind, split)
    problem = Problem(
        id=f"{SOURCE}/{kind}/d{difficulty}/s{seed}/{index}",
        question=draft.question,
        answer=str(draft.answer),
        source=SOURCE,
    )
    return SyntheticTask(problem=problem, kind=kind, solution_code=draft.code)


@gin.configurable
def synthetic_tasks(
    count: int, seed: int = 0, difficulty: int = 1, kinds: Sequence[str] = KINDS, split: str | None = None
) -> list[SyntheticTask]:
    """`count` tasks cycling through `kinds` (issue 4.5); deterministic by seed, harder with `difficulty`; only
    questions of `split` ("train" / "heldout") when given."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not kinds:
        raise ValueError("kinds must name at least one synthetic task kind")
    return [synthetic_task(index, seed, difficulty, kinds[index % len(kinds)], split) for index in range(count)]


def synthetic_problems(count: int, **task_options: object) -> list[Problem]:
    """Just the `Problem` records of `synthetic_tasks` (same options, gin bindings included), for RL and eval."""
    return [task.problem for task in synthetic_tasks(count, **task_options)]

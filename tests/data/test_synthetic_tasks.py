"""Synthetic tool tasks: exact answers (checked independently), a difficulty knob, determinism by seed."""

from __future__ import annotations

import re
import subprocess
import sys

import gin
import pytest

from rstar_jax.data.problem import Problem
from rstar_jax.data.synthetic import KINDS, synthetic_problems, synthetic_tasks


def _slow_modpow(base: int, exponent: int, modulus: int) -> int:
    result, square = 1, base % modulus
    while exponent:
        if exponent & 1:
            result = result * square % modulus
        square = square * square % modulus
        exponent >>= 1
    return result


def _digits_of(n: int) -> list[int]:
    digits = []
    while n:
        n, digit = divmod(n, 10)
        digits.append(digit)
    return digits or [0]


def _factorial(n: int) -> int:
    product = 1
    for k in range(2, n + 1):
        product *= k
    return product


def _independent_answer(question: str) -> int:
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if question.startswith("Compute"):
        return numbers[0] * numbers[1]
    if question.startswith("What is the remainder"):
        return _slow_modpow(*numbers)
    if question.startswith("What is the sum of the digits"):
        return sum(_digits_of(numbers[0] ** numbers[1]))
    digit, n = numbers[0], numbers[1]
    return _digits_of(_factorial(n)).count(digit)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_answers_are_exact(difficulty: int) -> None:
    for task in synthetic_tasks(40, seed=7, difficulty=difficulty):
        assert task.problem.answer == str(_independent_answer(task.problem.question)), task.problem


def test_hand_checked_examples() -> None:
    assert _independent_answer("Compute 123 * 45.") == 5535
    assert _independent_answer("What is the remainder when 3^4 is divided by 5?") == 1
    assert _independent_answer("What is the sum of the digits of 2^10?") == 7
    assert _independent_answer("How many times does the digit 0 appear in 10! (the factorial of 10)?") == 2


def test_solution_programs_print_exactly_the_answer() -> None:
    for task in synthetic_tasks(len(KINDS) * 2, seed=11, difficulty=2):
        run = subprocess.run([sys.executable, "-c", task.solution_code], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout == task.problem.answer + "\n"


def test_records_are_problems_cycling_through_kinds_with_unique_ids() -> None:
    tasks = synthetic_tasks(12, seed=0, difficulty=1)
    assert [task.kind for task in tasks] == list(KINDS) * 3
    assert all(isinstance(task.problem, Problem) and task.problem.source == "synthetic" for task in tasks)
    assert len({task.problem.id for task in tasks}) == 12
    assert tasks[0].problem.id == "synthetic/multiply/d1/s0/0"


def test_deterministic_by_seed_and_stable_under_longer_requests() -> None:
    assert synthetic_tasks(10, seed=5) == synthetic_tasks(10, seed=5)
    assert synthetic_tasks(10, seed=5)[:4] == synthetic_tasks(4, seed=5)
    assert [t.problem.question for t in synthetic_tasks(10, seed=5)] != [
        t.problem.question for t in synthetic_tasks(10, seed=6)
    ]


def test_difficulty_scales_the_numbers() -> None:
    for difficulty in (1, 3, 5):
        for task in synthetic_tasks(20, seed=2, difficulty=difficulty, kinds=("multiply",)):
            a, b = (int(n) for n in re.findall(r"\d+", task.problem.question))
            assert (len(str(a)), len(str(b))) == (difficulty + 2, difficulty + 1)


def test_gin_sets_the_difficulty_for_problems() -> None:
    with gin.unlock_config():
        gin.parse_config(["synthetic_tasks.difficulty = 4", "synthetic_tasks.kinds = ['multiply']"])
    try:
        [problem] = synthetic_problems(1, seed=0)
    finally:
        gin.clear_config()
    assert problem.id == "synthetic/multiply/d4/s0/0"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 3, "kinds": ("division",)}, "unknown synthetic task kind 'division'"),
        ({"count": 3, "difficulty": 0}, "difficulty must be an integer >= 1"),
        ({"count": -1}, "count must be >= 0"),
        ({"count": 3, "kinds": ()}, "at least one"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        synthetic_tasks(**kwargs)

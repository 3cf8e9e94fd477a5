"""The verifier pool: adversarial answers return False within their time limit, the pool survives and stays fast
(issue 4, item 1; SPEC 3)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from rstar_jax.reward import VerifierPool

LIMIT_S = 2.0
SLACK_S = 1.5  # killing and replacing a worker, and the scheduler of a shared 2-core machine

ADVERSARIAL = {
    "power tower": "<answer>\\boxed{9^{9^{9^{9}}}}</answer>",
    "huge power": "\\boxed{2^{2^{40}}}",
    "huge factorial": "\\boxed{(10^{10})!}",
    "100 KB LaTeX blob": "\\boxed{" + "\\frac{1}{2}+" * 9000 + "}",
    "10,000 nested braces": "\\boxed{" + "{" * 10000 + "1" + "}" * 10000 + "}",
    "unbalanced braces": "\\boxed{\\frac{1}{2" + "{" * 5000,
    "stray closing braces": "\\boxed{\\sqrt{2}}" + "}" * 10000,
}


@pytest.fixture(scope="module")
def pool() -> VerifierPool:
    with VerifierPool(num_workers=2, timeout_s=LIMIT_S, memory_limit_mb=1024) as verifier_pool:
        yield verifier_pool


@pytest.fixture(scope="module")
def unguarded_pool() -> VerifierPool:
    """No length guard: every adversarial answer reaches math-verify and sympy, so only the time limit saves us."""
    with VerifierPool(num_workers=2, timeout_s=LIMIT_S, memory_limit_mb=1024, max_answer_chars=10**6) as verifier_pool:
        yield verifier_pool


def _assert_still_works(pool: VerifierPool) -> None:
    assert pool.verify_batch(["\\boxed{42}", "\\boxed{\\frac{1}{2}}", "\\boxed{7}"], ["42", "0.5", "8"]) == [
        True,
        True,
        False,
    ]


@pytest.mark.parametrize("name", list(ADVERSARIAL))
@pytest.mark.parametrize("which", ["guarded", "unguarded"])
def test_adversarial_answer_is_false_within_its_limit(
    name: str, which: str, pool: VerifierPool, unguarded_pool: VerifierPool
) -> None:
    verifier_pool = pool if which == "guarded" else unguarded_pool
    started = time.monotonic()
    assert verifier_pool.verify_batch([ADVERSARIAL[name]], ["9"]) == [False]
    assert time.monotonic() - started < LIMIT_S + SLACK_S
    _assert_still_works(verifier_pool)


def test_hung_items_do_not_hold_up_the_rest_of_the_batch(pool: VerifierPool) -> None:
    responses = [ADVERSARIAL["power tower"], "\\boxed{3}", ADVERSARIAL["huge factorial"], "\\boxed{1,000}"] * 2
    references = ["9", "3", "9", "1000"] * 2
    replaced_before = pool.workers_replaced
    started = time.monotonic()
    assert pool.verify_batch(responses, references) == [False, True, False, True] * 2
    # four hung items, two workers: two rounds of the limit, never more
    assert time.monotonic() - started < 2 * LIMIT_S + 2 * SLACK_S
    assert pool.workers_replaced - replaced_before == 4


def test_per_call_timeout_overrides_the_default(pool: VerifierPool) -> None:
    started = time.monotonic()
    assert pool.verify_batch([ADVERSARIAL["power tower"]], ["9"], timeout_s=0.5) == [False]
    assert time.monotonic() - started < 0.5 + SLACK_S


def test_workers_run_under_the_memory_limit() -> None:
    """The cap is the worker's start-up size plus the configured amount (start-up size depends on the parent)."""
    with VerifierPool(num_workers=2, memory_limit_mb=768) as fresh_pool:  # construction waits for its workers
        for pid in fresh_pool.worker_pids:
            limits = pathlib.Path(f"/proc/{pid}/limits").read_text()
            address_space = next(line for line in limits.splitlines() if line.startswith("Max address space"))
            limit = int(address_space.split()[3])
            size = int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            assert 700 * 2**20 < limit - size <= 768 * 2**20


def test_two_thousand_easy_items_take_seconds(pool: VerifierPool) -> None:
    responses = [f"<answer>\\boxed{{{n * 7}}}</answer>" for n in range(1000)] + [
        f"so it is \\boxed{{\\frac{{{n}}}{{4}}}}" for n in range(1000)
    ]
    references = [str(n * 7) for n in range(1000)] + [str(n / 4) for n in range(1000)]
    started = time.monotonic()
    results = pool.verify_batch(responses, references)
    elapsed = time.monotonic() - started
    assert all(results)
    assert elapsed < 10.0, f"2,000 easy items took {elapsed:.2f} s"


def test_batch_shape_and_types_are_checked(pool: VerifierPool) -> None:
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        pool.verify_batch(["a", "b"], ["a"])
    with pytest.raises(TypeError, match="item 1: response and reference must be str"):
        pool.verify_batch(["a", None], ["a", "b"])
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        pool.verify_batch(["a"], ["a"], timeout_s=0)
    assert pool.verify_batch([], []) == []


def test_a_worker_that_died_while_idle_is_replaced(pool: VerifierPool) -> None:
    os.kill(pool.worker_pids[0], signal.SIGKILL)
    time.sleep(0.2)
    assert pool.verify_batch(["\\boxed{5}"] * 4, ["5"] * 4) == [True] * 4


TRAINER_LIKE_SCRIPT = """
import pathlib
import jax  # a trainer's main module imports JAX at the top; verifier workers must not inherit or re-import it
from rstar_jax.reward import VerifierPool

if __name__ == "__main__":
    with VerifierPool(num_workers=1, timeout_s=5.0) as pool:
        results = pool.verify_batch(["\\\\boxed{9^{9^{9^{9}}}}", "\\\\boxed{4}"], ["9", "4"], timeout_s=1.0)
        maps = pathlib.Path(f"/proc/{pool.worker_pids[0]}/maps").read_text()
        print(results, "jaxlib" in maps, "jaxlib" in pathlib.Path("/proc/self/maps").read_text())
"""


def test_workers_of_a_jax_process_do_not_load_jax(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "trainer_like.py"
    script.write_text(TRAINER_LIKE_SCRIPT)
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["[False,", "True]", "False", "True"]


def test_worker_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        VerifierPool(num_workers=0)


def test_closed_pool_refuses_work() -> None:
    verifier_pool = VerifierPool(num_workers=1)
    verifier_pool.close()
    with pytest.raises(RuntimeError, match="closed VerifierPool"):
        verifier_pool.verify_batch(["\\boxed{1}"], ["1"])

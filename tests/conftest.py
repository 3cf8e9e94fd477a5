"""Test-session set-up shared by every test.

JAX reads XLA_FLAGS once at import, so the 8 simulated CPU devices the sharding tests need are requested here,
before any test module imports jax. Single-device tests are unaffected: unsharded arrays live on device 0.

Every test, and every process a test starts (the trainer killed and resumed, two JAX processes, the demo, sweeps),
shares one persistent XLA compilation cache in a folder made empty for the session, so CI still compiles each
program once: a resumed run or a later test that builds the same program loads it instead of compiling it again
(the RL trainer, SFT resume and sweep modules together, one run each back to back: 875 s without it, 730 s with
it, 2026-12-07; over a whole suite this machine's drift is as large).
A cached program is the same executable, so bit-exact comparisons between runs are unaffected. The lock that
`JAX_COMPILATION_CACHE_MAX_SIZE` turns on keeps processes compiling the same program at once from reading a
half-written entry.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_SESSION_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_COMPILATION_CACHE = tempfile.mkdtemp(prefix="rstar-jax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_COMPILATION_CACHE
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

from collections.abc import Iterator  # noqa: E402  (after the environment above)
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from rstar_jax.reward import VerifierPool


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the session's compilation cache (only the one made above, never a folder the caller named)."""
    if _SESSION_COMPILATION_CACHE is not None:
        shutil.rmtree(_SESSION_COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def verifier() -> Iterator["VerifierPool"]:
    """One verifier pool for the session (2 workers, 10 s per answer), as an entry point opens one and passes it
    down; imported here, not at the top, so sessions that never verify do not load the checkers."""
    from rstar_jax.reward import VerifierPool

    with VerifierPool(num_workers=2, timeout_s=10.0) as pool:
        yield pool


def _memory_map_count() -> tuple[int, int] | None:
    """This process's memory mappings and the kernel's limit on them (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return None


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs() -> Iterator[None]:
    """After each test module, drop JAX's compiled programs once this process holds a third of the kernel's memory
    mappings. XLA:CPU maps about three regions per compiled program and keeps them while JAX caches the program
    (20,868 mappings halfway through tests/model and tests/rollout); past `vm.max_map_count` (65,530 by default)
    the compiler's next mmap fails and the process dies with a segmentation fault inside `backend_compile_and_load`
    (seen twice, at 94% of the suite, in a JAX engine's warm-up). Clearing only past the threshold keeps programs
    shared by nearby modules (the engine tests) compiled once."""
    yield
    counts = _memory_map_count()
    if counts is not None and counts[0] > counts[1] // 3:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()

"""Test-session set-up shared by every test.

JAX reads XLA_FLAGS once at import, so the 8 simulated CPU devices the sharding tests need are requested here,
before any test module imports jax. Single-device tests are unaffected: unsharded arrays live on device 0.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Iterator  # noqa: E402  (after the environment above)
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from rstar_jax.reward import VerifierPool


@pytest.fixture(scope="session")
def verifier() -> Iterator["VerifierPool"]:
    """One verifier pool for the session (2 workers, 10 s per answer), as an entry point opens one and passes it
    down; imported here, not at the top, so sessions that never verify do not load the checkers."""
    from rstar_jax.reward import VerifierPool

    with VerifierPool(num_workers=2, timeout_s=10.0) as pool:
        yield pool

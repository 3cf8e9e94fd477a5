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

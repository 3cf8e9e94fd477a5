"""The server's knobs: pool size, queue bound and per-call limits, gin-configurable and overridable by flags.

Defaults follow SPEC section 6 (code-judge's 10 s default timeout) with room for the sympy-heavy snippets of math
tool use. Invalid gin bindings or values raise ValueError naming the offending binding or field.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import gin

from sandbox_server.api import RequestLimits

MIN_MEMORY_MB = 32

DEFAULT_PRELOAD = (
    "numpy",
    "sympy",
    "mpmath",
    "scipy",
    "math",
    "cmath",
    "fractions",
    "decimal",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "statistics",
    "random",
    "re",
    "json",
    "string",
    "threading",
    "subprocess",
    "multiprocessing",
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Everything a deployment tunes; each field is a gin parameter `SandboxConfig.<field>` and a CLI flag."""

    workers: int = max(2, 2 * (os.cpu_count() or 1))
    max_queue: int = 20_000
    default_timeout_s: float = 10.0
    max_timeout_s: float = 120.0
    default_memory_mb: int = 512
    max_memory_mb: int = 8192
    max_processes: int = 64
    max_open_files: int = 256
    max_file_size_mb: int = 32
    tmpfs_size_mb: int = 64
    output_cap_bytes: int = 64 * 1024  # per stream; SPEC 2: tool responses keep ~1,000 characters anyway
    max_code_bytes: int = 256 * 1024
    max_stdin_bytes: int = 4 * 1024 * 1024
    uid_base: int = 62_000
    preload_modules: tuple[str, ...] = DEFAULT_PRELOAD
    allow_unisolated: bool = False
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        positive = (
            "workers", "max_queue", "default_timeout_s", "max_timeout_s", "default_memory_mb", "max_memory_mb",
            "max_processes", "max_open_files", "max_file_size_mb", "tmpfs_size_mb", "output_cap_bytes",
            "max_code_bytes", "max_stdin_bytes", "uid_base", "shutdown_grace_s",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive number, got {value!r}")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(f"default_timeout_s {self.default_timeout_s} exceeds max_timeout_s {self.max_timeout_s}")
        if not MIN_MEMORY_MB <= self.default_memory_mb <= self.max_memory_mb:
            raise ValueError(
                f"default_memory_mb {self.default_memory_mb} must lie in [{MIN_MEMORY_MB}, max_memory_mb "
                f"{self.max_memory_mb}]"
            )
        if self.uid_base + self.workers > 65_533:
            raise ValueError(f"uid_base {self.uid_base} + workers {self.workers} leaves the 16-bit uid range")
        if isinstance(self.preload_modules, list):
            object.__setattr__(self, "preload_modules", tuple(self.preload_modules))
        if isinstance(self.preload_modules, str) or not all(isinstance(m, str) for m in self.preload_modules):
            raise ValueError(f"preload_modules must be a sequence of module names, got {self.preload_modules!r}")

    def request_limits(self) -> RequestLimits:
        """The bounds a `/run` body is validated against."""
        return RequestLimits(
            max_code_bytes=self.max_code_bytes,
            max_stdin_bytes=self.max_stdin_bytes,
            max_timeout_s=self.max_timeout_s,
            min_memory_mb=MIN_MEMORY_MB,
            max_memory_mb=self.max_memory_mb,
        )


def load_config(
    gin_files: Sequence[str] = (), gin_params: Sequence[str] = (), overrides: dict[str, object] | None = None
) -> SandboxConfig:
    """Parse gin files and bindings, then apply explicit (flag) overrides; errors name the bad binding."""
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(gin_params), finalize_config=False)
    except (ValueError, KeyError, TypeError, OSError, SyntaxError, RuntimeError) as exc:
        raise ValueError(f"invalid gin configuration ({gin_files=}, {gin_params=}): {exc}") from exc
    try:
        config = SandboxConfig()
    except TypeError as exc:
        raise ValueError(f"invalid gin binding for SandboxConfig: {exc}") from exc
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(SandboxConfig)}
    if unknown:
        raise ValueError(f"unknown SandboxConfig override(s) {sorted(unknown)}")
    return dataclasses.replace(config, **given)

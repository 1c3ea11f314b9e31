#!/usr/bin/env bash
# The GPU checks of the kernels (docs/KERNELS.md) in one run, for a machine with a CUDA GPU:
#   1. the kernel tests of tests/test_kernels.py that need CUDA or triton (auto/triton/torch backends
#      against the HF modules on the GPU in three dtypes, the Triton residual variant), plus the compile
#      tests;
#   2. `normswap bench --device cuda`: every norm vs a same-size copy and F.rms_norm, with the verdict
#      against the GPU targets (>= 80% of the copy's bandwidth in bfloat16 at hidden >= 2048, faster
#      than F.rms_norm) on the lines starting with "target".
# Needs python3 with a CUDA build of torch, triton, transformers, click, tqdm, pytest; no network: normswap
# runs from this checkout (PYTHONPATH), so nothing is installed. Results go to $OUT (default
# benchmarks/results/cuda): tests.log, bench.log, norm_kernels.json (+ .png with matplotlib).
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' || exit 2
import sys
try:
    import torch, triton
except ImportError as error:
    sys.exit(f"gpu_check: {error} (needs a CUDA build of torch and triton)")
if not torch.cuda.is_available():
    sys.exit("gpu_check: this torch sees no CUDA device")
print("torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())
PY
mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda or triton or compiled" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
python3 -m normswap bench --device cuda --rounds 30 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
exit $(( tests != 0 || bench != 0 ))

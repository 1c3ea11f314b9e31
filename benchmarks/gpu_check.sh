#!/usr/bin/env bash
# The GPU acceptance run of normswap, in one go, on a machine with one CUDA GPU (about 6 minutes on an H200,
# measured 2026-11-30; results of that run in benchmarks/results/cuda/):
#   tests     the CUDA tests: kernels (auto/triton/torch/compiled backends against the HF modules in three
#             dtypes, the Triton residual variant) and devices (convert on the GPU equals the CPU run, bf16
#             finds every norm, a model spread over CPU and GPU by accelerate), plus the meta-device guard;
#   zoo       `normswap zoo --device cuda`: every tiny architecture converted on the GPU in float32 (TF32
#             off), every row within 1e-5 of the unconverted model;
#   bench     `normswap bench --device cuda` on issue 13's shapes (16384x2048, 16384x4096, 8192x8192,
#             32768x4096; bfloat16, float16, float32; torch and triton backends, torch.compile of the HF
#             module, Liger-Kernel when importable) and decode sizes (1, 8, 128 rows, per call through the
#             module): $OUT/bench/norm_kernels.md holds the issue's tables and the target verdicts, .json
#             the numbers (63 s on an H200; the limit is 180 s);
#   llama     a random-weight ~1B Llama (bfloat16, norms re-randomized, benchmarks/gpu_models.py) saved to
#             disk, then `normswap convert DIR --dtype bfloat16 --device cuda`: the bf16 check must pass;
#   gemma3    the same for a Gemma-3-style model (1+w norms, sandwich and q/k norms);
#   devmap    `normswap convert` of the Llama with `--device-map auto` (accelerate's placement);
#   stream    `normswap convert` of the Llama streamed onto the device with `--max-memory` a quarter of its
#             weights: check and verification pass, and the device's peak memory (torch's
#             max_memory_allocated; on a CPU dry run the weights the streamed model held) stays under the
#             budget plus one layer's weights (or the largest module's in float32, for the bf16 check's
#             float32 reference run);
#   time      prefill (8 x 2048) and decode (32 tokens) of the original vs the converted Llama: the converted
#             one must not be slower (3% slack for noise).
# Each part writes a log under $OUT and one summary line (PASS/FAIL/SKIP) to $OUT/summary.txt; the exit
# code is 1 when any part fails, 2 when the machine cannot run the check at all.
#
# Needs python3 with a CUDA build of torch, triton, transformers, accelerate, click, tqdm, pytest
# (matplotlib optional); no network: normswap runs from this checkout (PYTHONPATH), nothing is installed.
# Liger-Kernel (an anchor of the bench part, never a dependency) is used when it imports, or from a wheel
# in .whl/ of this checkout, unpacked into $OUT and put on PYTHONPATH for the bench only. Fetch it where
# there is network: `pip download --no-deps liger-kernel==0.8.5 -d .whl` (pure Python, needs only
# torch and triton).
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#   DEVICE=cpu SIZE=tiny ZOO_ONLY="llama gemma3_text" bash benchmarks/gpu_check.sh   # CPU dry run (tests, CI)
#
# DEVICE (cuda) is where everything runs; SIZE (1b) the size of the generated models (tiny: hidden 64);
# ZOO_ONLY limits the zoo to some rows; PARTS ("tests zoo bench llama gemma3 devmap stream time") picks parts.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/cuda}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-1b}
ZOO_ONLY=${ZOO_ONLY:-}
PARTS=${PARTS:-tests zoo bench llama gemma3 devmap stream time}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if [ "$SIZE" = tiny ]; then
  TIMING=(--batch 2 --prefill 64 --decode 8 --rounds 3 --slack 100)  # a dry run times nothing meaningful
else
  TIMING=(--batch 8 --prefill 2048 --decode 32 --rounds 5)
fi

DEVICE="$DEVICE" python3 - <<'PY' || exit 2
import os, sys
try:
    import torch, transformers, accelerate
except ImportError as error:
    sys.exit(f"gpu_check: {error}")
device = os.environ["DEVICE"]
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit("gpu_check: this torch sees no CUDA device (DEVICE=cpu SIZE=tiny for a dry run)")
gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "none (dry run)"
print("gpu_check: torch", torch.__version__, "transformers", transformers.__version__, "accelerate",
      accelerate.__version__, "gpu", gpu)
PY
mkdir -p "$OUT"
: >"$OUT/summary.txt"
MODELS="$OUT/models"
rm -rf "$MODELS"
mkdir -p "$MODELS"
failed=0

# Steps that are more than one command, run by `part` in a child bash (exported below).
convert_new() {  # convert_new NAME MODEL_TYPE [normswap convert options...]: generate, then convert
  local name=$1 type=$2
  shift 2
  python3 benchmarks/gpu_models.py make "$type" --size "$SIZE" --device "$DEVICE" --out "$MODELS/$name" &&
    python3 -m normswap convert "$MODELS/$name" --dtype bfloat16 -o "$MODELS/$name-converted" \
      --report "$OUT/$name.json" "$@"
  local rc=$?
  [ -f "$OUT/$name.json" ] && report_line "$OUT/$name.json"
  return $rc
}
convert_devmap() {  # the generated Llama again, placed by accelerate (--device-map auto)
  python3 -m normswap convert "$MODELS/llama" --dtype bfloat16 --device-map auto -o "$MODELS/llama-devmap" \
    --report "$OUT/devmap.json"
  local rc=$?
  [ -f "$OUT/devmap.json" ] && report_line "$OUT/devmap.json"
  return $rc
}
convert_stream() {  # the generated Llama streamed onto $DEVICE, a quarter of its weights on the device at once
  local budget
  budget=$(python3 -c "import sys,os; print(sum(os.path.getsize(os.path.join(sys.argv[1], f)) for f in os.listdir(sys.argv[1]) if f.endswith('.safetensors')) // 4096, 'KiB', sep='')" "$MODELS/llama")
  python3 -m normswap convert "$MODELS/llama" --device "$DEVICE" --max-memory "$budget" \
    -o "$MODELS/llama-streamed" --report "$OUT/stream.json" || return $?
  python3 - "$OUT/stream.json" "$MODELS/llama" <<'PY'
import json, sys
from normswap.stream.shards import CheckpointReader
r = json.load(open(sys.argv[1]))
s, reader = r["streamed"], CheckpointReader(sys.argv[2])
layers = {n.split(".")[2] for n in reader.tensors if n.startswith("model.layers.")}
layer = max(sum(t.nbytes for n, t in reader.tensors.items() if n.startswith(f"model.layers.{i}.")) for i in layers)
# the half-precision check's reference also runs in float32: one module's weights then take 4 bytes each
module = max(layer, max(t.nbytes // t.dtype.itemsize * 4 for t in reader.tensors.values()))
peak = s.get("peak_device_bytes", s["peak_weight_bytes"])
ok = r["check"]["passed"] and r["verify"]["passed"] and peak <= s["budget"] + module
print(f"streamed on {s['device']}: check {'PASSED' if r['check']['passed'] else 'FAILED'}, verify "
      f"{'PASSED' if r['verify']['passed'] else 'FAILED'}, peak {peak / 2**20:.1f} MiB <= budget "
      f"{s['budget'] / 2**20:.1f} MiB + one layer or module in float32 {module / 2**20:.1f} MiB: {ok}")
sys.exit(0 if ok else 1)
PY
}
report_line() {  # report_line REPORT.json: norms and the check's verdict in one line
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c = r.get("check") or {}
print(f"{r['norms_found']} found / {r['norms_folded']} folded / {r['norms_swapped']} swapped; check "
      f"{'PASSED' if c.get('passed') else 'FAILED'}: max |logit diff| {c.get('max_abs_logit_diff'):.3g}, "
      f"KL {c.get('kl_mean'):.3g}, top-1 {c.get('top1_agreement'):.2%}")
PY
}
zoo_rows() {  # the zoo on $DEVICE (table in zoo.md); its last line: rows passed and the largest raw difference
  python3 - <<'PY'
import os, sys
from normswap import zoo
from normswap.device import resolve_device
only = os.environ["ZOO_ONLY"].split()
entries = [e for e in zoo.ZOO if not only or e.name in only]
results = zoo.run_zoo(entries, device=resolve_device(os.environ["DEVICE"]))
with open(os.path.join(os.environ["OUT"], "zoo.md"), "w") as f:
    f.write(zoo.coverage_markdown(results))
for r in results:
    print(f"{r.name}: max abs diff {r.max_abs_diff:.2e}, top-1 {r.top1:.0%}, {'ok' if r.passed else 'FAIL ' + str(r.error)}")
worst = max(results, key=lambda r: r.max_abs_diff)
print(f"{sum(r.passed for r in results)} / {len(results)} passed; max abs diff {worst.max_abs_diff:.2e} ({worst.name};"
      f" float32, <= {zoo.TOLERANCE:g})")
sys.exit(0 if all(r.passed for r in results) else 1)
PY
}
export -f report_line convert_new convert_devmap convert_stream zoo_rows
export OUT DEVICE SIZE ZOO_ONLY MODELS

# part NAME LIMIT_S COMMAND...: run COMMAND (log in $OUT/NAME.log), one summary line from its last line
part() {
  local name=$1 limit=$2
  shift 2
  if [[ " $PARTS " != *" $name "* ]]; then
    echo "SKIP $name" | tee -a "$OUT/summary.txt"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" bash -c '"$@"' part "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-200)
  local verdict=PASS
  if [ $rc -ne 0 ]; then
    verdict=FAIL
    failed=1
    [ $rc -eq 124 ] && last="timed out after ${limit} s; $last"
  fi
  echo "$verdict $name ($((SECONDS - t0)) s, exit $rc): $last" | tee -a "$OUT/summary.txt"
}

part llama 120 convert_new llama llama --device "$DEVICE"
part gemma3 120 convert_new gemma3 gemma3_text --device "$DEVICE"
part zoo 120 zoo_rows
if [ "${DEVICE%%:*}" = cuda ]; then
  part tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_device_guard.py \
    tests/test_cases_saved.py \
    tests/test_kernels.py -k "cuda or triton or compiled or meta or device"
else
  echo "SKIP tests: CUDA only (DEVICE=$DEVICE)" | tee -a "$OUT/summary.txt"
fi
if [ -d "$MODELS/llama-converted" ]; then
  part devmap 90 convert_devmap
  part stream 180 convert_stream
  part time 90 python3 benchmarks/gpu_models.py time "$MODELS/llama" "$MODELS/llama-converted" \
    --device "$DEVICE" --json "$OUT/timings.json" "${TIMING[@]}"
else
  echo "FAIL devmap, stream, time: no converted Llama (part llama failed)" | tee -a "$OUT/summary.txt"
  failed=1
fi
if [ "${DEVICE%%:*}" = cuda ]; then
  LIGER_PATH=""
  whl=$(ls .whl/liger_kernel*.whl 2>/dev/null | tail -n 1)
  if [ -n "$whl" ] && python3 -m zipfile -e "$whl" "$OUT/liger" 2>/dev/null; then
    LIGER_PATH="$PWD/$OUT/liger"
    [[ "$OUT" = /* ]] && LIGER_PATH="$OUT/liger"
  fi
  part bench 180 env PYTHONPATH="$PYTHONPATH${LIGER_PATH:+:$LIGER_PATH}" python3 -m normswap bench \
    --device "$DEVICE" --dtypes bfloat16,float16,float32 --shapes 16384x2048,16384x4096,8192x8192,32768x4096 \
    --backends torch,triton --rounds 7 --out "$OUT/bench"
  rm -rf "$OUT/liger"
else
  echo "SKIP bench: CUDA only (DEVICE=$DEVICE)" | tee -a "$OUT/summary.txt"
fi
rm -rf "$MODELS"  # ~6 GB of random weights at SIZE=1b
echo "gpu_check: $(grep -c '^PASS' "$OUT/summary.txt") passed, $(grep -c '^FAIL' "$OUT/summary.txt") failed;" \
  "logs and results in $OUT"
exit $failed

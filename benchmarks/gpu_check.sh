#!/usr/bin/env bash
# The GPU acceptance run of normswap, in one go, on a machine with one CUDA GPU. Parts, in the order they run
# (the tests run in the background beside the converts; the timed parts run alone):
#   tests     the CUDA tests: kernels (auto/triton/torch/compiled backends against the HF modules in three
#             dtypes, the Triton residual variant, fused modules captured in a CUDA graph) and devices (convert
#             on the GPU equals the CPU run, bf16 finds every norm, a model spread over CPU and GPU by
#             accelerate), plus the meta-device guard;
#   llama     a random-weight ~1B Llama (bfloat16, norms re-randomized, benchmarks/gpu_models.py) saved to
#             disk, then `normswap convert DIR --dtype bfloat16 --device cuda`: the bf16 check must pass;
#   gemma3    the same for a Gemma-3-style model (1+w norms, sandwich and q/k norms);
#   zoo       `normswap zoo --device cuda`: every tiny architecture converted on the GPU in float32 (TF32
#             off), every row within 1e-5 of the unconverted model;
#   devmap    `normswap convert` of the Llama with `--device-map auto` (accelerate's placement);
#   time      prefill (8 x 2048) and decode (32 tokens) of the original vs the converted Llama, eager, and
#             decode under transformers' compiled static cache (torch.compile, fullgraph, mode
#             reduce-overhead: CUDA graphs; no recompile per call): the converted one must not be slower (3%
#             slack for noise);
#   bench     `normswap bench --device cuda` on the kernel table's shapes (16384x2048, 16384x4096, 8192x8192,
#             32768x4096; bfloat16, float16, float32; torch and triton backends, torch.compile of the HF
#             module, Liger-Kernel when importable), decode sizes per call through the module (1, 8, 128
#             rows) eager and replayed from a CUDA graph: $OUT/bench/norm_kernels.md holds the tables and the
#             target verdicts (parity with torch's kernels, the eager module within 3 us of F.rms_norm);
#   rotzoo    every tiny architecture rotated on the GPU (`normswap.convert(model, rotate="hadamard")`, float32):
#             logits within 1e-5 of the original, or refused in one line (weighted post-norms);
#   rotate    `normswap convert` of the Llama with `--rotate hadamard`: the bf16 check must pass;
#   stream    the Llama streamed onto the GPU under `--max-memory $STREAM_BUDGET`: check passes and the peak
#             device memory of the convert (torch's allocator) stays under the budget plus one decoder layer;
#   auto      the automatic streaming choice: with a ballast process holding all but $AUTO_FREE of the GPU's
#             memory, the plain `normswap convert --device cuda` (no memory flag) must stream and pass;
#   sweep     `python -m normswap.bench.sweep`: the Triton kernel's launch configurations side by side on the
#             table's shapes ($SWEEP_DTYPES), every configuration's output within 2 ulps of the default's.
# rotzoo, rotate, stream and auto report SKIP when this checkout's `normswap convert` lacks the feature
# (--rotate; streaming onto a GPU; --no-stream). Each part writes a log under $OUT and one summary line
# (PASS/FAIL/SKIP) to $OUT/summary.txt; a part starts only if its time limit still fits in $BUDGET_S seconds
# from the start, so the whole run ends within BUDGET_S (a part left out is listed "SKIP ... time budget":
# run those with PARTS=... in a second call). The exit code is 1 when any part fails, 2 when the machine
# cannot run the check at all.
#
# Needs python3 with a CUDA build of torch, triton, transformers, accelerate, click, tqdm, pytest
# (matplotlib optional); no network: normswap runs from this checkout (PYTHONPATH). Wheels of what the
# machine may lack travel in .whl/ of this checkout (ignored by git); fetch them where there is network with
#   bash benchmarks/fetch_wheels.sh      # gguf (the GGUF tests), liger-kernel (a bench anchor)
# gguf is installed from there into a temporary folder when it does not import; Liger-Kernel (never a
# dependency) is put on the bench part's PYTHONPATH only.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#   DEVICE=cpu SIZE=tiny ZOO_ONLY="llama gemma3_text" bash benchmarks/gpu_check.sh   # CPU dry run (tests, CI)
#
# DEVICE (cuda) is where everything runs; SIZE (1b) the size of the generated models (tiny: hidden 64);
# ZOO_ONLY limits the zoo rows; PARTS (all of the above) picks parts; BUDGET_S (540) the time budget;
# STREAM_BUDGET (1GB; tiny: 64KB) the stream part's --max-memory; AUTO_FREE (4GiB) what the auto part's
# ballast leaves free; SWEEP_DTYPES (bfloat16) the sweep's dtypes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/cuda}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-1b}
ZOO_ONLY=${ZOO_ONLY:-}
PARTS=${PARTS:-tests llama gemma3 zoo devmap time bench rotzoo rotate stream auto sweep}
BUDGET_S=${BUDGET_S:-540}
AUTO_FREE=${AUTO_FREE:-4GiB}
SWEEP_DTYPES=${SWEEP_DTYPES:-bfloat16}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if [ "$SIZE" = tiny ]; then
  TIMING=(--batch 2 --prefill 64 --decode 24 --rounds 3 --slack 100 --compiled --compile-backend eager)
  STREAM_BUDGET=${STREAM_BUDGET:-64KB}  # a dry run times nothing meaningful
else
  TIMING=(--batch 8 --prefill 2048 --decode 32 --rounds 5 --compiled)
  STREAM_BUDGET=${STREAM_BUDGET:-1GB}
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
MODELS=$(mktemp -d "$OUT/models.XXXXXX")  # a new folder: the clean-ups below delete only what this run wrote
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT

# Carried wheels: gguf, when it does not import (pure Python; numpy, pyyaml, requests, tqdm are there).
if ! python3 -c "import gguf" 2>/dev/null; then
  whl=$(ls .whl/gguf-*.whl 2>/dev/null | tail -n 1)
  if [ -n "$whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl"; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
    echo "gpu_check: gguf installed from $whl"
  else
    echo "gpu_check: gguf does not import and no .whl/gguf-*.whl (bash benchmarks/fetch_wheels.sh): its tests skip"
  fi
fi

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
convert_again() {  # convert_again NAME [normswap convert options...]: the generated Llama, converted another way
  local name=$1
  shift
  python3 -m normswap convert "$MODELS/llama" --dtype bfloat16 -o "$MODELS/llama-$name" --report "$OUT/$name.json" "$@"
  local rc=$?
  [ -f "$OUT/$name.json" ] && report_line "$OUT/$name.json"
  rm -rf "$MODELS/llama-$name"
  return $rc
}
has_option() {  # has_option OPTION: whether this checkout's `normswap convert --help` lists OPTION
  python3 -m normswap convert --help 2>/dev/null | grep -q -- "$1"
}
rotate_llama() {
  has_option --rotate || { echo "SKIP: normswap convert has no --rotate in this checkout"; return 77; }
  convert_again rotate --device "$DEVICE" --rotate hadamard
}
report_line() {  # report_line REPORT.json: norms and the check's verdict in one line
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c = r.get("check") or {}
streamed = " (streamed)" if r.get("streamed") else ""
print(f"{r['norms_found']} found / {r['norms_folded']} folded / {r['norms_swapped']} swapped{streamed}; check "
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
rotate_zoo() {  # every zoo row rotated on $DEVICE through the Python API: exact (logits) or refused in one line
  python3 - <<'PY'
import copy, inspect, os, sys
import torch
import normswap
from normswap import zoo
from normswap.device import exact_float32, resolve_device
if "rotate" not in inspect.signature(normswap.convert).parameters:
    print("SKIP: normswap.convert has no rotate argument in this checkout")
    sys.exit(77)
device = resolve_device(os.environ["DEVICE"])
only = os.environ["ZOO_ONLY"].split()
exact = refused = 0
failed = []
for entry in [e for e in zoo.ZOO if not only or e.name in only]:
    with exact_float32():
        model = zoo.tiny_model(entry.model_type, **entry.overrides).to(device)
        if getattr(model, "get_output_embeddings", lambda: None)() is None:
            print(f"{entry.name}: no logits (a rotation moves hidden states by Q): not compared")
            continue
        ids = zoo.example_ids().to(device)
        before = zoo.model_outputs(copy.deepcopy(model), ids)
        try:
            normswap.convert(model, rotate="hadamard")
        except normswap.NormswapError as error:
            one_line = "\n" not in str(error).strip()
            print(f"{entry.name}: refused: {error}" + ("" if one_line else "  [FAIL: not one line]"))
            refused += 1
            if not one_line:
                failed.append(entry.name)
            continue
        except Exception as error:  # noqa: BLE001 - a row records the failure
            print(f"{entry.name}: FAIL {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            failed.append(entry.name)
            continue
        diff = (zoo.model_outputs(model, ids) - before).abs().max().item()
    ok = diff <= zoo.TOLERANCE
    exact += ok
    print(f"{entry.name}: rotated, max abs logit diff {diff:.2e} {'ok' if ok else 'FAIL'}")
    if not ok:
        failed.append(entry.name)
print(f"{exact} rotated within {zoo.TOLERANCE:g}, {refused} refused, {len(failed)} failed"
      + (f": {', '.join(failed)}" if failed else "") + f" (float32, {device})")
sys.exit(1 if failed or not exact else 0)
PY
}
stream_convert() {  # the Llama streamed onto $DEVICE under --max-memory $STREAM_BUDGET; peak device memory
  python3 - "$MODELS/llama" "$MODELS/llama-streamed" "$OUT/stream.json" "$STREAM_BUDGET" <<'PY'
import contextlib, io, json, os, re, sys
import torch
from safetensors import safe_open
from normswap.cli import main
from normswap.stream.source import parse_size

model, out, report, budget = sys.argv[1:5]
device = os.environ["DEVICE"]
cuda = device.startswith("cuda")
# One decoder layer: the largest group of checkpoint tensors sharing a numbered prefix (model.layers.N.), in
# bfloat16; or one tensor in float32 (the bfloat16 check's reference runs upcast to float32), if larger.
layers, largest = {}, 0
for name in sorted(os.listdir(model)):
    if name.endswith(".safetensors"):
        with safe_open(os.path.join(model, name), "pt") as f:
            for key in f.keys():
                n = 1
                for s in f.get_slice(key).get_shape():
                    n *= s
                largest = max(largest, n * 4)
                m = re.match(r"(.*?\.\d+)\.", key)
                if m:
                    layers[m.group(1)] = layers.get(m.group(1), 0) + n * 2  # bfloat16
layer = max(max(layers.values()), largest)
if cuda:
    torch.cuda.reset_peak_memory_stats()
err = io.StringIO()
args = ["convert", model, "--dtype", "bfloat16", "--device", device, "--max-memory", budget, "-o", out,
        "--report", report]
with contextlib.redirect_stderr(err):
    try:
        rc = main(args, standalone_mode=False) or 0
    except SystemExit as e:
        rc = e.code or 0
sys.stderr.write(err.getvalue())
if rc == 2 and "streaming runs on the CPU" in err.getvalue():
    print(f"SKIP: this checkout streams on the CPU only ({err.getvalue().strip().splitlines()[-1]})")
    sys.exit(77)
r = json.load(open(report)) if os.path.exists(report) else {}
limit = parse_size(budget) + layer
# on a CPU dry run: the bytes of weights the streamed model held at once (the report's streamed entry)
peak = torch.cuda.max_memory_allocated() if cuda else (r.get("streamed") or {}).get("peak_weight_bytes")
streamed = bool(r.get("streamed"))
passed = rc == 0 and streamed and (peak is None or peak <= limit)
held = "peak device memory" if cuda else "peak weights held"
where = (f"{held} {peak / 2**20:.1f} MiB <= {limit / 2**20:.1f} MiB (budget {budget} + one layer or float32 "
         f"module {layer / 2**20:.1f} MiB)" if peak is not None else f"{held}: n/a")
if peak is not None and peak > limit:
    where = where.replace("<=", "> (FAIL)")
print(f"stream: exit {rc}, {'streamed' if streamed else 'NOT streamed'}, check "
      f"{'PASSED' if (r.get('check') or {}).get('passed') else 'FAILED'}; {where}")
sys.exit(0 if passed else 1)
PY
  local rc=$?
  rm -rf "$MODELS/llama-streamed"
  return $rc
}
auto_stream() {  # the automatic streaming choice: plain convert, no memory flag
  has_option --no-stream || { echo "SKIP: normswap convert has no automatic streaming (--no-stream) in this checkout"; return 77; }
  if [ "${DEVICE%%:*}" != cuda ]; then  # the dry run: a model that fits is converted in memory
    convert_again auto --device "$DEVICE" || return 1
    python3 -c "import json,sys; r=json.load(open('$OUT/auto.json')); sys.exit(1 if r.get('streamed') else 0)" ||
      { echo "FAIL: a model that fits was streamed"; return 1; }
    echo "auto: fits, converted in memory (no memory pressure can be made on the CPU)"
    return 0
  fi
  # A ballast process takes all but $AUTO_FREE of the GPU, so the in-memory path (~3x the bf16 model) cannot fit.
  python3 - "$AUTO_FREE" "$OUT/ballast.ready" <<'PY' &
import sys, time, torch
from normswap.stream.source import parse_size
free, total = torch.cuda.mem_get_info()
keep = parse_size(sys.argv[1])
ballast = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
open(sys.argv[2], "w").write(f"{ballast.numel()}\n")
time.sleep(3600)
PY
  local ballast=$! i
  for i in $(seq 120); do [ -f "$OUT/ballast.ready" ] && break; sleep 0.5; done
  python3 -c "import torch; f, t = torch.cuda.mem_get_info(); print(f'auto: {f / 2**30:.1f} GiB of {t / 2**30:.0f} GiB free beside the ballast')"
  convert_again auto --device "$DEVICE"
  local rc=$?
  kill "$ballast" 2>/dev/null
  wait "$ballast" 2>/dev/null
  rm -f "$OUT/ballast.ready"
  [ $rc -ne 0 ] && return $rc
  python3 -c "import json,sys; r=json.load(open('$OUT/auto.json')); sys.exit(0 if r.get('streamed') else 1)" ||
    { echo "FAIL: with $AUTO_FREE free the plain convert did not stream"; return 1; }
  echo "auto: with $AUTO_FREE free on the GPU the plain convert streamed and passed"
}
bench_part() {
  local liger=""
  local whl
  whl=$(ls .whl/liger_kernel*.whl 2>/dev/null | tail -n 1)
  if [ -n "$whl" ] && python3 -m zipfile -e "$whl" "$SITE/liger" 2>/dev/null; then
    liger="$SITE/liger"
  fi
  PYTHONPATH="$PYTHONPATH${liger:+:$liger}" python3 -m normswap bench --device "$DEVICE" \
    --dtypes bfloat16,float16,float32 --shapes 16384x2048,16384x4096,8192x8192,32768x4096 \
    --backends torch,triton --rounds 7 --out "$OUT/bench"
}
export -f report_line convert_new convert_again has_option rotate_llama zoo_rows rotate_zoo stream_convert \
  auto_stream bench_part
export OUT DEVICE SIZE ZOO_ONLY MODELS STREAM_BUDGET AUTO_FREE SITE

# part NAME LIMIT_S COMMAND...: run COMMAND (log in $OUT/NAME.log), one summary line from its last line;
# exit 77 from COMMAND means SKIP (a feature this checkout lacks).
part() {
  local name=$1 limit=$2
  shift 2
  if [[ " $PARTS " != *" $name "* ]]; then
    echo "SKIP $name" | tee -a "$OUT/summary.txt"
    return 0
  fi
  if ((SECONDS + limit > BUDGET_S)); then
    echo "SKIP $name: time budget (${SECONDS} s of BUDGET_S=$BUDGET_S spent; rerun with PARTS=$name)" |
      tee -a "$OUT/summary.txt"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" bash -c '"$@"' part "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-200)
  local verdict=PASS
  if [ $rc -eq 77 ]; then
    verdict=SKIP
  elif [ $rc -ne 0 ]; then
    verdict=FAIL
    [ $rc -eq 124 ] && last="timed out after ${limit} s; $last"
  fi
  echo "$verdict $name ($((SECONDS - t0)) s, exit $rc): $last" | tee -a "$OUT/summary.txt"
}

tests_pid=""
if [ "${DEVICE%%:*}" = cuda ]; then  # in the background, beside the converts (neither times anything)
  part tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_device_guard.py \
    tests/test_cases_saved.py tests/test_kernels.py -k "(cuda or triton or compiled or meta or device) and not interpreter" &
  tests_pid=$!
else
  echo "SKIP tests: CUDA only (DEVICE=$DEVICE)" | tee -a "$OUT/summary.txt"
fi
part llama 120 convert_new llama llama --device "$DEVICE"
part gemma3 120 convert_new gemma3 gemma3_text --device "$DEVICE"
part zoo 120 zoo_rows
llama_ok=""
[ -d "$MODELS/llama-converted" ] && llama_ok=1
[ -n "$llama_ok" ] && part devmap 90 convert_again devmap --device-map auto
[ -n "$tests_pid" ] && wait "$tests_pid"  # the parts below time the GPU or take all of it
if [ -n "$llama_ok" ]; then
  part time 300 python3 benchmarks/gpu_models.py time "$MODELS/llama" "$MODELS/llama-converted" \
    --device "$DEVICE" --json "$OUT/timings.json" "${TIMING[@]}"
fi
if [ "${DEVICE%%:*}" = cuda ]; then
  part bench 180 bench_part
else
  echo "SKIP bench: CUDA only (DEVICE=$DEVICE)" | tee -a "$OUT/summary.txt"
fi
part rotzoo 90 rotate_zoo
if [ -n "$llama_ok" ]; then
  part rotate 120 rotate_llama
  part stream 180 stream_convert
  part auto 180 auto_stream
else
  echo "FAIL devmap, time, rotate, stream, auto: no converted Llama (part llama failed)" | tee -a "$OUT/summary.txt"
fi
if [ "${DEVICE%%:*}" = cuda ]; then
  part sweep 150 python3 -m normswap.bench.sweep --device "$DEVICE" --dtypes "$SWEEP_DTYPES" --rounds 7 \
    --out "$OUT/bench"
else
  echo "SKIP sweep: CUDA only (DEVICE=$DEVICE)" | tee -a "$OUT/summary.txt"
fi
rm -rf "$MODELS"  # ~6 GB of random weights at SIZE=1b
echo "gpu_check: $(grep -c '^PASS' "$OUT/summary.txt") passed, $(grep -c '^FAIL' "$OUT/summary.txt") failed," \
  "$(grep -c '^SKIP' "$OUT/summary.txt") skipped in $SECONDS s; logs and results in $OUT"
grep -q '^FAIL' "$OUT/summary.txt" && exit 1
exit 0

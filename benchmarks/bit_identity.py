"""Bit-identity of the written checkpoints between two versions of normswap (a redesign keeps outputs).

Three steps, each run by the normswap that is importable (``PYTHONPATH=CHECKOUT`` picks a checkout):

    python benchmarks/bit_identity.py inputs DIR           # once: the zoo rows and SmolLM2 saved as inputs
    python benchmarks/bit_identity.py run DIR OUT.json     # convert every case, hash what was written
    python benchmarks/bit_identity.py compare A.json B.json

``inputs`` saves every zoo row that ``save_pretrained`` can write (``normswap.zoo.tiny_model``, constant
parameters re-randomized) and SmolLM2-135M as float32 safetensors shards, so that both versions convert the
very same files whatever their fixtures do. ``run`` converts each input through the CLI (in this process,
click's runner) with every option set of ``CASES`` (in memory, and streamed with ``--max-memory 64KB`` for
causal LMs), plus the short-name models from their GGUF/safetensors wheels (``--real``), and records per case:
the exit code, the summary lines (times dropped), a SHA-256 per written tensor, per other file, and
``normswap.json`` without its timings. ``compare`` prints the cases whose tensors differ (exit 1 if any), then
the other differences (files, report keys, summary lines), which a change may make on purpose.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CASES = {  # name -> extra CLI options
    "plain": [],
    "rmsnorm": ["--norm", "rmsnorm"],
    "rotate": ["--rotate", "hadamard"],
    "rotate-heads": ["--rotate", "hadamard", "--rotate-heads"],
    "keep-hidden": ["--keep-hidden-states"],
    "streamed": ["--max-memory", "64KB"],
    "streamed-rmsnorm": ["--max-memory", "64KB", "--norm", "rmsnorm"],
    "streamed-rotate": ["--max-memory", "64KB", "--rotate", "hadamard"],
    "streamed-rotate-heads": ["--max-memory", "64KB", "--rotate", "hadamard", "--rotate-heads"],
}
REAL = {  # short name or input folder -> cases
    "smollm2-135m": ["plain", "rotate", "rotate-heads"],
    "gemma3-270m": ["plain", "rotate"],
    "minilm-l6": ["plain", "rmsnorm"],
    "@smollm2-sharded": ["streamed", "streamed-rotate"],
}


def write_inputs(folder: Path) -> None:
    """Save every zoo row (and SmolLM2 as shards) under ``folder``; rows that cannot be saved are listed."""
    import torch

    from normswap.zoo import ZOO, tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    skipped = {}
    for entry in ZOO:
        out = folder / entry.name
        if out.exists():
            continue
        try:
            model = tiny_model(entry.model_type, **entry.overrides)
            model.save_pretrained(out)
        except Exception as error:  # noqa: BLE001 - a row that is no saved checkpoint (the custom model)
            shutil.rmtree(out, ignore_errors=True)
            skipped[entry.name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    sharded = folder / "@smollm2-sharded"
    if not sharded.exists():
        from normswap.io import load_model
        from normswap.io.save import plain_float_checkpoint

        loaded = load_model("smollm2-135m", dtype="float32")
        with plain_float_checkpoint(loaded.model), torch.no_grad():
            loaded.model.save_pretrained(sharded, max_shard_size="200MB")
        loaded.tokenizer.save_pretrained(sharded)
    (folder / "skipped.json").write_text(json.dumps(skipped, indent=1))
    print(f"inputs in {folder}; not saved: {sorted(skipped) or 'none'}")


def _causal(folder: Path) -> bool:
    config = json.loads((folder / "config.json").read_text())
    return not config.get("is_encoder_decoder") and any(
        a.endswith("ForCausalLM") for a in config.get("architectures") or []
    )


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def hash_output(folder: Path) -> dict:
    """Per written tensor a SHA-256 of its bytes with dtype and shape; per other file its SHA-256;
    ``normswap.json`` without timings."""
    from safetensors import safe_open

    tensors, files, report = {}, {}, None
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        rel = str(path.relative_to(folder))
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    t = f.get_tensor(name)
                    raw = t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                    tensors[f"{rel}:{name}"] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
        elif rel == "normswap.json":
            report = json.loads(path.read_text())
            for key in ("timings", "normswap_version"):
                report.pop(key, None)
        else:
            files[rel] = digest(path)
    return {"tensors": tensors, "files": files, "report": report}


def run_case(source: str, options: list[str]) -> dict:
    from click.testing import CliRunner

    from normswap.cli import main

    with tempfile.TemporaryDirectory(dir=os.environ.get("BIT_IDENTITY_TMP")) as tmp:
        out = Path(tmp) / "out"
        started = time.perf_counter()
        result = CliRunner().invoke(main, ["convert", source, "--output", str(out), *options])
        record = {
            "exit": result.exit_code,
            "seconds": round(time.perf_counter() - started, 1),
            "lines": [
                line.replace(str(out), "OUT")  # the temporary output folder differs from run to run
                for line in (result.output or "").splitlines()
                if not line.startswith(("time:", "report:", "saved:", "verified:"))
            ],  # fmt: skip
        }
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            record["exception"] = f"{type(result.exception).__name__}: {result.exception}"
        if out.is_dir():
            record |= hash_output(out)
    return record


def run_row(source: str, cases: list[str], out: Path) -> None:
    """Convert ``source`` with each of ``cases`` (keys of ``CASES``) in this process; the records as JSON."""
    out.write_text(json.dumps({case: run_case(source, CASES[case]) for case in cases}))


def _in_child(source: str, cases: list[str]) -> dict:
    """``run_row`` in a child process (one import of torch per row): a crash of the conversion (a
    segmentation fault) is recorded as that case's result, and the other cases still run."""
    import subprocess

    results: dict = {}
    while len(results) < len(cases):
        rest = [c for c in cases if c not in results]
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / "row.json"
            command = [sys.executable, __file__, "row", source, str(file), *rest]
            done = subprocess.run(command, capture_output=True, text=True)
            if file.exists():
                results |= json.loads(file.read_text())
            else:  # the first case crashed the process: record it and go on with the others
                tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
                results[rest[0]] = {"exit": done.returncode, "lines": [], "exception": f"crashed: {tail[0]}"}
                for case in rest[1:]:  # a row's cases run one by one once one crashed
                    with tempfile.TemporaryDirectory() as tmp2:
                        one = Path(tmp2) / "one.json"
                        r = subprocess.run([sys.executable, __file__, "row", source, str(one), case],
                                           capture_output=True, text=True)  # fmt: skip
                        results[case] = json.loads(one.read_text())[case] if one.exists() else {
                            "exit": r.returncode, "lines": [], "exception": "crashed"}  # fmt: skip
    return results


def run_all(folder: Path, out: Path, only: list[str], real: bool, zoo: bool, kinds: list[str]) -> None:
    results = json.loads(out.read_text()) if out.exists() else {}
    jobs = []
    if zoo:
        for row in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("@")):
            for case, options in CASES.items():
                if case.startswith("streamed") and not _causal(row):
                    continue
                jobs.append((f"{row.name}/{case}", str(row), options))
    if real:
        for name, cases in REAL.items():
            source = str(folder / name) if name.startswith("@") else name
            jobs += [(f"{name}/{case}", source, CASES[case]) for case in cases]
    jobs = [j for j in jobs if not only or any(j[0].startswith(o) for o in only)]
    jobs = [j for j in jobs if not kinds or j[0].rpartition("/")[2] in kinds]
    rows: dict[str, list[str]] = {}
    for key, source, _ in jobs:
        if key not in results:
            rows.setdefault(source, []).append(key.rpartition("/")[2])
    for i, (source, cases) in enumerate(rows.items()):
        name = Path(source).name if os.sep in source else source
        for case, r in _in_child(source, cases).items():
            results[f"{name}/{case}"] = r
            print(f"[row {i + 1}/{len(rows)}] {name}/{case}: exit {r['exit']}, {len(r.get('tensors', {}))} "
                  f"tensors, {r.get('seconds', '?')} s", flush=True)  # fmt: skip
        out.write_text(json.dumps(results, indent=0, sort_keys=True))


VOLATILE = {"peak_rss_mib", "path", "peak_weight_bytes", "available", "budget"}  # differ between runs


def _report_diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        diffs = []
        for k in sorted(set(a) | set(b)):
            if k in VOLATILE:
                continue
            if k not in a or k not in b:
                diffs.append(f"{path}.{k}: {'only in B' if k not in a else 'only in A'}")
            else:
                diffs += _report_diff(a[k], b[k], f"{path}.{k}")
        return diffs
    return [] if a == b else [f"{path}: {json.dumps(a)[:120]} -> {json.dumps(b)[:120]}"]


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    keys = sorted(set(a) & set(b))
    tensor_fail, other = [], []
    for key in keys:
        ra, rb = a[key], b[key]
        if ra["exit"] != rb["exit"]:
            tensor_fail.append(f"{key}: exit {ra['exit']} -> {rb['exit']}")
            continue
        ta, tb = ra.get("tensors", {}), rb.get("tensors", {})
        if ta != tb:
            changed = sorted(n for n in set(ta) | set(tb) if ta.get(n) != tb.get(n))
            tensor_fail.append(f"{key}: {len(changed)} tensors differ ({', '.join(changed[:3])})")
        if ra.get("files", {}) != rb.get("files", {}):
            fa, fb = ra.get("files", {}), rb.get("files", {})
            other.append(f"{key}: files {sorted(n for n in set(fa) | set(fb) if fa.get(n) != fb.get(n))}")
        for d in _report_diff(ra.get("report"), rb.get("report"), "normswap.json")[:5]:
            other.append(f"{key}: {d}")
        if ra["lines"] != rb["lines"]:
            other.append(f"{key}: summary lines differ")
    print(f"{len(keys)} cases compared ({len(set(a) ^ set(b))} in one file only)")
    print(f"tensors or exit codes differ: {len(tensor_fail)}")
    for line in tensor_fail:
        print("  " + line)
    print(f"other differences: {len(other)}")
    for line in other:
        print("  " + line)
    return 1 if tensor_fail else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inputs")
    p.add_argument("folder", type=Path)
    p = sub.add_parser("run")
    p.add_argument("folder", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--only", nargs="*", default=[], help="case keys starting with these")
    p.add_argument("--real", action="store_true", help="also the short-name models (slow)")
    p.add_argument("--no-zoo", action="store_true")
    p.add_argument("--cases", nargs="*", default=[], choices=list(CASES), help="only these cases")
    p = sub.add_parser("row", help="one input with several cases, in this process (run uses it)")
    p.add_argument("source")
    p.add_argument("out", type=Path)
    p.add_argument("cases", nargs="+")
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "inputs":
        write_inputs(args.folder)
        return 0
    if args.command == "run":
        run_all(args.folder, args.out, args.only, args.real, not args.no_zoo, args.cases)
        return 0
    if args.command == "row":
        run_row(args.source, args.cases, args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())

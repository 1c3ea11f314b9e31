"""normswap's in-memory peak estimate (normswap/memory.py) against the measured peak of `normswap convert`.

    python benchmarks/bench_memory.py                                  # the default cases below
    python benchmarks/bench_memory.py --cases "bfloat16:0.5GiB,float32:1GiB:tied" --work /tmp/m

Each case is ``STORED_DTYPE:SIZE[:tied][:float32]``: a synthetic Llama-shaped checkpoint
(benchmarks/make_checkpoint.py, "small" preset: hidden 1024, vocabulary 49152, the layer count set by
SIZE, 300 MB shards) stored in STORED_DTYPE, with a tied ``lm_head`` for ``tied``, converted in its own dtype
(``--dtype auto``) or, with ``float32``, in float32. Each is converted in memory (``--no-stream``) in its own
process under ``/usr/bin/time -v`` (peak RSS = "Maximum resident set size"), next to ``memory.estimate``
for it, then deleted. Writes ``memory.json`` and ``memory.md`` into --out (default benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CASES = "float32:0.5GiB,bfloat16:0.5GiB,float32:1GiB:tied,bfloat16:1GiB:tied,bfloat16:0.5GiB:float32"


def _case(text: str) -> dict:
    stored, size, *flags = text.split(":")
    return {
        "stored": stored,
        "size": size,
        "tied": "tied" in flags,
        "dtype": "float32" if "float32" in flags else "auto",
        "name": text,
    }


def _estimate(folder: Path, dtype: str) -> dict:
    from normswap import memory
    from normswap.io.load import load_config, resolve, resolve_dtype

    resolved = resolve(str(folder))
    config = load_config(resolved)
    torch_dtype = resolve_dtype(dtype, resolved, config)
    guess = memory.estimate(memory.checkpoint_tensors(folder), config, torch_dtype)
    return {
        "estimate_gib": guess.peak / 2**30,
        "stage": guess.stage,
        "dtype": str(torch_dtype)[6:],
        "parts_gib": {k: round(v / 2**30, 3) for k, v in guess.parts.items()},
        "layers": config.num_hidden_layers,
    }


def _load_average() -> float:
    return os.getloadavg()[0]


@click.command()
@click.option(
    "--cases", default=CASES, show_default=True, help="Comma-separated STORED:SIZE[:tied][:float32]."
)
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/normswap-bench-memory"))
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results")
@click.option("--append", is_flag=True, help="Add the rows to those of --out's memory.json.")
def main(cases, work, out, append):
    """Estimate vs measured in-memory peak, one conversion per case."""
    from normswap.bench.report import run_folder

    work = run_folder(work)  # everything deleted below was written into this new folder
    rows = json.loads((out / "memory.json").read_text()) if append and (out / "memory.json").is_file() else []
    for case in map(_case, cases.split(",")):
        src, dst = work / "src", work / "out"
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
        make = [
            sys.executable,
            str(ROOT / "benchmarks" / "make_checkpoint.py"),
            str(src),
            "--size",
            case["size"],
            "--dtype",
            case["stored"],
            "--max-shard-size",
            "300MB",
        ] + (["--tied"] if case["tied"] else [])
        subprocess.run(make, cwd=ROOT, check=True)
        row = dict(case, **_estimate(src, case["dtype"]))
        command = [
            "/usr/bin/time",
            "-v",
            sys.executable,
            "-m",
            "normswap",
            "convert",
            str(src),
            "-o",
            str(dst),
            "--no-stream",
            "--dtype",
            case["dtype"],
        ]
        load, start = _load_average(), time.perf_counter()
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        peak = next(int(line.split()[-1]) for line in done.stderr.splitlines() if "Maximum resident" in line)
        row.update(
            exit=done.returncode,
            measured_gib=peak / 2**20,
            wall_s=round(time.perf_counter() - start, 1),
            load_average=round(max(load, _load_average()), 1),
            size_gib=sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**30,
        )
        row["ratio"] = row["estimate_gib"] / row["measured_gib"]
        click.echo(
            f"{case['name']}: estimate {row['estimate_gib']:.2f} GiB, measured {row['measured_gib']:.2f} GiB "
            f"(x{row['ratio']:.2f}), exit {done.returncode}"
        )
        rows.append(row)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
    work.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| stored | size (GiB) | layers | tied | converted in | estimate (GiB) | stage | measured peak (GiB) "
        "| estimate / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stored']} | {r['size_gib']:.2f} | {r['layers']} | {'yes' if r['tied'] else 'no'} | "
            f"{r['dtype']} | {r['estimate_gib']:.2f} | {r['stage']} | {r['measured_gib']:.2f} | "
            f"{r['ratio']:.2f} |"
        )
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()

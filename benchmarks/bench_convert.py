"""The whole `normswap convert` command's time by stage, next to the floor of the work it must do.

    python benchmarks/bench_convert.py smollm2-135m                         # the quick start, 3 runs
    python benchmarks/bench_convert.py /tmp/7b --runs 1 --name 7b-streamed --no-floor  # a 7B-class checkpoint
    python benchmarks/bench_convert.py /tmp/7b --runs 0 --name 7b-floor --streamed-floor  # its floor

Each run is `python -m normswap convert MODEL -o OUT --report R.json` (plus --extra options) in its own
process, under `/usr/bin/time -v` (wall clock, peak RSS), with its stderr on a pseudo-terminal so that the
command prints its progress lines (it prints them only to a terminal); each line is time-stamped as it
arrives. Stage times: the report's `timings` when the command writes them, else the time between
consecutive progress lines, each stage named by its line ("loading" -> load, "finding the norms" -> walk,
"running the original" -> reference, "centering"/"planning"/"converting" -> fold, "writing N shard(s)" ->
write (streamed: the folds applied as each tensor is written), "checking" -> check, "saving" -> save,
"verifying" -> verify). Median of --runs per stage.

The floor, measured in the same process as the benchmark, next to it:
* read: every safetensors file (or the GGUF file) of MODEL read once (16 MiB plain reads; the page cache
  as the runs left it);
* write: the last run's output size (or, without runs, the input's) written once into a file in --work;
* forwards: the check's forwards on its 512 tokens (for a half-precision model: the original in its dtype,
  in float32, and the converted model), with plain transformers for a model that fits in memory, else
  streamed (normswap.stream.model: each weight read from its shard as its module runs).
Writes ``convert-NAME.json`` and ``convert-NAME.md`` into --out (default benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = [  # progress line prefix -> stage
    ("loading", "load"),
    ("loaded", "load"),
    ("finding the norms", "walk"),
    ("running the original", "reference"),
    ("centering", "fold"),
    ("planning", "fold"),
    ("converting", "fold"),
    ("writing", "write"),
    ("checking", "check"),
    ("saving", "save"),
    ("verifying", "verify"),
]


def _stage(line: str) -> str:
    text = line.removeprefix("normswap: ").split(": ", 1)[-1] if ": streaming" in line else line
    text = text.removeprefix("normswap: ")
    for prefix, stage in STAGES:
        if text.startswith(prefix):
            return stage
    return "other"


def run_once(model: str, out: Path, report: Path, extra: list[str]) -> dict:
    """One `normswap convert` in its own process; progress lines time-stamped through a pseudo-terminal."""
    timing = Path(tempfile.mktemp(suffix=".time"))
    command = [
        "/usr/bin/time",
        "-v",
        "-o",
        str(timing),
        sys.executable,
        "-m",
        "normswap",
        "convert",
        model,
        "-o",
        str(out),
        "--report",
        str(report),
        *extra,
    ]
    master, slave = pty.openpty()
    start = time.perf_counter()
    load = os.getloadavg()[0]
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=slave, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    os.close(slave)
    lines, buffer = [], b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                chunk = b""
            if not chunk and proc.poll() is not None:
                break
            buffer += chunk
            while b"\n" in buffer:
                raw, buffer = buffer.split(b"\n", 1)
                lines.append((time.perf_counter() - start, raw.decode(errors="replace").strip()))
        elif proc.poll() is not None:
            break
    stdout = proc.stdout.read().decode()
    proc.wait()
    os.close(master)
    wall = time.perf_counter() - start
    text = timing.read_text()
    timing.unlink()
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 2**20
    progress = [(t, line) for t, line in lines if line.startswith("normswap: ")]
    stages: dict[str, float] = {}
    bounds = [(0.0, "startup")] + progress + [(wall, "end")]
    for (t0, line), (t1, _) in zip(bounds, bounds[1:], strict=False):
        name = "startup" if line == "startup" else _stage(line)
        stages[name] = stages.get(name, 0.0) + (t1 - t0)
    data = json.loads(report.read_text()) if report.is_file() else {}
    if data.get("timings"):
        stages = {k: float(v) for k, v in data["timings"].items() if isinstance(v, int | float)}
    return {
        "exit": proc.returncode,
        "wall_s": wall,
        "peak_rss_gib": peak,
        "stages_s": stages,
        "load_average": round(max(load, os.getloadavg()[0]), 1),
        "progress": progress,
        "summary": stdout.strip().splitlines(),
        "check": data.get("check"),
        "verify": data.get("verify"),
        "streamed": data.get("streamed"),
    }


def _files(model: str) -> list[Path]:
    from normswap.io import resolve

    resolved = resolve(model)
    if resolved.gguf_file:
        return [Path(resolved.path) / resolved.gguf_file]
    return sorted(Path(resolved.path).glob("*.safetensors"))


def floor_read(files: list[Path]) -> tuple[float, int]:
    """Seconds to read ``files`` once (16 MiB plain reads) and their bytes."""
    start, total = time.perf_counter(), 0
    buffer = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - start, total


def floor_write(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` once into a file in ``folder`` (removed afterwards)."""
    path = folder / ".bench-write.tmp"
    block = os.urandom(16 << 20)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def floor_forwards(model: str, streamed: bool, tokens: int = 512) -> dict:
    """The check's forwards: seconds of one forward of the original on ``tokens`` ids in its dtype (and in
    float32 for a half-precision model), with plain transformers or streamed; the converted model's forward
    costs what the original's does, so the floor counts it once more."""
    import torch

    from normswap.check import default_input_ids
    from normswap.check.core import _forward, upcast
    from normswap.io import load_model

    if streamed:
        from normswap.stream.model import build
        from normswap.stream.source import open_source

        source = open_source(model, "auto")
        ids = default_input_ids(source.tokenizer, tokens)
        model_obj, dtype = build(source.config, source.reader, source.dtype).model, source.dtype
    else:
        loaded = load_model(model)
        ids = default_input_ids(loaded.tokenizer, tokens)
        model_obj, dtype = loaded.model, loaded.model.dtype
    times = {}
    with torch.no_grad():
        start = time.perf_counter()
        _forward(model_obj, ids)
        times["forward"] = time.perf_counter() - start
        if dtype in (torch.bfloat16, torch.float16):
            with upcast(model_obj):
                start = time.perf_counter()
                _forward(model_obj, ids)
                times["forward_float32"] = time.perf_counter() - start
    times["total"] = 2 * times["forward"] + times.get("forward_float32", 0.0)
    return times


@click.command()
@click.argument("model")
@click.option("--name", default=None, help="Name of the result files (default: MODEL's last part).")
@click.option("--runs", type=click.IntRange(min=0), default=3, show_default=True, help="0: the floor only.")
@click.option("--extra", default="", help="More `normswap convert` options, space-separated.")
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/normswap-bench-convert"))
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results")
@click.option("--no-floor", is_flag=True, help="Skip the floor measurements.")
@click.option("--streamed-floor", is_flag=True, help="Measure the floor's forwards streamed.")
@click.option("--keep", is_flag=True, help="Keep the last run's output directory (WORK/run-*/out).")
def main(model, name, runs, extra, work, out, no_floor, streamed_floor, keep):
    """Time `normswap convert MODEL` by stage (median of --runs) and its floor."""
    name = name or Path(model.rstrip("/")).name
    from normswap.bench.report import run_folder

    work = run_folder(work)  # everything deleted below was written into this new folder
    results = []
    for i in range(runs):
        target, report = work / "out", work / "report.json"
        shutil.rmtree(target, ignore_errors=True)
        report.unlink(missing_ok=True)
        row = run_once(model, target, report, extra.split())
        click.echo(
            f"run {i + 1}: exit {row['exit']}, {row['wall_s']:.1f} s, "
            f"peak RSS {row['peak_rss_gib']:.2f} GiB, "
            + ", ".join(f"{k} {v:.1f}" for k, v in row["stages_s"].items())
        )
        results.append(row)
    stages = sorted(
        {k for r in results for k in r["stages_s"]},
        key=lambda k: min(
            (r["progress"].index(p) for r in results for p in r["progress"] if _stage(p[1]) == k), default=-1
        ),
    )
    median = {k: statistics.median(r["stages_s"].get(k, 0.0) for r in results) for k in stages}
    floor = {}
    written = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
    if not no_floor:
        files = _files(model)
        floor["read_s"], nbytes = floor_read(files)
        floor["bytes"], floor["written_bytes"] = nbytes, written or nbytes
        floor["write_s"] = floor_write(work, floor["written_bytes"])
        floor["forwards_s"] = floor_forwards(model, streamed_floor)
        floor["total_s"] = floor["read_s"] + floor["write_s"] + floor["forwards_s"]["total"]
    if keep:
        click.echo(f"kept the last run's output: {work / 'out'}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "model": model,
        "extra": extra,
        "runs": results,
        "median_stages_s": median,
        "median_wall_s": statistics.median(r["wall_s"] for r in results) if results else None,
        "floor": floor,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"convert-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = []
    if results:
        peak = statistics.median(r["peak_rss_gib"] for r in results)
        lines += [
            f"`normswap convert {model} {extra}`: median of {runs} run(s), wall "
            f"{result['median_wall_s']:.1f} s, peak RSS {peak:.2f} GiB, "
            f"load average {max(r['load_average'] for r in results)}",
            "",
            "| stage | seconds |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v:.1f} |" for k, v in median.items()]
    if floor:
        f = floor["forwards_s"]
        lines += [
            "",
            "| floor | seconds |",
            "|---|---|",
            f"| read the input once ({floor['bytes'] / 2**30:.2f} GiB) | {floor['read_s']:.1f} |",
            f"| write the output once ({floor['written_bytes'] / 2**30:.2f} GiB) | {floor['write_s']:.1f} |",
            f"| the check's forwards (2 x {f['forward']:.1f}"
            + (f" + float32 {f['forward_float32']:.1f}" if "forward_float32" in f else "")
            + f") | {f['total']:.1f} |",
            f"| total | {floor['total_s']:.1f} |",
        ]
    (out / f"convert-{name}.md").write_text("\n".join(lines) + "\n")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()

"""The plain `normswap convert` on a Mixtral-8x7B-shaped checkpoint stored one tensor per expert.

    python benchmarks/bench_stream_moe.py                          # 4 layers of Mixtral-8x7B: 12.4 GB
    python benchmarks/bench_stream_moe.py --preset mixtral-small   # hidden 1024, 2 layers: 0.55 GB

1. ``benchmarks/make_checkpoint.py WORK/in --preset PRESET --dtype bfloat16``: Mixtral's shape (hidden 4096,
   8 experts of intermediate 14336, 32 heads and 8 KV heads, SmolLM2's vocabulary and tokenizer), random
   weights, written as ``save_pretrained`` writes them: the hub's per-expert layout
   (``block_sparse_moe.experts.N.w1/w2/w3.weight``), 2 GB shards. One layer's expert stacks, as transformers
   assembles them, are 2.8 GB (``gate_up_proj`` 1.88 GB, ``down_proj`` 0.94 GB);
2. ``benchmarks/bench_convert.py WORK/in --runs 1 --streamed-floor --keep``: ``normswap convert IN -o OUT``
   with no option (it decides to stream by itself) under ``/usr/bin/time -v`` (peak RSS, wall clock, the
   stages), then the floor: the input read once, the output written once, the check's forwards streamed
   (the original in bfloat16 and in float32, and once more for the converted model);
3. the output is checked here: exit 0, the check and the verification passed, every tensor bfloat16 with the
   input's names in the input's shard files.

Writes ``stream_moe-PRESET.{json,md}`` into --out (default benchmarks/results/) and deletes the checkpoint and
the output (``--keep-input`` keeps the checkpoint for another run).
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


def _layout(folder: Path) -> dict[str, tuple[str, str]]:
    """Tensor name -> (shard file, dtype) of a checkpoint folder."""
    from normswap.io.shards import CheckpointReader

    reader = CheckpointReader(folder)
    return {name: (info.file, str(info.dtype)) for name, info in reader.tensors.items()}


@click.command()
@click.option(
    "--preset", type=click.Choice(["mixtral", "mixtral-small"]), default="mixtral", show_default=True
)
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/normswap-bench-moe"))
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results")
@click.option("--keep-input", is_flag=True, help="Keep the checkpoint (WORK/in) for another run.")
@click.option("--extra", default="", help="More `normswap convert` options, space-separated (--force).")
@click.option(
    "--floor-from",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Take the floor from an earlier run's stream_moe-*.json instead of measuring it again.",
)
@click.option("--name", default=None, help="Name of the result files (default: stream_moe-PRESET).")
def main(preset, work, out, keep_input, extra, floor_from, name):
    """Convert a Mixtral-shaped checkpoint with the plain command; peak RSS and time next to the floor."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work.mkdir(parents=True, exist_ok=True)
    source = work / "in"
    made_s = None
    if not source.exists():
        start = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_checkpoint.py"), str(source),
                        "--preset", preset, "--dtype", "bfloat16"], check=True, env=env)  # fmt: skip
        made_s = time.perf_counter() - start
    runs = work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    name = name or f"stream_moe-{preset}"
    floor_options = ["--no-floor"] if floor_from else ["--streamed-floor"]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_convert.py"), str(source), "--runs", "1",
                    "--name", name, *floor_options, "--keep", "--work", str(runs), "--out", str(out),
                    "--extra", extra], check=True, env=env)  # fmt: skip
    result = json.loads((out / f"convert-{name}.json").read_text())
    if floor_from:
        result["floor"] = json.loads(floor_from.read_text())["floor"]
    (out / f"convert-{name}.json").unlink()
    (out / f"convert-{name}.md").unlink()
    run = result["runs"][0]
    outputs = list(runs.glob("run-*/out"))
    checks = {"exit 0": run["exit"] == 0}
    checks["check passed"] = bool(run.get("check") and run["check"].get("passed"))
    checks["verification passed"] = bool(run.get("verify") and run["verify"].get("passed"))
    checks["streamed by itself"] = bool(run.get("streamed") and run["streamed"].get("choice"))
    if outputs:
        have, want = _layout(outputs[0]), _layout(source)
        checks["the input's names, shards and dtypes"] = have == want
        checks["bfloat16"] = {dtype for _, dtype in have.values()} == {"torch.bfloat16"}
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    floor = result["floor"]
    data = {
        "preset": preset,
        "extra": extra,
        "floor_from": str(floor_from) if floor_from else None,
        "date": time.strftime("%Y-%m-%d"),
        "size_bytes": size,
        "make_s": made_s,
        "peak_rss_gib": run["peak_rss_gib"],
        "wall_s": run["wall_s"],
        "stages_s": run["stages_s"],
        "load_average": run["load_average"],
        "floor": floor,
        "ratio": run["wall_s"] / floor["total_s"] if floor.get("total_s") else None,
        "checks": checks,
        "summary": run["summary"],
        "streamed": run.get("streamed"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    f = floor["forwards_s"]
    lines = [
        f"`normswap convert {extra or '(no option)'}` on {source} ({preset}, {size / 1e9:.1f} GB bfloat16), "
        f"{data['date']}, load average {run['load_average']}",
        "",
        f"peak RSS {run['peak_rss_gib']:.2f} GiB, wall {run['wall_s']:.0f} s, floor {floor['total_s']:.0f} s "
        f"(ratio {data['ratio']:.2f})",
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in run["stages_s"].items()],
        "",
        "| floor | seconds |",
        "|---|---|",
        f"| read the input once | {floor['read_s']:.1f} |",
        f"| write the output once | {floor['write_s']:.1f} |",
        f"| forwards: 2 x {f['forward']:.1f} + float32 {f.get('forward_float32', 0.0):.1f} "
        f"| {f['total']:.1f} |",
        "",
        *[f"* {what}: {'yes' if ok else 'NO'}" for what, ok in checks.items()],
        "",
        "```text",
        *run["summary"],
        "```",
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    click.echo("\n".join(lines))
    shutil.rmtree(runs, ignore_errors=True)
    if not keep_input:
        shutil.rmtree(source, ignore_errors=True)
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

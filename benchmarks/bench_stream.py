"""Peak memory and time of `normswap convert`, in memory vs streamed (--max-memory), versus model size.

    python benchmarks/bench_stream.py                          # 0.5, 1, 2, 4 GiB, Llama-shaped, float32
    python benchmarks/bench_stream.py --sizes 0.5,1 --work /tmp/b
    python benchmarks/bench_stream.py --sizes "" --acceptance  # only the TinyLlama-shaped 4.36 GiB target

For each size a synthetic checkpoint (benchmarks/make_checkpoint.py, "small" preset: hidden 1024, the
layer count set by the size, SmolLM2's vocabulary, 2 GB shards) is written into --work, converted once in
memory and once streamed with --max-memory 256MiB, each in its own process under `/usr/bin/time -v`
(peak RSS = "Maximum resident set size", wall clock = "Elapsed"), and deleted. --acceptance converts the
TinyLlama-shaped checkpoint (1.17B parameters, 4.36 GiB in 3 shards) streamed with --max-memory 1GiB and
then reloads original and output in plain transformers to compare their logits (max abs difference and
top-1 agreement on the check's 512 tokens).

Writes ``stream.json``, ``stream.md`` (the table) and, with matplotlib (`pip install .[bench]`),
``stream.png`` into --out (default benchmarks/results/).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent


def _timed(args: list[str], log) -> dict:
    from normswap.bench.report import timed_normswap

    return timed_normswap(args, log, cwd=ROOT)


def _make(out: Path, *extra: str, log) -> float:
    """Write a checkpoint with make_checkpoint.py; returns its size in GiB."""
    command = [sys.executable, str(ROOT / "benchmarks" / "make_checkpoint.py"), str(out), *extra]
    log("$ " + " ".join(command[1:]))
    subprocess.run(command, cwd=ROOT, check=True)
    return sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30


def reload_check(original: Path, converted: Path, tokens: int = 512) -> dict:
    """Plain transformers: logits of original and converted on the check's text; max abs diff, top-1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from normswap.check import default_input_ids

    ids = default_input_ids(AutoTokenizer.from_pretrained(original), tokens)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
        a = model(input_ids=ids).logits[0]
        del model
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
        b = model(input_ids=ids).logits[0]
    return {
        "max_abs_logit_diff": float((a - b).abs().max()),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "tokens": tokens,
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| model | size (GiB) | mode | --max-memory | peak RSS (GiB) | peak / size | wall (s) | check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["peak_rss_gib"] / r["size_gib"] if r.get("peak_rss_gib") else float("nan")
        check = next(
            (s.strip() for s in r.get("summary", []) if "PASSED" in s or "FAILED" in s), f"exit {r['exit']}"
        )
        lines.append(
            f"| {r['model']} | {r['size_gib']:.2f} | {r['mode']} | {r['max_memory'] or '-'} | "
            f"{r['peak_rss_gib']:.2f} | {ratio:.2f} | {r['wall_s']:.0f} | {check.split(' (')[0]} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("in memory", "o"), ("streamed", "s")):
        sel = [r for r in rows if r["mode"] == mode and r["model"] == "small" and r.get("peak_rss_gib")]
        sizes = [r["size_gib"] for r in sel]
        axes[0].plot(sizes, [r["peak_rss_gib"] for r in sel], marker=marker, label=mode)
        axes[1].plot(sizes, [r["wall_s"] for r in sel], marker=marker, label=mode)
    axes[0].set(xlabel="checkpoint size (GiB, float32)", ylabel="peak RSS (GiB)", title="memory")
    axes[1].set(xlabel="checkpoint size (GiB, float32)", ylabel="wall clock (s)", title="time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("normswap convert: in memory vs streamed (--max-memory 256MiB), 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


@click.command()
@click.option("--sizes", default="0.5,1,2,4", show_default=True, help="Checkpoint sizes in GiB (comma list).")
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/normswap-bench-stream"),
              show_default=True, help="Scratch folder (emptied afterwards).")  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results")
@click.option("--budget", default="256MiB", show_default=True, help="--max-memory of the streamed runs.")
@click.option("--acceptance", is_flag=True, help="Also the TinyLlama-shaped 4.36 GiB run with 1GiB.")
@click.option("--modes", default="in memory,streamed", show_default=True, help="Which conversions to time.")
@click.option("--merge", type=click.Path(exists=True, path_type=Path), default=None,
              help="A previous stream.json whose rows this run did not measure are kept.")  # fmt: skip
def main(sizes, work, out, budget, acceptance, modes, merge):
    """Measure peak RSS and time, in memory vs streamed, and write the table (and plot)."""
    from normswap.bench.report import run_folder

    work = run_folder(work)  # everything deleted below was written into this new folder
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    runs = [("small", float(s), None) for s in sizes.split(",") if s]
    if acceptance:
        runs.append(("tinyllama", None, "1GiB"))
    for preset, size, acceptance_budget in runs:
        ckpt = work / f"{preset}-{size or 'preset'}"
        shutil.rmtree(ckpt, ignore_errors=True)
        extra = ["--preset", preset] + (["--size", f"{size}GiB"] if size else [])
        real_size = _make(ckpt, *extra, log=click.echo)
        wanted = [m for m in (("in memory", None), ("streamed", budget)) if m[0] in modes.split(",")]
        for mode, max_memory in [("streamed", acceptance_budget)] if acceptance_budget else wanted:
            target = work / "out"
            shutil.rmtree(target, ignore_errors=True)
            args = ["convert", str(ckpt), "--output", str(target)] + (
                ["--max-memory", max_memory] if max_memory else []
            )
            row = {"model": preset, "size_gib": real_size, "mode": mode, "max_memory": max_memory}
            row |= _timed(args, click.echo)
            if acceptance_budget and row["exit"] == 0:
                row["reload"] = reload_check(ckpt, target)
            rows.append(row)
            click.echo(json.dumps({k: v for k, v in row.items() if k != "summary"}))
            shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        (out / "stream.json").write_text(json.dumps(rows, indent=2) + "\n")
    work.rmdir()
    if merge is not None:

        def key(r):
            return r["model"], round(r["size_gib"], 1), r["mode"]

        measured = {key(r) for r in rows}
        old = [r for r in json.loads(merge.read_text()) if key(r) not in measured]
        rows = sorted(old + rows, key=lambda r: (r["model"] != "small", r["size_gib"], r["mode"]))
        (out / "stream.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = _table(rows)
    (out / "stream.md").write_text(table)
    click.echo(table)
    if _plot(rows, out / "stream.png"):
        click.echo(f"wrote {out / 'stream.png'}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

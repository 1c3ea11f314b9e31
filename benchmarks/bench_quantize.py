"""What a conversion does to the user's quantization: original vs folded vs rotated under the same quantizer.

    OMP_NUM_THREADS=1 python benchmarks/bench_quantize.py                      # smollm2-135m, 1024 tokens
    python benchmarks/bench_quantize.py --folded DIR --rotated DIR --tokens 512  # reuse saved conversions

Makes (or takes) two conversions of ``--model`` with the CLI: ``normswap convert MODEL -o FOLDED`` (norms
folded, normswap's default) and ``normswap convert MODEL --rotate hadamard -o ROTATED``; then runs
``normswap eval --model MODEL --converted DIR --quantize SCHEME ...`` on each, in its own process, on the
first ``--tokens`` tokens of Python's ``LICENSE.txt`` (English prose the project uses nowhere else; the
check and ``eval``'s default read pydoc topics), in windows of ``--window``. Each eval quantizes both its
models the same way (round-to-nearest, symmetric, ``normswap.quantize``): ``a8``/``a6``/``a4`` per-token
activations at the input of every linear op but ``lm_head``, ``w4`` weights per output channel. The original
column is read from the first eval, and the second eval's original numbers must equal it (the same model,
text and quantizer: a consistency check, recorded as ``original_max_rel_diff``).

Writes ``quantize.json`` and ``quantize.md`` (perplexity, and KL to the float original) into --out;
docs/ROTATION.md quotes them with the command, date and machine. ``--scheme w8a8|w4a16|w4a16-gptq|w4a8-gptq``
runs llm-compressor's quantizers (run this script with the Python of the environment that has the quant
extra); GPTQ calibrates on the end of pydoc topics (``--calibration-samples`` x ``--calibration-length``
tokens). llama.cpp's quantizers are not run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("a8", "a6", "a4", "w4")  # --scheme w4a16-gptq etc.: llm-compressor (run with its environment)


def license_text_file() -> Path:
    return Path(os.__file__).parent / "LICENSE.txt"


def _run(args: list[str]) -> float:
    """Run ``python -m normswap ARGS`` with this checkout first on the path; its wall time (s)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    click.echo("$ normswap " + " ".join(args), err=True)
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "normswap", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"normswap {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    click.echo(done.stdout, err=True)
    return time.time() - started


def markdown(results: dict) -> str:
    cols = ("original", "folded", "rotated")
    lines = ["| perplexity (KL to the float original) | " + " | ".join(cols) + " |", "|---|---:|---:|---:|"]
    for scheme, row in results.items():
        cells = []
        best = min(row[c]["ppl"] for c in cols)
        for c in cols:
            cell = f"{row[c]['ppl']:.2f}" + ("" if scheme == "float" else f" ({row[c]['kl']:.3g})")
            cells.append(f"**{cell}**" if row[c]["ppl"] == best and scheme != "float" else cell)
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="The original MODEL.")
@click.option("--folded", type=click.Path(file_okay=False, path_type=Path),
              help="A saved `normswap convert MODEL` output (made in a temporary folder if not "
              "given).")  # fmt: skip
@click.option("--rotated", type=click.Path(file_okay=False, path_type=Path),
              help="A saved `normswap convert MODEL --rotate hadamard` output (made if not "
              "given).")  # fmt: skip
@click.option("--tokens", default=1024, show_default=True, help="Tokens of LICENSE.txt evaluated.")
@click.option("--window", default=512, show_default=True, help="Tokens per window.")
@click.option("--scheme", "schemes", multiple=True, default=SCHEMES, show_default=True, help="Repeatable.")
@click.option("--calibration-samples", default=32, show_default=True, help="For the llm-compressor schemes.")
@click.option("--calibration-length", default=256, show_default=True, help="For the llm-compressor schemes.")
@click.option("--name", default="quantize", show_default=True, help="Result files: NAME.json, NAME.md.")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results",
              show_default=True)  # fmt: skip
def main(model, folded, rotated, tokens, window, schemes, calibration_samples, calibration_length, name, out):
    from normswap.bench import report as bench_report

    started = time.time()
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        if folded is None:
            folded = Path(tmp) / "folded"
            seconds["convert folded"] = _run(["convert", model, "-o", str(folded)])
        if rotated is None:
            rotated = Path(tmp) / "rotated"
            seconds["convert rotated"] = _run(["convert", model, "--rotate", "hadamard", "-o", str(rotated)])
        reports = {}
        for variant, directory in (("folded", folded), ("rotated", rotated)):
            report = Path(tmp) / f"{variant}.json"
            args = ["eval", "--model", model, "--converted", str(directory), "--text",
                    str(license_text_file()), "--max-tokens", str(tokens), "--window", str(window),
                    "--report", str(report)]  # fmt: skip
            for scheme in schemes:
                args += ["--quantize", scheme]
            args += ["--calibration-samples", str(calibration_samples)]
            args += ["--calibration-length", str(calibration_length)]
            seconds[f"eval {variant}"] = _run(args)
            reports[variant] = json.loads(report.read_text())
    first, second = reports["folded"], reports["rotated"]
    results = {"float": {"original": {"ppl": first["ppl_original"], "kl": 0.0}}}
    results["float"] |= {n: {"ppl": r["ppl_converted"], "kl": r["kl_mean"]} for n, r in reports.items()}
    rel = abs(first["ppl_original"] / second["ppl_original"] - 1)
    for scheme in schemes:
        row = {"original": first["quantized"][scheme]["original"]}
        row |= {n: r["quantized"][scheme]["converted"] for n, r in reports.items()}
        results[scheme] = row
        rel = max(rel, abs(row["original"]["ppl"] / second["quantized"][scheme]["original"]["ppl"] - 1))
    meta = {"command": "python benchmarks/bench_quantize.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": bench_report.machine_info(), "model": model, "tokens": first["tokens"],
            "windows": first["windows"], "text": "LICENSE.txt", "original_max_rel_diff": rel,
            "seconds": {k: round(v) for k, v in seconds.items()} | {"total": round(time.time() - started)},
            "calibration": [calibration_samples, calibration_length],
            "descriptions": {s: first["quantized"][s]["description"] for s in schemes},
            "linear_ops": {s: first["quantized"][s]["linear_ops"] for s in schemes}}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = markdown(results)
    (out / f"{name}.md").write_text(f"`{meta['command']}`, {meta['date']}, {meta['machine']}\n\n{table}\n")
    click.echo(table)
    click.echo(
        f"original's numbers in the two evals agree to {rel:.2g} (relative); wrote {out / 'quantize.json'}"
    )


if __name__ == "__main__":
    main()

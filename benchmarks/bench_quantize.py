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
tokens).

``--llama-cpp DIR`` (a llama.cpp source tree whose ``build/bin`` holds ``llama-quantize`` and
``llama-perplexity``) adds llama.cpp's quantizers: each of the three models is written as a float32 GGUF
file by the tree's ``convert_hf_to_gguf.py`` (run with ``--gguf-python``: a Python with ``sentencepiece``;
the original, when it is a short name or a GGUF file, is first saved as a float checkpoint), quantized by
``llama-quantize`` to each ``--gguf-type`` (Q4_K_M, Q4_0, IQ4_NL), and scored by ``llama-perplexity`` on the
same text, ``--window`` tokens a chunk, ``--tokens`` tokens in all: perplexity (llama.cpp's: the second half
of each chunk) and KL to the float32 original's GGUF (``--kl-divergence``). Written to NAME_llamacpp.json and
.md; ``--llama-cpp-only`` skips the evals. Without ``--llama-cpp`` that part is skipped with one line.
A tree to build (CPU only), e.g. the one vendored in llama-cpp-python's source distribution::

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF && cmake --build build -j2 --target llama-quantize llama-perplexity
"""

from __future__ import annotations

import json
import os
import re
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


GGUF_TYPES = ("Q4_K_M", "Q4_0", "IQ4_NL")


def _tool(args: list, what: str) -> str:
    """Run a llama.cpp tool (or its converter); its stdout and stderr together."""
    click.echo("$ " + " ".join(str(a) for a in args), err=True)
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def float_checkpoint(model: str, folder: Path) -> Path:
    """``model`` as a folder convert_hf_to_gguf.py reads: itself when it is one, else (a short name, a GGUF
    file: weights dequantized on load) the loaded model saved in float32 into ``folder``."""
    if Path(model, "config.json").is_file():
        return Path(model)
    from safetensors.torch import save_file

    from normswap.io.load import load_model

    loaded = load_model(model)
    net, config = loaded.model, loaded.model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF record: the weights are float now
    config.architectures = [type(net).__name__]
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    head = net.get_output_embeddings()
    if head is not None and head.weight is net.get_input_embeddings().weight:  # tied: saved once
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded.tokenizer.save_pretrained(folder)
    return folder


def llama_cpp_rows(tree: Path, python: str, models: dict, types, text: Path, tokens: int, window: int,
                   work: Path) -> dict:  # fmt: skip
    """``{type: {model: {"ppl", "kl"}}}``: each model's float32 GGUF and its llama-quantize outputs, scored by
    llama-perplexity against the float32 original's logits (``--kl-divergence-base``)."""
    bins = tree / "build" / "bin"
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    chunks = ["-c", str(window), "--chunks", str(max(1, tokens // window)), "-t", threads]
    files = {}
    for name, folder in models.items():
        files[name] = {"F32": work / f"{name}-f32.gguf"}
        _tool([python, tree / "convert_hf_to_gguf.py", folder, "--outtype", "f32", "--outfile",
               files[name]["F32"]], f"convert_hf_to_gguf.py {folder}")  # fmt: skip
        for kind in types:
            files[name][kind] = work / f"{name}-{kind}.gguf"
            _tool([bins / "llama-quantize", files[name]["F32"], files[name][kind], kind, threads],
                  f"llama-quantize {name} {kind}")  # fmt: skip
    base = work / "original-f32.kld"
    _tool([bins / "llama-perplexity", "-m", files["original"]["F32"], "-f", text, *chunks,
           "--kl-divergence-base", base], "llama-perplexity (the float32 original's logits)")  # fmt: skip
    rows = {}
    for kind in ("F32", *types):
        rows[kind] = {}
        for name in models:
            out = _tool([bins / "llama-perplexity", "-m", files[name][kind], *chunks, "--kl-divergence-base",
                         base, "--kl-divergence"], f"llama-perplexity {name} {kind}")  # fmt: skip
            ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.eE+-]+)", out)
            kl = re.search(r"Mean\s+KLD:\s*([0-9.eE+-]+)", out)
            if not ppl or not kl:
                raise click.ClickException(f"no perplexity/KLD in llama-perplexity's output:\n{out[-3000:]}")
            rows[kind][name] = {"ppl": float(ppl.group(1)), "kl": float(kl.group(1))}
    return rows


def markdown(results: dict, unquantized: str = "float") -> str:
    cols = ("original", "folded", "rotated")
    lines = ["| perplexity (KL to the float original) | " + " | ".join(cols) + " |", "|---|---:|---:|---:|"]
    for scheme, row in results.items():
        cells = []
        best = min(row[c]["ppl"] for c in cols)
        for c in cols:
            cell = f"{row[c]['ppl']:.2f}" + ("" if scheme == unquantized else f" ({row[c]['kl']:.3g})")
            cells.append(f"**{cell}**" if row[c]["ppl"] == best and scheme != unquantized else cell)
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
@click.option("--llama-cpp", "llama_cpp", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="A llama.cpp source tree with build/bin/llama-quantize and llama-perplexity built: adds "
              "llama.cpp's quantizers.")  # fmt: skip
@click.option("--gguf-python", default=sys.executable, show_default=True,
              help="The Python that runs convert_hf_to_gguf.py (it needs sentencepiece).")  # fmt: skip
@click.option("--gguf-type", "gguf_types", multiple=True, default=GGUF_TYPES, show_default=True,
              help="llama-quantize types (repeatable).")  # fmt: skip
@click.option("--llama-cpp-only", is_flag=True, help="Only the llama.cpp part (no normswap eval).")
def main(model, folded, rotated, tokens, window, schemes, calibration_samples, calibration_length, name, out,
         llama_cpp, gguf_python, gguf_types, llama_cpp_only):  # fmt: skip
    from normswap.bench import report as bench_report

    if llama_cpp_only and llama_cpp is None:
        raise click.UsageError("--llama-cpp-only needs --llama-cpp DIR")
    started = time.time()
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        if folded is None:
            folded = Path(tmp) / "folded"
            seconds["convert folded"] = _run(["convert", model, "-o", str(folded)])
        if rotated is None:
            rotated = Path(tmp) / "rotated"
            seconds["convert rotated"] = _run(["convert", model, "--rotate", "hadamard", "-o", str(rotated)])
        if llama_cpp is None:
            click.echo("llama.cpp: skipped (give --llama-cpp DIR, a llama.cpp tree built, to add its rows)")
        else:
            began = time.time()
            work = Path(tmp) / "gguf"
            work.mkdir()
            models = {"original": float_checkpoint(model, Path(tmp) / "original"), "folded": folded,
                      "rotated": rotated}  # fmt: skip
            rows = llama_cpp_rows(llama_cpp, gguf_python, models, gguf_types, license_text_file(), tokens,
                                  window, work)  # fmt: skip
            meta = {"command": "python benchmarks/bench_quantize.py " + " ".join(sys.argv[1:]),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": bench_report.machine_info(), "model": model, "text": "LICENSE.txt",
                    "tokens": tokens, "window": window, "types": list(gguf_types),
                    "seconds": round(time.time() - began)}  # fmt: skip
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}_llamacpp.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
            table = markdown(rows, unquantized="F32")
            (out / f"{name}_llamacpp.md").write_text(
                f"`{meta['command']}`, {meta['date']}, {meta['machine']}\n\n{table}\n"
            )
            click.echo(table)
            if llama_cpp_only:
                return
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

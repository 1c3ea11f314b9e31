"""`normswap convert --rotate hadamard` in memory vs streamed (--max-memory), on SmolLM2-135M.

    python benchmarks/bench_stream_rotate.py                      # --max-memory 100MB, the check's 512 tokens
    python benchmarks/bench_stream_rotate.py --work /tmp/b --max-memory 50MB

SmolLM2-135M (normswap's short name ``smollm2-135m``: a GGUF file, which streaming does not read) is loaded
once and saved as a float32 safetensors checkpoint in a new folder inside --work. Four conversions of it
run, each in its own process under `/usr/bin/time -v` (peak RSS = "Maximum resident set size", wall clock =
"Elapsed"): in memory (--no-stream), in memory with --rotate hadamard, streamed (--max-memory), streamed with
--rotate hadamard. Then:

* the two rotated outputs are compared: every tensor bit for bit, ``normswap/rotation.safetensors``, the
  rotation records of ``normswap.json``;
* the streamed rotated output is loaded in plain transformers and compared with the original (float32,
  the check's ids): the largest logit difference, and the largest difference of every hidden state before
  the final norm from the original's times the saved Q, relative to that state's largest entry.

Writes ``stream_rotate.json`` and ``stream_rotate.md`` into --out (default benchmarks/results/); deletes only
the folder it made inside --work.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent


def _timed(args: list[str], log) -> dict:
    from normswap.bench.report import timed_normswap

    return timed_normswap(args, log, cwd=ROOT)


def _save_safetensors(folder: Path) -> None:
    from normswap.io import load_model
    from normswap.io.save import plain_float_checkpoint

    loaded = load_model("smollm2-135m")
    with plain_float_checkpoint(loaded.model):
        loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)


def _compare(memory: Path, streamed: Path) -> dict:
    """The rotated outputs, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from normswap.io.shards import CheckpointReader
    from normswap.rotate import ROTATION_FILE

    a, b = CheckpointReader(memory), CheckpointReader(streamed)
    differ = [
        n
        for n in a.tensors
        if n not in b.tensors or not torch.equal(a.read(n).view(torch.uint8), b.read(n).view(torch.uint8))
    ]
    qa, qb = load_file(str(memory / ROTATION_FILE)), load_file(str(streamed / ROTATION_FILE))
    ra, rb = (json.loads((d / "normswap.json").read_text())["rotation"] for d in (memory, streamed))
    return {
        "tensors": len(a.tensors),
        "tensors_differing": differ + sorted(set(b.tensors) - set(a.tensors)),
        "q_identical": qa.keys() == qb.keys() and all(torch.equal(qa[k], qb[k]) for k in qa),
        "records_identical": ra == rb,
    }


def _against_original(original: Path, converted: Path, tokens: int) -> dict:
    """Plain transformers, float32: logits and hidden states of ``converted`` against ``original``."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from normswap.check import default_input_ids
    from normswap.rotate import ROTATION_FILE

    ids = default_input_ids(AutoTokenizer.from_pretrained(original), tokens)
    q = load_file(str(converted / ROTATION_FILE))["Q"]
    outs = []
    for folder in (original, converted):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            outs.append(model(input_ids=ids, output_hidden_states=True, use_cache=False))
        del model
    before, after = outs
    worst = max(
        ((h0.double() @ q - h1.double()).abs().max() / h0.double().abs().max()).item()
        for h0, h1 in zip(before.hidden_states[:-1], after.hidden_states[:-1], strict=True)
    )
    return {
        "tokens": int(ids.shape[-1]),
        "max_abs_logit_diff": (before.logits - after.logits).abs().max().item(),
        "top1_agreement": (before.logits.argmax(-1) == after.logits.argmax(-1)).double().mean().item(),
        "hidden_states_max_rel_diff": worst,
    }


def _table(runs: dict, compared: dict, checked: dict, max_memory: str) -> str:
    lines = [
        "| conversion | command | exit | peak RSS (GiB) | wall (s) |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        command = "normswap convert SMOLLM2 -o OUT " + " ".join(r["args"][4:])
        lines.append(f"| {name} | `{command}` | {r['exit']} | {r['peak_rss_gib']:.2f} | {r['wall_s']:.1f} |")
    lines += [
        "",
        f"Rotated, in memory vs streamed (--max-memory {max_memory}): {compared['tensors']} tensors, "
        f"{len(compared['tensors_differing'])} differing; Q file identical: {compared['q_identical']}; "
        f"rotation records identical: {compared['records_identical']}.",
        f"Streamed rotated output vs the original (plain transformers, float32, {checked['tokens']} tokens): "
        f"max |logit diff| {checked['max_abs_logit_diff']:.2e}, top-1 agreement "
        f"{checked['top1_agreement']:.2%}, hidden states vs original x Q: max relative diff "
        f"{checked['hidden_states_max_rel_diff']:.2e}.",
    ]
    return "\n".join(lines) + "\n"


FOLDER = click.Path(file_okay=False, path_type=Path)


@click.command()
@click.option("--work", type=FOLDER, default=None, help="A new folder inside it holds the checkpoint and "
              "the outputs [default: the temp dir].")  # fmt: skip
@click.option("--out", type=FOLDER, default=ROOT / "benchmarks" / "results")
@click.option("--max-memory", default="100MB", show_default=True)
@click.option("--tokens", type=int, default=512, show_default=True)
def main(work: Path | None, out: Path, max_memory: str, tokens: int) -> None:
    from normswap.bench.report import machine_info

    log = click.echo
    parent = work or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-stream-rotate-", dir=parent))
    try:
        src = folder / "smollm2"
        _save_safetensors(src)
        common = ["--tokens", str(tokens)]
        runs = {}
        for name, extra in [
            ("in memory", ["--no-stream"]),
            ("in memory, rotated", ["--no-stream", "--rotate", "hadamard"]),
            ("streamed", ["--max-memory", max_memory]),
            ("streamed, rotated", ["--max-memory", max_memory, "--rotate", "hadamard"]),
        ]:
            target = folder / name.replace(", ", "-").replace(" ", "-")
            runs[name] = _timed(["convert", str(src), "-o", str(target), *common, *extra], log)
            if "rotated" not in name:
                shutil.rmtree(target, ignore_errors=True)
        compared = _compare(folder / "in-memory-rotated", folder / "streamed-rotated")
        checked = _against_original(src, folder / "streamed-rotated", tokens)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": "smollm2-135m (float32 safetensors)",
        "max_memory": max_memory,
        "machine": machine_info(),
        "runs": runs,
        "rotated_in_memory_vs_streamed": compared,
        "streamed_rotated_vs_original": checked,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_rotate.json").write_text(json.dumps(result, indent=2) + "\n")
    table = _table(runs, compared, checked, max_memory)
    (out / "stream_rotate.md").write_text(table)
    log(table)


if __name__ == "__main__":
    main()

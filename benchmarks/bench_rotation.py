"""What the rotation buys under low-bit quantization: original, folded-only and rotated models side by side.

    python benchmarks/bench_rotation.py                 # smollm2-135m + a small LayerNorm GPT-2 trained here
    python benchmarks/bench_rotation.py --ln-steps 0    # smollm2-135m only

Each model is evaluated as three variants: the original as loaded; ``normswap.convert(model)`` (every norm
folded: the same function, other weights and other linear inputs); ``normswap.convert(model,
rotate="hadamard")`` (folded, then the residual stream rotated by a randomized Hadamard ``Q``; a LayerNorm
model centered first). Under round-to-nearest fake quantization (symmetric, scale = absmax / (2^(b-1) - 1)):

* ``W4 per channel`` / ``W4 g64``: the weight of every linear map but the output head (``lm_head``), per
  output channel or per group of 64 along the input axis, 4 bits;
* ``A8`` / ``A6`` / ``A4``: the input of every such linear map, per token (one scale per row), 8 / 6 / 4 bits;

each variant's perplexity on ``--tokens`` tokens of a text the project uses nowhere else (Python's
``LICENSE.txt``, shipped with every Python: English prose), one window, float32 on the CPU; and the
activations' max/RMS ratio at the same linear inputs (per token: ``max |x| / sqrt(mean x^2)``; median and
max over every token), the outliers a rotation spreads, separately for the linear maps that read a norm
(q/k/v, gate/up: what the stream's rotation changes) and the others (o_proj, down_proj, which read values
inside a block that the stream's rotation does not touch).

No real LayerNorm language model is available offline here (``minilm-l6`` is a post-LN encoder, which no
rotation can pass), so the LayerNorm model is a 4-layer GPT-2 (hidden 128, 4 heads, bytes as tokens:
vocabulary 256) trained for ``--ln-steps`` steps (AdamW, batch 8 x 128 bytes, cosine schedule) on
Python's pydoc topics from a fixed seed, and evaluated on the first ``--tokens`` bytes of the same held
text: small, but a trained LayerNorm model with biases, whose rotation needs the centering and ``Q 1 = 1``.
Results (JSON and a Markdown table) go to --out; docs/ROTATION.md quotes them with the command, date and
machine.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("float", "W4 per channel", "W4 g64", "A8", "A6", "A4")


def held_text() -> str:
    """Python's own ``LICENSE.txt`` (the history of Python and its licenses): English prose that the
    project uses nowhere else (the check and ``eval`` read pydoc topics)."""
    return (Path(os.__file__).parent / "LICENSE.txt").read_text()


def linears(model):
    """``(name, module, layout)`` of every linear map but the output head: ``nn.Linear`` (weight out x in)
    and transformers' ``Conv1D`` (weight in x out)."""
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            found.append((name, module, "out_in"))
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            found.append((name, module, "in_out"))
    return found


def rtn(x, bits: int, dim: int = -1, group: int | None = None):
    """Symmetric round-to-nearest fake quantization of ``x`` along ``dim`` (one scale per slice, or per
    ``group`` consecutive entries of ``dim``)."""
    import torch

    levels = 2 ** (bits - 1) - 1
    y = x.movedim(dim, -1)
    shape = y.shape
    if group is not None:
        y = y.reshape(*shape[:-1], shape[-1] // group, group)
    scale = y.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
    q = torch.round(y / scale).clamp(-levels, levels) * scale
    return q.reshape(shape).movedim(-1, dim)


@contextlib.contextmanager
def quantized_weights(model, bits: int, group: int | None):
    """Every linear weight (not the head) fake-quantized per output channel (``group`` None) or per group of
    input entries, restored on exit."""
    import torch

    saved = []
    with torch.no_grad():
        for _, module, layout in linears(model):
            w = module.weight
            saved.append((w, w.detach().clone()))
            in_dim = 1 if layout == "out_in" else 0
            w.copy_(rtn(w, bits, dim=in_dim, group=group))
    try:
        yield
    finally:
        with torch.no_grad():
            for w, old in saved:
                w.copy_(old)


@contextlib.contextmanager
def quantized_inputs(model, bits: int | None, stats: list | None = None):
    """Every linear input (not the head's) fake-quantized per token; ``stats`` collects ``(module name,
    per-token max/RMS ratios)`` of each input (before quantization)."""
    names = {id(m): n for n, m, _ in linears(model)}

    def hook(module, args):
        x = args[0]
        if stats is not None:
            flat = x.detach().reshape(-1, x.shape[-1]).double()
            ratio = (flat.abs().amax(-1) / flat.pow(2).mean(-1).sqrt().clamp(min=1e-30)).cpu()
            stats.append((names[id(module)], ratio))
        if bits is None:
            return None
        return (rtn(x, bits, dim=-1), *args[1:])

    handles = [m.register_forward_pre_hook(hook) for _, m, _ in linears(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def perplexity(model, ids) -> float:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="mean")
    return math.exp(nll.item())


STATS = ("norm readers: median", "norm readers: max", "other linears: median", "other linears: max")


def evaluate(model, ids, readers: set[str]) -> dict:
    """Perplexity under each of ``CONFIGS``, and the max/RMS ratio of the inputs of the linear maps that read
    a norm (``readers``: q/k/v, gate/up: what the rotation of the stream changes) and of the others (o_proj,
    down_proj: not on the stream)."""
    import torch

    out = {}
    for config in CONFIGS:
        if config.startswith("W4"):
            with quantized_weights(model, 4, None if config == "W4 per channel" else 64):
                out[config] = perplexity(model, ids)
        elif config.startswith("A"):
            with quantized_inputs(model, int(config[1:])):
                out[config] = perplexity(model, ids)
        else:
            stats: list = []
            with quantized_inputs(model, None, stats):
                out[config] = perplexity(model, ids)
            for label, keep in (("norm readers", True), ("other linears", False)):
                ratios = torch.cat([r for name, r in stats if (name in readers) is keep])
                out[f"{label}: median"] = ratios.median().item()
                out[f"{label}: max"] = ratios.max().item()
    return out


def variants(model, ids) -> dict:
    """``{"original", "folded", "rotated"}`` (deep copies converted with normswap), the rotation's
    description, and the names of the linear maps that read a norm (found by ``normswap.inspect``)."""
    import torch

    import normswap

    readers = {c.module for site in normswap.inspect(model, ids[:, :32]) for c in site.consumers}
    folded, rotated = copy.deepcopy(model), copy.deepcopy(model)
    normswap.convert(folded, input_ids=ids[:, :32])
    report = normswap.convert(rotated, input_ids=ids[:, :32], rotate="hadamard")
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        b = rotated(input_ids=ids, use_cache=False).logits
    diff = (a - b).abs().max().item()
    note = f"{report.rotation.matrices['Q'].description}; max |logit diff| vs original {diff:.2g}"
    return {"original": model, "folded": folded, "rotated": rotated}, note, readers


def byte_ids(text: str):
    import torch

    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def train_ln_model(steps: int, seed: int = 0):
    """A 4-layer GPT-2 (LayerNorm, hidden 128, bytes as tokens) trained on pydoc topics for ``steps`` steps
    (AdamW, batch 8 x 128 bytes, cosine schedule from 3e-3), float32, eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from normswap.check.text import default_text

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=1024, n_embd=128, n_layer=4, n_head=4)
    model = GPT2LMHeadModel(config)
    data = byte_ids(default_text())[0]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    for step in range(steps):
        if step % 50 == 0:
            print(f"training step {step}/{steps}", file=sys.stderr, flush=True)
        starts = torch.randint(0, data.numel() - 129, (8,), generator=gen)
        batch = torch.stack([data[s : s + 128] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * (step + 1) / steps))
    return model.eval()


def markdown(name: str, results: dict, note: str) -> str:
    cols = ("original", "folded", "rotated")
    lines = [f"**{name}** ({note})", "", "| | " + " | ".join(cols) + " |", "|---|---:|---:|---:|"]
    for row in (*CONFIGS, *STATS):
        label = f"ppl, {row}" if row in CONFIGS else f"max/RMS, {row}"
        lines.append(f"| {label} | " + " | ".join(f"{results[c][row]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


@click.command()
@click.option("--model", default="smollm2-135m", show_default=True, help="The RMSNorm model (MODEL).")
@click.option("--tokens", default=1024, show_default=True, help="Tokens of held text (one window).")
@click.option("--ln-steps", default=400, show_default=True, help="LayerNorm GPT-2 training steps (0: none).")
@click.option("--skip-model", is_flag=True, help="Only the LayerNorm GPT-2.")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results",
              show_default=True)  # fmt: skip
def main(model, tokens, ln_steps, skip_model, out):
    import torch

    from normswap.bench import report as bench_report
    from normswap.io import load_model

    torch.manual_seed(0)
    started = time.time()
    runs = {}
    if not skip_model:
        loaded = load_model(model)
        ids = loaded.tokenizer(held_text(), return_tensors="pt").input_ids[:, :tokens]
        models, note, readers = variants(loaded.model.eval(), ids)
        runs[model] = ({name: evaluate(m, ids, readers) for name, m in models.items()}, note)
        click.echo(markdown(model, *runs[model]) + "\n")
        del models, loaded
    if ln_steps:
        t0 = time.time()
        ln = train_ln_model(ln_steps)
        ln_ids = byte_ids(held_text())[:, : min(tokens, ln.config.n_positions)]
        models, note, readers = variants(ln, ln_ids)
        note = f"bytes as tokens, trained {ln_steps} steps in {time.time() - t0:.0f} s; " + note
        name = "GPT-2 4 x 128 (LayerNorm, trained here)"
        runs[name] = ({n: evaluate(m, ln_ids, readers) for n, m in models.items()}, note)
        click.echo(markdown(name, *runs[name]) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/bench_rotation.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": bench_report.machine_info(), "tokens": tokens,
            "seconds": round(time.time() - started)}  # fmt: skip
    data = {"meta": meta, "runs": {k: {"results": r, "note": n} for k, (r, n) in runs.items()}}
    (out / "rotation.json").write_text(json.dumps(data, indent=1))
    table = "\n\n".join(markdown(k, r, n) for k, (r, n) in runs.items())
    (out / "rotation.md").write_text(f"`{meta['command']}`, {meta['date']}, {meta['machine']}\n\n{table}\n")
    click.echo(f"wrote {out / 'rotation.json'} and rotation.md")


if __name__ == "__main__":
    main()

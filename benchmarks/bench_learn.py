"""What ``--rotate learned`` can win, and what a step costs: the a4 loss of the Hadamard-rotated model by
group of quantized linear ops, and the learning's loss and time per step.

    OMP_NUM_THREADS=1 python benchmarks/bench_learn.py                  # smollm2-135m, a4, 12 steps
    python benchmarks/bench_learn.py --steps 60 --batch 1 --lr 1e-3

Rotates ``--model`` by the randomized Hadamard ``Q0`` in memory, then on 4 held-out windows of 256 tokens
(the beginning of pydoc topics: ``normswap eval``'s default text; the learning calibrates on their end)
measures the next-token loss of the rotated model in float and under ``--target``'s fake quantization at
every linear op but ``lm_head``, at the stream's readers alone (q/k/v, gate/up: the inputs a rotation of
the stream changes), at ``o_proj`` alone and at ``down_proj`` alone (inputs inside a block, which no saved
rotation of the stream reaches). Then it learns ``R`` (``normswap.rotate.learn.learn``) and reports the
time per step and the held-out loss with ``Q0 R``. Prints one JSON object; docs/ROTATION.md quotes it.
"""

from __future__ import annotations

import json
import time

import click
import torch

import normswap
from normswap import io
from normswap.check.text import default_text
from normswap.evaluate import calibration_windows
from normswap.rotate import learn


def held_loss(model, records, held, scheme, r, keep=None) -> float:
    """Mean next-token loss on the ``held`` windows of the proxy with ``r`` (``scheme`` None: float), only the
    linear ops whose parameter name ``keep`` accepts quantized (all by default)."""
    proxy = learn.Proxy(model, records, scheme)
    if keep is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        proxy.linear = {k: v for k, v in proxy.linear.items() if keep(names.get(k, ""))}
    proxy.begin(r.float())
    with torch.no_grad(), proxy:
        return sum(float(learn._loss(model, w[None])) for w in held) / len(held)


@click.command()
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--target", default="a4", show_default=True)
@click.option("--steps", default=12, show_default=True)
@click.option("--batch", default=1, show_default=True)
@click.option("--length", default=256, show_default=True)
@click.option("--lr", default=1e-3, show_default=True)
def main(model, target, steps, batch, length, lr):
    loaded = io.load_model(model, dtype="float32", tokenizer=True)
    m, tok = loaded.model, loaded.tokenizer
    ids = tok(default_text(2000), return_tensors="pt")["input_ids"][:, :64]
    report = normswap.convert(m, rotate="hadamard", input_ids=ids, swap=False)
    records, n = report.rotation.tensors, report.rotation.Q.shape[0]
    held = torch.tensor(tok(default_text(20000))["input_ids"][: 4 * 256]).reshape(4, 256)
    scheme, eye = learn.SCHEMES[target], torch.eye(n)
    readers = {r.name for r in records if "input" in r.sides}  # a rotation changes their input
    result = {
        "model": model, "target": target, "threads": torch.get_num_threads(),
        "held_float": held_loss(m, records, held, None, eye),
        "held_all": held_loss(m, records, held, scheme, eye),
        "held_stream_readers_only": held_loss(m, records, held, scheme, eye, readers.__contains__),
    }  # fmt: skip
    inside = {p for p, t in m.named_parameters() if t.dim() == 2 and p not in readers}
    for group in sorted({".".join(p.split(".")[-3:]) for p in inside}):  # e.g. mlp.down_proj.weight
        only = lambda p, g=group: p.endswith(g)  # noqa: E731
        result[f"held_{group}_only"] = held_loss(m, records, held, scheme, eye, only)
    settings = learn.Settings(target=target, steps=steps, batch=batch, length=length, samples=64, lr=lr)
    eval_chars = len(default_text(16384))  # what `normswap eval` reads by default
    calibration = calibration_windows(tok, None, settings.samples, length, eval_chars=eval_chars)
    start = time.perf_counter()
    done = learn.learn(m, records, calibration, settings, progress=True)
    result |= {
        "steps": steps, "batch": batch, "length": length, "lr": lr,
        "seconds_per_step": done.seconds / steps, "seconds": time.perf_counter() - start,
        "losses": [round(x, 4) for x in done.losses],
        "held_all_learned": held_loss(m, records, held, scheme, done.r),
    }  # fmt: skip
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

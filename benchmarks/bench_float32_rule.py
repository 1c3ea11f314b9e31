"""float32's second rule (the float64 reference, docs/CHECKING.md): its constants against real conversions.

    python benchmarks/bench_float32_rule.py                 # measurements + cost (about 15 min on 2 cores)
    python benchmarks/bench_float32_rule.py --no-cost       # measurements only

SmolLM2-135M-Instruct (``smollm2-135m``, float32) on two check inputs: the check's default text (512
tokens) and 1024 tokens of Python's ``LICENSE.txt`` (a text the project uses nowhere else). On each, the
original runs in float32, upcast to float64 (``normswap.check.upcast``: the check's float64 reference), and
upcast to float64 with every cast to float32 inside transformers' code turned into float64 (``pure64``:
RMSNorm, rotary and softmax compute in float32 internally, so the check's float64 reference is not exact;
its own error is ``pure64`` vs float64). Then each variant, made from a copy of the original:

* correct: ``convert`` (fold), ``convert(rotate="hadamard")``, ``convert(rotate="random")``;
* wrong: layer 3's ``input_layernorm`` folded into ``q_proj`` only (k/v lose its weight); one norm weight
  (layer 15's ``input_layernorm``) x (1 + 1e-4), then converted; one channel of layer 15's
  ``post_attention_layernorm`` x (1 + 1e-3), then converted; the final norm's weight x (1 + 1e-5), then
  converted (a scale error right before ``lm_head``: the smallest one here);
* on ``minilm-l6`` (a LayerNorm encoder, compared on its last hidden state, default text): layer 2's output
  LayerNorm bias dropped (zeroed), then converted.

Per variant and input: the fixed bound's numbers (max abs vs the float32 original, top-1 agreement) and
verdict, and the float64 rule's (``e_conv``, ``e_orig``, ``kl_conv``, ``kl_orig``, ``bound = 2 e_orig +
5e-5``, ``e_conv / bound``) and verdict. With cost (not ``--no-cost``): ``normswap convert smollm2-135m
--rotate hadamard`` saved once, then ``normswap check`` of it against the original on the LICENSE
text, 1024 tokens, each in its own process under ``/usr/bin/time -v``: as is (the fixed bound misses, the
original is reloaded and run in float64) and with ``--max-abs 1`` (the fixed bound final, no rerun): wall
time and peak RSS. Writes ``float32_rule.json`` and ``float32_rule.md`` into --out.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def license_text() -> str:
    return (Path(os.__file__).parent / "LICENSE.txt").read_text()


def pure64():
    """A TorchFunctionMode under which casts to float32 (``.float()``, ``.to(torch.float32)``,
    ``dtype=torch.float32``) give float64: transformers' float32 islands run in float64 too."""
    import torch
    from torch.overrides import TorchFunctionMode

    def swap(x):
        return torch.float64 if x is torch.float32 else x

    class Pure64(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = {k: swap(v) for k, v in (kwargs or {}).items()}
            if func is torch.Tensor.float:
                return args[0].double()
            return func(*[swap(a) for a in args], **kwargs)

    return Pure64()


def logits(model, ids, mode=None):
    import contextlib

    import torch

    from normswap.check.core import _forward

    with torch.no_grad(), mode or contextlib.nullcontext():
        return _forward(model, ids)[1]


def upcast_copy(model):
    import torch

    from normswap.check import upcast

    m = copy.deepcopy(model)
    with upcast(m, torch.float64, restore=False):
        pass
    return m


def wrong_q_only(m):
    import torch

    layer = m.model.layers[3]
    with torch.no_grad():
        w = layer.input_layernorm.weight
        layer.self_attn.q_proj.weight.mul_(w)
        w.fill_(1.0)


def scaled(path: str, factor: float, channel: int | None = None):
    def apply(m):
        import torch

        from normswap.convert import convert

        with torch.no_grad():
            w = m.get_parameter(path)
            (w if channel is None else w[channel : channel + 1]).mul_(factor)
        convert(m)

    return apply


def converted(**kw):
    def apply(m):
        from normswap.convert import convert

        convert(m, **kw)

    return apply


CORRECT = {"fold": converted(), "rotate hadamard": converted(rotate="hadamard"),
           "rotate random": converted(rotate="random")}  # fmt: skip
WRONG = {
    "fold into q_proj only (layer 3)": wrong_q_only,
    "norm weight x (1+1e-4)": scaled("model.layers.15.input_layernorm.weight", 1 + 1e-4),
    "one channel x (1+1e-3)": scaled("model.layers.15.post_attention_layernorm.weight", 1 + 1e-3, 0),
    "final norm weight x (1+1e-5)": scaled("model.norm.weight", 1 + 1e-5),
}


def judge_both(kind, orig32, orig64, conv, targets) -> dict:
    from normswap.check.core import _metrics
    from normswap.check.policy import (
        FLOAT64_RULE,
        against_reference,
        default_tolerance,
        float64_summary,
        judge,
        top1_within_margin,
    )

    tol = default_tolerance("float32")
    m = _metrics(kind, orig32, conv, targets)
    fixed = judge(m, tol, None)
    o64, c64 = _metrics(kind, orig64, orig32, targets), _metrics(kind, orig64, conv, targets)
    f64 = float64_summary(o64, c64)
    failed64 = against_reference(o64, c64, FLOAT64_RULE, "float64")
    return {
        "max_abs": m["max_abs"],
        "top1": m.get("top1"),
        "top1_near_ties": top1_within_margin(m, tol) if "top1" in m else None,
        "fixed_bound": "PASS" if not fixed else "FAIL",
        **{k: f64[k] for k in ("e_orig", "e_conv", "kl_orig", "kl_conv", "bound", "kl_bound")},
        "ratio": f64["e_conv"] / f64["bound"],
        "kl_ratio": None if f64["kl_bound"] is None else f64["kl_conv"] / f64["kl_bound"],
        "float64_rule": "PASS" if not failed64 else "FAIL",
        "verdict": "PASS" if not fixed or not failed64 else "FAIL",
    }


def measure_model(name: str, inputs: dict, variants: dict, log) -> list[dict]:
    import torch

    from normswap import io
    from normswap.check.metrics import next_token_targets

    original = io.load_model(name, dtype="float32", tokenizer=False).model
    rows = []
    for text, ids in inputs.items():
        targets = next_token_targets(ids)
        kind = "logits" if hasattr(original, "lm_head") else "last_hidden_state"
        t0 = time.perf_counter()
        orig32 = logits(original, ids)
        t32 = time.perf_counter() - t0
        m64 = upcast_copy(original)
        t0 = time.perf_counter()
        orig64 = logits(m64, ids)
        t64 = time.perf_counter() - t0
        exact = logits(m64, ids, pure64())
        del m64
        from normswap.check.core import _metrics

        own = _metrics(kind, exact, orig64, targets)
        orig_vs_exact = _metrics(kind, exact, orig32, targets)
        log(
            f"{name} {text}: float32 {t32:.1f}s, float64 {t64:.1f}s; "
            f"float64 ref vs pure64 {own['max_abs']:.3g}"
        )
        rows.append({"model": name, "input": text, "variant": "float64 reference vs pure float64",
                     "kind": "reference", "max_abs": own["max_abs"], "kl": own.get("kl_mean"),
                     "orig32_vs_pure64": orig_vs_exact["max_abs"], "seconds_float32": t32,
                     "seconds_float64": t64})  # fmt: skip
        for variant, apply in variants.items():
            m = copy.deepcopy(original)
            apply(m)
            conv = logits(m, ids)
            del m
            row = {"model": name, "input": text, "variant": variant,
                   "kind": "correct" if variant in CORRECT else "wrong"}  # fmt: skip
            row |= judge_both(kind, orig32, orig64, conv, targets)
            e_exact = _metrics(kind, exact, conv, targets)["max_abs"]
            row["e_conv_vs_pure64"] = e_exact
            log(f"  {variant}: {json.dumps({k: v for k, v in row.items() if k not in ('model', 'input')})}")
            rows.append(row)
        del orig64, exact
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def timed(cmd: list[str], env: dict) -> dict:
    """Run ``cmd`` under /usr/bin/time -v: exit code, wall seconds, peak RSS (MiB), the verdict line."""
    start = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    verdict = [line.strip() for line in r.stdout.splitlines() if "PASSED" in line or "FAILED" in line]
    return {"cmd": " ".join(cmd[2:]), "exit": r.returncode, "seconds": wall,
            "peak_rss_mib": int(rss.group(1)) / 1024 if rss else None, "verdict": verdict,
            "stderr_tail": r.stderr.splitlines()[-3:] if r.returncode not in (0, 1) else []}  # fmt: skip


def cost(work: Path, log) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    license_file = Path(os.__file__).parent / "LICENSE.txt"
    out = work / "rotated"
    norm = [sys.executable, "-m", "normswap"]
    made = timed([*norm, "convert", "smollm2-135m", "--rotate", "hadamard", "-o", str(out)], env)
    log(f"convert: {made}")
    runs = [made | {"what": "convert --rotate hadamard (default text, 512 tokens)"}]
    base = [*norm, "check", "smollm2-135m", str(out), "--text", str(license_file), "--tokens", "1024"]
    for what, extra in (("check, fixed bound final (--max-abs 1: no rerun)", ["--max-abs", "1"]),
                        ("check (fixed bound misses: float64 rerun)", [])):  # fmt: skip
        report = work / f"check{len(runs)}.json"
        r = timed([*base, *extra, "--report", str(report)], env)
        if report.exists():
            r["float64_reference"] = json.loads(report.read_text()).get("float64_reference")
            r["rule"] = json.loads(report.read_text()).get("rule")
        log(f"{what}: {r}")
        runs.append(r | {"what": what})
    return runs


def markdown(data: dict) -> str:
    lines = [f"# float32's second rule (the float64 reference)\n\n{data['command']}; {data['date']}; "
             f"{data['machine']}\n",  # fmt: skip
             "| model | input | variant | kind | max abs vs float32 | top-1 | fixed bound | e_orig | e_conv "
             "| e_conv / bound | kl_conv / kl_bound | float64 rule | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data["rows"]:
        if r["kind"] == "reference":
            continue
        kl = "-" if r["kl_ratio"] is None else f"{r['kl_ratio']:.2f}"
        top1 = "-" if r["top1"] is None else f"{r['top1']:.2%}"
        lines.append(
            f"| {r['model']} | {r['input']} | {r['variant']} | {r['kind']} | {r['max_abs']:.3g} | {top1} | "
            f"{r['fixed_bound']} | {r['e_orig']:.3g} | {r['e_conv']:.3g} | {r['ratio']:.2f} | {kl} | "
            f"{r['float64_rule']} | {r['verdict']} |"
        )
    lines += ["", "The float64 reference's own error (HF float64 vs every internal float32 cast made "
              "float64):", "", "| model | input | max abs | KL | float32 original vs pure float64 | "
              "float32 s | float64 s |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data["rows"]:
        if r["kind"] == "reference":
            kl = "-" if r["kl"] is None else f"{r['kl']:.2g}"
            lines.append(f"| {r['model']} | {r['input']} | {r['max_abs']:.3g} | {kl} | "
                         f"{r['orig32_vs_pure64']:.3g} | {r['seconds_float32']:.1f} | "
                         f"{r['seconds_float64']:.1f} |")  # fmt: skip
    if data.get("cost"):
        lines += ["", "| run | exit | wall s | peak RSS MiB | verdict |", "|---|---|---|---|---|"]
        for r in data["cost"]:
            lines.append(f"| {r['what']} | {r['exit']} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{' / '.join(r['verdict']).replace('|', chr(92) + '|')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


@click.command()
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), default=ROOT / "benchmarks" / "results"
)
@click.option(
    "--cost/--no-cost", "with_cost", default=True, help="Also time the CLI check with/without rerun."
)
@click.option(
    "--work", type=click.Path(file_okay=False, path_type=Path), default=None, help="Scratch parent."
)
@click.option("--measure/--no-measure", default=True, help="--no-measure: keep the rows of --out's JSON.")
def run(out: Path, with_cost: bool, work: Path | None, measure: bool):
    """Measure float32's two rules on SmolLM2 (and minilm-l6) conversions; see the module docstring."""
    from normswap import io
    from normswap.check import default_input_ids
    from normswap.check.inputs import text_ids

    def log(line: str) -> None:
        print(line, flush=True)

    if measure:
        tok = io.load_model("smollm2-135m", dtype="float32").tokenizer
        license_ids = text_ids(tok, license_text(), 1024, source="LICENSE.txt", what="tokens")
        inputs = {
            "default text, 512 tokens": default_input_ids(tok, 512),
            "LICENSE.txt, 1024 tokens": license_ids,
        }
        rows = measure_model("smollm2-135m", inputs, CORRECT | WRONG, log)
        mtok = io.load_model("minilm-l6", dtype="float32").tokenizer
        ln = {"fold": converted(), "LN bias dropped (layer 2 output)": scaled(
            "encoder.layer.2.output.LayerNorm.bias", 0.0)}  # fmt: skip
        rows += measure_model(
            "minilm-l6", {"default text, 256 tokens": default_input_ids(mtok, 256)}, ln, log
        )
        command = (
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python benchmarks/bench_float32_rule.py"
        )
    else:
        kept = json.loads((out / "float32_rule.json").read_text())
        rows, command = kept["rows"], kept["command"] + ", then --no-measure"
    data = {
        "command": command + ("" if with_cost else " --no-cost"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, torch {__import__('torch').__version__}",
        "rows": rows,
    }
    if with_cost:
        with tempfile.TemporaryDirectory(dir=work) as scratch:
            data["cost"] = cost(Path(scratch), log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "float32_rule.json").write_text(json.dumps(data, indent=1))
    (out / "float32_rule.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    run()

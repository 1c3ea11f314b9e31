"""Time of each stage of `normswap convert`'s walk + fold + swap, per real model (load excluded).

    python benchmarks/bench_stages.py                            # smollm2-135m and gemma3-270m, 3 repeats
    python benchmarks/bench_stages.py --models gemma3-270m --repeats 5 --label after

Each model is loaded once with normswap's own loader (float32, CPU); each repeat converts a fresh deep copy
of it exactly as `normswap convert` does (or, with `--inputs library`, as `normswap.convert(model)` does, on
the walk's default 2 x 16 ids): `walk` on the check's token ids (the command's default: 512 tokens
of its bundled text; their first 32 since `normswap.walk.short_inputs`), then `convert(..., traced=...)`.
Every stage is timed with `time.perf_counter` around the function that does it (patched in for the run,
restored after):

| stage | function(s) |
|---|---|
| trace | `normswap.walk.trace`: the one traced forward |
| probe | `normswap.walk._sites` and `_unreached`: probing every candidate module |
| walk, rest | the remainder of `walk` (untouched parameters, guards) |
| plan | `normswap.fold.plan`: sharing, untying, overflow test of every fold |
| untie proof | the forwards `normswap.fold.untie_checked` runs (`normswap.walk.run_example`) |
| untie copy | `normswap.fold.untie_parameters`: the copy of the tied weight |
| fold | `normswap.fold.fold_site`, all sites |
| swap | `normswap.swap.swap_norms` |
| total | `walk` + `convert`; "other" is total minus the stages above |

The median over the repeats (and the fastest run's total: on a shared machine the run least slowed by other
processes) goes into ``stages.json`` and ``stages.md`` in --out (default
benchmarks/results/); the machine (CPU model, cores, torch threads, load average before and after) is
recorded with them. Rows of a previous ``stages.json`` with another --label are kept, so one file holds a
"before" and an "after" run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("trace", "probe", "walk, rest", "plan", "untie proof", "untie copy", "fold", "swap", "other",
          "total")  # fmt: skip


def _machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def _timers(times: dict[str, float]):
    """Patch a perf_counter timer around each stage's function; ``times[stage]`` accumulates seconds."""
    import normswap.convert  # noqa: F401 - the module, not the function normswap exports under that name
    import normswap.walk  # noqa: F401

    walk_mod, convert_mod = sys.modules["normswap.walk"], sys.modules["normswap.convert"]
    fold_mod = sys.modules["normswap.fold"]
    targets = [
        (walk_mod, "trace", "trace"),
        (walk_mod, "_sites", "probe"),
        (walk_mod, "_unreached", "probe"),
        (walk_mod, "run_example", "untie proof"),
        (fold_mod, "untie_parameters", "untie copy"),
        (convert_mod, "plan", "plan"),
        (convert_mod, "fold_site", "fold"),
        (convert_mod, "swap_norms", "swap"),
        (convert_mod, "walk", "walk"),
    ]
    saved = []
    for module, attr, stage in targets:
        original = getattr(module, attr)
        saved.append((module, attr, original))

        def timed(*args, __f=original, __stage=stage, **kwargs):
            start = time.perf_counter()
            try:
                return __f(*args, **kwargs)
            finally:
                times[__stage] += time.perf_counter() - start

        setattr(module, attr, timed)
    try:
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)


def measure(model, input_ids) -> dict[str, float]:
    """One walk + convert of a deep copy of ``model`` on ``input_ids`` (None: the library's default inputs,
    as ``normswap.convert(model)``): seconds per stage."""
    from normswap.convert import convert

    convert_mod, walk_mod = sys.modules["normswap.convert"], sys.modules["normswap.walk"]
    traced_ids = getattr(walk_mod, "short_inputs", lambda ids: ids)(input_ids)  # what the command traces
    work = copy.deepcopy(model)
    times: dict[str, float] = defaultdict(float)
    with _timers(times):
        start = time.perf_counter()
        traced = convert_mod.walk(work, traced_ids)
        report = convert(work, input_ids=input_ids, traced=traced)
        times["total"] = time.perf_counter() - start
    times["walk, rest"] = times.pop("walk") - times["trace"] - times["probe"]
    named = sum(v for k, v in times.items() if k != "total")
    times["other"] = times["total"] - named
    times["norms"] = (report.norms_found, report.norms_folded, report.norms_swapped)
    del work
    return {stage: times[stage] for stage in STAGES} | {"norms": times["norms"]}


def _table(rows: list[dict]) -> str:
    head = "| model | label | " + " | ".join(STAGES) + " | total, fastest run | norms found/folded/swapped |"
    lines = [head, "|" + "---|" * (len(STAGES) + 4)]
    for r in rows:
        cells = " | ".join(f"{r['median_s'][s]:.2f}" for s in STAGES)
        fastest = min(run["total"] for run in r["runs_s"])
        norms = "/".join(map(str, r["norms"]))
        lines.append(f"| {r['model']} | {r['label']} | {cells} | {fastest:.2f} | {norms} |")
    return "\n".join(lines) + "\n"


def _machine_lines(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        m = r["machine"]
        lines.append(
            f"- {r['model']} ({r['label']}): {m['cpu']}, {m['cores']} cores, "
            f"{m['torch_threads']} torch threads, torch {m['torch']}; "
            f"load average {r['load_before']:.2f} before, {r['load_after']:.2f} after; "
            f"{r['repeats']} repeats, {r['tokens']} tokens"
        )
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--models", default="smollm2-135m,gemma3-270m", show_default=True, help="MODELs (comma list).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1), help="Runs per model.")
@click.option("--tokens", default=None, type=click.IntRange(2), help="Check tokens (default: convert's).")
@click.option("--label", default="now", show_default=True, help="Row label (e.g. before, after).")
@click.option("--inputs", "which", type=click.Choice(["command", "library"]), default="command",
              show_default=True, help="command: the check's ids, as `normswap convert`; library: "
              "`normswap.convert(model)`'s default 2 x 16 ids.")  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results")
def main(models, repeats, tokens, label, which, out):
    """Time each stage of walk + fold + swap on real models; write stages.json and stages.md."""
    from normswap import io
    from normswap.check.inputs import command_input_ids

    out.mkdir(parents=True, exist_ok=True)
    path = out / "stages.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    for name in [m for m in models.split(",") if m]:
        loaded = io.load_model(name)
        ids = (
            command_input_ids(name, loaded.model.config, loaded.tokenizer, tokens)
            if which == "command"
            else None
        )
        load_before = os.getloadavg()[0]
        runs = []
        for i in range(repeats):
            runs.append(measure(loaded.model, ids))
            click.echo(f"{name} run {i + 1}: " + ", ".join(f"{s} {runs[-1][s]:.2f}" for s in STAGES))
        row = {
            "model": name,
            "label": label,
            "tokens": int(ids.shape[-1]) if ids is not None else "2 x 16 (library default)",
            "repeats": repeats,
            "median_s": {s: round(statistics.median(r[s] for r in runs), 3) for s in STAGES},
            "runs_s": [{s: round(r[s], 3) for s in STAGES} for r in runs],
            "norms": list(runs[0]["norms"]),
            "machine": _machine(),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        }
        rows = [r for r in rows if (r["model"], r["label"]) != (name, label)] + [row]
        del loaded
        path.write_text(json.dumps(rows, indent=2) + "\n")
    rows.sort(key=lambda r: (r["model"], r["label"]))
    text = (
        "Seconds per stage of walk + fold + swap (median of the repeats; load excluded), "
        "benchmarks/bench_stages.py.\n\n" + _table(rows) + "\n" + _machine_lines(rows)
    )
    (out / "stages.md").write_text(text)
    click.echo(text)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

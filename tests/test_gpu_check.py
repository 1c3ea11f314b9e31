"""benchmarks/gpu_check.sh runs only on a GPU machine after the fact: its parts are dry-run here on the CPU
with tiny models (DEVICE=cpu SIZE=tiny), so the script and benchmarks/gpu_models.py cannot rot unseen."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(tmp_path: Path, parts: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEVICE": "cpu", "SIZE": "tiny", "PARTS": parts}
    env["ZOO_ONLY"] = "llama gemma3_text"
    env["BUDGET_S"] = "3600"  # a loaded CI machine must not leave parts out for time
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)


NEEDS_BASH = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash"
)


def _verdicts(tmp_path: Path, proc: subprocess.CompletedProcess) -> dict[str, str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    verdicts = {line.split()[1]: line.split()[0] for line in summary}
    assert not any(v == "FAIL" for v in verdicts.values()), summary
    assert not list((tmp_path / "out").glob("models*"))  # the generated checkpoints are removed
    return verdicts


@NEEDS_BASH
def test_gpu_check_dry_run(tmp_path):
    """Generate a tiny Llama, convert it through the CLI (bf16, --device cpu), in memory and streamed under
    --max-memory: both parts pass and leave their summary line and report."""
    verdicts = _verdicts(tmp_path, _run(tmp_path, "llama stream"))
    assert [verdicts[p] for p in ("llama", "stream")] == ["PASS"] * 2, verdicts
    for name in ("llama", "stream"):
        report = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert report["norms_found"] == report["norms_folded"] == 5 and report["check"]["passed"]
        assert report["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "out" / "stream.json").read_text())["streamed"]
    assert "peak weights held" in (tmp_path / "out" / "stream.log").read_text()


@pytest.mark.slow
@NEEDS_BASH
def test_gpu_check_dry_run_other_parts(tmp_path):
    """The other parts, after the Llama they start from: timing original vs converted (eager, and compiled
    static-cache decoding with dynamo's eager backend: minutes of compiling on 2 cores), --device-map auto,
    rotation on the zoo and on the Llama, the automatic streaming choice (each passes; the default run
    covers the script's machinery with two parts)."""
    verdicts = _verdicts(tmp_path, _run(tmp_path, "llama time devmap rotzoo rotate auto"))
    assert [verdicts[p] for p in ("time", "devmap", "rotzoo", "rotate", "auto")] == ["PASS"] * 5, verdicts
    report = json.loads((tmp_path / "out" / "devmap.json").read_text())
    assert report["norms_found"] == report["norms_folded"] == 5 and report["check"]["passed"]
    timings = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert timings["prefill"]["original_ms"] > 0 and timings["decode"]["converted_ms"] > 0
    compiled = timings["compile"]
    assert compiled["graph_breaks"] == 0 and compiled["converted"]["unique_graphs"] >= 1
    assert compiled["unique_graphs_after_timing"] == compiled["unique_graphs_after_warmup"]  # no recompile
    assert timings["decode_compiled"]["converted_ms"] > 0


def test_gpu_check_time_budget(tmp_path):
    """A part whose time limit no longer fits in BUDGET_S is not started: listed as skipped for the budget,
    with the PARTS to run it by."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEVICE": "cpu", "SIZE": "tiny", "PARTS": "llama zoo"}
    env["BUDGET_S"] = "100"  # llama's limit is 120 s
    mine = tmp_path / "out" / "models" / "notes.txt"  # a user's folder where older scripts put their models
    mine.parent.mkdir(parents=True)
    mine.write_text("not the script's")
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert mine.read_text() == "not the script's"
    assert [p.name for p in (tmp_path / "out").glob("models*")] == ["models"]  # its own folder is removed
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "SKIP llama: time budget" in summary and "rerun with PARTS=llama" in summary
    assert "SKIP zoo: time budget" in summary
    assert proc.returncode == 1 and "FAIL devmap, time, rotate, stream, auto: no converted Llama" in summary


def test_gpu_check_fails_when_a_part_fails(tmp_path):
    proc = _run(tmp_path, "time")  # no Llama generated: devmap and time cannot run
    assert proc.returncode == 1
    assert (
        "FAIL devmap, time, rotate, stream, auto: no converted Llama"
        in (tmp_path / "out" / "summary.txt").read_text()
    )

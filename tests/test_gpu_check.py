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
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")
def test_gpu_check_dry_run(tmp_path):
    """Generate a tiny Llama, convert it through the CLI (bf16, --device cpu), again with --device-map auto,
    again streamed with --max-memory a quarter of its weights, and time original vs converted: every part
    passes and leaves its summary line and report."""
    proc = _run(tmp_path, "llama devmap stream time")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary if line.startswith("PASS")] == [
        ["PASS", "llama"], ["PASS", "devmap"], ["PASS", "stream"], ["PASS", "time"],
    ]  # fmt: skip
    streamed = json.loads((tmp_path / "out" / "stream.json").read_text())["streamed"]
    assert streamed["shards"] >= 1 and streamed["peak_weight_bytes"] > 0
    for name in ("llama", "devmap"):
        report = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert report["norms_found"] == report["norms_folded"] == 5 and report["check"]["passed"]
        assert report["dtype"] == "bfloat16"
    timings = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert timings["prefill"]["original_ms"] > 0 and timings["decode"]["converted_ms"] > 0
    assert not (tmp_path / "out" / "models").exists()  # the generated checkpoints are removed


def test_gpu_check_fails_when_a_part_fails(tmp_path):
    proc = _run(tmp_path, "time")  # no Llama generated: devmap and time cannot run
    assert proc.returncode == 1
    assert "FAIL devmap, stream, time: no converted Llama" in (tmp_path / "out" / "summary.txt").read_text()

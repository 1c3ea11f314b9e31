"""normswap.bench and `normswap bench` on tiny sizes (no timing is asserted, only structure and
that every timed norm computes what the module it stands for computes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from normswap import bench

ROOT = Path(__file__).resolve().parents[1]


def test_bench_kernels_rows_and_agreement():
    rows = bench.bench_kernels([(8, 48)], ["float32", "bfloat16"], ["eager", "torch"], rounds=2)
    names = {r["name"] for r in rows}
    assert {"copy", "HF LlamaRMSNorm", "nn.LayerNorm", "normswap rms_norm llama [torch]"} <= names
    assert len(rows) == 2 * len(names)
    for r in rows:
        assert r["median_s"] > 0 and r["gb_per_s"] > 0
        if r["name"] == "copy":
            assert r["ratio_to_copy"] == 1.0
        if r["name"].startswith("normswap"):
            # eager and torch reproduce the HF modules bit for bit on the CPU (see test_kernels.py),
            # except the Cohere-style two-pass formula of eager layer_norm vs nn.LayerNorm's kernel
            # (float32 summation order: below 1e-5 of outputs of magnitude ~3).
            assert r["agrees_with"] is not None
            if r["name"] == "normswap layer_norm [eager]":
                assert r["max_abs_diff"] <= (1e-5 if r["dtype"] == "float32" else 2**-5)
            else:
                assert r["max_abs_diff"] == 0.0, r
    table = bench.format_table(rows)
    assert "| copy | 1.00x" in table and "8x48 bfloat16" in table


def test_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown dtype"):
        bench.bench_kernels([(4, 8)], ["float12"], ["eager"], rounds=1)
    with pytest.raises(ValueError, match="rounds"):
        bench.bench_kernels([(4, 8)], ["float32"], ["eager"], rounds=0)


def test_write_results(tmp_path):
    rows = bench.bench_kernels([(4, 16)], ["float32"], ["eager"], rounds=1)
    paths = bench.write_results(rows, tmp_path / "out", bench.machine_info("cpu", False))
    doc = json.loads(paths[0].read_text())
    assert doc["results"] == rows and doc["machine"]["torch"] == torch.__version__
    if importlib.util.find_spec("matplotlib") is not None:
        assert paths[1].suffix == ".png" and paths[1].stat().st_size > 0


def test_bench_command_exit_codes(tmp_path):
    """``normswap bench`` (and benchmarks/bench_norms.py, which calls it): bad input exits 2 with one line."""
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    out = ["--out", str(tmp_path)]
    cases = [
        (["--rounds", "0"], "0 is not in the range x>=1"),
        (["--dtypes", "float12", "--backends", "eager", *out], "unknown dtype"),
        (["--backends", "fast", *out], "backend must be one of"),
        (["--threads", "0", *out], "0 is not in the range x>=1"),
    ]
    for args, message in cases:
        result = runner.invoke(main, ["bench", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output
    args = ["--quick", "--no-heap-reuse", "--dtypes", "float32", "--backends", "eager,torch", *out]
    result = runner.invoke(main, ["bench", *args])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "norm_kernels.json").read_text())["results"]


def test_bench_model_on_tiny_gguf(tiny_gguf):
    """Original vs converted on a tiny Llama: both phases timed, same greedy tokens after conversion."""
    rows = bench.bench_model(str(tiny_gguf), prompt_len=16, decode_tokens=3, rounds=1)
    assert [(r["phase"], r["model"]) for r in rows] == [
        ("prefill", "original"),
        ("prefill", "converted"),
        ("decode", "original"),
        ("decode", "converted"),
    ]
    assert all(r["tokens_agree"] for r in rows) and all(r["median_s"] > 0 for r in rows)
    assert "| decode | converted |" in bench.format_model_table(rows)

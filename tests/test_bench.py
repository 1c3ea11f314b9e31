"""normswap.bench and `normswap bench` on tiny sizes (no timing is asserted, only structure and
that every timed norm computes what the module it stands for computes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from normswap import bench
from normswap.bench import kernels as bench_kernels_mod

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
    assert doc["targets"] == []  # no target covers [4, 16]
    md = paths[1].read_text()
    assert "| HF LlamaRMSNorm |" in md and "RMSNorm (llama order): shape, dtype" in md
    summary = md.split("## summary")[1]
    assert "| 4x16 float32 |" in summary and "x [eager]" in summary  # normswap's best backend is named
    if importlib.util.find_spec("matplotlib") is not None:
        assert paths[2].suffix == ".png" and paths[2].stat().st_size > 0


def test_bench_command_exit_codes(tmp_path):
    """``normswap bench`` (and benchmarks/bench_norms.py, which calls it): bad input exits 2 with one line."""
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    out = ["--out", str(tmp_path)]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    fresh = tmp_path / "fresh"  # must not be created by a refused run
    cases = [
        (["--rounds", "0"], "0 is not in the range x>=1"),
        (["--dtypes", "float12", "--backends", "eager", *out], "unknown dtype"),
        (["--dtypes", "float32,int8", "--backends", "eager", *out], "unknown dtype 'int8'"),
        (["--backends", "fast", *out], "backend must be one of"),
        (["--threads", "0", *out], "0 is not in the range x>=1"),
        (["--device", "tpu", *out], "unknown device"),
        (["--device", "meta", *out], "device must be cpu or cuda"),
        (["--quick", "--out", str(a_file)], "not a directory"),
        (["--no-kernels", *out], "nothing to run"),
        (["--quick", "--model", str(tmp_path / "nope"), "--out", str(fresh)], "no such file or directory"),
        (
            ["--no-kernels", "--model", "smollm2-135m", "--device", "tpu", "--out", str(fresh)],
            "unknown device",
        ),
        (["--no-kernels", "--model", "smollm2-135m", "--device", "meta", "--out", str(fresh)], "must be cpu"),
        (["--quick", "--backends", "", "--out", str(fresh)], "list of backends is empty"),
        (["--quick", "--out", str(a_file / "sub")], "is not a directory"),
        (["--shapes", "16384by2048", *out], "is not ROWSxHIDDEN"),
        (["--shapes", "0x64", *out], "is not ROWSxHIDDEN"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda", *out], "sees no CUDA device"))
        cases.append((["--quick", "--backends", "triton", *out], "triton backend runs on cuda"))
    for args, message in cases:
        result = runner.invoke(main, ["bench", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    # every bad argument was refused before any timing: no results were written, no folder was made
    assert not (tmp_path / "norm_kernels.json").exists() and a_file.read_text() == "x"
    assert not fresh.exists()
    args = ["--quick", "--no-heap-reuse", "--dtypes", "float32", "--backends", "eager,torch", *out]
    result = runner.invoke(main, ["bench", *args])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "norm_kernels.json").read_text())
    assert doc["results"] and doc["decode"]
    first = "decode 1x576 float32 normswap FusedRMSNorm [auto]"
    assert any(line.startswith(first) for line in doc["targets"])


def test_bench_decode_rows_and_agreement():
    """Per-call rows at decode sizes: every fused module reproduces its HF module bit for bit (the CPU
    backends, identity weight included), except eager LayerNorm's two-pass formula (float32 order)."""
    from normswap.bench.decode import bench_decode, decode_targets, format_decode_table

    rows = bench_decode([(1, 64), (8, 48)], ["float32", "bfloat16"], ["eager", "torch"], rounds=2, calls=2)
    names = {r["name"] for r in rows}
    assert {"HF LlamaRMSNorm", "normswap FusedRMSNorm [auto]", "normswap FusedLayerNorm [auto]"} <= names
    assert "normswap FusedRMSNorm weight 1 [auto]" in names
    assert {"normswap FusedRMSNorm [eager]", "normswap FusedLayerNorm [torch]", "nn.LayerNorm"} <= names
    assert len(rows) == 4 * len(names)
    for r in rows:
        assert r["per_call_us"] > 0
        if r["name"] == "HF LlamaRMSNorm":
            assert r["ratio_to_hf"] == 1.0
        if r["name"].startswith("normswap"):
            assert r["agrees_with"] is not None
            if r["name"] == "normswap FusedLayerNorm [eager]":
                assert r["max_abs_diff"] <= (1e-5 if r["dtype"] == "float32" else 2**-5)
            else:
                assert r["max_abs_diff"] == 0.0, r
    lines = decode_targets(rows, "cpu")
    assert len(lines) == 3 * 4 and all(line.endswith((": met", ": missed")) for line in lines)
    assert "x HF LlamaRMSNorm (target <= 1.03x)" in lines[0]
    assert "| normswap FusedRMSNorm [auto] |" in format_decode_table(rows)
    assert bench.parse_shapes("16384x2048, 8X64") == ((16384, 2048), (8, 64))


def test_bench_decode_graphs_dry_run_and_capture_failures(monkeypatch, tmp_path):
    """Per call under a CUDA graph: on the CPU the same path without the graph (rows marked ``graph:
    False``); a candidate that cannot be captured is reported with its reason, not dropped, and does not
    stop the others; the rows reach the JSON and the markdown."""
    from normswap.bench import decode

    original = decode._candidates

    def with_a_failure(x, backends):
        cands = original(x, backends)

        def sync():  # stands for a candidate that reads a value back to the host during capture
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

        cands["host read"] = (sync, None)
        return cands

    monkeypatch.setattr(decode, "_candidates", with_a_failure)
    rows = decode.bench_decode_graphs(
        [(1, 64), (4, 32)], ["float32"], ["eager"], rounds=2, device="cpu", calls=3
    )
    names = {r["name"] for r in rows}
    assert {
        "F.rms_norm",
        "nn.LayerNorm",
        "normswap FusedRMSNorm [auto]",
        "normswap FusedRMSNorm [eager]",
    } <= names
    assert len(rows) == 2 * len(names)
    for r in rows:
        assert r["graph"] is False
        if r["name"] == "host read":
            assert r["per_call_us"] is None and r["ratio_to_torch"] is None
            assert r["error"] == "RuntimeError: operation not permitted when stream is capturing"
        else:
            assert r["per_call_us"] > 0 and r["error"] is None
        if r["name"] == "F.rms_norm":
            assert r["ratio_to_torch"] == 1.0
    table = decode.format_graph_table(rows)
    assert table.startswith("| dry run (no graph), us per call |") and "not captured (RuntimeError" in table
    with pytest.raises(ValueError, match="rounds and calls"):
        decode.bench_decode_graphs([(1, 64)], ["float32"], rounds=0, device="cpu")
    paths = bench.write_results([], tmp_path, bench.machine_info("cpu"), graph_rows=rows)
    assert json.loads(paths[0].read_text())["decode_graphs"] == rows
    assert "## decode sizes, per call replayed from a CUDA graph" in paths[1].read_text()


def test_decode_targets_on_cuda_are_microseconds_above_torch():
    """On CUDA a fused module's eager call may cost at most 3 us more than torch's call of the same
    computation: F.rms_norm with the weight, without it for the identity weight, nn.LayerNorm."""
    from normswap.bench.decode import decode_targets

    def row(name, us):
        return {"rows": 1, "hidden": 2048, "dtype": "bfloat16", "name": name, "per_call_us": us}

    rows = [row("HF LlamaRMSNorm", 80.0), row("F.rms_norm", 10.0), row("F.rms_norm, no weight", 9.0)]
    rows += [row("nn.LayerNorm", 12.0), row("normswap FusedRMSNorm [auto]", 12.5)]
    rows += [row("normswap FusedRMSNorm weight 1 [auto]", 12.5), row("normswap FusedLayerNorm [auto]", 14.0)]
    assert decode_targets(rows, "cuda") == [
        "decode 1x2048 bfloat16 normswap FusedRMSNorm [auto]: 12.5 us per call, +2.5 us vs F.rms_norm "
        "(target <= +3 us): met",
        "decode 1x2048 bfloat16 normswap FusedRMSNorm weight 1 [auto]: 12.5 us per call, +3.5 us vs "
        "F.rms_norm, no weight (target <= +3 us): missed",
        "decode 1x2048 bfloat16 normswap FusedLayerNorm [auto]: 14.0 us per call, +2.0 us vs nn.LayerNorm "
        "(target <= +3 us): met",
    ]


def test_bench_model_on_tiny_gguf(tiny_gguf):
    """Two copies each of the original and the converted tiny Llama: both phases timed, each copy's
    median reported, same greedy tokens after conversion."""
    rows = bench.bench_model(str(tiny_gguf), prompt_len=16, decode_tokens=3, rounds=2, copies=2)
    assert [(r["phase"], r["model"]) for r in rows] == [
        ("prefill", "original"),
        ("prefill", "converted"),
        ("decode", "original"),
        ("decode", "converted"),
    ]
    assert all(r["tokens_agree"] for r in rows) and all(r["median_s"] > 0 for r in rows)
    assert all(len(r["copy_medians_s"]) == 2 for r in rows)
    for phase in ("prefill", "decode"):
        orig, conv = (r for r in rows if r["phase"] == phase)
        assert orig["ratio_to_original"] == 1.0
        assert conv["ratio_to_original"] == pytest.approx(conv["median_s"] / orig["median_s"])
    assert "| decode | converted |" in bench.format_model_table(rows)
    with pytest.raises(ValueError, match="copies"):
        bench.bench_model(str(tiny_gguf), copies=0)


@pytest.mark.compile
def test_bench_floor_kernels_compute_what_they_claim():
    """The two compiled reference kernels timed beside the norms: x * w rounded once (bit-identical to
    eager, no reduction involved) and the float32 row sum of squares (float64 reference, float32
    summation-order bound: D * eps32 relative)."""
    from normswap.kernels.compiled import compiled_function

    rows = bench.bench_kernels([(64, 256)], ["bfloat16"], ["compiled"], rounds=1)
    names = {r["name"] for r in rows}
    assert {bench.FLOOR_ONE_PASS, bench.FLOOR_READ} <= names
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 256, generator=g) * 3).bfloat16()
    w = (torch.rand(256, generator=g) + 0.5).bfloat16()
    assert torch.equal(
        compiled_function(bench_kernels_mod._scale_rows)(x, w), (x.float() * w.float()).bfloat16()
    )
    s = compiled_function(bench_kernels_mod._sum_squares)(x)
    want = x.double().pow(2).sum(-1)
    assert s.shape == (64,) and s.dtype == torch.float32
    assert ((s.double() - want).abs() <= 256 * 2**-24 * want).all()


def _row(tokens, hidden, dtype, name, median_s, copy_s):
    return {
        "tokens": tokens,
        "hidden": hidden,
        "dtype": dtype,
        "name": name,
        "median_s": median_s,
        "ratio_to_copy": median_s / copy_s,
    }


def test_check_targets_cpu_and_cuda():
    """The verdicts against the kernel issue's targets, one per op and configuration, for the op's fastest
    backend: CPU <= 1.3x of the copy at [16384, 2048]; CUDA (half types, hidden >= 2048, >= 16384 x 2048
    elements) >= 85% of the copy's bandwidth and faster than torch's and Liger's kernels (those that ran),
    float32 within 1.25x of the copy."""
    rows = [
        _row(16384, 2048, "float32", "copy", 1.0, 1.0),
        _row(16384, 2048, "float32", "normswap rms_norm llama [eager]", 3.5, 1.0),  # slower backend
        _row(16384, 2048, "float32", "normswap rms_norm llama [compiled]", 1.25, 1.0),
        _row(16384, 2048, "bfloat16", "normswap layer_norm [torch]", 1.35, 1.0),
        _row(4096, 576, "bfloat16", "normswap layer_norm [torch]", 3.0, 1.0),  # not covered on the CPU
    ]
    lines = bench.check_targets(rows, "cpu")
    assert len(lines) == 2
    assert lines[0].startswith("[16384, 2048] float32 normswap rms_norm llama [compiled]: 1.25x") and lines[
        0
    ].endswith(": met")
    assert "1.35x of copy (target <= 1.3x): missed" in lines[1]

    cuda = [
        _row(8192, 4096, "bfloat16", "F.rms_norm", 1.5, 1.0),
        _row(8192, 4096, "bfloat16", "Liger RMSNorm", 1.4, 1.0),
        _row(8192, 4096, "bfloat16", "nn.LayerNorm", 1.1, 1.0),
        _row(8192, 4096, "bfloat16", "normswap rms_norm llama [torch]", 1.5, 1.0),  # slower backend
        _row(8192, 4096, "bfloat16", "normswap rms_norm llama [triton]", 1.15, 1.0),  # 87%, faster: met
        _row(8192, 4096, "bfloat16", "normswap rms_norm gemma [triton]", 1.6, 1.0),  # 62%, slower: missed
        _row(8192, 4096, "bfloat16", "normswap layer_norm [triton]", 1.16, 1.0),  # 86%, slower than torch
        _row(8192, 4096, "float32", "normswap rms_norm llama [triton]", 1.2, 1.0),  # float32: <= 1.25x
        _row(4096, 576, "bfloat16", "normswap rms_norm llama [triton]", 9.0, 1.0),  # hidden < 2048
        _row(1024, 4096, "float16", "normswap rms_norm llama [triton]", 9.0, 1.0),  # too few rows
    ]
    cuda.append(_row(8192, 4096, "float32", "F.rms_norm", 1.1, 1.0))
    lines = bench.check_targets(cuda, "cuda")
    # Against torch's own call (every dtype): at most its time.
    parity = [line for line in lines if "the time of" in line]
    head = "[8192, 4096] bfloat16 normswap"
    assert parity == [
        f"{head} rms_norm llama [triton]: 0.77x the time of F.rms_norm (target <= 1x): met",
        f"{head} rms_norm gemma [triton]: 1.07x the time of F.rms_norm (target <= 1x): missed",
        f"{head} layer_norm [triton]: 1.05x the time of nn.LayerNorm (target <= 1x): missed",
        "[8192, 4096] float32 normswap rms_norm llama [triton]: 1.09x the time of F.rms_norm (target <= 1x): "
        "missed",
    ]
    lines = [line for line in lines if "the time of" not in line]
    assert len(lines) == 4
    assert "87% of copy bandwidth" in lines[0] and "1.30x the speed of F.rms_norm" in lines[0]
    assert "1.22x the speed of Liger RMSNorm" in lines[0] and lines[0].endswith(": met")
    assert "62% of copy bandwidth" in lines[1] and lines[1].endswith(": missed")
    assert "86% of copy bandwidth" in lines[2] and "0.95x the speed of nn.LayerNorm" in lines[2]
    assert "F.rms_norm" not in lines[2] and lines[2].endswith(": missed")
    assert lines[3] == (
        "[8192, 4096] float32 normswap rms_norm llama [triton]: 1.20x of copy (target <= 1.25x): met"
    )


def test_cuda_timing_is_event_mean_of_back_to_back_calls(monkeypatch):
    """On CUDA a sample is (event elapsed ms) / 1e3 / CUDA_CALLS with CUDA_CALLS calls between the
    events; checked with stand-in events, since the tests run without a GPU."""

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 40.0  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", Event)
    calls = []
    seconds = bench_kernels_mod._time_call(lambda: calls.append(1), torch.device("cuda"))
    assert len(calls) == bench.CUDA_CALLS
    assert seconds == pytest.approx(0.040 / bench.CUDA_CALLS)
    calls.clear()
    assert bench_kernels_mod._time_call(lambda: calls.append(1), torch.device("cpu")) >= 0 and len(calls) == 1


def test_triton_sweep_dry_run_in_interpreter(tmp_path):
    """``python -m normswap.bench.sweep`` (the GPU run's launch-configuration sweep) on the CPU in triton's
    interpreter: every configuration of every op computes the default's output (0 ulps apart here), the
    table and JSON are written; without a GPU or the interpreter it refuses in one line (exit 2)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "normswap.bench.sweep", "--device", "cpu", "--shapes", "300x64"]
    args += ["--dtypes", "float32", "--rounds", "1", "--out", str(tmp_path), "--extended"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "sweep.json").read_text())["results"]
    assert {r["op"] for r in rows} == {"rms_norm llama", "rms_norm gemma", "layer_norm"}
    assert {"default", "legacy", "persistent, early"} <= {r["label"] for r in rows}
    for r in rows:
        assert r["max_ulps_vs_default"] == 0.0 and r["median_s"] > 0 and r["host_s"] > 0, r
    assert "| rms_norm llama 300x64 float32 |" in (tmp_path / "sweep.md").read_text()
    env.pop("TRITON_INTERPRET")
    proc = subprocess.run(args[:5] + ["--out", str(tmp_path / "x")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr

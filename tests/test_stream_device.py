"""Streaming onto a GPU, dry-run on the CPU: ``convert --device cuda --max-memory SIZE``.

There is no GPU in CI, so the GPU is the CPU here, reached through every device-moving code path of the
streamed conversion: ``--device cuda`` is resolved (``normswap.device.resolve_device``, patched) to a device
object every weight is read to, every fold is made on and every forward runs on (``ShardStore``'s
``device``), and the whole streamed
pipeline runs with torch's default device set to ``meta`` (as tests/test_device_guard.py does for the
in-memory pipeline): a tensor made without naming its device lands on ``meta`` and the first op that reads
it fails. The bytes of weights on the device are counted as the streamed model reads and releases them;
they must stay within the budget plus one module's weights. The output must equal the in-memory
conversion's, bit for bit (with ``--rotate``: its matrices and records too). On a real GPU,
benchmarks/gpu_check.sh (part ``stream``) runs the same command.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from test_stream import TOKENS, assert_same_checkpoint, assert_verified, run, save_sharded, tokenizer  # noqa: F401

import normswap.pipeline
from normswap.io.shards import CheckpointReader
from normswap.stream import dist
from normswap.stream import store as stream_store
from normswap.stream.store import ShardStore

BUDGET = 64_000  # "64KB" in accelerate's syntax


@pytest.mark.parametrize(
    "model_type, norm, extra",
    [
        pytest.param("llama", "keep", [], marks=pytest.mark.slow),  # the rotated row covers its path
        ("llama", "keep", ["--rotate", "hadamard", "--rotate-heads"]),
        pytest.param("gpt2", "rmsnorm", [], marks=pytest.mark.slow),
    ],
    ids=["llama", "llama-rotate", "gpt2-center"],
)
def test_gpu_streaming_dry_run(model_type, norm, extra, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    src = save_sharded(make_tiny_model(model_type), tokenizer, tmp_path / "src")
    memory = tmp_path / "memory"
    r = run("convert", src, "-o", memory, "--tokens", TOKENS, "--norm", norm, *extra)
    assert r.exit_code == 0, r.output

    fake_gpu = torch.device("cpu")  # the device object --device cuda resolves to
    asked = []
    monkeypatch.setattr(normswap.pipeline, "resolve_device", lambda spec: asked.append(spec) or fake_gpu)
    real_open, real_convert = ShardStore.__init__, normswap.pipeline._convert

    def opening(store, source, output, device, **kwargs):
        assert device is fake_gpu
        with torch.device("meta"):  # anything made without a device fails at its first use
            real_open(store, source, output, device, **kwargs)

    def converting(store, *args, **kwargs):
        assert isinstance(store, ShardStore)
        with torch.device("meta"):
            return real_convert(store, *args, **kwargs)

    monkeypatch.setattr(ShardStore, "__init__", opening)
    monkeypatch.setattr(normswap.pipeline, "_convert", converting)
    out = tmp_path / "gpu"
    r = run("convert", src, "-o", out, "--tokens", TOKENS, "--norm", norm, "--device", "cuda",
            "--max-memory", "64KB", *extra)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert asked == ["cuda"]
    assert_verified(out, r.output)
    assert_same_checkpoint(memory, out)
    if extra:  # the rotation's matrices and records too
        from safetensors.torch import load_file

        from normswap.rotate import ROTATION_FILE

        got, want = (load_file(str(d / ROTATION_FILE)) for d in (out, memory))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        report, expected = (json.loads((d / "normswap.json").read_text())["rotation"] for d in (out, memory))
        assert report == expected
    streamed = json.loads((out / "normswap.json").read_text())["streamed"]
    reader = CheckpointReader(src)
    largest = max(t.nbytes for t in reader.tensors.values())
    resident = sum(t.nbytes for t in reader.tensors.values() if len(t.shape) <= 1)
    assert streamed["budget"] == BUDGET and streamed["device"] == str(fake_gpu)
    assert resident < streamed["peak_weight_bytes"] <= BUDGET + largest, streamed


def test_device_helpers(monkeypatch):
    """The GPU branches: the device's free memory, its peak, and each process's GPU under accelerate."""
    from normswap import memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 12345)
    assert memory.available_memory("cuda:0") == 7 * 2**30
    assert stream_store.device_peak("cuda:0") == {"peak_device_bytes": 12345}
    assert stream_store.device_peak("cpu") == {}
    assert dist.device(torch.device("cuda", 0)) == torch.device("cuda", 0)  # one process
    monkeypatch.setattr(dist, "world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.device(torch.device("cuda", 0)) == torch.device("cuda", 3)
    assert dist.device(torch.device("cpu")) == torch.device("cpu")


def test_auto_streams_onto_a_small_gpu(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """--device cuda without --max-memory: the estimate is of the device's memory; a device too small
    streams, with the reason naming the device."""
    from normswap import memory

    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    seen = []
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": seen.append(device) or 100_000)
    choice = memory.decide(str(src), "auto", device="cuda:0", tokens=64)
    assert seen == ["cuda:0"] and choice.stream and choice.estimate.device == "cuda:0"
    assert "on cuda:0" in choice.reason and choice.source is not None

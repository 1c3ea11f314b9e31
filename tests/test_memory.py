"""The plain ``normswap convert``: the checkpoint's own dtype, and streaming chosen from a memory estimate.

The estimate's terms are checked against the sizes they are made of (``normswap.memory``'s docstring); its
agreement with measured peaks is a benchmark (benchmarks/bench_memory.py, docs/STREAMING.md). Here: which
path runs, and that a conversion streamed because the memory is short writes what the in-memory path
writes.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from test_stream import TOKENS, assert_verified, run, save_sharded, tensors, tokenizer  # noqa: F401
from transformers import LlamaConfig

from normswap import memory

GIB = 2**30


def _llama(tied=False, layers=32, hidden=4096, inter=11008, vocab=32000):
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         vocab_size=vocab, tie_word_embeddings=tied)  # fmt: skip
    tensors = {"model.embed_tokens.weight": (torch.bfloat16, (vocab, hidden))}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = (torch.bfloat16, (hidden, inter))
        tensors[f"model.layers.{i}.input_layernorm.weight"] = (torch.bfloat16, (hidden,))
    if not tied:
        tensors["lm_head.weight"] = (torch.bfloat16, (vocab, hidden))
    return config, tensors


def test_estimate_terms():
    config, tensors = _llama()
    stored = sum(memory._numel(s) * 2 for _, s in tensors.values())
    half = memory.estimate(tensors, config, torch.bfloat16)
    assert half.parts["weights"] == stored and half.parts["cast"] == 0
    assert half.parts["upcast"] == 2 * stored  # the float32 copy of the check's reference
    assert half.parts["untie"] == 0 and half.stage == "reference"
    assert half.peak == memory.RUNTIME + stored * 3 + half.parts["logits"] + half.parts["activations"]
    full = memory.estimate(tensors, config, torch.float32)
    assert full.parts["weights"] == 2 * stored and full.parts["cast"] == stored and full.parts["upcast"] == 0
    config, tensors = _llama(tied=True)
    tied = memory.estimate(tensors, config, torch.float32, untie=True)
    assert tied.parts["untie"] == 32000 * 4096 * 4
    assert memory.estimate(tensors, config, torch.float32, untie=False).parts["untie"] == 0
    centered = memory.estimate(tensors, config, torch.float32, norm="rmsnorm")
    assert centered.parts["centering"] >= centered.parts["weights"] // 2 and centered.stage == "convert"
    # the walk's recorded forward (32 tokens), held from the walk, through the reference, to the plans
    assert full.parts["recording"] == 0
    recording = memory.RECORD_COPIES * 32 * 32 * (4096 + 11008) * 4
    assert centered.parts["recording"] == recording
    rotated = memory.estimate(tensors, config, torch.bfloat16, rotate=True)
    assert rotated.parts["recording"] == recording // 2
    device = memory.estimate(tensors, config, torch.bfloat16, device="cuda:0")
    assert device.parts["runtime"] == device.parts["cast"] == 0


def test_rotation_term():
    """--rotate: Q and H in float64, every rotated weight's new values (computed before any is assigned)
    and one tensor's float64 blocks, added to the conversion stage; a rotation can make a model stream."""
    from normswap.rotate.apply import CHUNK

    config, tensors = _llama(layers=2, hidden=256, inter=512, vocab=1000)
    plain = memory.estimate(tensors, config, torch.float32)
    rotated = memory.estimate(tensors, config, torch.float32, rotate=True)
    largest = 1000 * 256  # the embedding and lm_head
    head_dim = 256 // config.num_attention_heads
    expected = 8 * (256**2 + head_dim**2) + largest * 4 + 3 * 8 * min(CHUNK, largest) + plain.parts["weights"]
    assert plain.parts["rotation"] == 0 and rotated.parts["rotation"] == expected
    assert rotated.stage == "convert" and rotated.peak > plain.peak
    room = (plain.peak + rotated.peak) / 2 / memory.FITS
    assert not memory.choose(tensors, config, torch.float32, available=room).stream
    assert memory.choose(tensors, config, torch.float32, available=room, rotate=True).stream


def test_choose():
    config, tensors = _llama()
    need = memory.estimate(tensors, config, torch.bfloat16).peak
    assert not memory.choose(tensors, config, torch.bfloat16, available=2 * need).stream
    short = memory.choose(tensors, config, torch.bfloat16, available=need // 2)
    assert short.stream and short.budget == int(memory.STREAM_SHARE * (need // 2))
    assert f"{need / GIB:.1f} GiB" in short.reason and "--no-stream" in short.reason
    tiny = memory.choose(tensors, config, torch.bfloat16, available=1000)  # the budget holds one tensor
    assert tiny.budget == 32000 * 4096 * 2
    assert not memory.choose(tensors, config, torch.bfloat16, available=1000, no_stream=True).stream
    assert not memory.choose(tensors, config, torch.bfloat16, available=None).stream  # cannot tell
    assert not memory.choose(None, config, torch.bfloat16, available=1000).stream  # cannot stream
    weights = memory.weight_bytes(tensors, torch.bfloat16)
    assert memory.choose(tensors, config, torch.bfloat16, max_memory=weights - 1).stream
    assert not memory.choose(tensors, config, torch.bfloat16, max_memory=weights).stream


def test_available_memory(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\nHugePages_Total:       0\n")
    (tmp_path / "max").write_text("max\n")  # cgroup v2 without a limit
    (tmp_path / "current").write_text("5000\n")
    (tmp_path / "limit").write_text("9000\n")
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "CGROUP_FILES", [(str(tmp_path / "max"), str(tmp_path / "current"))])
    assert memory.available_memory() == 2000000 * 1024
    monkeypatch.setattr(memory, "CGROUP_FILES", [(str(tmp_path / "limit"), str(tmp_path / "current"))])
    assert memory.available_memory() == 4000  # a cgroup limit lowers it: 9000 - 5000
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (123, 456))
    assert memory.available_memory("cuda:0") == 123


def test_plain_convert_streams_when_memory_is_short(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """No flag: the estimate exceeds the (patched) memory available, so normswap streams, says so in one
    line, and writes what the in-memory path (--no-stream) writes."""
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": 100_000)
    r = run("convert", src, "-o", tmp_path / "auto", "--tokens", TOKENS)
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if "streaming with a budget of" in line]
    assert len(lines) == 1 and "in memory would need about" in lines[0] and "--no-stream" in lines[0], (
        r.stderr
    )
    assert_verified(tmp_path / "auto", r.output)
    streamed = json.loads((tmp_path / "auto" / "normswap.json").read_text())["streamed"]
    assert streamed["budget"] == max(25_000, 128 * 64 * 4) and streamed["choice"]["available"] == 100_000
    r = run("convert", src, "-o", tmp_path / "memory", "--tokens", TOKENS, "--no-stream")
    assert r.exit_code == 0, r.output
    assert "streaming" not in r.stderr and "streamed" not in json.loads(
        (tmp_path / "memory" / "normswap.json").read_text()
    )
    got, want = tensors(tmp_path / "auto"), tensors(tmp_path / "memory")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)


@pytest.mark.parametrize("stored", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_default_dtype_is_the_checkpoints_own(stored, tokenizer, tmp_path):  # noqa: F811
    """--dtype auto (the default): a half-precision checkpoint converts, checks and saves in its own dtype;
    --dtype float32 still overrides."""
    src = save_sharded(make_tiny_model("llama", dtype=stored), tokenizer, tmp_path / "src")
    name = str(stored).removeprefix("torch.")
    r = run("convert", src, "-o", tmp_path / "own", "--tokens", TOKENS, "--report", tmp_path / "own.json")
    assert r.exit_code == 0, r.output
    assert f"({name})" in r.stdout.splitlines()[0]
    report = json.loads((tmp_path / "own.json").read_text())
    assert report["dtype"] == name and report["check"]["dtype"] == name
    assert {t.dtype for t in tensors(tmp_path / "own").values()} == {stored}
    r = run("convert", src, "-o", tmp_path / "f32", "--tokens", TOKENS, "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert {t.dtype for t in tensors(tmp_path / "f32").values()} == {torch.float32}
    r = run("check", src, tmp_path / "own", "--tokens", TOKENS)  # auto: the original's dtype, for both
    assert r.exit_code == 0, r.output
    assert f"({name}," in r.output


def test_auto_dtype_resolution(tmp_path):
    from normswap.io.load import Resolved, resolve_dtype

    gguf = Resolved("x.gguf", "gguf", str(tmp_path), "x.gguf")
    assert resolve_dtype("auto", gguf, LlamaConfig(dtype="bfloat16")) == torch.float32
    folder = Resolved(str(tmp_path), "dir", str(tmp_path))
    assert resolve_dtype("auto", folder, LlamaConfig(dtype="float16")) == torch.float16
    assert resolve_dtype("auto", folder, LlamaConfig()) == torch.float32  # no dtype, no weights
    assert resolve_dtype("bfloat16", folder, LlamaConfig(dtype="float16")) == torch.bfloat16

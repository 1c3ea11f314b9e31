"""Rotation (``--rotate``) streamed: the same checkpoint, matrices and records as in memory, bit for bit.

Each tiny model (norm weights and biases re-randomized, ``normswap.zoo.tiny_model``) is saved sharded (shards
of a few KB) and converted with ``--rotate`` in memory (itself checked against the original and verified)
and streamed under ``--max-memory 64KB``. The streamed output must hold the same tensors with bit-identical
bytes, the same ``normswap/rotation.safetensors``, the same rotation records in ``normswap.json``, and pass
its own check (no divergence localized) and verification.

Independent of both conversions, the streamed output is loaded in plain transformers and compared with the
original model: logits within 1e-5 (float32 logits of size ~1: a correct rotation moves them by rounding
only, measured 2e-8 .. 7e-7; a wrong one, a tensor rotated on the wrong side or a bias left out, by 1e-2 or
more, tests/test_rotate.py) and every hidden state before the final norm equal to the original's (its mean
over the features subtracted, for a LayerNorm model, which is centered first) times the saved Q, computed
here in float64, within 1e-5.

Rows: Llama (RMSNorm), GPT-2 (LayerNorm: centered, Conv1D, learned positions, heads), GPT-OSS (an MoE
whose experts are stored stacked; checkpoints stored one tensor per expert: tests/test_stream_moe.py), and a
tied-embedding Llama with ``--rotate random --rotate-seed 3 --rotate-heads`` (the tied table untied for the
final norm's fold).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_rotated, hidden_outputs, make_tiny_model
from safetensors.torch import load_file
from test_stream import (  # noqa: F401
    TOKENS,
    assert_same_checkpoint,
    assert_verified,
    run,
    save_sharded,
    smollm2_sharded,
    tokenizer,
)
from transformers import AutoModelForCausalLM

from normswap import memory
from normswap.rotate import ROTATION_FILE
from normswap.zoo import ZOO, example_ids

TOL = 1e-5
HEADS = ["--rotate-heads"]
# Llama and GPT-OSS (stacked experts) in the default run; a centered GPT-2 with its heads and a tied Llama
# with a random Q are marked slow (centering streamed and heads are covered by other default tests).
ROWS = [
    ("llama", ["--rotate", "hadamard"]),
    pytest.param("gpt2", ["--rotate", "hadamard", *HEADS], marks=pytest.mark.slow),
    ("gpt_oss", ["--rotate", "hadamard"]),
    pytest.param("llama-tied", ["--rotate", "random", "--rotate-seed", "3", *HEADS], marks=pytest.mark.slow),
]


def _model(name: str, dtype=torch.float32):
    entry = next(e for e in ZOO if e.name == name)
    return make_tiny_model(entry.model_type, dtype=dtype, **entry.overrides)


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> the SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def assert_folder_rotated(original, folder: Path) -> None:
    """The independent check: ``folder`` (plain transformers) against the unconverted ``original``; and its
    ``inputs_embeds`` map (``normswap/inputs_embeds.json``, proved by the conversion on the check's ids),
    applied to the original's embeddings of other ids, reproduces the original's logits within ``TOL``."""
    from normswap.rotate import inputs

    q = load_file(str(folder / ROTATION_FILE))["Q"]
    centered = json.loads((folder / "normswap.json").read_text())["rotation"]["centered"]
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = example_ids()
    before = hidden_outputs(original, ids)
    assert_rotated(before, hidden_outputs(fresh, ids), q, centered, TOL)
    transform = inputs.load(folder)
    assert (
        transform["verified"]["passed"] and transform["verified"]["max_abs_diff"] <= 2e-4
    )  # float32's bound
    with torch.no_grad():
        mapped = inputs.apply(transform, original.get_input_embeddings()(ids))
        assert (fresh(inputs_embeds=mapped).logits - before.logits).abs().max().item() <= TOL


@pytest.mark.parametrize("name, args", ROWS, ids=["llama", "gpt2", "gpt_oss", "llama-tied"])
def test_rotation_streamed_equals_in_memory(name, args, tokenizer, tmp_path):  # noqa: F811
    model = _model(name)
    src = save_sharded(model, tokenizer, tmp_path / "src")
    before = _tree(src)
    memory_out, streamed = tmp_path / "memory", tmp_path / "streamed"
    r = run("convert", src, "-o", memory_out, "--tokens", TOKENS, *args)
    assert r.exit_code == 0, r.output
    r = run("convert", src, "-o", streamed, "--tokens", TOKENS, *args, "--max-memory", "64KB")
    assert r.exit_code == 0, r.output
    assert "rotated:  Q 64 x 64" in r.output and "first divergence" not in r.output, r.output
    assert_verified(streamed, r.output)
    assert_same_checkpoint(memory_out, streamed)
    got, want = (load_file(str(d / ROTATION_FILE)) for d in (streamed, memory_out))
    assert got.keys() == want.keys() == ({"Q", "H"} if "--rotate-heads" in args else {"Q"})
    assert all(got[k].dtype == torch.float64 and torch.equal(got[k], want[k]) for k in got)
    report, expected = (json.loads((d / "normswap.json").read_text()) for d in (streamed, memory_out))
    for r in (report, expected):  # the map's proof: the streamed and in-memory forwards round apart
        assert r["rotation"]["inputs_embeds"].pop("verified")["passed"]
    assert report["rotation"] == expected["rotation"] and report["rotation"]["tensors"]
    assert report["norm"] == expected["norm"] and report["centering"] == expected["centering"]
    assert report["check"]["passed"] and report["check"]["divergence"] is None
    assert report["streamed"]["rotation_bytes"] >= 8 * 64 * 64  # Q in float64, at least
    assert _tree(src) == before  # the input is only read
    assert_folder_rotated(model, streamed)


INPUTS_ROWS = [
    # BLOOM's rewritten table is proved in memory by tests/test_rotate.py; streamed in the slow run
    pytest.param("bloom", {}, [], "e -> rewrite(e) @ Q", id="bloom", marks=pytest.mark.slow),
    pytest.param("opt", {"word_embed_proj_dim": 32}, HEADS, "e -> e", id="opt-project_in"),
    # e @ Q streamed as Llama's (ROWS); its scaled table is covered in memory by tests/test_rotate.py
    pytest.param(
        "gemma", {"tie_word_embeddings": False}, [], "e -> e @ Q", id="gemma", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("model_type, overrides, heads, formula", INPUTS_ROWS)
def test_inputs_embeds_map_streamed_and_in_memory(model_type, overrides, heads, formula, tokenizer,  # noqa: F811
                                                  tmp_path):  # fmt: skip
    """The tables the rotation meets besides Llama's and GPT-2's (ROWS): BLOOM's, rewritten for its
    embedding norm; OPT's, read by ``project_in`` (rotated in its place); Gemma's, scaled in its module. In
    memory and streamed, the same map is written and proved on the check's ids, the summary names it, and
    it holds on other ids against the original (``assert_folder_rotated``)."""
    model = make_tiny_model(model_type, **overrides)
    src = save_sharded(model, tokenizer, tmp_path / "src")
    maps = []
    for out, extra in ((tmp_path / "memory", []), (tmp_path / "streamed", ["--max-memory", "64KB"])):
        r = run("convert", src, "-o", out, "--tokens", TOKENS, "--rotate", "hadamard", *heads, *extra)
        assert r.exit_code == 0, r.output
        assert f"inputs_embeds: {formula} (normswap/inputs_embeds.json; proved on the check's ids" in r.output
        assert_folder_rotated(model, out)
        maps.append(json.loads((out / "normswap" / "inputs_embeds.json").read_text()))
    for m in maps:
        del m["verified"]  # the streamed and in-memory forwards round apart
    assert maps[0] == maps[1] and maps[0]["map"] == formula


def _converted(model, tokenizer, tmp_path, *args) -> tuple[Path, Path]:  # noqa: F811
    """``model`` saved sharded (``src``) and converted in memory with ``args`` (``conv``)."""
    src = save_sharded(model, tokenizer, tmp_path / "src")
    r = run("convert", src, "-o", tmp_path / "conv", "--tokens", TOKENS, *args)
    assert r.exit_code == 0, r.output
    return src, tmp_path / "conv"


@pytest.mark.parametrize(  # a centered GPT-2 output in the default run (its centering.json not carried)
    "name, first", [pytest.param("llama", [], marks=pytest.mark.slow), ("gpt2", ["--norm", "rmsnorm"])]
)
def test_a_converted_output_is_rotated(name, first, tokenizer, tmp_path):  # noqa: F811
    """Folded norms are what a rotation needs: an output of normswap that was not rotated (folded; for
    GPT-2 also centered) is rotated, in memory and streamed (the same bytes), and the result is exact
    against the ORIGINAL model: logits, hidden states (centered) times the saved Q, the inputs_embeds map.
    The input's own records (its centering.json) are not carried into the output."""
    model = _model(name)
    _, conv = _converted(model, tokenizer, tmp_path, *first)
    args = ["--tokens", TOKENS, "--rotate", "hadamard", *HEADS]
    r = run("convert", conv, "-o", tmp_path / "memory", *args)
    assert r.exit_code == 0, r.output
    r = run("convert", conv, "-o", tmp_path / "streamed", *args, "--max-memory", "64KB")
    assert r.exit_code == 0, r.output
    assert_same_checkpoint(tmp_path / "memory", tmp_path / "streamed")
    carried = [
        json.loads((tmp_path / out / "normswap.json").read_text())["carried"]
        for out in ("memory", "streamed")
    ]
    assert carried[0] == carried[1]  # what the two paths say they copied: the same
    for out in (tmp_path / "memory", tmp_path / "streamed"):
        report = json.loads((out / "normswap.json").read_text())
        assert report["check"]["passed"] and report["check"]["divergence"] is None
        assert report["rotation"]["centered"] is (name == "gpt2")
        assert_folder_rotated(model, out)
        # the output's normswap.json is this conversion's, never a copy of the input's, nor said to be one
        assert report["model"] == str(conv) and "normswap.json" not in (report["carried"] or {}).get(
            "files", []
        )
        if name == "gpt2":  # the input's centering.json is its own record (e - mean alone): not carried over
            assert not (out / "centering.json").exists()
            [why] = [x for x in report["carried"]["not_copied"] if x.startswith("centering.json ")]
            assert "record of the input's own conversion" in why


def test_a_rotated_output_is_not_rotated_or_centered_again(tokenizer, tmp_path):  # noqa: F811
    """A rotated GPT-2 (centered by its rotation): ``--rotate`` again is refused (a second Q would make the
    saved records relative to the rotated input, not the original), ``--norm rmsnorm`` has nothing to do;
    each in one line, in memory and streamed, nothing written, the input unchanged."""
    _, conv = _converted(_model("gpt2"), tokenizer, tmp_path, "--rotate", "hadamard")
    before = _tree(conv)
    for extra in ([], ["--max-memory", "64KB"]):
        r = run("convert", conv, "-o", tmp_path / "again", "--tokens", TOKENS, "--rotate", "random", *extra)
        _refused(
            r, "conv: already rotated by normswap", "normswap/rotation.safetensors", "rotate the original"
        )
        r = run("convert", conv, "-o", tmp_path / "again", "--tokens", TOKENS, "--norm", "rmsnorm", *extra)
        _refused(r, "conv: nothing to do: already centered and rotated by normswap", "would change nothing")
        r = run("convert", conv, "-o", tmp_path / "again", "--tokens", TOKENS, *extra)
        _refused(r, "conv: nothing to fold: already converted, centered and rotated by normswap")
    assert _tree(conv) == before and not (tmp_path / "again").exists()


@pytest.mark.slow  # the automatic choice is tested without a rotation by tests/test_memory.py
def test_rotation_streams_when_memory_is_short(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """No --max-memory: the estimate (with the rotation's term) exceeds the patched memory available, so
    normswap streams, and writes what the in-memory path (--no-stream) writes."""
    src = save_sharded(_model("llama"), tokenizer, tmp_path / "src")
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": 100_000)
    args = ["--tokens", TOKENS, "--rotate", "hadamard"]
    r = run("convert", src, "-o", tmp_path / "auto", *args)
    assert r.exit_code == 0, r.output
    assert "streaming with a budget of" in r.stderr
    choice = json.loads((tmp_path / "auto" / "normswap.json").read_text())["streamed"]["choice"]
    assert choice["estimate"]["parts"]["rotation"] > 0
    r = run("convert", src, "-o", tmp_path / "memory", *args, "--no-stream")
    assert r.exit_code == 0, r.output
    assert_same_checkpoint(tmp_path / "memory", tmp_path / "auto")
    q = [load_file(str(tmp_path / d / ROTATION_FILE))["Q"] for d in ("auto", "memory")]
    assert torch.equal(q[0], q[1])


def _refused(result, *fragments) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert all(f in lines[0] for f in fragments), lines[0]


def test_post_norm_is_refused_before_writing(tokenizer, tmp_path):  # noqa: F811
    """Gemma 2 adds a weighted post-norm's output into the stream: refused by the plan, in one line, before
    anything is written; the input is left as it was."""
    src = save_sharded(_model("gemma2"), tokenizer, tmp_path / "src")
    before = _tree(src)
    r = run("convert", src, "-o", tmp_path / "out", "--tokens", TOKENS, "--rotate", "hadamard",
            "--max-memory", "64KB")  # fmt: skip
    _refused(r, "cannot rotate", "post_attention_layernorm adds its output")
    assert _tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_float16_overflow_is_refused_and_nothing_is_left(tokenizer, tmp_path):  # noqa: F811
    """A float16 embedding row equal to 70000 times Q's first column (entries +-8750, which fit) rotates to
    70000 in one feature, beyond float16's 65504. Streamed, the weight is rotated as it is written: refused
    in one line naming it, the hidden output folder removed, no output, the input unchanged."""
    from normswap.rotate.matrix import generator, make

    model = _model("llama", dtype=torch.float16)  # untied: the row is only looked up, the logits stay finite
    q = make("Q", 64, "hadamard", generator(0)).values  # the matrix convert will draw (seed 0)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = (70000.0 * q[:, 0]).half()
    src = save_sharded(model, tokenizer, tmp_path / "src")
    before = _tree(src)
    r = run("convert", src, "-o", tmp_path / "out", "--tokens", TOKENS, "--rotate", "hadamard",
            "--max-memory", "64KB")  # fmt: skip
    _refused(r, "cannot rotate: model.embed_tokens.weight would leave the range of torch.float16 (65504)")
    assert _tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow  # 35 s; tests/test_stream.py runs the plain two-process case by default
def test_two_processes_write_the_same_rotated_bytes(tokenizer, tmp_path):  # noqa: F811
    """``accelerate launch --multi_gpu --num_processes 2`` on the CPU (gloo), rotated: every process plans
    and rotates, each writes its shards; shards, index and Q file byte-identical to one process's."""
    import subprocess
    import sys

    src = save_sharded(_model("llama"), tokenizer, tmp_path / "src")
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["convert", str(src), "--output", str(two), "--tokens", TOKENS, "--max-memory", "4KB",
            "--rotate", "hadamard", *HEADS]  # fmt: skip
    r = run(*[one if a == str(two) else a for a in args])
    assert r.exit_code == 0, r.output
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "29519"]  # fmt: skip
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "normswap", *args]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in one.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(p.name for p in two.glob("*.safetensors"))
    for name in [*files, "model.safetensors.index.json", ROTATION_FILE]:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    report = json.loads((two / "normswap.json").read_text())
    assert report["streamed"]["processes"] == 2
    assert report["rotation"] == json.loads((one / "normswap.json").read_text())["rotation"]
    assert_verified(two, done.stdout)


@pytest.mark.slow  # CI time; the tiny models' tests cover the same kinds
@pytest.mark.real
def test_smollm2_rotated_streamed_equals_in_memory(tmp_path):
    """SmolLM2-135M (as float32 safetensors) with --rotate hadamard, in memory and under --max-memory 100MB:
    every tensor, the Q file and the records bit for bit (benchmarks/bench_stream_rotate.py measures it)."""
    src = smollm2_sharded(tmp_path / "src")
    memory_out, streamed = tmp_path / "memory", tmp_path / "streamed"
    r = run("convert", src, "-o", memory_out, "--rotate", "hadamard")
    assert r.exit_code == 0, r.output
    r = run("convert", src, "-o", streamed, "--rotate", "hadamard", "--max-memory", "100MB")
    assert r.exit_code == 0, r.output
    assert_verified(streamed, r.output)
    assert_same_checkpoint(memory_out, streamed)
    got, want = (load_file(str(d / ROTATION_FILE)) for d in (streamed, memory_out))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    report, expected = (json.loads((d / "normswap.json").read_text()) for d in (streamed, memory_out))
    for r in (report, expected):  # the map's proof: the streamed and in-memory forwards round apart
        assert r["rotation"]["inputs_embeds"].pop("verified")["passed"]
    assert report["rotation"] == expected["rotation"] and report["check"]["divergence"] is None

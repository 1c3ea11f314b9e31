"""Centering (``--norm rmsnorm``) streamed: the same checkpoint as the in-memory path, bit for bit.

Each LayerNorm model is saved sharded (shards of a few KB), converted with ``--norm rmsnorm`` in memory
(itself checked against the original by the CLI's check, and verified) and streamed under ``--max-memory
64KB``; the streamed output must hold the same tensor names with bit-identical bytes, the same sites, and
pass its own verification. The rows cover the kinds centering meets: GPT-2 (Conv1D writers, learned
positions, lm_head tied to the embedding and untied by centering), OPT (a projection after the final norm),
GPT-NeoX (an ``embed_out`` that transformers renames to ``lm_head`` as it loads), BLOOM (the embedding table
rewritten for its LayerNorm), Falcon without biases (a config flag adds the zero biases the fold needs).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from test_stream import TOKENS, assert_same_checkpoint, assert_verified, run, save_sharded, tokenizer  # noqa: F401

from normswap.io.shards import CheckpointReader
from normswap.stream.model import build

_SLOW = pytest.mark.slow
ROWS = [
    ("gpt2", {}),
    pytest.param("opt", {}, marks=_SLOW),
    pytest.param("gpt_neox", {"use_parallel_residual": False}, marks=_SLOW),
    pytest.param("bloom", {}, marks=_SLOW),
    pytest.param(
        "falcon", {"new_decoder_architecture": False, "multi_query": True, "bias": False}, marks=_SLOW
    ),
]


@pytest.mark.parametrize("model_type, overrides", ROWS)
def test_centering_streamed_equals_in_memory(model_type, overrides, tokenizer, tmp_path):  # noqa: F811
    src = save_sharded(make_tiny_model(model_type, **overrides), tokenizer, tmp_path / "src")
    memory, streamed = tmp_path / "memory", tmp_path / "streamed"
    r = run("convert", src, "-o", memory, "--tokens", TOKENS, "--norm", "rmsnorm")
    assert r.exit_code == 0, r.output
    r = run("convert", src, "-o", streamed, "--tokens", TOKENS, "--norm", "rmsnorm", "--max-memory", "64KB")
    assert r.exit_code == 0, r.output
    assert_verified(streamed, r.output)
    assert_same_checkpoint(memory, streamed)
    report = json.loads((streamed / "normswap.json").read_text())
    assert report["norm"] == "rmsnorm" and report["streamed"]["shards"] == len(CheckpointReader(src).files)
    kinds = {s["kind"] for s in report["sites"]}
    assert kinds == {"rmsnorm"}, kinds  # every LayerNorm became an RMSNorm
    config = json.loads((streamed / "config.json").read_text())
    assert config == json.loads((memory / "config.json").read_text())  # flags set, ties undone, the same
    # the inputs_embeds transform: written, proved on the check's ids, and the in-memory one
    transform, expected = (json.loads((d / "centering.json").read_text()) for d in (streamed, memory))
    assert transform["verified"]["passed"] and expected["verified"]["passed"]
    assert transform["verified"]["max_abs_diff"] <= 2e-4  # float32's tolerance (check.policy)
    del transform["verified"], expected["verified"]  # the streamed and in-memory forwards round apart
    assert transform == expected and transform["kind"] in ("center", "rewrite", "none")


def test_streamed_transform_is_applied_on_every_read(tokenizer, tmp_path):  # noqa: F811
    """``Streamed.transform``: a released weight's values are read and transformed on every read (forward,
    deep copy), a resident one's at once; the original checkpoint is never written."""
    import copy

    model = make_tiny_model("llama")
    src = save_sharded(model, tokenizer, tmp_path / "src")
    streamed = build(model.config, CheckpointReader(src), torch.float32)
    weight = streamed.model.get_parameter("model.layers.0.mlp.down_proj.weight")
    norm = streamed.model.get_parameter("model.norm.weight")
    streamed.transform(weight, lambda t: t * 2)
    streamed.transform(norm, lambda t: t + 1)
    original = dict(model.named_parameters())
    assert torch.equal(copy.deepcopy(weight), original["model.layers.0.mlp.down_proj.weight"] * 2)
    assert torch.equal(norm, original["model.norm.weight"] + 1)
    seen = []
    handle = streamed.model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: seen.append(m.weight.detach().clone())  # runs after the hook that reads the weight
    )
    streamed.model(input_ids=torch.tensor([[1, 2, 3]]))
    handle.remove()
    assert torch.equal(seen[0], original["model.layers.0.mlp.down_proj.weight"] * 2)
    untied = streamed.copy("model.layers.0.mlp.down_proj.weight", weight)  # carries the transforms
    assert torch.equal(copy.deepcopy(untied), original["model.layers.0.mlp.down_proj.weight"] * 2)
    reread = CheckpointReader(src).read("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(reread, original["model.layers.0.mlp.down_proj.weight"])

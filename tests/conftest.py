"""Shared fixtures: tiny random models (constant parameters re-randomized), fixed input ids, a tiny GGUF file.

transformers initializes norm weights at 1 (0 for Gemma's (1+w) norms) and biases at 0, which hides fold
bugs: every tiny model here gets each parameter its initialization left constant moved to ``constant +
U(-0.5, 0.5)`` after building, and BatchNorm running statistics too (``normswap.zoo.randomize_constants``).
This goes by parameter, never through normswap's walk (the code under test): a norm the walk misses keeps a
non-identity weight, so a test that compares outputs still sees it.

Fixtures (all function-scoped, deterministic):

* ``tiny_model(model_type, *, dtype=torch.float32, seed=0, **config_overrides)``
  -> ``normswap.zoo.tiny_model`` cast to ``dtype`` (eval mode, constant parameters re-randomized);
* ``tiny_config(model_type, **config_overrides)`` -> its config, unbuilt;
* ``input_ids`` -> ``LongTensor (2, 16)`` in ``[0, 128)`` from a fixed seed;
* ``tiny_gguf(tmp_path)`` -> path of a small Llama ``.gguf`` file (float32 tensors, 128-token vocabulary).

Plain functions ``make_tiny_model`` and ``write_tiny_gguf`` can be imported from ``conftest`` by test
modules that need them outside fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from normswap.zoo import tiny_config as zoo_tiny_config
from normswap.zoo import tiny_model as tiny_zoo_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is never needed by the suite
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 128


def make_tiny_model(model_type: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """``normswap.zoo.tiny_model`` (constant parameters re-randomized by value), cast to ``dtype``."""
    return tiny_zoo_model(model_type, seed=seed, **overrides).to(dtype)


def hidden_outputs(model, ids):
    """``model``'s forward on ``ids`` with every hidden state (no cache, no gradients)."""
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True, use_cache=False)


def assert_smollm2_rotated(out, q: torch.Tensor) -> None:
    """A rotated SmolLM2-135M output ``out``, loaded fresh in plain transformers (float32), against the
    original on 64 tokens of the default text: logits within the check's float32 bound (2e-4), every hidden
    state before the final norm the original's times ``q`` to 1e-5 of that state's largest entry (they reach
    ~100 in SmolLM2; a correct rotation measures about 4e-7)."""
    from transformers import AutoModelForCausalLM

    from normswap.check import default_input_ids
    from normswap.io import load_model

    original = load_model("smollm2-135m")
    ids = default_input_ids(original.tokenizer, 64)
    fresh = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    before, after = hidden_outputs(original.model, ids), hidden_outputs(fresh, ids)
    assert (before.logits - after.logits).abs().max().item() <= 2e-4
    worst = max(
        ((h0.double() @ q - h1.double()).abs().max() / h0.double().abs().max()).item()
        for h0, h1 in zip(before.hidden_states[:-1], after.hidden_states[:-1], strict=True)
    )
    assert worst <= 1e-5


def assert_rotated(before, after, q: torch.Tensor, centered: bool, tol: float) -> None:
    """A rotation's independent check: the rotated model's logits (``after``, from ``hidden_outputs``) within
    ``tol`` of the original's (``before``), and every hidden state before the final norm the original's
    (minus its mean over the features, for a centered LayerNorm model) times ``q``, in float64, within
    ``tol``."""
    assert (before.logits - after.logits).abs().max().item() <= tol
    for h0, h1 in zip(before.hidden_states[:-1], after.hidden_states[:-1], strict=True):
        h0 = h0.double()
        if centered:
            h0 = h0 - h0.mean(-1, keepdim=True)
        assert (h0 @ q - h1.double()).abs().max().item() <= tol


@pytest.fixture
def tiny_config():
    """Factory: ``tiny_config(model_type, **overrides)`` -> config."""
    return zoo_tiny_config


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(model_type, dtype=..., seed=..., **overrides)`` -> model."""
    return make_tiny_model


@pytest.fixture
def input_ids() -> torch.LongTensor:
    """``LongTensor (2, 16)`` of token ids in ``[0, 128)`` from a fixed seed."""
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1234))


def write_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """Write a small Llama GGUF file (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128, float32).

    The tokenizer is a byte-level SentencePiece-style vocabulary (``<unk> <s> </s>``, then the 125 tokens
    ``<0x00>`` .. ``<0x7C>``); norm weights are ``1 + U(-0.5, 0.5)``, other tensors ``N(0, 0.02)``.
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_vocab_size(VOCAB)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(VOCAB - 3)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([2, 3, 3] + [6] * (VOCAB - 3))  # unknown, control, control, byte
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def norm_weight():
        return (1.0 + rng.uniform(-0.5, 0.5, hidden)).astype(np.float32)

    writer.add_tensor("token_embd.weight", normal(VOCAB, hidden))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm_weight())
        writer.add_tensor(f"blk.{i}.attn_q.weight", normal(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", normal(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", normal(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", normal(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm_weight())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", normal(inter, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", normal(inter, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", normal(hidden, inter))
    writer.add_tensor("output_norm.weight", norm_weight())
    writer.add_tensor("output.weight", normal(VOCAB, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    """Path of a freshly written tiny Llama ``.gguf`` file (see ``write_tiny_gguf``)."""
    return write_tiny_gguf(tmp_path / "tiny-llama.gguf")

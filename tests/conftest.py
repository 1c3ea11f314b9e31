"""Shared fixtures: tiny random models (norm parameters re-randomized), fixed input ids, a tiny GGUF file.

transformers initializes norm weights at 1 (0 for Gemma's (1+w) norms) and biases at 0, which hides fold
bugs: every tiny model here gets its norm parameters moved to ``base + U(-0.5, 0.5)`` after building.

Fixtures (all function-scoped, deterministic):

* ``tiny_model(model_type, *, dtype=torch.float32, seed=0, randomize=True, **config_overrides)``
  -> a transformers model in eval mode (``AutoModelForCausalLM`` for decoders, ``AutoModel`` for encoders);
* ``tiny_config(model_type, **config_overrides)`` -> its config, unbuilt;
* ``input_ids`` -> ``LongTensor (2, 16)`` in ``[0, 128)`` from a fixed seed;
* ``tiny_gguf(tmp_path)`` -> path of a small Llama ``.gguf`` file (float32 tensors, 128-token vocabulary).

Plain functions ``make_tiny_config``, ``make_tiny_model``, ``randomize_norms``, ``write_tiny_gguf`` can be
imported from ``conftest`` by test modules that need them outside fixtures.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is never needed by the suite
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 128
# The "tiny config" of ../shared/cases/README.md, in each model type's own parameter names.
_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=0,
)
TINY_CONFIGS: dict[str, dict] = {
    **{
        t: _LLAMA_LIKE
        for t in (
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma",
            "gemma2",
            "gemma3_text",
            "olmo",
            "olmo2",
            "cohere",
            "phi3",
            "granite",
            "glm",
            "smollm3",
        )
    },
    "mixtral": {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        **_LLAMA_LIKE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    "gpt_neox": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    ),
    "opt": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=128,
    ),
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=128),
    "falcon": dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "bloom": dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "phi": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    ),
    "bert": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    ),
}

_NORM_CLASS = re.compile(r"norm", re.IGNORECASE)


def make_tiny_config(model_type: str, **overrides):
    """A tiny transformers config of ``model_type`` (sizes from ``TINY_CONFIGS``, then ``overrides``)."""
    from transformers import AutoConfig

    if model_type not in TINY_CONFIGS:
        raise KeyError(f"no tiny config for {model_type!r}; add one to TINY_CONFIGS in tests/conftest.py")
    return AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})


@torch.no_grad()
def randomize_norms(model: torch.nn.Module, seed: int = 0, spread: float = 0.5) -> int:
    """Add ``U(-spread, spread)`` to every parameter owned directly by a normalization module.

    A module counts as a norm when its class name contains "norm" (``LlamaRMSNorm``, ``LayerNorm``,
    ``Gemma3RMSNorm``, ...). Right after building, weights hold their identity value (1, or 0 for
    (1+w) norms) and biases 0, so the result is ``base + U(-spread, spread)`` as the field cases require.

    Returns:
        the number of norm modules found (parameter-free ones, as in OLMo, included).
    """
    generator = torch.Generator().manual_seed(seed)
    found = 0
    for module in model.modules():
        if not _NORM_CLASS.search(type(module).__name__):
            continue
        for p in module.parameters(recurse=False):
            noise = torch.rand(p.shape, generator=generator, dtype=torch.float64) * (2 * spread) - spread
            p.add_(noise.to(p.dtype))
        found += 1
    return found


def make_tiny_model(
    model_type: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    randomize: bool = True,
    **overrides,
):
    """Build a tiny random ``model_type`` model in eval mode, norm parameters re-randomized.

    Decoders are built with ``AutoModelForCausalLM``, encoders (BERT) with ``AutoModel``. The weights come
    from ``torch.manual_seed(seed)``; the noise on the norms from ``seed`` too.
    """
    from transformers import AutoModel, AutoModelForCausalLM

    from normswap.io import is_causal_lm

    config = make_tiny_config(model_type, **overrides)
    auto = AutoModelForCausalLM if is_causal_lm(config) else AutoModel
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=dtype).eval()
    if randomize:
        assert randomize_norms(model, seed=seed) > 0, f"{model_type}: no norm modules found"
    return model


@pytest.fixture
def tiny_config():
    """Factory: ``tiny_config(model_type, **overrides)`` -> config."""
    return make_tiny_config


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(model_type, dtype=..., seed=..., randomize=True, **overrides)`` -> model."""
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

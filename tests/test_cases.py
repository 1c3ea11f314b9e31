"""Field cases about graph assumptions (../shared/cases/README.md): C1, C4, C5, C6, with their right values.

Tolerance: max abs logit difference < 1e-5 in float32 (correct folds measure ~1e-7 here; the faults these
cases come from were off by 0.3 .. 1.6). Fold factors are checked against a float64 recomputation from the
unconverted model's own tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.zoo import example_ids, tiny_model

TOL = 1e-5


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _diff(reference, model, ids=None):
    ids = example_ids() if ids is None else ids
    return (_logits(reference, ids) - _logits(model, ids)).abs().max().item()


# -- C1: Gemma's (1 + w) norm folded as plain w -------------------------------------------------------------


def test_c1_gemma_folds_one_plus_w():
    model = tiny_model("gemma", tie_word_embeddings=False)
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    assert _diff(reference, model) < TOL
    sites = {s.name: s for s in report.sites}
    site = sites["model.layers.0.input_layernorm"]
    assert site.offset == 1.0 and site.folded
    w = reference.model.layers[0].input_layernorm.weight.detach().double()
    for proj in ("q_proj", "k_proj", "v_proj"):
        before = getattr(reference.model.layers[0].self_attn, proj).weight.detach().double()
        after = getattr(model.model.layers[0].self_attn, proj).weight.detach().double()
        torch.testing.assert_close(after, before * (1.0 + w), rtol=2e-7, atol=0)  # (1 + w), not w
    w2 = reference.model.layers[0].post_attention_layernorm.weight.detach().double()
    up_before = reference.model.layers[0].mlp.up_proj.weight.detach().double()
    torch.testing.assert_close(
        model.model.layers[0].mlp.up_proj.weight.double(), up_before * (1 + w2), rtol=2e-7, atol=0
    )
    # what stays of each folded Gemma norm is its identity, weight 0 under (1 + w): held by no tensor, and
    # what the state dict (the saved checkpoint) holds under the Gemma module's key
    state = model.state_dict()
    for s in report.sites:
        assert s.folded and model.get_submodule(s.name).identity_weight
        assert torch.all(state[f"{s.name}.{s.weight}"] == 0)


def test_c1_swapped_module_keeps_the_offset():
    """The fused replacement represents (1 + w): with the original (unfolded) weight it reproduces the
    original module exactly in float32."""
    model = tiny_model("gemma", tie_word_embeddings=False)
    original = copy.deepcopy(model.model.layers[0].input_layernorm)
    normswap.convert(model, fold=False)
    swapped = model.model.layers[0].input_layernorm
    assert type(swapped) is not type(original)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        torch.testing.assert_close(swapped(x), original(x), rtol=1e-6, atol=1e-6)


# -- C4: tied embeddings and the final norm -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma"])
def test_c4_tied_embeddings_are_untied_before_folding(model_type):
    model = tiny_model(model_type, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    reference = copy.deepcopy(model)
    embedding = model.get_input_embeddings().weight.detach().clone()
    final = next(s for s in normswap.inspect(model) if s.name == "model.norm")
    w = getattr(model.model.norm, final.weight).detach().clone()
    assert (w - (1 - final.offset)).abs().max() > 0.3  # the final norm is 1 +- 0.5 (0 +- 0.5 for Gemma)

    report = normswap.convert(model)

    assert "lm_head.weight" in report.untied
    assert report.untie_bytes == embedding.numel() * embedding.element_size()
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # bit-identical
    assert model.config.tie_word_embeddings is False
    assert next(s for s in report.sites if s.name == "model.norm").folded
    expected = embedding.double() * (w.double() + final.offset)
    torch.testing.assert_close(model.lm_head.weight.double(), expected, rtol=2e-7, atol=0)
    assert _diff(reference, model) < TOL


# -- C5: sandwich norms (Gemma 2/3) -------------------------------------------------------------------------


def test_c5_gemma2_sandwich_norms():
    model = tiny_model("gemma2", tie_word_embeddings=False)
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    sites = {s.name: s for s in report.sites}
    for i in range(2):
        pre_ff = sites[f"model.layers.{i}.pre_feedforward_layernorm"]
        assert pre_ff.folded
        assert {c.module for c in pre_ff.consumers} == {
            f"model.layers.{i}.mlp.gate_proj",
            f"model.layers.{i}.mlp.up_proj",
        }
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            site = sites[f"model.layers.{i}.{name}"]
            assert not site.foldable and not site.folded and site.swapped
            assert site.reason == f"output feeds add in model.layers.{i}"
    assert _diff(reference, model) < TOL


# -- C6: parameter-free LayerNorm (OLMo) --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c6_olmo_parameter_free_layernorm(dtype):
    model = tiny_model("olmo").to(dtype)
    reference = copy.deepcopy(model)
    originals = {
        n: copy.deepcopy(m) for n, m in model.named_modules() if n.endswith("layernorm") or n == "model.norm"
    }
    report = normswap.convert(model)  # no AttributeError
    assert report.norms_found == 5 == len(originals)
    for site in report.sites:
        assert (site.kind, site.weight, site.bias) == ("layernorm", None, None)
        assert not site.folded and site.reason == "parameter-free norm: nothing to fold"
        assert site.eps == 1e-5  # hard-coded in OlmoLayerNorm, not read from the config
        swapped = model.get_submodule(site.name)
        assert list(swapped.parameters()) == []
        # the float32 upcast is kept: bit for bit what the original computes, in either dtype
        x = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
        with torch.no_grad():
            y, expected = swapped(x), originals[site.name](x)
        assert y.dtype == expected.dtype == dtype
        assert torch.equal(y, expected)
    if dtype == torch.float32:
        assert _diff(reference, model) < TOL

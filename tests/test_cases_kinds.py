"""Field cases C9, C11, C12, C16, C17 (../shared/cases/README.md), each as a test with its right value.

Tolerance: max abs logit difference < 1e-5 in float32 (correct folds measure ~1e-7 here; the faults these
cases come from were off by 0.27 or more). Models are tiny (README's "tiny config") and their norm weights are
re-randomized by class (base +- 0.5), not through normswap, so a norm normswap misses still carries a
non-identity weight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import normswap

TOL = 1e-5


def _randomize(model: nn.Module, classes: tuple[type, ...], seed: int = 1) -> None:
    """Every parameter of each module of ``classes``: 1 + U(-0.5, 0.5) for scales, U(-0.5, 0.5) for biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, classes):
                for name, p in module.named_parameters(recurse=False):
                    base = 0.0 if "bias" in name or "beta" in name else 1.0
                    noise = torch.rand(p.shape, generator=gen, dtype=torch.float64) - 0.5
                    p.copy_((base + noise).to(p.dtype))


def _ids(vocab: int = 128, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


# -- C16: a model whose forward does not take input_ids -----------------------------------------------------


class Gain(nn.Module):
    """An RMSNorm nothing names a norm: parameter ``gain``."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class Alpha(nn.Module):
    """A bias-free LayerNorm nothing names a norm: parameter ``alpha``."""

    def __init__(self, d: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.alpha * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class IdsLM(nn.Module):
    """``forward(self, ids)``: embedding -> residual MLP block behind ``Gain`` -> ``Alpha`` -> head."""

    def __init__(self, vocab: int = 128, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pre, self.up, self.down = Gain(d), nn.Linear(d, 128), nn.Linear(128, d)
        self.last, self.head = Alpha(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(self.pre(h))))
        return self.head(self.last(h))


def _ids_lm() -> IdsLM:
    torch.manual_seed(0)
    model = IdsLM().eval()
    _randomize(model, (Gain, Alpha))
    return model


def test_c16_example_inputs_positional():
    model = _ids_lm()
    reference = copy.deepcopy(model)
    ids = _ids()
    sites = normswap.inspect(model, example_inputs=((ids,), {}))
    found = [(s.name, s.weight, s.kind) for s in sites]
    assert found == [("pre", "gain", "rmsnorm"), ("last", "alpha", "layernorm")]
    assert all(s.foldable for s in sites)
    report = normswap.convert(model, example_inputs=(ids,))  # a tuple of positional args works too
    assert report.norms_found == report.norms_folded == report.norms_swapped == 2
    other = _ids(seed=9)  # ids the conversion never traced with
    with torch.no_grad():
        assert (reference(other) - model(other)).abs().max().item() < TOL


def test_c16_example_inputs_keyword_and_input_ids_exclusive():
    model = _ids_lm()
    ids = _ids()
    assert len(normswap.inspect(model, example_inputs={"ids": ids})) == 2
    with pytest.raises(ValueError, match="either input_ids or example_inputs"):
        normswap.inspect(model, ids, example_inputs={"ids": ids})


# -- C12: a gated RMSNorm called with its gate by keyword ---------------------------------------------------


def _gated_norm() -> type:
    """Mamba2's gated RMSNorm (``norm(x * silu(gate))``): ``MambaRMSNormGated`` up to transformers 5.24,
    ``Mamba2RMSNormGated`` from 5.25 on (the same signature and computation)."""
    from transformers.models.mamba2 import modeling_mamba2

    return getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated


class GatedBlock(nn.Module):
    """``h + out(gated(y, gate=z))`` with ``y, z = in(norm(h))``: a gated norm between two linears."""

    def __init__(self, keyword: bool, d: int = 64, inner: int = 128):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.keyword = keyword
        self.norm = LlamaRMSNorm(d)
        self.in_proj = nn.Linear(d, 2 * inner)
        self.gated = _gated_norm()(inner, group_size=inner)
        self.out_proj = nn.Linear(inner, d)

    def forward(self, h):
        y, z = self.in_proj(self.norm(h)).chunk(2, dim=-1)
        y = self.gated(y, gate=z) if self.keyword else self.gated(y, z)
        return h + self.out_proj(y)


class GatedLM(nn.Module):
    def __init__(self, keyword: bool, vocab: int = 128, d: int = 64):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([GatedBlock(keyword), GatedBlock(keyword)])
        self.norm = LlamaRMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, **_):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@pytest.mark.parametrize("keyword", [True, False], ids=["gate=z", "positional"])
def test_c12_gated_norm_is_left_in_place(keyword):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gated_norm = _gated_norm()
    torch.manual_seed(0)
    model = GatedLM(keyword).eval()
    _randomize(model, (LlamaRMSNorm, gated_norm))
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    sites = {s.name: s for s in report.sites}
    for i in range(2):
        gated = sites[f"blocks.{i}.gated"]
        assert not gated.foldable and not gated.folded and not gated.swapped and not gated.swappable
        assert gated.reason.startswith("called with another input (")
        assert f"by blocks.{i}" in gated.reason and ("gate=" in gated.reason) == keyword
        assert type(model.blocks[i].gated) is gated_norm  # still applies the gate
        assert sites[f"blocks.{i}.norm"].folded
    assert sites["norm"].folded
    assert report.norms_found == 5 and report.norms_swapped == report.norms_folded == 3
    ids = _ids(seed=9)
    with torch.no_grad():
        assert (reference(ids) - model(ids)).abs().max().item() < TOL


# -- C9: a consumer whose weight is stored quantized --------------------------------------------------------


class Int8Linear(nn.Module):
    """Weight-only int8 linear: an int8 weight and a 0-dim float scale, dequantized in the forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().max() / 127
        self.weight = nn.Parameter(torch.round(w / scale).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale.clone())
        self.bias = linear.bias

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale, self.bias)


def _llama(**overrides):
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from normswap.zoo import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=False, **overrides)).eval()
    _randomize(model, (LlamaRMSNorm,))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_c9_quantized_consumers_are_not_folded():
    model = _llama()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    sites = {s.name: s for s in report.sites}
    assert len(sites) == 5 and report.norms_swapped == 5
    for i in range(2):
        for norm, consumer in (
            ("input_layernorm", "self_attn.q_proj"),
            ("post_attention_layernorm", "mlp.gate_proj"),
        ):
            site = sites[f"model.layers.{i}.{norm}"]
            assert not site.foldable and not site.folded and site.swapped
            assert site.reason == (
                f"output feeds the quantized consumer model.layers.{i}.{consumer} (weight "
                f"model.layers.{i}.{consumer}.weight stored as int8, used as float32): a fold would "
                "re-round it"
            )
    assert sites["model.norm"].folded  # lm_head is a float32 linear: folding into it is exact
    after = dict(model.named_parameters())
    for name, before in reference.named_parameters():
        if before.dtype == torch.int8:
            assert torch.equal(before, after[name]), (
                name
            )  # no int8 weight touched (a fold wrapped 190 to -66)
    ids = _ids(seed=9)
    assert (_logits(reference, ids) - _logits(model, ids)).abs().max().item() < TOL


# -- C11: a fold whose result does not fit the weight's dtype -----------------------------------------------


def _quiet_channel_llama(j: int = 5) -> nn.Module:
    """float16 Llama (vocab 260) whose residual channel ``j`` is quiet (embedding column ~1e-6, nothing
    writes into it) and amplified by the final norm (weight 2000) into lm_head[:, j] in [-60, 60]."""
    model = _llama(vocab_size=260)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, j] = (torch.rand(emb.shape[0], generator=gen) - 0.5) * 2e-6
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[j] = 0
            layer.mlp.down_proj.weight[j] = 0
        model.model.norm.weight[j] = 2000.0
        model.lm_head.weight[:, j] = (torch.rand(260, generator=gen) - 0.5) * 120
    return model.half()


def test_c11_fold_that_overflows_float16_is_refused(tmp_path):
    from safetensors.torch import load_file

    from normswap.check import compare, reference_outputs
    from normswap.io import save_converted

    model = _quiet_channel_llama()
    ids = _ids(vocab=260, seed=9)
    original = _logits(model, ids)
    assert torch.isfinite(original).all() and original.abs().max() < 20
    lm_head = model.lm_head.weight.detach().clone()
    reference = reference_outputs(model, ids)
    report = normswap.convert(model)
    sites = {s.name: s for s in report.sites}
    final = sites["model.norm"]
    assert not final.foldable and not final.folded and final.swapped
    assert final.reason.startswith("fold overflows float16 (lm_head.weight would need 1.")
    assert final.reason.endswith("e+05 > 65504)")
    assert all(s.folded for n, s in sites.items() if n != "model.norm")  # the rest still folds
    assert torch.equal(model.lm_head.weight, lm_head)  # nothing written into the refused consumer
    assert all(torch.isfinite(p).all() for p in model.parameters())
    result = compare(reference, model, ids)
    assert result.passed, result.failures
    out = save_converted(model, None, report.to_dict(), tmp_path / "out")
    saved = load_file(out / "model.safetensors")
    assert saved and all(torch.isfinite(t).all() for t in saved.values())


# -- C17: LayerNorm to RMSNorm through a mixture of experts -------------------------------------------------


@pytest.mark.parametrize("experts", ["grouped_mm", "eager", "batched_mm"])
def test_c17_centering_through_routed_experts(experts):
    """The routed sum of expert outputs (``sum`` of weighted rows, ``index_add_`` into zeros, or
    ``bmm(W, x)`` per token) is a sum of linear writes: each expert's down projection is centered."""
    from transformers import AutoModelForCausalLM

    from normswap.zoo import tiny_config

    torch.manual_seed(0)
    config = tiny_config("phimoe", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=experts).float().eval()
    _randomize(model, (nn.LayerNorm,))
    reference = copy.deepcopy(model)
    down = model.model.layers[0].mlp.experts.down_proj  # (experts, hidden, intermediate)
    report = normswap.convert(model, norm="rmsnorm")
    assert report.norms_found == report.norms_swapped == 5
    assert all(s.kind == "rmsnorm" for s in report.sites)
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    centered = model.model.layers[0].mlp.experts.down_proj
    assert centered is down and centered.double().mean(1).abs().max() < 1e-7  # each expert's rows centered
    ids = _ids(seed=9)
    assert (_logits(reference, ids) - _logits(model, ids)).abs().max().item() < TOL


# -- norms a text-only trace never reaches (a VLM's vision tower) -------------------------------------------


def _gemma3_vlm():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=8,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=7,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(model, (nn.LayerNorm,))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # Gemma's (1 + w) norms: base 0
        for module in model.modules():
            if isinstance(module, Gemma3RMSNorm):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) - 0.5)
    return model


def test_vision_tower_norms_are_listed_as_not_reached_and_swapped():
    """Gemma 3 multimodal converted on text only: the 5 vision-side norms are listed "not reached by the
    trace", swapped with their probed semantics and never folded; text and image prompts stay exact."""
    model = _gemma3_vlm()
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    idle = [s for s in report.sites if not s.reached]
    assert [s.name for s in idle] == [
        "model.vision_tower.encoder.layers.0.layer_norm1",
        "model.vision_tower.encoder.layers.0.layer_norm2",
        "model.vision_tower.post_layernorm",
        "model.vision_tower.head.layernorm",
        "model.multi_modal_projector.mm_soft_emb_norm",
    ]
    for site in idle:
        assert site.reason == "not reached by the trace" and site.swapped and not site.folded
    assert (idle[-1].kind, idle[-1].offset) == ("rmsnorm", 1.0) and idle[0].kind == "layernorm"
    assert sum(s.folded for s in report.sites) == 5  # the language model's norms still fold
    gen = torch.Generator().manual_seed(4)
    text = torch.randint(0, 290, (2, 16), generator=gen)
    image = torch.tensor([[5, 6, 7, 297, 299, 299, 299, 299, 298, 8, 9, 10]])
    pixels = torch.randn(1, 3, 28, 28, generator=gen)
    with torch.no_grad():
        for kwargs in (dict(input_ids=text), dict(input_ids=image, pixel_values=pixels)):
            assert (reference(**kwargs).logits - model(**kwargs).logits).abs().max().item() < TOL


def test_qwen2_5_vl_vision_norms_are_listed():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters=rope,
        bos_token_id=0,
        eos_token_id=1,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        fullatt_block_indexes=[1],
        window_size=28,
        patch_size=14,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=299,
        video_token_id=298,
        vision_start_token_id=297,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).float().eval()
    _randomize(model, (Qwen2_5_VLRMSNorm,))
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    idle = {s.name for s in report.sites if s.reason == "not reached by the trace"}
    assert idle == {f"model.visual.blocks.{i}.norm{j}" for i in (0, 1) for j in (1, 2)} | {
        "model.visual.merger.ln_q"
    }
    assert all(s.swapped and not s.folded for s in report.sites if s.name in idle)
    assert report.norms_folded == 5
    ids = _ids(vocab=290, seed=9)
    with torch.no_grad():
        assert (reference(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item() < TOL

"""LayerNorm -> RMSNorm by centering (``normswap.center``): exactness, refusals, checkpoints, MiniLM.

Every comparison is against the unconverted model (a deepcopy) or a float64 formula. Tolerances: a correct
float32 centering + fold + swap is exact up to rounding (measured 1e-8 .. 5e-7 on these tiny models, whose
logits are O(1)); 1e-5 is the issue's bound. Wrong conversions seen while building this (centering a tied
lm_head, forgetting a writer's bias, treating BLOOM's embedding norm as an ordinary writer) were off by
1e-2 or more. The zoo re-randomizes every parameter its initialization left constant, by parameter (norm
weights and biases, linear biases: constant +- U(-0.5, 0.5)), so a writer bias left uncentered or a consumer
bias the fold forgets shows.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from torch import nn

from normswap import convert, inspect
from normswap.center import CenteringError
from normswap.errors import NormswapError
from normswap.kernels.biased import BiasedRMSNorm
from normswap.zoo import example_ids, model_outputs, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOL = 1e-5  # float32 max abs logit difference (see the module docstring)
MEAN_TOL = 1e-5  # |mean| / RMS of a norm input row after conversion (measured <= 1.5e-7)

ARCHITECTURES = [
    ("gpt2", {}),
    ("opt", {}),
    ("gpt_neox", dict(use_parallel_residual=True)),
    ("gpt_neox", dict(use_parallel_residual=False)),
    ("gptj", {}),
    ("falcon", dict(new_decoder_architecture=False, multi_query=True)),  # parallel block, one norm
    ("falcon", dict(new_decoder_architecture=True)),  # parallel block, ln_attn + ln_mlp
    ("falcon", dict(new_decoder_architecture=False, parallel_attn=False)),  # sequential
    ("phi", {}),
    ("bloom", {}),
    ("stablelm", {}),
    ("starcoder2", {}),
    ("gpt_bigcode", {}),
    ("codegen", {}),
    ("olmo", {}),
    ("cohere", {}),
    # per-head q/k LayerNorms: the producing rows are centered head by head
    ("cohere", dict(use_qk_norm=True)),
    ("phi", dict(qk_layernorm=True)),
    ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True)),
    ("persimmon", dict(qk_layernorm=True)),  # fused qkv: only the q/k slices are centered
]


def _id(case) -> str:
    model_type, overrides = case
    return model_type + "".join(f"-{k}={v}" for k, v in overrides.items())


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mean_ratios(model: nn.Module, names: list[str], ids: torch.Tensor) -> list[float]:
    """Run ``model`` with pre-hooks on the modules ``names``: the largest |mean| / RMS of an input row."""
    ratios: list[float] = []

    def hook(_module, args):
        x = args[0].double()
        rms = x.pow(2).mean(-1).sqrt().clamp(min=1e-30)  # an all-zero row (a padding embedding) has ratio 0
        ratios.append((x.mean(-1).abs() / rms).max().item())

    handles = [model.get_submodule(n).register_forward_pre_hook(hook) for n in names]
    try:
        model_outputs(model, ids)
    finally:
        for h in handles:
            h.remove()
    return ratios


@pytest.mark.parametrize("case", ARCHITECTURES, ids=_id)
def test_rmsnorm_conversion_is_exact(case):
    model_type, overrides = case
    model = tiny_model(model_type, **overrides)
    reference = copy.deepcopy(model)
    ids = example_ids()
    before = model_outputs(reference, ids)

    report = convert(model, norm="rmsnorm")
    after = model_outputs(model, ids)
    sites = inspect(model)

    assert [s.kind for s in sites].count("layernorm") == 0
    assert len(sites) == report.norms_found == report.norms_swapped
    assert (before - after).abs().max().item() <= TOL
    assert torch.equal(before.argmax(-1), after.argmax(-1))
    # The stream every norm reads is zero-mean now; it was not before (the check can fail).
    names = [s.name for s in sites]
    assert max(_mean_ratios(model, names, ids)) <= MEAN_TOL
    assert max(_mean_ratios(reference, names, ids)) > 1e-3


def test_gpt2_tied_embedding_is_untied_and_final_bias_kept():
    model = tiny_model("gpt2")
    wte = model.transformer.wte.weight.detach().clone()
    report = convert(model, norm="rmsnorm")
    assert report.untied == ["lm_head.weight"]
    assert report.untie_bytes == wte.numel() * 4
    assert model.config.tie_word_embeddings is False
    # the embedding rows are centered; lm_head keeps the original table (ln_f is not folded into it)
    assert model.transformer.wte.weight.double().mean(-1).abs().max().item() < 1e-7
    assert torch.equal(model.lm_head.weight, wte)
    final = next(s for s in report.sites if s.name == "transformer.ln_f")
    assert not final.folded and "bias kept" in final.reason and "lm_head" in final.reason
    assert isinstance(model.transformer.ln_f, BiasedRMSNorm)


@pytest.mark.parametrize(
    "model_type, overrides, flag",
    [("falcon", dict(new_decoder_architecture=True), "bias"), ("stablelm", {}, "use_qkv_bias")],
)
def test_config_flag_adds_biases_that_absorb_the_norm_bias(model_type, overrides, flag):
    model = tiny_model(model_type, **overrides)
    assert getattr(model.config, flag) is False
    report = convert(model, norm="rmsnorm")
    assert getattr(model.config, flag) is True
    folded = [s for s in report.sites if s.folded]
    assert folded and all(c.bias is not None for s in folded for c in s.consumers)
    # the added biases are reported in the model's parameter order: the same report from run to run
    added = report.centering["biases_added"]
    order = [name for name, _ in model.named_parameters() if name in set(added)]
    assert len(added) > 1 and added == order
    # a checkpoint of the converted model loads in plain transformers with the same biases
    _check_plain_reload(model, tiny_model(model_type, **overrides))


def _check_plain_reload(converted: nn.Module, original: nn.Module) -> None:
    from transformers import AutoModelForCausalLM

    ids = example_ids()
    with tempfile.TemporaryDirectory() as out:
        converted.save_pretrained(out)
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert set(original.state_dict()) <= set(loaded.state_dict())
    assert (model_outputs(loaded, ids) - model_outputs(original, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("model_type", ["gpt2", "bloom", "cohere"])
def test_saved_checkpoint_loads_in_plain_transformers(model_type):
    model = tiny_model(model_type)
    original = copy.deepcopy(model)
    convert(model, norm="rmsnorm")
    _check_plain_reload(model, original)


@pytest.mark.parametrize("model_type", ["gpt2", "gptj"])
def test_manifest_sites_rebuild_the_fused_rmsnorms_on_a_reloaded_checkpoint(model_type):
    """What ``load_pretrained`` does: plain reload, then swap from the manifest sites (biased ones too)."""
    from transformers import AutoModelForCausalLM

    from normswap.sites import NormSite
    from normswap.swap import swap_norms

    model = tiny_model(model_type)
    original = copy.deepcopy(model)
    report = convert(model, norm="rmsnorm")
    assert any(s.kind == "rmsnorm" and s.bias for s in report.sites)  # a final norm kept its bias
    sites = [NormSite.from_dict(s.to_dict()) for s in report.sites]
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert swap_norms(loaded, sites) == report.norms_found
    assert all(type(loaded.get_submodule(s.name)) is type(model.get_submodule(s.name)) for s in sites)
    ids = example_ids()
    assert (model_outputs(loaded, ids) - model_outputs(original, ids)).abs().max().item() <= TOL


def test_bloom_embedding_norm_outputs_the_centered_original_rows():
    model = tiny_model("bloom")
    original = copy.deepcopy(model)
    report = convert(model, norm="rmsnorm")
    site = next(s for s in report.sites if s.name == "transformer.word_embeddings_layernorm")
    norm = model.transformer.word_embeddings_layernorm
    assert isinstance(norm, BiasedRMSNorm) and not site.folded
    scale = norm.weight[0].item()
    assert torch.equal(norm.weight, torch.full_like(norm.weight, scale)) and scale == 2.0 ** round(
        torch.log2(torch.tensor(scale)).item()
    )
    assert torch.equal(norm.bias, torch.zeros_like(norm.bias))
    # float64 reference: the original LayerNorm of every table row, centered
    ln = original.transformer.word_embeddings_layernorm.double()
    with torch.no_grad():
        want = ln(original.transformer.word_embeddings.weight.double())
        want = want - want.mean(-1, keepdim=True)
        got = norm(model.transformer.word_embeddings.weight)
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_per_head_norm_centers_each_head_of_its_projection():
    model = tiny_model("cohere", use_qk_norm=True)
    report = convert(model, norm="rmsnorm")
    attn = model.model.layers[0].self_attn
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for proj in (attn.q_proj, attn.k_proj):
        per_head = proj.weight.double().reshape(-1, head_dim, proj.weight.shape[1])
        assert per_head.mean(1).abs().max().item() < 1e-7  # every head's rows sum to zero, column by column
    whole = attn.v_proj.weight.double().mean(0).abs().max().item()
    assert whole > 1e-3  # v has no norm: left alone
    q_norm = next(s for s in report.sites if s.name.endswith("layers.0.self_attn.q_norm"))
    assert q_norm.kind == "rmsnorm" and tuple(q_norm.shape) == (model.config.num_attention_heads, head_dim)


def test_rmsnorm_model_is_never_centered():
    model = tiny_model("llama")
    keep = copy.deepcopy(model)
    convert(keep)
    convert(model, norm="rmsnorm")
    for (name, a), (_, b) in zip(model.state_dict().items(), keep.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


class _ActivationThenNorm(nn.Module):
    """A LayerNorm applied to gelu(linear(embedding)): its input has a non-linear producer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.up = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 128)

    def forward(self, input_ids, **_):
        return self.head(self.norm(nn.functional.gelu(self.up(self.emb(input_ids)))))


def _refusal_model(name: str) -> nn.Module:
    if name == "activation":
        torch.manual_seed(0)
        return _ActivationThenNorm().eval()
    model_type, overrides = {
        "opt-post-ln": ("opt", dict(do_layer_norm_before=False)),  # as OPT-350m
        "bert": ("bert", {}),
        "xglm-sinusoids": ("xglm", dict(d_model=64, ffn_dim=128, num_layers=2, attention_heads=4)),
        "custom-mixed": ("custom", {}),  # an RMSNorm and a LayerNorm read the same stream
        "bloom-post-ln": ("bloom", dict(apply_residual_connection_post_layernorm=True)),
        "gpt2-no-untie": ("gpt2", {}),
    }[name]
    return tiny_model(model_type, **overrides)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("opt-post-ln", "post-LN"),
        ("bert", "post-LN"),
        ("xglm-sinusoids", "buffer model.embed_positions.weights"),
        ("custom-mixed", "rmsnorm blocks.0.pre"),
        ("bloom-post-ln", "post-LN"),
        ("activation", "non-linear producer: gelu"),
        ("gpt2-no-untie", "untying disabled"),
    ],
)
def test_refusal_names_the_site_and_leaves_the_model_bit_identical(name, expected):
    model = _refusal_model(name)
    ids = example_ids()
    before = model_outputs(model, ids)
    state = _state(model)
    params = {n: id(p) for n, p in model.named_parameters()}
    config = model.config.to_dict() if hasattr(model, "config") and model.config is not None else None

    with pytest.raises(CenteringError, match="cannot convert LayerNorm .* to RMSNorm exactly") as error:
        convert(model, norm="rmsnorm", untie=name != "gpt2-no-untie")

    assert expected in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value, NormswapError)  # the CLI prints it on one line and exits with 2
    after = _state(model)
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert {n: id(p) for n, p in model.named_parameters()} == params
    assert config is None or model.config.to_dict() == config
    assert torch.equal(model_outputs(model, ids), before)


def test_failure_before_commit_leaves_the_model_unchanged(monkeypatch):
    """Falcon exercises every prepared step (untie, config-flag biases, centering); fail in the middle."""
    import normswap.center.rewrite as rewrite

    model = tiny_model("falcon", new_decoder_architecture=True)
    state = _state(model)
    calls = []
    real = rewrite.centered

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(rewrite, "centered", failing)
    with pytest.raises(RuntimeError, match="injected"):
        convert(model, norm="rmsnorm")
    after = _state(model)
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert model.config.bias is False and model.config.tie_word_embeddings is True


def test_biased_rmsnorm_equals_layernorm_on_zero_mean_input():
    """float32: on a zero-mean input, ``BiasedRMSNorm`` is ``nn.LayerNorm`` with the same weight, bias
    and eps, and both match the float64 formula to float32 rounding of O(1) outputs (a few ulps)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 64, generator=gen, dtype=torch.float64) * 3
    x = x - x.mean(-1, keepdim=True)
    w = 1 + torch.rand(64, generator=gen, dtype=torch.float64) - 0.5
    b = torch.rand(64, generator=gen, dtype=torch.float64) - 0.5
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w + b
    norm, ln = BiasedRMSNorm(64, 1e-5), nn.LayerNorm(64, eps=1e-5)
    with torch.no_grad():
        for module in (norm, ln):
            module.weight.copy_(w)
            module.bias.copy_(b)
        got, ref = norm(x.float()), ln(x.float())
    assert (got.double() - want).abs().max().item() <= 2e-6
    assert (got - ref).abs().max().item() <= 2e-6


def test_biased_rmsnorm_rounds_once_in_bfloat16():
    """Cast order "fp32" (nn.LayerNorm's): normalize, scale and shift in float32, round to bfloat16 once,
    so every output is within half a bf16 ulp (2**-8 relative at worst) of the float64 formula evaluated
    on the same bf16 input and parameters."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 16, 64, generator=gen) * 3).to(torch.bfloat16)
    norm = BiasedRMSNorm(64, 1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.rand(64, generator=gen) - 0.5)
        norm.bias.copy_(torch.rand(64, generator=gen) - 0.5)
        got = norm(x)
    x64, w64, b64 = x.double(), norm.weight.double(), norm.bias.double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64 + b64
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-6).all()


# -- the real model: all-MiniLM-L6-v2 (post-LN BERT encoder, 13 LayerNorms) --------------------------------

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage.",
    "Normalization layers keep activations in a stable range.",
    "Paris is the capital and most populous city of France.",
    "I would like a cup of coffee with a little milk, please.",
    "The committee postponed its decision until next week.",
]


@pytest.fixture(scope="module")
def minilm():
    from normswap.io import load_model

    try:
        return load_model("minilm-l6")
    except NormswapError as error:
        if "cannot fetch" in str(error):
            pytest.skip(f"minilm-l6 not fetchable here: {error}")
        raise


def _mean_pooled(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).double()
    return hidden, (hidden.double() * mask).sum(1) / mask.sum(1)


@pytest.mark.real
def test_minilm_refuses_rmsnorm_and_converts_with_fused_layernorm(minilm):
    """Measured: refusal names encoder.layer.0.attention.output.LayerNorm; the plain conversion (13
    LayerNorms, nothing foldable in a post-LN encoder) matches bit for bit (max abs 0.0, cosine 1 - 3e-16).
    """
    from normswap.kernels import FusedLayerNorm

    model = copy.deepcopy(minilm.model)
    batch = minilm.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    hidden_before, pooled_before = _mean_pooled(model, batch)
    state = _state(model)

    with pytest.raises(CenteringError, match="post-LN") as error:
        convert(model, norm="rmsnorm")
    assert "encoder.layer.0.attention.output.LayerNorm" in str(error.value)
    after = _state(model)
    assert all(torch.equal(state[k], after[k]) for k in state)

    report = convert(model)
    assert report.norms_found == report.norms_swapped == 13
    assert all(isinstance(model.get_submodule(s.name), FusedLayerNorm) for s in report.sites)
    hidden_after, pooled_after = _mean_pooled(model, batch)
    assert (hidden_after - hidden_before).abs().max().item() <= 1e-5
    cosine = torch.nn.functional.cosine_similarity(pooled_before, pooled_after, dim=-1)
    assert cosine.min().item() >= 0.999999

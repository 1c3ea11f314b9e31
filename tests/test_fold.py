"""Folding math against an independent float64 reference, untying, and convert's options.

Tolerances: a correct float32 fold changes logits by rounding only (~1e-7 relative per weight), measured
at ~3e-7 on these tiny models; every wrong fold seen in the field was off by >= 4e-3 (shared/FIELD-NOTES.md).
1e-5 separates the two by more than an order of magnitude on each side.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normswap
from normswap.fold import fold_site
from normswap.sites import Consumer, NormSite
from normswap.zoo import example_ids, tiny_model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


class _Block(nn.Module):
    """A norm (1+w convention, with bias) feeding a linear with bias, in float64 for an exact reference."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8, dtype=torch.float64)
        self.proj = nn.Linear(8, 5, dtype=torch.float64)


def test_fold_site_matches_float64_algebra():
    torch.manual_seed(0)
    block = _Block()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(7, 8, dtype=torch.float64)
    expected = block.proj(block.norm(x))
    site = NormSite(
        name="norm", kind="layernorm", offset=0.0, eps=1e-5, weight="weight", bias="bias", shape=(8,),
        cast_order="fp32", dtype="float64",
        consumers=[Consumer(module="proj", param="proj.weight", op="linear", axis=1, bias="proj.bias")],
        foldable=True,
    )  # fmt: skip
    fold_site(block, site)
    assert torch.equal(block.norm.weight, torch.ones(8, dtype=torch.float64))
    assert torch.equal(block.norm.bias, torch.zeros(8, dtype=torch.float64))
    # float64 throughout: only rounding of the reassociated products remains.
    torch.testing.assert_close(block.proj(block.norm(x)), expected, rtol=0, atol=1e-12)


def test_fold_in_blocks_equals_one_shot(monkeypatch):
    """The chunked float64 fold gives bit-identical weights to an unchunked one."""
    import normswap.fold as fold

    model_a = tiny_model("llama")
    model_b = copy.deepcopy(model_a)
    normswap.convert(model_a, swap=False)
    monkeypatch.setattr(fold, "_CHUNK", 64)  # forces many blocks per weight
    normswap.convert(model_b, swap=False)
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("model_type", ["llama", "gemma", "gpt2"])
def test_convert_preserves_logits(model_type):
    model = tiny_model(model_type)
    ref = copy.deepcopy(model)
    ids = example_ids()
    report = normswap.convert(model)
    assert report.norms_swapped == report.norms_found > 0
    assert report.norms_folded >= 1
    diff = (_logits(ref, ids) - _logits(model, ids)).abs().max().item()
    assert diff <= 1e-5


def test_fold_changes_weights_and_resets_norm_identity():
    """A fold that silently did nothing would pass a logits test on a fresh model; check the weights moved."""
    model = tiny_model("gemma", tie_word_embeddings=False)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    w = model.model.layers[0].input_layernorm.weight.detach().double()
    normswap.convert(model, swap=False)
    after = model.model.layers[0].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(after.double(), before.double() * (1.0 + w), rtol=1e-6, atol=0)
    # the (1+w) norm's identity is w = 0
    assert torch.count_nonzero(model.model.layers[0].input_layernorm.weight) == 0


def test_untie_false_keeps_shared_storage_and_still_matches():
    """C7: skipping the lm_head fold keeps lm_head and the embedding on one storage."""
    model = tiny_model("llama", tie_word_embeddings=True)
    ref = copy.deepcopy(model)
    ids = example_ids()
    report = normswap.convert(model, untie=False)
    assert report.untied == [] and report.untie_bytes == 0
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    final = next(s for s in report.sites if any(c.module == "lm_head" for c in s.consumers))
    assert not final.folded and "untying disabled" in final.reason
    assert (_logits(ref, ids) - _logits(model, ids)).abs().max().item() <= 1e-5


def test_untie_reports_bytes_and_keeps_embedding_bit_identical():
    """C4/C7: untying gives lm_head its own Parameter, reports its size, leaves the embedding alone."""
    model = tiny_model("llama", tie_word_embeddings=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    report = normswap.convert(model)
    assert report.untied == ["lm_head.weight"]
    assert report.untie_bytes == embedding.numel() * embedding.element_size()
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert model.config.tie_word_embeddings is False


def test_fold_false_swaps_only_with_reason():
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    report = normswap.convert(model, fold=False)
    assert report.norms_folded == 0 and report.norms_swapped == report.norms_found
    assert all(s.reason == "folding disabled by option" for s in report.sites)
    ids = example_ids()
    assert (_logits(ref, ids) - _logits(model, ids)).abs().max().item() <= 1e-5


def test_convert_rejects_unknown_norm_and_normless_model():
    with pytest.raises(ValueError, match="norm must be one of"):
        normswap.convert(tiny_model("llama"), norm="batchnorm")

    class NoNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.out = nn.Linear(8, 16)

        def forward(self, input_ids, **_):
            return self.out(self.emb(input_ids))

    with pytest.raises(normswap.NormswapError, match="no normalization module"):
        normswap.convert(NoNorm(), input_ids=torch.randint(0, 16, (2, 4)))


class _SharedConsumer(nn.Module):
    """One Linear called on two different norms' outputs, and (optionally) on a raw activation too."""

    def __init__(self, raw_use: bool):
        super().__init__()
        self.config = None
        self.emb = nn.Embedding(32, 16)
        self.norm_a = nn.LayerNorm(16)
        self.norm_b = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.raw_use = raw_use
        with torch.no_grad():
            for norm in (self.norm_a, self.norm_b):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, input_ids, **_):
        h = self.emb(input_ids)
        if self.raw_use:
            return self.proj(self.norm_a(h)) + self.proj(h)
        return self.proj(self.norm_a(h)) + self.proj(self.norm_b(h))


@pytest.mark.parametrize("raw_use", [False, True])
def test_weight_shared_by_two_uses_is_not_folded(raw_use):
    """Folding norm_a into proj would also scale proj's other use: the fold must be refused, with a reason."""
    model = _SharedConsumer(raw_use)
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
    report = normswap.convert(model, input_ids=ids)
    reached = [s for s in report.sites if s.reached]
    assert len(reached) == (1 if raw_use else 2)
    assert report.norms_folded == 0
    assert all("proj.weight" in s.reason for s in reached)
    if raw_use:  # norm_b never runs: listed as not reached, swapped, not folded
        assert [(s.name, s.reason) for s in report.sites if not s.reached] == [
            ("norm_b", "not reached by the trace")
        ]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)


# -- the overflow test reads each consumer weight once (input_peaks) -----------------------------------------


def _elementwise_verdict(weight: torch.Tensor, scale: torch.Tensor) -> str | None:
    """The overflow test element by element, independent of normswap: every folded entry in float64."""
    after = weight.double() * scale.reshape(1, -1)
    limit = torch.finfo(weight.dtype).max
    bad = (~torch.isfinite(after) | (after.abs() > limit)) & torch.isfinite(weight)
    if not bad.any():
        return None
    name = str(weight.dtype).removeprefix("torch.")
    return f"fold overflows {name} (proj.weight would need {after[bad].abs().max().item():.3g} > {limit:.6g})"


class _NormProj(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.norm = nn.RMSNorm(weight.shape[1], dtype=torch.float64)
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(scale)
            self.proj.weight.copy_(weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["fits", "just over", "at the limit", "negative", "non-finite weight"])
def test_overflow_verdict_equals_the_elementwise_test(dtype, case):
    from normswap.fold import unrepresentable

    gen = torch.Generator().manual_seed(0)
    limit = torch.finfo(dtype).max
    weight = ((torch.rand(300, 24, generator=gen) - 0.5) * 2).to(dtype)
    scale = torch.rand(24, generator=gen, dtype=torch.float64) + 0.5
    big = torch.tensor(limit / 4, dtype=dtype)  # exactly representable (a power-of-two fraction of max)
    if case == "just over":
        weight[17, 5] = big
        scale[5] = 4.0 * (1 + 2**-20)
    elif case == "at the limit":
        weight[17, 5] = big
        scale[5] = 4.0  # big * 4 == max exactly: fits
    elif case == "negative":
        weight[3, 9] = -big
        scale[9] = -4.5
    elif case == "non-finite weight":  # not counted, and the other entries still are
        weight[0, 0], weight[1, 2] = float("inf"), float("nan")
        weight[17, 5] = big
        scale[5] = 4.5
    model = _NormProj(weight, scale)
    consumer = Consumer(module="proj", param="proj.weight", op="linear", axis=1)
    site = NormSite(name="norm", kind="rmsnorm", offset=0.0, eps=1e-6, weight="weight", bias=None,
                    shape=(24,), cast_order="fp32", dtype="float64", consumers=[consumer])  # fmt: skip
    expected = _elementwise_verdict(model.proj.weight.detach(), scale)
    assert (expected is None) == (case in ("fits", "at the limit"))
    assert unrepresentable(model, site) == expected


def test_input_peaks_are_the_largest_magnitude_per_input_index(monkeypatch):
    import normswap.fold as fold

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 37, 6, generator=gen)  # stacked experts, input axis 1
    expected = weight.abs().amax(dim=(0, 2))
    monkeypatch.setattr(fold, "_CHUNK", 30)  # many blocks
    assert torch.equal(fold.input_peaks(weight, 1), expected)
    assert torch.equal(fold.input_peaks(weight.transpose(0, 1).contiguous(), 0), expected)
    weight[2, 3, 1] = float("nan")
    assert fold.input_peaks(weight, 1) is None


class _ReadsTieFlag(nn.Module):
    """A tied LM that reads ``config.tie_word_embeddings`` while running (as T5 v1.0 and UDOP do): it
    halves its logits when the flag is set, so untying it changes its outputs at every position."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_model("llama", tie_word_embeddings=True)
        self.config = self.inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, **kwargs):
        logits = self.inner(input_ids=input_ids, **kwargs).logits
        return logits * 0.5 if self.config.tie_word_embeddings else logits


def test_untie_proof_on_the_first_positions_still_refuses_a_model_that_reads_the_flag():
    model = _ReadsTieFlag()
    ids = torch.randint(0, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids)
    forwarded = []
    hook = model.register_forward_pre_hook(lambda m, a, kwargs: forwarded.append(kwargs), with_kwargs=True)
    report = normswap.convert(model, input_ids=ids)
    hook.remove()
    final = next(s for s in report.sites if s.name == "inner.model.norm")
    assert not final.folded and final.reason.startswith("the model reads tie_word_embeddings while running")
    assert report.untied == [] and model.config.tie_word_embeddings is True
    assert model.inner.lm_head.weight is model.inner.model.embed_tokens.weight
    # its consumer reads the shared weight again, as the walk found it (not the copy the plan had named)
    assert [c.param for c in final.consumers] == ["inner.model.embed_tokens.weight"]
    proof = forwarded[1:]  # after the walk's forward, then the untie proof's two
    assert len(proof) == 2 and all(f["input_ids"].shape == (1, 8) for f in proof)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)


class _ReadsWholeConfig(_ReadsTieFlag):
    """Reads the config's state wholesale (``to_dict``, through ``__dict__``), never the flag by name: its
    outputs do not depend on the flag, but the walk cannot tell, so the proof's forwards run."""

    def forward(self, input_ids, **kwargs):
        assert isinstance(self.config.to_dict(), dict)
        return self.inner(input_ids=input_ids, **kwargs).logits


def _forwards(model):
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kwargs: calls.append(kwargs), with_kwargs=True)
    return calls, hook


def test_untie_without_forwards_when_the_walk_never_read_the_flag():
    model = tiny_model("llama", tie_word_embeddings=True)
    ids = example_ids()
    expected = _logits(model, ids)
    calls, hook = _forwards(model)
    report = normswap.convert(model, input_ids=ids)
    hook.remove()
    assert len(calls) == 1  # the walk's; no proof forwards
    assert report.untied == ["lm_head.weight"] and model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert report.norms_folded == report.norms_found
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)


def test_a_config_read_wholesale_runs_the_proof_and_unties():
    model = _ReadsWholeConfig()
    ids = example_ids()
    with torch.no_grad():
        expected = model(ids)
    calls, hook = _forwards(model)
    report = normswap.convert(model, input_ids=ids)
    hook.remove()
    assert len(calls) == 3  # the walk's, then the proof's two
    assert report.untied == ["inner.lm_head.weight"] and model.config.tie_word_embeddings is False
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)


def test_read_names_records_the_watched_config_only_and_restores_its_class():
    from transformers import LlamaConfig

    from normswap.reads import may_read_flag, read_names

    watched, other = LlamaConfig(), LlamaConfig()
    before = LlamaConfig.__getattribute__
    with read_names([watched]) as names:
        assert watched.tie_word_embeddings is not None and other.hidden_size > 0
    assert "__getattribute__" not in LlamaConfig.__dict__ and LlamaConfig.__getattribute__ is before
    assert names == {"tie_word_embeddings"}
    assert may_read_flag(frozenset(names)) and may_read_flag(None)
    assert not may_read_flag(frozenset({"hidden_size", "use_cache"}))
    assert may_read_flag(frozenset({"__dict__"}))
    with pytest.raises(RuntimeError), read_names([watched]):
        raise RuntimeError("restored on error too")
    assert "__getattribute__" not in LlamaConfig.__dict__


def test_a_norm_with_a_bias_and_no_weight_folds_with_scale_one():
    """``x / rms(x) + b`` has scale 1: folding it adds ``W b`` to the consumer's bias and leaves ``W`` as it
    is (it was folded with scale 0 before: logits off by 1.2)."""
    import copy

    from torch import nn

    import normswap

    class BiasNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.shift = nn.Parameter(torch.rand(d, generator=torch.Generator().manual_seed(0)) - 0.5)

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + self.shift

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.norm = nn.Embedding(128, 64), BiasNorm(64)
            self.up, self.head = nn.Linear(64, 64), nn.Linear(64, 128)

        def forward(self, ids):
            x = self.emb(ids)
            return self.head(x + self.up(self.norm(x)))

    torch.manual_seed(0)
    model = Model().eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    report = normswap.convert(model, example_inputs=(ids,))
    assert report.norms_folded == 1
    with torch.no_grad():
        assert (reference(ids) - model(ids)).abs().max().item() <= 1e-5
        assert torch.equal(model.up.weight, reference.up.weight)

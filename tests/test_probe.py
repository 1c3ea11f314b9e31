"""Norm semantics by probing: kind, (1 + w) convention, the eps really used, parameter roles and shapes,
cast order, whatever the class and parameter names; look-alikes are not taken for norms.

Every expectation is an independent fact about the module (its formula as written here or in
transformers' source), not a value read back from normswap.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normswap
from normswap.probe import probe_module
from normswap.zoo import randomize_constants

D = 16


class Squash(nn.Module):
    """RMS norm under another name, parameter ``gain``, eps hard-coded to 1e-6."""

    def __init__(self, d=D):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class Whiten(nn.Module):
    """A hand-written LayerNorm with ``alpha``/``beta`` and eps 1e-3."""

    def __init__(self, d=D):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-3) * self.alpha + self.beta


class Lift(nn.Module):
    """(1 + scale) RMS norm whose ``eps`` attribute lies (0.1) about the eps it uses (1e-5)."""

    def __init__(self, d=D):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(d))
        self.eps = 0.1

    def forward(self, x):
        return (1 + self.scale) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


class HeadGain(nn.Module):
    """RMS norm over head_dim with one scale per (head, feature): parameter of shape (heads, head_dim)."""

    def __init__(self, heads=4, d=D):
        super().__init__()
        self.g = nn.Parameter(torch.ones(heads, d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g


class RMSNorm(nn.Module):
    """Looks like a norm (class name, ``weight``, ``eps``), is not one: divides by the max, not the RMS."""

    def __init__(self, d=D):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        return x / (x.abs().amax(-1, keepdim=True) + self.eps) * self.weight


class PreScaledNorm(nn.Module):
    """Scale-invariant but scales *before* normalizing: rms(x * w) is no (offset + w) * n."""

    def __init__(self, d=D):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x = x * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LayerNorm(nn.Module):
    """Named like a norm, normalizes over the *sequence* axis: not a per-token norm, must not be taken."""

    def __init__(self, d=D):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + 1e-6) * self.weight


def _randomized(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.rand(p.shape) - 0.5)
    return module


@pytest.mark.parametrize(
    "module, kind, weight, bias, offset, eps",
    [
        (Squash(), "rmsnorm", "gain", None, 0.0, 1e-6),
        (Whiten(), "layernorm", "alpha", "beta", 0.0, 1e-3),
        (Lift(), "rmsnorm", "scale", None, 1.0, 1e-5),
        (nn.LayerNorm(D, eps=1e-5), "layernorm", "weight", "bias", 0.0, 1e-5),
        (nn.LayerNorm(D, eps=1e-5, bias=False), "layernorm", "weight", None, 0.0, 1e-5),
        (nn.LayerNorm(D, elementwise_affine=False, eps=1e-4), "layernorm", None, None, 0.0, 1e-4),
        (nn.RMSNorm(D, eps=3e-6), "rmsnorm", "weight", None, 0.0, 3e-6),
        # eps=None: torch adds the machine epsilon of the input dtype
        (nn.RMSNorm(D), "rmsnorm", "weight", None, 0.0, torch.finfo(torch.float32).eps),
    ],
    ids=[
        "Squash",
        "Whiten",
        "Lift",
        "LayerNorm",
        "LayerNorm-nobias",
        "LayerNorm-noaffine",
        "RMSNorm",
        "RMSNorm-eps-none",
    ],
)
def test_probe_reads_semantics_not_names(module, kind, weight, bias, offset, eps):
    site = probe_module(_randomized(module), (2, 8, D), "m")
    assert site is not None
    assert (site.kind, site.weight, site.bias, site.offset) == (kind, weight, bias, offset)
    assert site.eps == pytest.approx(eps, rel=1e-3)
    assert site.shape == (D,)


def test_per_head_scale_shape():
    site = probe_module(_randomized(HeadGain()), (2, 8, 4, D), "m")
    assert site is not None and site.shape == (4, D) and site.weight == "g"


@pytest.mark.parametrize("module", [RMSNorm(), PreScaledNorm(), LayerNorm(), nn.Linear(D, D), nn.GELU()])
def test_look_alikes_are_not_norms(module):
    assert probe_module(_randomized(module), (2, 8, D), "m") is None


def test_hf_norms_conventions_and_cast_order():
    """transformers' own classes: Llama casts before the weight multiply, Gemma (1 + w) multiplies in float32,
    Nemotron's LayerNorm1P is a (1 + w) LayerNorm, OLMo's is parameter-free with a hard-coded eps 1e-5."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    llama = probe_module(_randomized(LlamaRMSNorm(D, eps=1e-6)), (2, 8, D), "m")
    gemma = probe_module(_randomized(GemmaRMSNorm(D, eps=1e-6)), (2, 8, D), "m")
    nemotron = probe_module(_randomized(NemotronLayerNorm1P(D, eps=1e-5)), (2, 8, D), "m")
    olmo = probe_module(OlmoLayerNorm(D), (2, 8, D), "m")
    assert (llama.kind, llama.offset, llama.cast_order) == ("rmsnorm", 0.0, "llama")
    assert (gemma.kind, gemma.offset, gemma.cast_order) == ("rmsnorm", 1.0, "fp32")
    assert (nemotron.kind, nemotron.offset, nemotron.bias) == ("layernorm", 1.0, "bias")
    assert (olmo.kind, olmo.weight, olmo.bias, olmo.eps) == ("layernorm", None, None, 1e-5)


def test_probe_does_not_touch_the_module():
    module = _randomized(Whiten())
    before = copy.deepcopy(module.state_dict())
    probe_module(module, (2, 8, D), "m")
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


# -- a whole model written here: odd names everywhere --------------------------------------------------


class Mixer(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.squash = Squash(d)
        self.lookalike = RMSNorm(d)  # not a norm: its output must keep flowing as an ordinary activation
        self.kqv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.whiten = Whiten(d)
        self.widen = nn.Linear(d, 2 * d)
        self.narrow = nn.Linear(2 * d, d)

    def forward(self, x):
        a, b, c = self.kqv(self.squash(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.tanh(a) * b + self.lookalike(c))
        return x + self.narrow(torch.relu(self.widen(self.whiten(x))))


class OddLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lookup = nn.Embedding(128, D)
        self.stack = nn.ModuleList([Mixer(), Mixer()])
        self.lift = Lift()
        self.readout = nn.Linear(D, 128, bias=False)

    def forward(self, input_ids, **_):
        x = self.lookup(input_ids)
        for mixer in self.stack:
            x = mixer(x)
        return self.readout(self.lift(x))


def test_custom_model_with_odd_names_converts_exactly():
    torch.manual_seed(0)
    model = OddLM().eval()
    randomize_constants(model)  # by parameter: the look-alike's weight moves too
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    found = {s.name for s in report.sites}
    assert found == {"stack.0.squash", "stack.0.whiten", "stack.1.squash", "stack.1.whiten", "lift"}
    assert all(s.folded for s in report.sites), [(s.name, s.reason) for s in report.sites]
    lift = next(s for s in report.sites if s.name == "lift")
    assert (lift.offset, lift.eps) == (1.0, 1e-5)
    assert type(model.stack[0].lookalike) is RMSNorm  # left alone
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (reference(ids) - model(ids)).abs().max().item() <= 1e-5


# -- probe input shapes: long axes cut, the parameters' axes kept -------------------------------------------


class TwoAxisNorm(nn.Module):
    """RMS over the last TWO axes with a per-feature weight: not a norm over the last axis alone."""

    def __init__(self, d=D):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * self.weight


class FixedLength(nn.Module):
    """An RMS norm that reshapes with a hard-coded axis length (64): it only runs on inputs of that length."""

    def __init__(self, d=D):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        rows = x.reshape(x.shape[0], x.shape[1], 64, x.shape[-1])
        return (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).reshape(x.shape)


def _probed_shapes(module, input_shape):
    """Run probe_module and return (site, shapes of every input the module's copies were called with)."""
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: seen.append(tuple(args[0].shape)) if type(m) is type(module) else None
    )
    try:
        site = probe_module(module, input_shape, "m")
    finally:
        handle.remove()
    return site, seen


def test_long_axes_are_cut_and_the_norm_still_read_right():
    # a per-head norm traced on 512 positions: (batch, heads, positions, head_dim)
    site, seen = _probed_shapes(_randomized(Squash()), (1, 4, 512, D))
    assert (site.kind, site.weight, site.offset, site.eps, site.shape) == ("rmsnorm", "gain", 0.0, 1e-6, (D,))
    assert seen and all(s == (2, 4, 4, D) for s in seen)  # axes of 1 stay 1: none is made longer than 4
    site, seen = _probed_shapes(_randomized(Squash()), (1, 1, 512, D))
    assert site is not None and all(s == (2, 4, 4, D) for s in seen)
    site, seen = _probed_shapes(_randomized(Squash()), (3, 1, 1, D))
    assert site is not None and all(s == (2, 4, 1, D) for s in seen)


def test_per_head_scale_on_a_flat_token_axis():
    # (tokens, heads, head_dim) with a (heads, head_dim) scale: the scale's axes are kept whole
    site, seen = _probed_shapes(_randomized(HeadGain()), (48, 4, D))
    assert site.shape == (4, D) and all(s == (8, 4, D) for s in seen)


def test_a_cut_axis_still_exposes_a_norm_over_two_axes():
    assert probe_module(_randomized(TwoAxisNorm()), (2, 4, 512, D), "m") is None
    assert probe_module(_randomized(TwoAxisNorm()), (2, 4, 2, D), "m") is None


def test_a_module_that_needs_its_axis_length_is_probed_at_it():
    site, seen = _probed_shapes(_randomized(FixedLength()), (1, 3, 64, D))
    assert (site.kind, site.weight, site.eps) == ("rmsnorm", "weight", 1e-6)
    assert seen[0] == (2, 4, 4, D) and all(s == (2, 4, 64, D) for s in seen[1:])


# -- any eps: measured, not assumed small ----------------------------------------------------------------


class HandNorm(nn.Module):
    """An RMS or LayerNorm written out, its eps held where the probe cannot read it (a tuple), so the eps
    reported is the one measured."""

    def __init__(self, eps, layer=False, d=D):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.h = nn.Parameter(torch.zeros(d)) if layer else None
        self.hidden = (eps, layer)

    def forward(self, x):
        eps, layer = self.hidden
        if layer:
            x = x - x.mean(-1, keepdim=True)
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.g
        return y + self.h if layer else y


def _hf_norm(name):
    def make(eps):
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm}[name](D, eps=eps)

    return make


# maker, (kind, weight, bias, offset)
NORMS = {
    "hand-rms": (lambda eps: HandNorm(eps), ("rmsnorm", "g", None, 0.0)),
    "hand-layer": (lambda eps: HandNorm(eps, layer=True), ("layernorm", "g", "h", 0.0)),
    "nn.LayerNorm": (lambda eps: nn.LayerNorm(D, eps=eps), ("layernorm", "weight", "bias", 0.0)),
    "nn.RMSNorm": (lambda eps: nn.RMSNorm(D, eps=eps), ("rmsnorm", "weight", None, 0.0)),
    "LlamaRMSNorm": (_hf_norm("llama"), ("rmsnorm", "weight", None, 0.0)),  # normalizes in float32
    "GemmaRMSNorm": (_hf_norm("gemma"), ("rmsnorm", "weight", None, 1.0)),  # (1 + w), float32
}


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-6, 2.5e-3, 1e-2, 0.3, 1.0, 10.0])
@pytest.mark.parametrize("norm", list(NORMS))
def test_eps_of_any_size_is_measured(norm, eps):
    """A norm is found whatever its eps, and its eps measured: equal to the one it adds within 1e-6 relative
    (the measurement's precision where the module normalizes in float32 is ~1e-7)."""
    make, expected = NORMS[norm]
    site = probe_module(_randomized(make(eps)), (2, 8, D), "m")
    assert site is not None
    assert (site.kind, site.weight, site.bias, site.offset) == expected
    assert site.eps == pytest.approx(eps, rel=1e-6, abs=0.0)


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 0.3, 1.0, 10.0])
def test_cast_order_in_bfloat16_whatever_eps(eps):
    """In bfloat16 Llama casts the normalized input before its weight multiply, Gemma multiplies in float32
    (transformers' source): the probe tells them apart bit for bit, large eps or not."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for cls, order in ((LlamaRMSNorm, "llama"), (GemmaRMSNorm, "fp32")):
        module = _randomized(cls(D, eps=eps)).to(torch.bfloat16)
        site = probe_module(module, (2, 8, D), "m", torch.bfloat16)
        assert (site.cast_order, site.eps) == (order, eps)


class Elementwise(nn.Module):
    """``fn(self, x)``, with an optional per-feature ``w`` (in [0.5, 1.5]) and ``b``."""

    def __init__(self, fn, w=False, b=False, d=D):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.rand(d) + 0.5) if w else None
        self.b = nn.Parameter(torch.rand(d) - 0.5) if b else None

    def forward(self, x):
        return self.fn(self, x)


def _ms(x):
    return x.pow(2).mean(-1, keepdim=True)


NOT_NORMS = {
    "identity": Elementwise(lambda m, x: x),
    "dropout": nn.Dropout(0.1).eval(),
    "twice": Elementwise(lambda m, x: 2 * x),
    "per-feature affine": Elementwise(lambda m, x: x * m.w + m.b, w=True, b=True),
    "linear": nn.Linear(D, D),
    "gelu": nn.GELU(),
    "tanh": nn.Tanh(),
    "sign": Elementwise(lambda m, x: torch.sign(x)),
    "x/(|x|+c)": Elementwise(lambda m, x: x / (x.abs() + 0.3)),
    "scaled softmax": Elementwise(lambda m, x: torch.softmax(x * 0.25, -1) * D),
    "x/(max|x|+c)": Elementwise(lambda m, x: x / (x.abs().amax(-1, keepdim=True) + 0.3) * m.w, w=True),
    "x/(mean|x|+c)": Elementwise(lambda m, x: x / (x.abs().mean(-1, keepdim=True) + 0.3) * m.w, w=True),
    "x/(ms+c)": Elementwise(lambda m, x: x / (_ms(x) + 0.3) * m.w, w=True),
    "tanh of a norm": Elementwise(lambda m, x: torch.tanh(x / torch.sqrt(_ms(x) + 0.3)) * m.w, w=True),
    "x*ms": Elementwise(lambda m, x: x * _ms(x)),
    "std norm (unbiased)": Elementwise(
        lambda m, x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 0.3) * m.w, w=True
    ),
}


@pytest.mark.parametrize("name", list(NOT_NORMS))
def test_maps_that_are_no_norms_are_not_taken(name):
    """Odd maps, maps linear in their input, per-row rescalings by another statistic than the RMS: none is
    a norm, whatever eps would be fitted to them."""
    assert probe_module(NOT_NORMS[name], (2, 8, D), "m") is None


@pytest.mark.parametrize("c", [1e-6, 0.3])
def test_a_norm_no_eps_reproduces_is_reported(c):
    """``x / (rms(x) + c) * w`` is an RMSNorm far above c but no eps reproduces it near c: the probe says so
    (the walk lists it among its probe failures) instead of leaving it out without a word."""
    from normswap.probe import ProbeError
    from normswap.walk import walk

    module = Elementwise(lambda m, x: x / (_ms(x).sqrt() + c) * m.w, w=True)
    with pytest.raises(
        ProbeError, match=r"^a rmsnorm over its last axis on large inputs, but no eps reproduces"
    ):
        probe_module(module, (2, 8, D), "m")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pre, self.odd = (
                nn.Embedding(128, D),
                _randomized(nn.RMSNorm(D, eps=1e-6)),
                module,
            )
            self.mid, self.head = nn.Linear(D, D), nn.Linear(D, 128)

        def forward(self, input_ids, **_):
            return self.head(self.odd(self.mid(self.pre(self.embed(input_ids)))))

    model = Model().eval()
    traced = walk(model)
    assert [s.name for s in traced.sites] == ["pre"] and list(traced.probe_failures) == ["odd"]
    assert "no eps reproduces it near its eps" in traced.probe_failures["odd"]
    report = normswap.convert(model)  # listed in the report too, left as it was
    assert report.to_dict()["probe_failures"] == traced.probe_failures
    assert model.odd is module


# -- whole models with large eps: every norm found, measured, folded -----------------------------------


class EpsRMSNorm(nn.Module):
    """A hand-written RMSNorm with its own eps."""

    def __init__(self, width, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class EpsBlock(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.norm = EpsRMSNorm(width, eps)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class EpsLM(nn.Module):
    """Five pre-norm blocks whose norms have the given eps, a final norm (eps 1e-6), a head."""

    def __init__(self, eps, width=32):
        super().__init__()
        self.embed = nn.Embedding(128, width)
        self.blocks = nn.ModuleList(EpsBlock(width, e) for e in eps)
        self.final = EpsRMSNorm(width, 1e-6)
        self.head = nn.Linear(width, 128, bias=False)

    def forward(self, input_ids, **_):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final(x))


@torch.no_grad()
def _randomize_parameters(model, norm_params, base):
    """Every parameter ``norm_params`` names: ``base(name) + U(-0.5, 0.5)`` (chosen by name, here in the
    test, not found by normswap)."""
    gen = torch.Generator().manual_seed(11)
    for name in norm_params:
        p = model.get_parameter(name)
        p.copy_(base(name) + torch.rand(p.shape, generator=gen) - 0.5)


def _assert_every_norm_found_and_folded(model, norms: dict[str, float], unfolded=None):
    """``norms``: module name -> the eps it adds. All found by ``inspect`` and by ``convert``, eps within 1e-6
    relative, every one folded but those of ``unfolded`` (name -> the reason, as at a small eps), the
    converted model's logits within 1e-5 of the original's (float32: a fold changes them by rounding only,
    ~1e-7 here; a norm left out or a wrong eps moves them by 1e-3 or more)."""
    unfolded = unfolded or {}
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = _logits(model, ids)
    listed = {s.name: s.eps for s in normswap.inspect(model)}
    assert listed.keys() == norms.keys()
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    found = {s.name: s for s in report.sites}
    assert found.keys() == norms.keys()
    for name, eps in norms.items():
        assert found[name].eps == pytest.approx(eps, rel=1e-6, abs=0.0), name
        assert listed[name] == found[name].eps
        assert (found[name].folded, found[name].reason) == (name not in unfolded, unfolded.get(name)), name
    with torch.no_grad():
        assert (_logits(reference, ids) - before).abs().max().item() == 0.0
        assert (_logits(model, ids) - before).abs().max().item() <= 1e-5


def _logits(model, ids):
    out = model(input_ids=ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def test_custom_model_with_large_eps_in_two_layers():
    """eps 0.3 and 2.5e-3 in two of five blocks: both were missing from inspect and the report."""
    eps = [1e-6, 0.3, 1e-6, 2.5e-3, 1e-6]
    torch.manual_seed(0)
    model = EpsLM(eps).eval()
    params = [n for n, _ in model.named_parameters() if "norm" in n or n.startswith("final")]
    _randomize_parameters(model, params, lambda name: 1.0)
    norms = {f"blocks.{i}.norm": e for i, e in enumerate(eps)} | {"final": 1e-6}
    _assert_every_norm_found_and_folded(model, norms)


def _hf(model_type, norm_word, base, **config):
    """A tiny transformers model of ``model_type`` (config as the zoo's, with ``config``), its norm parameters
    (names holding ``norm_word``) set to ``base(name) + U(-0.5, 0.5)``; returns (model, norm module names)."""
    from transformers import AutoModelForCausalLM

    from normswap.zoo import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **config), dtype=torch.float32).eval()
    params = [n for n, _ in model.named_parameters() if norm_word in n]
    _randomize_parameters(model, params, base)
    return model, sorted({n.rsplit(".", 1)[0] for n in params})


@pytest.mark.parametrize("eps", [2e-3, 3e-3, 1e-1, 1.0])
def test_llama_with_large_rms_norm_eps(eps):
    model, names = _hf("llama", "norm", lambda name: 1.0, rms_norm_eps=eps)
    assert len(names) == 5  # two per layer, the final norm
    _assert_every_norm_found_and_folded(model, dict.fromkeys(names, eps))


@pytest.mark.parametrize("eps", [1e-2, 1.0])
def test_gpt2_with_large_layer_norm_epsilon(eps):
    model, names = _hf("gpt2", ".ln_", lambda name: 1.0 if name.endswith("weight") else 0.0,
                       layer_norm_epsilon=eps)  # fmt: skip
    assert len(names) == 5
    # the final LayerNorm's bias has no lm_head bias to go to (at any eps)
    unfolded = {"transformer.ln_f": "consumer lm_head has no bias to absorb the norm's bias"}
    _assert_every_norm_found_and_folded(model, dict.fromkeys(names, eps), unfolded)


def test_gemma_one_plus_w_with_large_eps():
    model, names = _hf("gemma", "norm", lambda name: 0.0, rms_norm_eps=1e-2)
    assert len(names) == 5
    _assert_every_norm_found_and_folded(model, dict.fromkeys(names, 1e-2))

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
from normswap.zoo import randomize_norms

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
    randomize_norms(model)
    with torch.no_grad():  # the look-alike is not touched by randomize_norms (not a norm): move it by hand
        for mixer in model.stack:
            mixer.lookalike.weight.add_(torch.rand(D) - 0.5)
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

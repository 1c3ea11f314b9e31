"""normswap.kernels: every op and module against the transformers module it replaces and an fp64 formula.

Tolerance policy (used throughout):

* ``eager`` is HF's op sequence, and ``torch`` for LayerNorm is ``nn.LayerNorm``'s own kernel: where the
  backend performs the same operations as the original module, outputs must be bit-identical.
* Other backend/module pairs differ only in the float32 summation order of the row reduction. That moves
  the pre-rounding value by a few float32 ulps (relative ~2**-22), which can flip the final half/bfloat16
  rounding only for values that sit that close to a rounding boundary: at most 1 ulp, on a small fraction
  of elements (measured: < 0.05%). A wrong cast order is *also* 1 ulp per element, but on 20-50% of them,
  so "<= 1 ulp on <= 1% of elements" separates the two (``assert_ulp_close``).
* float32 outputs: a few float32 ulps of the output scale (atol ``2**-20 * max|ref|``, i.e. 8 ulps of the
  largest value); wrong math (eps, offset, weight) is off by far more, see ``test_eps_is_used``.
* Against the float64 formula (with the cast order's intermediate roundings emulated): 2 ulps of the
  output dtype (one intermediate and one final rounding) plus the same float32-scale floor, which covers
  LayerNorm's cancellation in ``x - mean`` for outputs near zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normswap.kernels import FusedLayerNorm, FusedRMSNorm, add_rms_norm, layer_norm, resolve_backend, rms_norm

LOW = (torch.bfloat16, torch.float16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CPU_BACKENDS = ("auto", "eager", "torch")  # "compiled" is exercised by the marked compile tests


def ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the dtype of ``v`` at ``|v|`` (as float64)."""
    a = v.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()


def assert_ulp_close(out: torch.Tensor, ref: torch.Tensor, max_ulps: float = 1, max_frac: float = 0.01):
    """Same dtype and shape; low precision: <= max_ulps everywhere and differing on <= max_frac of elements;
    float32/64: within 8 ulps of the largest |ref| (see module docstring)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    diff = (out.double() - ref.double()).abs()
    if ref.dtype in LOW:
        bound = max_ulps * torch.maximum(ulp(out), ulp(ref))
        assert (diff <= bound).all(), f"max diff {diff.max().item():.3g} exceeds {max_ulps} ulp"
        frac = (diff > 0).double().mean().item()
        assert frac <= max_frac, f"{frac:.2%} of elements differ (cast order?)"
    else:
        atol = 2.0**-20 * ref.double().abs().max().item()
        assert diff.max().item() <= atol, f"max diff {diff.max().item():.3g} > {atol:.3g}"


def noise(shape, base=0.0, seed=0, dtype=torch.float32):
    """``base + U(-0.5, 0.5)`` (the field cases' re-randomized norm parameters)."""
    g = torch.Generator().manual_seed(seed)
    return (base + torch.rand(shape, generator=g) - 0.5).to(dtype)


def hidden(shape, dtype, seed=1):
    """Hidden states ~ N(0, 3), as in case C2."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# The transformers modules normswap replaces, each with the fused module of the same semantics.


def _hf_cases():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    D, H, HD = 96, 4, 32
    # name -> (HF module factory, fused factory, input shape, backends that run the module's own ops)
    return {
        "LlamaRMSNorm": (
            lambda: LlamaRMSNorm(D, eps=1e-6),
            lambda: FusedRMSNorm((D,), 1e-6),
            (2, 9, D),
            {"auto", "eager", "torch"},
        ),
        "GemmaRMSNorm": (
            lambda: GemmaRMSNorm(D, eps=1e-6),
            lambda: FusedRMSNorm((D,), 1e-6, offset=1.0, cast_order="fp32"),
            (2, 9, D),
            {"auto", "eager", "torch"},
        ),
        "Gemma3RMSNorm": (
            lambda: Gemma3RMSNorm(D, eps=1e-6),
            lambda: FusedRMSNorm((D,), 1e-6, offset=1.0, cast_order="fp32"),
            (2, 9, D),
            {"auto", "eager", "torch"},
        ),
        # Qwen3's q_norm: a (head_dim,) RMSNorm applied to (batch, seq, heads, head_dim).
        "Qwen3 q_norm": (
            lambda: Qwen3RMSNorm(HD, eps=1e-6),
            lambda: FusedRMSNorm((HD,), 1e-6),
            (2, 9, H, HD),
            {"auto", "eager", "torch"},
        ),
        "nn.LayerNorm": (
            lambda: nn.LayerNorm(D, eps=1e-5),
            lambda: FusedLayerNorm((D,), 1e-5),
            (2, 9, D),
            {"auto", "torch"},
        ),
        # OLMo: no parameters, eps hard-coded to 1e-5, float32 upcast.
        "OlmoLayerNorm": (
            lambda: OlmoLayerNorm(D),
            lambda: FusedLayerNorm((D,), 1e-5, weight_name=None, bias_name=None),
            (2, 9, D),
            {"auto", "torch"},
        ),
        # Cohere's per-head q/k LayerNorm: weight (H, D), no bias, float32 multiply.
        "CohereLayerNorm (H, D)": (
            lambda: CohereLayerNorm((H, HD), eps=1e-5),
            lambda: FusedLayerNorm((H, HD), 1e-5, bias_name=None),
            (2, 9, H, HD),
            {"eager"},
        ),
    }


HF_CASES = list(_hf_cases())


def _pair(name, dtype, backend, param_dtype=None):
    """(HF module, fused module with the same randomized parameters, input) in ``dtype``."""
    make_hf, make_fused, shape, _ = _hf_cases()[name]
    hf, fused = make_hf(), make_fused()
    with torch.no_grad():
        for i, (pname, p) in enumerate(hf.named_parameters()):
            base = (
                0.0 if (isinstance(fused, FusedRMSNorm) and fused.offset == 1.0) or "bias" in pname else 1.0
            )
            p.copy_(noise(p.shape, base, seed=10 + i))
    hf.to(param_dtype or dtype)
    fused.load_state_dict(hf.state_dict())
    fused.to(param_dtype or dtype)
    fused.backend = backend
    return hf.requires_grad_(False), fused.requires_grad_(False), hidden(shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", HF_CASES)
def test_matches_transformers_module(name, backend, dtype):
    hf, fused, x = _pair(name, dtype, backend)
    ref, out = hf(x), fused(x)
    assert set(fused.state_dict()) == set(hf.state_dict())
    if backend in _hf_cases()[name][3]:
        assert out.dtype == ref.dtype and torch.equal(out, ref), (out - ref).abs().max()
    else:
        assert_ulp_close(out, ref)


# ---------------------------------------------------------------------------------------------------------
# Field case C2 on tiny models: each original norm module against its replacement, bit for bit.


def _fused_for(module: nn.Module) -> nn.Module:
    """The fused module with the semantics of a transformers Llama/Gemma norm (known here by class)."""
    w = module.weight
    if type(module).__name__.startswith("Gemma"):
        fused = FusedRMSNorm(w.shape, module.eps, offset=1.0, cast_order="fp32", dtype=w.dtype)
    else:
        fused = FusedRMSNorm(w.shape, module.variance_epsilon, dtype=w.dtype)
    fused.load_state_dict(module.state_dict())
    return fused.requires_grad_(False)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_c2_cast_order_bf16_models(tiny_model, model_type, backend):
    model = tiny_model(model_type, dtype=torch.bfloat16)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 5  # 2 per layer + final
    for i, m in enumerate(norms):
        fused = _fused_for(m)
        fused.backend = backend
        x = hidden((2, 16, *m.weight.shape), torch.bfloat16, seed=i)
        with torch.no_grad():
            ref, out = m(x), fused(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_c2_wrong_cast_order_is_caught():
    """The check above can fail: the other cast order differs on many elements by 1 ulp."""
    w, x = noise(64, 1.0, dtype=torch.bfloat16), hidden((32, 64), torch.bfloat16)
    llama = rms_norm(x, w, cast_order="llama")
    gemma = rms_norm(x, w, cast_order="fp32")
    assert not torch.equal(llama, gemma)
    with pytest.raises(AssertionError, match="cast order"):
        assert_ulp_close(gemma, llama)


# ---------------------------------------------------------------------------------------------------------
# Field case C3: mixed dtypes between activations and norm weight.


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["LlamaRMSNorm", "GemmaRMSNorm", "Qwen3 q_norm", "CohereLayerNorm (H, D)"])
def test_c3_mixed_dtypes(name, backend, x_dtype, w_dtype):
    hf, fused, x = _pair(name, x_dtype, backend, param_dtype=w_dtype)
    ref, out = hf(x), fused(x)
    # Llama order promotes (a float32-weight LlamaRMSNorm returns float32); fp32 order returns x's dtype.
    assert out.dtype == ref.dtype
    if backend in _hf_cases()[name][3]:
        assert torch.equal(out, ref)
    else:
        assert_ulp_close(out, ref)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_c3_layernorm_bf16_input_float32_params(backend):
    ln = nn.LayerNorm(96).requires_grad_(False)
    ln.weight.copy_(noise(96, 1.0))
    ln.bias.copy_(noise(96, 0.0, seed=1))
    fused = FusedLayerNorm((96,), 1e-5, backend=backend).requires_grad_(False)
    fused.load_state_dict(ln.state_dict())
    x = hidden((4, 96), torch.bfloat16)
    ref, out = ln(x), fused(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    if backend == "eager":  # the Cohere formula; "torch"/"auto" run nn.LayerNorm's own kernel
        assert_ulp_close(out, ref)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "model_dtype,norm_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)]
)
def test_c3_tiny_llama_mixed_norm_weights(tiny_model, model_dtype, norm_dtype):
    """Case C3 on the tiny Llama: every norm with its weight in another dtype than the activations.

    (The unconverted model itself cannot run end to end that way: a float32 norm output meets bfloat16
    linears. What must hold is that each replacement returns what the module it replaces returns.)
    """
    model = tiny_model("llama", dtype=model_dtype)
    norms = [m.to(norm_dtype) for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5
    for i, m in enumerate(norms):
        fused = _fused_for(m)
        x = hidden((2, 16, 64), model_dtype, seed=i)
        with torch.no_grad():
            ref, out = m(x), fused(x)
        assert out.dtype == ref.dtype == torch.promote_types(model_dtype, norm_dtype)
        assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------------------
# The functional ops against the float64 formula.


def _fp64_norm(x, w, b, eps, offset, cast_order, kind, residual=None):
    """float64 formula with the cast order's roundings emulated (Zhang & Sennrich 2019; Ba et al. 2016)."""
    h = x if residual is None else x + residual  # torch's add (rounded to the promoted dtype)
    x64 = h.double()
    if kind == "layer":
        x64 = x64 - x64.mean(-1, keepdim=True)
    n = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if cast_order == "llama":
        y = n.to(h.dtype).double()
        out_dtype = h.dtype
        if w is not None:
            y = y * (offset + w).double()  # (offset + w) in the weight's dtype, as the contract says
            out_dtype = torch.promote_types(out_dtype, w.dtype)
            if b is not None:
                y = y.to(out_dtype).double()
        if b is not None:
            y = y + b.double()
            out_dtype = torch.promote_types(out_dtype, b.dtype)
        return y.to(out_dtype)
    if w is not None:
        n = n * (offset + w.double())
    if b is not None:
        n = n + b.double()
    return n.to(h.dtype)


def _assert_fp64_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = (out.double() - ref.double()).abs()
    bound = 2 * torch.maximum(ulp(out), ulp(ref)) + 2.0**-20 * ref.double().abs().max().item()
    assert (diff <= bound).all(), f"max diff {diff.max().item():.3g}"


# (input shape, weight shape or None, transpose the input's dims 1 and 2 to make it non-contiguous)
LAYOUTS = [
    ((3, 7, 64), (64,), False),
    ((2, 5, 4, 32), (4, 32), False),  # per-head weight, 4D input
    ((2, 4, 5, 32), (32,), True),  # non-contiguous input
    ((6, 48), None, False),  # parameter-free
]


ORDERS = [("llama", 0.0), ("fp32", 0.0), ("fp32", 1.0), ("llama", 1.0)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["rms", "layer", "add_rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "layout,cast_order,offset",
    # a parameter-free norm has no offset
    [(i, o, off) for i, lay in enumerate(LAYOUTS) for o, off in ORDERS if lay[1] is not None or off == 0.0],
)
def test_ops_against_fp64(layout, cast_order, offset, dtype, kind, backend):
    shape, wshape, transpose = LAYOUTS[layout]
    x = hidden(shape, dtype)
    if transpose:
        x = x.transpose(1, 2)
        assert not x.is_contiguous()
    w = None if wshape is None else noise(wshape, 1.0 - offset, seed=2, dtype=dtype)
    b = None if wshape is None or kind != "layer" else noise(wshape, 0.0, seed=3, dtype=dtype)
    if kind == "rms":
        out = rms_norm(x, w, 1e-6, offset, cast_order, backend)
        ref = _fp64_norm(x, w, None, 1e-6, offset, cast_order, "rms")
        _assert_fp64_close(out, ref)
    elif kind == "layer":
        out = layer_norm(x, w, b, 1e-5, offset, cast_order, backend)
        ref = _fp64_norm(x, w, b, 1e-5, offset, cast_order, "layer")
        _assert_fp64_close(out, ref)
    else:
        residual = hidden(x.shape, dtype, seed=4)
        out, new_res = add_rms_norm(x, residual, w, 1e-6, offset, cast_order, backend)
        assert torch.equal(new_res, x + residual)
        ref = _fp64_norm(x, w, None, 1e-6, offset, cast_order, "rms", residual=residual)
        _assert_fp64_close(out, ref)
    assert out.shape == x.shape


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_add_rms_norm_mixed_residual(backend):
    """bfloat16 block output into a float32 residual stream: the add promotes, the norm follows."""
    x, res, w = hidden((4, 64), torch.bfloat16), hidden((4, 64), torch.float32, seed=2), noise(64, 1.0)
    y, h = add_rms_norm(x, res, w, backend=backend)
    assert h.dtype == torch.float32 and torch.equal(h, x + res)
    assert torch.equal(y, rms_norm(x + res, w, backend="eager"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_eps_is_used(op, backend):
    """Inputs of scale 1e-3: eps 1e-6 vs 1e-5 changes outputs by ~5%, far beyond any tolerance above."""
    x, w = hidden((4, 64), torch.float32) * 1e-3 / 3, noise(64, 1.0)
    fn = rms_norm if op == "rms" else layer_norm
    out = fn(x, w, eps=1e-6, backend=backend)
    ref = _fp64_norm(x, w, None, 1e-6, 0.0, "llama" if op == "rms" else "fp32", op)
    _assert_fp64_close(out, ref)
    assert (fn(x, w, eps=1e-5, backend=backend) - out).abs().max() > 1e-2 * out.abs().max()


def test_float64_input_stays_float64():
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.rand(16, dtype=torch.float64) + 0.5
    out = rms_norm(x, w)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)  # computed in float64 throughout


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_input(backend):
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    assert rms_norm(x, torch.ones(32), backend=backend).shape == (0, 32)
    assert layer_norm(x, torch.ones(32), torch.zeros(32), backend=backend).shape == (0, 32)


def test_gradients_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(32)
    with torch.no_grad():
        hf.weight.copy_(noise(32, 1.0))
    fused = FusedRMSNorm((32,), 1e-6)
    fused.load_state_dict(hf.state_dict())
    x1 = hidden((5, 32), torch.float32).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    g = hidden((5, 32), torch.float32, seed=7)
    hf(x1).backward(g)
    fused(x2).backward(g)
    # Same op sequence under autograd: identical gradients.
    assert torch.equal(x1.grad, x2.grad) and torch.equal(hf.weight.grad, fused.weight.grad)


# ---------------------------------------------------------------------------------------------------------
# Modules, validation, backend selection.


def test_module_parameters_and_repr():
    m = FusedRMSNorm((4, 8), 1e-5, offset=1.0, cast_order="fp32", weight_name="scale", dtype=torch.bfloat16)
    assert list(m.state_dict()) == ["scale"] and m.scale.dtype == torch.bfloat16
    assert torch.equal(m.scale, torch.zeros(4, 8, dtype=torch.bfloat16))  # identity: offset + w == 1
    assert (m.kind, m.eps, m.offset, m.cast_order, m.normalized_shape) == ("rmsnorm", 1e-5, 1.0, "fp32", (8,))
    assert "weight_name='scale'" in repr(m) and "offset=1.0" in repr(m)
    x = hidden((3, 4, 8), torch.float32)
    n = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(m.float()(x), n, rtol=1e-6, atol=1e-6)  # float32 rounding only

    ln = FusedLayerNorm((8,), 1e-5, weight_name="gamma", bias_name="beta")
    assert list(ln.state_dict()) == ["gamma", "beta"] and ln.kind == "layernorm"
    assert torch.equal(ln.gamma, torch.ones(8)) and torch.equal(ln.beta, torch.zeros(8))
    free = FusedLayerNorm(8, 1e-5, weight_name=None, bias_name=None)
    assert list(free.parameters()) == [] and free.normalized_shape == (8,)
    no_bias = FusedLayerNorm(8, 1e-5, bias_name=None)
    assert list(no_bias.state_dict()) == ["weight"]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: rms_norm(torch.randn(2, 8), cast_order="gemma"), "cast_order"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(7)), "does not broadcast"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(3, 8)), "does not broadcast"),
        (lambda: rms_norm(torch.randn(2, 8), None, offset=1.0), "needs a weight"),
        (lambda: rms_norm(torch.ones(2, 8, dtype=torch.int64)), "floating-point"),
        (lambda: layer_norm(torch.randn(2, 8), torch.ones(8), torch.ones(4)), "bias of shape"),
        (lambda: rms_norm(torch.randn(2, 8), backend="cuda"), "backend must be one of"),
        (lambda: add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8)), "same shape"),
        (lambda: FusedRMSNorm((8,), 1e-6, cast_order="x"), "cast_order"),
        (lambda: FusedRMSNorm((8,), 1e-6, weight_name=None, offset=1.0), "needs a weight"),
        (lambda: FusedRMSNorm((0,), 1e-6), "positive sizes"),
        (lambda: FusedLayerNorm((8,), 1e-6, backend="fast"), "backend must be one of"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_backend_from_environment(monkeypatch):
    """$NORMSWAP_BACKEND is read once per process (``ops._ENV`` holds it; clearing it re-reads)."""
    from normswap.kernels import ops

    monkeypatch.setattr(ops, "_ENV", [])
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    assert resolve_backend(None) == "torch" and resolve_backend("eager") == "eager"
    monkeypatch.setenv("NORMSWAP_BACKEND", "turbo")
    assert resolve_backend(None) == "torch"  # read once
    ops._ENV.clear()
    with pytest.raises(ValueError, match=r"\$NORMSWAP_BACKEND must be one of"):
        rms_norm(torch.randn(2, 8))
    monkeypatch.delenv("NORMSWAP_BACKEND")
    ops._ENV.clear()
    assert resolve_backend(None) == "auto"


def test_triton_backend_falls_back_on_cpu():
    x, w = hidden((4, 64), torch.bfloat16), noise(64, 1.0, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="triton backend unavailable"):
        out = rms_norm(x, w, backend="triton")
    assert torch.equal(out, rms_norm(x, w, backend="eager"))


def test_custom_ops_opcheck():
    """Schema, fake (meta) impls and dispatch of the registered ops, as torch.compile relies on them."""
    x, w, b = hidden((3, 5, 32), torch.bfloat16), noise(32, 1.0), noise(32, 0.0, seed=1)
    cases = [
        (torch.ops.normswap.rms_norm.default, (x, w, 1e-6, 0.0, "llama", "eager")),
        (torch.ops.normswap.rms_norm.default, (x, None, 1e-6, 0.0, "fp32", "torch")),
        (torch.ops.normswap.layer_norm.default, (x, w, b, 1e-5, 1.0, "fp32", "torch")),
        (torch.ops.normswap.add_rms_norm.default, (x, x.float(), w, 1e-6, 0.0, "llama", "eager")),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------------
# torch.compile: one short marked test each for graph capture and for the compiled backend.


@pytest.mark.compile
@pytest.mark.parametrize("backend", [None, "eager"])
def test_compiled_model_no_graph_breaks_or_recompiles(tiny_model, input_ids, backend):
    """A model with fused norms compiles as one graph; norm instances do not add recompiles.

    ``None`` (auto) lets the compiler trace the reference math; ``"eager"`` goes through the custom op.
    Dynamo's own backend ("eager") keeps the test to graph capture, without inductor's codegen.
    """
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "LlamaRMSNorm":
            parent, _, attr = name.rpartition(".")
            fused = _fused_for(m)
            fused.backend = backend
            setattr(model.get_submodule(parent), attr, fused)
    with torch.no_grad():
        ref = model(input_ids).logits
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        out = compiled(input_ids).logits
        out2 = compiled(input_ids.flip(0)).logits
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(out2, model(input_ids.flip(0)).logits, rtol=0, atol=0)

        # Several norm instances (different eps and weights) through one compiled function: one graph.
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(lambda mod, h: mod(h), backend="eager", fullgraph=True)
        for i, eps in enumerate((1e-6, 1e-6, 1e-5)):
            norm = FusedRMSNorm((64,), eps, backend=backend)
            norm.weight.copy_(noise(64, 1.0, seed=i))
            x = hidden((2, 64), torch.float32, seed=i)
            torch.testing.assert_close(fn(norm, x), norm(x), rtol=0, atol=0)
        assert counters["stats"]["unique_graphs"] <= 2  # eps is a constant: one graph per distinct eps


@pytest.mark.compile
def test_compiled_backend_keeps_cast_order():
    """Inductor kernels (backend="compiled") against HF modules in bfloat16 (the C2 fault if not)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(256).requires_grad_(False)
    hf.weight.copy_(noise(256, 1.0))
    hf.bfloat16()
    x = hidden((64, 256), torch.bfloat16)
    assert_ulp_close(rms_norm(x, hf.weight, backend="compiled"), hf(x))
    ln = nn.LayerNorm(256).requires_grad_(False).bfloat16()
    ln.weight.copy_(noise(256, 1.0))
    ln.bias.copy_(noise(256, 0.0, seed=1))
    assert_ulp_close(layer_norm(x, ln.weight, ln.bias, backend="compiled"), ln(x))
    # Calls below compiled.MIN_ELEMENTS (decode-sized) run the eager math: bit-identical to HF.
    assert torch.equal(rms_norm(x[:2], hf.weight, backend="compiled"), hf(x[:2]))


@pytest.mark.compile
@pytest.mark.parametrize("emulate", [False, True], ids=["casts-fusable", "emulate_precision_casts"])
def test_compiled_llama_order_rounds_explicitly(emulate):
    """The compiled llama-order math rounds with integer ops, so it equals the eager reference bit for bit in
    bfloat16 even where inductor may fuse ``n.to(bf16)`` away (emulate_precision_casts off: the naive math
    then differs in 26% of the elements, the fault first seen on the H200 with torch 2.11)."""
    from normswap.kernels import compiled
    from normswap.kernels import reference as ref

    torch._dynamo.reset()
    x, w, b = hidden((64, 256), torch.bfloat16), noise(256, 1.0, dtype=torch.bfloat16), noise(256, seed=2)
    b = b.bfloat16()
    options = {"emulate_precision_casts": emulate}
    rms = torch.compile(compiled._rms, fullgraph=True, options=options)
    assert torch.equal(rms(x, w, 1e-6, "llama"), ref.rms_norm_math(x, w, 1e-6, "llama"))
    ln = torch.compile(compiled._layer, fullgraph=True, options=options)
    assert torch.equal(ln(x, w, b, 1e-5, "llama"), ref.layer_norm_math(x, w, b, 1e-5, "llama"))
    # float16 keeps more mantissa bits, so the float32 summation order can flip a rounding of n (measured: 1
    # element of 8192, 2 ulp of the output at a binade edge); the naive math is off in 27% of them.
    xh, wh = x.half(), w.half()
    want = ref.rms_norm_math(xh, wh, 1e-6, "llama")
    assert_ulp_close(rms(xh, wh, 1e-6, "llama"), want, max_ulps=2, max_frac=0.001)


def test_round_bits_matches_casts():
    """``_round_bits`` rounds float32 to bfloat16/float16 precision exactly as ``.to(dtype)`` does (ties to
    even, signs, huge and tiny values) over the normal range of each dtype."""
    from normswap.kernels.compiled import _round_bits

    g = torch.Generator().manual_seed(0)
    t = torch.randn(100000, generator=g) * torch.logspace(-4, 4, 100000)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11])
    for dtype in (torch.bfloat16, torch.float16):
        v = torch.cat([t, ties])
        v = v[v.abs() >= torch.finfo(dtype).tiny]
        v = v[v.abs() <= torch.finfo(dtype).max / 2]
        assert torch.equal(_round_bits(v, dtype), v.to(dtype).float()), dtype


# ---------------------------------------------------------------------------------------------------------
# Triton kernel in triton's CPU interpreter (runs only where triton is installed; no GPU needed).

_TRITON_CHECK = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from normswap.kernels import reference as ref, triton_norm as tn

    def spacing(v, dtype):
        a = v.abs().to(dtype)
        return (torch.nextafter(a, a + float("inf")) - a).double()

    def configs(n_rows, d, itemsize):
        # Every kind of launch: the default (decode-sized here: one row per program); tiles of 4 rows
        # with a masked tail on a grid of half the tiles (each program loops over two, loading the
        # parameters after each reduction); 2-row tiles on a one-program grid holding the parameters in
        # registers over all tiles.
        row = tn.triton.next_power_of_2(d) * itemsize
        packed = tn.choose_config(n_rows, d, itemsize, sm_count=1, tile_bytes=4 * row)
        packed = packed._replace(programs=max(1, packed.programs // 2))
        early = tn.choose_config(n_rows, d, itemsize, sm_count=1, tile_bytes=2 * row, programs_per_sm=1)
        assert packed.rows == 4 and not packed.early_params and early.early_params and early.programs == 1
        return [None, packed, early]

    def check(out, want, case):
        xdt = case[0]
        assert out.dtype == want.dtype and out.shape == want.shape, (case, out.dtype)
        d = (out.double() - want.double()).abs()
        floor = 2.0**-20 * want.double().abs().max()
        if xdt == torch.bfloat16:
            # The interpreter truncates float32 -> bfloat16 where GPUs round to nearest, so each
            # intermediate rounding may be off by 1 ulp of its own (larger) magnitude: bfloat16 only gets
            # a coarse check (indexing, eps, formula); float16, which the interpreter rounds correctly,
            # checks the same code paths strictly.
            bound = 4 * spacing(want.double().abs().max(), xdt)
        else:
            # 1 ulp of the precision the roundings happen in, float32 reduction-order floor
            bound = spacing(want, xdt) + floor
        assert (d <= bound).all(), (case, d.max().item())
        if want.dtype == torch.float16:
            frac = (d > 0).double().mean().item()
            assert frac <= 0.01, (case, frac)

    def run_case(x, w, b, r, order, offset, cfg):
        we, be = ref.prepare_params(w, b, offset, order)

        def launch(res, w_, b_, rms, eps):
            return tn.norm(x, res, w_, b_, eps, order, rms, offset if w_ is not None else 0.0, cfg)

        y, h = launch(r, w, None, True, 1e-6)
        return [
            (launch(None, w, None, True, 1e-6)[0], ref.rms_norm_math(x, we, 1e-6, order)),
            (launch(None, w, b, False, 1e-5)[0], ref.layer_norm_math(x, we, be, 1e-5, order)),
            (launch(None, None, None, True, 1e-6)[0], ref.rms_norm_math(x, None, 1e-6, order)),
            (h, x + r),
            (y, ref.rms_norm_math(x + r, we, 1e-6, order)),
            (launch(None, None, b, False, 1e-5)[0], ref.layer_norm_math(x, None, be, 1e-5, order)),
        ]

    # Row lengths and parameter shapes: short rows (96; per-head (4, 32)), a masked row of 1000, 2048; row
    # counts that leave a masked tail in 4-row tiles.
    CASES = (((3, 5, 96), (96,)), ((2, 3, 4, 32), (4, 32)), ((5, 1000), (1000,)), ((5, 2048), (2048,)))
    g = torch.Generator().manual_seed(0)
    launches = 0
    for xdt in (torch.float16, torch.float32, torch.bfloat16):
        for wdt in (xdt, torch.float32):
            for order in ("llama", "fp32"):
                for k, (shape, wshape) in enumerate(CASES):
                    offset = float(k % 2)
                    x = (torch.randn(shape, generator=g) * 3).to(xdt)
                    w = (torch.rand(wshape, generator=g) + 0.5 - offset).to(wdt)
                    b = (torch.rand(wshape, generator=g) - 0.5).to(wdt)
                    r = (torch.randn(shape, generator=g) * 3).to(wdt)
                    n_rows = x.numel() // shape[-1]
                    # Every configuration for float16 (the strict check); for the other dtypes (their
                    # casts do not depend on the tiling) the 4-row tiles, the fewest programs to interpret.
                    cfgs = configs(n_rows, shape[-1], x.element_size())
                    cfgs = cfgs if xdt == wdt == torch.float16 else cfgs[1:2]
                    for cfg in cfgs:
                        for i, (out, want) in enumerate(run_case(x, w, b, r, order, offset, cfg)):
                            check(out, want, (xdt, wdt, order, shape, offset, i, cfg))
                        launches += 5
    print("ok", launches)
    """
)


def test_triton_kernel_in_interpreter():
    """The Triton kernel in triton's CPU interpreter against the reference math, in every kind of launch
    configuration (``configs`` above): every rounding and index is checked; float16 strictly."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK, root], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_triton_launch_configuration_choice():
    """``choose_config``: the launch shape per (rows, row length, element size), pinned at the kernel table's
    shapes and decode sizes, and its invariants everywhere (power-of-two tiles covering the row, every row
    covered by the grid, at most ``TILE_BYTES`` per tile unless one row is larger)."""
    tn = pytest.importorskip("normswap.kernels.triton_norm")
    C = tn.Config
    # The table's shapes: about 64 bfloat16 / 32 float32 values per thread, 16 KiB tiles, 4-warp programs.
    assert tn.choose_config(16384, 2048, 2) == C(2048, 4, 4, 4096)
    assert tn.choose_config(16384, 2048, 4) == C(2048, 2, 4, 8192)
    assert tn.choose_config(16384, 4096, 2) == C(4096, 2, 4, 8192)
    assert tn.choose_config(8192, 8192, 2) == C(8192, 1, 4, 8192)
    assert tn.choose_config(8192, 8192, 2, layer=True) == C(8192, 1, 8, 8192)  # 32 values per thread
    assert tn.choose_config(8192, 8192, 4) == C(8192, 1, 8, 8192)
    assert tn.choose_config(1024, 65536, 4) == C(65536, 1, 32, 1024)
    # q/k norms' head dims: many rows per tile.
    assert tn.choose_config(16384 * 32, 128, 2) == C(128, 64, 4, 8192)
    # Decode sizes: one row per program so that every row gets its own multiprocessor; short rows get
    # fewer warps.
    assert tn.choose_config(1, 2048, 2) == C(2048, 1, 4, 1)
    assert tn.choose_config(128, 4096, 2) == C(4096, 1, 4, 128)
    assert tn.choose_config(8, 64, 2) == C(64, 1, 1, 8)
    # Persistent: a grid of sm_count * programs_per_sm, parameters kept in registers.
    assert tn.choose_config(16384, 2048, 2, sm_count=132, programs_per_sm=4) == C(2048, 4, 4, 528, True)
    assert tn.choose_config(100, 2048, 2, sm_count=132, programs_per_sm=4) == C(2048, 1, 4, 100, False)
    for n_rows in (0, 1, 7, 300, 4096, 50000):
        for d in (1, 3, 64, 96, 1000, 2048, 5000, 8192, 65536):
            for itemsize in (2, 4):
                for per_sm in (0, 2):
                    c = tn.choose_config(n_rows, d, itemsize, 132, programs_per_sm=per_sm)
                    assert c.block_d >= d and c.block_d & (c.block_d - 1) == 0
                    assert c.rows >= 1 and c.rows & (c.rows - 1) == 0 and c.warps in (1, 2, 4, 8, 16, 32)
                    assert c.rows * c.block_d * itemsize <= max(tn.TILE_BYTES, c.block_d * itemsize)
                    tiles = -(-n_rows // c.rows)
                    assert 1 <= c.programs <= max(1, tiles) and c.early_params == (c.programs < tiles)
                    if per_sm == 0:
                        assert c.programs * c.rows >= n_rows
    for bad in ((4, 0, 2), (4, 65537, 2), (-1, 64, 2)):
        with pytest.raises(ValueError):
            tn.choose_config(*bad)


def test_triton_kernel_compiles_for_hopper_without_spills():
    """The default configuration compiled for sm_90 (H100/H200) with the ptxas of triton's wheel, no GPU:
    16-byte loads and stores only, no local memory (spills). LayerNorm over 4096 bfloat16 values, two rows
    per program: the kernel variant with the most registers per row of the table's defaults
    (``benchmarks/triton_resources.py`` lists them all)."""
    pytest.importorskip("triton")
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    )
    from triton_resources import resources

    from normswap.kernels import triton_norm as tn

    try:
        r = resources("layer_norm", "bfloat16", 4096, tn.choose_config(16384, 4096, 2))
    except (OSError, RuntimeError, subprocess.CalledProcessError, TypeError, KeyError) as error:
        # no ptxas/cuobjdump in this triton, or another version's compile API (the CI's triton has both)
        pytest.skip(f"cannot compile for sm_90 here: {type(error).__name__}: {error}")
    assert r["local_bytes"] == 0 and r["ldg_narrow"] == 0 and r["stg_narrow"] == 0, r
    assert r["ldg128"] > 0 and r["stg128"] > 0 and r["ldgsts"] == 0, r


def test_torch_backend_uses_fused_layer_norm_exactly():
    """The CPU default for LayerNorm is torch's kernel: identical to F.layer_norm on the same inputs."""
    x, w, b = hidden((8, 64), torch.bfloat16), noise(64, 1.0, dtype=torch.bfloat16), noise(64, 0.0)
    out = layer_norm(x, w, b.bfloat16())
    assert torch.equal(out, F.layer_norm(x, (64,), w, b.bfloat16(), 1e-5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", HF_CASES)
def test_cuda_backends_match_transformers_module(name, dtype):
    """On a GPU: auto (= triton), triton and torch against the HF module run on the same GPU."""
    pytest.importorskip("triton")
    for backend in ("auto", "triton", "torch"):
        hf, fused, x = _pair(name, dtype, backend)
        hf, fused, x = hf.cuda(), fused.cuda(), x.cuda()
        assert_ulp_close(fused(x), hf(x))
    x = hidden((4, 9, 4096), dtype).cuda()
    w = noise(4096, 1.0, dtype=dtype).cuda()
    res = hidden((4, 9, 4096), dtype, seed=5).cuda()
    y, h = add_rms_norm(x, res, w, backend="triton")
    assert torch.equal(h, x + res)
    assert_ulp_close(y, rms_norm(x + res, w, backend="eager"))


# ---------------------------------------------------------------------------------------------------------
# Identity weights: a folded RMSNorm's weight is the identity (1, or 0 with offset 1) by construction; the
# module built with ``identity_weight=True`` holds no weight and runs the weight-free norm (1 * v is exact in
# both cast orders). Every other module multiplies by its weight on every call: nothing is cached.


def _spy(monkeypatch, name="rms_norm_unchecked"):
    """Record the weight argument of every call of ``ops.<name>`` the modules make."""
    from normswap.kernels import ops

    seen = []
    real = getattr(ops, name)

    def spy(x, weight, *args):
        seen.append(weight)
        return real(x, weight, *args)

    monkeypatch.setattr(ops, name, spy)
    return seen


def _identity_for(module: nn.Module) -> FusedRMSNorm:
    """The folded (identity-weight) fused module of a transformers Llama/Gemma norm holding its identity."""
    from normswap.sites import NormSite
    from normswap.swap import fused_module

    gemma = type(module).__name__.startswith("Gemma")
    eps = module.eps if gemma else module.variance_epsilon
    w = module.weight
    order, dtype = "fp32" if gemma else "llama", str(w.dtype).removeprefix("torch.")
    site = NormSite(
        "norm", "rmsnorm", float(gemma), eps, "weight", None, tuple(w.shape), order, dtype, folded=True
    )
    fused = fused_module(site, module)
    assert fused.identity_weight and not list(fused.parameters())
    return fused


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_identity_weight_is_dropped_exactly(monkeypatch, model_type, dtype):
    """A folded norm (Llama's weight 1, Gemma's 0): no weight is passed and the output equals the HF module
    bit for bit, at decode and prefill sizes, in every dtype; its state dict holds the identity under the
    HF module's key, so the HF module loads it."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    d = 256
    hf = (LlamaRMSNorm(d, eps=1e-6) if model_type == "llama" else GemmaRMSNorm(d, eps=1e-6)).to(dtype)
    hf.requires_grad_(False)
    fused = _identity_for(hf)
    seen = _spy(monkeypatch)
    for shape in ((1, 1, d), (2, 70, d)):  # CPU auto: torch below CPU_TORCH_RMS_MAX, eager above
        x = hidden(shape, dtype)
        assert torch.equal(fused(x), hf(x))
    assert seen == [None, None]
    state = fused.state_dict()
    assert list(state) == ["weight"] and torch.equal(state["weight"], hf.weight)
    assert state["weight"].dtype == dtype
    hf.load_state_dict(state)  # the checkpoint's format: the replaced module's key, the identity


def test_weights_are_used_whatever_the_editing_route(monkeypatch):
    """A module with a weight multiplies by it on every call, whatever changed it: ``.data`` edits (no
    version bump), an in-place edit under no_grad, a new tensor, ``load_state_dict``,
    ``vector_to_parameters``, a fused AdamW step (no version bump either) -- each output equals LlamaRMSNorm
    holding the same values. A folded (identity) module given a state dict whose weight is not the identity,
    or assigned a weight, has one from then on."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def agrees(fused, x):
        hf = LlamaRMSNorm(64, eps=1e-6)
        with torch.no_grad():
            hf.weight.copy_(fused.weight)
            return torch.equal(fused(x), hf(x))

    fused = FusedRMSNorm(64, 1e-6)  # weight 1: used all the same
    seen = _spy(monkeypatch)
    x = hidden((3, 64), torch.bfloat16)
    w = noise(64, 1.0)
    with torch.no_grad():
        fused(x)
        fused.weight.data.copy_(w)  # invisible to the version counter
        assert agrees(fused, x)
        fused.weight.mul_(0.5)
        assert agrees(fused, x)
        fused.weight.data = w.clone()
        assert agrees(fused, x)
        fused.load_state_dict({"weight": torch.ones(64)})
        assert agrees(fused, x)
        vector_to_parameters(parameters_to_vector(fused.parameters()) * 3, fused.parameters())
        assert agrees(fused, x)
    assert all(t is fused.weight for t in seen)
    opt = torch.optim.AdamW(fused.parameters(), lr=0.1, fused=True)
    xg = hidden((3, 64), torch.float32)
    fused(xg).square().sum().backward()
    opt.step()
    with torch.no_grad():
        assert agrees(fused, x)

    folded = _identity_for(LlamaRMSNorm(64, eps=1e-6))
    folded.load_state_dict({"weight": torch.ones(64)})
    assert folded.identity_weight  # the identity: stays weight-free
    folded.load_state_dict({"weight": w})
    assert not folded.identity_weight and torch.equal(folded.weight, w)
    with torch.no_grad():
        assert agrees(folded, x)
    other = _identity_for(LlamaRMSNorm(64, eps=1e-6))
    other.weight = nn.Parameter(w.clone())
    assert not other.identity_weight
    with torch.no_grad():
        assert agrees(other, x)
    with pytest.raises(AttributeError, match="add_weight"):
        _identity_for(LlamaRMSNorm(64, eps=1e-6)).weight  # noqa: B018 - loud, never a stale value
    trainable = _identity_for(LlamaRMSNorm(64, eps=1e-6))
    p = trainable.add_weight()
    assert p.requires_grad and list(trainable.parameters()) == [p] and torch.equal(p, torch.ones(64))


def test_identity_mixed_dtypes_and_layer_norm(monkeypatch):
    """Llama order promotes to the weight's dtype also when the weight is the identity and not stored (case
    C3), after ``.to()`` too; LayerNorm (fp32 order with a bias) always passes its parameters."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-6).requires_grad_(False)  # float32 weight 1
    fused = _identity_for(hf)
    x = hidden((2, 5, 64), torch.bfloat16)
    out = fused(x)
    assert out.dtype == torch.float32 and torch.equal(out, hf(x))
    fused.to(torch.bfloat16)
    hf.to(torch.bfloat16)
    assert fused.state_dict()["weight"].dtype == torch.bfloat16
    assert torch.equal(fused(x), hf(x)) and fused(x).dtype == torch.bfloat16

    seen = _spy(monkeypatch, "layer_norm_unchecked")
    ln = FusedLayerNorm(64, 1e-5).requires_grad_(False)  # identity weight, zero bias
    ref_ln = nn.LayerNorm(64, eps=1e-5).requires_grad_(False)
    assert torch.equal(ln(x), ref_ln(x))
    assert seen == [ln.weight]


def test_auto_routing_decisions():
    """``auto``: weight-free RMSNorm -> torch; CPU RMSNorm by size; CUDA decode-sized calls -> torch."""
    from types import SimpleNamespace

    from normswap.kernels.ops import CPU_TORCH_RMS_MAX, CUDA_TORCH_MAX, _pick

    w = torch.ones(64)
    small, large = torch.zeros(2, 64), torch.zeros(CPU_TORCH_RMS_MAX // 64 + 1, 64)
    assert _pick("rms", "auto", large, None) == "torch"
    assert _pick("rms", "auto", small, w) == "torch"
    assert _pick("rms", "auto", large, w) == "eager"
    assert _pick("layer", "auto", large, w, w) == "torch"
    assert _pick("rms", "eager", small, None) == "eager"  # a forced backend is kept
    cuda = SimpleNamespace(is_cuda=True, is_cpu=False, numel=lambda: CUDA_TORCH_MAX)
    assert _pick("rms", "auto", cuda, w) == "torch" and _pick("layer", "auto", cuda, w, w) == "torch"


@pytest.mark.compile
def test_compiled_converted_model_same_tokens(tiny_model):
    """A converted tiny Llama (norm weights re-randomized, then folded: identity weights in the fused norms)
    under ``torch.compile(model, fullgraph=True)``: no graph break and the same greedy tokens as the
    unconverted model compiled the same way. Transformers' compiled static-cache decoding (no recompile per
    call, weighted norms, the custom-op route, Gemma 3) is tests/test_compile.py."""
    from torch._dynamo.utils import counters

    from normswap.convert import convert

    def randomize(model):
        with torch.no_grad():
            for i, (name, p) in enumerate(model.named_parameters()):
                if "norm" in name:
                    p.copy_(noise(p.shape, 1.0, seed=i))
        return model

    original = randomize(tiny_model("llama")).eval()
    converted = randomize(tiny_model("llama")).eval()
    convert(converted)
    assert sum(isinstance(m, FusedRMSNorm) for m in converted.modules()) == 5
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    tokens = {}
    for label, model in (("original", original), ("converted", converted)):
        # Dynamo's own backend keeps the test to graph capture (no inductor codegen on a 2-core CPU).
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with torch.no_grad():
            logits = compiled(ids).logits
        assert not counters["graph_break"], label
        tokens[label] = logits.argmax(-1)
    assert torch.equal(tokens["converted"], tokens["original"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_cuda_triton_configs_and_identity_route(dtype):
    """On a GPU: the triton kernel in every launch configuration (packed short rows, per-head, one row with
    4/8/16 warps) and both cast orders against the eager reference, <= 1 ulp (2 where llama order rounds
    twice) on under 0.1% of the elements; an identity-weight module (torch's F.rms_norm) against the HF
    module, same bound (issue 13). With FMA contraction on, the llama-order LayerNorm differed on 30% of
    the elements (up to 254 ulps where w * n cancels b)."""
    pytest.importorskip("triton")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cases = (((64, 96), (96,)), ((16, 8, 128), (8, 128)), ((512, 1000), (1000,)), ((512, 2048), (2048,)))
    cases += (((4096, 4096), (4096,)), ((300, 8192), (8192,)))
    for shape, wshape in cases:
        x = hidden(shape, dtype).cuda()
        for order, offset in (("llama", 0.0), ("fp32", 1.0)):
            w = (noise(wshape, 1.0 - offset, dtype=dtype)).cuda()
            b = noise(wshape, 0.0, seed=3, dtype=dtype).cuda()
            got = rms_norm(x, w, 1e-6, offset, order, backend="triton")
            # llama order rounds twice: n (1 ulp apart where the float32 reductions differ), then w * n, so
            # such an element can end 2 ulps apart (measured on an H200: 67 of 16.8M at 4096 x 4096).
            ulps = 2 if order == "llama" else 1
            want = rms_norm(x, w, 1e-6, offset, order, backend="eager")
            assert_ulp_close(got, want, max_ulps=ulps, max_frac=0.001)
            got = layer_norm(x, w, b, 1e-5, offset, order, backend="triton")
            want = layer_norm(x, w, b, 1e-5, offset, order, backend="eager")
            # An output near zero is a cancellation of w * n against b: one ulp of w * n (the float32
            # summation order moves n by an ulp of its own) is then many ulps of the output, so the bound
            # is two ulps (n, then w * n in llama order) at the magnitude before the bias, plus the final one.
            diff = (got.double() - want.double()).abs()
            bound = ulp(want) + 2 * ulp((want.double() - b.double()).abs().to(dtype))
            assert (diff <= bound).all(), (shape, order)
            assert (diff > 0).double().mean().item() <= 0.001, (shape, order)
    for rows in (1, 8, 128, 16384):
        x = hidden((rows, 4096), dtype).cuda()
        for hf in (LlamaRMSNorm(4096, eps=1e-6), GemmaRMSNorm(4096, eps=1e-6)):
            hf = hf.to("cuda", dtype).requires_grad_(False)
            fused = _identity_for(hf)
            assert_ulp_close(fused(x), hf(x), max_frac=0.001)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_of_fused_modules():
    """The fused modules inside a captured CUDA graph (how compiled decoding and serving stacks run them):
    capture succeeds (no host synchronization in the call: the identity decision is made before, at the
    warm-up) and the replay equals the eager call bit for bit, for the auto route (torch's kernels at
    decode sizes), the identity weight, and the triton kernel."""
    pytest.importorskip("triton")
    dt = torch.bfloat16
    x = hidden((8, 4096), dt).cuda()
    weighted = FusedRMSNorm(4096, 1e-6, device="cuda", dtype=dt).requires_grad_(False)
    weighted.weight.copy_(noise(4096, 1.0, dtype=dt))
    identity = FusedRMSNorm(4096, 1e-6, device="cuda", dtype=dt).requires_grad_(False)
    gemma = FusedRMSNorm(4096, 1e-6, offset=1.0, cast_order="fp32", device="cuda", dtype=dt, backend="triton")
    gemma.requires_grad_(False).weight.copy_(noise(4096, 0.0, seed=2, dtype=dt))
    ln = FusedLayerNorm(4096, 1e-5, device="cuda", dtype=dt).requires_grad_(False)
    ln.weight.copy_(noise(4096, 1.0, seed=3, dtype=dt))
    ln.bias.copy_(noise(4096, 0.0, seed=4, dtype=dt))
    ln_triton = FusedLayerNorm(4096, 1e-5, device="cuda", dtype=dt, backend="triton").requires_grad_(False)
    ln_triton.load_state_dict(ln.state_dict())
    triton_rms = FusedRMSNorm(4096, 1e-6, device="cuda", dtype=dt, backend="triton").requires_grad_(False)
    triton_rms.load_state_dict(weighted.state_dict())
    for module in (weighted, identity, gemma, ln, ln_triton, triton_rms):
        with torch.no_grad():
            want = module(x)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    module(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = module(x)
            x_before = x.clone()
            x.mul_(2)  # the replay reads the input's memory as it is then
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, module(x)), module
            x.copy_(x_before)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), module

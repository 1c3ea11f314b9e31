"""Converted models under transformers' compiled decoding: one graph, no graph break, no recompile per call.

Production decode runs a static KV cache under ``torch.compile`` (transformers' ``generate`` with
``cache_implementation="static"`` and a compile config; ``benchmarks/gpu_models.py time --compiled`` times
it on a GPU with inductor and CUDA graphs). Here, on the CPU, AOT autograd's eager backend (``aot_eager``)
traces what inductor would receive (dynamo's graph, functionalized, with the custom ops' fake impls) without
generating code, so a graph break (``fullgraph=True`` raises), a recompile on a later call
(``torch.compiler.set_stance("fail_on_recompile")`` raises) or a wrong fake impl fails the test in seconds.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from normswap.convert import convert
from normswap.kernels import FusedLayerNorm, FusedRMSNorm

pytestmark = pytest.mark.compile


def _generate(model, ids, tokens=3):
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=tokens, do_sample=False, cache_implementation="static", pad_token_id=0
        )


def _compiled_decoding(model, backend: str = "eager"):
    from transformers import CompileConfig

    model.generation_config.compile_config = CompileConfig(fullgraph=True, backend=backend, dynamic=False)
    model.generation_config.compile_config._compile_all_devices = True  # compile on the CPU as on CUDA
    return model


@pytest.mark.parametrize(
    "model_type,overrides,backend",
    [
        # Llama with a tied head kept tied (--no-untie): the final norm keeps its weight, the others hold
        # the identity; auto traces the reference math, a forced backend goes through the custom op.
        ("llama", dict(tie_word_embeddings=True), None),
        ("llama", dict(tie_word_embeddings=True), "torch"),
        # Gemma 3: (1 + w) norms in fp32 order, sandwich norms that keep their weights, q/k norms over
        # the head dim, sliding-window layers in the static cache.
        ("gemma3_text", {}, None),
    ],
    ids=["llama-auto", "llama-custom-op", "gemma3-auto"],
)
def test_static_cache_decoding_compiles_once(tiny_model, model_type, overrides, backend):
    """A converted tiny model decodes under transformers' compiled static-cache path with fullgraph=True,
    then decodes again (another prompt of the same length, then the first again) without a single
    recompile, producing the tokens of its own eager decoding and of the unconverted model's."""
    original = tiny_model(model_type, **overrides)
    converted = tiny_model(model_type, **overrides)
    convert(converted, untie=False)
    fused = [m for m in converted.modules() if isinstance(m, (FusedRMSNorm, FusedLayerNorm))]
    kept = [m for m in fused if m.weight_name is not None and not m.identity_weight]  # weights that multiply
    assert kept and any(m.identity_weight for m in fused)  # and folded norms, weight-free
    for m in fused:
        m.backend = backend
    g = torch.Generator().manual_seed(5)
    ids, other = torch.randint(3, 128, (2, 1, 5), generator=g)
    want = [_generate(original, ids), _generate(original, other)]
    assert torch.equal(_generate(converted, ids), want[0])
    _compiled_decoding(converted)
    torch._dynamo.reset()
    counters.clear()
    first = _generate(converted, ids)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    torch.compiler.set_stance("fail_on_recompile")
    try:
        second = _generate(converted, other)
        again = _generate(converted, ids)
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(first, want[0]) and torch.equal(again, want[0]) and torch.equal(second, want[1])

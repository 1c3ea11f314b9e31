"""The walk: leaves the model exactly as it was, costs one forward, follows dataflow through the ops that
real architectures use, and never folds past a consumer it could not see.

Numerical checks compare converted outputs with the unconverted deepcopy; 1e-5 float32 tolerance as in
tests/test_zoo.py (correct folds measure ~1e-7 here, wrong ones >= 4e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normswap
from normswap.walk import walk
from normswap.zoo import Squash, Standardize, randomize_constants, tiny_model

TOL = 1e-5


def _global_hooks() -> int:
    m = nn.modules.module
    return sum(
        len(getattr(m, name))
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
        if hasattr(m, name)
    )


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gpt2", "t5", "custom"])
def test_walk_leaves_the_model_exactly_as_it_was(model_type):
    model = tiny_model(model_type)
    # mixed training flags, to see them restored one by one
    for i, module in enumerate(model.modules()):
        module.training = i % 3 == 0
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    hooks_before = _global_hooks()
    modes_before = torch._C._len_torch_function_stack()
    tie = getattr(getattr(model, "config", None), "tie_word_embeddings", None)

    walk(model)

    assert [m.training for m in model.modules()] == flags
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k, v in state.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    assert {id(p) for p in model.parameters()} == params
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert _global_hooks() == hooks_before
    assert torch._C._len_torch_function_stack() == modes_before
    assert getattr(getattr(model, "config", None), "tie_word_embeddings", None) == tie


def test_walk_costs_one_forward():
    model = tiny_model("qwen3_moe")
    calls = {"model": 0, "layers": 0}

    def count(key):
        def hook(module, args, kwargs):
            calls[key] += 1

        return hook

    handles = [model.register_forward_pre_hook(count("model"), with_kwargs=True)]
    handles += [
        layer.register_forward_pre_hook(count("layers"), with_kwargs=True) for layer in model.model.layers
    ]
    walk(model)
    for h in handles:
        h.remove()
    assert calls == {"model": 1, "layers": len(model.model.layers)}


# -- synthetic modules for one dataflow feature each -----------------------------------------------------


class _Experts(nn.Module):
    """Stacked experts as transformers' batched path runs them: `bmm(weight[ids], x.unsqueeze(-1))`,
    weight on the LEFT, then `.squeeze(-1).add_(bias[ids])`; tokens duplicated by repeat_interleave."""

    def __init__(self, d=16, h=12, n=3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, h, d) * 0.2)
        self.bias = nn.Parameter(torch.randn(n, h) * 0.2)
        self.back = nn.Linear(h, d)

    def forward(self, x):
        ids = torch.arange(x.shape[0] * 2) % self.weight.shape[0]
        rows = x.repeat_interleave(2, dim=0)
        out = torch.zeros_like(rows)  # reads only the shape of a norm output
        y = torch.bmm(self.weight[ids], rows.unsqueeze(-1)).squeeze(-1).add_(self.bias[ids])
        return (out + self.back(torch.relu(y)).type_as(x)).view(x.shape[0], 2, -1).sum(1)


class _Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(128, d)
        self.norm = Standardize(d)
        self.experts = _Experts(d)
        self.norm2 = Squash(d)
        self.head = nn.Linear(d, 128, bias=False)

    def forward(self, input_ids, **_):
        x = self.emb(input_ids).flatten(0, 1)
        x = x + self.experts(self.norm(x))
        return self.head(self.norm2(x))


def test_weight_on_the_left_bias_after_squeeze_and_shape_only_uses():
    torch.manual_seed(0)
    model = _Net().eval()
    randomize_constants(model)
    reference = copy.deepcopy(model)
    report = normswap.convert(model)
    site = report.sites[0]
    assert site.name == "norm" and site.folded, site.reason
    (consumer,) = {(c.param, c.axis, c.bias) for c in site.consumers}
    assert consumer == ("experts.weight", 2, "experts.bias")
    ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (reference(ids) - model(ids)).abs().max().item() <= TOL


# -- MoE experts that receive no token in the trace --------------------------------------------------------


class _Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class HashMoE(nn.Module):
    """Hash-routed MoE (expert = token id % n) with per-expert modules in a ModuleList, so the trace ids
    decide which experts ever run."""

    def __init__(self, widths=(32, 32, 32, 32), d=16):
        super().__init__()
        self.emb = nn.Embedding(128, d)
        self.norm = Standardize(d)
        self.experts = nn.ModuleList(_Expert(d, h) for h in widths)
        self.head = nn.Linear(d, 128, bias=False)

    def forward(self, input_ids, **_):
        x = self.emb(input_ids)
        h = self.norm(x)
        out = torch.zeros_like(x)
        route = input_ids % len(self.experts)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                out[mask] = expert(h[mask])
        return self.head(x + out)


_EVEN_IDS = torch.arange(0, 64, 2).reshape(2, 16)  # routed to experts 0 and 2 only
_ALL_IDS = torch.arange(128).reshape(4, 32)


def _moe(widths):
    torch.manual_seed(0)
    model = HashMoE(widths).eval()
    randomize_constants(model)
    return model, copy.deepcopy(model)


def test_idle_experts_are_replayed_and_folded():
    """Experts 1 and 3 get no token in the trace; they are interchangeable with 0 and 2, so the walk replays
    them on their siblings' inputs, sees them consume the norm, and the fold is exact on ids routed there.
    Removing the replay (walk._Tracer.replay_idle_siblings) leaves the site unfolded and fails here."""
    model, reference = _moe((32, 32, 32, 32))
    report = normswap.convert(model, input_ids=_EVEN_IDS)
    site = report.sites[0]
    assert site.folded, site.reason
    assert {c.module for c in site.consumers} == {f"experts.{i}.up" for i in range(4)}
    assert report.untouched == []
    with torch.no_grad():
        assert (reference(_ALL_IDS) - model(_ALL_IDS)).abs().max().item() <= TOL


def test_idle_experts_that_cannot_be_replayed_block_the_fold():
    """Experts of different widths have no interchangeable sibling: the unseen ones may still read the norm,
    so the norm is swapped only, with the parameter named; the model stays exact on every route."""
    model, reference = _moe((32, 24, 32, 24))
    report = normswap.convert(model, input_ids=_EVEN_IDS)
    site = report.sites[0]
    assert not site.folded and not site.foldable
    assert "experts.1." in site.reason or "experts.3." in site.reason
    assert "experts.1.up.weight" in report.untouched
    with torch.no_grad():
        assert (reference(_ALL_IDS) - model(_ALL_IDS)).abs().max().item() <= TOL


def test_reasons_name_the_blocking_use():
    sites = {s.name: s for s in normswap.inspect(tiny_model("gemma2", tie_word_embeddings=False))}
    assert sites["model.layers.0.post_attention_layernorm"].reason == "output feeds add in model.layers.0"
    t5 = {s.name: s for s in normswap.inspect(tiny_model("t5"))}
    assert t5["encoder.final_layer_norm"].reason == "output is returned as a model output"
    bloom = {s.name: s for s in normswap.inspect(tiny_model("bloom"))}
    assert "transformer.h.0.input_layernorm" in bloom["transformer.word_embeddings_layernorm"].reason


# -- what the trace runs: one head position, the first positions of long ids ---------------------------------


def _walk_record(result) -> tuple:
    uses = {name: sorted(pairs) for name, pairs in result.param_uses.items()}
    return [s.to_dict() for s in result.sites], result.untouched, result.probe_failures, uses


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_moe", "gpt2", "t5", "bert"])
def test_one_head_position_traces_the_same_dataflow(model_type, monkeypatch):
    """The trace maps one position through the head (``logits_to_keep=1`` where the forward names it): the
    walk records exactly what a trace over every position records, use by use."""
    import normswap.walk as walk_module

    model = tiny_model(model_type)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = []
    hook = head.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[-2])) if head else None
    short = _walk_record(walk(model))
    monkeypatch.setattr(walk_module, "trace_example", lambda m, i, *_: walk_module.example_inputs(m, i))
    full = _walk_record(walk(model))
    if hook is not None:
        hook.remove()
    assert short == full
    takes = "logits_to_keep" in walk_module._named_arguments(model)
    assert takes == (model_type not in ("t5", "bert"))  # BertModel: no head; T5: no such argument
    if takes:
        assert rows == [1, 16]  # one position in the trace, all 16 without it


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma3_text"])
def test_first_positions_of_long_ids_trace_the_same_dataflow(model_type):
    """``short_inputs`` (what ``normswap convert`` traces: the first 32 check tokens) finds what 200 do."""
    from normswap.walk import SHORT_POSITIONS, short_inputs

    model = tiny_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(5))
    assert short_inputs(ids).shape == (1, SHORT_POSITIONS) and torch.equal(short_inputs(ids), ids[:, :32])
    assert _walk_record(walk(model, short_inputs(ids))) == _walk_record(walk(model, ids))
    few = ids[:, :7]
    assert short_inputs(few) is few and short_inputs(None) is None

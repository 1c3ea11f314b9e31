"""The walk's forward, recorded (``normswap.recording``): every op a node of tensor versions with its uses,
each norm call one node once the walk has found the norms; checked against the graph of a model written out
by hand here."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from normswap.walk import record_forward, walk


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, h):
        return h + self.proj(self.norm(h))


class _Wrapper(nn.Module):
    """A parameter-free module around a norm: the walk keeps the inner one as the site."""

    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.RMSNorm(width, eps=1e-6)

    def forward(self, x):
        return self.inner(x)


class _Model(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([_Block(width), _Block(width)])
        self.final = _Wrapper(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.final(h))


def _model() -> _Model:
    torch.manual_seed(0)
    model = _Model().eval()
    with torch.no_grad():  # norm parameters not at 1 / 0
        for block in model.blocks:
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.uniform_(-0.5, 0.5)
        model.final.inner.weight.uniform_(0.5, 1.5)
    return model


def test_each_norm_call_is_one_node_and_its_ops_are_not_in_the_graph():
    model = _model()
    ids = torch.randint(0, 11, (2, 5))
    traced = walk(model, ids, record=True)
    names = [s.name for s in traced.sites]
    assert names == ["blocks.0.norm", "blocks.1.norm", "final.inner"]  # the wrapper is not a site
    rec = traced.take_recording()
    assert traced.recording is None and traced.take_recording() is None  # handed over once

    by_order = sorted(rec.nodes.values(), key=lambda n: n.order)
    ops = [(n.op, n.module) for n in by_order]
    # the ops of this forward, by hand: the norms' own (layer_norm, rms_norm) are inside their nodes
    assert ops == [
        ("embedding", "embed"),
        ("norm", "blocks.0.norm"), ("linear", "blocks.0.proj"), ("add", "blocks.0"),
        ("norm", "blocks.1.norm"), ("linear", "blocks.1.proj"), ("add", "blocks.1"),
        ("norm", "final.inner"), ("linear", "head"),
    ]  # fmt: skip
    norms = {n.site: n for n in by_order if n.op == "norm"}
    assert set(norms) == set(names)

    embed = next(n for n in by_order if n.op == "embedding")
    assert norms["blocks.0.norm"].operands == {0: embed.key}  # a norm's operand is its input
    # the embedding's output is read by the first norm, then by the residual add, in that order
    assert [u if isinstance(u, tuple) else u.op for u in rec.uses[embed.key]][0] == ("norm", "blocks.0.norm")
    assert [u.module for u in rec.uses[embed.key][1:]] == ["blocks.0"]
    assert rec.norm_inputs["blocks.0.norm"] == [embed.key]
    # the wrapper returns its inner norm's output: the head reads the norm node's version
    head = next(n for n in by_order if n.module == "head")
    assert head.operands[0] == norms["final.inner"].key
    last_add = rec.nodes[rec.norm_inputs["final.inner"][0]]
    assert (last_add.op, last_add.module) == ("add", "blocks.1")
    assert torch.equal(norms["final.inner"].out, model.final.inner(last_add.out))
    assert rec.uses[head.key] == [("output", None)]  # the logits: a model output
    assert not any(use == ("norm", "final") for uses in rec.uses.values() for use in uses)
    # what each node holds is the value the forward computed (independent: F.layer_norm by hand)
    block = model.blocks[0]
    expected = F.layer_norm(embed.out, (8,), block.norm.weight, block.norm.bias, block.norm.eps)
    assert torch.equal(norms["blocks.0.norm"].out, expected)


def test_a_walk_without_the_recording_records_the_same_graph_on_demand():
    """``record_forward`` (for a walk made without ``record=True``) gives the same ops, modules and order."""
    model = _model()
    ids = torch.randint(0, 11, (2, 5))
    traced = walk(model, ids)
    assert traced.recording is None
    again = record_forward(model, [s.name for s in traced.sites], ids)
    recorded = walk(model, ids, record=True).recording

    def shape(rec):
        nodes = sorted(rec.nodes.values(), key=lambda n: n.order)
        return [(n.op, n.module, n.site, tuple(n.out.shape)) for n in nodes]

    assert shape(again) == shape(recorded)
    assert {k: len(v) for k, v in again.norm_inputs.items()} == {"blocks.0.norm": 1, "blocks.1.norm": 1,
                                                                  "final.inner": 1}  # fmt: skip

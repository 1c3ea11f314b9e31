"""The half-precision check imposes the float32 original's top-k routing on both runs (check.routing).

The model: a tiny Mixtral in bfloat16 whose routers score every expert within about 1% of expert 0 (rows
``w[e] = w[0] + 0.01 n``), so many tokens sit near a tie, with its experts scaled up 20x so that a token
routed to another expert pair changes its output well beyond rounding. Converting it (the norms folded into
the routers and experts) flips the choice of some near-tied tokens: measured, compared as they were, the
converted logits' error against the float32 original (0.38) is far beyond the bfloat16 bound (2 x the
original's own 0.0075 + 0.05), which the test asserts before the check's verdict under imposed choices.
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.check import compare, reference_outputs
from normswap.check.core import _forward
from normswap.check.routing import Choices
from normswap.zoo import tiny_model


def _near_tied_mixtral() -> torch.nn.Module:
    model = tiny_model("mixtral")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            for e in range(1, w.shape[0]):
                w[e] = w[0] + 0.01 * torch.randn(w.shape[1], generator=g)
            for p in layer.mlp.experts.parameters():
                p.mul_(20)
    return model.to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def converted():
    """(original, converted in bfloat16, input ids, reference)."""
    original = _near_tied_mixtral()
    ids = torch.randint(0, original.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(original)
    reference = reference_outputs(model, ids)
    normswap.convert(model)
    return original, model, ids, reference


def test_choices_record_and_impose_indices_with_the_running_scores():
    x = torch.tensor([[3.0, 2.0, 1.99, 0.0], [0.0, 1.0, 5.0, 4.0]])

    def forward(t):
        return torch.topk(t, 2, dim=-1), t.topk(1, dim=0)

    model = torch.nn.Linear(1, 1)
    with Choices(model) as recorded:
        (v, i), (v0, i0) = forward(x)
    assert len(recorded.choices) == 2
    assert recorded.choices[0].indices.tolist() == [[0, 1], [2, 3]]
    assert recorded.choices[0].gaps.tolist() == pytest.approx([0.01, 3.0])  # 2nd minus 3rd score
    y = x.clone()
    y[0, 2] = 2.5  # row 0 now prefers 0, 2; row 1 unchanged
    with Choices(model, replay=recorded.choices) as imposed:
        (v, i), (v0, i0) = forward(y)
    assert i.tolist() == [[0, 1], [2, 3]]  # the recorded choice
    assert v.tolist() == [[3.0, 2.0], [5.0, 4.0]]  # values from the running scores
    assert imposed.run.flipped == 1  # row 0 alone would have chosen (0, 2); topk over dim 0 unchanged
    assert imposed.run.largest_gap == pytest.approx(0.01, abs=1e-6)
    assert imposed.run.mismatch is None


def test_without_imposed_routing_the_converted_model_is_out_of_bounds(converted):
    """The test model does flip tokens: the converted model run as is misses the bfloat16 bound."""
    _, model, ids, reference = converted
    _, alone = _forward(model, ids)
    error = (alone.float() - reference.upcast.float()).abs().max().item()
    bound = 2 * reference.original_error["max_abs"] + 0.05
    assert error > bound


def test_imposed_routing_passes_and_reports_the_flips(converted):
    _, model, ids, reference = converted
    result = compare(reference, model, ids)
    assert result.passed, result.failures
    entry = result.routing
    assert entry["choices"] == 2 and entry["rows"] == 2 * ids.numel()
    assert entry["flipped"]["converted"] >= 1
    assert entry["largest_gap"]["converted"] < 0.01  # near ties: softmax probabilities within 1%
    assert entry["worst"]["rel_error"] <= entry["worst"]["threshold"]
    assert "imposed on both models" in result.summary()


def test_a_changed_router_fails_by_its_scores(converted):
    _, model, ids, reference = converted
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[1].mlp.gate.weight.mul_(1.5)
    result = compare(reference, broken, ids)
    assert not result.passed
    assert any("routing scores of model.layers.1.mlp.gate" in f for f in result.failures), result.failures


def test_other_choices_fail(converted):
    _, model, ids, reference = converted
    broken = copy.deepcopy(model)
    broken.model.layers[0].mlp.gate.top_k = 1
    result = compare(reference, broken, ids)
    assert any("routing differs from the original's" in f for f in result.failures), result.failures


def test_float32_and_dense_models_run_as_they_are():
    """Only half precision imposes choices; a model without top-k records none."""
    mixtral = tiny_model("mixtral").eval()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    assert reference_outputs(mixtral, ids).routing is None
    llama = tiny_model("llama").to(torch.bfloat16).eval()
    reference = reference_outputs(llama, ids)
    assert reference.routing is None
    assert compare(reference, llama, ids).routing is None

"""A site is what the walk measured, never changed; each later verdict and change is a record of its own
(``normswap.sites``): the steps that made them are named, and the report holds the values they leave."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from normswap.convert import convert
from normswap.sites import Action, Consumer, Decision, NormSite


def _site() -> NormSite:
    ops = [Consumer("proj", "proj.weight", "linear", 1)]
    return NormSite("norm", "layernorm", 0.0, 1e-5, "weight", "bias", (8,), "fp32", "float32", ops)


def test_a_site_is_never_changed_only_recorded():
    site = _site()
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.foldable = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.consumers[0].bias = "proj.bias"
    with pytest.raises(TypeError, match="Decision cannot set folded"):
        site.decide("walk", folded=True)  # what was done is an Action, not a Decision
    with pytest.raises(TypeError, match="Action cannot set reason"):
        site.act("fold", reason="x")
    site.decide("walk", foldable=True, reason=None)
    site.decide("fold plan", foldable=False, reason="blocked")
    site.act("centering", kind="rmsnorm")
    assert (site.foldable, site.reason, site.kind) == (False, "blocked", "rmsnorm")
    assert site.records == [
        Decision("walk", (("foldable", True), ("reason", None))),
        Decision("fold plan", (("foldable", False), ("reason", "blocked"))),
        Action("centering", (("kind", "rmsnorm"),)),
    ]
    found = site.as_found()
    assert (found.foldable, found.reason, found.kind, found.records) == (False, None, "layernorm", [])
    assert site.to_dict()["kind"] == "rmsnorm" and site.to_dict()["reason"] == "blocked"
    assert NormSite.from_dict(site.to_dict()) == site  # a report's site reads back as the values left


def _steps(site: NormSite) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(type(r).__name__, r.step, tuple(k for k, _ in r.values)) for r in site.records]


def test_records_name_the_steps_of_a_centered_model(tiny_model, input_ids):
    """GPT-2 made an RMSNorm model: each block norm was decided foldable by the walk, made an RMSNorm by
    centering, folded and swapped; the final norm (``lm_head`` has no bias for its bias) was not foldable
    by the walk's verdict and keeps its bias, as the centering's record says; the walk's fields are as
    found."""
    model = tiny_model("gpt2")
    ids = input_ids
    with torch.no_grad():
        before = model(ids).logits
    report = convert(model, norm="rmsnorm", input_ids=ids)
    sites = {s.name: s for s in report.sites}
    block = sites["transformer.h.0.ln_1"]
    assert _steps(block) == [
        ("Decision", "walk", ("foldable", "reason")),
        ("Action", "centering", ("kind",)),
        ("Action", "fold", ("folded",)),
        ("Action", "swap", ("swapped",)),
    ]
    assert block.as_found().kind == "layernorm" and block.kind == "rmsnorm" and block.folded
    final = sites["transformer.ln_f"]
    assert ("Decision", "walk", ("foldable", "reason")) == _steps(final)[0]
    assert final.records[0].values[0] == ("foldable", False)
    assert not final.folded and final.reason.startswith("bias kept on the RMSNorm")
    assert [s.to_dict() for s in report.sites] == report.to_dict()["sites"]
    with torch.no_grad():  # the records describe a conversion that kept the model's function
        assert (model(ids).logits - before).abs().max().item() < 1e-4


def test_untying_gives_the_folded_consumer_its_own_weight(tiny_model, input_ids):
    """Llama with tied embeddings: the fold plan gives the final norm's consumer ``lm_head`` its own weight,
    as a new consumer in a Decision; the walk's consumer (the shared embedding) is as found."""
    model = tiny_model("llama", tie_word_embeddings=True)
    report = convert(model, input_ids=input_ids)
    final = next(s for s in report.sites if s.name == "model.norm")
    assert final.as_found().consumers[0].param == "model.embed_tokens.weight"
    plan = [r for r in final.records if r.step == "fold plan"]
    assert len(plan) == 1 and dict(plan[0].values)["consumers"][0].param == "lm_head.weight"
    assert final.consumers[0].param == "lm_head.weight"
    assert report.untied == ["lm_head.weight"] and final.folded
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_convert_pretrained_gives_the_sites_with_their_records(tmp_path, tiny_model):
    """The API's result holds the sites as converted, records included; their values are the report's."""
    import normswap

    src = tmp_path / "llama"
    tiny_model("llama").save_pretrained(src)
    result = normswap.convert_pretrained(src, tmp_path / "out", tokens=32)
    assert result.passed and [s.to_dict() for s in result.sites] == result.report["sites"]
    assert len(result.sites) == result.report["norms_found"] > 0
    assert all([r.step for r in s.records] == ["walk", "fold", "swap"] for s in result.sites)

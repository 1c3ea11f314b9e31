"""The converted model's contract beyond logits (../shared/cases/README.md, C31-C37): what users rely on --
hidden states, the base model's output, fine-tuning after load, the probe's measurements, ``inspect``'s
verdicts, localization after centering -- is checked, kept, or stated.

Tolerances: float32 logits and hidden states of tiny models (size ~1) match to about 1e-6 after a correct
fold (1e-5 allows rounding); every fault these cases come from was off by 0.02 or more (C31: 1.57, C32: 0.025,
C33: 0.50, C34: 0.30, C35: 0.187).
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.io import report_dict, save_converted

TOL = 1e-5


def _saved_llama(tmp_path, tiny_model):
    """A tiny untied Llama (norms re-randomized), converted and saved with its manifest; (original, dir)."""
    model = tiny_model("llama", tie_word_embeddings=False)
    original = copy.deepcopy(model)
    report = normswap.convert(model)
    out = save_converted(model, None, report_dict(report), tmp_path / "out")
    return original, out


def _lm_loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# -- C35: training a model loaded with fused norms ---------------------------------------------------------


@pytest.mark.parametrize("trainable", [False, True], ids=["folded", "trainable_norm_weights"])
@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "sgd"])
def test_c35_training_after_load_pretrained(tmp_path, tiny_model, input_ids, optimizer, trainable):
    """After 3 optimizer steps on a model from ``load_pretrained`` (fused AdamW updates in place without
    bumping a version counter), eval logits equal a fresh load given the same state dict, normswap's and
    plain transformers' (the case measured 0.187 off). With ``trainable_norm_weights`` the folded norms'
    weights are parameters, are trained, and the fresh loads follow them."""
    from transformers import AutoModelForCausalLM

    _, out = _saved_llama(tmp_path, tiny_model)
    model = normswap.load_pretrained(out, trainable_norm_weights=trainable)
    norms = [m for m in model.modules() if isinstance(m, normswap.kernels.FusedRMSNorm)]
    assert len(norms) == 5 and all(m.identity_weight != trainable for m in norms)
    with torch.no_grad():
        model(input_ids=input_ids)  # one forward first, as in the case
    params = list(model.parameters())
    make = {
        "adamw-fused": lambda: torch.optim.AdamW(params, lr=0.05, fused=True),
        "adamw-foreach": lambda: torch.optim.AdamW(params, lr=0.05, foreach=True),
        "sgd": lambda: torch.optim.SGD(params, lr=0.5),
    }[optimizer]()
    model.train()
    for _ in range(3):
        make.zero_grad()
        _lm_loss(model, input_ids).backward()
        make.step()
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=input_ids).logits
    state = model.state_dict()
    if trainable:  # the norm weights moved away from the identity
        assert not torch.equal(state["model.norm.weight"], torch.ones(64))
    fresh = normswap.load_pretrained(out)
    fresh.load_state_dict(state)
    plain = AutoModelForCausalLM.from_pretrained(out)
    plain.load_state_dict(state)
    with torch.no_grad():
        for other in (fresh, plain):
            assert (other(input_ids=input_ids).logits - trained).abs().max().item() <= 1e-6

"""The guard against device bugs, without a GPU.

Every step runs on a CPU model with torch's default device set to ``meta``. A tensor the pipeline creates
without naming its device then lands on ``meta``, and the first op that reads its values fails loudly
("Cannot copy out of meta tensor"): the kind of bug that made the probe build CPU inputs for a module on a
GPU (no norm found on CUDA). Tensors made with a device (or ``*_like`` an existing one) are unaffected, so
the converted models must match the unconverted ones as on a plain CPU run (1e-5, float32: correct folds
land at ~1e-6, wrong ones at 4e-3 or more, see test_center). Only public API here, so this file also runs
against older code (it fails on bddc513, before the device work).
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.check import compare, reference_outputs
from normswap.zoo import example_ids, model_outputs, tiny_model

TOL = 1e-5


def _meta_default():
    return torch.device("meta")


@pytest.mark.parametrize(
    "model_type, norm",
    [("llama", "keep"), ("gemma3_text", "keep"), ("gpt2", "rmsnorm"), ("persimmon", "rmsnorm")],
)
def test_pipeline_under_meta_default_device(model_type, norm):
    """inspect, convert (keep and rmsnorm: centering), reference_outputs and compare create no tensor on the
    default device: all pass under ``torch.device("meta")`` and the result equals the original's."""
    overrides = {"qk_layernorm": True} if model_type == "persimmon" else {}
    model = tiny_model(model_type, **overrides)
    original = copy.deepcopy(model)
    ids = example_ids()
    before = model_outputs(original, ids)
    with _meta_default():
        sites = normswap.inspect(model)
        reference = reference_outputs(model, ids, sites=sites)
        report = normswap.convert(model, norm=norm)
        checked = compare(reference, model, ids)
        both = normswap.check(original, model, ids)
    assert report.norms_found == len(sites) > 0 and report.norms_folded > 0
    assert checked.passed and both.passed
    assert (model_outputs(model, ids) - before).abs().max().item() <= TOL


def test_eval_and_check_text_paths_under_meta_default_device(tmp_path):
    """The token ids of the check's text and of eval's windows, and eval's per-window record."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from normswap.check import default_input_ids
    from normswap.evaluate import summarize, text_windows, window_record

    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))  # one id per ASCII char
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?")
    original = tiny_model("llama")
    converted = copy.deepcopy(original)
    normswap.convert(converted)
    with _meta_default():
        ids = default_input_ids(tokenizer, 48)
        windows = text_windows(tokenizer, "abcdefghij" * 10, 40, 16)
        records = torch.cat([window_record(original, converted, w, i) for i, w in enumerate(windows)])
        result = summarize(records)
    assert ids.device.type == "cpu" and ids.shape == (1, 48)
    assert result["max_abs_logit_diff"] <= TOL and result["top1_agreement"] == 1.0


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_probe_under_meta_default_device(model_type):
    """The probe finds every norm with the same semantics as without the guard (on bddc513 it built its
    inputs on the default device and swallowed the failure: every norm "not a norm")."""
    from normswap.probe import probe_module

    model = tiny_model(model_type)
    sites = normswap.inspect(model)
    shape = (2, 16, model.config.hidden_size)
    for site in sites:
        if site.shape != (shape[-1],):
            continue  # q/k norms take per-head inputs
        module = model.get_submodule(site.name)
        with _meta_default():
            guarded = probe_module(module, shape, site.name)
        assert guarded is not None, site.name
        assert (guarded.kind, guarded.offset, guarded.eps, guarded.cast_order) == (
            site.kind, site.offset, site.eps, site.cast_order,
        )  # fmt: skip

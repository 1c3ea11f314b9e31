"""Every zoo row converts exactly: the walker on many architectures, by behaviour and dataflow.

Each row builds a tiny random model (norm weights and biases re-randomized), converts it in place and
compares its outputs with the unconverted deepcopy on ids the conversion did not trace with; another copy is
rotated (``rotate="hadamard"``, with the heads where they rotate) and compared the same way, in memory and
after a plain transformers reload, or refused in one line.

Tolerance 1e-5 (float32, absolute, logits of size ~1): a correct fold changes them by rounding only, measured
at 1e-8 .. 2e-6 here; every wrong fold seen in the field was off by 4e-3 or more (shared/cases/README.md).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import normswap
from normswap.zoo import TOLERANCE, ZOO, example_ids, example_inputs, model_outputs, run_entry, tiny_model

REQUIRED = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "opt", "bloom", "olmo", "olmo2",
    "cohere", "stablelm", "starcoder2", "granite", "deepseek_v3", "gpt_bigcode", "codegen", "smollm3", "glm",
    "exaone4", "t5", "bert", "custom",
}  # fmt: skip

# A reason must say what blocks the fold: name a module of the model, or be one of these facts.
_FACTS = (
    "parameter-free norm: nothing to fold",
    "output is returned as a model output",
    "not reached by the trace",
)


# Rows whose residual stream cannot be rotated, and a part of the one-line reason (everything else rotates).
ROTATION_REFUSED = {
    **dict.fromkeys(["gemma2", "gemma3_text", "olmo2", "exaone4", "glm4", "olmo3"], "(a post-norm)"),
    "bert": "embeddings.LayerNorm adds its output, scaled by its weight, into the stream (a post-norm)",
    **dict.fromkeys(["t5", "switch_transformers"], "encoder.final_layer_norm keeps its weight (output is "),
    "gemma3n_text": "no norm reads a residual stream that starts at an embedding lookup",  # AltUp stacks it
    "mobilebert": "embeddings.LayerNorm adds its output, scaled by its weight, into the stream (a post-norm)",
    # speech and vision encoders: their stream starts at a convolution, not at an embedding lookup
    **dict.fromkeys(
        ["wav2vec2_conformer", "resnet", "swiftformer"],
        "no norm reads a residual stream that starts at an embedding lookup",
    ),
}


def _concrete(reason: str | None, module_names: set[str]) -> bool:
    if not reason:
        return False
    words = {w.strip(".,:;()'") for w in reason.split()}
    return (
        reason in _FACTS
        or bool(words & module_names)
        or any(w.rsplit(".", 1)[0] in module_names for w in words)
    )


def test_zoo_covers_the_required_architectures():
    assert REQUIRED <= {e.model_type for e in ZOO}
    variants = {e.name for e in ZOO}
    assert {"gpt_neox-parallel", "gpt_neox-sequential", "falcon-classic", "falcon-new"} <= variants
    assert {"cohere", "cohere-qknorm"} <= variants
    assert len({e.model_type for e in ZOO}) >= 30


# outputs a user reads besides the logits (the contract's), compared over every position
_HIDDEN = ("hidden_states", "encoder_hidden_states", "decoder_hidden_states", "encoder_last_hidden_state")


def _independent_contract(original, converted, inputs) -> dict[str, tuple[float, float]]:
    """``output_hidden_states`` of both models on ``inputs`` (token ids, or ``ExampleInputs``: a waveform, an
    image), compared here without normswap.check: output name -> (relative error, relative error against
    the original centered over its last axis)."""
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (), {"input_ids": inputs, "use_cache": False}
        if getattr(original.config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = inputs
    else:
        args, kwargs = inputs.args, dict(inputs.kwargs)
    kwargs["output_hidden_states"] = True
    with torch.no_grad():
        a, b = original(*args, **kwargs), converted(*args, **kwargs)
    measured = {}
    for key in _HIDDEN:
        x, y = getattr(a, key, None), getattr(b, key, None)
        pairs = [(key, x, y)] if isinstance(x, torch.Tensor) else [
            (f"{key}[{i}]", u, v) for i, (u, v) in enumerate(zip(x or (), y or (), strict=True))
        ]  # fmt: skip
        for name, u, v in pairs:
            u, v = u.double(), v.double()
            centered = u - u.mean(-1, keepdim=True)
            measured[name] = (
                ((v - u).norm() / u.norm()).item(),
                ((v - centered).norm() / centered.norm()).item(),
            )
    return measured


@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_row(entry):
    result = run_entry(entry, keep=True)
    assert result.error is None, result.error
    assert result.found > 0
    assert result.max_abs_diff <= TOLERANCE, f"{entry.name}: max abs diff {result.max_abs_diff:.3g}"
    assert result.top1 == 1.0
    assert result.swapped == sum(s.swappable for s in result.sites), "every plain norm must be swapped"
    for site in result.sites:
        assert site.swapped == site.swappable  # a norm called with a gate is listed, left in place
        if site.foldable:
            assert site.folded, f"{site.name} is foldable but was not folded"
        else:
            assert not site.folded
            assert _concrete(site.reason, result.module_names), f"{site.name}: vague reason {site.reason!r}"
    assert result.folded == sum(s.folded for s in result.sites)
    rotation = result.rotation
    assert rotation.error is None, rotation.error
    if entry.name in ROTATION_REFUSED:
        assert rotation.refused and ROTATION_REFUSED[entry.name] in rotation.refused, rotation.refused
        assert "\n" not in rotation.refused
    else:
        assert rotation.refused is None, rotation.refused
        assert rotation.max_abs_diff <= TOLERANCE, f"rotated: off by {rotation.max_abs_diff:.3g}"
        if entry.model_type != "custom":  # plain transformers reload of the save_pretrained copy
            assert rotation.reload_diff <= TOLERANCE, f"reloaded: off by {rotation.reload_diff:.3g}"
            # the original's inputs_embeds through the recorded map (every zoo row that rotates takes ids)
            off = rotation.inputs_diff
            assert off <= TOLERANCE, f"inputs_embeds through {rotation.inputs_map}: off by {off:.3g}"
    assert result.passed
    # the contract the report states matches an independent comparison of output_hidden_states
    original, converted = result.models
    if not hasattr(original, "config") or original.config.model_type == "custom":
        return
    stated = {e["output"]: e for e in result.contract}
    measured = _independent_contract(original, converted, example_inputs(original))
    for name, (rel, rel_centered) in measured.items():
        entry_ = stated.get(name)
        if entry_ is None:  # the main output (an encoder's last hidden state): judged by the logits metrics
            assert name == "last_hidden_state" or result.contract[0]["output"] == name, name
            continue
        if entry_["status"] == "same":
            assert rel <= 1e-4, (name, rel)
        elif entry_.get("relation") == "centered":
            assert rel_centered <= 1e-4 < rel, (name, rel, rel_centered)
        else:
            assert entry_["status"] == "changed by design" and rel > 1e-4, (name, entry_, rel)


def test_coverage_table_lists_every_zoo_row():
    """docs/COVERAGE.md comes from `normswap zoo --output docs/COVERAGE.md`; rerun it after adding rows."""
    table = (Path(__file__).parents[1] / "docs" / "COVERAGE.md").read_text()
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert {e.name for e in ZOO} <= rows


def test_custom_model_norms_found_by_behaviour():
    """Hand-written norms named Squash/Standardize, parameters gain/alpha/beta: found, measured, folded."""
    model = tiny_model("custom")
    sites = {s.name: s for s in normswap.inspect(model)}
    assert set(sites) == {"blocks.0.pre", "blocks.0.pre2", "blocks.1.pre", "blocks.1.pre2", "final"}
    pre, pre2, final = sites["blocks.0.pre"], sites["blocks.0.pre2"], sites["final"]
    assert (pre.kind, pre.weight, pre.bias, pre.offset, pre.eps) == ("rmsnorm", "gain", None, 0.0, 1e-6)
    assert (pre2.kind, pre2.weight, pre2.bias, pre2.eps) == ("layernorm", "alpha", "beta", 1e-4)
    assert {c.module for c in pre.consumers} == {"blocks.0.mix"}  # a fused projection, chunked afterwards
    assert {c.module for c in pre2.consumers} == {"blocks.0.up"}
    assert final.foldable and final.consumers[0].bias == "head.bias"


def test_untying_keeps_a_forward_that_reads_the_tie_flag():
    """switch_transformers multiplies the decoder output by d_model**-0.5 only while
    config.tie_word_embeddings is True, so flipping the flag when lm_head is untied would change the forward
    (measured: logits off by ~39). convert must notice on its check forward, undo the untie, and leave the
    final norm unfolded with that reason."""
    model = tiny_model("switch_transformers", tie_word_embeddings=True)
    reference = copy.deepcopy(model)
    ids = example_ids()
    report = normswap.convert(model)
    diff = (model_outputs(reference, ids) - model_outputs(model, ids)).abs().max().item()
    assert diff <= TOLERANCE
    assert report.untied == [] and report.untie_bytes == 0 and model.config.tie_word_embeddings is True
    assert model.lm_head.weight is model.get_input_embeddings().weight
    blocked = [s for s in report.sites if s.reason and "tie_word_embeddings" in s.reason]
    assert blocked and not any(s.folded for s in blocked)


@pytest.mark.parametrize("name", ["falcon-rw", "gpt2", "gpt_oss-batched"])
def test_bias_found_through_separate_add(name):
    """Falcon's `x @ weight.T` then `+ bias`, GPT-2's addmm, and batched experts' `bmm(...).squeeze().add_()`
    give each consumer its bias; for a LayerNorm with a bias this is what makes it foldable."""
    entry = next(e for e in ZOO if e.name == name)
    model = tiny_model(entry.model_type, **entry.overrides)
    consumers = [c for s in normswap.inspect(model) for c in s.consumers if c.module != "lm_head"]
    assert consumers and all(c.bias is not None for c in consumers)


def test_moe_eager_and_batched_experts_have_the_same_consumers():
    """The same Mixtral run through three expert implementations (loop, bmm with the weight on the left,
    grouped_mm on a transposed view) folds into the same stacked parameter along the same axis."""
    found = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        model = tiny_model("mixtral", experts_implementation=impl)
        site = normswap.inspect(model)[1]
        found[impl] = sorted({(c.param, c.axis) for c in site.consumers})
    assert found["eager"] == found["batched_mm"] == found["grouped_mm"]
    assert ("model.layers.0.mlp.experts.gate_up_proj", 2) in found["eager"]


def test_zoo_cli_writes_the_table(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    out = tmp_path / "coverage.md"
    result = CliRunner().invoke(main, ["zoo", "--only", "llama", "--only", "custom", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote {out}: 2 / 2 rows passed"
    text = out.read_text()
    assert "| llama | llama | 5 | 5 rmsnorm | 5 | 5 | < 1e-" in text and "| custom | custom |" in text
    bad = CliRunner().invoke(main, ["zoo", "--only", "nosuch"])
    assert bad.exit_code == 2 and "unknown zoo row" in bad.output


def test_magnitude_bound_keeps_a_factor_two():
    """The table's difference column: a true upper bound with a factor 2 to spare, so it stays the same
    across CPUs whose last digits differ."""
    from normswap.zoo import magnitude_bound

    values = (1.5e-8, 2.4e-7, 4.9e-7, 5.1e-7, 9.5e-7, 1.7e-6, 3e-3)
    assert [magnitude_bound(x) for x in values] == [
        "< 1e-6", "< 1e-6", "< 1e-6", "< 1e-5", "< 1e-5", "< 1e-5", "< 1e-2",
    ]  # fmt: skip
    assert magnitude_bound(0.0) == "0"
    for x in values:
        assert 2 * x <= float(magnitude_bound(x).removeprefix("< "))


def test_tiny_model_randomizes_every_norm():
    model = tiny_model("gemma")
    for site in normswap.inspect(model):
        w = getattr(model.get_submodule(site.name), site.weight)
        identity = 1.0 - site.offset  # 0 for Gemma's (1 + w)
        assert (w - identity).abs().max() <= 0.5 and (w - identity).abs().max() > 0.3
        assert float(w.detach().std()) > 0.1
    assert model.dtype == torch.float32 and not model.training


@pytest.mark.parametrize("name", ["gemma", "qwen3_next", "wav2vec2_conformer", "swiftformer"])
def test_tiny_model_leaves_no_parameter_constant(name):
    """The fixture moves parameters by value, not through normswap's walk: a norm the walk does not list
    (Qwen3-Next's gated ``linear_attn.norm``, whose probe needs its gate; the conformer's GroupNorm over
    time) still carries a non-identity weight, and so do linear biases and layer scales."""
    entry = next(e for e in ZOO if e.name == name)
    model = tiny_model(entry.model_type, **entry.overrides)
    constant = [
        n
        for n, p in model.named_parameters()
        if p.is_floating_point() and p.numel() > 1 and bool((p == p.reshape(-1)[0]).all())
    ]
    assert constant == []
    for n, b in model.named_buffers():  # BatchNorm statistics, by torch's names
        if n.endswith(("running_mean", "running_var")):
            assert b.std() > 0.1, n

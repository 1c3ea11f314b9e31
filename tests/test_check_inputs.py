"""``check`` and ``eval`` on inputs they cannot compare: one line and exit 2 before any forward pass.

Field case C22 (shared/cases/README.md): a tiny GPT-2 with learned positions (n_positions 64), saved and
converted; asking for more positions than its table has is bad input, not an IndexError. Item 1 of issue
15: two models that differ (vocabulary, kind, architecture) are named. The passing runs beside them are
checked against the unconverted model (the check's own tolerance, float32: 2e-4; measured ~1e-7).
"""

from __future__ import annotations

import copy

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model
from test_check import byte_tokenizer
from test_cli import assert_bad_input

from normswap.check import compare, reference_outputs
from normswap.cli import main

ENV = {"HF_HUB_OFFLINE": "1"}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], env=ENV, catch_exceptions=False)


def save(model, path):
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    """A tiny GPT-2 (n_positions 64, vocab 260) saved, and its conversion by ``normswap convert``."""
    root = tmp_path_factory.mktemp("gpt2")
    src = save(make_tiny_model("gpt2", vocab_size=260, n_positions=64), root / "src")
    out = root / "out"
    result = run("convert", src, "--output", out, "--tokens", "32")
    assert result.exit_code == 0, result.output
    return src, out


@pytest.mark.parametrize(
    "args, what",
    [
        (["--tokens", "65"], "--tokens 65 exceeds"),
        (["--tokens", "60", "--greedy", "10"], "--tokens 60 + --greedy 10 exceeds"),
        # without --tokens only what was asked for is named (the default shrank to the 2-token minimum)
        (["--greedy", "63"], "--greedy 63 (plus at least 2 tokens to compare) exceeds"),
    ],
)
def test_check_past_the_position_limit_is_bad_input(gpt2_pair, args, what):
    src, out = gpt2_pair
    assert_bad_input(run("check", src, out, *args), what, "max_position_embeddings (64)")


def test_check_default_fits_the_position_limit(gpt2_pair):
    """Without --tokens the check takes min(512, limit - greedy) tokens and passes."""
    src, out = gpt2_pair
    result = run("check", src, out, "--greedy", "4", "--report", out.parent / "r.json")
    assert result.exit_code == 0, result.output
    assert "64 tokens" not in result.output and "60 tokens" in result.output
    assert "greedy agreement 100.00% of 4 tokens" in result.output


def test_eval_past_the_position_limit_is_bad_input(gpt2_pair, tmp_path):
    src, out = gpt2_pair
    result = run("eval", "--model", src, "--converted", out, "--max-tokens", "200", "--window", "65")
    assert_bad_input(result, "--window 65 exceeds", "max_position_embeddings (64)")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    result = run("eval", "--model", src, "--converted", out, "--text", short)
    assert_bad_input(result, "gives only 3 tokens, fewer than the 2048 asked for", "--max-tokens 3")


def test_eval_default_window_fits_the_position_limit(gpt2_pair):
    src, out = gpt2_pair
    result = run("eval", "--model", src, "--converted", out, "--max-tokens", "200")
    assert result.exit_code == 0, result.output
    assert "200 tokens in 4 windows" in result.output  # 64 + 64 + 64 + 8


def test_check_text_shorter_than_asked_is_bad_input(gpt2_pair, tmp_path):
    src, out = gpt2_pair
    short = tmp_path / "short.txt"
    short.write_text("hello")
    assert_bad_input(run("check", src, out, "--text", short, "--tokens", "32"), "gives only 5 tokens")
    longer = tmp_path / "longer.txt"
    longer.write_text("The quick brown fox jumps over the lazy dog. " * 3)  # 135 byte tokens
    result = run("check", src, out, "--text", longer)  # default: as many as the 64 positions hold
    assert result.exit_code == 0 and "64 tokens" in result.output, result.output


@pytest.mark.parametrize(
    "other, fragments",
    [
        (dict(model_type="llama", vocab_size=300), ["vocab_size 260 vs 300"]),
        (dict(model_type="bert", vocab_size=260), ["causal LM vs encoder", "model_type llama vs bert"]),
        (dict(model_type="gemma", vocab_size=260), ["model_type llama vs gemma"]),
    ],
)
def test_check_on_models_that_differ_names_the_difference(tmp_path, other, fragments):
    a = save(make_tiny_model("llama", vocab_size=260), tmp_path / "a")
    kind = other.pop("model_type")
    b = save(make_tiny_model(kind, **other), tmp_path / "b")
    line = assert_bad_input(run("check", a, b, "--tokens", "32"), f"{a} and {b} are different models")
    for fragment in fragments:
        assert fragment in line


def test_divergence_at_the_first_point_names_no_none():
    """A change before the first probed point (the embeddings) is described as such, not "after None"."""
    original = make_tiny_model("llama", tie_word_embeddings=False)
    changed = copy.deepcopy(original)
    with torch.no_grad():
        changed.model.embed_tokens.weight.mul_(1.5)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    names = [n for n, m in original.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    result = compare(reference_outputs(original, ids, sites=names), changed)
    div = result.divergence
    assert not result.passed and div["last_match"] is None
    assert div["point"] == "model.layers.0.input_layernorm:input"
    assert "None" not in div["description"] and "before the first recorded point" in div["description"]

"""``normswap.convert_pretrained`` does what ``normswap convert`` does: the same tensors written (bit for
bit), the same report and summary lines, the same refusals (as exceptions), a failed check as a result.

The independent reference for the written model is the unconverted one: a fresh load of the output computes
the original's logits within 1e-5 (float32 folds of these tiny models are exact to about 1e-6)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model
from safetensors.torch import load_file

import normswap
from normswap.cli import main
from normswap.config import ConvertOptions, OptionError
from normswap.errors import NormswapError

pipeline = importlib.import_module("normswap.pipeline")
FEW = {"tokens": 32}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out


def _lines(text: str, folder: Path) -> list[str]:
    """Summary lines without the timings and with the output folder named OUT."""
    return [line.replace(str(folder), "OUT") for line in text.splitlines() if not line.startswith("time:")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny Llama, GPT-2 and Qwen3-MoE checkpoints (norm parameters re-randomized), saved once for the
    module."""
    root = tmp_path_factory.mktemp("src")
    out = {}
    for name in ("llama", "gpt2", "qwen3_moe"):
        model = make_tiny_model(name)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


CASES = {  # name -> (model, options)
    "gpt2-rmsnorm": ("gpt2", {"norm": "rmsnorm"}),
    "llama-rotate-streamed": ("llama", {"rotate": "hadamard", "max_memory": "4KB"}),
}
FLAGS = {"norm": "--norm", "rotate": "--rotate", "max_memory": "--max-memory"}


@pytest.mark.parametrize("case", list(CASES))
def test_api_writes_what_the_cli_writes(case, saved, tmp_path):
    name, options = CASES[case]
    src, original = saved[name]
    flags = [str(a) for key, value in options.items() for a in (FLAGS[key], value)]
    cli_out, api_out = tmp_path / "cli", tmp_path / "api"
    ran = CliRunner().invoke(main, ["convert", str(src), "-o", str(cli_out), "--tokens", "32", *flags])
    assert ran.exit_code == 0, ran.output
    result = normswap.convert_pretrained(src, api_out, **FEW, **options)
    assert result.passed and result.saved and result.failure is None and result.exit_code == 0
    a, b = _tensors(cli_out), _tensors(api_out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    manifest = json.loads((api_out / "normswap.json").read_text())
    assert manifest["sites"] == json.loads((cli_out / "normswap.json").read_text())["sites"]
    assert result.report["sites"] == manifest["sites"]
    assert _lines(result.summary, api_out) == _lines(ran.stdout, cli_out)

    # the independent reference: a fresh load computes the original's logits
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(api_out, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (loaded(ids).logits - original(ids).logits).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rotate_heads": True}, "rotate_heads=True and rotate_seed=... need rotate='hadamard'|'random'|"),
        ({"norm": "rmsnorm", "keep_hidden_states": True}, "norm='rmsnorm' centers the residual stream"),
        ({"rotate": "hadamard", "keep_hidden_states": True}, "rotate=... rotates the residual stream"),
        ({"device_map": "auto", "max_memory": "1GB"}, "device_map=... is not available when streaming"),
        ({"norm": "layernorm"}, "norm must be one of 'keep', 'rmsnorm', not 'layernorm'"),
        ({"max_memory": "lots"}, "max_memory 'lots' is not a size"),
        ({"tokens": 1}, "tokens must be an integer of at least 2"),
        ({"untie_lm_head": False}, "unknown option 'untie_lm_head'; the options are"),
    ],
)
def test_options_that_cannot_work_are_refused_before_anything_is_read(options, message, tmp_path):
    with pytest.raises(OptionError) as raised:
        normswap.convert_pretrained(tmp_path / "no-such-model", tmp_path / "out", **options)
    assert str(raised.value).startswith(message) or message in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_the_cli_says_the_same_refusals_in_its_own_words(saved, tmp_path):
    src, _ = saved["llama"]
    ran = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "o"), "--rotate-heads"])
    assert ran.exit_code == 2
    assert "--rotate-heads and --rotate-seed need --rotate hadamard|random|learned" in ran.stderr
    ran = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "o"), "--device-map", "auto",
                                    "--max-memory", "1GB"])  # fmt: skip
    assert ran.exit_code == 2
    assert ran.stderr.strip() == (
        "normswap: error: --device-map is not available when streaming (--max-memory); give --device"
    )


def test_bad_input_is_an_exception_and_touches_nothing(saved, tmp_path):
    src, _ = saved["llama"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(NormswapError, match="notes.txt|not written by normswap|not empty"):
        normswap.convert_pretrained(src, theirs, overwrite=True, **FEW)
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    assert (theirs / "notes.txt").read_text() == "mine"
    with pytest.raises(NormswapError, match="names a file"):
        normswap.convert_pretrained(src, tmp_path / "model.safetensors")
    with pytest.raises(OptionError, match="not both"):
        normswap.convert_pretrained(src, tmp_path / "o", options=ConvertOptions(), norm="rmsnorm")


def test_a_failed_check_is_a_result_and_saves_nothing(saved, tmp_path, monkeypatch):
    src, _ = saved["llama"]
    real = pipeline.compare

    def failing(*args, **kwargs):
        result = real(*args, **kwargs)
        result.passed, result.failures = False, ["forced failure for the test"]
        return result

    monkeypatch.setattr(pipeline, "compare", failing)
    result = normswap.convert_pretrained(src, tmp_path / "out", report=tmp_path / "r.json", **FEW)
    assert not result.passed and not result.saved and result.exit_code == 1
    assert result.failure == "check FAILED; nothing saved"
    assert "forced failure for the test" in result.summary and "saved:" not in result.summary
    assert not (tmp_path / "out").exists()
    assert json.loads((tmp_path / "r.json").read_text())["saved"] is False


def test_convert_pretrained_prints_nothing_and_leaves_the_callers_logging(
    saved, tmp_path, monkeypatch, capfd
):
    """As the CLI, the API hides transformers' progress bars and warnings while it runs (docs/API.md: the
    library prints nothing), and gives the caller's transformers settings back afterwards."""
    from transformers.utils import logging as hf_logging

    src, _ = saved["llama"]
    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    seen = []
    real = pipeline._convert

    def spying(*args, **kwargs):
        seen.append((hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_convert", spying)
    try:
        result = normswap.convert_pretrained(src, tmp_path / "out", **FEW)
        after = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    finally:
        hf_logging.set_verbosity(before[0])
        (hf_logging.enable_progress_bar if before[1] else hf_logging.disable_progress_bar)()
    assert result.passed and seen == [(hf_logging.ERROR, False)]
    assert after == (hf_logging.INFO, True)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == "", captured


def test_norm_rmsnorm_on_a_model_without_layernorm_says_it_changed_nothing(saved, tmp_path):
    """Llama has RMSNorms only: ``--norm rmsnorm`` centers nothing, writes what a plain conversion writes,
    and the summary says so; a centered model (GPT-2) does not get the line."""
    src, _ = saved["llama"]
    plain = normswap.convert_pretrained(src, tmp_path / "plain", **FEW)
    asked = normswap.convert_pretrained(src, tmp_path / "asked", norm="rmsnorm", **FEW)
    line = "center:   none: the model has no LayerNorm (--norm rmsnorm changed nothing)"
    assert asked.passed and line in asked.summary.splitlines() and line not in plain.summary
    a, b = _tensors(tmp_path / "plain"), _tensors(tmp_path / "asked")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    centered = normswap.convert_pretrained(saved["gpt2"][0], tmp_path / "gpt2", norm="rmsnorm", **FEW)
    assert centered.passed and "center:   none" not in centered.summary


STORES = {  # name -> (model, options): each option's path
    "plain": ("llama", {}),
    "moe": ("qwen3_moe", {}),
    "rmsnorm": ("gpt2", {"norm": "rmsnorm"}),
    "rotate-heads": ("llama", {"rotate": "hadamard", "rotate_heads": True}),
    "keep-hidden": ("llama", {"keep_hidden_states": True}),
}
RECORDS = (
    "norm",
    "norms_found",
    "norms_folded",
    "norms_swapped",
    "untied",
    "centering",
    "rotation",
    "source",
)


def _uses(site: dict) -> set[tuple]:
    """What a site's consumers are: the weight and its axis. A streamed stack of experts runs one expert at
    a time, so its walk sees one ``linear`` per expert where the model in memory runs one ``_grouped_mm``;
    the fold is the same (the test compares the tensors)."""
    return {(c["module"], c["param"], c["axis"], c["bias"]) for c in site["consumer_ops"]}


@pytest.mark.parametrize(
    "case",  # plain: tests/test_stream.py compares such tensors in the default run
    [pytest.param(c, marks=pytest.mark.slow) if c == "plain" else c for c in STORES],
)
def test_one_pipeline_over_both_stores(case, saved, tmp_path, monkeypatch):
    """Each option runs the same steps (``pipeline._convert``) over the model in memory and over its shards
    (streamed: ``max_memory`` below the weights); both write the same tensors, bit for bit, with the same
    records and summary lines, and a fresh load of either computes the original's logits within 1e-5."""
    name, options = STORES[case]
    src, original = saved[name]
    stores, real = [], pipeline._convert

    def spy(store, *args, **kwargs):
        stores.append(type(store).__name__)
        return real(store, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_convert", spy)
    memory = normswap.convert_pretrained(src, tmp_path / "memory", **FEW, **options)
    streamed = normswap.convert_pretrained(src, tmp_path / "streamed", max_memory="4KB", **FEW, **options)
    assert stores == ["MemoryStore", "ShardStore"]
    assert memory.passed and streamed.passed
    a, b = _tensors(memory.output), _tensors(streamed.output)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    for key in RECORDS:
        assert memory.report.get(key) == streamed.report.get(key), key
    for a_site, b_site in zip(memory.report["sites"], streamed.report["sites"], strict=True):
        assert {k: v for k, v in a_site.items() if k != "consumer_ops"} == {
            k: v for k, v in b_site.items() if k != "consumer_ops"
        }
        assert _uses(a_site) == _uses(b_site), a_site["name"]
    assert "streamed" in streamed.report and "streamed" not in memory.report
    # the same lines but what a streamed run says of its memory and of its own fresh load, and (experts run
    # one at a time, as linear maps) the rounding the check measures on a mixture of experts
    lines = [_lines(r.summary, r.output) for r in (memory, streamed)]

    def kept(line: str) -> bool:
        return not line.startswith(("memory:", "verified:")) and not (case == "moe" and "diff" in line)

    assert [line for line in lines[0] if kept(line)] == [line for line in lines[1] if kept(line)]
    assert all(any(line.startswith("verified: fresh load as ") for line in r) for r in lines)

    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = original(ids).logits
        for result in (memory, streamed):
            loaded = AutoModelForCausalLM.from_pretrained(result.output, dtype=torch.float32).eval()
            assert (loaded(ids).logits - want).abs().max().item() <= 1e-5

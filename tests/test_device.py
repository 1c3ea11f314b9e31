"""Devices without a GPU: ``--device`` parsing, TF32 settings restored, probe failures surfaced,
accelerate placement (hooks kept by the swap) and offload (field case C8: refused in one line, nothing
changed). The meta-device guard is in test_device_guard.py."""

from __future__ import annotations

import logging

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.check import compare, reference_outputs
from normswap.device import exact_float32, resolve_device
from normswap.errors import NormswapError
from normswap.zoo import example_ids, model_outputs, tiny_model

TOL = 1e-5


def _meta_default():
    return torch.device("meta")


def _gguf(tmp_path):
    pytest.importorskip("gguf")  # not on the GPU machine of benchmarks/gpu_check.sh
    from conftest import write_tiny_gguf

    return write_tiny_gguf(tmp_path / "tiny.gguf")


# -- --device ---------------------------------------------------------------------------------------------


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == resolve_device("auto")
    with pytest.raises(NormswapError, match="unknown device"):
        resolve_device("gpu0")
    with pytest.raises(NormswapError, match="unsupported device"):
        resolve_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(NormswapError, match="sees no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(NormswapError, match=r"no such CUDA device .*cuda:0\.\.1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("command", ["convert", "inspect", "check", "eval", "zoo"])
def test_cli_refuses_a_missing_cuda_device_in_one_line(command, tmp_path, monkeypatch):
    tiny_gguf = _gguf(tmp_path)
    from normswap.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = {
        "convert": ["convert", str(tiny_gguf), "-o", str(tmp_path / "out")],
        "inspect": ["inspect", str(tiny_gguf)],
        "check": ["check", str(tiny_gguf), str(tiny_gguf)],
        "eval": ["eval", "--model", str(tiny_gguf), "--converted", str(tiny_gguf)],
        "zoo": ["zoo", "--only", "llama"],
    }[command]
    result = CliRunner().invoke(main, [*args, "--device", "cuda:1"])
    assert result.exit_code == 2, result.output
    assert "--device cuda:1: this torch sees no CUDA device" in result.output
    assert not (tmp_path / "out").exists()


def test_cli_inspect_and_convert_on_an_explicit_cpu(tmp_path):
    tiny_gguf = _gguf(tmp_path)
    from normswap.cli import main

    result = CliRunner().invoke(main, ["inspect", str(tiny_gguf), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "5 norms, 5 foldable" in result.output
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(tiny_gguf), "-o", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file()


# -- TF32 -------------------------------------------------------------------------------------------------


def test_exact_float32_sets_and_restores_the_legacy_flags():
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
    try:
        matmul.allow_tf32, cudnn.allow_tf32 = True, True
        torch.set_float32_matmul_precision("medium")
        with exact_float32():
            assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
            assert torch.get_float32_matmul_precision() == "highest"
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
        assert torch.get_float32_matmul_precision() == "medium"
        with pytest.raises(RuntimeError, match="inside"), exact_float32():  # restored on errors too
            raise RuntimeError("inside")
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9")
def test_exact_float32_with_the_fp32_precision_api():
    """A caller that set TF32 through torch's newer ``fp32_precision`` attributes gets them back."""
    targets = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
    saved = [t.fp32_precision for t in targets]
    try:
        for t in targets:
            t.fp32_precision = "tf32"
        with exact_float32():
            assert [t.fp32_precision for t in targets] == ["ieee", "ieee"]
        assert [t.fp32_precision for t in targets] == ["tf32", "tf32"]
    finally:
        for t, value in zip(targets, saved, strict=True):
            t.fp32_precision = value


def test_measuring_runs_with_tf32_off(monkeypatch):
    """walk, reference_outputs and compare run inside ``exact_float32`` (seen from a model's forward)."""
    seen = []
    model = tiny_model("llama")
    model.register_forward_pre_hook(lambda *_: seen.append(torch.get_float32_matmul_precision()))
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        ids = example_ids()
        reference = reference_outputs(model, ids)
        normswap.convert(model)
        compare(reference, model, ids)
    finally:
        torch.set_float32_matmul_precision(saved)
    assert seen and set(seen) == {"highest"}


# -- probe failures ---------------------------------------------------------------------------------------


class Float32OnlyRMSNorm(nn.Module):
    """An RMSNorm whose forward accepts float32 only (as a custom kernel would)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(1 + torch.rand(width) - 0.5)

    def forward(self, x):
        if x.dtype != torch.float32:
            raise TypeError(f"float32 only, got {x.dtype}")
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_a_probe_that_raises_is_reported_not_dropped(caplog):
    from normswap.walk import walk

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.input_layernorm = Float32OnlyRMSNorm(model.config.hidden_size)
    with caplog.at_level(logging.WARNING, logger="normswap"):
        traced = walk(model)
    failed = {f"model.layers.{i}.input_layernorm" for i in range(len(model.model.layers))}
    assert set(traced.probe_failures) == failed
    assert all("float32 only" in e for e in traced.probe_failures.values())
    assert {s.name for s in traced.sites}.isdisjoint(failed) and traced.sites  # the others still found
    assert all(name in caplog.text for name in failed)


def test_no_norm_message_counts_the_failed_probes():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.norm = Float32OnlyRMSNorm(8)
            self.head = nn.Linear(8, 16)

        def forward(self, input_ids):
            return self.head(self.norm(self.embed(input_ids)))

    with pytest.raises(NormswapError, match=r"no normalization module found \(1 candidate failed to probe; "
                       r"norm: TypeError: float32 only"):  # fmt: skip
        normswap.convert(Tiny(), input_ids=torch.randint(0, 16, (2, 5)))


# -- accelerate placement and offload -----------------------------------------------------------------------


def _placement(model: nn.Module) -> dict[str, str]:
    names = ["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"]
    names += [f"model.layers.{i}" for i in range(len(model.model.layers))]
    return dict.fromkeys(names, "cpu")


def test_dispatched_model_keeps_its_hooks():
    """A model placed by accelerate (hooks on every block, as device_map spreads one over GPUs) converts,
    and the swapped final norm keeps its AlignDevicesHook."""
    from accelerate import dispatch_model

    model = tiny_model("llama", tie_word_embeddings=False)
    ids = example_ids()
    before = model_outputs(model, ids)
    dispatch_model(model, device_map=_placement(model), force_hooks=True)
    assert hasattr(model.model.norm, "_hf_hook")
    report = normswap.convert(model)
    assert report.norms_folded == report.norms_swapped == 5
    assert type(model.model.norm).__name__ == "FusedRMSNorm" and hasattr(model.model.norm, "_hf_hook")
    assert (model_outputs(model, ids) - before).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["a", "b"])
def test_offloaded_model_is_refused_in_one_line(case, tmp_path):
    """Field case C8: (a) layer 1, the final norm and lm_head on disk; (b) only layer 0's MLP and lm_head.
    Right outcome here: one clear refusal naming the offloaded module, nothing changed (never a silent
    undercount: the walk found 2 of 5 norms in (a) and left 2 unfolded with a wrong reason in (b))."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama", tie_word_embeddings=False).save_pretrained(tmp_path / "model")
    placement = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu"}
    if case == "a":
        placement |= {"model.layers.1": "disk", "model.norm": "disk", "lm_head": "disk"}
        first = "model.layers.1.self_attn.q_proj"
    else:
        placement = {k: v for k, v in placement.items() if k != "model.layers.0"}
        placement |= {f"model.layers.0.{m}": "cpu" for m in ("self_attn", "input_layernorm",
                                                               "post_attention_layernorm")}  # fmt: skip
        placement |= {
            "model.layers.0.mlp": "disk",
            "model.layers.1": "cpu",
            "model.norm": "cpu",
            "lm_head": "disk",
        }
        first = "model.layers.0.mlp.gate_proj"
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=placement, offload_folder=tmp_path / "offload", dtype=torch.float32
    )
    ids = example_ids()
    before = model_outputs(model, ids)
    for call in (normswap.inspect, normswap.convert):
        with pytest.raises(NormswapError) as error:
            call(model)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{first}: parameters offloaded by accelerate")
    assert torch.equal(model_outputs(model, ids), before)
    assert not any(type(m).__name__.startswith("Fused") for m in model.modules())


# -- on a GPU (benchmarks/gpu_check.sh runs these on the H200) ----------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize(
    "model_type, norm", [("llama", "keep"), ("gemma3_text", "keep"), ("gpt2", "rmsnorm")]
)
def test_cuda_convert_matches_the_cpu_run(model_type, norm):
    """Same sites as on the CPU, and the converted model on the GPU within 1e-5 of the original on the CPU
    (float32, TF32 off)."""
    model = tiny_model(model_type)
    ids = example_ids()
    before = model_outputs(model, ids)
    cpu_sites = [s.to_dict() for s in normswap.inspect(model)]
    model.cuda()
    assert [s.to_dict() for s in normswap.inspect(model)] == cpu_sites
    with exact_float32():
        report = normswap.convert(model, norm=norm)
        after = model_outputs(model, ids.cuda()).cpu()
    assert report.norms_found == report.norms_swapped > 0
    assert (after - before).abs().max().item() <= TOL


@cuda
def test_cuda_bfloat16_model_finds_every_norm():
    """The first GPU run's fault: a bfloat16 Llama on CUDA gave "no normalization module found"."""
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    report = normswap.convert(model)
    assert report.norms_found == report.norms_folded == 5


@cuda
def test_cuda_dispatched_model_keeps_its_hooks():
    from accelerate import dispatch_model

    model = tiny_model("llama", tie_word_embeddings=False)
    ids = example_ids()
    before = model_outputs(model, ids)
    placement = _placement(model) | {"model.layers.0": 0, "model.norm": 0, "lm_head": 0}
    dispatch_model(model, device_map=placement, main_device="cpu", force_hooks=True)
    with exact_float32():
        report = normswap.convert(model)
        after = model_outputs(model, ids)
    assert report.norms_folded == 5 and model.lm_head.weight.device.type == "cuda"
    assert (after.cpu() - before).abs().max().item() <= TOL

"""Streamed conversion of mixture-of-experts checkpoints stored one tensor per expert.

transformers 5 saves Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 with one tensor per expert
(``...experts.3.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.3.w1.weight``) and stacks them into
one parameter as it loads (``experts.gate_up_proj``). Each model is saved by transformers in small shards
and converted twice through the CLI, in memory and streamed (``--max-memory 4KB``, below any shard); the
references are independent of the streamed path:

* the in-memory output (itself checked against the original by the CLI's logits check): the streamed output
  holds the same tensors, bit for bit, with the same sites (each norm's consumers as the parameters and axes
  they read: the streamed experts forward is transformers' eager one, one ``linear`` per expert, where the
  in-memory one may be ``grouped_mm``);
* the input: the streamed output has exactly its tensor names, each in the shard file it came from;
* the original model: a fresh plain ``transformers`` load of the streamed output gives its logits within
  1e-5 (float32; the fold rounds each weight once, about 1e-7 relative, and a rotation's float32 forward
  differs by a few float32 ulps of the logits: measured below 1e-6 on these models).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from test_stream import (
    _one_error_line,
    assert_same_checkpoint,
    convert_both,
    run,
    save_sharded,
    tokenizer,  # noqa: F401 - the module fixture
)

from normswap.io.shards import INDEX, CheckpointReader

_SLOW = pytest.mark.slow
# (model type, extra options): Mixtral (renamed block_sparse_moe, w1/w3/w2) plain, Qwen3-MoE rotated in the
# default run; the other layouts, the other option and bfloat16 marked slow.
ROWS = [("mixtral", ()), ("qwen3_moe", ("--rotate", "hadamard")), ("qwen3_next", ())] + [
    pytest.param(name, extra, marks=_SLOW)
    for name, extra in (
        ("qwen3_moe", ()),
        ("olmoe", ()),
        ("qwen2_moe", ()),
        ("deepseek_v3", ()),
        ("mixtral", ("--rotate", "hadamard")),
        ("qwen3_next", ("--rotate", "hadamard")),
    )
]


def _consumer(record: dict) -> tuple:
    """What a consumer record says the fold does: which parameter, along which axis, with which bias."""
    return record["module"], record["param"], record["axis"], record["bias"]


def _placement(folder) -> dict[str, str]:
    reader = CheckpointReader(folder)
    return {name: info.file for name, info in reader.tensors.items()}


@pytest.mark.parametrize(("name", "extra"), ROWS)
def test_moe_streams_in_its_own_layout(name, extra, tokenizer, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(name)
    src = save_sharded(model, tokenizer, tmp_path / "src", "100KB")  # fewer files: each costs a gc pass
    placement = _placement(src)
    assert any(".experts.1." in n for n in placement)  # stored per expert
    assert not any(n.endswith("experts.gate_up_proj") for n in placement)
    assert len(set(placement.values())) > 2
    layers: dict[str, set[str]] = {}  # a layer's experts -> the files holding them
    for n, file in placement.items():
        if ".experts." in n:
            layers.setdefault(n.split(".experts.")[0], set()).add(file)
    assert any(len(files) > 1 for files in layers.values())  # some parameter is assembled across shards
    memory, streamed = convert_both(src, tmp_path, *extra)
    assert_same_checkpoint(memory, streamed, consumers=_consumer)
    assert _placement(streamed) == placement  # the input's names, each in its own shard
    index = json.loads((streamed / INDEX).read_text())
    assert set(index["weight_map"]) == set(placement)
    report = json.loads((streamed / "normswap.json").read_text())
    peak = report["streamed"]["peak_weight_bytes"]
    stacks = [p.nbytes for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3]
    # a rotated stack of experts is made whole as it is written: the peak (the summary's memory: line) says so
    assert peak >= (max(stacks) if extra else 1), (peak, stacks)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    fresh = AutoModelForCausalLM.from_pretrained(streamed, dtype=torch.float32).eval()
    with torch.no_grad():
        before, after = model(ids).logits, fresh(ids).logits
    assert (before - after).abs().max().item() <= 1e-5


def test_weight_read_outside_its_module_is_read_on_demand(tokenizer, tmp_path):  # noqa: F811
    """Qwen3-Next's linear attention passes ``conv1d.weight`` to its convolution function without calling
    the ``Conv1d``: the streamed forward reads it as it is used and releases it when the reading module
    returns; the logits equal the in-memory model's, bit for bit (same weights, same ops)."""
    from normswap.stream.model import build, is_released

    model = make_tiny_model("qwen3_next")
    src = save_sharded(model, tokenizer, tmp_path / "src")
    streamed = build(model.config, CheckpointReader(src), torch.float32)
    conv = [m for n, m in streamed.model.named_modules() if n.endswith("linear_attn.conv1d")]
    assert conv and all(is_released(m.weight) for m in conv)
    released = [p for p in streamed.model.parameters() if is_released(p)]
    fetched = []
    fetch = streamed.fetch
    streamed.fetch = lambda p: (fetched.append(p), fetch(p))
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = streamed.model(ids).logits
        assert torch.equal(logits, model(ids).logits)
    assert {id(p) for p in fetched} == {id(m.weight) for m in conv}  # only what no module hook read
    assert all(is_released(p) for p in released)
    resident = sum(t.nbytes for t in [*streamed.model.parameters(), *streamed.model.buffers()]
                   if not is_released(t))  # fmt: skip
    assert streamed.held == resident and streamed.running == [] and streamed.loose == []
    assert streamed.peak >= resident + conv[0].weight.nbytes


def test_experts_are_read_one_at_a_time(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """A streamed conversion never assembles a whole stack of experts (``Group.assemble`` on real tensors):
    the forwards take one expert's rows (the eager experts forward), the fold plan's overflow test and the
    write read them row by row; the output equals the in-memory one, bit for bit."""
    from normswap.stream import model as stream_model
    from normswap.stream.assemble import Group

    whole = []
    assemble = Group.assemble

    def watched(self, read):
        def spy(key):
            t = read(key)
            if t.device.type != "meta" and t.dtype != torch.float64:  # not the checks of meta/probe tensors
                whole.append(key)
            return t

        return assemble(self, spy)

    monkeypatch.setattr(Group, "assemble", watched)
    by_rows = stream_model._by_rows

    def rows_of_all(reader, key, *args):
        whole.append(key)
        return by_rows(reader, key, *args)

    monkeypatch.setattr(stream_model, "_by_rows", rows_of_all)  # a whole parameter made row by row
    src = save_sharded(make_tiny_model("mixtral"), tokenizer, tmp_path / "src", "100KB")
    memory, streamed = convert_both(src, tmp_path)
    assert whole == []
    assert_same_checkpoint(memory, streamed, consumers=_consumer)
    report = json.loads((streamed / "normswap.json").read_text())
    config = json.loads((src / "config.json").read_text())
    stack = config["num_local_experts"] * 2 * config["intermediate_size"] * config["hidden_size"] * 4
    assert 0 < report["streamed"]["peak_weight_bytes"] < stack  # never a whole gate_up_proj


def test_rows_the_walk_keeps_hold_no_bytes(tokenizer, tmp_path):  # noqa: F811
    """The walk keeps every tensor derived from a parameter it follows (an expert's row) until it ends; a
    row read during a forward has its storage freed when the module that read it returns, so the walk's
    sites are the in-memory eager walk's and no row's bytes outlive its experts module."""
    from normswap.stream.model import build
    from normswap.walk import walk

    model = make_tiny_model("mixtral")
    src = save_sharded(model, tokenizer, tmp_path / "src")
    streamed = build(model.config, CheckpointReader(src), torch.float32)
    rows = []
    row = streamed.row
    streamed.row = lambda p, i: rows.append(row(p, i)) or rows[-1]
    traced = walk(streamed.model)
    assert rows and all(t.untyped_storage().nbytes() == 0 for t in rows)
    model.set_experts_implementation("eager")
    assert [s.to_dict() for s in traced.sites] == [s.to_dict() for s in walk(model).sites]


@_SLOW
@pytest.mark.parametrize(
    ("name", "extra"),
    [("qwen3_moe", ()), ("qwen3_moe", ("--rotate", "hadamard")), ("qwen3_next", ("--rotate", "hadamard"))],
    ids=["plain", "rotated", "qwen3_next-rotated"],
)
def test_moe_bfloat16_streams(name, extra, tokenizer, tmp_path):  # noqa: F811
    src = save_sharded(make_tiny_model(name).to(torch.bfloat16), tokenizer, tmp_path / "src")
    memory, streamed = convert_both(src, tmp_path, "--dtype", "bfloat16", *extra)
    assert_same_checkpoint(memory, streamed, consumers=_consumer)
    assert _placement(streamed) == _placement(src)


def test_missing_expert_is_refused(tokenizer, tmp_path):  # noqa: F811
    """A checkpoint whose expert tensors do not assemble into the model's parameter: one line, nothing
    written."""
    src = save_sharded(make_tiny_model("qwen3_moe"), tokenizer, tmp_path / "src", "1GB")
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", "64", "--max-memory", "4KB")
    _one_error_line(r, "model.layers.1.mlp.experts.gate_up_proj", "do not fit the model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.fixture(scope="module")
def llama_src(tokenizer, tmp_path_factory):  # noqa: F811
    return save_sharded(make_tiny_model("llama"), tokenizer, tmp_path_factory.mktemp("quantized") / "src")


def _fp8_config(src):
    config = json.loads((src / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    config["quantization_config"] = fp8  # as DeepSeek-V3's release
    (src / "config.json").write_text(json.dumps(config))
    return "fp8 with 128x128 block scales", "FineGrainedFP8Config(dequantize=True)"


def _compressed_config(src):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (src / "config.json").write_text(json.dumps(config))
    return "compressed-tensors (pack-quantized)", "CompressedTensorsConfig(run_compressed=False)"


def _scale_tensors(src):
    """No quantization_config (a config edited by hand), but fp8 block scales beside the weights."""
    from safetensors.torch import save_file

    index = json.loads((src / INDEX).read_text())
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    save_file({name: torch.ones(1, 1)}, src / "scales.safetensors", metadata={"format": "pt"})
    index["weight_map"][name] = "scales.safetensors"
    (src / INDEX).write_text(json.dumps(index))
    return "fp8 with block scales (weight_scale_inv tensors)", "FineGrainedFP8Config(dequantize=True)"


@pytest.mark.parametrize("stored", [_fp8_config, _compressed_config, _scale_tensors])
@pytest.mark.parametrize("options", [(), ("--max-memory", "4KB")], ids=["memory", "streamed"])
def test_quantized_checkpoint_is_refused(stored, options, llama_src, tmp_path):
    """A checkpoint stored quantized: one line naming the format and the fix, exit 2, nothing written, the
    input untouched; in memory and streamed."""
    import shutil

    src = shutil.copytree(llama_src, tmp_path / "src")
    fmt, how = stored(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", "64", *options)
    _one_error_line(r, f"stored quantized ({fmt})", "convert a bfloat16 copy", how)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


@_SLOW
def test_moe_two_processes_write_the_same_bytes(tokenizer, tmp_path):  # noqa: F811
    """``accelerate launch --multi_gpu --num_processes 2`` on the CPU (gloo): each process writes its shards
    (an expert group split over shards of both processes is assembled by each), byte-identical to one."""
    import subprocess
    import sys
    from pathlib import Path

    from test_stream import assert_verified

    src = save_sharded(make_tiny_model("mixtral"), tokenizer, tmp_path / "src")
    one, two = tmp_path / "one", tmp_path / "two"
    assert run("convert", src, "--output", one, "--tokens", "64", "--max-memory", "4KB").exit_code == 0
    root = Path(__file__).resolve().parent.parent
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "29533"]  # fmt: skip
    args = ["convert", str(src), "--output", str(two), "--tokens", "64", "--max-memory", "4KB"]
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "normswap", *args]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in one.glob("*.safetensors"))
    assert files == sorted(p.name for p in two.glob("*.safetensors")) and len(files) > 2
    for name in [*files, INDEX]:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert json.loads((two / "normswap.json").read_text())["streamed"]["processes"] == 2
    assert_verified(two, done.stdout)

"""Streamed conversion (``convert --max-memory``): the same checkpoint as the in-memory path, bit for bit.

Each model is saved as a sharded safetensors directory (shards of a few KB, so every model spans several
files) with a byte-level tokenizer, then converted twice through the CLI: in memory, and streamed with a
budget smaller than any shard. The reference is the in-memory output, itself checked against the original
by the CLI's own logits check; the streamed output must hold the same tensor names with bit-identical values
(``torch.equal`` on the raw bytes), and the same sites in its report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model, write_tiny_gguf
from safetensors import safe_open

from normswap.cli import main
from normswap.io import plain_float_checkpoint
from normswap.stream import convert as stream_convert
from normswap.stream.model import build, is_released
from normswap.stream.records import DiskRecords
from normswap.stream.shards import INDEX, CheckpointReader, ShardWriter

TOKENS = "64"


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def save_sharded(model, tokenizer, folder: Path, shard: str = "24KB") -> Path:
    with plain_float_checkpoint(model):
        model.save_pretrained(folder, max_shard_size=shard)
    tokenizer.save_pretrained(folder)
    return folder


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.read(name) for name in reader.tensors}


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
    sites_a = json.loads((a / "normswap.json").read_text())["sites"]
    sites_b = json.loads((b / "normswap.json").read_text())["sites"]
    assert sites_a == sites_b


def convert_both(src: Path, tmp_path: Path, *extra) -> tuple[Path, Path]:
    memory, streamed = tmp_path / "memory", tmp_path / "streamed"
    r = run("convert", src, "--output", memory, "--tokens", TOKENS, *extra)
    assert r.exit_code == 0, r.output
    r = run("convert", src, "--output", streamed, "--tokens", TOKENS, "--max-memory", "4KB", *extra)
    assert r.exit_code == 0, r.output
    assert_verified(streamed, r.output)
    return memory, streamed


def assert_verified(folder: Path, output: str) -> dict:
    """The streamed output was verified by a fresh load: every tensor written, the checked logits."""
    verify = json.loads((folder / "normswap.json").read_text())["verify"]
    assert verify["passed"] and verify["failures"] == [], verify
    assert verify["tensors"] == len(CheckpointReader(folder).tensors)
    assert verify["tokens"] == 16 and verify["max_abs_diff"] == 0.0
    assert verify["architecture"] == verify["expected_architecture"]
    assert "verified: fresh load as " in output and "streamed fresh load" in output
    return verify


# Four rows cover the kinds (tied lm_head, (1+w) sandwich norms, Conv1D, matmul on a derived weight) in
# every run; the other five are marked ``slow`` (deselected by default: `python -m pytest -m slow`).
_SLOW = pytest.mark.slow
STREAM_ROWS = ["llama-tied", "gemma2", "gpt2", "falcon-new"] + [
    pytest.param(name, marks=_SLOW) for name in ("llama", "gemma-tied", "qwen3", "phi3", "olmo2")
]


@pytest.mark.parametrize("name", STREAM_ROWS)
def test_streamed_equals_in_memory(name, tokenizer, tmp_path):
    """Tied (untied into lm_head), (1+w) and sandwich norms, Conv1D, MoE experts: bit-identical shards."""
    from normswap.zoo import ZOO

    entry = next(e for e in ZOO if e.name == name)
    model = make_tiny_model(entry.model_type, **entry.overrides)
    src = save_sharded(model, tokenizer, tmp_path / "src")
    assert len(CheckpointReader(src).files) > 2
    memory, streamed = convert_both(src, tmp_path)
    assert_same_checkpoint(memory, streamed)
    index = json.loads((streamed / INDEX).read_text())
    reader = CheckpointReader(streamed)  # the index names every tensor's real file (checked by the reader)
    assert set(index["weight_map"]) == set(reader.tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in reader.tensors.values())
    assert reader.files == CheckpointReader(src).files  # the input's shard layout


def test_renamed_checkpoint_is_refused(tokenizer, tmp_path):
    """transformers 5 stacks Mixtral's per-expert tensors as it loads them: refused in one line."""
    src = save_sharded(make_tiny_model("mixtral"), tokenizer, tmp_path / "src")
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    _one_error_line(r, "the checkpoint has no tensor model.layers.0.mlp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_tied_embedding_untied_in_its_own_tensor(tokenizer, tmp_path):
    model = make_tiny_model("llama", tie_word_embeddings=True)
    src = save_sharded(model, tokenizer, tmp_path / "src")
    assert "lm_head.weight" not in CheckpointReader(src).tensors
    _, streamed = convert_both(src, tmp_path)
    out = tensors(streamed)
    original = model.model.embed_tokens.weight.detach()
    assert torch.equal(out["model.embed_tokens.weight"], original)  # the embedding is untouched
    assert not torch.equal(out["lm_head.weight"], original)  # the final norm folded into the copy
    assert json.loads((streamed / "config.json").read_text())["tie_word_embeddings"] is False


def test_no_untie_keeps_the_tie(tokenizer, tmp_path):
    model = make_tiny_model("llama", tie_word_embeddings=True)
    src = save_sharded(model, tokenizer, tmp_path / "src")
    memory, streamed = convert_both(src, tmp_path, "--no-untie")
    assert_same_checkpoint(memory, streamed)
    assert "lm_head.weight" not in CheckpointReader(streamed).tensors


def test_bfloat16_streamed_equals_in_memory(tokenizer, tmp_path):
    """The half-precision check upcasts the reference without reading the released weights."""
    src = save_sharded(make_tiny_model("llama").to(torch.bfloat16), tokenizer, tmp_path / "src")
    memory, streamed = convert_both(src, tmp_path, "--dtype", "bfloat16")
    assert_same_checkpoint(memory, streamed)


def test_walk_of_streamed_model_releases_weights(tokenizer, tmp_path):
    """After the walk every weight of more than one dimension is back on disk (no bytes held)."""
    from normswap.walk import walk

    model = make_tiny_model("llama")
    src = save_sharded(model, tokenizer, tmp_path / "src")
    streamed = build(model.config, CheckpointReader(src), torch.float32)
    sites = walk(streamed.model).sites
    assert [s.to_dict() for s in sites] == [s.to_dict() for s in walk(model).sites]
    big = [p for p in streamed.model.parameters() if p.ndim > 1]
    assert big and all(is_released(p) for p in big)


def test_model_that_fits_runs_in_memory(tokenizer, tmp_path):
    """In memory, save_pretrained writes shards no larger than the input's largest one."""
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "1GiB")
    assert r.exit_code == 0, r.output
    assert "streamed" not in json.loads((tmp_path / "out" / "normswap.json").read_text())
    largest = max((src / f).stat().st_size for f in CheckpointReader(src).files)
    out = CheckpointReader(tmp_path / "out")
    assert out.sharded and len(out.files) > 2
    assert all((tmp_path / "out" / f).stat().st_size <= largest + 4096 for f in out.files)  # + its header


def _one_error_line(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normswap: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_truncated_shard_is_one_line_exit_2(tokenizer, tmp_path):
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    shard = src / CheckpointReader(src).files[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    _one_error_line(r, shard.name, "truncated")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("size", ["abc", "-1GB"])
def test_bad_max_memory(size, tokenizer, tmp_path):
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    _one_error_line(run("convert", src, "--output", tmp_path / "out", "--max-memory", size), "--max-memory")


def test_gguf_cannot_be_streamed(tiny_gguf, tmp_path):
    r = run("convert", tiny_gguf, "--output", tmp_path / "out", "--max-memory", "1KB")
    _one_error_line(r, "GGUF")


def test_failed_check_or_interrupt_leaves_no_output(tokenizer, tmp_path, monkeypatch):
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    check_module = sys.modules["normswap.check"]
    real_compare = check_module.compare

    def failing(reference, model, ids, *args, **kwargs):
        result = real_compare(reference, model, ids, *args, **kwargs)
        result.passed = False
        return result

    monkeypatch.setattr(check_module, "compare", failing)
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 1 and "nothing saved" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.setattr(check_module, "compare", real_compare)

    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_make(*args, **kwargs)

    real_make = stream_convert.make_tensor
    monkeypatch.setattr(stream_convert, "make_tensor", interrupted)
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _flip_low_bit(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a float32 tensor with the lowest mantissa bit of its first element flipped (1 ulp)."""
    out = tensor.clone()
    out.view(torch.int32).view(-1)[0] ^= 1
    return out


CORRUPTED = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("force", [False, True])
def test_corrupted_written_tensor_fails_verification(force, tokenizer, tmp_path, monkeypatch):
    """A tensor written with other bytes than were made (1 ulp of one element): the check, which streams the
    written shards, cannot see it (measured logit change < 1e-6); the digest of the fresh read does. Exit 1;
    the output is removed, or kept with the failure in its report under --force."""
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    real_write = ShardWriter.write

    def corrupting(self, name, tensor):
        real_write(self, name, _flip_low_bit(tensor) if name == CORRUPTED else tensor)

    monkeypatch.setattr(ShardWriter, "write", corrupting)
    out, report = tmp_path / "out", tmp_path / "report.json"
    extra = ["--force"] if force else []
    r = run(
        "convert", src, "--output", out, "--tokens", TOKENS, "--max-memory", "4KB", "--report", report, *extra
    )
    assert r.exit_code == 1
    assert "PASSED" in r.stdout and "verified: FAILED" in r.stdout
    assert "verification of the saved checkpoint FAILED" in r.stderr
    verify = json.loads(report.read_text())["verify"]
    assert not verify["passed"]
    assert verify["failures"] == [f"{CORRUPTED} is saved with other values than were written and checked"]
    assert verify["max_abs_diff"] == 0.0  # the fresh load reads the bytes the check read
    if force:
        assert "saved anyway (--force)" in r.stderr
        assert json.loads((out / "normswap.json").read_text())["verify"] == verify
    else:
        assert "nothing saved" in r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "src"]


def test_output_changed_after_the_check_fails_verification(tokenizer, tmp_path, monkeypatch):
    """Bytes of a shard changed between the check and the verification: the digest and the logits of the
    fresh streamed load both differ from what was checked."""
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    from normswap.io import staging

    def corrupt(stage):
        if stage != "written":
            return
        built = next(tmp_path.glob(".out.*.partial"))
        reader = CheckpointReader(built)
        info = reader.tensors[CORRUPTED]
        with open(built / info.file, "r+b") as f:  # the first element becomes 1e3
            f.seek(info.start)
            f.write(torch.tensor([1e3], dtype=torch.float32).view(torch.uint8).numpy().tobytes())

    monkeypatch.setattr(staging, "at_stage", corrupt)
    out = tmp_path / "out"
    r = run("convert", src, "--output", out, "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 1 and "nothing saved" in r.stderr
    assert "verified: FAILED" in r.stdout and CORRUPTED in r.stdout
    assert "logits of the reload differ by" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5, dtype=torch.float64),
        torch.randn(4, dtype=torch.float32).to(torch.bfloat16),
        torch.arange(6).reshape(2, 1, 3),
        torch.zeros(0, 4),
        torch.tensor(2.5),
    ],
)
def test_disk_records_round_trip(tensor):
    records = DiskRecords()
    records["a"] = torch.ones(2)
    records["b"] = tensor
    records["c"] = tensor[..., :1] if tensor.ndim else tensor  # a view: its own bytes only
    assert list(records) == ["a", "b", "c"] and len(records) == 3
    got = records["b"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    assert torch.equal(records["c"], tensor[..., :1] if tensor.ndim else tensor)
    assert torch.equal(records["a"], torch.ones(2))
    del records["a"]
    assert list(records) == ["b", "c"]
    records.close()


def test_shard_writer_reads_back_with_safetensors(tmp_path):
    tensors_in = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.tensor([True, False]),
    }
    writer = ShardWriter(
        tmp_path / "x.safetensors", [(n, t.dtype, tuple(t.shape)) for n, t in tensors_in.items()]
    )
    for name, t in tensors_in.items():
        writer.write(name, t)
    writer.close()
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors_in.items():
            assert torch.equal(f.get_tensor(name), t)
    with pytest.raises(ValueError):
        ShardWriter(tmp_path / "y.safetensors", [("a", torch.float32, (2,))]).write("b", torch.zeros(2))


@pytest.mark.slow  # CI time; the tiny models' tests cover the same kinds
@pytest.mark.real
def test_smollm2_safetensors_streamed_equals_in_memory(tmp_path):
    memory, streamed = convert_both(smollm2_sharded(tmp_path / "src"), tmp_path)
    assert_same_checkpoint(memory, streamed)


def smollm2_sharded(folder: Path) -> Path:
    """SmolLM2-135M (from its GGUF, float32) saved as safetensors shards of 200 MB in ``folder``; skips the
    test when the model cannot be had (no network and no cache)."""
    from normswap.io import load_model

    try:
        loaded = load_model("smollm2-135m")
    except Exception as error:  # noqa: BLE001 - no network and no cache
        pytest.skip(f"smollm2-135m unavailable: {error}")
    return save_sharded(loaded.model, loaded.tokenizer, folder, shard="200MB")


def test_two_processes_write_the_same_bytes(tokenizer, tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` on the CPU (gloo): shards byte-identical."""
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    one, two = tmp_path / "one", tmp_path / "two"
    assert run("convert", src, "--output", one, "--tokens", TOKENS, "--max-memory", "4KB").exit_code == 0
    root = Path(__file__).resolve().parent.parent
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "29517"]  # fmt: skip
    args = ["convert", str(src), "--output", str(two), "--tokens", TOKENS, "--max-memory", "4KB"]
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "normswap", *args]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in one.glob("*.safetensors"))
    assert files == sorted(p.name for p in two.glob("*.safetensors"))
    for name in [*files, INDEX]:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert json.loads((two / "normswap.json").read_text())["streamed"]["processes"] == 2
    assert_verified(two, done.stdout)  # the digests of both processes' shards

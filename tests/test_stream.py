"""Streamed conversion (``convert --max-memory``): the same checkpoint as the in-memory path, bit for bit.

Each model is saved as a sharded safetensors directory (shards of a few KB, so every model spans several
files) with a byte-level tokenizer, then converted twice through the CLI: in memory, and streamed with a
budget smaller than any shard. The reference is the in-memory output, itself checked against the original
by the CLI's own logits check; the streamed output must hold the same tensor names with bit-identical values
(``torch.equal`` on the raw bytes), and the same sites in its report.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model, write_tiny_gguf
from safetensors import safe_open

from normswap import progress
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.io import plain_float_checkpoint
from normswap.io.shards import INDEX, CheckpointReader, ShardWriter, check_checkpoint
from normswap.stream import write as stream_write
from normswap.stream.model import build, is_released
from normswap.stream.records import DiskRecords

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


def assert_same_checkpoint(a: Path, b: Path, consumers=None) -> None:
    """The same tensors, bit for bit, and the same sites; ``consumers`` (a function of a consumer record)
    compares each site's consumer records as the set of what it gives."""
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
    sites_a = json.loads((a / "normswap.json").read_text())["sites"]
    sites_b = json.loads((b / "normswap.json").read_text())["sites"]
    if consumers is not None:
        for site in [*sites_a, *sites_b]:
            site["consumer_ops"] = sorted({consumers(c) for c in site["consumer_ops"]})
    assert sites_a == sites_b


def convert_both(src: Path, tmp_path: Path, *extra) -> tuple[Path, Path]:
    memory, streamed = tmp_path / "memory", tmp_path / "streamed"
    r = run("convert", src, "--output", memory, "--tokens", TOKENS, *extra)
    assert r.exit_code == 0, r.output
    assert "memory:" not in r.output
    r = run("convert", src, "--output", streamed, "--tokens", TOKENS, "--max-memory", "4KB", *extra)
    assert r.exit_code == 0, r.output
    assert_verified(streamed, r.output)
    assert_memory_line(streamed, r.output, 4000)
    return memory, streamed


def assert_memory_line(folder: Path, output: str, budget: int) -> None:
    """The summary says the run streamed, the most weight bytes it held, and whether that was over the
    budget (one module's weights are held whole: 4KB is below every tiny model's embedding)."""
    streamed = json.loads((folder / "normswap.json").read_text())["streamed"]
    peak = streamed["peak_weight_bytes"]
    assert streamed["budget"] == budget and peak > 0
    line = next(line for line in output.splitlines() if line.startswith("memory:"))
    assert line.startswith(f"memory:   streamed ({streamed['shards']} shard"), line
    assert f"weights held at most {progress.size(peak)}" in line, line
    assert (f"over the budget of {progress.size(budget)}" in line) == (peak > budget), line


def assert_verified(folder: Path, output: str) -> dict:
    """The streamed output was verified by a fresh load: every tensor written, the checked logits."""
    verify = json.loads((folder / "normswap.json").read_text())["verify"]
    assert verify["passed"] and verify["failures"] == [], verify
    assert verify["tensors"] == len(CheckpointReader(folder).tensors)
    assert verify["tokens"] == 16 and verify["max_abs_diff"] == 0.0
    assert verify["architecture"] == verify["expected_architecture"]
    assert "verified: fresh load as " in output and "streamed fresh load" in output
    return verify


# Five rows cover the kinds (tied lm_head, (1+w) sandwich norms, Conv1D, matmul on a derived weight, a
# per-head norm with a [heads, head_dim] scale: resident, so the probe reads its values) in every run; the
# other five are marked ``slow`` (deselected by default: `python -m pytest -m slow`).
_SLOW = pytest.mark.slow
STREAM_ROWS = ["llama-tied", "gemma2", "gpt2", "falcon-new", "cohere-qknorm"] + [
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
    assert "memory:" not in r.output
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


def test_model_without_norms_is_the_same_line_on_both_paths(tokenizer, tmp_path, monkeypatch):
    """A walk that finds no norm: in memory and streamed, the same one line, nothing written."""
    import normswap.walk
    from normswap import pipeline

    def no_norms(model, input_ids=None, **options):
        return normswap.walk.Walk(sites=[], param_uses={}, owners={}, untouched=[])

    monkeypatch.setattr(pipeline, "walk", no_norms)  # one pipeline walks both stores
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    lines = []
    for extra in (["--no-stream"], ["--max-memory", "4KB"]):
        result = run("convert", src, "--output", tmp_path / "out", *extra)
        _one_error_line(result, "no normalization module found; nothing to convert")
        lines.append(result.stderr)
        assert not (tmp_path / "out").exists()
    assert lines[0] == lines[1]


@pytest.fixture(scope="module")
def multi_tensor_src(tokenizer, tmp_path_factory) -> tuple[Path, str]:
    """A sharded tiny Llama, and its shard holding the most tensors."""
    src = save_sharded(
        make_tiny_model("llama"), tokenizer, tmp_path_factory.mktemp("corrupt") / "src", "100KB"
    )
    placed = list(json.loads((src / INDEX).read_text())["weight_map"].values())
    shard = max(sorted(set(placed)), key=placed.count)
    assert placed.count(shard) >= 3
    return src, shard


def _split(path: Path) -> tuple[int, dict, bytes]:
    """A safetensors file's header length, parsed header and data (read here, not by normswap)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


REDOWNLOAD = "re-download the file (or save it again)"
RECHECKPOINT = "re-download the checkpoint (its index and every shard)"


def _shorter(folder, file):
    path = folder / file
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-100])
    return f"{path}: truncated: {size - 100} bytes, its header describes {size} (100 missing); {REDOWNLOAD}"


def _longer(folder, file):
    path = folder / file
    size = path.stat().st_size
    path.write_bytes(path.read_bytes() + bytes(16))
    return (
        f"{path}: 16 extra bytes after the last tensor ({size + 16} bytes, its header describes {size}): "
        f"not a valid safetensors file; {REDOWNLOAD}"
    )


def _length_field(folder, file):
    path = folder / file
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 10**9) + raw[8:])
    return (
        f"{path}: truncated or not a safetensors file: its header length field says 1000000000 bytes, "
        f"the file has {len(raw) - 8} after it; {REDOWNLOAD}"
    )


def _not_json(folder, file):
    path = folder / file
    n, _, data = _split(path)
    path.write_bytes(struct.pack("<Q", n) + b"x" * n + data)
    return (
        f"{path}: not a safetensors file: its {n}-byte header is not JSON (Expecting value: line 1 "
        f"column 1 (char 0)); {REDOWNLOAD}"
    )


def _overlap(folder, file):
    path = folder / file
    _, header, data = _split(path)
    first, second = _by_offset(header)[:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]
    _rewrite(path, header, data)
    return (
        f"{path}: bad safetensors header: tensors {first} and {second} overlap (bytes "
        f"{begin - 4}..{begin} of the data belong to both); {REDOWNLOAD}"
    )


def _reversed(folder, file):
    path = folder / file
    _, header, data = _split(path)
    name = _by_offset(header)[0]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [end, begin]
    _rewrite(path, header, data)
    return (
        f"{path}: bad safetensors header: tensor {name} has data_offsets {[end, begin]}: its data ends "
        f"before it begins; {REDOWNLOAD}"
    )


def _swapped(folder, file):
    """Two tensors of different sizes given each other's byte ranges."""
    path = folder / file
    _, header, data = _split(path)
    names = _by_offset(header)
    a = next(k for k in names if header[k]["data_offsets"][1] - header[k]["data_offsets"][0] != 256)
    b = next(k for k in names if header[k]["data_offsets"][1] - header[k]["data_offsets"][0] == 256)
    header[a]["data_offsets"], header[b]["data_offsets"] = (
        header[b]["data_offsets"],
        header[a]["data_offsets"],
    )
    _rewrite(path, header, data)
    first = next(k for k in header if k in (a, b))  # entries are checked in header order
    spec = header[first]
    size = 4 * math.prod(spec["shape"])
    span = spec["data_offsets"][1] - spec["data_offsets"][0]
    return (
        f"{path}: bad safetensors header: tensor {first} is F32 {tuple(spec['shape'])} ({size} bytes) "
        f"but its data_offsets {spec['data_offsets']} span {span} bytes; {REDOWNLOAD}"
    )


def _gap(folder, file):
    """Every range moved 8 bytes on, 8 zero bytes in front: the data no longer starts with a tensor."""
    path = folder / file
    _, header, data = _split(path)
    for name in _by_offset(header):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + 8, end + 8]
    _rewrite(path, header, bytes(8) + data)
    return (
        f"{path}: bad safetensors header: bytes 0..8 of the data belong to no tensor (a gap before "
        f"{_by_offset(header)[0]}); {REDOWNLOAD}"
    )


def _unknown_dtype(folder, file):
    path = folder / file
    _, header, data = _split(path)
    name = _by_offset(header)[0]
    header[name]["dtype"] = "F33"
    _rewrite(path, header, data)
    return (
        f"{path}: bad safetensors header: tensor {name} has dtype 'F33', which the safetensors format "
        f"does not define; {REDOWNLOAD}"
    )


def _missing_shard(folder, file):
    (folder / file).unlink()
    return f"{folder / INDEX}: names the shard {file}, which is not in {folder}; {RECHECKPOINT}"


def _index_extra(folder, file):
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["model.layers.9.extra.weight"] = file
    (folder / INDEX).write_text(json.dumps(index))
    return (
        f"{folder / INDEX}: names tensor model.layers.9.extra.weight in {file}, which does not hold it, "
        f"nor does any other shard; {RECHECKPOINT}"
    )


def _index_elsewhere(folder, file):
    index = json.loads((folder / INDEX).read_text())
    name = next(k for k, v in sorted(index["weight_map"].items()) if v != file)
    other = index["weight_map"][name]
    index["weight_map"][name] = file
    (folder / INDEX).write_text(json.dumps(index))
    return (
        f"{folder / INDEX}: names tensor {name} in {file}, which does not hold it; it is in {other}; "
        f"{RECHECKPOINT}"
    )


CORRUPTIONS = [
    _shorter,
    _longer,
    _length_field,
    _not_json,
    _overlap,
    _reversed,
    _swapped,
    _gap,
    _unknown_dtype,
    _missing_shard,
    _index_extra,
    _index_elsewhere,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_checkpoint_is_one_exact_line_on_both_paths(corrupt, multi_tensor_src, tmp_path):
    """The in-memory and the streamed path refuse a corrupt checkpoint with the same line (exit 2): the file,
    what is wrong with it, what to do; nothing is written and the input is left as it was."""
    src, shard = multi_tensor_src
    folder = tmp_path / "src"
    shutil.copytree(src, folder)
    expected = corrupt(folder, shard)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for extra in ([], ["--max-memory", "4KB"]):
        r = run("convert", folder, "--output", tmp_path / "out", "--tokens", TOKENS, *extra)
        assert r.exit_code == 2, (extra, r.output)
        assert r.stderr.strip().splitlines() == [f"normswap: error: {expected}"], extra
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    r = run("inspect", folder)  # every command that loads the model
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [f"normswap: error: {expected}"]


def _raw(header) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"\x10\x00", "not a safetensors file: 2 bytes, too short for the 8-byte header length"),
        (_raw([1, 2]), "bad safetensors header: it is a JSON list, not an object"),
        (_raw({"a": {"shape": [2], "data_offsets": [0, 8]}}),
         "bad safetensors header: tensor a has no dtype"),
        (_raw({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}),
         'bad safetensors header: tensor a has shape "2", not a list of sizes'),
        (_raw({"a": {"dtype": "F32", "shape": [2]}}),
         "bad safetensors header: tensor a has data_offsets null, not two byte offsets [begin, end]"),
        (_raw({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}) + bytes(2),
         "bad safetensors header: tensor a is F4 (3,), which does not fill whole bytes"),
    ],
)  # fmt: skip
def test_bad_header_entries_are_named(raw, problem, tmp_path):
    """Each malformed part of a header is one line naming the file, the tensor and what is wrong with it."""
    (tmp_path / "model.safetensors").write_bytes(raw)
    with pytest.raises(NormswapError) as error:
        check_checkpoint(tmp_path)
    assert (
        str(error.value)
        == f"{tmp_path / 'model.safetensors'}: {problem}; re-download the file (or save it again)"
    )


def test_valid_checkpoint_of_every_format_dtype_passes(tmp_path):
    """Dtypes the format defines but normswap does not stream are not corruption: the in-memory check
    passes them; the streamed reader names the dtype."""
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "U16", "shape": [2, 3], "data_offsets": [0, 12]},
              "b": {"dtype": "F4", "shape": [4], "data_offsets": [12, 14]}}  # fmt: skip
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(14))
    check_checkpoint(tmp_path)
    with pytest.raises(NormswapError, match=r"tensor a is stored as U16, a dtype normswap cannot read"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("size", ["abc", "-1GB"])
def test_bad_max_memory(size, tokenizer, tmp_path):
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    _one_error_line(run("convert", src, "--output", tmp_path / "out", "--max-memory", size), "--max-memory")


def test_gguf_cannot_be_streamed(tiny_gguf, tmp_path):
    r = run("convert", tiny_gguf, "--output", tmp_path / "out", "--max-memory", "1KB")
    _one_error_line(r, "GGUF")


def test_failed_check_or_interrupt_leaves_no_output(tokenizer, tmp_path, monkeypatch):
    src = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")
    from normswap import pipeline as check_module  # the one pipeline checks both stores

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

    real_make = stream_write.make_tensor
    monkeypatch.setattr(stream_write, "make_tensor", interrupted)
    r = run("convert", src, "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _flip_low_bit(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a float32 tensor with the lowest mantissa bit of its first element flipped (1 ulp)."""
    out = tensor.clone()
    out.view(torch.int32).view(-1)[0] ^= 1
    return out


CORRUPTED = "model.layers.0.mlp.down_proj.weight"


# without --force (the output removed) in the slow run: tests/test_faults.py's C27 covers it streamed
@pytest.mark.parametrize("force", [pytest.param(False, marks=pytest.mark.slow), True])
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


def test_disk_records_on_a_full_disk_are_one_line_and_give_the_space_back(tmp_path):
    """A record the disk refuses: ``normswap.files.write_error``'s line naming the output they are for, and
    the temporary file closed at once (not when the error is collected: a full disk gets its space back)."""
    import errno
    import os

    records = DiskRecords(tmp_path, owner=tmp_path / "out")
    records["a"] = torch.ones(2)
    file = records._file

    class Full:  # the file as a full disk answers a write
        def __getattr__(self, name):
            return getattr(file, name)

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    records._file = Full()
    with pytest.raises(NormswapError) as raised:
        records["b"] = torch.ones(3)
    assert str(raised.value) == f"cannot write {tmp_path / 'out'}: no space left on device"
    assert file.closed


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


def test_shard_writer_out_of_order_writes_the_same_bytes(tmp_path):
    """``put`` writes a tensor at its offset (an expert's tensors written together); ``write`` skips what
    was put; the file is byte-identical to one written in order, and every tensor must be written."""
    tensors_in = {name: torch.randn(4, 3 + i) for i, name in enumerate("abcde")}
    layout = [(n, t.dtype, tuple(t.shape)) for n, t in tensors_in.items()]
    in_order = ShardWriter(tmp_path / "in_order.safetensors", layout)
    for name, t in tensors_in.items():
        in_order.write(name, t)
    in_order.close()
    mixed = ShardWriter(tmp_path / "mixed.safetensors", layout)
    mixed.put("d", tensors_in["d"])
    mixed.write("a", tensors_in["a"])
    mixed.put("c", tensors_in["c"])
    mixed.write("b", tensors_in["b"])
    with pytest.raises(ValueError):
        mixed.put("c", tensors_in["c"])  # once
    mixed.write("e", tensors_in["e"])  # c and d were put: e comes next
    mixed.close()
    assert (tmp_path / "mixed.safetensors").read_bytes() == (tmp_path / "in_order.safetensors").read_bytes()
    short = ShardWriter(tmp_path / "short.safetensors", layout)
    short.put("e", tensors_in["e"])
    with pytest.raises(ValueError, match="4 tensors not written"):
        short.close()


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


def test_a_budget_given_in_decimal_units_is_said_in_them_too():
    """``--max-memory 100MB`` is 100 * 10**6 bytes: the line says 95.4 MiB (100e6 / 2**20 = 95.37) and the
    100 MB the user gave, so the two numbers are not taken for a conversion error."""
    from normswap.summary import streamed_line

    report = {"streamed": {"peak_weight_bytes": 113 * 10**6, "budget": 100 * 10**6, "shards": 2}}
    assert streamed_line(report) == (
        "memory:   streamed (2 shards), weights held at most 107.8 MiB: over the budget of 95.4 MiB = 100 MB "
        "(one module's weights, or a tensor being written, are held whole)"
    )  # 113e6 / 2**20 = 107.76
    report["streamed"]["budget"] = 100 * 2**20  # 100MiB: one unit, as given
    assert "over the budget of 100.0 MiB (" in streamed_line(report)

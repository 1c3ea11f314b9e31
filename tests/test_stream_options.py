"""Options of ``convert`` on the streamed path: each one honoured, or refused in one line (never ignored).

Found by a fresh-user run: ``--device-map`` and ``--tokenizer`` were silently dropped when the model
exceeded ``--max-memory``, and a directory without tokenizer files could not be streamed although the
in-memory path checks it on ids drawn from the vocabulary.
"""

from __future__ import annotations

import json
import shutil

from conftest import make_tiny_model
from test_stream import TOKENS, _one_error_line, run, save_sharded, tensors, tokenizer  # noqa: F401


def _src(tokenizer, tmp_path):  # noqa: F811
    return save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "src")


def test_device_map_is_refused_when_streaming(tokenizer, tmp_path):  # noqa: F811
    """--device-map places a whole model; streamed, --device names where the layers run (tests/
    test_stream_device.py), and --no-stream contradicts --max-memory."""
    src = _src(tokenizer, tmp_path)
    r = run("convert", src, "-o", tmp_path / "out", "--max-memory", "4KB", "--device-map", "auto")
    _one_error_line(r, "--device-map is not available when streaming", "give --device")
    r = run("convert", src, "-o", tmp_path / "out", "--max-memory", "4KB", "--no-stream")
    _one_error_line(r, "--no-stream and --max-memory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_directory_without_tokenizer_streams_on_vocabulary_ids(tokenizer, tmp_path):  # noqa: F811
    """As in memory: the check runs on ids drawn from the vocabulary, said on the input line; the output
    equals the in-memory conversion of the same directory, tensor for tensor."""
    src = _src(tokenizer, tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / file).unlink(missing_ok=True)
    r = run("convert", src, "-o", tmp_path / "streamed", "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 0, r.output
    assert "input:    ids drawn from the vocabulary" in r.stdout and "verified:" in r.stdout
    r = run("convert", src, "-o", tmp_path / "memory", "--tokens", TOKENS)
    assert r.exit_code == 0, r.output
    got, want = tensors(tmp_path / "streamed"), tensors(tmp_path / "memory")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)


def test_tokenizer_option_is_used_when_streaming(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """--tokenizer tokenizes the check's text when streaming; a perplexity that says the text means little to
    the model gets its note in the saved normswap.json too (it was added after the manifest was written)."""
    from normswap import pipeline

    src = _src(tokenizer, tmp_path)
    tok = tmp_path / "tok"
    tok.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(src / file, tok / file)
    r = run("convert", src, "-o", tmp_path / "out", "--max-memory", "4KB", "--tokenizer", tmp_path / "none")
    _one_error_line(r, "no such directory")
    real_compare = pipeline.compare

    def implausible(*args, **kwargs):  # what another model's tokenizer does to a trained model's perplexity
        result = real_compare(*args, **kwargs)
        result.ppl_original = 5.1e7
        return result

    monkeypatch.setattr(pipeline, "compare", implausible)
    r = run(
        "convert", src, "-o", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB", "--tokenizer", tok
    )
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # checked with, not saved: src has none
    assert "input:    ids drawn" not in r.stdout
    manifest = json.loads((tmp_path / "out" / "normswap.json").read_text())
    assert f"--tokenizer {tok} is not its tokenizer" in manifest["check_input"]["note"]

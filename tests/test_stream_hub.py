"""Streamed conversion of a hub id (``convert OWNER/NAME --max-memory``): what is fetched, and failures.

The hub is replaced by a fake ``snapshot_download`` that copies the files matching ``allow_patterns`` from a
local "repository" into a fake cache (this machine has no hub); the output must equal the streamed output
of the same files as a local directory, byte for byte.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from conftest import make_tiny_model
from test_stream import TOKENS, _one_error_line, run, save_sharded, tensors, tokenizer  # noqa: F401


class FakeHub:
    """``snapshot_download(repo_id, allow_patterns=...)`` over local folders; records what was fetched."""

    def __init__(self, repos: dict[str, Path], cache: Path):
        self.repos, self.cache, self.fetched = repos, cache, set()

    def __call__(self, repo_id, allow_patterns=None, **_):
        if repo_id not in self.repos:  # what huggingface_hub raises offline for a repository not cached
            raise huggingface_hub.errors.LocalEntryNotFoundError(
                "Cannot find an appropriate cached snapshot folder for the specified revision on the local "
                "disk and outgoing traffic has been disabled."
            )
        snapshot = self.cache / repo_id.replace("/", "--")
        for file in self.repos[repo_id].iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns or ["*"]):
                snapshot.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, snapshot / file.name)
                self.fetched.add(file.name)
        return str(snapshot)


@pytest.fixture
def hub(tokenizer, tmp_path, monkeypatch):  # noqa: F811 - the module fixture of test_stream
    repo = save_sharded(make_tiny_model("llama"), tokenizer, tmp_path / "repo")
    shutil.copy(next(repo.glob("model-*.safetensors")), repo / "consolidated.safetensors")  # another copy
    (repo / "pytorch_model.bin").write_bytes(b"not fetched")
    fake = FakeHub({"owner/tiny": repo}, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


def test_hub_id_is_fetched_then_streamed(hub, tmp_path):
    """Only the config, tokenizer, index and the shards it names are fetched; the output equals the
    streamed conversion of the same repository as a local directory, tensor for tensor."""
    r = run("convert", "owner/tiny", "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 0, r.output
    assert "consolidated.safetensors" not in hub.fetched and "pytorch_model.bin" not in hub.fetched
    shards = {p.name for p in hub.repos["owner/tiny"].glob("model-*.safetensors")}
    assert shards <= hub.fetched and "config.json" in hub.fetched and "tokenizer.json" in hub.fetched
    local = tmp_path / "local"
    shutil.copytree(tmp_path / "cache" / "owner--tiny", local)
    r = run("convert", local, "--output", tmp_path / "ref", "--tokens", TOKENS, "--max-memory", "4KB")
    assert r.exit_code == 0, r.output
    got, want = tensors(tmp_path / "out"), tensors(tmp_path / "ref")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)


def test_unreachable_hub_is_one_line(hub, tmp_path):
    r = run("convert", "owner/missing", "--output", tmp_path / "out", "--max-memory", "4KB")
    _one_error_line(r, "owner/missing: cannot fetch from the Hugging Face hub (LocalEntryNotFoundError")
    assert not (tmp_path / "out").exists()


def test_quantized_hub_checkpoint_is_refused_before_its_weights(hub, tmp_path):
    """A repository whose config says it is stored quantized (fp8 with block scales, as DeepSeek-V3's
    release): refused in one line from its config; no weight file is fetched."""
    import json

    config = hub.repos["owner/tiny"] / "config.json"
    data = json.loads(config.read_text())
    data["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config.write_text(json.dumps(data))
    r = run("convert", "owner/tiny", "--output", tmp_path / "out", "--tokens", TOKENS, "--max-memory", "4KB")
    _one_error_line(r, "owner/tiny: the checkpoint is stored quantized (fp8 with 128x128 block scales)")
    assert "config.json" in hub.fetched and not any(f.endswith(".safetensors") for f in hub.fetched)
    assert not (tmp_path / "out").exists()

"""A safetensors model opened for streaming: its shards' headers checked, config, tokenizers, dtype.

``open_source`` reads a local model directory, or a hub id whose small files and safetensors shards are
fetched into the Hugging Face cache first (``fetch_hub``); nothing else of the model is read here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap import progress
from normswap.errors import NormswapError
from normswap.io.shards import INDEX, CheckpointReader


@dataclass
class Source:
    """A safetensors model directory opened for streaming: ``reader``, ``config``, ``tokenizer`` (the
    model's own, saved with the output; None without tokenizer files), ``info`` (``normswap.io.ModelInfo``),
    ``dtype``, whether the model's own code may run, and ``check_tokenizer`` (what the check's text is
    tokenized with: ``--tokenizer``, else ``tokenizer``)."""

    reader: CheckpointReader
    config: Any
    tokenizer: Any
    info: Any
    dtype: torch.dtype
    trust_remote_code: bool = False
    check_tokenizer: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the weights in ``dtype`` (floating tensors converted, others as stored)."""
        size = self.dtype.itemsize
        return sum(
            (t.nbytes // t.dtype.itemsize) * size if t.dtype.is_floating_point
            else t.nbytes
            for t in self.reader.tensors.values()
        )  # fmt: skip


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"1.5GB"``, ``"512MiB"`` -> bytes (``normswap.options.parse_size``: powers of 1000 for
    KB/MB/GB/TB, as accelerate's ``max_memory``, and of 1024 for KiB/MiB/GiB/TiB).

    Raises:
        NormswapError: not such a size, or not positive.
    """
    from normswap.options import parse_size as parse

    try:
        return parse(text)
    except ValueError as error:
        raise NormswapError(f"--max-memory {error}") from error


# What a streamed conversion needs from a hub repository besides the weights: config, index, generation
# config, the tokenizer in any of its formats, the model card and licence files (normswap.io.carry; Python
# files only with trust_remote_code).
HUB_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "vocab*", "merges*",
             "README*", "LICENSE*", "LICENCE*", "NOTICE*", "USE_POLICY*"]  # fmt: skip


def fetch_hub(repo_id: str, trust_remote_code: bool = False) -> str:
    """Fetch what streaming reads of hub repository ``repo_id`` into the Hugging Face cache; its path.

    First the small files (``HUB_FILES``), then only the safetensors files the index names (or
    ``model.safetensors``): a repository that also holds other copies of the weights (Mistral's
    ``consolidated.safetensors``, PyTorch ``.bin`` files) is not fetched twice. ``huggingface_hub`` writes
    each file to disk as it downloads (never whole in memory), resumes, and reuses the cache.

    Raises:
        NormswapError: the hub cannot be reached (offline), the repository or a file does not exist,
            access is refused, or its config says the checkpoint is stored quantized (before the weights
            are fetched); one line.
    """
    from huggingface_hub import snapshot_download

    small = HUB_FILES + (["*.py"] if trust_remote_code else [])
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=small))
    except Exception as error:  # noqa: BLE001 - huggingface_hub raises many kinds; each is one line here
        raise _fetch_failed(repo_id, error) from error
    _refuse_quantized_repo(repo_id, path)  # from its config, before its weights are fetched
    try:
        index = path / INDEX
        weights = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
        path = Path(snapshot_download(repo_id, allow_patterns=small + (weights or ["model.safetensors"])))
    except Exception as error:  # noqa: BLE001 - huggingface_hub raises many kinds; each is one line here
        raise _fetch_failed(repo_id, error) from error
    return str(path)


def _fetch_failed(repo_id: str, error: Exception) -> NormswapError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return NormswapError(
        f"{repo_id}: cannot fetch from the Hugging Face hub ({type(error).__name__}: {first})"
    )


def _refuse_quantized_repo(repo_id: str, folder: Path) -> None:
    """``normswap.io.load.refuse_quantized`` from the ``quantization_config`` of a fetched ``config.json``."""
    import types

    from normswap.io.load import Resolved, refuse_quantized

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):  # none, or not JSON: the config's own load says what is wrong
        return
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    config = types.SimpleNamespace(quantization_config=quantization)
    refuse_quantized(Resolved(repo_id, "hub", repo_id), config)


def open_source(
    model: str, dtype: str, trust_remote_code: bool = False, tokenizer: str | None = None
) -> Source:
    """Open MODEL for streaming: a local directory with ``config.json`` and safetensors weights, or a hub
    id whose files are fetched into the Hugging Face cache first (``fetch_hub``). The check's tokenizer is
    ``tokenizer`` (a hub id or directory) if given, else MODEL's own, else ``None`` for a directory without
    tokenizer files (``normswap.io.load.load_tokenizer``; the check then runs on vocabulary ids); the output
    gets MODEL's own only.

    Every shard's header is checked here, before anything runs or is written.

    Raises:
        NormswapError: MODEL is not such a directory or hub id (a .gguf file), a hub id cannot be
            fetched, is stored quantized (``normswap.io.load.refuse_quantized``), not a causal LM, has a
            missing/truncated/corrupt shard, or a tokenizer that cannot be loaded.
    """
    from normswap.io.load import (
        ModelInfo,
        is_causal_lm,
        load_config,
        load_tokenizer,
        refuse_quantized,
        resolve,
        resolve_dtype,
    )

    resolved = resolve(model)
    kind = resolved.kind
    if kind == "hub":
        resolved = dataclasses.replace(resolved, kind="dir", path=fetch_hub(model, trust_remote_code))
    if resolved.kind != "dir":
        raise NormswapError(
            f"{model}: --max-memory streams a model directory (or hub id) with safetensors weights, "
            "not a GGUF file"
        )
    config = load_config(resolved, trust_remote_code=trust_remote_code)
    refuse_quantized(resolved, config)
    reader = CheckpointReader(resolved.path)
    torch_type = resolve_dtype(dtype, resolved, config)
    if not is_causal_lm(config):
        size = progress.size(Source(reader, config, None, None, torch_type).nbytes)
        raise NormswapError(
            f"{model}: --max-memory streams causal LMs only; drop --max-memory to convert it in memory (its "
            f"weights: {size})"
        )
    own = load_tokenizer(resolved, None, trust_remote_code=trust_remote_code)
    check = (
        own if tokenizer is None else load_tokenizer(resolved, tokenizer, trust_remote_code=trust_remote_code)
    )
    architecture = _causal_lm_name(model, config)
    info = ModelInfo(
        source=resolved.source, kind=kind, path=resolved.path, gguf_file=None, short_name=None,
        architecture=architecture, causal_lm=True, dtype=str(torch_type).removeprefix("torch."),
        auto_class="AutoModelForCausalLM",  # the class _causal_lm_name found it in: a causal LM only streams
    )  # fmt: skip
    return Source(reader, config, own, info, torch_type, trust_remote_code, check)


def _causal_lm_name(model: str, config) -> str:
    """The name of the causal-LM class ``config`` builds: transformers' own, or the one its ``auto_map``
    names (remote code, which transformers' mapping does not hold)."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) in mapping:
        return mapping[type(config)].__name__
    remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if remote:
        return str(remote).rsplit(".", 1)[-1]
    raise NormswapError(f"{model}: transformers has no causal-LM class for model type {config.model_type!r}")

"""Resolve a MODEL argument and load it with transformers.

MODEL may be
* a local ``.gguf`` file (loaded with ``from_pretrained(folder, gguf_file=name)``, dequantized to float),
* a local model directory (``config.json`` + weights; a directory holding exactly one ``.gguf`` file and no
  ``config.json`` counts as that file),
* a short name from ``normswap.io.shortnames.SHORT_MODELS`` (fetched once into normswap's cache),
* a Hugging Face hub id (needs the hub or a local HF cache; set ``HF_HUB_OFFLINE=1`` to skip the network).

Causal LMs load with ``AutoModelForCausalLM``; everything else (encoders such as BERT/MiniLM) with
``AutoModel``, so no randomly initialized head is ever attached. The choice comes from the config's
``architectures`` (or, when absent, as in GGUF files, from its ``model_type``).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from normswap.errors import NormswapError
from normswap.io import shortnames

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass
class Resolved:
    """Where a MODEL argument points.

    Attributes:
        source: the argument as given.
        kind: ``"gguf"``, ``"dir"``, ``"hub"``; short names resolve to ``"gguf"`` or ``"dir"`` with
            ``short_name`` set.
        path: directory (or hub id) handed to ``from_pretrained``.
        gguf_file: file name inside ``path`` for GGUF models, else ``None``.
        short_name: the short name, if MODEL was one.
    """

    source: str
    kind: str
    path: str
    gguf_file: str | None = None
    short_name: str | None = None

    @property
    def local_path(self) -> Path | None:
        """The file or directory on disk that holds the model (``None`` for a hub id)."""
        if self.kind == "hub":
            return None
        return Path(self.path) / self.gguf_file if self.gguf_file else Path(self.path)


@dataclass
class ModelInfo:
    """What was loaded: ``Resolved`` plus the model class, whether it is a causal LM, and its dtype."""

    source: str
    kind: str
    path: str
    gguf_file: str | None
    short_name: str | None
    architecture: str
    causal_lm: bool
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedModel:
    """``model`` (eval mode), ``tokenizer``, ``info``.

    Unpacks as ``model, tokenizer, info = load_model(...)``.
    """

    model: torch.nn.Module
    tokenizer: Any
    info: ModelInfo

    def __iter__(self):
        return iter((self.model, self.tokenizer, self.info))


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith(("/", ".", "~"))
        or source.lower().endswith(".gguf")
        or source.count("/") > 1
        or "\\" in source
    )


def resolve(source: str | Path, *, download: bool = True) -> Resolved:
    """Decide what MODEL ``source`` is, fetching a short-name model into the cache if ``download``.

    Raises:
        NormswapError: a missing path, a file that is not ``.gguf``, a directory without ``config.json``,
            or a string that is neither a path, a short name nor a hub id.
    """
    source = str(source)
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise NormswapError(
                f"{source}: a model file must be a .gguf file "
                "(for a safetensors checkpoint, pass its directory)"
            )
        return Resolved(source, "gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return Resolved(source, "dir", str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Resolved(source, "gguf", str(path.resolve()), ggufs[0].name)
        what = f"{len(ggufs)} .gguf files (pass one of them)" if ggufs else "no .gguf file"
        raise NormswapError(f"{source}: not a model directory (no config.json and {what})")
    if source in shortnames.SHORT_MODELS:
        local = shortnames.fetch(source) if download else shortnames.cached_path(source)
        if local.suffix == ".gguf":
            return Resolved(source, "gguf", str(local.parent), local.name, short_name=source)
        return Resolved(source, "dir", str(local), short_name=source)
    if _looks_like_path(source):
        raise NormswapError(f"{source}: no such file or directory")
    if _HUB_ID.fullmatch(source):
        return Resolved(source, "hub", source)
    raise NormswapError(
        f"{source!r} is not a path, a short name ({', '.join(shortnames.SHORT_MODELS)}) or a hub id"
    )


def is_causal_lm(config) -> bool:
    """Whether ``config`` describes a causal LM (load with ``AutoModelForCausalLM``) or not (``AutoModel``).

    With ``config.architectures`` set: true when one of them is a causal-LM class of transformers (or of
    the model's remote code, via ``auto_map``). Without it (GGUF files, hand-made configs): true when the
    ``model_type`` has a causal-LM class and is not an encoder family (one with a masked-LM class),
    unless the config says ``is_decoder``.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    causal_classes = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal_classes.update(value if isinstance(value, list | tuple) else [value])
    auto_map = getattr(config, "auto_map", None) or {}
    remote_causal = str(auto_map.get("AutoModelForCausalLM", "")).rsplit(".", 1)[-1]
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(a in causal_classes or (remote_causal and a == remote_causal) for a in architectures)
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return bool(getattr(config, "is_decoder", False))
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or bool(remote_causal)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``torch.float32`` -> ``torch.float32``.

    Raises:
        NormswapError: a dtype normswap does not load models in.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise NormswapError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0].strip() if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _load_failure(resolved: Resolved, what: str, error: Exception) -> NormswapError:
    """One line for a failure of transformers to read ``what`` (config, weights, tokenizer)."""
    text = str(error)
    if "trust_remote_code" in text:
        return NormswapError(
            f"{resolved.source}: needs its own Python code to load; pass --trust-remote-code "
            "(trust_remote_code=True) only if you trust it"
        )
    if resolved.kind == "hub":
        hint = ""
        close = difflib.get_close_matches(resolved.source, list(shortnames.SHORT_MODELS), n=1)
        if close:
            hint = f" (did you mean the short name {close[0]!r}?)"
        return NormswapError(
            f"{resolved.source}: not a local path or short name ({', '.join(shortnames.SHORT_MODELS)}), "
            f"and the Hugging Face hub cannot provide it{hint}: {_first_line(error)}"
        )
    where = resolved.local_path
    if resolved.gguf_file and what != "tokenizer":
        return NormswapError(
            f"{resolved.source}: cannot read the GGUF file {where} (truncated or corrupt?): "
            f"{_first_line(error)}"
        )
    return NormswapError(f"{resolved.source}: cannot load the {what} from {where} ({_first_line(error)})")


def load_config(resolved: Resolved, *, trust_remote_code: bool = False):
    """The transformers config of a resolved model.

    Raises:
        NormswapError: the config cannot be read (missing, corrupt, unknown model type, needs remote code,
            unreachable hub id).
    """
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    try:
        return AutoConfig.from_pretrained(resolved.path, **kwargs)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, gguf's own errors ...
        raise _load_failure(resolved, "config", error) from error


@contextlib.contextmanager
def _gguf_loading():
    """Speed up transformers' GGUF loader for one ``load_model`` call; everything is undone afterwards.

    transformers (5.24) parses the whole GGUF header, tokenizer vocabulary included, for the config, again
    for the weights and again for the tokenizer, and rebuilds gguf's tensor-name map once per module
    (about 400 times for SmolLM2): together most of a GGUF load on a small CPU. Within the block:

    * one ``gguf.GGUFReader`` is shared per file (it is only read from);
    * the metadata-only parse ``load_gguf_checkpoint(path, return_tensors=False)`` runs once per file and
      each caller gets its own deep copy of the result;
    * ``gguf.get_tensor_name_map`` is memoized (a pure function of architecture and layer count);
    * the loader's per-tensor progress bar (plain ``tqdm``, out of reach of transformers'
      ``disable_progress_bar``) shows only when stderr is a terminal.

    All four return exactly what the unpatched code returns.
    """
    import gguf

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: load without the shortcuts
        gguf_utils = None
    if gguf_utils is None:
        yield
        return
    reader_cls = gguf.GGUFReader
    parse = getattr(gguf_utils, "load_gguf_checkpoint", None)
    readers: dict[tuple[str, str], Any] = {}
    parsed: dict[str, dict] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    def parse_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return parse(path, return_tensors, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    patches = [(gguf, "GGUFReader", shared_reader)]
    if parse is not None:
        patches.append((gguf_utils, "load_gguf_checkpoint", parse_once))
    if hasattr(gguf, "get_tensor_name_map"):
        patches.append(
            (gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        )
    if hasattr(gguf_utils, "tqdm"):  # disable=None: off unless stderr is a terminal
        patches.append((gguf_utils, "tqdm", functools.partial(gguf_utils.tqdm, disable=None)))
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


@torch.no_grad()
def _realign(model: torch.nn.Module) -> None:
    """Give every parameter fresh, aligned storage (one at a time, so the peak grows by one tensor).

    Tensors dequantized from a GGUF file can start at 16-byte offsets of their buffers, which makes every
    matmul that reads them markedly slower (measured: a one-token forward of SmolLM2 250 vs 185 ms).
    Shared (tied) Parameters stay shared: each Parameter object is visited once.
    """
    for p in model.parameters():
        p.data = p.data.clone()


def load_model(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    tokenizer: bool = True,
    device: str | torch.device | None = "cpu",
    device_map: str | dict | None = None,
) -> LoadedModel:
    """Resolve MODEL ``source`` and load model and tokenizer, in eval mode on ``device``.

    Args:
        source: hub id, model directory, ``.gguf`` file or short name (see the module docstring).
        dtype: dtype of the floating-point parameters (``"float32"`` default, ``"bfloat16"``,
            ``"float16"``, ``"float64"`` or a ``torch.dtype``). GGUF weights are dequantized into it.
        trust_remote_code: allow transformers to run Python code shipped with the model.
        tokenizer: also load the tokenizer (``LoadedModel.tokenizer`` is ``None`` otherwise).
        device: ``"cpu"`` (default), ``"auto"`` (the first CUDA GPU if any), ``"cuda"``, ``"cuda:N"`` or a
            ``torch.device`` (``normswap.device.resolve_device``); the weights load straight onto it.
        device_map: passed to ``from_pretrained`` instead of ``device`` (``"auto"``: accelerate spreads the
            layers over the GPUs; see README for the memory each mode needs).

    Returns:
        ``LoadedModel(model, tokenizer, info)``.

    Raises:
        NormswapError: anything wrong with the input (see ``resolve`` and ``load_config``), weights that
            cannot be read (truncated or corrupt files), a tokenizer that cannot be built.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from normswap.device import resolve_device

    target = resolve_device(str(device)) if device_map is None else None
    resolved = resolve(source)
    dtype = torch_dtype(dtype)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    placement = {}
    if device_map is not None:
        placement["device_map"] = device_map
    elif target.type != "cpu" and not resolved.gguf_file:  # GGUF dequantizes on the CPU, then moves
        placement["device_map"] = str(target)
    with _gguf_loading() if resolved.gguf_file else contextlib.nullcontext():
        config = load_config(resolved, trust_remote_code=trust_remote_code)
        causal = is_causal_lm(config)
        auto = AutoModelForCausalLM if causal else AutoModel
        try:
            model = auto.from_pretrained(resolved.path, config=config, dtype=dtype, **placement, **kwargs)
        except Exception as error:
            raise _load_failure(resolved, "weights", error) from error
        model.eval()
        if resolved.gguf_file:
            _realign(model)
            if target is not None and target.type != "cpu":
                model.to(target)
        tok = None
        if tokenizer:
            try:
                tok = AutoTokenizer.from_pretrained(resolved.path, **kwargs)
            except Exception as error:
                raise _load_failure(resolved, "tokenizer", error) from error
    info = ModelInfo(
        source=resolved.source,
        kind=resolved.kind,
        path=resolved.path,
        gguf_file=resolved.gguf_file,
        short_name=resolved.short_name,
        architecture=type(model).__name__,
        causal_lm=causal,
        dtype=str(dtype).removeprefix("torch."),
    )
    return LoadedModel(model, tok, info)

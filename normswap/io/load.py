"""Resolve a MODEL argument and load it with transformers.

MODEL may be
* a local ``.gguf`` file (loaded with ``from_pretrained(folder, gguf_file=name)``, dequantized to float),
* a local model directory (``config.json`` + weights; a directory holding exactly one ``.gguf`` file and no
  ``config.json`` counts as that file),
* a short name from ``normswap.io.shortnames.SHORT_MODELS`` (fetched once into normswap's cache),
* a Hugging Face hub id (needs the hub or a local HF cache; set ``HF_HUB_OFFLINE=1`` to skip the network).

Each model loads with its own head: the transformers Auto class that maps the class its config's
``architectures`` names (``AutoModelForCausalLM``, ``AutoModelForSeq2SeqLM``,
``AutoModelForImageTextToText``), or ``AutoModel`` for a headless encoder such as BERT/MiniLM, so no
randomly initialized head is ever attached and the saved checkpoint is the class that was loaded. Without
``architectures`` (GGUF files, hand-made configs) the choice comes from the ``model_type`` (see
``auto_class_name``).
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

from normswap.catalog import misspelled
from normswap.check.inputs import is_causal_lm
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
    """What was loaded: ``Resolved`` plus the model class, whether it is a causal LM, its dtype and the
    transformers Auto class it was loaded with (``auto_class``)."""

    source: str
    kind: str
    path: str
    gguf_file: str | None
    short_name: str | None
    architecture: str
    causal_lm: bool
    dtype: str
    auto_class: str = ""

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
            a name without ``/`` close to a short name in any case (``normswap.catalog.misspelled``:
            ``SmolLM2-135M`` -> "did you mean 'smollm2-135m'?"),
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
        raise NormswapError(
            f"{source}: no such file or directory; give a model directory, a .gguf file, a hub id (org/name) "
            f"or a short name ({', '.join(shortnames.SHORT_MODELS)})"
        )
    mistyped = misspelled(source)
    if mistyped:  # a mistyped short name: answer now, not after the hub's retries
        raise NormswapError(mistyped)
    if _HUB_ID.fullmatch(source):
        return Resolved(source, "hub", source)
    raise NormswapError(
        f"{source!r} is not a path, a short name ({', '.join(shortnames.SHORT_MODELS)}) or a hub id"
    )


def quiet_loading() -> None:
    """Silence transformers' and huggingface_hub's progress bars, warnings and retry messages.

    normswap reports its own steps, and a failure as one line; the hub's "Retrying in 2s" lines and
    transformers' per-tensor bars would bury both.
    """
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hub_logging.set_verbosity_error()


@contextlib.contextmanager
def quiet_libraries():
    """``quiet_loading`` while the block runs, then transformers' and huggingface_hub's verbosity and
    transformers' progress bars as they were (the Python API leaves its caller's settings alone)."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    verbosity, hub_verbosity = hf_logging.get_verbosity(), hub_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    quiet_loading()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# The heads normswap loads, in order of preference: transformers Auto class -> the constant in
# transformers.models.auto.modeling_auto that lists the model classes it builds. AutoModel (last) is for
# headless encoders; a model whose config names any other head is refused rather than loaded headless.
_HEADS = (
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("AutoModel", "MODEL_MAPPING_NAMES"),
)


def _mapped_classes(constant: str) -> set[str]:
    from transformers.models.auto import modeling_auto

    classes: set[str] = set()
    for value in getattr(modeling_auto, constant, {}).values():
        classes.update(value if isinstance(value, list | tuple) else [value])
    return classes


def auto_class_name(config) -> str:
    """The name of the transformers Auto class that loads ``config``'s model with its own head.

    With ``config.architectures`` set: the first Auto class of ``AutoModelForCausalLM``,
    ``AutoModelForSeq2SeqLM``, ``AutoModelForImageTextToText``, ``AutoModel`` whose mapping (or, for remote
    code, the config's ``auto_map``) names one of the architectures. Without it (GGUF files, hand-made
    configs): ``AutoModelForSeq2SeqLM`` for an encoder-decoder, ``AutoModelForCausalLM`` when
    ``is_causal_lm(config)``, else ``AutoModel``.

    Raises:
        NormswapError: the architectures name only heads none of these classes builds (a classifier, a
            masked LM, ...): loading it headless would save another class than the input.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        if getattr(config, "is_encoder_decoder", False):
            return "AutoModelForSeq2SeqLM"
        return "AutoModelForCausalLM" if is_causal_lm(config) else "AutoModel"
    auto_map = getattr(config, "auto_map", None) or {}
    for name, constant in _HEADS:
        remote = str(auto_map.get(name, "")).rsplit(".", 1)[-1]
        if any(a in _mapped_classes(constant) or (remote and a == remote) for a in architectures):
            return name
    raise NormswapError(
        f"the config names {', '.join(architectures)}: normswap loads causal LMs, seq2seq LMs, "
        "image-text-to-text models and headless encoders only"
    )


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``torch.float32`` -> ``torch.float32``.

    Raises:
        NormswapError: a dtype normswap does not load models in (``"auto"`` is resolved by
            ``resolve_dtype`` first).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise NormswapError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def stored_dtype(folder: str | os.PathLike) -> torch.dtype | None:
    """The floating dtype holding most bytes of a local directory's safetensors weights (headers only), or
    None when it has no safetensors files or no floating tensor."""
    from normswap.io.shards import CheckpointReader

    try:
        reader = CheckpointReader(folder)
    except NormswapError:
        return None
    totals: dict[torch.dtype, int] = {}
    for t in reader.tensors.values():
        if t.dtype.is_floating_point:
            totals[t.dtype] = totals.get(t.dtype, 0) + t.nbytes
    return max(totals, key=totals.get) if totals else None


def resolve_dtype(dtype: str | torch.dtype, resolved: Resolved, config=None) -> torch.dtype:
    """The dtype a model is loaded in; ``"auto"`` is the checkpoint's own, as transformers 5 reads it.

    ``"auto"``: float32 for a GGUF file (its weights are dequantized); else the config's ``dtype``
    (``torch_dtype`` in older configs) when it is float32, bfloat16, float16 or float64; else, for a local
    directory, the floating dtype of most of its safetensors bytes; else float32. Any other value as
    ``torch_dtype``.

    Raises:
        NormswapError: an unsupported dtype name.
    """
    if not (isinstance(dtype, str) and dtype == "auto"):
        return torch_dtype(dtype)
    if resolved.gguf_file:
        return torch.float32
    own = getattr(config, "dtype", None) if config is not None else None
    if isinstance(own, str):
        own = DTYPES.get(own.removeprefix("torch."))
    if own in DTYPES.values():
        return own
    if resolved.kind == "dir":
        stored = stored_dtype(resolved.path)
        if stored in DTYPES.values():
            return stored
    return torch.float32


def _stored_tensors(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype code of a local directory's weights, from the headers alone (an
    index's shards, or ``model.safetensors``); ``{}`` when they cannot be read (the load reports that)."""
    import json
    import struct

    index = folder / "model.safetensors.index.json"
    try:
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])  # fmt: skip
        found: dict[str, str] = {}
        for file in files:
            with open(folder / file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, 100 << 20)))
            found |= {k: v.get("dtype", "") for k, v in header.items() if k != "__metadata__"}
        return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return {}


# how transformers loads each quantized format as float weights (its quantization configs' own options)
_DEQUANTIZED = "FineGrainedFP8Config(dequantize=True)"
_DECOMPRESSED = "CompressedTensorsConfig(run_compressed=False)"


def quantized_format(resolved: Resolved, config) -> tuple[str, str] | None:
    """``(format, how to get a float copy)`` of a checkpoint stored quantized, or None.

    Quantized: its config has a ``quantization_config`` (any ``quant_method`` but GGUF's, whose weights
    transformers dequantizes as it loads: fp8 with block scales, as DeepSeek-V3's release; compressed-tensors;
    GPTQ, AWQ, bitsandbytes, ...), or, in a local directory without one, its safetensors weights hold fp8
    block scales (``*.weight_scale_inv``), packed weights (``*.weight_packed``) or ``*.weight`` tensors
    stored in a float8 dtype. Read from the config and the safetensors headers only.
    """
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if qc:
        method = qc.get("quant_method")
        method = str(getattr(method, "value", method) or "an unnamed method")
        if method == "gguf":
            return None
        if method == "fp8" and qc.get("weight_block_size"):
            size = "x".join(str(d) for d in qc["weight_block_size"])
            return f"fp8 with {size} block scales", _DEQUANTIZED
        if method == "compressed-tensors":
            fmt = qc.get("format")
            return f"compressed-tensors{f' ({fmt})' if fmt else ''}", _DECOMPRESSED
        return method, ""
    if resolved.kind != "dir" or resolved.gguf_file:
        return None
    tensors = _stored_tensors(Path(resolved.path))
    if any(name.endswith(".weight_scale_inv") for name in tensors):
        return "fp8 with block scales (weight_scale_inv tensors)", _DEQUANTIZED
    if any(name.endswith(".weight_packed") for name in tensors):
        return "compressed-tensors (weight_packed tensors)", _DECOMPRESSED
    if any(name.endswith(".weight") and code.startswith("F8") for name, code in tensors.items()):
        return "fp8 weights", _DEQUANTIZED
    return None


def refuse_quantized(resolved: Resolved, config) -> None:
    """Refuse a checkpoint stored quantized (``quantized_format``) in one line naming the format and the fix,
    before anything is loaded or written: folding and rotating need float weights, and the output would not
    be a checkpoint in the input's format.

    Raises:
        NormswapError: the checkpoint is stored quantized.
    """
    found = quantized_format(resolved, config)
    if found is None:
        return
    fmt, how = found
    how = f" (load it in transformers with {how}, then save_pretrained)" if how else ""
    raise NormswapError(
        f"{resolved.source}: the checkpoint is stored quantized ({fmt}); normswap converts float weights: "
        f"convert a bfloat16 copy of it{how}"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0].strip() if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _load_failure(resolved: Resolved, what: str, error: Exception) -> NormswapError:
    """One line for a failure of transformers to read ``what`` (config, weights, tokenizer)."""
    text = str(error)
    if "trust_remote_code" in text:
        return NormswapError(
            f"{resolved.source}: needs its own Python code to load; pass trust_remote_code=True "
            "only if you trust it"
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
    # a short name's files are normswap's cached copy (checked when fetched): damaged since, fetched again
    fix = ""
    if resolved.short_name:
        entry = shortnames.cache_dir() / shortnames.SHORT_MODELS[resolved.short_name].name
        fix = f"; delete {entry} to fetch it again"
    if resolved.gguf_file and what != "tokenizer":
        return NormswapError(
            f"{resolved.source}: cannot read the GGUF file {where} (truncated or corrupt?): "
            f"{_first_line(error)}{fix}"
        )
    return NormswapError(
        f"{resolved.source}: cannot load the {what} from {where} ({_first_line(error)}){fix}"
    )


def _names(items, limit: int = 3) -> str:
    items = sorted(items)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def mismatch(info: dict) -> str | None:
    """What ``from_pretrained(..., output_loading_info=True)`` found wrong with a checkpoint, or None.

    ``info`` has ``missing_keys`` (parameters the config needs and the checkpoint lacks: transformers would
    fill them with random values), ``unexpected_keys`` (tensors the config has no place for),
    ``mismatched_keys`` (``(name, checkpoint shape, model shape)``) and ``error_msgs``. Tied parameters
    are never "missing": transformers ties them before it reports.
    """
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing {_names(info['missing_keys'])}")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected {_names(info['unexpected_keys'])}")
    for name, found, expected in sorted(info.get("mismatched_keys") or [])[:3]:
        problems.append(f"{name} has shape {tuple(found)}, the config expects {tuple(expected)}")
    if len(info.get("mismatched_keys") or []) > 3:
        problems.append(f"{len(info['mismatched_keys']) - 3} more of another shape")
    if info.get("error_msgs"):
        problems.append(str(info["error_msgs"][0]).strip().splitlines()[0])
    return "; ".join(problems) or None


def load_weights(auto, resolved: Resolved, **kwargs) -> torch.nn.Module:
    """``auto.from_pretrained(resolved.path, **kwargs)``, refusing a checkpoint that does not fit its config.

    A tensor missing from the checkpoint would otherwise be initialized at random (and a conversion of
    the random model would pass its check and be saved); unexpected tensors and tensors of another shape
    mean the config describes another model. Used for every load of weights (``load_model``,
    ``load_pretrained``, evaluation with a ``device_map``).

    A local directory's safetensors checkpoint is validated first from its headers and file sizes
    (``normswap.io.shards.check_checkpoint``), so a corrupt file gets the same precise line as on the
    streamed path.

    Raises:
        NormswapError: a corrupt safetensors checkpoint (the file, what is wrong, what to do), transformers
            cannot read the weights (see ``_load_failure``), or the checkpoint's tensors do not match its
            config (one line naming them).
    """
    if resolved.kind == "dir" and not resolved.gguf_file:
        from normswap.io.shards import check_checkpoint

        check_checkpoint(resolved.path)
    try:
        model, info = auto.from_pretrained(
            resolved.path, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except Exception as error:  # transformers raises OSError, ValueError, RuntimeError, gguf's own errors
        raise _load_failure(resolved, "weights", error) from error
    problem = mismatch(info)
    if problem:
        raise NormswapError(
            f"{resolved.source}: the checkpoint's tensors do not match its config ({problem}); "
            "refusing to load it with randomly initialized weights"
        )
    return model


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
      ``disable_progress_bar``) shows only when stderr is a terminal, and is cleared when done (no line
      of its own is left between normswap's stage lines, nor an empty one where the terminal reports no
      width).

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
        patches.append((gguf_utils, "tqdm", functools.partial(gguf_utils.tqdm, disable=None, leave=False)))
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


# Files a tokenizer is saved as (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json/.txt,
# merges.txt, spiece.model, *.tiktoken): a local model directory with none of them has no tokenizer.
_TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "spiece.model", "*.tiktoken")


def has_tokenizer_files(resolved: Resolved) -> bool:
    """Whether ``resolved`` may hold a tokenizer: always for hub ids and GGUF files (the tokenizer is in the
    file's metadata), for a local directory only when it holds a tokenizer file."""
    if resolved.kind != "dir" or resolved.gguf_file:
        return True
    folder = Path(resolved.path)
    return any(next(folder.glob(pattern), None) is not None for pattern in _TOKENIZER_FILES)


def load_tokenizer(resolved: Resolved, name_or_dir: str | Path | None = None, *, trust_remote_code=False):
    """The tokenizer of model ``resolved``, or of ``name_or_dir`` (a hub id or tokenizer directory) if given.

    Returns:
        the tokenizer, or ``None`` when ``name_or_dir`` is ``None`` and the model is a local directory
        without tokenizer files (``has_tokenizer_files``): the caller then checks on ids drawn from the
        vocabulary (``normswap.check.vocabulary_ids``).

    Raises:
        NormswapError: tokenizer files that cannot be read, or a ``name_or_dir`` that gives no tokenizer.
    """
    from transformers import AutoTokenizer

    if name_or_dir is None and not has_tokenizer_files(resolved):
        return None
    where = resolved
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if name_or_dir is not None:
        path = Path(str(name_or_dir)).expanduser()
        if path.is_dir():
            where = Resolved(str(name_or_dir), "dir", str(path.resolve()))
        elif _looks_like_path(str(name_or_dir)):
            raise NormswapError(f"tokenizer {name_or_dir}: no such directory")
        else:
            where = Resolved(str(name_or_dir), "hub", str(name_or_dir))
    elif resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    try:
        return AutoTokenizer.from_pretrained(where.path, **kwargs)
    except Exception as error:
        raise _load_failure(where, "tokenizer", error) from error


def load_model(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    tokenizer: bool | str | Path = True,
    device: str | torch.device | None = "cpu",
    device_map: str | dict | None = None,
    float_weights: bool = False,
) -> LoadedModel:
    """Resolve MODEL ``source`` and load model (with its own head, see ``auto_class_name``) and tokenizer,
    in eval mode on ``device``.

    Args:
        source: hub id, model directory, ``.gguf`` file or short name (see the module docstring).
        dtype: dtype of the floating-point parameters: ``"auto"`` (default: the checkpoint's own,
            float32 for GGUF; see ``resolve_dtype``), ``"float32"``, ``"bfloat16"``, ``"float16"``,
            ``"float64"`` or a ``torch.dtype``. GGUF weights are dequantized into it.
        trust_remote_code: allow transformers to run Python code shipped with the model.
        tokenizer: ``True``: the model's own tokenizer (``None`` for a model directory without tokenizer
            files); a hub id or directory: that tokenizer; ``False``: none (``LoadedModel.tokenizer`` is
            ``None``).
        device: ``"cpu"`` (default), ``"auto"`` (the first CUDA GPU if any), ``"cuda"``, ``"cuda:N"`` or a
            ``torch.device`` (``normswap.device.resolve_device``); the weights load straight onto it.
        device_map: passed to ``from_pretrained`` instead of ``device`` (``"auto"``: accelerate spreads the
            layers over the GPUs; docs/GPU.md gives the memory each mode needs).
        float_weights: refuse a checkpoint stored quantized (``refuse_quantized``) before loading it (what
            ``convert`` needs; ``inspect`` and ``eval`` load such a model as transformers does).

    Returns:
        ``LoadedModel(model, tokenizer, info)``.

    Raises:
        NormswapError: anything wrong with the input (see ``resolve``, ``load_config``,
            ``auto_class_name``), with ``float_weights`` a checkpoint stored quantized, weights that cannot
            be read (truncated or corrupt files) or do not match the config (``load_weights``), a loaded
            class other than the one the config names, a tokenizer that cannot be built.
    """
    import transformers

    from normswap.device import resolve_device

    target = resolve_device(str(device)) if device_map is None else None
    resolved = resolve(source)
    if not (isinstance(dtype, str) and dtype == "auto"):
        dtype = torch_dtype(dtype)  # a bad name fails before the config is read
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
        if float_weights:
            refuse_quantized(resolved, config)
        dtype = resolve_dtype(dtype, resolved, config)
        try:
            auto_name = auto_class_name(config)
        except NormswapError as error:
            raise NormswapError(f"{resolved.source}: {error}") from error
        model = load_weights(
            getattr(transformers, auto_name), resolved, config=config, dtype=dtype, **placement, **kwargs
        )
        _check_named_class(resolved, config, model)
        model.eval()
        if resolved.gguf_file:
            _realign(model)
            if target is not None and target.type != "cpu":
                model.to(target)
        tok = None
        if tokenizer is not False:
            name = None if tokenizer is True else tokenizer
            tok = load_tokenizer(resolved, name, trust_remote_code=trust_remote_code)
    info = ModelInfo(
        source=resolved.source,
        kind=resolved.kind,
        path=resolved.path,
        gguf_file=resolved.gguf_file,
        short_name=resolved.short_name,
        architecture=type(model).__name__,
        causal_lm=auto_name == "AutoModelForCausalLM",
        dtype=str(dtype).removeprefix("torch."),
        auto_class=auto_name,
    )
    return LoadedModel(model, tok, info)


def _check_named_class(resolved: Resolved, config, model: torch.nn.Module) -> None:
    """Refuse a loaded class that is not one the config's ``architectures`` names (it would save as another
    class than the input); configs without ``architectures`` accept what the Auto class chose."""
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and type(model).__name__ not in architectures:
        raise NormswapError(
            f"{resolved.source}: the config names {', '.join(architectures)} but transformers builds "
            f"{type(model).__name__} from it; normswap would save another class than the input"
        )

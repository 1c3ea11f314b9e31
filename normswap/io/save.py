"""Save a converted model as an ordinary transformers checkpoint, atomically; load it back.

The output directory holds what ``save_pretrained`` writes (``model.safetensors``, ``config.json``,
``generation_config.json``), the tokenizer files, and ``normswap.json`` (the conversion report, whose
``sites`` let ``load_pretrained`` put the fused modules back). It loads in plain
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` without normswap: the swapped norms keep their
module names and parameter names, so the checkpoint is in the model's own architecture format, with the
folded norms at their identity weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from normswap.errors import NormswapError
from normswap.io import files, shortnames
from normswap.io.adapters import plain_manifest
from normswap.io.load import ModelInfo, auto_class_name, load_config, load_weights, resolve, torch_dtype

log = logging.getLogger(__name__)

MANIFEST = "normswap.json"


def _protected_paths(source: str | os.PathLike | None) -> list[Path]:
    """The files/directories of the input model that a save must never write into or replace."""
    if source is None:
        return []
    text = str(source)
    if text in shortnames.SHORT_MODELS and not Path(text).exists():
        return [(shortnames.cache_dir() / text).resolve()]
    path = Path(text).expanduser()
    return [path.resolve()] if path.exists() else []


def _inputs(source) -> list[Path]:
    """Protected paths of one MODEL argument or of a list/tuple of them."""
    sources = list(source) if isinstance(source, list | tuple) else [source]
    return [p for s in sources for p in _protected_paths(s)]


def _check_creatable(folder: Path) -> None:
    """``folder`` is a writable directory or can be created as one (nothing is left behind).

    Permission bits say nothing for root or for special filesystems (``/proc``), so the nearest existing
    ancestor is tried for real: a hidden directory is made in it and removed at once.
    """
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NormswapError(f"cannot create {folder}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise NormswapError(f"cannot write to {existing}: not writable (permission denied or read-only)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".normswap-probe-", dir=existing))
    except OSError as error:
        raise NormswapError(f"cannot create {folder}: {error.strerror or error}") from error


def check_output_dir(out_dir: str | os.PathLike, source=None, *, overwrite: bool = False) -> Path:
    """Check that ``out_dir`` can receive a converted checkpoint of model ``source``; return it absolute.

    Nothing is created. Call it before the (slow) load so bad input fails at once.

    Args:
        out_dir: the output directory.
        source: the MODEL argument (path, short name, hub id), a list of them (every input of the
            command), or ``None``.
        overwrite: whether an existing ``out_dir`` may be replaced.

    Raises:
        NormswapError: ``out_dir`` exists (without ``overwrite``) or is a file, lies inside an input
            model's directory, is an input, (with ``overwrite``) contains an input, or cannot be created
            (its nearest existing ancestor is a file or is not writable).
    """
    out = Path(out_dir).expanduser().resolve()
    for protected in _inputs(source):
        if out == protected or protected in out.parents:
            raise NormswapError(
                f"output directory {out} is inside the input model {protected}; choose another"
            )
        if out in protected.parents:
            raise NormswapError(
                f"output directory {out} contains the input model {protected}; "
                "replacing it would delete the input"
            )
    if out.exists() and not out.is_dir():
        raise NormswapError(f"output path {out} exists and is not a directory")
    if out.exists() and not overwrite:
        raise NormswapError(f"output directory {out} already exists; pass overwrite=True to replace it")
    _check_creatable(out.parent)
    return out


def check_output_file(path: str | os.PathLike, sources=(), output: str | os.PathLike | None = None) -> Path:
    """Check that a file (``--report``, ``--json``, ...) can be written at ``path``; return it absolute.

    Nothing is created. The file must not be, or lie inside, any input model of ``sources`` (MODEL
    arguments) or the output directory ``output``, and its folder must exist and be writable.

    Raises:
        NormswapError: ``path`` is a directory, would overwrite or write into an input model or the output
            directory, or its folder does not exist or is not writable.
    """
    target = Path(path).expanduser().resolve()
    guarded = _inputs(list(sources))
    if output is not None:
        guarded.append(Path(output).expanduser().resolve())
    for protected in guarded:
        if target == protected or protected in target.parents:
            raise NormswapError(f"{path} would overwrite or write into {protected}; choose another file")
    if target.is_dir():
        raise NormswapError(f"{path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise NormswapError(f"cannot write {path}: directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise NormswapError(f"cannot write {path}: directory {target.parent} is not writable")
    return target


@contextlib.contextmanager
def plain_float_checkpoint(model: torch.nn.Module):
    """Within the block, ``model`` saves as an ordinary float checkpoint even if it was loaded from GGUF.

    Loading a GGUF file dequantizes every weight to a float tensor, but transformers still attaches its
    GGUF quantizer (``model.hf_quantizer``, ``model.is_quantized``, ``model.quantization_method``,
    ``config.quantization_config``, ``config._is_quantized``), and ``save_pretrained`` refuses such a model
    ("quantized with gguf ... not serializable"); the config would also carry the GGUF quantization
    settings into ``config.json``. This removes that state for the duration of the block and restores it
    afterwards, so the caller's model is not changed permanently.

    Raises:
        NormswapError: the model is quantized by another method, or holds GGUF weights still packed
            (non-float parameters): there is no float checkpoint to write.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        yield model
        return
    method = getattr(quantizer.quantization_config, "quant_method", None)
    method = str(getattr(method, "value", method))
    if method != "gguf":
        raise NormswapError(f"the model is quantized with {method}; normswap saves float checkpoints only")
    packed = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise NormswapError(
            f"the model holds packed GGUF weights ({packed[0]}, ...); "
            "load it dequantized to save a float checkpoint"
        )
    from transformers import PreTrainedModel

    configs = {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}
    saved: list[tuple[object, str, object]] = []
    targets = [(model, a) for a in ("hf_quantizer", "quantization_method", "is_quantized")]
    targets += [(c, a) for c in configs.values() for a in ("quantization_config", "_is_quantized")]
    try:
        for obj, attr in targets:
            if attr in vars(obj):
                saved.append((obj, attr, vars(obj)[attr]))
                delattr(obj, attr)
        model.is_quantized = False
        yield model
    finally:
        if "is_quantized" in vars(model):
            del model.is_quantized
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def report_dict(report, info: ModelInfo | None = None) -> dict[str, Any]:
    """The JSON-ready manifest for ``normswap.json`` and ``--report``: ``report.to_dict()`` (a
    ``ConvertReport``) plus where the model came from (``model`` = the MODEL argument, ``source`` = the
    resolved ``ModelInfo``), its ``dtype`` and ``architecture``, and the normswap version."""
    from importlib.metadata import PackageNotFoundError, version

    data = report.to_dict() if hasattr(report, "to_dict") else dict(report)
    if info is not None:
        data["model"] = info.source
        data["architecture"] = info.architecture
        data["dtype"] = info.dtype
        data["source"] = info.to_dict()
    try:
        data["normswap_version"] = version("normswap")
    except PackageNotFoundError:
        data["normswap_version"] = None
    return data


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the system or filesystem cannot (then nothing was changed).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _replace_dir(built: Path, out: Path, overwrite: bool) -> None:
    """Move the finished ``built`` directory to ``out`` with renames only (same filesystem).

    An existing ``out`` (only with ``overwrite``) is exchanged with ``built`` in one atomic step where
    Linux allows it, so ``out`` always holds one complete checkpoint; elsewhere it is renamed aside first.
    The old checkpoint ends up at ``built``'s path, which the caller removes.
    """
    if not out.exists():
        os.rename(built, out)
        return
    if not overwrite:
        raise NormswapError(f"output directory {out} already exists; pass overwrite=True to replace it")
    if _exchange(built, out):
        return
    old = built.with_name(built.name.removesuffix(".partial") + ".old")
    os.rename(out, old)
    try:
        os.rename(built, out)
    except BaseException:
        os.rename(old, out)
        raise
    os.rename(old, built)


_HIDDEN = ".partial", ".old"


def _remove_stale(out: Path) -> list[Path]:
    """Remove the hidden build folders of ``out`` that a killed save left (call with the lock held).

    Saves create ``.NAME.XXXXXXXX.partial`` (and, where paths cannot be exchanged, ``.old``) only while
    holding ``output_lock(out)``, so any such folder found by the lock's holder is stale.
    """
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}({'|'.join(map(re.escape, _HIDDEN))})")
    stale = [p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()]
    for path in stale:
        log.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path, ignore_errors=True)
    return stale


def save_converted(
    model: torch.nn.Module,
    tokenizer,
    report: dict[str, Any],
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    input_path: str | os.PathLike | None = None,
) -> Path:
    """Write ``model`` (converted in place), its tokenizer and the report to ``out_dir``, atomically.

    The files are written into a hidden temporary directory beside ``out_dir`` (same filesystem), which
    then replaces ``out_dir`` in one step (see ``_replace_dir``); an error or interruption removes it, so
    ``out_dir`` is either complete or as it was. The save holds ``output_lock(out_dir)``: a concurrent save
    to the same directory fails with an "in use" line instead of interleaving, and build folders left by a
    killed save are removed. The weights are saved by ``save_pretrained`` as safetensors in the model's
    own architecture format (GGUF-loaded models as a plain float checkpoint, see
    ``plain_float_checkpoint``); tied parameters are written once, an untied ``lm_head``
    (``config.tie_word_embeddings = False``) as its own tensor. The caller's model is left as it was.
    A PEFT model (``peft.PeftModel``) is saved as the plain model it computes: a copy merged with peft's
    ``merge_and_unload`` (one more model in memory during the save); ``report["saved_as"]`` then says so
    (the dict is updated in place, so a ``--report`` written after the save says it too) and ``normswap.json``
    names the sites as the merged model does.

    Args:
        model: a transformers ``PreTrainedModel``.
        tokenizer: its tokenizer (or ``None``).
        report: JSON-ready dict (``report_dict(...)``), written as strict JSON to ``normswap.json``.
        out_dir: the output directory; its parent is created if needed.
        overwrite: replace an existing ``out_dir``.
        input_path: the MODEL argument the model came from, to refuse an ``out_dir`` inside it.

    Returns:
        the absolute output directory.

    Raises:
        NormswapError: see ``check_output_dir``, ``plain_float_checkpoint`` and
            ``normswap.io.adapters.plain_model`` (all before anything is written); another process is
            saving to ``out_dir`` ("in use"); any failure of a writer (a full disk, safetensors' or
            tokenizers' own errors), as one line naming ``out_dir`` and the cause.
    """
    out = check_output_dir(out_dir, input_path, overwrite=overwrite)
    model, manifest = plain_manifest(model, report)  # a PEFT model: a merged copy, freed on return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise files.write_error(out.parent, error) from error
    with files.output_lock(out):
        _remove_stale(out)
        if out.exists() and not overwrite:  # created while this process was converting
            raise NormswapError(f"output directory {out} already exists; pass overwrite=True to replace it")
        try:
            built = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        except OSError as error:
            raise files.write_error(out.parent, error) from error
        try:
            with plain_float_checkpoint(model):
                model.save_pretrained(built)
            if tokenizer is not None:
                tokenizer.save_pretrained(built)
            (built / MANIFEST).write_text(files.to_json(manifest))
            files.apply_umask(built)
            _replace_dir(built, out, overwrite)
        except NormswapError:
            raise
        except Exception as error:  # any writer's exception type: OSError, SafetensorError, ...
            raise files.write_error(out, error) from error
        finally:
            shutil.rmtree(built, ignore_errors=True)
    log.info("saved %s", out)
    return out


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The ``normswap.json`` of a converted checkpoint directory.

    Raises:
        NormswapError: no ``normswap.json`` (not a normswap checkpoint) or it is not valid JSON.
    """
    manifest = Path(path).expanduser() / MANIFEST
    if not manifest.is_file():
        raise NormswapError(f"{path}: no {MANIFEST}; not a checkpoint written by normswap convert")
    try:
        return json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise NormswapError(f"{manifest}: not valid JSON ({error})") from error


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    **kwargs,
) -> torch.nn.Module:
    """Load a checkpoint written by ``normswap convert`` with its fused norm modules in place.

    The weights load with plain transformers (the Auto class of ``normswap.io.load.auto_class_name``:
    the model's own head); then every site the manifest marks ``swapped`` is rebuilt with
    ``NormSite.from_dict`` and ``normswap.swap.swap_norms`` installs the fused modules under the same
    module names.

    Args:
        path: the checkpoint directory.
        dtype: dtype to load in (default, or ``"auto"``: the dtype the checkpoint was saved in).
        trust_remote_code: allow transformers to run Python code shipped with the model.
        **kwargs: passed on to ``from_pretrained``.

    Returns:
        the model, in eval mode.

    Raises:
        NormswapError: not a normswap checkpoint, transformers cannot load it, or its tensors do not
            match its config (see ``normswap.io.load.load_weights``).
    """
    import transformers

    from normswap.sites import NormSite
    from normswap.swap import swap_norms

    manifest = read_manifest(path)
    resolved = resolve(path, download=False)
    config = load_config(resolved, trust_remote_code=trust_remote_code)
    auto = getattr(transformers, auto_class_name(config))
    if dtype is not None and not (isinstance(dtype, str) and dtype == "auto"):
        kwargs["dtype"] = torch_dtype(dtype)
    else:
        kwargs.setdefault("dtype", "auto")
    model = load_weights(auto, resolved, config=config, trust_remote_code=trust_remote_code, **kwargs)
    sites = [NormSite.from_dict(site) for site in manifest.get("sites", []) if site.get("swapped")]
    swap_norms(model, sites)
    return model.eval()

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
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from normswap import files
from normswap.errors import NormswapError
from normswap.io import shortnames, staging
from normswap.io.adapters import plain_manifest
from normswap.io.load import ModelInfo, auto_class_name, load_config, load_weights, resolve, torch_dtype
from normswap.io.staging import MANIFEST, Staging

log = logging.getLogger(__name__)


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


def _check_creatable(folder: Path, target: Path | None = None) -> None:
    """``folder`` is a writable directory or can be created as one (nothing is left behind); ``target`` is
    what the caller will create in it (the output directory), the path a refusal names (default ``folder``).

    Permission bits say nothing for root or for special filesystems (``/proc``), so the nearest existing
    ancestor is tried for real: a hidden directory is made in it and removed at once.
    """
    target = folder if target is None else target
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NormswapError(f"cannot create {target}: {existing} is not a directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise NormswapError(f"cannot write to {existing}: not writable (permission denied or read-only)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".normswap-probe-", dir=existing))
    except OSError as error:
        raise NormswapError(
            f"cannot create {target}: no folder can be made in {existing} ({error.strerror or error}); "
            "choose another path"
        ) from error


def check_output_dir(
    out_dir: str | os.PathLike, source=None, *, overwrite: bool = False, write_into: bool = False
) -> Path:
    """Check that ``out_dir`` can receive a converted checkpoint of model ``source``; return it absolute.

    Nothing is created. Call it before the (slow) load so bad input fails at once.

    Args:
        out_dir: the output directory.
        source: the MODEL argument (path, short name, hub id), a list of them (every input of the
            command), or ``None``.
        overwrite: whether an existing ``out_dir`` may be replaced: only an empty directory or one that
            normswap wrote (``normswap.io.staging.check_replaceable``) ever is.
        write_into: an existing directory is written into, file by file (``bench --out``), never replaced:
            it may hold anything.

    Raises:
        NormswapError: ``out_dir`` exists (without ``overwrite``) or is a file, lies inside an input
            model's directory, is an input, (with ``overwrite``) contains an input or is neither empty nor
            an earlier normswap output (the line names what it holds), or cannot be created (its nearest
            existing ancestor is a file or is not writable).
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
    if not (write_into and out.is_dir()):
        staging.check_replaceable(out, overwrite)
    _check_creatable(out.parent, out)
    return out


def check_output_file(path: str | os.PathLike, sources=(), output: str | os.PathLike | None = None) -> Path:
    """Check that a file (``--report``, ``--json``, ...) can be written at ``path``; return it absolute.

    Nothing is created. The file must not be, or lie inside, any input model of ``sources`` (MODEL
    arguments) or the output directory ``output``; an existing file is replaced only when it is empty or
    normswap wrote it (``files.written_by_normswap``: a report of an earlier run); its folder must be
    writable or creatable (the write creates missing folders, as ``--output`` does).

    Raises:
        NormswapError: ``path`` is a directory, a file normswap did not write, would overwrite or write into
            an input model or the output directory, or its folder cannot be created or written.
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
    if target.exists() and not files.written_by_normswap(target):
        raise NormswapError(
            f"{path} exists and normswap did not write it (only an empty file or a normswap report is "
            "replaced); give another file name, or remove it yourself"
        )
    if not target.parent.is_dir():
        _check_creatable(target.parent)
    elif not os.access(target.parent, os.W_OK | os.X_OK):
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
    data = report.to_dict() if hasattr(report, "to_dict") else dict(report)
    if info is not None:
        data["model"] = info.source
        data["architecture"] = info.architecture
        data["dtype"] = info.dtype
        data["source"] = info.to_dict()
    data[files.VERSION_KEY] = files.normswap_version()
    return data


def write_checkpoint(
    model: torch.nn.Module,
    tokenizer,
    manifest: dict[str, Any] | None,
    folder: Path,
    *,
    max_shard_size: int | None = None,
) -> None:
    """Write ``model``'s checkpoint, its tokenizer and ``manifest`` (``normswap.json``) into ``folder``.

    The weights are saved by ``save_pretrained`` as safetensors in the model's own architecture format
    (GGUF-loaded models as a plain float checkpoint, see ``plain_float_checkpoint``), in shards of at most
    ``max_shard_size`` bytes when given (transformers' default otherwise). ``folder`` is a staged folder
    (``normswap.io.staging.Staging``): nothing here is atomic on its own.
    """
    with plain_float_checkpoint(model):
        model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    staging.at_stage("weights")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if manifest is not None:
        files.write_json(folder / MANIFEST, manifest)


def save_converted(
    model: torch.nn.Module,
    tokenizer,
    report: dict[str, Any],
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    *,
    input_path: str | os.PathLike | None = None,
    expected=None,
    trust_remote_code: bool = False,
    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (converted in place), its tokenizer and the report to ``out_dir``, atomically.

    The files are written into a hidden folder beside ``out_dir`` (same filesystem), verified there when
    ``expected`` is given, and only then exchanged with ``out_dir`` in one step
    (``normswap.io.staging.Staging``): an error, a failed verification or an interruption leaves
    ``out_dir`` exactly as it was. ``overwrite`` replaces only an empty directory or one that normswap
    wrote. The save holds ``output_lock(out_dir)``: a concurrent save to the same directory fails with an
    "in use" line instead of interleaving, and build folders left by a killed save are removed. The
    weights are saved as ``write_checkpoint`` does; tied parameters are written once, an untied
    ``lm_head`` (``config.tie_word_embeddings = False``) as its own tensor. The caller's model is left as
    it was. A PEFT model (``peft.PeftModel``) is saved as the plain model it computes: a copy merged with
    peft's ``merge_and_unload`` (one more model in memory during the save); ``report["saved_as"]`` then
    says so (the dict is updated in place, so a ``--report`` written after the save says it too) and
    ``normswap.json`` names the sites as the merged model does.

    Args:
        model: a transformers ``PreTrainedModel``.
        tokenizer: its tokenizer (or ``None``).
        report: JSON-ready dict (``report_dict(...)``), written as strict JSON to ``normswap.json``.
        out_dir: the output directory; its parent is created if needed.
        overwrite: replace an existing ``out_dir`` (an empty one or a normswap output only).
        input_path: the MODEL argument the model came from, to refuse an ``out_dir`` inside it.
        expected: ``normswap.io.verify.record_expected(model, ids)``: verify the written checkpoint by a
            fresh load (``verify_saved``) before it replaces ``out_dir``; the result goes into
            ``report["verify"]`` and ``normswap.json``. The fresh load is a second model in memory.
        trust_remote_code: passed to the fresh load.
        extra_tensors: more safetensors files to write with the checkpoint, as ``{relative path: {name:
            tensor}}`` (a rotation's matrices, ``normswap.rotate.ROTATION_FILE``); a path in a subfolder
            keeps loaders that read every top-level ``*.safetensors`` as weights from reading them.
        extra_files: more files to write beside the checkpoint, relative path -> text (``centering.json``).

    Returns:
        the absolute output directory.

    Raises:
        NormswapError: see ``check_output_dir``, ``plain_float_checkpoint`` and
            ``normswap.io.adapters.plain_model`` (all before anything is written); another process is
            saving to ``out_dir`` ("in use"); any failure of a writer (a full disk, safetensors' or
            tokenizers' own errors), as one line naming ``out_dir`` and the cause; a failed verification
            (``out_dir`` left as it was; ``report["verify"]`` says why).
    """
    out = check_output_dir(out_dir, input_path, overwrite=overwrite)
    model, manifest = plain_manifest(model, report)  # a PEFT model: a merged copy, freed on return
    inputs = _api_inputs(model, manifest, input_path)
    with Staging(out, overwrite=overwrite) as stage:
        carried = _write_staged(
            stage, model, tokenizer, manifest, inputs, str(input_path), extra_tensors, extra_files
        )
        if expected is not None:
            from normswap.io.verify import verify_saved

            expected.carried = carried
            verified = verify_saved(stage.path, expected, trust_remote_code=trust_remote_code)
            report["verify"] = manifest["verify"] = verified.to_dict() | {"path": str(out)}
            if not verified.passed:
                raise NormswapError(
                    f"verification of the checkpoint for {out} failed ({verified.failures[0]}); "
                    f"{out} is left as it was"
                )
            staging.at_stage("verified")
        stage.commit(manifest)
    log.info("saved %s", out)
    return out


def _api_inputs(model: torch.nn.Module, manifest: dict, input_path):
    """``carry.gather`` for ``save_converted``'s ``input_path`` (nothing without one). Tensors the model
    class does not run are carried only when the conversion the manifest records kept what they read.

    Raises:
        NormswapError: such tensors, and a centered model or a folded final norm (one line naming them).
    """
    from normswap.io import carry
    from normswap.sites import NormSite

    try:
        resolved = resolve(input_path, download=False) if input_path is not None else None
    except NormswapError:  # not a model path: only the output guards use it
        resolved = None
    if resolved is None:
        return carry.InputFiles()
    inputs = carry.gather(resolved, model)
    reading = carry.may_read_outputs(model, inputs.skipped) if inputs.skipped else []
    if reading:
        if manifest.get("norm", "keep") != "keep" or manifest.get("rotation"):
            option = f"norm={manifest['norm']!r}" if not manifest.get("rotation") else "rotate=..."
            carry.refuse_changed_stream(str(input_path), model, reading, option)
        sites = [NormSite.from_dict(s) for s in manifest.get("sites", [])]
        folded = [s.name for s in carry.final_norms(model, sites) if s.folded]
        if folded:
            raise NormswapError(
                f"{input_path}: the checkpoint holds {len(reading)} tensors the model class does not "
                f"run ({reading[0]}, ...), which may read the output of {folded[0]}, folded here; "
                "keep it unfolded (normswap.io.carry.keep_final_norms on the walk's sites before convert)"
            )
    return inputs


def _write_staged(stage: Staging, model, tokenizer, manifest: dict, inputs, source: str,
                  extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
                  extra_files: dict[str, str] | None = None) -> dict:  # fmt: skip
    """Write the checkpoint into ``stage.path``: the model (in the input's shard size), the tensors the model
    class does not run and the other files of the input (``inputs``), ``extra_tensors`` and ``extra_files``
    (see ``save_converted``), the manifest; every input tensor must have reached it. Returns the carried
    tensors' fingerprints (for the verification)."""
    from normswap.io import carry

    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    with stage.writing():
        write_checkpoint(model, tokenizer, manifest, stage.path, max_shard_size=inputs.shard_size)
        carried = carry.append_tensors(stage.path, inputs.folder, inputs.skipped, dtype, inputs.shard_size)
        write_extra_tensors(stage.path, extra_tensors or {})
        for relative, text in (extra_files or {}).items():
            (stage.path / relative).parent.mkdir(parents=True, exist_ok=True)
            files.write_text(stage.path / relative, text)
        carry.copy_files(inputs, stage.path)
    if inputs:  # what was copied is known only now (a file the output already held is not copied)
        manifest["carried"] = inputs.to_dict()
    else:  # nothing was: every file named before was one transformers had written
        manifest.pop("carried", None)
    carry.check_complete(source, inputs, stage.path, set(model.state_dict()))
    staging.at_stage("written")
    return carried


def write_extra_tensors(folder: str | os.PathLike, extra_tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write each ``{relative path: {name: tensor}}`` of ``extra_tensors`` as a safetensors file under
    ``folder`` (its subfolders made), each tensor moved to the CPU and made contiguous: a rotation's matrices
    (``normswap.rotate.ROTATION_FILE``), by the in-memory save and the streamed one alike.

    Raises:
        OSError, safetensors' errors: the write fails (the callers write into a staged folder).
    """
    from safetensors.torch import save_file

    for relative, tensors in extra_tensors.items():
        path = Path(folder) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        cpu = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        save_file(cpu, str(path))


def save_and_verify(
    loaded,
    report: dict[str, Any],
    out_dir: str | os.PathLike,
    input_ids: torch.Tensor,
    *,
    overwrite: bool = False,
    force: bool = False,
    inputs=None,
    input_path: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    stages=None,
    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    extra_files: dict[str, str] | None = None,
    check_extra=None,
):
    """What ``normswap convert`` does after the check: write, verify, and only then replace ``out_dir``.

    1. ``record_expected(loaded.model, input_ids)``: what the saved copy must reproduce;
    2. into a hidden folder beside ``out_dir`` (``Staging``): the checkpoint (``write_checkpoint``, in the
       input's shard size), the input tensors the model class does not run and the model card and licence
       files (``normswap.io.carry``, from ``inputs``), ``report`` as ``normswap.json``; every input tensor
       must have reached it (``carry.check_complete``);
    3. ``loaded.model`` is dropped (set to ``None``, so the fresh load needs one model's memory, not two)
       and the folder verified by a fresh load (``verify_saved``; the carried tensors by digest);
    4. passed (or ``force``): ``report`` with ``verify`` and ``saved`` becomes the final ``normswap.json``
       and the folder is exchanged with ``out_dir`` in one step. Failed: ``out_dir`` is left as it was.

    Args:
        loaded: a ``LoadedModel`` (its ``model`` converted and checked; ``tokenizer`` saved beside it).
        report: the manifest (``report_dict``); ``report["verify"]`` is set here.
        out_dir: the output directory.
        input_ids: the check's ``(1, T)`` ids (the first 16 are run by the verification).
        overwrite: replace an existing ``out_dir`` (an empty one or a normswap output only).
        force: replace ``out_dir`` even when the verification fails.
        inputs: ``normswap.io.carry.gather(...)`` for the input, or ``None``.
        input_path: the MODEL argument (refuses an ``out_dir`` inside it; named in messages).
        trust_remote_code: passed to the fresh load.
        stages: a ``normswap.progress.Stages`` that times the stages ``save`` and ``verify`` (their seconds
            go into ``report["timings"]`` and ``normswap.json``); a fresh one when ``None``.
        extra_tensors, extra_files: more files written with the checkpoint (see ``save_converted``).
        check_extra: ``folder -> list of failures``, run on the written folder with the verification (the
            rotation's saved ``Q`` against the one applied); a failure fails the verification.

    Returns:
        the ``VerifyResult``; ``out_dir`` holds the new checkpoint iff ``result.passed or force``.

    Raises:
        NormswapError: see ``check_output_dir``; another process is saving to ``out_dir``; a write fails;
            an input tensor would be lost. ``out_dir`` is then left as it was.
    """
    from normswap.io import carry
    from normswap.io.verify import record_expected, verify_saved

    out = check_output_dir(out_dir, input_path, overwrite=overwrite)
    inputs = inputs if inputs is not None else carry.InputFiles()
    expected = record_expected(loaded.model, input_ids)
    from normswap.progress import Stages

    stages = stages if stages is not None else Stages()
    with Staging(out, overwrite=overwrite) as stage:
        stages.start("save", str(out))
        expected.carried = _write_staged(
            stage, loaded.model, loaded.tokenizer, report, inputs, str(input_path), extra_tensors, extra_files
        )
        loaded.model = None  # the fresh load below then needs one model's memory, not two
        stages.start("verify", f"{out} by a fresh load")
        verified = verify_saved(stage.path, expected, trust_remote_code=trust_remote_code)
        if check_extra is not None:
            verified.failures += check_extra(stage.path)
            verified.passed = not verified.failures
        stages.stop()
        report["timings"] = dict(stages.timings)
        verified.path = str(out)
        report["verify"] = verified.to_dict()
        staging.at_stage("verified")
        if verified.passed or force:
            stage.commit(report | {"saved": True})
    return verified


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


def input_manifest(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """The ``normswap.json`` of an input model directory ``path`` (normswap wrote it), or ``None`` when it
    has none, is not a directory (a GGUF file's folder counts: pass the directory) or cannot be read."""
    if path is None:
        return None
    manifest = Path(path).expanduser() / MANIFEST
    try:
        data = json.loads(manifest.read_text()) if manifest.is_file() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_manifest(info: ModelInfo) -> dict[str, Any] | None:
    """The ``normswap.json`` of the model ``info`` describes (normswap wrote it), or ``None``: read from a
    model directory, or fetched from a hub repository (``huggingface_hub.hf_hub_download``, into its cache);
    ``None`` for a GGUF file, a repository without one, or a hub that cannot be reached (the conversion then
    goes on as for a model normswap did not write)."""
    if info.kind == "dir":
        return input_manifest(info.path)
    if info.kind != "hub":
        return None
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(info.path, MANIFEST)
    except Exception:  # noqa: BLE001 - no such file (most repositories), offline, gated: no manifest
        return None
    return input_manifest(Path(path).parent)


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    trainable_norm_weights: bool = False,
    **kwargs,
) -> torch.nn.Module:
    """Load a checkpoint written by ``normswap convert`` with its fused norm modules in place.

    The weights load with plain transformers (the Auto class of ``normswap.io.load.auto_class_name``:
    the model's own head); then every site the manifest marks ``swapped`` is rebuilt with
    ``NormSite.from_dict`` and ``normswap.swap.swap_norms`` installs the fused modules under the same
    module names. A folded RMSNorm whose checkpoint weight is the identity holds no weight (its scale is
    in the layers that read it; ``normswap.kernels.modules``): it is not among ``model.parameters()``.

    Args:
        path: the checkpoint directory.
        dtype: dtype to load in (default, or ``"auto"``: the dtype the checkpoint was saved in).
        trust_remote_code: allow transformers to run Python code shipped with the model.
        trainable_norm_weights: give every folded RMSNorm its identity weight as a trainable Parameter,
            as plain transformers loads it (one more multiply per norm call), to fine-tune norm weights.
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
    swap_norms(model, sites, identity_weights=not trainable_norm_weights)
    return model.eval()

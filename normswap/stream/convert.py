"""``normswap convert`` for a model larger than memory (or than ``--max-memory``): the pipeline, streamed.

Every step runs on one device (``--device``: the CPU or a GPU), with one module's weights there at a time:

1. walk: ``normswap.walk.walk`` on a streamed model (``stream.model``: norm parameters resident, every
   larger weight read from its shard as its module runs), on the first ids of the check as the in-memory
   convert does (``walk.short_inputs``: the walk keeps every activation it follows until it ends, ~0.9 GB on
   512 tokens of a 1.1B Llama, and the dataflow it records does not depend on the length);
2. reference logits of the original, streamed the same way (the localization records in a temporary file,
   ``stream.records``, so the memory does not grow with the layer count);
3. with ``--norm rmsnorm``, centering (``stream.transforms.center``: the in-memory plan, each change of a
   weight a transform applied as it is read); ``normswap.fold.plan``; untying proved on two streamed
   forwards as ``normswap.fold.untie_checked`` does;
4. every output shard written tensor by tensor with the plan applied (``stream.plan``), into a temporary
   directory beside the output, in the input's shard layout, with its index;
5. the check: the written checkpoint, streamed, with the fused norms swapped in, against the reference
   (``normswap.check.compare``: same text, tolerance policy and localization);
6. the temporary directory becomes the output with one rename (``normswap.io.save``), or is removed;
7. the output verified by a fresh streamed load (``stream.verify``: the digest of every tensor as written,
   the checked model's outputs); a failure removes it again unless ``force``.

Under ``accelerate launch`` (``torch.distributed`` initialized, ``stream.dist``) every process walks and
plans, process r writes the shards r, r+K, ...; process 0 writes the index, config, tokenizer and report,
runs the check and moves the directory into place.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap.errors import NormswapError
from normswap.stream import dist
from normswap.stream.model import Streamed, StreamedParameter, build, is_released
from normswap.stream.plan import layout, make_tensor, tensor_plans
from normswap.stream.records import DiskRecords
from normswap.stream.shards import INDEX, CheckpointReader, ShardWriter, nbytes, write_index
from normswap.stream.verify import fingerprint, record, verify_streamed
from normswap.walk import short_inputs


@dataclass
class Source:
    """A safetensors model directory opened for streaming: ``reader``, ``config``, ``tokenizer``, ``info``
    (``normswap.io.ModelInfo``) and ``dtype``."""

    reader: CheckpointReader
    config: Any
    tokenizer: Any
    info: Any
    dtype: torch.dtype

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
    """``"2GiB"``, ``"1.5GB"``, ``"512MiB"`` -> bytes (accelerate's ``convert_file_size_to_int``); a plain
    integer is bytes.

    Raises:
        NormswapError: not a size accelerate understands, or not positive.
    """
    from accelerate.utils import convert_file_size_to_int

    try:
        size = int(text) if text.strip().isdigit() else int(convert_file_size_to_int(text))
    except (ValueError, TypeError) as error:
        raise NormswapError(f"--max-memory {text!r} is not a size (examples: 2GiB, 1.5GB, 512MiB)") from error
    if size <= 0:
        raise NormswapError(f"--max-memory {text!r} must be positive")
    return size


# What a streamed conversion needs from a hub repository besides the weights: config, index, generation
# config and the tokenizer in any of its formats (Python files only with trust_remote_code).
HUB_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "vocab*", "merges*"]


def fetch_hub(repo_id: str, trust_remote_code: bool = False) -> str:
    """Fetch what streaming reads of hub repository ``repo_id`` into the Hugging Face cache; its path.

    First the small files (``HUB_FILES``), then only the safetensors files the index names (or
    ``model.safetensors``): a repository that also holds other copies of the weights (Mistral's
    ``consolidated.safetensors``, PyTorch ``.bin`` files) is not fetched twice. ``huggingface_hub`` writes
    each file to disk as it downloads (never whole in memory), resumes, and reuses the cache.

    Raises:
        NormswapError: the hub cannot be reached (offline), the repository or a file does not exist, or
            access is refused; one line.
    """
    from huggingface_hub import snapshot_download

    small = HUB_FILES + (["*.py"] if trust_remote_code else [])
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=small))
        index = path / INDEX
        weights = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
        path = Path(snapshot_download(repo_id, allow_patterns=small + (weights or ["model.safetensors"])))
    except Exception as error:  # noqa: BLE001 - huggingface_hub raises many kinds; each is one line here
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise NormswapError(f"{repo_id}: cannot fetch from the Hugging Face hub ({type(error).__name__}: "
                            f"{first})") from error  # fmt: skip
    return str(path)


def open_source(
    model: str, dtype: str, trust_remote_code: bool = False, tokenizer: str | None = None
) -> Source:
    """Open MODEL for streaming: a local directory with ``config.json`` and safetensors weights, or a hub
    id whose files are fetched into the Hugging Face cache first (``fetch_hub``). The tokenizer is
    ``tokenizer`` (a hub id or directory) if given, else MODEL's own, else ``None`` for a directory without
    tokenizer files (``normswap.io.load.load_tokenizer``; the check then runs on vocabulary ids).

    Every shard's header is checked here, before anything runs or is written.

    Raises:
        NormswapError: MODEL is not such a directory or hub id (a .gguf file), a hub id cannot be
            fetched, not a causal LM, has a missing/truncated/corrupt shard, or a tokenizer that cannot be
            loaded.
    """
    from normswap.io.load import ModelInfo, is_causal_lm, load_config, load_tokenizer, resolve, resolve_dtype

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
    if not is_causal_lm(config):
        raise NormswapError(f"{model}: --max-memory streams causal LMs only")
    reader = CheckpointReader(resolved.path)
    loaded_tokenizer = load_tokenizer(resolved, tokenizer, trust_remote_code=trust_remote_code)
    torch_type = resolve_dtype(dtype, resolved, config)
    from transformers import AutoModelForCausalLM

    architecture = AutoModelForCausalLM._model_mapping[type(config)].__name__
    info = ModelInfo(
        source=resolved.source, kind=kind, path=resolved.path, gguf_file=None, short_name=None,
        architecture=architecture, causal_lm=True, dtype=str(torch_type).removeprefix("torch."),
    )  # fmt: skip
    return Source(reader, config, loaded_tokenizer, info, torch_type)


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def unmap_freed_weights() -> None:
    """On glibc, serve every block of 128 KiB or more with its own memory map, returned to the OS when freed.

    By default glibc raises that threshold to the size of the last large block freed (up to 32 MiB), so the
    weights of a streamed forward come from the heap, where the small tensors allocated in between pin
    them: measured, the peak then grew by about 20 MB per Llama layer (hidden 1024). A fixed 1 MiB
    threshold left about 1 MB per layer: activations of 128 KiB-1 MiB (a k/v projection of 512 tokens,
    the check's float64 samples) fragment the heap. At 128 KiB (glibc's initial value, kept fixed) a
    streamed forward's RSS stays flat from layer to layer. Process-wide (``mallopt(M_MMAP_THRESHOLD)``);
    other allocators are left alone.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (also turns off the dynamic threshold)


def release_memory() -> None:
    """Return freed memory to the OS now: collect reference cycles (a forward's outputs, hooks) and, on
    glibc, trim the heap. Called between the stages, so one stage's tensors never add to the next one's."""
    import gc

    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc; other allocators keep their own policy
        libc.malloc_trim(0)


def _untie_checked(streamed: Streamed, folding, input_ids: torch.Tensor) -> list[str]:
    """``normswap.fold.untie_checked`` on a streamed model (same proof, same rule), each untied Parameter a
    placeholder read from the tensor it was tied to (``Streamed.copy``); returns the untied names."""
    from normswap.fold import untie_checked

    return untie_checked(streamed.model, folding, input_ids, copy=streamed.copy).names


def write_shards(
    reader: CheckpointReader,
    plans,
    folder: Path,
    files: list[str],
    written: dict | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """Write the output shards ``files`` (the input's shard names) into ``folder``, tensor by tensor, each
    made on ``device``; each tensor's ``stream.verify.fingerprint`` goes into ``written`` (name ->
    fingerprint) when given."""
    shards = layout(reader, plans)
    for file in files:
        writer = ShardWriter(folder / file, shards[file])
        try:
            for name, _, _ in shards[file]:
                tensor = make_tensor(reader, plans, name, device)
                if written is not None:
                    written[name] = fingerprint(tensor)
                writer.write(name, tensor)
                del tensor  # over 128 KiB: its own memory map, returned at once (unmap_freed_weights)
            writer.close()
            release_memory()  # once per shard: a collection costs ~0.1 s (28 s per 11 GB of bfloat16)
        except BaseException:
            writer.abort()
            raise


def _write_metadata(source: Source, plans, folder: Path, config) -> None:
    """Index (sharded inputs), config, generation config and tokenizer files of the output."""
    if source.reader.sharded:
        shards = layout(source.reader, plans)
        weight_map = {name: file for file, entries in shards.items() for name, _, _ in entries}
        total = sum(nbytes(d, s) for entries in shards.values() for _, d, s in entries)
        write_index(folder, weight_map, total)
    config.save_pretrained(folder)
    generation = Path(source.reader.folder) / "generation_config.json"
    if generation.is_file():
        shutil.copyfile(generation, folder / "generation_config.json")
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(folder)


def convert_streamed(
    source: Source,
    output: Path,
    input_ids: torch.Tensor,
    *,
    untie: bool = True,
    force: bool = False,
    overwrite: bool = False,
    step=lambda message: None,
    norm: str = "keep",
    device: torch.device | str = "cpu",
    choice=None,
) -> tuple[dict[str, Any], bool]:
    """Convert ``source`` into ``output`` with bounded memory (see the module docstring).

    Args:
        source: from ``open_source``.
        output: the output directory (checked by ``normswap.io.check_output_dir`` by the caller).
        input_ids: ``(1, T)`` ids of the check (and of the walk, as in memory).
        untie: allow untying a tied ``lm_head`` to fold the final norm into it.
        norm: ``"keep"``, or ``"rmsnorm"``: center the LayerNorms into RMSNorms first
            (``stream.transforms.center``, as ``normswap.convert`` does in memory).
        device: where the weights are read to and every forward and fold runs (one module's weights at a
            time; see ``stream.model.build``).
        choice: ``normswap.memory.Choice`` that chose streaming (its budget and reason go into the report's
            ``streamed`` entry).
        force: move the output into place even when the check fails.
        overwrite: replace an existing output directory.
        step: called with a progress message before each stage.

    Returns:
        ``(report dict as normswap.json holds it, whether the check passed)``. When the output was moved
        into place, the report's ``"verify"`` holds ``stream.verify.verify_streamed``'s result on it; a
        failed verification without ``force`` removes the output again (``verify.passed`` False).

    Raises:
        NormswapError: bad input, a model that cannot be streamed, or a write the disk refuses; the
            output directory is then untouched.
    """
    from normswap.check import compare, reference_outputs
    from normswap.convert import ConvertReport
    from normswap.fold import plan
    from normswap.io import files
    from normswap.io.save import MANIFEST, _remove_stale, _replace_dir, report_dict
    from normswap.swap import swap_norms
    from normswap.walk import walk

    out = Path(output).expanduser().resolve()
    unmap_freed_weights()
    # the localization records of the check (a few positions at every probe point: O(layers)) go to a file
    spill = out.parent if out.parent.is_dir() and os.access(out.parent, os.W_OK) else None

    def records():
        return DiskRecords(spill)

    streamed = build(source.config, source.reader, source.dtype, device)
    step("finding the norms and their consumers (streamed) ...")
    walk_ids = short_inputs(input_ids)
    traced = _guarded(lambda: walk(streamed.model, walk_ids), source)
    if not traced.sites:
        raise NormswapError(f"{source.info.source}: no normalization modules found; nothing to convert")
    release_memory()
    reference = None
    if dist.is_main():  # only the main process checks
        step(f"running the original on {input_ids.shape[-1]} tokens (streamed) ...")
        reference = _guarded(
            lambda: reference_outputs(streamed.model, input_ids, sites=traced.sites, records=records), source
        )
    release_memory()
    centered = None
    if norm == "rmsnorm":
        from normswap.stream.transforms import center

        step("centering the LayerNorms' inputs (streamed) ...")
        centered = _guarded(lambda: center(streamed, traced, walk_ids, untie=untie), source)
        release_memory()
    step("planning the folds (each consumer weight read once) ...")
    folding = plan(streamed.model, traced, untie=untie, read=lambda name: _values(streamed.model, name))
    untied = _guarded(lambda: _untie_checked(streamed, folding, input_ids), source) if untie else []
    if centered is not None:  # centering may untie an embedding written into the residual stream
        untied = centered.untied + untied
    plans = tensor_plans(streamed, folding, source.dtype)
    config = streamed.model.config
    streamed.close()  # holds only the 1-D parameters from here on
    release_memory()
    lock = contextlib.ExitStack()  # held by the main process from here to the end, as save_converted does

    def take_lock():
        lock.enter_context(files.output_lock(out))
        _remove_stale(out)

    built = dist.shared_tempdir(out, prepare=take_lock)
    try:
        step(f"writing {len(source.reader.files)} shard(s) ...")
        mine = dist.my_share(source.reader.files)
        written: dict[str, tuple] = {}
        dist.all_ok(lambda: write_shards(source.reader, plans, built, mine, written, device))
        written = dist.merged(written)
        for site in folding.sites:
            site.folded = True
        report = ConvertReport(
            model=source.info.source, norm=norm, norms_found=len(traced.sites),
            norms_folded=len(folding.sites), norms_swapped=0, sites=traced.sites, untied=untied,
            untie_bytes=folding.untie_bytes + (centered.untie_bytes if centered else 0),
            untouched=traced.untouched,
        )  # fmt: skip
        for site in traced.sites:
            if site.foldable and not site.folded:
                site.reason = site.reason or "not folded"
        passed = True
        if dist.is_main():
            _write_metadata(source, plans, built, config)
            release_memory()
            step("checking the converted logits (streamed) ...")
            converted = build(config, CheckpointReader(built), source.dtype, device)
            report.norms_swapped = swap_norms(converted.model, traced.sites)
            checked = _guarded(
                lambda: compare(reference, converted.model, input_ids, records=records), source
            )
            reference = None
            passed = bool(checked.passed)
            expected = None
            if passed or force:  # what the saved copy must reproduce
                expected = _guarded(lambda: record(converted.model, input_ids, written, source.dtype), source)
            converted.close()
            peak = max(streamed.peak, converted.peak)
            del converted, written
            report.check = checked.to_dict()
            data = report_dict(report, source.info)
            data["streamed"] = {
                "shards": len(source.reader.files), "processes": dist.world_size(), "device": str(device),
                "budget": choice.budget if choice is not None else None, "peak_weight_bytes": peak,
                **device_peak(device), "choice": choice.to_dict() if choice is not None else None,
            }  # fmt: skip
            (built / MANIFEST).write_text(files.to_json(data))
            if passed or force:
                files.apply_umask(built)
                if out.exists() and not overwrite:  # created while this process was converting
                    raise NormswapError(f"output directory {out} already exists; pass overwrite=True")
                _replace_dir(built, out, overwrite)
                release_memory()
                step(f"verifying {out} by a fresh load (streamed) ...")
                verified = _guarded(lambda: verify_streamed(out, expected, device), source)
                data["verify"] = verified.to_dict()
                if verified.passed or force:
                    (out / MANIFEST).write_text(files.to_json(data))
                else:
                    shutil.rmtree(out, ignore_errors=True)
        else:
            data = {}
        passed = dist.broadcast(passed)
        return data, passed
    except NormswapError:
        raise
    except Exception as error:  # any writer's exception type: OSError, SafetensorError, ...
        raise files.write_error(out, error) from error
    finally:
        dist.barrier()
        if dist.is_main():
            shutil.rmtree(built, ignore_errors=True)
            lock.close()


def device_peak(device: torch.device | str) -> dict[str, int]:
    """``{"peak_device_bytes": N}``: the most memory torch allocated on a CUDA ``device`` so far; ``{}``
    elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"peak_device_bytes": int(torch.cuda.max_memory_allocated(device))}


def _values(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Parameter ``name`` of a streamed model with its values (read from the checkpoint when released)."""
    p = model.get_parameter(name)
    return copy.deepcopy(p) if isinstance(p, StreamedParameter) and is_released(p) else p


def _guarded(fn, source: Source):
    """Run ``fn``; a forward that reads a streamed weight outside its module becomes one clear line."""
    try:
        return fn()
    except RuntimeError as error:
        if "storage" in str(error) and "size 0" in str(error):
            raise NormswapError(
                f"{source.info.source}: cannot be streamed: a weight is read outside the module that holds "
                f"it ({str(error).splitlines()[0]})"
            ) from error
        raise

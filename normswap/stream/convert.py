"""``normswap convert`` for a model larger than memory (or than ``--max-memory``): the pipeline, streamed.

Every step runs on one device (``--device``: the CPU or a GPU), with one module's weights there at a time:

1. walk: ``normswap.walk.walk`` on a streamed model (``stream.model``: norm parameters resident, every
   larger weight read from its shard as its module runs), on the first ids of the check as the in-memory
   convert does (``walk.short_inputs``: the walk keeps every activation it follows until it ends, ~0.9 GB on
   512 tokens of a 1.1B Llama, and the dataflow it records does not depend on the length);
2. reference logits of the original, streamed the same way (the localization records in a temporary file,
   ``stream.records``, so the memory does not grow with the layer count);
3. ``normswap.convert.convert`` itself, on the streamed model with its weights as the store
   (``stream.store.ShardStore``): the rotation's plan, centering, the fold plan, the untie proof and the
   rotation, the in-memory steps in their order, each change of a weight on disk a transform applied as it
   is read; the folds are left as records for the writer;
4. every output shard written tensor by tensor with the plan applied (``stream.plan``), into a hidden
   folder beside the output (``normswap.io.staging.Staging``), in the input's shard layout, with its index;
   every checkpoint tensor is written, also those the model class does not run (``stream.model.build``:
   ``Streamed.skipped``; the final norm then stays unfolded, ``normswap.io.carry``); a rotation's matrices
   in ``normswap.rotate.ROTATION_FILE``;
5. the check: the written checkpoint, streamed, with the fused norms swapped in, against the reference
   (``normswap.check.compare``: same text, tolerance policy and localization; a rotated model's reference
   records mapped through ``Q`` by ``normswap.rotate.rotate_reference``, as in memory);
6. the folder verified by a fresh streamed load (``stream.verify``: the digest of every tensor as written,
   the checked model's outputs; the saved rotation matrices against those applied);
7. passed (or ``force``): the folder is exchanged with the output in one step; otherwise it is removed and
   the output is left as it was.

Under ``accelerate launch`` (``torch.distributed`` initialized, ``stream.dist``) every process walks and
plans, process r writes the shards r, r+K, ...; process 0 holds the output's lock, writes the index, config,
tokenizer and report, runs the check and the verification and exchanges the folder with the output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap import progress
from normswap.errors import NormswapError
from normswap.io import carry, staging
from normswap.io.shards import INDEX, CheckpointReader, ShardWriter, nbytes, write_index
from normswap.stream import dist
from normswap.stream.model import build
from normswap.stream.plan import by_rows, layout, make_pieces, make_row_pieces, make_tensor, tensor_plans
from normswap.stream.records import DiskRecords
from normswap.stream.store import ShardStore, release_memory, unmap_freed_weights
from normswap.stream.verify import fingerprint, record, verify_streamed
from normswap.walk import short_inputs


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


def write_shards(
    reader: CheckpointReader,
    plans,
    folder: Path,
    files: list[str],
    written: dict | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """Write the output shards ``files`` (the input's shard names) into ``folder``, tensor by tensor, each
    made on ``device``; each tensor's ``stream.verify.fingerprint`` goes into ``written`` (name ->
    fingerprint) when given. Returns the most bytes of made tensors held at once (a whole expert stack,
    where one is made whole).

    A checkpoint tensor that is a piece of an assembled parameter (``stream.assemble``: one expert's
    ``gate_proj``) is split from that parameter, made whole (``make_pieces``); the pieces are held until each
    of them in ``files`` is written (safetensors orders a shard's tensors by name, so two groups of a layer
    interleave), then released. A group made by rows (``plan.by_rows``: a stack of experts folded along its
    input axis) is made one expert at a time (``make_row_pieces``), and that expert's tensors of the same
    shard are written at once, each at its offset (``ShardWriter.put``; the file's order is the input's), so
    the write holds one expert's tensors, not the layer's experts (a copy of those that go into a later
    shard)."""
    shards = layout(reader, plans)
    wanted: dict[int, set[str]] = {}  # id(group) -> its pieces still to be written by this call
    for file in files:
        for name, _, _ in shards[file]:
            if plans[name].piece_of is not None:
                wanted.setdefault(id(plans[name].piece_of), set()).add(name)
    pieces: dict = {}  # id(group) (or (id(group), row)) -> its output tensors not yet written
    rowwise: dict[int, dict[str, int]] = {}  # id(group) -> its checkpoint tensor -> row, when made by rows
    shard_names = {file: {name for name, _, _ in shards[file]} for file in files}
    most = 0

    def holding(*made: torch.Tensor) -> None:  # the pieces kept for later, and what was just made
        nonlocal most
        kept = sum(t.nbytes for held in pieces.values() for t in held.values())
        most = max(most, kept + sum(t.nbytes for t in made))

    for tp in plans.values():
        group = tp.piece_of
        if group is not None and id(group) not in rowwise and by_rows(plans, group):
            rowwise[id(group)] = {key: i for i in range(group.slots) for _, key in group.slot_sources(i)}
    for file in files:
        writer = ShardWriter(folder / file, shards[file])
        try:
            for name, _, _ in shards[file]:
                if writer.written(name):  # with its expert's other tensors (below)
                    continue
                group = plans[name].piece_of
                if group is None:
                    tensor = make_tensor(reader, plans, name, device)
                    holding(tensor)
                elif id(group) in rowwise:  # one expert's tensors at a time, written at once where they go
                    i = rowwise[id(group)][name]
                    if (id(group), i) not in pieces:
                        made = make_row_pieces(reader, plans, group, i, device)
                        holding(*made.values())
                        for key in [k for k in made if k != name and k in shard_names[file]]:
                            piece = made.pop(key)
                            if written is not None:
                                written[key] = fingerprint(piece)
                            writer.put(key, piece)
                            wanted[id(group)].discard(key)
                            del piece
                        later = {
                            k: t.clone() for k, t in made.items() if k != name and k in wanted[id(group)]
                        }
                        pieces[(id(group), i)] = {name: made.pop(name), **later}  # another shard's: copied
                        del made  # (a view would hold the whole row)
                    tensor = pieces[(id(group), i)].pop(name).contiguous()
                    wanted[id(group)].discard(name)
                    if not pieces[(id(group), i)]:
                        del pieces[(id(group), i)]
                else:
                    if id(group) not in pieces:
                        pieces[id(group)] = make_pieces(reader, plans, group, device)
                        holding()
                    tensor = pieces[id(group)].pop(name).contiguous()
                    wanted[id(group)].discard(name)
                    if not wanted[id(group)]:
                        del pieces[id(group)]
                if written is not None:
                    written[name] = fingerprint(tensor)
                writer.write(name, tensor)
                del tensor  # over 128 KiB: its own memory map, returned at once (unmap_freed_weights)
            writer.close()
            release_memory()  # once per shard: a collection costs ~0.1 s (28 s per 11 GB of bfloat16)
        except BaseException:
            writer.abort()
            raise
        staging.at_stage("shard")
    return most


def _write_metadata(source: Source, plans, folder: Path, config, inputs) -> None:
    """Index (sharded inputs), config, generation config and tokenizer files of the output; the other files
    of the input (``inputs``, ``normswap.io.carry``: model card, licence, the model's own code, ...)."""
    if source.reader.sharded:
        shards = layout(source.reader, plans)
        weight_map = {name: file for file, entries in shards.items() for name, _, _ in entries}
        total = sum(nbytes(d, s) for entries in shards.values() for _, d, s in entries)
        write_index(folder, weight_map, total)
    config.save_pretrained(folder)
    generation = Path(source.reader.folder) / "generation_config.json"
    if generation.is_file():  # part of the checkpoint, as save_pretrained writes it in memory
        shutil.copyfile(generation, folder / "generation_config.json")
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(folder)
    carry.copy_files(inputs, folder)  # model card, licence, the model's own code, ...


def convert_streamed(
    source: Source,
    output: Path,
    input_ids: torch.Tensor,
    *,
    untie: bool = True,
    force: bool = False,
    overwrite: bool = False,
    stages=None,
    keep_hidden_states: bool = False,
    norm: str = "keep",
    device: torch.device | str = "cpu",
    choice=None,
    rotate: str | None = None,
    rotate_seed: int = 0,
    rotate_heads: bool = False,
    check_input: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Convert ``source`` into ``output`` with bounded memory (see the module docstring).

    Args:
        source: from ``open_source``.
        output: the output directory (checked by ``normswap.io.check_output_dir`` by the caller).
        input_ids: ``(1, T)`` ids of the check (and of the walk, as in memory).
        untie: allow untying a tied ``lm_head`` to fold the final norm into it.
        norm: ``"keep"``, or ``"rmsnorm"``: center the LayerNorms into RMSNorms first (as
            ``normswap.convert`` does in memory).
        rotate, rotate_seed, rotate_heads: rotate the residual stream (``"hadamard"`` or ``"random"``), as
            ``normswap.convert`` does in memory: the same tensors, ``ROTATION_FILE`` and records, bit for bit
            (a LayerNorm stream centered first where it can be).
        device: where the weights are read to and every forward and fold runs (one module's weights at a
            time; see ``stream.model.build``).
        choice: ``normswap.memory.Choice`` that chose streaming (its budget and reason go into the report's
            ``streamed`` entry).
        force: move the output into place even when the check fails.
        overwrite: replace an existing output directory.
        stages: a ``normswap.progress.Stages`` that times the stages walk, reference, convert (the plan,
            the untie proof and the shards written with the folds applied), check, save, verify; the
            report's ``timings`` has them (a fresh one when ``None``).
        keep_hidden_states: as ``normswap.convert``'s: the final norm is not folded, and the check requires
            every returned hidden state to match.
        check_input: what ``input_ids`` are (the CLI's ``check_input`` entry), recorded in the report and
            ``normswap.json`` as in memory.

    Returns:
        ``(report dict as normswap.json holds it, whether the check passed)``. When the check passed (or
        ``force``), the report's ``"verify"`` holds ``stream.verify.verify_streamed``'s result on the
        written folder; the output is replaced only when that passed (or ``force``), else left as it was.

    Raises:
        NormswapError: bad input, a model that cannot be streamed, or a write the disk refuses; the
            output directory is then untouched. ``normswap.rotate.RotationError`` (one): a rotation refused
            by its plan (before anything is written), or a rotated weight beyond its dtype's range (found as
            it is written: the hidden folder is removed, the output untouched).
    """
    from normswap import files
    from normswap.check import compare, reference_outputs, reload_original
    from normswap.convert import already_converted, convert, no_norms_message, stream_transform
    from normswap.io.save import input_manifest, report_dict
    from normswap.io.staging import MANIFEST, Staging
    from normswap.progress import Stages
    from normswap.swap import swap_norms
    from normswap.walk import walk

    out = Path(output).expanduser().resolve()
    unmap_freed_weights()
    # the localization records of the check (a few positions at every probe point: O(layers)) go to a file
    spill = out.parent if out.parent.is_dir() and os.access(out.parent, os.W_OK) else None

    def records():
        return DiskRecords(spill)

    stages = stages if stages is not None else Stages()
    trusted = source.trust_remote_code
    streamed = build(source.config, source.reader, source.dtype, device, trust_remote_code=trusted)
    store = ShardStore(streamed, source.info.source)
    inputs = carry.gather(source.info)  # the other files of the input
    inputs.skipped = streamed.skipped  # tensors the class does not run: every checkpoint tensor is written
    if norm != "keep" or rotate is not None:
        option = f"--norm {norm}" if rotate is None else f"--rotate {rotate}"
        carry.refuse_changed_stream(source.info.source, streamed.model, inputs.skipped, option)
    stages.start("walk", "finding the norms and their consumers (streamed)")
    walk_ids = short_inputs(input_ids)
    traced = store.run(lambda: walk(streamed.model, walk_ids, keep_hidden_states=keep_hidden_states))
    if not traced.sites:
        raise NormswapError(f"{source.info.source}: {no_norms_message(traced)}; nothing to convert")
    manifest = input_manifest(source.info.path)
    already_converted(source.info.source, streamed.model, traced.sites, norm, manifest, rotate=rotate)
    inputs.kept = carry.keep_final_norms(streamed.model, traced.sites, inputs.skipped)
    store.settle()
    reference = None
    if dist.is_main():  # only the main process checks
        stages.start("reference", f"running the original on {input_ids.shape[-1]} tokens (streamed)")
        rerun = reload_original(lambda: _original(source, device))
        reference = store.run(
            lambda: reference_outputs(
                streamed.model, input_ids, sites=traced.sites, records=records, rerun=rerun
            )
        )
    store.settle()
    stages.start("convert", f"folding the norms into {len(source.reader.files)} shard(s) as they are written")
    embeds = None
    if dist.is_main() and (norm == "rmsnorm" or rotate is not None):  # to prove the inputs_embeds map
        from normswap.center.inputs import original_embeds

        embeds = store.run(lambda: original_embeds(streamed.model, input_ids))
    # the in-memory steps (centering, the plans, untying, the rotation), each change of a weight on disk
    # a transform; the folds are applied as the shards are written
    report = convert(streamed.model, norm=norm, untie=untie, swap=False, input_ids=walk_ids, traced=traced,
                     rotate=rotate, rotate_seed=rotate_seed, rotate_heads=rotate_heads,
                     keep_hidden_states=keep_hidden_states, store=store)  # fmt: skip
    rotation = report.rotation
    plans = tensor_plans(streamed, store.writes, source.dtype)
    config = streamed.model.config
    streamed.close()  # holds only the 1-D parameters from here on
    store.settle()
    stage = contextlib.ExitStack()  # the main process's Staging, held from here to the end
    staged: list[Staging] = []

    def make() -> Path:  # main process: the output's lock and the hidden folder beside it
        staged.append(stage.enter_context(Staging(out, overwrite=overwrite)))
        return staged[0].path

    built = dist.shared_folder(make)
    try:
        mine = dist.my_share(source.reader.files)
        written: dict[str, tuple] = {}
        # the most bytes of made tensors this process held at once
        write_peak = dist.all_ok(lambda: write_shards(source.reader, plans, built, mine, written, device))
        written = dist.merged(written)
        passed = True
        if dist.is_main():
            _write_metadata(source, plans, built, config, inputs)
            if rotation is not None:  # the matrices applied, as the in-memory save writes them
                from normswap.io.save import write_extra_tensors
                from normswap.rotate import ROTATION_FILE, rotate_reference

                write_extra_tensors(built, {ROTATION_FILE: rotation.saved_tensors()})
                rotate_reference(reference, rotation)  # the original's stream records, as the rotated model
            store.settle()
            stages.start("check", "comparing the converted model's outputs with the original's (streamed)")
            written_reader = CheckpointReader(built)
            converted = build(config, written_reader, source.dtype, device, trust_remote_code=trusted)
            report.norms_swapped = swap_norms(converted.model, traced.sites)
            checked = store.run(
                lambda: compare(
                    reference,
                    converted.model,
                    input_ids,
                    records=records,
                    transform=stream_transform(report),
                    keep_hidden_states=keep_hidden_states,
                )
            )
            extra = {}
            if rotation is not None:  # normswap/inputs_embeds.json, proved on the check's ids as in memory
                from normswap.check.maps import prove_rotated

                matrices = {name: m.values for name, m in rotation.matrices.items()}
                extra = store.run(lambda: prove_rotated(rotation.inputs, reference, converted.model, embeds,
                                                        matrices, checked))  # fmt: skip
            else:  # centering.json, proved on the check's ids as in memory
                from normswap.check.maps import prove_centered

                extra = store.run(lambda: prove_centered(report.centering, reference, converted.model, embeds,
                                                         checked))  # fmt: skip
            for name, text in extra.items():
                (built / name).parent.mkdir(parents=True, exist_ok=True)
                files.write_text(built / name, text)
            reference = embeds = None
            passed = bool(checked.passed)
            expected = None
            if passed or force:  # what the saved copy must reproduce
                expected = store.run(lambda: record(converted.model, input_ids, written, source.dtype))
            converted.close()
            peak = max(streamed.peak, converted.peak, write_peak)
            del converted, written
            report.check = checked.to_dict()
            data = report_dict(report, source.info)
            data["streamed"] = {
                "shards": len(source.reader.files), "processes": dist.world_size(), "device": str(device),
                "budget": choice.budget if choice is not None else None, "peak_weight_bytes": peak,
                **device_peak(device), "choice": choice.to_dict() if choice is not None else None,
            }  # fmt: skip
            if rotation is not None:  # the rotation's float64 matrices and one tensor's temporaries
                from normswap.rotate.apply import rotation_bytes

                largest = max((t.nbytes // t.dtype.itemsize for t in source.reader.tensors.values()),
                              default=0)  # fmt: skip
                heads = rotation.matrices.get("H")
                data["streamed"]["rotation_bytes"] = rotation_bytes(
                    rotation.Q.shape[0], heads.size if heads is not None else 0, tensor_numel=largest,
                    tensor_bytes=largest * source.dtype.itemsize,
                )  # fmt: skip
            if check_input is not None:
                data["check_input"] = check_input
            if inputs:
                data["carried"] = inputs.to_dict()
            stages.start("save", f"{out} (the shards are written; its manifest, then the exchange)")
            files.write_json(built / MANIFEST, data)
            staging.at_stage("written")
            if passed or force:  # verified where it was written; it replaces the output only then
                store.settle()
                stages.start("verify", f"{out} by a fresh load (streamed)")
                verified = store.run(lambda: verify_streamed(built, expected, trusted, device))
                if rotation is not None:
                    from normswap.rotate import check_saved

                    verified.failures += check_saved(built, rotation)
                    verified.passed = not verified.failures
                stages.stop()
                verified.path = str(out)
                data["verify"] = verified.to_dict()
                data["timings"] = dict(stages.timings)
                staging.at_stage("verified")
                if verified.passed or force:
                    stages.start("save", f"{out}: replacing it by the verified checkpoint")
                    stages.stop()
                    data["timings"] = dict(stages.timings)
                    staged[0].commit(data | {"saved": True})
            stages.stop()
            data["timings"] = dict(stages.timings)
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
            stage.close()


def device_peak(device: torch.device | str) -> dict[str, int]:
    """``{"peak_device_bytes": N}``: the most memory torch allocated on a CUDA ``device`` so far; ``{}``
    elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"peak_device_bytes": int(torch.cuda.max_memory_allocated(device))}


def _original(source: Source, device) -> torch.nn.Module:
    """The original model again, streamed over the input's shards (which the conversion never changes):
    the check's float64 rule runs it (``normswap.check.reload_original``)."""
    return build(
        source.config, source.reader, source.dtype, device, trust_remote_code=source.trust_remote_code
    ).model

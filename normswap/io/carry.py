"""What a conversion carries over from the input directory besides the model it loaded.

* **Tensors the model class does not run.** transformers drops, by design, every checkpoint tensor that a
  model class's ``_keys_to_ignore_on_load_unexpected`` matches: DeepSeek-V3's multi-token-prediction (MTP)
  layer ``model.layers.61.*``, GLM-4.5's, Qwen3-Next's ``mtp.*``. Serving stacks use them (speculative
  decoding), so they must reach the output. They are found by comparing tensor names, not from a list of
  architectures: the names in the input's safetensors headers (or ``.bin`` files, ``InputTensors``),
  minus the names the loaded model writes (``saved_names``: its state dict, and the names transformers'
  ``save_pretrained`` turns it back into). They are copied as they are, floating tensors cast to the
  conversion's dtype like every other tensor (``append_tensors``), and verified by digest.
  Their inputs cannot be traced (the class never runs them); MTP layers read the embeddings and the target
  model's final hidden state, which serving stacks may take after the final norm. A conversion that keeps
  both (folding leaves the embeddings and the residual stream alone) keeps the final norm unfolded
  (``keep_final_norms``); one that changes them (``--norm rmsnorm`` centers the residual stream) is
  refused before anything is written (``refuse_changed_stream``). Stale buffers that transformers drops
  by its generic rule (an old checkpoint's per-layer ``rotary_emb.inv_freq``) are carried too, but read
  no hidden state (``may_read_outputs``).
* **Every other file of the input directory** (``extra_files``): the model card and licence files, a
  processor's or a sentence-transformers pipeline's configuration (``preprocessor_config.json``,
  ``modules.json``, ``1_Pooling/config.json``), chat templates, the model's own code. Subfolders are
  walked; hidden entries (``.git``, ``.cache``) are not. A file the output already holds (written by
  transformers or normswap: ``config.json``, tokenizer files, ...) is never overwritten, and the input's
  ``normswap.json`` is not a file to copy at all (the output's records its own conversion). Not copied, and
  named in the report with the reason: the input checkpoint's own weight files (the output holds the
  converted weights), weights of the original in another format or training state (``*.bin``, ``*.pt``,
  ``*.onnx``, ``*.h5``, ...: they would not match the converted model), files larger than
  ``FILE_LIMIT``, and, from an input that normswap wrote (it holds a ``normswap.json``), the records of
  that input's own conversion (``OWN_RECORDS``: ``centering.json``, ``normswap/inputs_embeds.json``,
  ``normswap/rotation.safetensors``): they describe it against its original, and the output's own
  ``normswap.json`` and files describe the new conversion against the input given.
* **Shard size.** A sharded input's output is written in shards of at most its largest shard's size.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap.errors import NormswapError

FILE_LIMIT = 64 << 20  # bytes: configuration, templates, cards and code are far smaller; larger: named
# suffixes of weight and training-state files: the original's, so never copied beside the converted weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                   ".onnx_data", ".tflite", ".ot", ".npz", ".npy", ".pkl", ".pickle", ".joblib")  # fmt: skip
CHECKPOINT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class InputFiles:
    """What of the input directory a conversion carries over (see the module docstring).

    Attributes:
        folder: the input directory (``None``: a GGUF file, or a hub id not in the local cache).
        skipped: checkpoint tensors the model class does not hold, in checkpoint order.
        files: the other files of the input directory to copy (``extra_files``), paths relative to it.
        not_copied: ``{path: reason}`` for the files of the input directory that are not copied.
        shard_size: bytes of the largest shard when the input is sharded, else ``None``.
        kept: norms kept unfolded because ``skipped`` may read their output (``keep_final_norms``).
        names: every tensor name of the input's safetensors (or .bin) files (checked against the output).
    """

    folder: Path | None = None
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    not_copied: dict[str, str] = field(default_factory=dict)
    shard_size: int | None = None
    kept: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        """The report's ``carried`` entry."""
        return {
            "tensors": list(self.skipped),
            "reason": "the model class does not run them (transformers skips them on load); copied unchanged"
            if self.skipped
            else None,
            "norms_kept_unfolded": list(self.kept),
            "files": list(self.files),
            "not_copied": [f"{name} ({why})" for name, why in self.not_copied.items()],
        }

    def __bool__(self) -> bool:
        """Whether the report needs a ``carried`` entry."""
        return bool(self.skipped or self.files or self.not_copied)


def input_folder(resolved) -> Path | None:
    """The directory holding the input's files: a model directory, or a hub id's snapshot in the local
    Hugging Face cache (where ``from_pretrained`` put its files); ``None`` for a GGUF file."""
    if resolved.gguf_file:
        return None
    if resolved.kind != "hub":
        return Path(resolved.path)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(resolved.path, "config.json")
    except Exception:  # noqa: BLE001 - no cache entry is no folder
        return None
    return Path(found).parent if isinstance(found, str) else None


def _checkpoint_files(folder: Path) -> set[str]:
    """The input checkpoint's own weight files in ``folder`` (rewritten as the output's weights): its
    safetensors files, else its PyTorch ``.bin`` files, with their index."""
    safetensors = {p.name for p in folder.glob("*.safetensors")}
    if safetensors:
        return safetensors | {CHECKPOINT_INDEXES[0]}
    return {p.name for p in folder.glob("pytorch_model*.bin")} | {CHECKPOINT_INDEXES[1]}


OWN_RECORDS = ("centering.json", "normswap/inputs_embeds.json", "normswap/rotation.safetensors")


def extra_files(folder: Path) -> tuple[list[str], dict[str, str]]:
    """``(files to copy, {file: why not copied})``: every file under ``folder`` but its checkpoint (see the
    module docstring), as paths relative to ``folder`` with ``/``; symlinks are followed."""
    checkpoint = _checkpoint_files(folder)
    copy, not_copied = [], {}
    if (folder / "normswap.json").is_file():  # the input is a normswap output: its records are not ours
        why = "normswap's record of the input's own conversion; the output's normswap.json records this one"
        not_copied |= {rel: why for rel in OWN_RECORDS if (folder / rel).is_file()}
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if name.startswith(".") or not path.is_file() or rel in checkpoint or rel in not_copied:
                continue
            if rel == "normswap.json":  # the output's own manifest, never a copy: it records this conversion
                continue
            if rel.lower().endswith(WEIGHT_SUFFIXES) or rel.endswith(CHECKPOINT_INDEXES):
                not_copied[rel] = "weights or training state of the original, not the converted model's"
            elif path.stat().st_size > FILE_LIMIT:
                limit = f"{FILE_LIMIT >> 20} MiB" if FILE_LIMIT >= 1 << 20 else f"{FILE_LIMIT} bytes"
                not_copied[rel] = f"larger than {limit}"
            else:
                copy.append(rel)
    return sorted(copy), dict(sorted(not_copied.items()))


def checkpoint_tensors(folder: Path) -> list[str]:
    """The tensor names in ``folder``'s safetensors headers, in checkpoint order (``[]`` without any)."""
    from normswap.io.shards import INDEX, SINGLE, CheckpointReader

    if not (folder / INDEX).is_file() and not (folder / SINGLE).is_file():
        return []
    reader = CheckpointReader(folder)
    return sorted(reader.tensors, key=lambda n: (reader.tensors[n].file, reader.tensors[n].start))


class InputTensors:
    """The tensors of an input checkpoint directory, read one at a time: safetensors files (headers checked,
    ``normswap.io.shards.CheckpointReader``) or PyTorch ``.bin`` files (``torch.load`` memory-mapped,
    tensors only); ``names`` is empty for a directory with neither.

    Raises:
        NormswapError: a safetensors file that is truncated or corrupt, or a ``.bin`` file that does not load.
    """

    BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"

    def __init__(self, folder: Path):
        from normswap.io.shards import INDEX, SINGLE, CheckpointReader

        self.folder = Path(folder)
        self._reader, self._files, self._loaded = None, {}, {}
        if (self.folder / INDEX).is_file() or (self.folder / SINGLE).is_file():
            self._reader = CheckpointReader(self.folder)
            self.names = checkpoint_tensors(self.folder)
        elif (self.folder / self.BIN_INDEX).is_file():
            try:
                self._files = dict(json.loads((self.folder / self.BIN_INDEX).read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise NormswapError(f"{self.folder / self.BIN_INDEX}: not a valid index ({error})") from error
            self.names = list(self._files)
        elif (self.folder / self.BIN_SINGLE).is_file():
            self.names = list(self._load(self.BIN_SINGLE))
            self._files = dict.fromkeys(self.names, self.BIN_SINGLE)
        else:
            self.names = []

    def _load(self, file: str) -> dict:
        if file not in self._loaded:
            try:
                self._loaded[file] = torch.load(
                    self.folder / file, map_location="cpu", mmap=True, weights_only=True
                )
            except Exception as error:  # noqa: BLE001 - pickle, zip and OS errors: one line
                raise NormswapError(f"cannot read {self.folder / file}: {error}") from error
        return self._loaded[file]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of tensor ``name`` as stored."""
        if self._reader is not None:
            info = self._reader.tensors[name]
            return info.dtype, tuple(info.shape)
        tensor = self._load(self._files[name])[name]
        return tensor.dtype, tuple(tensor.shape)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` on the CPU, cast to ``dtype`` when it is floating."""
        if self._reader is not None:
            return self._reader.read(name, dtype)
        tensor = self._load(self._files[name])[name]
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor.clone()


def shard_size(folder: Path) -> int | None:
    """Bytes of the largest shard of a sharded safetensors checkpoint in ``folder`` (``None``: unsharded)."""
    from normswap.io.shards import INDEX

    index = folder / INDEX
    if not index.is_file():
        return None
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return max((folder / f).stat().st_size for f in shards)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_names(model: torch.nn.Module) -> set[str]:
    """Every name ``model`` is known by in a checkpoint: its state dict's names, and the names
    ``save_pretrained`` writes them as (transformers turns some back into the original layout: per-expert
    tensors of a model that stacks them on loading). Computed on shapes only (meta tensors)."""
    state = model.state_dict()
    names = set(state)
    try:
        from transformers.core_model_loading import revert_weight_conversion

        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
        names |= set(revert_weight_conversion(model, meta))
    except Exception:  # noqa: BLE001 - another transformers layout: the state dict's names only
        pass
    return names


def gather(resolved, model: torch.nn.Module | None = None) -> InputFiles:
    """What of ``resolved``'s input directory to carry over for ``model`` (loaded from it).

    ``skipped`` is found only when ``model`` is given (the in-memory path; the streamed path knows them
    from its own build, ``normswap.stream.model.build``).

    Raises:
        NormswapError: the input's safetensors files cannot be read.
    """
    folder = input_folder(resolved)
    if folder is None or not folder.is_dir():
        return InputFiles()
    copy, not_copied = extra_files(folder)
    names, skipped = [], []
    if model is not None:
        names = InputTensors(folder).names
        known = saved_names(model) if names else set()
        skipped = [n for n in names if n not in known]
    return InputFiles(folder, skipped, copy, not_copied, shard_size(folder), names=names)


def loader_ignores(model: torch.nn.Module, names) -> set[str]:
    """Which of the checkpoint tensor ``names`` (that ``model`` has no place for) transformers' loader drops
    by design rather than report as unexpected: its own rule (``_adjust_missing_and_unexpected_keys``:
    the class's ``_keys_to_ignore_on_load_unexpected`` and old rotary/position buffers)."""
    names = set(names)
    info = types.SimpleNamespace(missing_keys=set(), unexpected_keys=set(names))
    try:
        model._adjust_missing_and_unexpected_keys(info)
        return names - set(info.unexpected_keys)
    except Exception:  # noqa: BLE001 - another transformers layout: the class's patterns alone
        patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
        return {n for n in names if any(re.search(p, n) for p in patterns)}


def may_read_outputs(model: torch.nn.Module, skipped: list[str]) -> list[str]:
    """The ``skipped`` tensors that may read the model's embeddings or hidden states: all of them but the
    stale buffers that transformers' loader drops by its generic rule (an old checkpoint's per-layer
    ``rotary_emb.inv_freq`` or ``position_ids``, which the class computes itself), told apart as the
    ones it drops although the class does not declare them (``_keys_to_ignore_on_load_unexpected``)."""
    declared = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    generic = {n for n in loader_ignores(model, skipped) if not any(p.search(n) for p in declared)}
    return [n for n in skipped if n not in generic]


def _names(names: list[str], limit: int = 3) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def refuse_changed_stream(source: str, model: torch.nn.Module, skipped: list[str], option: str) -> None:
    """Refuse ``option`` (a conversion that changes the embeddings and the residual stream) on a checkpoint
    with tensors the model class does not run that may read both (``may_read_outputs``): they could not be
    carried over exactly.

    Raises:
        NormswapError: there are such tensors (one line naming them).
    """
    reading = may_read_outputs(model, skipped)
    if reading:
        raise NormswapError(
            f"{source}: the checkpoint holds {len(reading)} tensors the model class does not run "
            f"({_names(reading)}), which read the embeddings and the residual stream that {option} changes; "
            "they cannot be carried over exactly: convert without it (they are then copied unchanged)"
        )


def final_norms(model: torch.nn.Module, sites) -> list:
    """The sites whose output the model's output embeddings (``lm_head``) read: the final norm(s)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return []
    names = {name for name, module in model.named_modules(remove_duplicate=False) if module is head}
    return [s for s in sites if any(c.module in names for c in s.consumers)]


def keep_final_norms(model: torch.nn.Module, sites, skipped: list[str]) -> list[str]:
    """Keep the final norm(s) unfolded when the checkpoint has tensors the model class does not run that
    may read the final hidden state after that norm (``may_read_outputs``; see the module docstring).
    Records those sites not foldable, with the reason (step ``"carried tensors"``); returns their names."""
    reading = may_read_outputs(model, skipped) if skipped else []
    if not reading:
        return []
    kept = []
    for site in final_norms(model, sites):
        if site.foldable:
            site.decide("carried tensors", foldable=False, reason=(
                f"kept unfolded: {len(reading)} checkpoint tensors the model class does not run "
                f"({_names(reading, 1)}) may read its output; they are copied unchanged"
            ))  # fmt: skip
            kept.append(site.name)
    return kept


def copy_files(inputs: InputFiles, dest: Path) -> list[str]:
    """Copy ``inputs.files`` into ``dest`` (contents, symlinks followed, subfolders made), never over a file
    already there (what transformers and normswap wrote wins); returns the paths copied and leaves in
    ``inputs.files`` exactly those, and in ``inputs.not_copied`` only what ``dest`` does not hold."""
    copied = []
    for rel in inputs.files:
        target = dest / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(inputs.folder / rel, target)
            copied.append(rel)
    inputs.files = copied
    inputs.not_copied = {rel: why for rel, why in inputs.not_copied.items() if not (dest / rel).exists()}
    return copied


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the header."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def append_tensors(dest: Path, source: Path, names: list[str], dtype: torch.dtype,
                   max_shard: int | None) -> dict[str, tuple]:  # fmt: skip
    """Append checkpoint tensors ``names`` of the input directory ``source`` to the checkpoint in ``dest``.

    They are read one at a time (``InputTensors``; floating ones cast to ``dtype``, as every tensor of the
    conversion) and
    written in new shards of at most ``max_shard`` bytes (one per tensor beyond it) after the existing ones;
    every shard is renamed ``model-0000i-of-0000N.safetensors`` and the index
    (``model.safetensors.index.json``) lists them all. A one-file checkpoint with ``max_shard`` None (the
    input was one file) stays one file, the tensors appended to it.

    Returns:
        ``{name: (dtype name, shape, digest)}`` of the tensors as written (``normswap.io.verify``'s
        fingerprint), for the verification.
    """
    from normswap.io.shards import INDEX, SINGLE, ShardWriter, nbytes, write_index

    if not names:
        return {}
    reader = InputTensors(source)
    index = dest / INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        metadata, weight_map = dict(data.get("metadata") or {}), dict(data["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(str(dest / SINGLE), "pt") as f:
            metadata, weight_map = {}, dict.fromkeys(f.keys(), SINGLE)
    existing = sorted(set(weight_map.values()))
    entries = []
    for name in names:
        own, shape = reader.meta(name)
        entries.append((name, dtype if own.is_floating_point else own, shape))
    if not index.is_file() and max_shard is None:  # the input was one file: so is the output
        return _append_to_single(dest, reader, entries)
    chunks: list[list] = []
    size = 0
    for entry in entries:
        n = nbytes(entry[1], entry[2])
        if chunks and max_shard is not None and size + n <= max_shard:
            chunks[-1].append(entry)
            size += n
        elif chunks and max_shard is None:
            chunks[-1].append(entry)
        else:
            chunks.append([entry])
            size = n
    total = len(existing) + len(chunks)
    file_names = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    renamed = dict(zip(existing, file_names, strict=False))
    for old, new in renamed.items():
        os.rename(dest / old, dest / new)
    weight_map = {name: renamed[file] for name, file in weight_map.items()}
    written: dict[str, tuple] = {}
    for chunk, file in zip(chunks, file_names[len(existing) :], strict=True):
        writer = ShardWriter(dest / file, chunk)
        try:
            written |= _write_entries(writer, reader, chunk)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        weight_map.update(dict.fromkeys((name for name, _, _ in chunk), file))
    index.unlink(missing_ok=True)
    write_index(dest, weight_map, sum(_data_bytes(dest / f) for f in file_names))
    if isinstance(metadata.get("total_parameters"), int):  # transformers counts the elements too
        metadata["total_parameters"] += sum(math.prod(shape) for _, _, shape in entries)
    if set(metadata) - {"total_size"}:  # keep what transformers' index held besides the size
        data = json.loads(index.read_text())
        data["metadata"] = metadata | data["metadata"]
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return written


def _write_entries(writer, reader: InputTensors, entries: list) -> dict[str, tuple]:
    """Write ``entries`` (``(name, dtype, shape)``) of the input, read one at a time in ``dtype``, with
    ``writer``; returns each one's ``(dtype name, shape, digest)`` as written."""
    from normswap.io.verify import _digest

    written = {}
    for name, out_dtype, _ in entries:
        tensor = reader.read(name, out_dtype)
        written[name] = (str(out_dtype).removeprefix("torch."), tuple(tensor.shape), _digest(tensor))
        writer.write(name, tensor)
        del tensor
    return written


def _append_to_single(dest: Path, reader: InputTensors, entries: list) -> dict[str, tuple]:
    """``append_tensors`` into a one-file checkpoint: ``model.safetensors`` written again beside itself with
    ``entries`` after its own tensors (each read and written one at a time, bytes unchanged), then put in
    its place."""
    from safetensors import safe_open

    from normswap.io.shards import SINGLE, CheckpointReader, ShardWriter

    own = CheckpointReader(dest)
    names = own.names_in(SINGLE)
    with safe_open(str(dest / SINGLE), "pt") as f:
        metadata = f.metadata()
    layout = [(n, own.tensors[n].dtype, own.tensors[n].shape) for n in names] + entries
    partial = dest / f".{SINGLE}.partial"
    writer = ShardWriter(partial, layout, metadata)
    try:
        for name in names:
            writer.write(name, own.read(name))
        written = _write_entries(writer, reader, entries)
        writer.close()
    except BaseException:
        writer.abort()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dest / SINGLE)
    return written


def check_complete(source: str, inputs: InputFiles, dest: Path, model_names) -> None:
    """Every input tensor reached the checkpoint written in ``dest``, or is one of ``model_names`` (the
    model's own names, checked by the verification: a tied ``lm_head`` is written once).

    Raises:
        NormswapError: input tensors the output would lack, named (nothing has replaced the output yet).
    """
    have = set(checkpoint_tensors(dest)) | set(model_names)
    lost = [n for n in inputs.names if n not in have]
    if lost:
        raise NormswapError(
            f"{source}: the output would lack {len(lost)} tensors of the input ({_names(lost)}); "
            "refusing to save an incomplete checkpoint"
        )

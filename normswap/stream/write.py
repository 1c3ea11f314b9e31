"""The output shards of a streamed conversion, written tensor by tensor with the plan applied
(``stream.plan``), in the input's shard layout, and the files written beside them (index, config,
tokenizer, the input's other files)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from normswap.io import carry, staging
from normswap.io.shards import CheckpointReader, ShardWriter, nbytes, write_index
from normswap.stream.model import release_memory
from normswap.stream.plan import by_rows, layout, make_pieces, make_row_pieces, make_tensor
from normswap.stream.verify import fingerprint


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


def write_metadata(source, plans, folder: Path, config, inputs) -> None:
    """Index (sharded inputs), config, generation config and tokenizer files of the output (``source``: a
    ``stream.source.Source``); the other files of the input (``inputs``, ``normswap.io.carry``: model card,
    licence, the model's own code, ...)."""
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

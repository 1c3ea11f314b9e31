"""Sharded safetensors checkpoints, one tensor at a time: a validating reader and an incremental writer.

A checkpoint directory holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(transformers' sharded format: ``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

The reader checks every shard's header against its file size up front, then reads each tensor with plain
file reads into a tensor it returns (no memory map: mapped pages count as resident until unmapped), so the
resident memory is the tensors the caller holds. The writer follows the safetensors format
(https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, padded with spaces to a multiple of 8, then the raw
little-endian bytes. The header is known before any data (folding changes no shape or dtype), so a shard is
written tensor by tensor; the library itself only writes whole dicts held in memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.errors import NormswapError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``file`` (name inside the checkpoint directory), ``dtype``, ``shape``,
    and ``start`` (byte offset of its data from the start of the file)."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


# Every dtype the safetensors format defines (safetensors 0.8), with its size in bits; ``CODE_DTYPES`` lists
# those normswap reads. A header naming any other is corrupt; one naming a defined dtype normswap does not
# read is a valid file normswap cannot stream.
FORMAT_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64,
    "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
REDOWNLOAD = "re-download the file (or save it again)"


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry) -> str | None:
    """What is wrong with one tensor entry of a header (``{"dtype", "shape", "data_offsets"}``), or None."""
    if not isinstance(entry, dict):
        return f"is {json.dumps(entry)[:40]}, not an object with dtype, shape and data_offsets"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return "has no dtype" if dtype is None else f"has dtype {json.dumps(dtype)[:40]}, not a dtype name"
    if dtype not in FORMAT_BITS:
        return f"has dtype {dtype!r}, which the safetensors format does not define"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"has shape {json.dumps(shape)[:40]}, not a list of sizes"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        return f"has data_offsets {json.dumps(offsets)[:40]}, not two byte offsets [begin, end]"
    if offsets[1] < offsets[0]:
        return f"has data_offsets {offsets}: its data ends before it begins"
    bits = FORMAT_BITS[dtype]
    for d in shape:
        bits *= d
    if bits % 8:
        return f"is {dtype} {tuple(shape)}, which does not fill whole bytes"
    if offsets[1] - offsets[0] != bits // 8:
        return (
            f"is {dtype} {tuple(shape)} ({bits // 8} bytes) but its data_offsets {offsets} span "
            f"{offsets[1] - offsets[0]} bytes"
        )
    return None


def _layout_problem(header: dict) -> str | None:
    """Whether the tensors' byte ranges tile the data exactly (no overlap, no byte of no tensor), as the
    safetensors format requires; what is wrong, or None."""
    spans = sorted(
        (v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__"
    )
    at, previous = 0, None
    for begin, end, name in spans:
        if begin < at:
            return f"tensors {previous} and {name} overlap (bytes {begin}..{at} of the data belong to both)"
        if begin > at:
            where = f"between {previous} and {name}" if previous else f"before {name}"
            return f"bytes {at}..{begin} of the data belong to no tensor (a gap {where})"
        at, previous = end, name
    return None


def header_problem(header) -> str | None:
    """Why a parsed safetensors header is not a valid one (one phrase naming the tensor), or None."""
    if not isinstance(header, dict):
        return f"it is a JSON {type(header).__name__}, not an object"
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry)
        if problem:
            return f"tensor {name} {problem}"
    return _layout_problem(header)


def _header(path: Path) -> dict:
    """The parsed JSON header of one safetensors file, checked against the format and the file's size.

    Returns the header with ``"__data_start__"`` added (the byte offset of the data in the file).

    Raises:
        NormswapError: one line naming the file, what is wrong and what to do: the file is missing or
            unreadable, shorter than its 8-byte header length, its header length field exceeds the file,
            its header is not JSON or not a valid header (an entry without dtype, shape or offsets, a dtype
            the format does not define, offsets that do not match the shape, overlap, leave a gap or end
            before they begin), the file is shorter than its header's data (truncated) or longer (extra
            bytes after the last tensor).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise NormswapError(
                    f"{path}: not a safetensors file: {size} bytes, too short for the 8-byte header length; "
                    f"{REDOWNLOAD}"
                )
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise NormswapError(
                    f"{path}: truncated or not a safetensors file: its header length field says {n} bytes, "
                    f"the file has {size - 8} after it; {REDOWNLOAD}"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError as error:
        raise NormswapError(f"{path}: no such file; {REDOWNLOAD}") from error
    except OSError as error:
        raise NormswapError(f"cannot read {path}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise NormswapError(
            f"{path}: not a safetensors file: its {n}-byte header is not JSON "
            f"({str(error).splitlines()[0]}); {REDOWNLOAD}"
        ) from error
    problem = header_problem(header)
    if problem:
        raise NormswapError(f"{path}: bad safetensors header: {problem}; {REDOWNLOAD}")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    expected = 8 + n + end
    if size < expected:
        raise NormswapError(
            f"{path}: truncated: {size} bytes, its header describes {expected} ({expected - size} missing); "
            f"{REDOWNLOAD}"
        )
    if size > expected:
        raise NormswapError(
            f"{path}: {size - expected} extra bytes after the last tensor ({size} bytes, its header "
            f"describes {expected}): not a valid safetensors file; {REDOWNLOAD}"
        )
    header["__data_start__"] = 8 + n
    return header


def check_checkpoint(folder: str | os.PathLike) -> None:
    """Validate the safetensors checkpoint in ``folder`` (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names) from its headers and file sizes alone, as the streamed path's
    reader does; nothing is read past the headers. A folder with neither file passes (nothing to check).

    Raises:
        NormswapError: one line naming the file, what is wrong with it and what to do (see ``_header``,
            ``CheckpointReader``).
    """
    folder = Path(folder)
    if (folder / INDEX).is_file() or (folder / SINGLE).is_file():
        _read_headers(folder)


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except OSError as error:
        raise NormswapError(f"cannot read {index}: {error.strerror or error}") from error
    except (ValueError, KeyError, TypeError) as error:
        what = "has no weight_map" if isinstance(error, KeyError) else f"is not JSON ({error})"
        raise NormswapError(f"{index}: not a valid safetensors index: it {what}; re-download it") from error
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise NormswapError(
            f"{index}: not a valid safetensors index: its weight_map is not a map of tensor names to file "
            "names; re-download it"
        )
    return weight_map


def _read_headers(folder: Path) -> tuple[dict[str, str] | None, list[str], dict[str, dict]]:
    """``(weight_map or None, files, {file: header})`` of a checkpoint directory, every header validated and
    every tensor the index names found in the file it names."""
    index = folder / INDEX
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise NormswapError(
                f"{index}: names the shard {missing[0]}{more}, which is not in {folder}; re-download the "
                "checkpoint (its index and every shard)"
            )
    elif (folder / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        raise NormswapError(f"{folder}: no {SINGLE} or {INDEX} (streaming needs safetensors weights)")
    headers = {file: _header(folder / file) for file in files}
    if weight_map is not None:
        where = {name: file for file, header in headers.items() for name in header if name != "__metadata__"}
        for name, file in weight_map.items():
            if where.get(name) != file:
                found = f"; it is in {where[name]}" if name in where else ", nor does any other shard"
                raise NormswapError(
                    f"{index}: names tensor {name} in {file}, which does not hold it{found}; re-download the "
                    "checkpoint (its index and every shard)"
                )
    return weight_map, files, headers


class CheckpointReader:
    """The safetensors tensors of a checkpoint directory, validated up front, read one at a time.

    Attributes:
        folder: the directory.
        files: shard file names in checkpoint order (``[SINGLE]`` for an unsharded checkpoint).
        tensors: ``name -> TensorInfo`` for every tensor of every shard.
        sharded: whether the checkpoint has an index file.

    Raises:
        NormswapError: no safetensors weights, an unreadable or invalid index, a shard the index names that
            is missing, corrupt (``check_checkpoint``: each message names the file, what is wrong and what to
            do), a tensor the index places in a file that does not hold it, or a dtype normswap does not read.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        weight_map, self.files, headers = _read_headers(self.folder)
        self.sharded = weight_map is not None
        self.tensors: dict[str, TensorInfo] = {}
        for file, header in headers.items():
            data_start = header.pop("__data_start__")
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in CODE_DTYPES:
                    raise NormswapError(
                        f"{self.folder / file}: tensor {name} is stored as {entry['dtype']}, a dtype "
                        f"normswap cannot read from safetensors files ({', '.join(CODE_DTYPES)})"
                    )
                self.tensors[name] = TensorInfo(
                    file,
                    CODE_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]),
                    data_start + entry["data_offsets"][0],
                )

    def names_in(self, file: str) -> list[str]:
        """The tensor names stored in ``file``, in the order of their data in the file."""
        return sorted(
            (n for n, t in self.tensors.items() if t.file == file), key=lambda n: self.tensors[n].start
        )

    def read(
        self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """An owned copy of tensor ``name``, cast to ``dtype`` (when given and floating), on ``device``.

        Raises:
            NormswapError: the shard cannot be read.
        """
        info = self.tensors[name]
        path = self.folder / info.file
        raw = torch.empty(info.shape, dtype=info.dtype, device="cpu")  # read into host memory
        try:  # plain reads, not a memory map: mapped pages would count as resident until unmapped
            with open(path, "rb") as f:
                f.seek(info.start)
                # a ctypes view of the tensor's bytes (a numpy view would pin the storage's size)
                got = (
                    f.readinto((ctypes.c_char * info.nbytes).from_address(raw.data_ptr()))
                    if raw.numel()
                    else 0
                )
        except OSError as error:
            raise NormswapError(f"cannot read {path}: {error.strerror or error}") from error
        if got != info.nbytes:
            raise NormswapError(
                f"{path}: truncated: tensor {name} ends past the end of the file, which changed after it was "
                f"checked; {REDOWNLOAD}"
            )
        if dtype is not None and raw.is_floating_point() and dtype != raw.dtype:
            raw = raw.to(dtype)
        return raw.to(device)


def _code(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_CODES:
        raise NormswapError(f"cannot write dtype {dtype} to safetensors")
    return DTYPE_CODES[dtype]


class ShardWriter:
    """Write one safetensors file tensor by tensor, in the order of ``layout``.

    Args:
        path: the file to create.
        layout: ``(name, dtype, shape)`` of every tensor, in file order.
        metadata: the header's ``__metadata__`` (transformers writes ``{"format": "pt"}``).

    ``write(name, tensor)`` must then be called once per tensor, in order (``put`` writes one out of order,
    at its offset: ``write`` then skips it); ``close()`` checks that all were written. The file is
    byte-identical to ``safetensors.torch.save_file`` of the same tensors when ``layout`` lists them in the
    order that function would.
    """

    def __init__(self, path: str | os.PathLike, layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):  # fmt: skip
        self.path = Path(path)
        self.layout = list(layout)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dtype, shape in self.layout:
            size = nbytes(dtype, shape)
            header[name] = {
                "dtype": _code(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._start = 8 + len(blob)
        self._entries = {
            name: (i, header[name]["data_offsets"][0]) for i, (name, _, _) in enumerate(self.layout)
        }
        self._done: set[str] = set()
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (moved to the CPU if needed) as ``name``, the layout's next entry not yet written.

        Raises:
            ValueError: out of order, or a dtype/shape different from the layout.
        """
        while self._next < len(self.layout) and self.layout[self._next][0] in self._done:
            self._next += 1
        expected = self.layout[self._next] if self._next < len(self.layout) else None
        if expected is None or expected[0] != name:
            raise ValueError(f"{self.path.name}: got {name}, expected {expected and expected[0]}")
        self.put(name, tensor)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``name`` at its offset, in any order (once).

        Raises:
            ValueError: not in the layout, written already, or a dtype/shape different from the layout.
        """
        if name not in self._entries or name in self._done:
            raise ValueError(f"{self.path.name}: {name} is not a tensor of the layout still to be written")
        i, offset = self._entries[name]
        expected = self.layout[i]
        if tensor.dtype != expected[1] or tuple(tensor.shape) != tuple(expected[2]):
            raise ValueError(f"{self.path.name}: {name} is {tensor.dtype} {tuple(tensor.shape)}, layout says "
                             f"{expected[1]} {tuple(expected[2])}")  # fmt: skip
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._start + offset)
        self._file.write(memoryview(data.numpy()))
        self._done.add(name)

    def written(self, name: str) -> bool:
        """Whether ``name`` was written."""
        return name in self._done

    def close(self) -> None:
        """Flush and close; raises ``ValueError`` when tensors of the layout were not written."""
        self._file.close()
        if len(self._done) != len(self.layout):
            raise ValueError(f"{self.path.name}: {len(self.layout) - len(self._done)} tensors not written")

    def abort(self) -> None:
        self._file.close()


def write_index(folder: str | os.PathLike, weight_map: dict[str, str], total_size: int) -> Path:
    """Write ``model.safetensors.index.json`` as transformers does (keys sorted); returns its path."""
    path = Path(folder) / INDEX
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path

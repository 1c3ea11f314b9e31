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


def _header(path: Path) -> dict:
    """The parsed JSON header of one safetensors file, checked against the file's size.

    Raises:
        NormswapError: the file is missing, shorter than its header says (truncated), or not safetensors.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise NormswapError(f"{path}: truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise NormswapError(f"{path}: truncated or not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as error:
        raise NormswapError(f"cannot read {path}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise NormswapError(f"{path}: not a safetensors file (bad header)") from error
    if not isinstance(header, dict):
        raise NormswapError(f"{path}: not a safetensors file (bad header)")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise NormswapError(f"{path}: truncated ({size} bytes, its header needs {8 + n + end})")
    header["__data_start__"] = 8 + n
    return header


class CheckpointReader:
    """The safetensors tensors of a checkpoint directory, validated up front, read one at a time.

    Attributes:
        folder: the directory.
        files: shard file names in checkpoint order (``[SINGLE]`` for an unsharded checkpoint).
        tensors: ``name -> TensorInfo`` for every tensor of every shard.
        sharded: whether the checkpoint has an index file.

    Raises:
        NormswapError: no safetensors weights, an unreadable index, a shard the index names that is
            missing, truncated or corrupt, or a tensor the index places in another file than it is.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / INDEX
        self.sharded = index.is_file()
        if self.sharded:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise NormswapError(f"{index}: not a valid safetensors index ({error})") from error
            self.files = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE).is_file():
            weight_map, self.files = None, [SINGLE]
        else:
            raise NormswapError(
                f"{self.folder}: no {SINGLE} or {INDEX} (streaming needs safetensors weights)"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            header = _header(self.folder / file)
            data_start = header.pop("__data_start__")
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry.get("dtype") not in CODE_DTYPES:
                    raise NormswapError(
                        f"{self.folder / file}: tensor {name} has unsupported dtype {entry.get('dtype')}"
                    )
                self.tensors[name] = TensorInfo(
                    file,
                    CODE_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]),
                    data_start + entry["data_offsets"][0],
                )
        if weight_map is not None:
            for name, file in weight_map.items():
                if self.tensors.get(name) is None or self.tensors[name].file != file:
                    raise NormswapError(f"{index}: {name} is not in {file}")

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
            raise NormswapError(f"{path}: truncated (tensor {name} ends past the end of the file)")
        if dtype is not None and raw.is_floating_point() and dtype != raw.dtype:
            raw = raw.to(dtype)
        return raw.to(device)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


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

    ``write(name, tensor)`` must then be called once per tensor, in order; ``close()`` checks that all were
    written. The file is byte-identical to ``safetensors.torch.save_file`` of the same tensors when
    ``layout`` lists them in the order that function would.
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
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (moved to the CPU if needed) as ``name``; it must match the layout's entry.

        Raises:
            ValueError: out of order, or a dtype/shape different from the layout.
        """
        expected = self.layout[self._next] if self._next < len(self.layout) else None
        if expected is None or expected[0] != name:
            raise ValueError(f"{self.path.name}: got {name}, expected {expected and expected[0]}")
        if tensor.dtype != expected[1] or tuple(tensor.shape) != tuple(expected[2]):
            raise ValueError(f"{self.path.name}: {name} is {tensor.dtype} {tuple(tensor.shape)}, layout says "
                             f"{expected[1]} {tuple(expected[2])}")  # fmt: skip
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        """Flush and close; raises ``ValueError`` when tensors of the layout were not written."""
        self._file.close()
        if self._next != len(self.layout):
            raise ValueError(f"{self.path.name}: {len(self.layout) - self._next} tensors not written")

    def abort(self) -> None:
        self._file.close()


def write_index(folder: str | os.PathLike, weight_map: dict[str, str], total_size: int) -> Path:
    """Write ``model.safetensors.index.json`` as transformers does (keys sorted); returns its path."""
    path = Path(folder) / INDEX
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path

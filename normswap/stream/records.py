"""Localization records kept in a temporary file instead of memory, so their size does not follow the model.

The check's localization (``normswap.check.localize``) records a few token positions, in float64, at every
probe point: about 2.5 MB per Llama layer of hidden size 1024, for the reference and again for the converted
model. In memory that grows with the layer count (measured: 5.2 MB per layer at the check's peak, 1 GB more
for an 86-layer model). ``DiskRecords`` appends each record's bytes to an anonymous temporary file as it is
set and reads it back with a plain read when it is got, so only one record is in memory at a time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, MutableMapping

import torch

from normswap.files import write_error


class DiskRecords(MutableMapping):
    """A ``str -> torch.Tensor`` mapping (insertion order) whose tensors live in a temporary file.

    Args:
        folder: where the file is made (``None``: the system's temporary directory). The file has no name
            (``tempfile.TemporaryFile``): it is gone when the mapping is closed, collected, or the process
            ends, whatever way it ends.
        owner: what the records are written for (the output folder), named when they cannot be written.

    ``m[key] = t`` writes ``t``'s bytes (any dtype, shape and device; a CPU copy is written); ``m[key]``
    returns a new CPU tensor equal to ``t``. Setting a key again appends its new bytes (the old ones stay
    in the file).

    Raises:
        NormswapError: the file cannot be made or written (a full disk: ``normswap.files.write_error``'s
            line, naming ``owner``, or ``folder``).
    """

    def __init__(self, folder: str | os.PathLike | None = None, owner: str | os.PathLike | None = None):
        self._owner = owner if owner is not None else (folder or tempfile.gettempdir())
        try:
            self._file = tempfile.TemporaryFile(dir=folder)
        except OSError as error:
            raise write_error(self._owner, error) from error
        self._where: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._end = 0

    def __setitem__(self, key: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        try:
            self._file.seek(self._end)
            self._file.write(memoryview(raw))
        except OSError as error:  # a full disk: one line, not a traceback from inside the check
            self._file.close()  # its space is given back now, not when the error is collected
            raise write_error(self._owner, error) from error
        self._where[key] = (self._end, data.dtype, tuple(data.shape))
        self._end += data.numel() * data.element_size()

    def __getitem__(self, key: str) -> torch.Tensor:
        start, dtype, shape = self._where[key]
        out = torch.empty(shape, dtype=dtype, device="cpu")
        if out.numel():
            self._file.seek(start)
            self._file.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out

    def __delitem__(self, key: str) -> None:
        del self._where[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._file.close()

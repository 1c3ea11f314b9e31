"""Splitting a streamed conversion over the processes of ``accelerate launch`` (or ``torchrun``).

Without a launcher (or with one process) every function here is the single-process identity. With several,
``accelerate.PartialState`` forms the process group (gloo on a machine without an accelerator, as
``normswap eval`` does): the main process makes the hidden output folder and tells the others its
path, each process writes its share of the shards, and failures are gathered so every process stops
together with the first error.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from normswap.errors import NormswapError


def _group():
    """The ``torch.distributed`` module when a multi-process group is (or can be) up, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        from accelerate import PartialState

        PartialState(cpu=not torch.accelerator.is_available())
    return torch_dist


def world_size() -> int:
    group = _group()
    return group.get_world_size() if group else 1


def rank() -> int:
    group = _group()
    return group.get_rank() if group else 0


def is_main() -> bool:
    return rank() == 0


def device(target: torch.device) -> torch.device:
    """This process's device for ``target``: under ``accelerate launch`` each process takes the GPU of its
    local rank (``LOCAL_RANK``); alone, or on the CPU, ``target`` itself."""
    if target.type == "cpu" or world_size() <= 1:
        return target
    return torch.device(target.type, int(os.environ.get("LOCAL_RANK", rank())))


def barrier() -> None:
    group = _group()
    if group:
        group.barrier()


def broadcast(value):
    """The main process's ``value``, on every process."""
    group = _group()
    if not group:
        return value
    box = [value]
    group.broadcast_object_list(box, src=0)
    return box[0]


def my_share(items: list) -> list:
    """This process's items: ``items[rank::world_size]``."""
    return items[rank() :: world_size()]


def shared_folder(make) -> Path:
    """``make()`` on the main process (it makes the hidden output folder beside the output and returns its
    path, ``normswap.io.staging.Staging``); every process gets that path. A ``NormswapError`` or ``OSError``
    of ``make`` reaches every process.

    Raises:
        NormswapError: ``make`` refused or failed.
    """
    path = None
    error = None
    if is_main():
        try:
            path = str(make())
        except NormswapError as e:
            error = str(e)
        except OSError as e:
            error = f"cannot write: {e.strerror or e}"
    path, error = broadcast((path, error))
    if error:
        raise NormswapError(error)
    return Path(path)


def all_ok(fn):
    """Run ``fn`` on every process and return its result (this process's); if it fails anywhere, raise on
    every process (the failing one re-raises its own exception, the others a ``NormswapError`` naming it)."""
    group = _group()
    if not group:
        return fn()
    failure, own, result = None, None, None
    try:
        result = fn()
    except BaseException as error:  # noqa: BLE001 - reported to every process, then re-raised
        own = error
        failure = f"process {rank()}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    failures = [None] * group.get_world_size()
    group.all_gather_object(failures, failure)
    if own is not None:
        raise own
    first = next((f for f in failures if f), None)
    if first:
        raise NormswapError(first)
    return result


def merged(items: dict) -> dict:
    """The union of every process's ``items`` (a dict of picklable values), on every process."""
    group = _group()
    if not group:
        return items
    parts = [None] * group.get_world_size()
    group.all_gather_object(parts, items)
    return {k: v for part in parts for k, v in part.items()}

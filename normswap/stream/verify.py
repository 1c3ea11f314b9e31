"""Verify a streamed conversion's output by a fresh, streamed load: what is saved is what was checked.

The counterpart of ``normswap.io.verify`` (``record_expected`` before the save, ``verify_saved`` after) for an
output written tensor by tensor, with memory bounded as the rest of the streamed path:

* while the shards are written, ``write_shards`` records each tensor's dtype, shape and blake2b digest of
  its bytes as planned (the folded tensor in memory, just before its bytes go to the file);
* after the check, ``record`` runs the checked model (the written checkpoint, streamed, fused norms
  swapped in) on the first ``VERIFY_TOKENS`` ids of the check;
* after the output is in place, ``verify_streamed`` opens it afresh: the class its saved ``config.json``
  builds, the tensor names, dtypes and shapes of its safetensors headers (and index) against the plan,
  every tensor read back one at a time and digested, and the outputs of a streamed model built from the
  output directory alone, with the fused norms its ``normswap.json`` lists, on the same ids.

Tolerance: the tensors bit-identical (same digest), the outputs bit-identical to the recorded ones (the same
bytes through the same modules on the same kernels). The plain transformers load that ``verify_saved``
also compares needs the whole model in memory; it is not run here (``max_abs_diff_plain`` is ``None``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.io.verify import VERIFY_TOKENS, Expected, VerifyResult, _digest, _max_diff, _names

NOTE = "streamed fresh load (the shards read back one tensor at a time)"


def fingerprint(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """``(dtype name, shape, blake2b hex digest of the bytes)`` of ``tensor``, as ``normswap.io.verify``."""
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), _digest(tensor)


@torch.no_grad()
def record(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    tensors: dict,
    dtype: torch.dtype,
    tokens: int = VERIFY_TOKENS,
) -> Expected:
    """``normswap.io.verify.Expected`` from the checked (streamed, norms swapped) ``model`` and the written
    ``tensors`` (no ``note``, ``device_map`` or ``carried``: the streamed output is the checked model).

    Args:
        model: the model the check ran; one more streamed forward, on ``tokens`` ids.
        input_ids: ``(B, T)`` ids of the check; the first row's first ``tokens`` are used.
        tensors: name -> ``fingerprint`` of every written tensor.
        dtype: the dtype ``model`` was built in.
    """
    from normswap.check.core import _forward

    ids = input_ids[:1, :tokens].cpu()
    kind, outputs = _forward(model, ids)
    dtype_name = str(dtype).removeprefix("torch.")
    return Expected(type(model).__name__, dtype_name, dict(tensors), ids, kind, outputs)


def _check_tensors(reader, expected: Expected) -> list[str]:
    """Names, dtypes and shapes of the headers against the plan, then every tensor's bytes (one at a time)."""
    failures = []
    missing = sorted(expected.tensors.keys() - reader.tensors.keys())
    extra = sorted(reader.tensors.keys() - expected.tensors.keys())
    if missing:
        failures.append(f"tensors missing from the saved shards: {_names(missing)}")
    if extra:
        failures.append(f"unexpected tensors in the saved shards: {_names(extra)}")
    for name in sorted(expected.tensors.keys() & reader.tensors.keys()):
        dtype, shape, digest = expected.tensors[name]
        info = reader.tensors[name]
        saved = (str(info.dtype).removeprefix("torch."), tuple(info.shape))
        if saved != (dtype, shape):
            failures.append(
                f"{name} is saved as {saved[0]} {list(saved[1])}, was planned as {dtype} {list(shape)}"
            )
            continue
        tensor = reader.read(name)
        if _digest(tensor) != digest:
            failures.append(f"{name} is saved with other values than were written and checked")
        del tensor
    return failures


def verify_streamed(
    path: str | Path, expected: Expected, trust_remote_code: bool = False, device: torch.device | str = "cpu"
) -> VerifyResult:
    """Open the output directory ``path`` afresh and compare it with ``expected`` (see the module docstring).

    Memory: one tensor at a time for the digests; the streamed model (its 1-D parameters and one module's
    weights, on ``device``, where the checked model ran) for the outputs.

    Returns:
        ``VerifyResult`` (``passed`` False with ``failures`` on any mismatch, including an output that no
        longer opens or builds; nothing raises for that).
    """
    from normswap.check.core import _forward, peak_rss_mib
    from normswap.io.load import load_config, resolve, torch_dtype
    from normswap.io.save import read_manifest
    from normswap.io.shards import CheckpointReader
    from normswap.sites import NormSite
    from normswap.stream.model import build
    from normswap.swap import swap_norms

    failures: list[str] = []
    architecture, diff, kind = "?", float("inf"), expected.output
    try:
        reader = CheckpointReader(path)
        failures += _check_tensors(reader, expected)
        config = load_config(resolve(str(path), download=False), trust_remote_code=trust_remote_code)
        dtype = torch_dtype(expected.dtype)
        fresh = build(config, reader, dtype, device, trust_remote_code=trust_remote_code)
    except NormswapError as error:
        failures.append(f"the saved checkpoint does not load: {error}")
        fresh = None
    if fresh is not None:
        architecture = type(fresh.model).__name__
        if architecture != expected.architecture:
            failures.append(f"reloads as {architecture}, was {expected.architecture}")
        else:
            manifest = read_manifest(path)
            sites = [NormSite.from_dict(s) for s in manifest.get("sites", []) if s.get("swapped")]
            swap_norms(fresh.model, sites)
            with torch.no_grad():
                kind, outputs = _forward(fresh.model, expected.input_ids)
            if kind != expected.output:
                failures.append(f"reload returns {kind}, was {expected.output}")
            diff = _max_diff(outputs, expected.outputs)
            if diff != 0:
                failures.append(f"{kind} of the reload differ by {diff:.3g} (expected bit-identical)")
        fresh.close()
    return VerifyResult(
        path=str(path),
        architecture=architecture,
        expected_architecture=expected.architecture,
        tensors=len(expected.tensors),
        tokens=expected.input_ids.numel(),
        output=kind,
        max_abs_diff=diff,
        max_abs_diff_plain=None,
        tolerance="bit-identical tensors (digests as written) and outputs (fused norms); no plain reload",
        passed=not failures,
        failures=failures,
        note=NOTE,
        peak_rss_mib=peak_rss_mib(),
    )

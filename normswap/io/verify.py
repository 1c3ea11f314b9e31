"""Verify a saved checkpoint by a fresh load: what is saved is what was checked.

``record_expected(model, input_ids)`` takes, from the converted model in memory and before it is saved, what
the saved directory must reproduce: the model class, every state-dict tensor's name, dtype, shape and a
digest of its bytes, and the outputs on a few tokens. ``verify_saved(path, expected)`` then loads the
directory afresh (plain transformers, the Auto class ``auto_class_name`` picks from the saved config) and
compares; the expectation is small, so the in-memory model can be freed before the fresh load and the peak
memory stays at about one model.

Tolerance: the weights must be bit-identical (same digest) and the outputs of the fresh load, with
normswap's fused norms put back from the manifest (``load_pretrained``), bit-identical to the recorded
ones: the same weights through the same modules on the same kernels (the fresh load is placed where the
checked model was: the CPU, one GPU, or accelerate's device map; on CUDA a load onto the CPU differed by
0.11 in bf16 logits of a 1B Llama, measured on an H200). The outputs of the plain
transformers load (its own norm modules) are compared too. In float32/float64 they must stay within the
check's own max-abs tolerance (``normswap.check.default_tolerance``: 2e-4 / 1e-8); measured: bit-identical
on tiny Llama, Gemma, Gemma 2/3, Qwen3, Phi-3, Mistral, OLMo, OLMo 2, Falcon, GPT-NeoX, StableLM, BLOOM,
GPT-2, T5 and on SmolLM2-135M, 1.2e-8 on Cohere (its LayerNorm rounds in another order). In
bfloat16/float16 an HF module and the fused one may round an element 1 ulp apart (field case C2) and the
model amplifies that, so the difference is reported, not judged.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from normswap.errors import NormswapError

VERIFY_TOKENS = 16  # tokens of the check's input the fresh load is run on


@dataclass
class Expected:
    """What a saved directory must reproduce, recorded from the in-memory model before saving.

    Attributes:
        architecture: the model's class name (``LlamaForCausalLM``, ``T5ForConditionalGeneration``, ...).
        dtype: the model's dtype name (``"float32"``, ...), the dtype the fresh load uses.
        tensors: state-dict name -> ``(dtype name, shape, blake2b hex digest of the bytes)``.
        input_ids: ``(1, T)`` long ids on the CPU, or the ``normswap.walk.ExampleInputs`` (a waveform, an
            image) of a model that reads no token ids.
        output: ``"logits"`` or ``"last_hidden_state"``.
        outputs: ``(T, V or D)`` outputs of the in-memory model, in its dtype, on the CPU.
        note: how the saved model relates to the one in memory (``None``: it is the same model).
        device_map: where the model's weights were (``normswap.device.placement``; ``None``: the CPU); the
            fresh load goes to the same place, so it runs the same kernels.
        carried: tensors written beside the model's (checkpoint tensors the model class does not run,
            ``normswap.io.carry``) -> their fingerprint as written; the fresh load does not hold them, so
            they are read back from the safetensors files.
    """

    architecture: str
    dtype: str
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    input_ids: torch.Tensor
    output: str
    outputs: torch.Tensor
    note: str | None = None
    device_map: dict[str, str | int] | None = None
    carried: dict[str, tuple[str, tuple[int, ...], str]] = field(default_factory=dict)


@dataclass
class VerifyResult:
    """The fresh load of a saved directory against ``Expected``.

    ``max_abs_diff`` (fused norms put back) and ``max_abs_diff_plain`` (transformers' own modules) are over
    the compared outputs; ``failures`` lists every mismatch (class, tensor names, dtypes, shapes, bytes,
    outputs); ``passed`` is ``not failures``.
    """

    path: str
    architecture: str
    expected_architecture: str
    tensors: int
    tokens: int
    output: str
    max_abs_diff: float
    max_abs_diff_plain: float
    tolerance: str
    passed: bool
    failures: list[str] = field(default_factory=list)
    note: str | None = None
    peak_rss_mib: float = 0.0
    device: str = "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line for the CLI's ``verified:`` (see ``describe``)."""
        return describe(self.to_dict())


def describe(verify: dict[str, Any]) -> str:
    """One line from a ``VerifyResult.to_dict()``: ``"fresh load as LlamaForCausalLM, 21 tensors
    bit-identical, logits on 16 tokens identical"``, or ``"FAILED: ..."`` with the first three failures."""
    if not verify.get("passed"):
        return "FAILED: " + "; ".join(verify.get("failures", [])[:3])
    plain = verify.get("max_abs_diff_plain") or 0
    plain_text = f" ({plain:.3g} with transformers' own norms)" if plain else ""
    note = f"; {verify['note']}" if verify.get("note") else ""
    where = f" on {verify['device']}" if verify.get("device", "cpu") != "cpu" else ""
    return (
        f"fresh load as {verify['architecture']}{where}, {verify['tensors']} tensors bit-identical, "
        f"{verify['output']} on {verify['tokens']} tokens identical{plain_text}{note}"
    )


def _release_freed_memory() -> None:
    """Collect garbage and ask glibc (``malloc_trim``) to hand freed heap pages back to the OS, so a model the
    caller has just dropped does not stay in the resident set under the fresh load. Measured peak RSS of
    ``normswap convert smollm2-135m`` (float32): 1953 MiB without the trim, 1638 MiB with it (1632 MiB
    before verification existed)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


def _fingerprint(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return {
        name: (str(t.dtype).removeprefix("torch."), tuple(t.shape), _digest(t))
        for name, t in model.state_dict().items()
    }


@torch.no_grad()
def record_expected(
    model: torch.nn.Module, input_ids: torch.Tensor, *, tokens: int = VERIFY_TOKENS, note: str | None = None
) -> Expected:
    """Record from ``model`` (converted, about to be saved) what its saved directory must reproduce.

    Args:
        model: a transformers ``PreTrainedModel``; a PEFT model is recorded as the merged copy that
            ``save_converted`` writes (``normswap.io.adapters.plain_model``; one more model in memory).
        input_ids: ``(B, T)`` long ids (the check's); the first row's first ``tokens`` ids are used. Or
            ``normswap.walk.ExampleInputs`` for a model that reads no ids: used whole.
        tokens: how many ids to run (the outputs kept are ``tokens x V``).
        note: recorded in the result (e.g. that adapters were merged).

    Returns:
        ``Expected``; it holds digests, not tensors, apart from the ``tokens x V`` outputs.
    """
    from normswap.check.core import _forward
    from normswap.device import placement
    from normswap.io.adapters import plain_model

    ids = input_ids[:1, :tokens].cpu() if isinstance(input_ids, torch.Tensor) else input_ids
    model, merged = plain_model(model)  # what save_converted writes for a PEFT model
    note = merged if note is None else note
    kind, outputs = _forward(model, ids)
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return Expected(
        architecture=type(model).__name__,
        dtype=str(dtype).removeprefix("torch."),
        tensors=_fingerprint(model),
        input_ids=ids,
        output=kind,
        outputs=outputs,
        note=note,
        device_map=placement(model),
    )


def _saved_dtypes(path: Path) -> dict[str, str]:
    """Tensor name -> dtype name as stored in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    names = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64"}
    found: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as reader:
            for name in reader.keys():
                stored = reader.get_slice(name).get_dtype()
                found[name] = names.get(stored, stored.lower())
    return found


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def _compare_tensors(expected: Expected, fresh: torch.nn.Module, saved: dict[str, str]) -> list[str]:
    failures = []
    got = _fingerprint(fresh)
    missing = sorted(expected.tensors.keys() - got.keys())
    extra = sorted(got.keys() - expected.tensors.keys())
    if missing:
        failures.append(f"tensors missing after reload: {_names(missing)}")
    if extra:
        failures.append(f"unexpected tensors after reload: {_names(extra)}")
    for name in sorted(expected.tensors.keys() & got.keys()):
        dtype, shape, digest = expected.tensors[name]
        if name in saved and saved[name] != dtype:
            failures.append(f"{name} is saved as {saved[name]}, was {dtype}")
        elif got[name][:2] != (dtype, shape):
            new_dtype, new_shape = got[name][:2]
            failures.append(f"{name} reloads as {new_dtype} {list(new_shape)}, was {dtype} {list(shape)}")
        elif got[name][2] != digest:
            failures.append(f"{name} reloads with other values than were checked")
    return failures


def _compare_carried(expected: Expected, path: Path) -> list[str]:
    """The carried tensors, read back one at a time from the safetensors files, against their fingerprints."""
    if not expected.carried:
        return []
    from normswap.io.shards import CheckpointReader

    reader = CheckpointReader(path)
    failures = []
    lost = sorted(expected.carried.keys() - reader.tensors.keys())
    if lost:
        failures.append(f"carried tensors missing from the saved files: {_names(lost)}")
    for name in sorted(expected.carried.keys() & reader.tensors.keys()):
        tensor = reader.read(name)
        got = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), _digest(tensor))
        if got != tuple(expected.carried[name]):
            failures.append(f"{name} is saved with other values than were carried over")
        del tensor
    return failures


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if torch.equal(a, b):
        return 0.0
    diff = (a.double() - b.double()).abs()
    return float(diff.nan_to_num(float("inf")).max())


def verify_saved(
    path: str | os.PathLike, expected: Expected, *, trust_remote_code: bool = False
) -> VerifyResult:
    """Load the checkpoint directory ``path`` afresh and compare it with ``expected`` (see the module doc).

    Checks: the class the saved config makes transformers build is ``expected.architecture``; the reloaded
    state dict has the same tensor names, and each the same dtype (also as stored in the safetensors
    files), shape and bytes; the outputs on ``expected.input_ids`` with the manifest's fused norms are
    bit-identical, and in float32/float64 those of the plain transformers load are within the check's
    max-abs tolerance; the tensors carried beside the model's (``expected.carried``: checkpoint tensors
    the model class does not run) are read back from the files with their digests. Needs one model's
    memory (free the in-memory model first to keep the peak at one model).

    Returns:
        ``VerifyResult`` (``passed`` False with ``failures`` on any mismatch; nothing raises for that).

    Raises:
        NormswapError: ``path`` is not a loadable checkpoint directory.
    """
    import transformers

    from normswap.check import default_tolerance
    from normswap.check.core import _forward, peak_rss_mib
    from normswap.io.load import _load_failure, auto_class_name, load_config, resolve, torch_dtype
    from normswap.io.save import read_manifest
    from normswap.sites import NormSite
    from normswap.swap import swap_norms

    resolved = resolve(path, download=False)
    config = load_config(resolved, trust_remote_code=trust_remote_code)
    _release_freed_memory()
    try:
        auto = getattr(transformers, auto_class_name(config))
        dtype = torch_dtype(expected.dtype)
        where = {} if expected.device_map is None else {"device_map": expected.device_map}
        fresh = auto.from_pretrained(
            resolved.path, config=config, dtype=dtype, trust_remote_code=trust_remote_code, **where
        ).eval()
    except NormswapError:
        raise
    except Exception as error:
        raise _load_failure(resolved, "weights", error) from error
    failures = []
    if type(fresh).__name__ != expected.architecture:
        failures.append(f"reloads as {type(fresh).__name__}, was {expected.architecture}")
    failures += _compare_tensors(expected, fresh, _saved_dtypes(Path(resolved.path)))
    failures += _compare_carried(expected, Path(resolved.path))
    exact_dtype = expected.dtype in ("float32", "float64")
    plain_tol = default_tolerance(expected.dtype)["max_abs"] if exact_dtype else float("inf")
    kind, plain_diff, fused_diff = expected.output, float("inf"), float("inf")
    if type(fresh).__name__ == expected.architecture:  # another class: its outputs are not comparable
        kind, plain = _forward(fresh, expected.input_ids)
        if kind != expected.output:
            failures.append(f"reload returns {kind}, was {expected.output}")
        plain_diff = _max_diff(plain, expected.outputs)
        if exact_dtype and not plain_diff <= plain_tol:
            failures.append(f"{kind} of the plain reload differ by {plain_diff:.3g} (> {plain_tol:g})")
        sites = [NormSite.from_dict(s) for s in read_manifest(path).get("sites", []) if s.get("swapped")]
        swap_norms(fresh, sites)
        _, fused = _forward(fresh, expected.input_ids)
        fused_diff = _max_diff(fused, expected.outputs)
        if fused_diff != 0:
            failures.append(f"{kind} of the reload differ by {fused_diff:.3g} (expected bit-identical)")
    return VerifyResult(
        path=str(resolved.path),
        architecture=type(fresh).__name__,
        expected_architecture=expected.architecture,
        tensors=len(expected.tensors) + len(expected.carried),
        tokens=expected.outputs.shape[0],
        output=kind,
        max_abs_diff=fused_diff,
        max_abs_diff_plain=plain_diff,
        tolerance="bit-identical with fused norms; plain reload "
        + (f"max abs <= {plain_tol:g}" if exact_dtype else "reported"),
        passed=not failures,
        failures=failures,
        note=expected.note,
        peak_rss_mib=peak_rss_mib(),
        device=_describe_placement(expected.device_map),
    )


def _describe_placement(device_map: dict[str, str | int] | None) -> str:
    """``"cpu"``, ``"cuda:0"``, or ``"device_map over cuda:0, cuda:1"`` (the distinct devices, in order)."""
    if device_map is None:
        return "cpu"
    devices = list(dict.fromkeys(f"cuda:{d}" if isinstance(d, int) else d for d in device_map.values()))
    return devices[0] if set(device_map) == {""} else "device_map over " + ", ".join(devices)

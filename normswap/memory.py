"""Will a conversion fit in memory? The in-memory peak estimated from the checkpoint, the memory available,
and the choice between the in-memory and the streamed path (``normswap convert`` without ``--max-memory``).

The estimate adds up what the in-memory pipeline holds at its fullest stage (docs/STREAMING.md, "When
normswap streams"), from the checkpoint's headers and config alone, before anything is loaded:

* ``runtime``: Python, torch and transformers imported (measured: 0.45 GiB);
* ``weights``: every tensor in the conversion's dtype (``numel x element size``; non-float tensors as
  stored);
* ``cast``: the stored tensors too while loading converts them to another dtype (transformers reads the
  file through a memory map, whose pages count while the converted copy is made);
* ``upcast``: half precision only: the check runs the original once more with every floating parameter in
  float32 (``normswap.check.upcast``), beside the half-precision values;
* ``untie``: the copy of a tied ``lm_head`` the final norm folds into (vocabulary x hidden);
* ``recording`` (``--norm rmsnorm`` or ``--rotate``): the graph of the walk's forward (``normswap.recording``,
  on ``walk.SHORT_POSITIONS`` tokens) keeps every activation of it, from the walk until the plans are made:
  ``RECORD_COPIES`` (tokens x (hidden + intermediate)) arrays per layer in the conversion's dtype;
* ``centering`` (``--norm rmsnorm``): the written weights are copied before they are replaced (half the
  weights at most) and the features replayed through the recorded ops;
* ``rotation`` (``--rotate``, ``rotate.apply.rotation_bytes``): the float64 ``Q`` (hidden x hidden) and
  ``H`` (head_dim x head_dim), every rotated weight's new values (computed before any is assigned, so that a
  refusal changes nothing: the weights once more, at most), and one tensor's float64 temporaries;
* ``logits``: the check's ``(tokens, vocabulary)`` logits, and the float64 metrics over them;
* ``activations``: per layer, what one forward on the check's tokens leaves held (hidden and MLP widths).

Not included: float32's second rule (``normswap.check``'s float64 reference), which runs only where the
check's fixed bound misses: the original loaded again and held in float64 (twice its float32 weights) beside
the converted model, with one float64 forward's activations and logits (SmolLM2-135M, 1024 tokens: +1.3-1.6
GiB peak RSS, docs/CHECKING.md). Counting it would move most models that pass the fixed bound to the streamed
path for memory they never use. Where the rerun does not fit, torch's allocation error is caught and the fixed
bound's verdict stands (``NoFloat64Reference``), unless the kernel's out-of-memory killer ends the process
first.

The stages do not overlap: loading (weights + cast), the reference (weights + upcast + logits +
activations + recording), the conversion and check (weights + untie + recording + centering + rotation +
logits + activations); the
verification's fresh load comes after the model is freed. The estimate is their maximum plus the runtime;
``LOGIT_COPIES`` and ``LAYER_COPIES`` are set from measured peaks (benchmarks/bench_memory.py) so that the
estimate is at or above the measured peak.

Available memory: the CPU's ``MemAvailable`` (Linux ``/proc/meminfo``), lowered to a cgroup's limit where
one is set, else free pages (``os.sysconf``); a CUDA device's free memory (``torch.cuda.mem_get_info``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 2**30
RUNTIME = int(0.45 * GIB)
LOGIT_COPIES = 2.5  # float64-sized (tokens x vocabulary) arrays held at once by the check
LAYER_COPIES = 2.5  # float32 (tokens x (hidden + intermediate)) arrays held per layer
RECORD_COPIES = 11  # (tokens x (hidden + inter)) arrays a recorded forward keeps per layer (SmolLM2: 10.2)
FITS = 0.9  # the in-memory path runs when its estimated peak is at most this share of the available memory
STREAM_SHARE = 0.25  # share of the available memory a derived streaming budget allows for weights
HALF = ("bfloat16", "float16")


@dataclass
class Estimate:
    """The estimated peak of the in-memory path, in bytes.

    Attributes:
        peak: the estimate (``runtime`` plus the fullest stage).
        stage: which stage that is (``"load"``, ``"reference"``, ``"convert"``).
        parts: each term of the module docstring, in bytes.
        device: where the weights would live (``"cpu"``, ``"cuda:0"``, ...); on a GPU the peak counts the
            device's memory (no runtime, no cast: the weights load onto the device directly).
    """

    peak: int
    stage: str
    parts: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _size(dtype) -> int:
    return dtype.itemsize


def estimate(
    tensors: dict,
    config,
    dtype,
    *,
    untie: bool = True,
    norm: str = "keep",
    tokens: int = 512,
    device: str = "cpu",
    rotate: bool = False,
) -> Estimate:
    """Estimate the in-memory peak of ``normswap convert`` (see the module docstring).

    Args:
        tensors: checkpoint tensor name -> ``(torch dtype, shape)`` as stored (``checkpoint_tensors``).
        config: the model's transformers config (layers, widths, vocabulary, tying).
        dtype: the ``torch.dtype`` the conversion runs in.
        untie: whether a tied ``lm_head`` is untied (not ``--no-untie``).
        norm: ``"keep"`` or ``"rmsnorm"``.
        tokens: the check's token count.
        device: ``"cpu"`` or a GPU's name: on a GPU the estimate is of the device's memory.
        rotate: whether the conversion rotates the residual stream (``--rotate``).

    Returns:
        ``Estimate``.
    """
    from normswap.rotate.apply import rotation_bytes
    from normswap.walk import SHORT_POSITIONS

    elt = _size(dtype)
    weights = stored = upcast = largest = 0
    cast = False
    for stored_dtype, shape in tensors.values():
        n, own = _numel(shape), _size(stored_dtype)
        stored += n * own
        if stored_dtype.is_floating_point:
            largest = max(largest, n)
            weights += n * elt
            upcast += n * 4
            cast = cast or stored_dtype != dtype
        else:
            weights += n * own
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0))
    name = str(dtype).removeprefix("torch.")
    parts = {
        "runtime": RUNTIME if device == "cpu" else 0,
        "weights": weights,
        "cast": stored if cast and device == "cpu" else 0,
        "upcast": upcast if name in HALF else 0,
        "untie": vocab * hidden * elt if tied and untie else 0,
        "recording": RECORD_COPIES * layers * SHORT_POSITIONS * (hidden + inter) * elt
        if norm == "rmsnorm" or rotate
        else 0,
        "centering": weights // 2 + 2 * int(LAYER_COPIES * layers * tokens * (hidden + inter) * 4)
        if norm == "rmsnorm"
        else 0,
        "rotation": rotation_bytes(
            hidden, head_dim, tensor_numel=largest, tensor_bytes=largest * elt, held=weights
        )
        if rotate
        else 0,
        "logits": int(LOGIT_COPIES * tokens * vocab * 8),
        "activations": int(LAYER_COPIES * layers * tokens * (hidden + inter) * 4),
    }
    stages = {
        "load": parts["weights"] + parts["cast"],
        "reference": parts["weights"] + parts["upcast"] + parts["logits"] + parts["activations"]
        + parts["recording"],
        "convert": parts["weights"] + parts["untie"] + parts["recording"] + parts["centering"]
        + parts["rotation"] + parts["logits"] + parts["activations"],
    }  # fmt: skip
    stage = max(stages, key=stages.get)
    return Estimate(parts["runtime"] + stages[stage], stage, parts, device)


def checkpoint_tensors(path: str | os.PathLike) -> dict:
    """``name -> (torch dtype, shape)`` of a local directory's safetensors weights (headers only).

    Raises:
        NormswapError: no safetensors weights, or a truncated or corrupt shard (``CheckpointReader``).
    """
    from normswap.io.shards import CheckpointReader

    return {name: (t.dtype, t.shape) for name, t in CheckpointReader(path).tensors.items()}


def hub_tensors(repo_id: str) -> dict | None:
    """``name -> (torch dtype, shape)`` of a hub repository's safetensors weights, read from their headers
    over HTTP (``huggingface_hub.get_safetensors_metadata``), or None when that fails (offline, no
    safetensors weights)."""
    from normswap.io.shards import CODE_DTYPES

    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(repo_id)
        return {
            name: (CODE_DTYPES[info.dtype], tuple(info.shape))
            for file in meta.files_metadata.values()
            for name, info in file.tensors.items()
        }
    except Exception:  # noqa: BLE001 - any failure means: no estimate, the in-memory path as before
        return None


MEMINFO = "/proc/meminfo"
CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _meminfo() -> dict[str, int]:
    try:
        lines = Path(MEMINFO).read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            found[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return found


def _cgroup_room() -> int | None:
    """Bytes a cgroup memory limit still allows this process (v2 ``memory.max``, v1 ``limit_in_bytes``)."""
    for limit, usage in CGROUP_FILES:
        try:
            cap = Path(limit).read_text().strip()
            used = int(Path(usage).read_text().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 2**60:
            return max(0, int(cap) - used)
    return None


def available_memory(device: str = "cpu") -> int | None:
    """Bytes of memory a conversion can use now, or None when it cannot be told.

    ``"cpu"``: ``MemAvailable`` of ``/proc/meminfo`` (what can be allocated without swapping, page cache
    included), at most what a cgroup memory limit still allows; elsewhere free pages
    (``os.sysconf("SC_AVPHYS_PAGES")``, which leaves out the page cache: lower). A CUDA device: its free
    memory (``torch.cuda.mem_get_info``).
    """
    if device != "cpu":
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    found = _meminfo().get("MemAvailable")
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            found = None
    room = _cgroup_room()
    if room is not None:
        found = room if found is None else min(found, room)
    return found


@dataclass
class Choice:
    """In memory or streamed, and why.

    Attributes:
        stream: whether to stream.
        budget: bytes of weights the streamed path may hold at once (None in memory).
        reason: one line saying why, when normswap chose to stream (None when the user chose).
        estimate: the in-memory estimate (None when none was made).
        available: the memory available (None when not measured).
        source: the opened checkpoint (``normswap.stream.source.open_source``) when streaming.
    """

    stream: bool
    budget: int | None = None
    reason: str | None = None
    estimate: Estimate | None = None
    available: int | None = None
    source: object = None

    def to_dict(self) -> dict:
        """JSON-ready (without ``source``): the report's ``streamed.choice``."""
        return {
            "stream": self.stream, "budget": self.budget, "reason": self.reason, "available": self.available,
            "estimate": self.estimate.to_dict() if self.estimate else None,
        }  # fmt: skip


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def weight_bytes(tensors: dict, dtype) -> int:
    """Bytes of ``tensors`` (``name -> (dtype, shape)``) in ``dtype`` (floating ones; others as stored)."""
    elt = _size(dtype)
    return sum(_numel(s) * (elt if d.is_floating_point else _size(d)) for d, s in tensors.values())


def choose(
    tensors: dict | None,
    config,
    dtype,
    *,
    max_memory: int | None = None,
    no_stream: bool = False,
    untie: bool = True,
    norm: str = "keep",
    tokens: int = 512,
    device: str = "cpu",
    available: int | None = None,
    rotate: bool = False,
) -> Choice:
    """In memory or streamed, for a conversion of ``tensors`` (``name -> (dtype, shape)``, None when the
    checkpoint cannot be streamed: a GGUF file, weights that are not safetensors).

    * ``no_stream``: in memory;
    * ``max_memory`` (bytes): streamed when the weights in ``dtype`` exceed it, with that budget;
    * otherwise: streamed when ``estimate`` exceeds ``FITS`` of ``available`` (default:
      ``available_memory(device)``), with a budget of ``STREAM_SHARE`` of it (at least the largest tensor);
      in memory when the memory cannot be told.
    """
    if no_stream or tensors is None:
        return Choice(False)
    if max_memory is not None:
        return Choice(weight_bytes(tensors, dtype) > max_memory, budget=max_memory)
    guess = estimate(
        tensors, config, dtype, untie=untie, norm=norm, tokens=tokens, device=device, rotate=rotate
    )
    room = available if available is not None else available_memory(device)
    if room is not None and device == "cpu":  # processes of one launch on one machine share its memory
        room //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if room is None or guess.peak <= FITS * room:
        return Choice(False, estimate=guess, available=room)
    elt = _size(dtype)
    largest = max((_numel(s) * (elt if d.is_floating_point else _size(d)) for d, s in tensors.values()),
                  default=0)  # fmt: skip
    budget = max(int(STREAM_SHARE * room), largest)
    where = "on the CPU" if device == "cpu" else f"on {device}"
    reason = (
        f"in memory would need about {gib(guess.peak)} ({guess.stage}), {gib(room)} is available {where}: "
        f"streaming with a budget of {gib(budget)} of weights (--max-memory sets it, --no-stream forces "
        "the in-memory path)"
    )
    return Choice(True, budget=budget, reason=reason, estimate=guess, available=room)


def decide(
    model: str,
    dtype: str,
    *,
    max_memory: str | None = None,
    no_stream: bool = False,
    untie: bool = True,
    norm: str = "keep",
    tokens: int | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    tokenizer: str | None = None,
    rotate: bool = False,
) -> Choice:
    """``normswap convert``'s choice for MODEL: the in-memory path, or streaming with which budget.

    With ``max_memory`` (a size such as ``"2GiB"``): MODEL is opened for streaming (a hub id's weights are
    fetched, ``stream.source.open_source``) and streamed when its weights exceed it. Otherwise, unless
    ``no_stream``: the checkpoint's headers and config are read (a hub id's over HTTP, without its
    weights) and ``choose`` decides; a checkpoint that cannot be streamed (a GGUF file, an encoder, weights
    that are not safetensors) runs in memory, as does one whose headers cannot be read (its load then says
    why). Under ``accelerate launch`` every process follows the main process's choice.

    Raises:
        NormswapError: a bad ``max_memory``, both ``max_memory`` and ``no_stream``, or (with ``max_memory``)
            a model that cannot be streamed (see ``open_source``).
    """
    from normswap.errors import NormswapError
    from normswap.stream import dist
    from normswap.stream import source as stream

    if max_memory is not None:
        if no_stream:
            raise NormswapError("--no-stream and --max-memory contradict each other; give one of them")
        budget = stream.parse_size(max_memory)
        source = stream.open_source(model, dtype, trust_remote_code, tokenizer)
        if source.nbytes <= budget:
            return Choice(False, budget=budget)
        return Choice(True, budget=budget, source=source)
    if no_stream:
        return Choice(False)
    choice = _auto(model, dtype, untie=untie, norm=norm, tokens=tokens, device=device,
                   trust_remote_code=trust_remote_code, rotate=rotate)  # fmt: skip
    choice.stream, choice.budget, choice.reason = dist.broadcast(
        (choice.stream, choice.budget, choice.reason)
    )
    if choice.stream:
        choice.source = stream.open_source(model, dtype, trust_remote_code, tokenizer)
    return choice


def _auto(model, dtype, *, untie, norm, tokens, device, trust_remote_code, rotate=False) -> Choice:
    from normswap.errors import NormswapError
    from normswap.io.load import is_causal_lm, load_config, resolve, resolve_dtype

    resolved = resolve(model)
    if resolved.gguf_file:
        return Choice(False)
    config = load_config(resolved, trust_remote_code=trust_remote_code)
    if not is_causal_lm(config):
        return Choice(False)
    if resolved.kind == "hub":
        tensors = hub_tensors(resolved.path)
    else:
        try:
            tensors = checkpoint_tensors(resolved.path)
        except NormswapError:
            tensors = None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None) or 512
    count = min(tokens or 512, positions)
    torch_type = resolve_dtype(dtype, resolved, config)
    return choose(
        tensors, config, torch_type, untie=untie, norm=norm, tokens=count, device=device, rotate=rotate
    )

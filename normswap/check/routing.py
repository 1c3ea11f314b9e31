"""The forward's discrete choices (a mixture of experts' top-k routing), made alike in every run compared.

A router picks each token's experts with ``torch.topk`` over its scores. In half precision a conversion's
rounding (a norm's weight folded into the router) moves the scores by about one ulp, and a token whose k-th
and (k+1)-th scores are that close picks another expert: its hidden state then differs by O(1). The original
in bfloat16 does the same against its own float32 run, on other tokens. Compared as they are, the check would
judge which handful of near-tied tokens each run happened to flip (measured on a Mixtral-8x7B-shaped model
with a random router: 14 of 512 tokens within 0.01 of a tie; the original flipped 6, the converted model 4,
2 of them different).

So the half-precision check records the float32 original's choices (``Choices()``) and imposes them on the
original in its own dtype and on the converted model (``Choices(replay=...)``): each ``torch.topk`` returns
the recorded indices, with values gathered from the running model's own scores. Every output is compared
under the same routing, and three things are judged or reported:

* the scores each choice was made on (the input of ``topk``) are compared like any other record: relative
  error at the check's sampled positions, within ``rtol + k x`` the original's own error (``judge``). A model
  can route a token otherwise than the float32 original only where its scores moved by at least half the gap
  between the k-th and (k+1)-th: so with the scores within rounding, every other choice is a near tie;
* how many rows each model, left alone, would have chosen otherwise (``flipped``), and the largest float32
  gap among them (``largest_gap``), for the report;
* a converted model whose ``topk`` calls do not match the original's (count, shapes) fails the check.

Only ``torch.topk`` (function or method) is a choice here: the routers of transformers' mixtures of experts
(Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek-V3's group-limited routing, OLMoE, GPT-OSS, Llama 4) all make
theirs with it. A model without any ``topk`` call is run as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .contract import _rel
from .localize import MAX_POSITIONS

_TOPK = (torch.topk, torch.Tensor.topk)


@dataclass(frozen=True)
class Choice:
    """One ``topk`` call of the float32 original.

    Attributes:
        module: the innermost module running when it was called (its qualified name; ``""``: the model).
        indices: the chosen indices, as ``topk`` returned them (long, CPU).
        gaps: per row (``indices``' shape without ``dim``), the k-th minus the (k+1)-th score (float32,
            CPU); None when ``k`` is the whole axis.
        scores: at most ``MAX_POSITIONS`` rows of the scores (float64, CPU, the chosen axis last).
        dim: the axis chosen along, non-negative.
    """

    module: str
    indices: torch.Tensor
    gaps: torch.Tensor | None
    scores: torch.Tensor
    dim: int


@dataclass
class Run:
    """What one run did with the choices: its own choices where they differ, and its scores' sample."""

    flipped: int = 0
    largest_gap: float | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    mismatch: str | None = None


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Evenly spaced rows (at most ``MAX_POSITIONS``) of ``t`` with ``dim`` moved last, float64 on the CPU."""
    flat = t.detach().movedim(dim, -1).reshape(-1, t.shape[dim])
    take = torch.linspace(0, flat.shape[0] - 1, min(flat.shape[0], MAX_POSITIONS)).round().long().unique()
    return flat[take.to(flat.device)].to("cpu", torch.float64)


def _arguments(args, kwargs) -> tuple[torch.Tensor, int, int, bool]:
    names = ("input", "k", "dim", "largest")
    given = dict(zip(names, args, strict=False)) | kwargs
    x = given["input"]
    return x, int(given["k"]), int(given.get("dim", -1)) % max(1, x.ndim), bool(given.get("largest", True))


class Choices(TorchFunctionMode):
    """Context manager over a model's forward: records every ``torch.topk`` call (``replay=None``), or
    imposes recorded choices on the same calls (``replay``: ``Choices.choices`` of a recording run).

    Attributes after the block: ``choices`` (recording: one :class:`Choice` per call, in call order) or
    ``run`` (replaying: a :class:`Run`).
    """

    def __init__(self, model: torch.nn.Module, replay: list[Choice] | None = None):
        super().__init__()
        self.names = {m: n for n, m in model.named_modules()}
        self.replay = replay
        self.choices: list[Choice] = []
        self.run = Run()
        self._stack: list[str] = []
        self._calls = 0
        self._hooks = []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module, args):
            self._stack.append(self.names.get(module, self._stack[-1] if self._stack else ""))

        def leave(module, args, output):
            if self._stack:
                self._stack.pop()

        self._hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)
        if self.replay is not None and self.run.mismatch is None and self._calls != len(self.replay):
            self.run.mismatch = f"it made {self._calls} top-k choices, the original {len(self.replay)}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _TOPK:
            return out
        x, k, dim, largest = _arguments(args, kwargs)
        i, self._calls = self._calls, self._calls + 1
        if self.replay is None:
            gaps = None
            if k < x.shape[dim]:
                near = func(x, k + 1, dim, largest).values.float()
                gaps = (near.select(dim, k - 1) - near.select(dim, k)).abs().cpu()
            module = self._stack[-1] if self._stack else ""
            self.choices.append(Choice(module, out.indices.cpu(), gaps, _rows(x, dim), dim))
            return out
        if self.run.mismatch is not None:
            return out
        if i >= len(self.replay) or self.replay[i].indices.shape != out.indices.shape:
            shape = tuple(out.indices.shape)
            self.run.mismatch = f"its top-k choice {i} is not the original's (shape {shape})"
            return out
        choice = self.replay[i]
        indices = choice.indices.to(out.indices.device)
        other = (out.indices.sort(dim).values != indices.sort(dim).values).any(dim).cpu()
        self.run.flipped += int(other.sum())
        if choice.gaps is not None and bool(other.any()):
            gap = float(choice.gaps[other].max())
            self.run.largest_gap = max(gap, self.run.largest_gap or 0.0)
        self.run.scores.append(_rows(x, dim))
        return torch.return_types.topk((x.gather(dim, indices), indices))


@dataclass
class Routing:
    """The float32 original's choices and the original's own run under them (``Reference.routing``)."""

    choices: list[Choice]
    original: Run

    def own_errors(self) -> list[float]:
        """Per choice, the original's own relative error of the scores against float32."""
        return [_rel(c.scores, s) for c, s in zip(self.choices, self.original.scores, strict=False)]


def judge(routing: Routing, converted: Run, rtol: float, k: float) -> tuple[dict, list[str]]:
    """The report's ``routing`` entry and the failures: the converted model's scores against the float32
    original's (relative error within ``rtol + k x`` the original's own, per choice), its choices matched.

    Returns ``(entry, failures)``; entry keys: ``choices`` (calls), ``rows`` (rows chosen per forward),
    ``imposed`` (True), ``flipped`` and ``largest_gap`` (``{"original", "converted"}``: rows each model alone
    would have chosen otherwise than the float32 original, the largest float32 gap among them), ``worst``
    (the choice whose scores came closest to their threshold: module, relative error, threshold).
    """
    failures = []
    if converted.mismatch is not None:
        failures.append(f"the converted model's routing differs from the original's: {converted.mismatch}")
    own = routing.own_errors()
    worst = None
    for i, (choice, scores) in enumerate(zip(routing.choices, converted.scores, strict=False)):
        threshold = rtol + k * own[i]
        error = _rel(choice.scores, scores)
        if worst is None or error / threshold > worst["rel_error"] / worst["threshold"]:
            worst = {"module": choice.module, "call": i, "rel_error": error, "threshold": threshold}
        if error > threshold:
            failures.append(
                f"the routing scores of {choice.module or 'the model'} (top-k choice {i}) differ from the "
                f"original's (relative error {error:.3g} > {threshold:.3g})"
            )
    rows = sum(c.indices.numel() // max(1, c.indices.shape[c.dim]) for c in routing.choices)
    entry = {
        "choices": len(routing.choices),
        "rows": rows,
        "imposed": True,
        "flipped": {"original": routing.original.flipped, "converted": converted.flipped},
        "largest_gap": {"original": routing.original.largest_gap, "converted": converted.largest_gap},
        "worst": worst,
    }
    return entry, failures


def _rows_text(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def line(entry: dict, dtype: str) -> str:
    """The summary's line for a ``routing`` entry."""
    flipped, gaps = entry["flipped"], entry["largest_gap"]
    gap = max((g for g in gaps.values() if g is not None), default=None)
    near = f", all at near ties (float32 score gaps up to {gap:.3g})" if gap is not None else ""
    return (
        f"the float32 original's {entry['choices']} top-k choices ({entry['rows']} rows) imposed on both "
        f"models; alone, the converted model would choose otherwise in {_rows_text(flipped['converted'])}, "
        f"the original in {dtype} in {_rows_text(flipped['original'])}{near}"
    )

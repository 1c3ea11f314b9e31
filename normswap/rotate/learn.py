"""Learning the residual stream's ``Q`` for a quantizer (``--rotate learned``; SpinQuant's R1, Liu et al.).

A randomized Hadamard ``Q0`` spreads the stream's outliers; an orthogonal ``R`` on top of it may spread them
better for a given quantizer. Learning works on the model already rotated by ``Q0`` (``normswap.convert``
rotates a copy with ``rotate="hadamard"``) and its records (``TensorRotation``: which tensors hold ``Q`` on
which axis): each such tensor is used as if rotated once more by ``R`` along the same axis (the same
``v -> v R`` the exact rotation applies), so the proxy computes the float model's function for every
orthogonal ``R`` (checked before training: ``proxy_error``). Its loss is the next-token cross entropy of the
proxy under a fake quantization scheme (``normswap.quantize``: round-to-nearest, per-token activations and/or
per-channel weights), with the rounding straight-through (its gradient is the identity; the scales, ``max
|x| / L``, keep their gradient). Only ``R`` is trained, kept orthogonal by the Cayley map ``R = (I + A)^-1
(I - A)`` of a skew-symmetric ``A = P - Pᵀ`` (Adam on ``P``, ``P = 0`` at the start: ``R = I``, the
Hadamard model). For a stream that LayerNorms read (``Q 1 = 1``), ``A`` is projected so that ``A 1 = 0``,
hence ``R 1 = 1``.

The result is ``Q = Q0 R`` in float64, made orthogonal to float64 rounding (its polar factor), which the
ordinary conversion then applies exactly (``normswap.rotate.fold_and_rotate``); the per-head ``H`` stays the
randomized Hadamard one. Cost per step: the forward and backward of the model on ``batch x length`` tokens,
plus rotating the tensors that hold ``Q`` by ``R`` (for a weight scheme, every rotated weight each step;
for activations alone, the activations at the rotated linear ops instead); docs/ROTATION.md has the
measurements.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normswap.config import LEARN_DEFAULTS, ROTATE_TARGETS
from normswap.quantize import SCHEMES, Scheme
from normswap.rotate.apply import rotate_along
from normswap.walk import func_name

log = logging.getLogger("normswap")

TARGETS = ROTATE_TARGETS  # normswap's own fake schemes (normswap.quantize.SCHEMES without a library)
_TRANSPOSES = {"t", "T", "mT", "transpose", "permute", "swapaxes", "swapdims"}
_MATMULS = {"matmul", "mm", "__matmul__"}


@dataclass(frozen=True)
class Settings:
    """How ``Q`` is learned (``normswap convert --rotate learned``'s ``--rotate-*`` options).

    Attributes:
        target: the fake quantization scheme trained for (``TARGETS``: ``normswap.quantize.SCHEMES`` without a
            library).
        steps: optimizer steps.
        batch: calibration windows per step.
        length: tokens per window.
        samples: calibration windows in all (cycled in a seeded order; at least ``batch``).
        lr: Adam's learning rate on ``P`` (``A = P - Pᵀ``), decayed linearly to 0 over the steps.
        calibration: where the calibration windows come from (for the report).
    """

    target: str = LEARN_DEFAULTS["target"]
    steps: int = LEARN_DEFAULTS["steps"]
    batch: int = LEARN_DEFAULTS["batch"]
    length: int = LEARN_DEFAULTS["length"]
    samples: int = LEARN_DEFAULTS["samples"]
    lr: float = LEARN_DEFAULTS["lr"]
    calibration: str = "token ids given"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"rotate_target must be one of {', '.join(TARGETS)}, not {self.target!r}")
        for name in ("steps", "batch", "samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rotate_{name} must be a positive integer, not {value!r}")
        if not isinstance(self.length, int) or self.length < 2:
            raise ValueError(f"rotate_length must be an integer of at least 2, not {self.length!r}")
        if self.samples < self.batch:
            raise ValueError(f"rotate_samples ({self.samples}) must be at least rotate_batch ({self.batch})")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"rotate_lr must be a positive number, not {self.lr!r}")

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.target]


@dataclass
class Learned:
    """What learning gave: ``R`` (float64, ``(n, n)``, orthogonal) and how it went (for the report).

    Attributes:
        r: the learned ``R`` (``Q = Q0 R``).
        losses: the quantized proxy's loss on each step's batch, before that step's update.
        final_loss: its loss on the first batch after the last step (``losses[0]`` is on the same batch).
        seconds: wall time of the training loop.
        proxy_error: the float proxy's largest logit difference from the ``Q0`` model for a random orthogonal
            ``R``, on one window, before training (float rounding only when the proxy is exact).
    """

    r: torch.Tensor
    losses: list[float] = field(default_factory=list)
    final_loss: float = math.nan
    seconds: float = 0.0
    proxy_error: float = 0.0


def ste_rtn(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """``normswap.quantize.fake.rtn`` with a straight-through rounding: the same values (to float rounding:
    ``y + (round(y) - y)`` is ``round(y)`` exactly when ``round(y) - y`` is), the gradient of the rounding
    the identity, the scale's gradient kept. Same shape and dtype as ``x``."""
    levels = 2 ** (bits - 1) - 1
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    scale = work.abs().amax(dim, keepdim=True).clamp(min=torch.finfo(work.dtype).tiny) / levels
    y = work / scale
    y = y + (torch.round(y) - y).detach()
    return (y.clamp(-levels, levels) * scale).to(x.dtype)


def cayley(p: torch.Tensor, keep_ones: bool = False) -> torch.Tensor:
    """``R = (I + A)^-1 (I - A)`` with ``A = P - Pᵀ`` (skew-symmetric: ``R`` is orthogonal), ``A`` projected
    to ``C A C`` (``C = I - u uᵀ``, ``u = 1/sqrt(n)``) when ``keep_ones``, so that ``R 1 = 1``. ``p``:
    ``(n, n)``; the result has its dtype and device."""
    a = p - p.T
    n = p.shape[0]
    eye = torch.eye(n, dtype=p.dtype, device=p.device)
    if keep_ones:
        u = torch.full((n, 1), 1.0 / math.sqrt(n), dtype=p.dtype, device=p.device)
        c = eye - u @ u.T
        a = c @ a @ c
    return torch.linalg.solve(eye + a, eye - a)


def orthogonalize(q: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor ``U Vᵀ`` of ``q`` (``U S Vᵀ`` its SVD), float64: the orthogonal matrix
    nearest ``q``. It keeps ``q 1 = 1`` where ``q`` and ``qᵀ`` both fix ``1`` (up to rounding)."""
    u, _, vh = torch.linalg.svd(q.double())
    return u @ vh


class Proxy(TorchFunctionMode):
    """While active (and after ``begin(R)``), ``model`` computes as if every tensor that holds ``Q`` (the
    records' rotations by ``"Q"``) were rotated once more by ``R`` along the same axis, with ``scheme``'s fake
    quantization (straight-through) at every linear op but the output head, found as
    ``normswap.quantize.fake.FakeQuant`` finds them.

    Where the tensor is the weight of ``F.linear`` (whole axis, not quantized itself) or an embedding
    table, ``R`` is applied to the activation instead of the weight (``x (W R)ᵀ = (x Rᵀ) Wᵀ``, ``(x Wᵀ) R``,
    ``E[ids] R``): the same function, cheaper than rotating a large table each step.

    Args:
        model: the model rotated by ``Q0``; its parameters are not changed.
        records: its ``TensorRotation`` records (``Rotation.tensors``).
        scheme: the quantization scheme (``None``: float).
    """

    def __init__(self, model: nn.Module, records, scheme: Scheme | None):
        super().__init__()
        self.scheme = scheme
        params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        self.rot: dict[int, tuple[torch.Tensor, list]] = {}
        for rec in records:
            q = [(axis, groups) for axis, name, groups in rec.rotations if name == "Q"]
            if q and rec.name in params:
                self.rot[id(params[rec.name])] = (params[rec.name], q)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_weight = getattr(head, "weight", None)
        self.linear = {id(p): p for p in params.values() if p.dim() == 2 and p is not head_weight}
        self.r: torch.Tensor | None = None
        self.values: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, r: torch.Tensor) -> None:
        """Use ``r`` (``(n, n)``, the model's dtype) from now on; forget what was computed with the last."""
        self.r = r
        self.values.clear()
        self.inputs.clear()
        self.views.clear()

    def value(self, p):
        """``p`` as rotated once more by ``R`` (computed once per ``begin``), or ``p`` itself."""
        if not isinstance(p, torch.Tensor) or id(p) not in self.rot:
            return p
        if id(p) not in self.values:
            x = p
            for axis, groups in self.rot[id(p)][1]:
                x = rotate_along(x, axis % p.ndim, self.r.to(p.dtype), groups)
            self.values[id(p)] = x
        return self.values[id(p)]

    def _act(self, x):
        bits = self.scheme.activation_bits if self.scheme else None
        if bits is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        return ste_rtn(x, bits, -1)

    def _weight_bits(self, p) -> int | None:
        return self.scheme.weight_bits if self.scheme and id(p) in self.linear else None

    def _whole(self, p, axis: int) -> bool:
        """``p`` holds ``Q`` along ``axis`` alone, over the whole axis."""
        return self.rot[id(p)][1] == [(axis, None)] if id(p) in self.rot else False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func_name(func)
        if name == "linear" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            rest = {k: v for k, v in kwargs.items() if k != "bias"}
            if id(w) in self.linear:
                x = self._act(x)
            r = self.r
            if self._weight_bits(w) is None:
                if self._whole(w, 1) and (b is None or id(b) not in self.rot):  # a reader: x (W R)ᵀ
                    key = id(args[0])
                    if key not in self.inputs or self.inputs[key][0] is not args[0]:
                        self.inputs[key] = (args[0], x @ r.to(x.dtype).T)
                    return func(self.inputs[key][1], w, b, **rest)
                if self._whole(w, 0) and (b is None or self._whole(b, 0)):  # a writer: (x Wᵀ + c) R
                    return func(x, w, b, **rest) @ r.to(x.dtype)
            w, b = self.value(w), self.value(b)
            bits = self._weight_bits(args[1])
            if bits is not None:
                w = ste_rtn(w, bits, 1)
            return func(x, w, b, **rest)
        if name == "embedding" and len(args) >= 2 and self._whole(args[1], 1):
            return func(*args, **kwargs) @ self.r.to(args[1].dtype)
        if name in _MATMULS or name == "addmm":
            at = 1 if name == "addmm" else 0
            found = self._param(args[at + 1]) if len(args) >= at + 2 else None
            if found is not None:  # x @ W, W (or W.t()) in x out
                param, transposed = found
                new = [self.value(a) for a in args]
                if id(param) in self.linear:
                    new[at] = self._act(args[at])
                w = self.value(param)
                w = w.transpose(0, 1) if transposed else w
                bits = self._weight_bits(param)
                if bits is not None:
                    w = ste_rtn(w, bits, 0)
                new[at + 1] = w
                return func(*new, **kwargs)
        if name in _TRANSPOSES and args and id(args[0]) in self.linear:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape == args[0].shape[::-1]:
                self.views[id(out)] = (out, args[0])
                return out
        new = [self.value(a) if isinstance(a, torch.Tensor) else a for a in args]
        new = [type(a)(self.value(t) for t in a) if isinstance(a, (list, tuple)) else a for a in new]
        return func(*new, **{k: self.value(v) for k, v in kwargs.items()})

    def _param(self, w):
        if not isinstance(w, torch.Tensor):
            return None
        if id(w) in self.linear:
            return w, False
        view = self.views.get(id(w))
        if view is not None and view[0] is w:
            return view[1], True
        return None


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on ``ids`` (``(B, L)``), float32."""
    logits = model(input_ids=ids, use_cache=False).logits.float()
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def proxy_error(model: nn.Module, records, ids: torch.Tensor, seed: int, keep_ones: bool) -> float:
    """Largest ``|logit|`` difference between ``model`` and its float proxy (``Proxy``, no quantization) for a
    random orthogonal ``R`` drawn from ``seed`` (``Q 1 = 1`` kept where asked): float rounding when the proxy
    is exact, large when some use of a rotated tensor was missed."""
    from normswap.rotate.matrix import generator, random_orthogonal

    n = _order(records, model)
    r = random_orthogonal(n, generator(seed))
    if keep_ones:
        from normswap.rotate.matrix import householder_ones

        r = householder_ones(r)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        proxy = Proxy(model, records, None)
        proxy.begin(r.to(dtype))
        with proxy:
            got = model(input_ids=ids, use_cache=False).logits
    return (got.double() - expected.double()).abs().max().item()


def _order(records, model) -> int:
    params = dict(model.named_parameters(remove_duplicate=False))
    for rec in records:
        for axis, name, _ in rec.rotations:
            if name == "Q" and rec.name in params:
                return params[rec.name].shape[axis]
    raise ValueError("the rotation records hold no tensor rotated by Q")


def learn(
    model: nn.Module,
    records,
    calibration: list[torch.Tensor],
    settings: Settings,
    *,
    seed: int = 0,
    keep_ones: bool = False,
    progress: bool = False,
) -> Learned:
    """Train ``R`` on ``model`` (rotated by ``Q0``, ``records`` its ``TensorRotation`` records) so that the
    quantized proxy's next-token loss on ``calibration`` falls.

    Args:
        model: a causal LM (``.logits``) rotated by ``Q0``; not changed (its parameters are frozen here and
            their ``requires_grad`` restored after).
        records: ``Rotation.tensors`` of that rotation.
        calibration: ``(1, L)`` long tensors of token ids (at least ``settings.batch``, one length).
        settings: ``Settings``.
        seed: seeds the order the windows are cycled in (and the proxy check's ``R``).
        keep_ones: keep ``R 1 = 1`` (a stream that LayerNorms read).
        progress: show a progress bar with the loss (tqdm, on stderr).

    Returns:
        ``Learned``: ``R`` in float64 (Cayley of the trained ``P`` computed in float64) and the losses.

    Raises:
        ValueError: fewer calibration windows than ``settings.batch``, or windows of different lengths.
        normswap.rotate.RotationError: a proxy that does not compute the model's function (``proxy_error``
            beyond float rounding: a use of a rotated tensor that ``Proxy`` does not see; one line, the CLI
            exits 2).
    """
    from tqdm.auto import tqdm

    if len(calibration) < settings.batch:
        raise ValueError(f"{len(calibration)} calibration windows, fewer than a batch of {settings.batch}")
    if len({tuple(c.shape) for c in calibration}) != 1:
        raise ValueError("calibration windows must all have one shape")
    n = _order(records, model)
    device = next(model.parameters()).device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    windows = torch.cat([c.reshape(1, -1) for c in calibration]).to(device)
    error = proxy_error(model, records, windows[:1], seed, keep_ones)
    with torch.no_grad():
        scale = 1.0 + float(model(input_ids=windows[:1], use_cache=False).logits.abs().max())
    bound = 1e-3 if dtype == torch.float32 else (1e-10 if dtype == torch.float64 else 5e-2)
    if not error <= bound * scale:
        from normswap.rotate.plan import RotationError

        raise RotationError(
            f"cannot learn the rotation: the learning proxy does not compute the rotated model's function "
            f"(logits differ by {error:.3g} for a random R: a use of a rotated tensor it does not see)"
        )
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    order: list[int] = []
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    was_training = model.training
    model.eval()
    p = torch.zeros((n, n), dtype=torch.float32, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([p], lr=settings.lr)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / settings.steps)
    proxy = Proxy(model, records, settings.scheme)
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=settings.steps, desc="learning Q", disable=not progress, leave=False)

    def batch(step: int) -> torch.Tensor:
        while len(order) < (step + 1) * settings.batch:
            order.extend(torch.randperm(windows.shape[0], generator=gen).tolist()[: settings.samples])
        picked = order[step * settings.batch : (step + 1) * settings.batch]
        return windows[picked]

    try:
        with torch.enable_grad():
            for step in range(settings.steps):
                ids = batch(step)
                proxy.begin(cayley(p, keep_ones).to(dtype))
                with proxy:
                    loss = _loss(model, ids)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                decay.step()
                losses.append(float(loss.detach()))
                bar.set_postfix(loss=f"{losses[-1]:.4f}", first=f"{losses[0]:.4f}")
                bar.update(1)
            with torch.no_grad():
                proxy.begin(cayley(p.detach(), keep_ones).to(dtype))
                with proxy:
                    final = float(_loss(model, batch(0)))
    finally:
        bar.close()
        proxy.values.clear()
        proxy.inputs.clear()
        for q, flag in frozen:
            q.requires_grad_(flag)
        model.train(was_training)
    seconds = time.perf_counter() - start
    r = cayley(p.detach().double().cpu(), keep_ones)
    log.info("learned R in %d steps (%.1f s): loss %.4f -> %.4f", settings.steps, seconds, losses[0], final)
    return Learned(r, losses, final, seconds, error)


def compose(q0: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``Q = Q0 R`` in float64, made orthogonal to float64 rounding (``orthogonalize``)."""
    return orthogonalize(q0.double().cpu() @ r.double().cpu())


def windows(calibration, settings: Settings) -> list[torch.Tensor]:
    """The first ``settings.samples`` windows of ``calibration`` (``(1, L)`` long tensors, ``L >=
    settings.length``), each cut to its first ``settings.length`` tokens.

    Raises:
        ValueError: no calibration, fewer windows than ``settings.samples``, or a window too short.
    """
    if not calibration:
        raise ValueError("rotate='learned' needs calibration token ids (rotate_calibration=[(1, L) tensors])")
    if len(calibration) < settings.samples:
        raise ValueError(
            f"{len(calibration)} calibration windows, fewer than rotate_samples={settings.samples}"
        )
    picked = [c.reshape(1, -1) for c in calibration[: settings.samples]]
    short = min(c.shape[-1] for c in picked)
    if short < settings.length:
        raise ValueError(
            f"a calibration window has {short} tokens, fewer than rotate_length={settings.length}"
        )
    return [c[:, : settings.length] for c in picked]


def record(settings: Settings, learned: Learned, base: str) -> dict:
    """The report's ``rotation.learned`` entry: the settings (with the calibration), the losses, the time."""
    return {
        **asdict(settings),
        "start": base,
        "optimizer": "Adam on P, R = Cayley(P - Pᵀ) = (I + A)^-1 (I - A)",
        "loss": "next-token cross entropy under the target's fake quantization (rounding straight-through)",
        "loss_first": learned.losses[0] if learned.losses else None,
        "loss_last_step": learned.losses[-1] if learned.losses else None,
        "loss_after_on_first_batch": learned.final_loss,
        "losses": [round(x, 6) for x in learned.losses],
        "seconds": round(learned.seconds, 2),
        "proxy_error": learned.proxy_error,
    }

"""The conversion pipeline, in place: walk -> plan -> untie -> fold -> swap."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.affine_fold import fold_affine, plan_affine
from normswap.config import KEEP_VS_CENTER, KEEP_VS_ROTATE, NORM_CHOICES
from normswap.errors import NormswapError
from normswap.fold import fold_site, plan, scale_and_shift, untie_checked
from normswap.sites import NormSite
from normswap.swap import swap_norms
from normswap.walk import ExampleInputs, Walk, walk

log = logging.getLogger("normswap")


@dataclass
class ConvertReport:
    """What ``convert`` did.

    Attributes:
        model: the model's name or path (``config._name_or_path``) or class name.
        norm: the requested target kind (``"keep"`` or ``"rmsnorm"``).
        norms_found / norms_folded / norms_swapped: counts over ``sites``.
        sites: every norm found, with consumers, what was done and why not.
        untied: qualified names of parameters given their own storage before folding.
        untie_bytes: extra bytes those copies cost.
        untouched: 2-D+ parameters no op used in the trace (listed for the user to judge).
        probe_failures: norm candidates the probe could not characterize (module name -> why: a module that
            normalizes like a norm on large inputs but that no eps reproduces, one that fails on a probe
            input); not in ``sites``, left as they are.
        check: the check result (``CheckResult.to_dict()``) when the caller ran one.
        rotation: the residual-stream rotation (``normswap.rotate.Rotation``) when one was asked for.
        keep_hidden_states: whether the conversion kept every hidden state (``convert``'s option).
        centering: what centering did (``norm="rmsnorm"``: ``CenterResult.to_dict()``, with ``inputs``, the
            ``inputs_embeds`` transform; after a rotation, ``inputs`` points to the rotation's map instead,
            ``ROTATED_INPUTS``), or None.
    """

    model: str
    norm: str
    norms_found: int
    norms_folded: int
    norms_swapped: int
    sites: list[NormSite]
    untied: list[str] = field(default_factory=list)
    untie_bytes: int = 0
    untouched: list[str] = field(default_factory=list)
    probe_failures: dict[str, str] = field(default_factory=dict)
    check: dict[str, Any] | None = None
    rotation: Any = None
    keep_hidden_states: bool = False
    centering: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        extra = {"rotation": self.rotation.to_dict()} if self.rotation is not None else {}
        return {
            "model": self.model,
            "norm": self.norm,
            "norms_found": self.norms_found,
            "norms_folded": self.norms_folded,
            "norms_swapped": self.norms_swapped,
            "untied": list(self.untied),
            "untie_bytes": self.untie_bytes,
            "untouched": list(self.untouched),
            "probe_failures": dict(self.probe_failures),
            "sites": [s.to_dict() for s in self.sites],
            "keep_hidden_states": self.keep_hidden_states,
            "centering": self.centering,
            "check": self.check,
        } | extra


class Store:
    """Where the weights ``convert`` changes live, and how its steps reach them.

    This class is the model's own Parameters, changed in place: ``convert``'s default. A model whose large
    weights stay on disk (``normswap.stream.store.ShardStore``) overrides the hooks: the plans read values
    with ``read``/``read_rows``, untying makes placeholders with ``copy``, centering and the rotation turn
    each change of a weight on disk into a transform, and ``fold`` leaves its records for the writer. The
    steps and their order are ``convert``'s either way.

    Attributes:
        read: ``name -> tensor``, a parameter's values for the rotation's plan; None: the Parameter itself.
        read_rows: the same for the fold plan's range test (``normswap.fold.plan``'s ``read``).
        copy: how untying makes a Parameter's own copy (``normswap.fold.untie_parameters``); None: a clone.
    """

    read = None
    read_rows = None
    copy = None

    def run(self, step):
        """``step()``: a store may turn the errors its weights raise into one line."""
        return step()

    def settle(self) -> None:
        """Called between two steps: a store may give back the memory the last one freed."""

    def note(self, step: str) -> None:
        """A step begins: a store whose steps take long may say so (``normswap.progress.note``)."""

    def center(self, model: nn.Module, walk: Walk, inputs, *, untie: bool, add_biases: bool, recorded=None):
        """``normswap.center.center`` in place; its ``CenterResult``."""
        from normswap.center import center

        return center(model, walk, inputs, untie=untie, add_biases=add_biases, recorded=recorded)

    def fold_and_rotate(self, model: nn.Module, plan, sites, folding, kind: str, seed: int, matrices=None):
        """``normswap.rotate.fold_and_rotate`` in place; its ``Rotation``."""
        from normswap.rotate import fold_and_rotate

        return fold_and_rotate(model, plan, sites, folding, kind, seed, matrices=matrices)

    def fold(self, model: nn.Module, walk: Walk, folding, scales: dict, skip: set[str]) -> int:
        """Fold ``folding``'s sites but ``skip`` (the rotation folded those) with their ``scales``
        (``normswap.fold.scale_and_shift``, read before any fold) and the per-channel affine sites
        (``normswap.affine_fold``), in place; returns how many affine sites were folded."""
        for site in folding.sites:
            if site.name not in skip:
                fold_site(model, site, scales[site.name])
        affine = plan_affine(model, walk)  # BatchNorm / NoNorm: into a producer or consumers
        for site in affine:
            fold_affine(model, site)
        return len(affine)


ROTATED_INPUTS = {
    "kind": "rotated",
    "inputs_embeds": "centered, then rotated: the map is the rotation's inputs_embeds "
    "(normswap/inputs_embeds.json)",
}


def describe_inputs(model: nn.Module, rotation, centering=None) -> None:
    """Set ``rotation.inputs``: what the rotated ``model`` expects as ``inputs_embeds``
    (``normswap.rotate.inputs.describe``), from the table's rotation and, for a model centered first
    (``centering``: the ``CenterResult``), the centering's own transform of it."""
    from normswap.rotate.inputs import describe

    centered = centering is not None and centering.note is None
    rotation.inputs = describe(model, rotation, centering.inputs if centered else None)


def stream_transform(report: ConvertReport | dict, folder=None):
    """The change ``report``'s conversion made to the residual stream by design, for ``check.compare``
    (``normswap.check.contract.StreamTransform``), or None: rotated after ``rotate=...`` (centered first for
    a LayerNorm model; the matrix is ``report.rotation``'s, or read from the checkpoint ``folder`` for a
    ``normswap.json`` dict), centered after ``norm="rmsnorm"`` (a rewritten embedding table's norm input
    excepted).

    With ``folder``, the files the manifest names are looked for there, and each one missing is a warning
    (``StreamTransform.warnings``): ``centering.json`` and ``normswap/inputs_embeds.json`` (the check does
    not need them; a user mapping ``inputs_embeds`` does) and the rotation's ``Q`` (``saved_q``). Without
    ``Q`` (missing, unreadable, of another shape, not the recorded matrix) the transform's ``apply`` is None:
    nothing on the stream is compared, and the logits decide."""
    from normswap.center.inputs import FILE
    from normswap.check.contract import centered, rotated

    data = report.to_dict() if hasattr(report, "to_dict") else report
    centering = data.get("centering") or {}
    # the modules holding the parameters centering changed: "model.layers.0.mlp.down_proj.weight[0]",
    # "model.layers.0.self_attn.q_proj.weight[0] x4 groups" (centered per head)
    centered_writers = [
        (w.split("[", 1)[0].rpartition(".")[0], " groups" in w) for w in centering.get("writers", [])
    ]
    writers = {m for m, grouped in centered_writers if not grouped}
    not_compared = {m for m, grouped in centered_writers if grouped}
    rewritten = {t.split(" -> ", 1)[1].split(" ", 1)[0] for t in centering.get("tables", [])}
    warnings = []
    if data.get("rotation"):
        from normswap.rotate import ROTATION_FILE
        from normswap.rotate.inputs import FILE as INPUTS_FILE

        rotation = data["rotation"]
        tensors = rotation.get("tensors", [])
        writers |= {t["name"].rpartition(".")[0] for t in tensors if "output" in t["sides"]}
        # --rotate-heads: value projections write each head's features times H (not the stream)
        not_compared |= {t["name"].rpartition(".")[0] for t in tensors if "head output" in t["sides"]}
        rewritten |= set(rotation.get("table_norms", []))
        q = getattr(getattr(report, "rotation", None), "Q", None)
        unavailable = None
        if q is None:
            q, unavailable = saved_q(rotation, folder)
        if unavailable is not None:
            warnings.append(
                f"normswap.json records a rotation, but {unavailable}: the residual stream (hidden states, "
                "the localization's records of the stream) cannot be compared without its Q and is not; the "
                "logits decide"
            )
        mapped = (rotation.get("inputs_embeds") or {}).get("kind") == "map"
        if folder is not None and mapped and not (Path(folder) / INPUTS_FILE).is_file():
            same = "normswap.json's rotation.inputs_embeds holds the same map"
            warnings.append(_missing_map(INPUTS_FILE, same))
        return rotated(q, bool(rotation.get("centered")), ROTATION_FILE, rewritten, writers, not_compared,
                       unavailable=unavailable, warnings=warnings)  # fmt: skip
    if not centering:
        return None
    transform = centering.get("inputs") or {}
    if folder is not None and transform.get("kind") in ("center", "rewrite", "none"):
        if not (Path(folder) / FILE).is_file():
            warnings.append(_missing_map(FILE, "normswap.json's centering.inputs holds the same transform"))
    result = centered(FILE, rewritten, writers, not_compared)
    result.warnings = tuple(warnings)
    return result


def _missing_map(file: str, where: str) -> str:
    return (
        f"{file} is missing (copied without it?): the check does not need it, but vectors given as "
        f"inputs_embeds must be mapped with it ({where})"
    )


def saved_q(rotation: dict, folder) -> tuple[torch.Tensor | None, str | None]:
    """The rotation's ``Q`` from the checkpoint ``folder`` (``normswap.rotate.ROTATION_FILE``), checked
    against what ``rotation`` (a manifest's ``rotation`` entry) records: its size and, where recorded, its
    SHA-256 (``normswap.rotate.matrix.Matrix.sha256``); without one (older manifests), ``Q`` must be
    orthogonal (``|Qᵀ Q x - x| <= 1e-9 |x|`` for 4 seeded random ``x``).

    Returns:
        ``(Q float64 (n, n), None)``, or ``(None, why)``: one phrase naming the file and what is wrong
        (missing, unreadable, no ``Q``, another shape, not the recorded matrix).
    """
    from normswap.rotate import ROTATION_FILE
    from normswap.rotate.matrix import digest

    file = rotation.get("file") or ROTATION_FILE
    if folder is None:
        return None, f"no folder was given to read {file} from"
    path = Path(folder) / file
    if not path.is_file():
        return None, f"{file} is missing (a copy without its normswap/ folder?)"
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if "Q" not in f.keys():
                return None, f"{file} holds no Q (tensors: {', '.join(sorted(f.keys())) or 'none'})"
            q = f.get_tensor("Q")
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: said in one line
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        return None, f"{file} cannot be read ({line})"
    recorded = (rotation.get("matrices") or {}).get("Q") or {}
    size = recorded.get("size")
    if q.ndim != 2 or q.shape[0] != q.shape[1] or (size is not None and q.shape[0] != size):
        want = f"{size} x {size}" if size is not None else "square"
        return None, f"{file} holds a Q of shape {tuple(q.shape)}, not {want}"
    q = q.to(torch.float64)
    sha = recorded.get("sha256")
    if sha is not None and digest(q) != sha:
        return None, f"{file} holds another Q than the one recorded (its SHA-256 differs: changed or corrupt)"
    if sha is None:
        x = torch.randn(q.shape[0], 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        if not bool(torch.isfinite(q).all()) or ((q.T @ (q @ x)) - x).norm() > 1e-9 * x.norm():
            return None, f"{file} holds a Q that is not orthogonal (changed or corrupt)"
    return q, None


def _model_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", "") or type(model).__name__


def trace_inputs(input_ids: torch.Tensor | None = None, example_inputs=None):
    """The inputs the pipeline traces with: ``ExampleInputs`` when ``example_inputs`` is given, else the ids.

    Raises:
        ValueError: both are given.
        TypeError: ``example_inputs`` has none of the forms ``ExampleInputs.of`` accepts.
    """
    if example_inputs is None:
        return input_ids
    if input_ids is not None:
        raise ValueError("give either input_ids or example_inputs, not both")
    return ExampleInputs.of(example_inputs)


def no_norms_message(result: Walk) -> str:
    """``"no normalization module found"``, plus how many candidates failed to probe and the first error."""
    message = "no normalization module found"
    if result.probe_failures:
        name, error = next(iter(result.probe_failures.items()))
        count = len(result.probe_failures)
        message += f" ({count} candidate{'s' if count > 1 else ''} failed to probe; {name}: {error})"
    return message


def at_identity(model: nn.Module, site: NormSite) -> bool:
    """Whether norm ``site`` of ``model`` already holds its identity affine parameters: weight ``1 - offset``
    (1, or 0 for Gemma's ``1 + w``) and bias 0 (as a fold leaves it); a parameter-free norm always does."""
    module = model.get_submodule(site.name)
    for attr, value in ((site.weight, 1.0 - site.offset), (site.bias, 0.0)):
        tensor = getattr(module, attr, None) if attr else None
        if tensor is None:
            continue
        tensor = tensor.detach()
        if tensor.is_meta or (tensor.numel() and tensor.untyped_storage().nbytes() == 0):
            return False  # its values are elsewhere (offloaded, or streamed from disk): not known here
        if not bool(torch.all(tensor == value)):
            return False
    return True


def already_converted(
    source: str, model: nn.Module, sites: list[NormSite], norm: str, manifest, *, rotate: str | None = None
) -> None:
    """Refuse a conversion that has nothing left to do on ``model``, a model converted before, or that
    cannot be done on it; return when there is work.

    The work asked for is read against what the input's ``manifest`` (its ``normswap.json`` as a dict, or
    ``None``) says was done, and against the model:

    * ``rotate``: on a model not rotated before, always work (folded norms are what a rotation needs), also
      when every norm already holds its identity weight; on a model the manifest says was rotated, refused:
      a second rotation would be exact (``Q2`` after ``Q1``), but what normswap saves beside the output (the
      matrices, the ``inputs_embeds`` map, the check's records) would then describe the rotated input, not
      the original, and the first ``Q`` would be lost from the output's record;
    * ``norm="rmsnorm"``: centering is work on a model with LayerNorms not centered before; on one the
      manifest says was centered and rotated (a LayerNorm model's rotation centers it first) there is
      nothing left to do;
    * otherwise, refused when the manifest says normswap wrote the input and every foldable norm already
      holds its identity parameters (:func:`at_identity`), or, without a manifest, when every norm with
      parameters does.

    Raises:
        NormswapError: one line naming ``source``, what the manifest says was done, and what to do instead.
    """
    version = (manifest or {}).get("normswap_version") or "an unknown version"
    rotated = (manifest or {}).get("rotation") or None
    if rotated is not None:
        file = rotated.get("file") or "normswap/rotation.safetensors"
        if rotate is not None:
            raise NormswapError(
                f"{source}: already rotated by normswap {version} (its normswap.json records Q in {file}); "
                "rotating it again would be exact, but its Q, inputs_embeds map and check would describe "
                "this rotated model instead of the original: rotate the original model instead"
            )
        if norm == "rmsnorm" and rotated.get("centered"):
            raise NormswapError(
                f"{source}: nothing to do: already centered and rotated by normswap {version} (its "
                "normswap.json says so: the rotation of a LayerNorm model centers its stream first, and its "
                "norms are folded); --norm rmsnorm would change nothing"
            )
    if rotate is not None:
        return
    if norm == "rmsnorm" and any(s.kind == "layernorm" for s in sites):
        if (manifest or {}).get("norm") != "rmsnorm":
            return
    if manifest is not None:
        if any(s.foldable and not at_identity(model, s) for s in sites):
            return
        steps = ["converted"] + ["centered"] * (manifest.get("norm") == "rmsnorm")
        steps += ["rotated"] * bool(rotated)
        done = steps[0] if len(steps) == 1 else ", ".join(steps[:-1]) + " and " + steps[-1]
        raise NormswapError(
            f"{source}: nothing to fold: already {done} by normswap {version} (its normswap.json says so, "
            "and every foldable norm holds its identity weight); convert the original model instead"
        )
    weighted = [s for s in sites if s.weight or s.bias]
    if weighted and all(at_identity(model, s) for s in weighted):
        raise NormswapError(
            f"{source}: nothing to fold: every norm already holds its identity weight (a model converted "
            "before?); its conversion would be a copy"
        )


def inspect(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    *,
    example_inputs=None,
    untie: bool = True,
    keep_hidden_states: bool = False,
) -> list[NormSite]:
    """List the norms of ``model`` with their semantics, consumers and foldability; changes nothing.

    Each site's ``foldable`` and ``reason`` are the verdict ``convert`` reaches with the same options: the
    walk, then the same fold plan (shared parameters, the fold's range in the weights' dtype, untying
    ``lm_head`` and its proof, undone afterwards). See ``survey``.

    Args:
        model: any ``nn.Module``: a Hugging Face model, or one whose forward takes other inputs (give
            ``example_inputs`` then).
        input_ids: ``(batch, seq)`` int64 ids for the one traced forward (called as
            ``model(input_ids=...)``); default 2 x 16 fixed random ids below the config's vocabulary size.
        example_inputs: the traced forward's inputs instead, as ``torch.export`` takes them:
            ``(args_tuple, kwargs_dict)``; also a tuple of positional args, a dict of keyword args, a single
            tensor (one positional arg) or ``normswap.walk.ExampleInputs``. Called as
            ``model(*args, **kwargs)``, exactly as given.
        untie, keep_hidden_states: as in ``convert``.

    Returns:
        One ``NormSite`` per norm module, in execution order.

    Raises:
        ValueError: both ``input_ids`` and ``example_inputs`` given.
    """
    inputs = trace_inputs(input_ids, example_inputs)
    return survey(model, inputs, untie=untie, keep_hidden_states=keep_hidden_states).sites


@torch.inference_mode(False)
def survey(model: nn.Module, inputs=None, *, untie: bool = True, keep_hidden_states: bool = False) -> Walk:
    """The walk of ``model`` with the verdict ``convert`` would reach on each site, without converting.

    ``walk`` finds the norms and what reads them; ``fold.plan`` then blocks the sites convert blocks
    (a Parameter shared with another holder, a fold beyond the weights' dtype range, a tied consumer with
    untying disabled), and the untie proof runs as in ``convert`` (two short forwards where the model may
    read ``tie_word_embeddings``), after which the untied copies are dropped again: the model ends exactly
    as it was. Centering (``norm="rmsnorm"``) is not planned here: the verdicts are those of ``"keep"``.

    Args:
        model: the model (unchanged on return).
        inputs: the trace's inputs (``input_ids``, ``ExampleInputs`` or None; see ``walk``).
        untie, keep_hidden_states: as in ``convert``.
    """
    result = walk(model, inputs, keep_hidden_states=keep_hidden_states)
    if result.sites:
        folding = plan(model, result, untie=untie)
        untie_checked(model, folding, inputs).restore()
    return result


@torch.inference_mode(False)  # tensors made here become parameters: never inference tensors (C24)
def convert(
    model: nn.Module,
    *,
    norm: str = "keep",
    fold: bool = True,
    untie: bool = True,
    swap: bool = True,
    input_ids: torch.Tensor | None = None,
    example_inputs=None,
    traced: Walk | None = None,
    rotate: str | None = None,
    rotate_seed: int = 0,
    rotate_heads: bool = False,
    keep_hidden_states: bool = False,
    rotate_learn=None,
    rotate_calibration: list[torch.Tensor] | None = None,
    rotate_progress: bool = False,
    store: Store | None = None,
) -> ConvertReport:
    """Fold every foldable norm into its consumers and swap every norm for a fused module, in place.

    Per-channel affine sites (``kind`` ``"batchnorm"`` / ``"affine"``: BatchNorm in eval mode, NoNorm) are
    folded into their consumers or the producer of their input where exact and left at their identity
    (``normswap.affine_fold``), never swapped; each one not folded has its reason.

    Args:
        model: the model to convert (modified in place).
        norm: ``"keep"`` keeps each norm's kind; ``"rmsnorm"`` converts a pre-LN LayerNorm model into an
            equivalent RMSNorm model by centering the residual stream (SliceGPT, Ashkboos et al. 2024).
        fold: fold affine parameters into consumers where exact.
        untie: allow giving a tied consumer weight (``lm_head`` tied to the embedding) its own copy so the
            final norm can fold into it; with False such sites are swapped only and storage stays shared.
        swap: replace norms by fused modules.
        input_ids: ids for the trace (see ``inspect``).
        example_inputs: the trace's inputs for a forward that does not take ``input_ids`` (see ``inspect``);
            also used for the untie proof and the centering record.
        traced: a ``normswap.walk.walk(model, inputs)`` of this model taken just before (so a caller that
            needed the sites first, e.g. to record a reference, does not trace twice); walked here if None.
            With ``keep_hidden_states`` it must have been walked with ``keep_hidden_states=True`` too.
            Walked with ``record=True``, its recording serves the rotation plan and centering (handed over:
            the walk no longer holds it); else they record a forward of their own.
        rotate: ``"hadamard"``, ``"random"`` or ``"learned"``: after folding, rotate the residual stream by
            an orthogonal ``Q`` (hidden x hidden; a randomized Hadamard matrix where a construction is known,
            else a seeded random orthogonal one); a LayerNorm model is centered first (as
            ``norm="rmsnorm"``) and gets a ``Q`` with ``Q 1 = 1``. Every hidden state becomes the original's
            (centered) times ``Q`` (``report.rotation``, docs/ROTATION.md). Needs ``fold``.
        rotate_seed: seed of the rotation's random signs or Gaussian matrix, in ``[0, 2**63 - 1]``.
        rotate_heads: also rotate each attention head's values and output projection (``--rotate-heads``).
            With ``"learned"``: ``Q = Q0 R``, ``Q0`` the randomized Hadamard matrix of ``rotate_seed`` and
            ``R`` trained so that a copy of the model rotated by ``Q0`` and fake-quantized loses least on
            ``rotate_calibration`` (``normswap.rotate.learn``; ``H`` stays the randomized Hadamard one).
        rotate_learn: ``normswap.rotate.learn.Settings`` for ``"learned"`` (None: its defaults).
        rotate_calibration: ``(1, L)`` long tensors of token ids that ``"learned"`` trains on (at least
            ``rotate_learn.samples`` of one length ``L >= rotate_learn.length``, cut to that length; needed).
        rotate_progress: show the learning's progress bar (tqdm, with the loss).
        keep_hidden_states: keep every hidden state the model returns (``output_hidden_states``, the base
            model's ``last_hidden_state``) the original's: a norm whose output is returned (the final norm) is
            not folded into the head, and centering and rotation, which move every hidden state, are refused.
        store: where the weights live (``Store``; default: the model's Parameters, changed in place; a
            streamed model's, ``normswap.stream.store.ShardStore``, whose fold is applied as its shards are
            written).

    Returns:
        A ``ConvertReport``. Every parameter it creates is an ordinary tensor, also when called inside
        ``torch.inference_mode()``: the converted model can be trained. After centering, give
        ``normswap.check.compare`` the stream transform ``stream_transform(report)``.

    Raises:
        ValueError: unknown ``norm``, both ``input_ids`` and ``example_inputs``, or ``norm="rmsnorm"`` with
            ``keep_hidden_states``.
        NormswapError: the model has no norm.
        normswap.center.CenteringError: ``norm="rmsnorm"`` on a model that cannot be converted exactly (the
            model is left unchanged).
        normswap.rotate.RotationError: ``rotate`` on a model whose stream cannot be rotated exactly (a
            weighted post-norm, a non-linear reader of the stream, ...; the model is left unchanged).
    """
    if norm not in NORM_CHOICES:
        raise ValueError(f"norm must be one of {NORM_CHOICES}, got {norm!r}")
    if norm == "rmsnorm" and keep_hidden_states:
        raise ValueError(KEEP_VS_CENTER)
    if rotate is not None and keep_hidden_states:
        raise ValueError(KEEP_VS_ROTATE)
    store = store if store is not None else Store()
    inputs = trace_inputs(input_ids, example_inputs)
    if traced is None:
        traced = walk(model, inputs, keep_hidden_states=keep_hidden_states,
                      record=norm == "rmsnorm" or rotate is not None)  # fmt: skip
    result = traced
    # the walk's recording forward serves the rotation plan and centering (on a streamed model, one pass
    # over the weights on disk); not across the learned rotation, whose memory goes to the copy it trains
    recorded = result.take_recording()
    if not result.sites:
        raise NormswapError(f"{_model_name(model)}: {no_norms_message(result)}")
    rotation_plan = None
    if rotate is not None:
        from normswap.rotate import KINDS, LEARNED, plan_rotation

        if rotate not in (*KINDS, LEARNED):
            raise ValueError(f"rotate must be one of {(*KINDS, LEARNED)}, got {rotate!r}")
        if not 0 <= int(rotate_seed) < 2**63:  # torch.Generator's range; negatives would alias large seeds
            raise ValueError(f"rotate_seed must be in [0, 2**63 - 1], got {rotate_seed}")
        if not fold:
            raise ValueError("rotate needs fold=True: a rotation needs every norm on the stream weightless")
        # checkpoint tensors the class does not run (an MTP layer) would read a rotated stream: the CLI
        # refuses them before converting, save_converted(input_path=...) before writing (normswap.io.carry)
        store.note("planning the rotation of the residual stream")
        rotation_plan = store.run(lambda: plan_rotation(
            model, result, inputs, untie=untie, heads=rotate_heads, read=store.read, recorded=recorded
        ))  # fmt: skip
        recorded, rotation_plan.recorded = rotation_plan.recorded, None
        store.settle()
    learned = None
    if rotate == "learned":  # from a copy of the model as it is now: nothing changed yet
        recorded = None
        learned = _learn(model, untie, rotate_seed, rotate_heads, rotate_learn, rotate_calibration,
                         rotate_progress, input_ids=input_ids, example_inputs=example_inputs)  # fmt: skip
    centering = not_centered = None
    if norm == "rmsnorm":
        store.note("centering the LayerNorms' inputs")
        centering = store.run(lambda: store.center(model, result, inputs, untie=untie, add_biases=fold,
                                                   recorded=recorded))  # fmt: skip
    elif rotation_plan is not None and rotation_plan.keep_ones:  # LayerNorms read the stream: center first
        from normswap.center import CenteringError

        store.note("centering the LayerNorms' inputs before the rotation")
        try:
            centering = store.run(lambda: store.center(model, result, inputs, untie=untie, add_biases=fold,
                                                       recorded=recorded))  # fmt: skip
            norm = "rmsnorm"
        except CenteringError as error:  # left unchanged: rotated uncentered, Q 1 = 1 keeps LayerNorm exact
            not_centered = getattr(error, "what", None) or str(error)
    recorded = None
    store.settle()
    report = ConvertReport(
        model=_model_name(model), norm=norm, norms_found=len(result.sites), norms_folded=0, norms_swapped=0,
        sites=result.sites, untouched=result.untouched, probe_failures=dict(result.probe_failures),
        keep_hidden_states=keep_hidden_states,
    )  # fmt: skip
    if fold:
        store.note("planning the folds (each consumer weight read once)")
        folding = store.run(lambda: plan(model, result, untie=untie, read=store.read_rows))
        if folding.untie_bytes:
            log.info("untying %s costs %d extra bytes", ", ".join(f"{m}.{a}" for m, a in folding.untie),
                     folding.untie_bytes)  # fmt: skip
        untied = store.run(lambda: untie_checked(model, folding, inputs, copy=store.copy))
        # every scale is read before any norm is reset: norms sharing one Parameter fold with its value
        scales = {s.name: scale_and_shift(s, model.get_submodule(s.name)) for s in folding.sites}
        stream = set()
        if rotation_plan is not None:  # before any fold: a refusal undoes the untying
            from normswap.rotate import RotationError, check_folding

            check_folding(model, result, rotation_plan, folding, untied)
            stream = set(rotation_plan.stream_sites)  # these fold in the rotation's float64 pass
            store.note(f"rotating the residual stream: {rotate}")
            try:
                report.rotation = store.fold_and_rotate(
                    model,
                    rotation_plan,
                    result.sites,
                    folding,
                    rotate,
                    rotate_seed,
                    None if learned is None else learned[0],
                )
            except RotationError:
                untied.restore()
                raise
            report.rotation.centered = centering is not None and centering.note is None
            report.rotation.not_centered = not_centered
            if learned is not None:
                report.rotation.learned = learned[1]
            describe_inputs(model, report.rotation, centering)
        report.untied = untied.names
        report.untie_bytes = folding.untie_bytes
        report.norms_folded = len(folding.sites) + store.fold(model, result, folding, scales, stream)
        for site in result.sites:
            if site.foldable and not site.folded and not site.reason:
                site.decide("convert", reason="not folded")
    else:
        for site in result.sites:
            if site.foldable:
                site.decide("convert", reason="folding disabled by option")
    if centering is not None:  # centering may untie an embedding written into the residual stream
        report.untied = centering.untied + report.untied
        report.untie_bytes += centering.untie_bytes
        if centering.note is None:
            report.centering = centering.to_dict()
            if report.rotation is not None:
                report.centering["inputs"] = dict(ROTATED_INPUTS)
    if swap:
        report.norms_swapped = swap_norms(model, result.sites)
    return report


def _learn(model, untie, seed, heads, settings, calibration, progress, **trace):
    """``rotate="learned"``: ``({"Q": learned, "H": ...}, the report's record)`` from a copy of ``model``
    rotated by the randomized Hadamard ``Q0`` of ``seed`` (``normswap.rotate.learn``); ``model`` is not
    changed.

    Raises:
        ValueError: no or too little calibration, or a proxy that does not compute the copy's function.
    """
    import copy

    from normswap.rotate import learn
    from normswap.rotate.matrix import Matrix

    settings = settings if settings is not None else learn.Settings()
    windows = learn.windows(calibration, settings)
    twin = copy.deepcopy(model)
    try:
        first = convert(twin, untie=untie, swap=False, rotate="hadamard", rotate_seed=seed,
                        rotate_heads=heads, **trace)  # fmt: skip
        q0 = first.rotation.matrices["Q"]
        keep_ones = q0.keeps_ones
        done = learn.learn(twin, first.rotation.tensors, windows, settings, seed=seed, keep_ones=keep_ones,
                           progress=progress)  # fmt: skip
    finally:
        del twin
    q = learn.compose(q0.values, done.r)
    description = (
        f"learned Q0 R: Q0 = {q0.description}; R trained for {settings.target} "
        f"({settings.steps} steps, loss {done.losses[0]:.4f} -> {done.final_loss:.4f} on the first batch)"
    )
    matrices = {"Q": Matrix("Q", q, "learned", description, keep_ones)}
    if "H" in first.rotation.matrices:
        matrices["H"] = first.rotation.matrices["H"]
    return matrices, learn.record(settings, done, q0.description)

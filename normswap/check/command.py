"""``normswap check A B``: compare two saved checkpoints with the full checker."""

from __future__ import annotations

from pathlib import Path

import click

from normswap.errors import NormswapError
from normswap.options import device_option, dtype_option


def _manifest_sites(path) -> list:
    """NormSite records from a checkpoint's ``normswap.json`` (empty when there is none)."""
    from normswap.io import MANIFEST, read_manifest
    from normswap.sites import NormSite

    if not (Path(path) / MANIFEST).is_file():
        return []
    return [NormSite.from_dict(s) for s in read_manifest(path).get("sites", [])]


@click.command("check")
@click.argument("original")
@click.argument("converted")
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
    help="Override the tolerance on the max abs logit difference.",
)
@click.option("--device-map", help='Passed to from_pretrained, e.g. "auto".')
@device_option
@click.option("--report", type=click.Path(dir_okay=False), help="Write the CheckResult as JSON here.")
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

    Prints the metrics; exit code 0 when CONVERTED matches within the tolerance for the dtype
    (docs/CHECKING.md), 1 when it does not (the first diverging norm site is named when CONVERTED has a
    normswap manifest), 2 on bad input.
    """
    from normswap.check import compare, reference_outputs
    from normswap.check.inputs import (
        check_positions,
        check_same_model,
        command_input_ids,
        default_tokens,
        text_ids,
    )
    from normswap.evaluate import load_for_eval, model_dtype_name, read_text
    from normswap.io import check_output_file, load, quiet_loading, resolve, write_json

    quiet_loading()
    if report:
        check_output_file(report, [original, converted])
    resolve(original)  # bad paths fail here, before the (slow) load of the other model
    converted_config = load.load_config(resolve(converted), trust_remote_code=trust_remote_code)
    kw = dict(dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code, device=device)
    model, tokenizer = load_for_eval(original, **kw)
    kw["dtype"] = model_dtype_name(model)  # auto: ORIGINAL's own dtype, for CONVERTED too
    if tokenizer is None:
        raise NormswapError(f"{original}: no tokenizer found")
    # models that differ are named before any forward pass (an IndexError or a size mismatch otherwise)
    check_same_model(original, model.config, converted, converted_config)
    if text_file is None:
        input_ids = command_input_ids(original, model.config, tokenizer, tokens, reserve=(greedy, "--greedy"))
    else:
        tokens = tokens or default_tokens(model.config, greedy)
        input_ids = text_ids(tokenizer, read_text(text_file)[0], tokens, source=text_file, what="--tokens")
    count = input_ids.shape[1]
    what = f"--tokens {count}" + (f" + --greedy {greedy}" if greedy else "")
    check_positions(count + greedy, what, {original: model.config, converted: converted_config})
    sites = _manifest_sites(converted)
    names = {name for name, _ in model.named_modules()}
    if sites and not all(site.name in names for site in sites):
        raise NormswapError(f"{converted}: its norm sites are not modules of {original} (different models?)")
    reference = reference_outputs(model, input_ids, sites=sites, greedy_tokens=greedy)
    del model  # lean: one model in memory at a time
    other, _ = load_for_eval(converted, tokenizer=False, **kw)
    try:
        tolerance = None if max_abs is None else {"max_abs": max_abs}
        result = compare(reference, other, tolerance=tolerance, sites=sites)
    except (ValueError, KeyError, AttributeError) as error:  # a model of another architecture
        raise NormswapError(f"{converted}: {error}") from error
    if report:
        write_json(report, result.to_dict())
    click.echo(result.summary())
    if not result.passed:
        raise SystemExit(1)

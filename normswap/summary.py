"""The summary ``normswap convert`` prints, from a conversion's report (``summary``)."""

from __future__ import annotations

from pathlib import Path

from normswap import progress
from normswap.check.contract import BY_DESIGN, lines
from normswap.check.policy import verdict_line
from normswap.check.routing import line as routing_line
from normswap.io.verify import describe
from normswap.rotate import summary_lines


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# measured with `normswap eval --quantize` by benchmarks/bench_quantize.py (docs/ROTATION.md, "Quantizing")
QUANTIZE_EXAMPLE = (
    "SmolLM2-135M, 4-bit weights per channel, Python's LICENSE.txt: perplexity 23.0 original, 67.3 folded"
)


def quantize_line(report: dict, output: Path | None) -> str | None:
    """After a conversion that folded norms but did not rotate: one line saying that folded weights can
    quantize worse than the original's (an example measured on another model), pointing at --rotate and
    ``eval --quantize``, which measures this one."""
    if not report.get("norms_folded") or report.get("rotation"):
        return None
    command = f"normswap eval --model {report.get('model')} --converted {output or 'OUT'} --quantize w4"
    return (
        f"quantize: folded weights can quantize worse than the original's (measured on {QUANTIZE_EXAMPLE}); "
        f"--rotate hadamard spreads activation outliers; measure yours: {command} --quantize a6"
    )


def streamed_line(report: dict) -> str | None:
    """For a streamed conversion: the shards, the most bytes of weights held at once, and whether that was
    over the budget (``--max-memory``): the weights one module runs with, and each tensor as it is written
    (a rotated or centered stack of experts), are held whole, whatever the budget."""
    streamed = report.get("streamed")
    if not streamed:
        return None
    peak, budget = streamed.get("peak_weight_bytes"), streamed.get("budget")
    shards = streamed.get("shards")
    line = f"memory:   streamed ({shards} shard{'s' if shards != 1 else ''})"
    if peak is not None:
        line += f", weights held at most {progress.size(peak)}"
        if budget is not None and peak > budget:
            whole = "one module's weights, or a tensor being written, are held whole"
            line += f": over the budget of {_decimal(budget)} ({whole})"
    return line


def _decimal(nbytes: int) -> str:
    """``progress.size``, and a budget given in decimal units as given: ``"95.4 MiB = 100 MB"``."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{progress.size(nbytes)} = {nbytes // scale} {unit}"
    return progress.size(nbytes)


def contract_lines(check: dict, report: dict) -> list[str]:
    """The ``contract:`` lines of ``check`` (the report's): per returned output (runs grouped), same or
    changed by design and why."""
    contract = check.get("contract") or []
    if not contract:
        return []
    out = [("contract: " if i == 0 else " " * 10) + line for i, line in enumerate(lines(contract, check))]
    folded = any(e["status"] == BY_DESIGN and not e.get("relation") for e in contract)
    # centering and rotation move the stream by design, which --keep-hidden-states refuses: no hint then
    moved = report.get("rotation") or (report.get("centering") or {}).get("sites")
    if folded and not report.get("keep_hidden_states") and not moved:
        out.append(" " * 10 + "(--keep-hidden-states keeps every hidden state the original's)")
    return out


def summary(report: dict, output: Path | None, report_path: Path | None) -> str:
    """The lines ``normswap convert`` prints after a conversion (one string, lines joined by newlines).

    Args:
        report: the conversion's report (``normswap.json``'s content: norms, untying, rotation, check,
            contract, carried tensors and files, verification, timings in seconds).
        output: the folder the checkpoint was saved to, or None when nothing was saved.
        report_path: where the report was written (``--report``), or None.
    """
    lines = [
        f"model:    {report.get('model')} ({report.get('dtype', '?')})",
        f"norms:    {report['norms_found']} found, {report['norms_folded']} folded, "
        f"{report['norms_swapped']} swapped",
    ]
    if report.get("norm") == "rmsnorm" and not report.get("centering"):
        lines.append("center:   none: the model has no LayerNorm (--norm rmsnorm changed nothing)")
    untied = report.get("untied") or []
    if untied:
        lines.append(f"untied:   {', '.join(untied)} (+{progress.size(report.get('untie_bytes') or 0)})")
    rotation = report.get("rotation")
    if rotation:
        lines += summary_lines(rotation)
    check_input = report.get("check_input") or {}
    if check_input.get("source") == "vocabulary":
        lines.append(
            f"input:    ids drawn from the vocabulary ({check_input['vocab_size']} ids, torch seed "
            f"{check_input['seed']}): {check_input['reason']}; --tokenizer gives real text"
        )
    if check_input.get("source") == "random":
        shape = "x".join(str(n) for n in check_input["shape"])
        lines.append(
            f"input:    {check_input['input']} {shape} ~ N(0, 1), torch seed {check_input['seed']}: "
            f"{check_input['reason']}"
        )
    check = report.get("check") or {}
    if check:
        output_name = {"logits": "logit", "last_hidden_state": "hidden state"}.get(
            check.get("output"), "logit"
        )
        numbers = [f"max |{output_name} diff| {_fmt(check.get('max_abs_logit_diff'), '.3g')}"]
        if check.get("kl_mean") is not None:
            numbers.append(f"KL {check['kl_mean']:.3g}, top-1 {_fmt(check.get('top1_agreement'), '.2%')}")
        if check.get("ppl_original") is not None:
            numbers.append(f"ppl {check['ppl_original']:.4f} -> {_fmt(check.get('ppl_converted'), '.4f')}")
        unit = "output rows" if check_input.get("source") == "random" else "tokens"
        lines.append(f"check:    {check.get('tokens')} {unit}, " + ", ".join(numbers))
        lines.append(f"          {verdict_line(check)}")
        for failure in check.get("failures") or []:
            lines.append(f"          - {failure}")
        if check.get("divergence"):
            lines.append(f"          first divergence: {check['divergence'].get('description')}")
        lines += contract_lines(check, report)
        if check.get("routing"):
            lines.append(f"routing:  {routing_line(check['routing'], check.get('dtype', ''))}")
    carried = report.get("carried") or {}
    if carried.get("tensors"):
        names = carried["tensors"]
        kept = carried.get("norms_kept_unfolded") or []
        lines.append(
            f"carried:  {len(names)} tensor{'s' if len(names) > 1 else ''} the model class does not run, "
            f"copied unchanged ({names[0]}"
            + (", ...)" if len(names) > 1 else ")")
            + (f"; {', '.join(kept)} kept unfolded: they may read its output" if kept else "")
        )
    if carried.get("files") or carried.get("not_copied"):
        copied = ", ".join(carried.get("files") or []) or "none"
        skipped = "; not copied: " + ", ".join(carried["not_copied"]) if carried.get("not_copied") else ""
        lines.append(f"copied:   {copied} (other files of the input){skipped}")
    if check_input.get("note"):
        lines.append(f"note:     {check_input['note']}")
    quantize = quantize_line(report, output)
    if quantize:
        lines.append(quantize)
    memory = streamed_line(report)
    if memory:
        lines.append(memory)
    if output is not None:
        lines.append(f"saved:    {output}")
    verify = report.get("verify")
    if verify:
        lines.append(f"verified: {describe(verify)}")
    if report_path is not None:
        lines.append(f"report:   {report_path}")
    timings = report.get("timings") or {}
    if timings:
        stages = ", ".join(f"{name} {seconds:.1f}" for name, seconds in timings.items())
        lines.append(f"time:     {progress.seconds(sum(timings.values()))} ({stages})")
    return "\n".join(lines)

"""Paired lm-evaluation-harness runs: the original and the converted model on the same task items.

``normswap eval --model A --converted B --tasks NAMES`` runs lm-eval's ``simple_evaluate`` (with
``log_samples=True``) once per model, each wrapped in lm-eval's ``HFLM`` around the model normswap already
loaded, and compares the two runs item by item (:func:`pair_task`): both sides' metrics with their
stderr, the difference with its paired stderr, the share of items where both chose the same answer (or
generated the same text), the largest change of an item's log-likelihood, and the items that changed.

Data parallelism is lm-eval's own: its evaluator gives document ``i`` to rank ``i % K``, pads every rank
to the same number of requests, and gathers the per-item results on rank 0. ``HFLM`` built around a
loaded model always sets ``rank 0 of 1`` (it forms its process group only when it loads the model from a
name, and then only on more than one GPU), so :func:`wrap_model` hands it normswap's ``Accelerator``
(rank, world size, device), the attributes lm-eval's own accelerate path sets. On a CPU-only machine the
group is gloo (``normswap.evaluate.make_accelerator``).

lm-eval is optional (``pip install -e '.[eval]'`` in normswap's checkout); only this module imports it.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
from pathlib import Path

from normswap import progress
from normswap.errors import NormswapError

INSTALL_HINT = (
    "--tasks needs lm-evaluation-harness: pip install -e '.[eval]' in normswap's checkout "
    "(or pip install 'lm-eval>=0.4.9,<0.5')"
)
STANDARD_TASKS = ("arc_easy", "hellaswag", "piqa", "winogrande")


def require_lm_eval():
    """The ``lm_eval`` package, or a ``NormswapError`` that says how to install it."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (HFLM needs the hf dependencies too)
    except ImportError as error:
        raise NormswapError(f"{INSTALL_HINT} ({error})") from error
    return lm_eval


@contextlib.contextmanager
def quiet_lm_eval():
    """Within the block, lm-eval logs errors only (it warns about every pre-loaded model it wraps), and its
    progress bars (and those of datasets and the hub it calls) show only when normswap's progress lines do
    (``normswap.progress.showing``: the CLI turns them on for a terminal)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.nullcontext() if progress.showing() else no_progress_bars():
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def no_progress_bars():
    """Within the block, every ``tqdm`` bar is created disabled, whatever its caller passes (lm-eval's bars
    pass ``disable=`` themselves, so tqdm's own ``TQDM_DISABLE`` does not reach them)."""
    from unittest import mock

    import tqdm.std

    init = tqdm.std.tqdm.__init__

    def disabled(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    with mock.patch.object(tqdm.std.tqdm, "__init__", disabled):
        yield


def load_tasks(names: list[str], include_path: str | None = None):
    """An lm-eval ``TaskManager`` that knows ``names`` (tasks, groups, tags or YAML paths), each loaded once.

    Tasks found under ``include_path`` alone skip indexing lm-eval's ~15000 built-in tasks (about 10 s);
    otherwise the built-in ones are indexed too. Loading a task loads its dataset (a built-in task such
    as ``arc_easy`` downloads it from the Hugging Face hub on first use), so this fails before any model
    is loaded.

    Raises:
        NormswapError: lm-eval missing, a name that is neither a task/group/tag nor a YAML file, or a task
            whose dataset cannot be loaded (e.g. offline).
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if not names:
        raise NormswapError("--tasks is empty; name lm-eval tasks, e.g. --tasks " + ",".join(STANDARD_TASKS))
    if include_path is not None and not Path(include_path).is_dir():
        raise NormswapError(f"--include-path {include_path} is not a directory")
    with quiet_lm_eval():
        manager = None
        if include_path is not None:
            manager = TaskManager(include_path=include_path, include_defaults=False)
            if not all(_known(manager, name) for name in names):
                manager = None
        if manager is None:
            manager = TaskManager(include_path=include_path)
        unknown = [name for name in names if not _known(manager, name)]
        if unknown:
            hints = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
            hint = f"; did you mean {', '.join(hints)}?" if hints else ""
            raise NormswapError(f"unknown lm-eval task(s) {', '.join(unknown)}{hint}")
        try:
            manager.load(list(names))
        except Exception as error:  # dataset download, YAML errors: lm-eval raises many kinds
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise NormswapError(f"lm-eval cannot load task(s) {', '.join(names)}: {first}") from error
    return manager


def _known(manager, name: str) -> bool:
    return name in manager.all_tasks or (name.endswith((".yaml", ".yml")) and Path(name).is_file())


def wrap_model(model, tokenizer, accelerator=None, batch_size: int = 1):
    """lm-eval's ``HFLM`` around a loaded causal LM, sharing ``accelerator``'s process group.

    Args:
        model: a transformers causal LM, already on ``accelerator.device``.
        tokenizer: its tokenizer (lm-eval may set its pad token: to its unk or eos token).
        accelerator: an ``accelerate.Accelerator``; with more than one process, lm-eval splits the
            documents over them and gathers the results on rank 0.
        batch_size: requests per forward pass.
    """
    from lm_eval.models.huggingface import HFLM

    with quiet_lm_eval():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if accelerator is not None and accelerator.num_processes > 1:
        # what HFLM.__init__ sets on its own accelerate path (a model it loads by name, on several GPUs)
        lm.accelerator = accelerator
        lm._rank = accelerator.process_index
        lm._world_size = accelerator.num_processes
        lm._device = accelerator.device
    return lm


def run_tasks(lm, tasks, *, manager=None, limit=None, num_fewshot=None):
    """``lm_eval.simple_evaluate`` with per-item samples -> its results dict (rank 0) or ``None``.

    lm-eval's environment probes are skipped (its results keep ``git_hash`` ``None`` and no
    ``pretty_env_info``): they run ``git describe`` in the working directory, which prints a ``fatal:``
    line outside a repository, and torch's ``collect_env`` (pip, nvidia-smi: 5.6 s on a 2-core machine),
    twice per ``normswap eval``.
    """
    from unittest import mock

    import lm_eval.evaluator
    from lm_eval import simple_evaluate

    with (
        quiet_lm_eval(),
        mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None),
        mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None),
    ):
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=True,
        )


def _number(value) -> float | None:
    """``value`` as a float if it is a number or a bool (per-item ``exact_match`` may be one), else None."""
    return float(value) if isinstance(value, int | float) else None


def _metrics(results: dict) -> dict:
    """``{"acc,none": 0.8, "acc_stderr,none": 0.1, ...}`` -> ``{("acc", "none"): (0.8, 0.1)}``."""
    out = {}
    for key, value in results.items():
        if "," not in key or "_stderr," in key or _number(value) is None:
            continue
        name, filt = key.split(",", 1)
        out[(name, filt)] = (value, _number(results.get(f"{name}_stderr,{filt}")))
    return out


def _item_view(sample: dict, output_type: str):
    """One logged sample -> ``(answer, log-likelihoods)``.

    ``answer`` is what the item's score depends on: the index of the choice with the highest
    log-likelihood (multiple choice), the generated text(s), or the is-greedy flags of the continuations.
    """
    logliks, texts, greedy = [], [], []
    for resp in sample["filtered_resps"]:
        if isinstance(resp, str):
            texts.append(resp)
        elif isinstance(resp, list | tuple) and resp and _number(resp[0]) is not None:
            logliks.append(float(resp[0]))
            if len(resp) > 1:
                greedy.append(bool(resp[1]))
        elif _number(resp) is not None:
            logliks.append(float(resp))
        else:
            texts.append(str(resp))
    if output_type == "multiple_choice" and logliks:
        answer = max(range(len(logliks)), key=logliks.__getitem__)
    elif texts:
        answer = texts[0] if len(texts) == 1 else texts
    else:
        answer = greedy or None
    return answer, logliks


def pair_task(original: dict, converted: dict, name: str, output_type: str) -> dict:
    """Compare two lm-eval runs of task ``name`` item by item.

    Args:
        original, converted: results dicts of ``simple_evaluate(..., log_samples=True)``.
        name: a task with logged samples in both.
        output_type: the task's lm-eval output type (``multiple_choice``, ``loglikelihood``,
            ``loglikelihood_rolling``, ``generate_until``).

    Returns:
        ``items``; ``same_answer`` (share of items with the same answer: choice with the highest
        log-likelihood, or generated text); ``max_abs_delta_loglik`` over all log-likelihoods of all items
        (nats; ``None`` for generation) and ``max_delta_item``; ``metrics``: per metric ``original``,
        ``original_stderr``, ``converted``, ``converted_stderr``, ``difference`` (converted - original)
        and ``paired_stderr`` (sample std of the per-item differences / sqrt(n), for metrics that are the
        mean of their per-item values; else ``None``); ``changed``: the items whose answer or per-item
        metric differs (``doc_id``, ``filter``, ``target``, both answers and metric values,
        ``max_abs_delta_loglik``); ``per_item``: every item's ``doc_id``, ``filter``, ``answer`` (original,
        converted) and, where the task scores log-likelihoods, ``loglik`` (both sides' lists, nats).

    Raises:
        RuntimeError: the two runs did not see the same items with the same prompts.
    """
    sides = [{(s["doc_id"], s["filter"]): s for s in run["samples"][name]} for run in (original, converted)]
    if sides[0].keys() != sides[1].keys() or any(
        sides[0][k].get("prompt_hash") != sides[1][k].get("prompt_hash") for k in sides[0]
    ):
        raise RuntimeError(f"{name}: the two lm-eval runs saw different items or prompts")
    keys = sorted(sides[0], key=lambda k: (str(k[1]), k[0]))
    same, max_delta, max_item, changed, items = 0, None, None, [], []
    per_item = {}  # (metric, filter) -> list of (original, converted)
    for key in keys:
        a, b = sides[0][key], sides[1][key]
        answer_a, ll_a = _item_view(a, output_type)
        answer_b, ll_b = _item_view(b, output_type)
        items.append({"doc_id": key[0], "filter": key[1], "answer": [answer_a, answer_b]})
        if ll_a:
            items[-1]["loglik"] = [ll_a, ll_b]
        delta = max((abs(x - y) for x, y in zip(ll_a, ll_b, strict=True)), default=None)
        if delta is not None and (max_delta is None or delta > max_delta):
            max_delta, max_item = delta, key[0]
        metric_values = {}
        for metric in a.get("metrics", []):
            va, vb = _number(a.get(metric)), _number(b.get(metric))
            if va is not None and vb is not None:
                per_item.setdefault((metric, key[1]), []).append((va, vb))
                metric_values[metric] = [va, vb]
        same += answer_a == answer_b
        if answer_a != answer_b or any(va != vb for va, vb in metric_values.values()):
            changed.append({
                "doc_id": key[0], "filter": key[1], "target": a.get("target"),
                "original": answer_a, "converted": answer_b, "metrics": metric_values,
                "max_abs_delta_loglik": delta,
            })  # fmt: skip
    metrics = {}
    results_a, results_b = (_metrics(run["results"].get(name, {})) for run in (original, converted))
    for (metric, filt), (value_a, stderr_a) in results_a.items():
        if (metric, filt) not in results_b:
            continue
        value_b, stderr_b = results_b[(metric, filt)]
        metrics[metric if filt == "none" else f"{metric},{filt}"] = {
            "original": value_a, "original_stderr": stderr_a, "converted": value_b,
            "converted_stderr": stderr_b, "difference": value_b - value_a,
            "paired_stderr": _paired_stderr(per_item.get((metric, filt)), value_a, value_b),
        }  # fmt: skip
    return {
        "output_type": output_type,
        "items": len(keys),
        "same_answer": same / len(keys) if keys else None,
        "max_abs_delta_loglik": max_delta,
        "max_delta_item": max_item,
        "metrics": metrics,
        "changed": changed,
        "per_item": items,
    }


def _paired_stderr(pairs, value_a: float, value_b: float) -> float | None:
    """Standard error of the mean per-item difference, if the metric is the mean of its item values."""
    if not pairs or len(pairs) < 2:
        return None
    n = len(pairs)
    means = [sum(p[i] for p in pairs) / n for i in (0, 1)]
    if not (math.isclose(means[0], value_a, abs_tol=1e-9) and math.isclose(means[1], value_b, abs_tol=1e-9)):
        return None  # not a mean over items (perplexity, F1, BLEU...): no paired stderr
    diffs = [b - a for a, b in pairs]
    mean = sum(diffs) / n
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)


def paired_report(original: dict, converted: dict) -> dict:
    """Both runs' results -> ``{task: pair_task(...) or metrics only}`` for every task and group."""
    report = {}
    for name in original["results"]:
        output_type = original.get("configs", {}).get(name, {}).get("output_type")
        if name in original.get("samples", {}) and name in converted.get("samples", {}):
            report[name] = pair_task(original, converted, name, output_type)
        else:  # a group: its aggregated metrics only
            report[name] = pair_task(
                {"results": original["results"], "samples": {name: []}},
                {"results": converted["results"], "samples": {name: []}},
                name,
                output_type,
            ) | {"items": None}
        report[name]["num_fewshot"] = original.get("n-shot", {}).get(name)
        fewshot_config = original.get("configs", {}).get(name, {}).get("fewshot_config") or {}
        report[name]["fewshot_sampler"] = fewshot_config.get("sampler", "default")
    return report


def _pm(value, stderr) -> str:
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


def format_table(report: dict) -> str:
    """The readable form of :func:`paired_report`: one line per task and metric, then agreement lines."""
    rows = [("task", "metric", "original", "converted", "difference (paired stderr)")]
    notes = []
    for task, r in report.items():
        for metric, m in r["metrics"].items():
            paired = f" (± {m['paired_stderr']:.4f})" if m["paired_stderr"] is not None else ""
            rows.append((
                task, metric, _pm(m["original"], m["original_stderr"]),
                _pm(m["converted"], m["converted_stderr"]), f"{m['difference']:+.4f}{paired}",
            ))  # fmt: skip
        if r["items"]:
            same = round(r["same_answer"] * r["items"])
            kind = "same generated text" if r["output_type"] == "generate_until" else "same answer"
            line = f"{task}: {same}/{r['items']} items {kind}"
            if r["max_abs_delta_loglik"] is not None:
                line += f", max |delta loglik| {r['max_abs_delta_loglik']:.3g} (item {r['max_delta_item']})"
            ids = [str(c["doc_id"]) for c in r["changed"]]
            line += f", {len(ids)} changed" + (f": items {', '.join(ids[:20])}" if ids else "")
            line += "..." if len(ids) > 20 else ""
            notes.append(line)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines + notes)


def paired_eval(
    original, converted, tokenizer, tasks: list[str], *, include_path=None, limit=None, num_fewshot=None,
    batch_size=1, accelerator=None, manager=None,
):  # fmt: skip
    """Run lm-eval tasks on both models and pair the results.

    Args:
        original, converted: causal LMs on ``accelerator.device`` (the converted one as
            ``normswap.load_pretrained`` gives it, fused norms in place), sharing ``tokenizer``.
        tasks: lm-eval task, group or tag names, or YAML paths.
        include_path: a folder of extra task YAMLs.
        limit: at most this many documents per task.
        num_fewshot: few-shot examples per prompt (``None``: each task's default).
        batch_size: requests per forward pass.
        accelerator: an ``accelerate.Accelerator``; K processes split the documents (lm-eval's own data
            parallelism) and give the numbers of one process.
        manager: ``load_tasks(tasks, include_path)`` if already done.

    Returns:
        on the main process ``{"tasks": paired_report(...), "lm_eval_version": ...,
        "num_processes": K}``; ``None`` on the others.

    Raises:
        NormswapError: lm-eval missing, unknown task, task data that cannot be loaded.
    """
    lm_eval = require_lm_eval()
    manager = manager or load_tasks(tasks, include_path)
    runs = []
    for model in (original, converted):
        lm = wrap_model(model, tokenizer, accelerator, batch_size)
        runs.append(run_tasks(lm, list(tasks), manager=manager, limit=limit, num_fewshot=num_fewshot))
    if runs[0] is None:
        return None
    return {
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "num_processes": accelerator.num_processes if accelerator is not None else 1,
        "tasks": paired_report(*runs),
    }


def run_command(original, converted, tokenizer, tasks, accelerator, manager, report, header, **options):
    """``normswap eval --tasks``: :func:`paired_eval`, then (main process) the table and ``--report``.

    ``header`` (model, converted, dtype) and ``options`` (limit, num_fewshot, batch_size) go into the
    JSON report beside the results.
    """
    import click

    result = paired_eval(original, converted, tokenizer, tasks, accelerator=accelerator, manager=manager,
                         **options)  # fmt: skip
    if result is None:
        return
    result = {**header, "lm_eval_tasks": list(tasks), **options, **result}
    if report:
        from normswap.files import stamped, write_json

        write_json(report, stamped(result))
    click.echo(f"lm-eval {result['lm_eval_version']}, {result['num_processes']} process(es)")
    click.echo(format_table(result["tasks"]))
    sampled = [
        name for name, r in result["tasks"].items() if r["num_fewshot"] and r["fewshot_sampler"] != "first_n"
    ]
    if result["num_processes"] > 1 and sampled:
        click.echo(
            f"normswap: warning: {', '.join(sampled)}: lm-eval draws few-shot examples from one random "
            "stream per process, so K processes build other prompts than one (both models see the same ones)",
            err=True,
        )

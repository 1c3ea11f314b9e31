"""normswap eval --tasks: paired lm-evaluation-harness runs, checked against float64 log-likelihoods.

The task is tests/data/lmeval/normswap_mc (10 four-way questions, loaded from the JSONL file beside its
YAML, no network). The tiny model is a Llama (vocab 260, the byte tokenizer of test_check) with its norms
re-randomized and tied embeddings, converted with normswap (untie, fold, swap) and saved; the converted
side loads through normswap.load_pretrained, fused norms in place.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model
from test_check import byte_tokenizer, save_pair
from test_cli import assert_bad_input
from test_evaluate import _free_port

from normswap.cli import main
from normswap.lmeval import format_table, pair_task

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "lmeval"
ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
# The check's float32 tolerance, 2e-4 per logit, moves a log-softmax value by at most 2 x 2e-4; an item's
# log-likelihood sums one such value per continuation token.
LOGIT_TOL = 2e-4


def _docs() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "normswap_mc.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(original dir, converted dir): a tiny Llama and its normswap conversion (all 5 norms folded)."""
    import normswap
    from normswap.io import report_dict, save_converted

    root = tmp_path_factory.mktemp("lmeval")
    model = make_tiny_model("llama", vocab_size=260, max_position_embeddings=256, tie_word_embeddings=True)
    tok = byte_tokenizer()
    model.save_pretrained(root / "orig")
    tok.save_pretrained(root / "orig")
    report = normswap.convert(model)
    assert report.norms_folded == 5 and report.untied
    save_converted(model, tok, report_dict(report), root / "conv")
    return root / "orig", root / "conv"


def _eval(*args, env=None):
    return CliRunner().invoke(main, ["eval", *map(str, args)], env={**ENV, **(env or {})})


def _fp64_logliks(model_dir) -> list[list[float]]:
    """Each choice's log-likelihood after its question, as lm-eval scores it, from a float64 copy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    tok = byte_tokenizer()
    out = []
    for doc in _docs():
        context = tok(f"Question: {doc['question']}\nAnswer:")["input_ids"]
        row = []
        for choice in doc["choices"]:
            continuation = tok(" " + choice)["input_ids"]
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logp = model(input_ids=ids[:, :-1]).logits[0].log_softmax(-1)
            targets = ids[0, len(context) :]
            row.append(logp[len(context) - 1 :].gather(1, targets[:, None]).sum().item())
        out.append(row)
    return out


# ---------------------------------------------------------------- pairing logic (no lm-eval needed)
def _run(logliks, accs, texts=None):
    samples = []
    for i, (ll, acc) in enumerate(zip(logliks, accs, strict=True)):
        resps = [texts[i]] if texts else [(x, False) for x in ll]
        samples.append({"doc_id": i, "filter": "none", "filtered_resps": resps, "metrics": ["acc"],
                        "acc": acc, "prompt_hash": f"p{i}", "target": 0})  # fmt: skip
    mean = sum(accs) / len(accs)
    stderr = statistics.stdev(accs) / math.sqrt(len(accs))
    return {
        "results": {"t": {"alias": "t", "acc,none": mean, "acc_stderr,none": stderr}},
        "samples": {"t": samples},
    }


def test_pair_task_finds_changed_items_and_paired_stderr():
    a = _run([[-1.0, -2.0], [-3.0, -2.5], [-1.0, -1.5], [-4.0, -3.0]], [1, 0, 1, 0])
    b = _run([[-1.0, -2.0], [-2.0, -2.5], [-1.0, -1.5001], [-4.0, -3.0]], [1, 1, 1, 0])
    r = pair_task(a, b, "t", "multiple_choice")
    assert r["items"] == 4 and r["same_answer"] == 0.75
    assert r["max_abs_delta_loglik"] == 1.0 and r["max_delta_item"] == 1
    assert [c["doc_id"] for c in r["changed"]] == [1]
    assert r["changed"][0]["original"] == 1 and r["changed"][0]["converted"] == 0
    m = r["metrics"]["acc"]
    assert (m["original"], m["converted"], m["difference"]) == (0.5, 0.75, 0.25)
    assert m["paired_stderr"] == pytest.approx(statistics.stdev([0, 1, 0, 0]) / 2)
    assert r["per_item"][2]["loglik"] == [[-1.0, -1.5], [-1.0, -1.5001]]
    table = format_table({"t": r})
    assert (
        "+0.2500 (± 0.2500)" in table and "3/4 items same answer" in table and "1 changed: items 1" in table
    )
    gen = pair_task(
        _run([[]] * 2, [1, 0], ["a b", "c"]), _run([[]] * 2, [1, 0], ["a b", "d"]), "t", "generate_until"
    )
    assert gen["same_answer"] == 0.5 and gen["max_abs_delta_loglik"] is None
    assert [(c["original"], c["converted"]) for c in gen["changed"]] == [("c", "d")]
    b["samples"]["t"][3]["prompt_hash"] = "other"
    with pytest.raises(RuntimeError, match="different items or prompts"):
        pair_task(a, b, "t", "multiple_choice")


def test_fewshot_warning_with_several_processes(monkeypatch, capsys):
    """lm-eval's few-shot prompts depend on the number of processes: a stderr warning says so."""
    from normswap import lmeval

    run = _run([[-1.0, -2.0]] * 2, [1, 1])
    task = pair_task(run, run, "t", "multiple_choice")
    cases = [(2, 5, "default", True), (1, 5, "default", False), (2, 0, "default", False)]
    for processes, shots, sampler, warned in [*cases, (2, 5, "first_n", False)]:
        result = {"lm_eval_version": "0", "num_processes": processes,
                  "tasks": {"t": task | {"num_fewshot": shots, "fewshot_sampler": sampler}}}  # fmt: skip
        monkeypatch.setattr(lmeval, "paired_eval", lambda *args, result=result, **kwargs: result)
        lmeval.run_command(None, None, None, ["t"], None, None, None, {})
        out, err = capsys.readouterr()
        assert "t: 2/2 items same answer" in out
        assert ("few-shot examples" in err) == warned, (processes, shots, sampler)


def test_tasks_refusals(pair, tmp_path, monkeypatch):
    orig, conv = pair
    assert_bad_input(_eval("--model", orig, "--converted", conv, "--limit", "3"), "--tasks only")
    both = ["--tasks", "normswap_mc", "--text", TASKS / "normswap_mc.jsonl"]
    assert_bad_input(_eval("--model", orig, "--converted", conv, *both), "not with --tasks")
    assert_bad_input(_eval("--model", orig, "--converted", conv, "--tasks", "x", "--report", orig / "r.json"),
                     "would overwrite or write into")  # fmt: skip
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    line = assert_bad_input(_eval("--model", orig, "--converted", conv, "--tasks", "normswap_mc"))
    assert "pip install -e '.[eval]'" in line  # the install command of eval --help and the README


# ---------------------------------------------------------------- lm-eval runs
@pytest.fixture(scope="module")
def one_process(pair, tmp_path_factory):
    pytest.importorskip("lm_eval")
    report = tmp_path_factory.mktemp("one") / "r.json"
    orig, conv = pair
    result = _eval("--model", orig, "--converted", conv, "--tasks", "normswap_mc", "--include-path", TASKS,
                   "--report", report)  # fmt: skip
    assert result.exit_code == 0, result.output
    return result, json.loads(report.read_text())


def test_tasks_paired_against_float64(pair, one_process):
    """lm-eval's per-item log-likelihoods of both sides against float64 forwards; identical choices."""
    result, report = one_process
    r = report["tasks"]["normswap_mc"]
    assert report["num_processes"] == 1 and r["items"] == 10 and r["output_type"] == "multiple_choice"
    want = [_fp64_logliks(d) for d in pair]
    got = [[item["loglik"][side] for item in r["per_item"]] for side in (0, 1)]
    for side in (0, 1):  # float32 forwards vs float64 ones: < 1e-4 on sums of up to 12 log-probabilities
        diff = max(
            abs(g - w)
            for gr, wr in zip(got[side], want[side], strict=True)
            for g, w in zip(gr, wr, strict=True)
        )
        assert diff < 1e-4, (side, diff)
    longest = max(len(" " + c) for doc in _docs() for c in doc["choices"])  # byte tokens
    assert r["max_abs_delta_loglik"] <= 2 * LOGIT_TOL * longest  # measured 3.8e-6
    assert r["same_answer"] == 1.0 and r["changed"] == []
    chosen = [max(range(4), key=row.__getitem__) for row in want[0]]
    accuracy = sum(c == doc["answer"] for c, doc in zip(chosen, _docs(), strict=True)) / 10
    acc = r["metrics"]["acc"]
    assert acc["original"] == acc["converted"] == accuracy and acc["difference"] == 0
    assert acc["original_stderr"] == pytest.approx(math.sqrt(accuracy * (1 - accuracy) / 9))
    assert "normswap_mc: 10/10 items same answer" in result.stdout and "0 changed" in result.stdout


def test_tasks_show_a_wrong_fold(tmp_path):
    """A fold that gets Gemma's (1+w) wrong at one norm moves the items' log-likelihoods visibly."""
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM

    from normswap.lmeval import paired_eval

    dirs = save_pair(tmp_path, "gemma", ignore_offset_at={"model.layers.1.post_attention_layernorm"})
    models = [AutoModelForCausalLM.from_pretrained(d).eval() for d in dirs]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENV.items():
            mp.setenv(key, value)
        result = paired_eval(*models, byte_tokenizer(), ["normswap_mc"], include_path=str(TASKS), limit=4)
    r = result["tasks"]["normswap_mc"]
    assert r["items"] == 4 and r["max_abs_delta_loglik"] > 1e-2  # a correct fold: ~1e-6
    differing = {i["doc_id"] for i in r["per_item"] if i["answer"][0] != i["answer"][1]}
    assert differing <= {c["doc_id"] for c in r["changed"]}


def test_tasks_two_processes_match_one(pair, one_process, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPUs (gloo): lm-eval splits the documents over
    the ranks and gathers them; every item's log-likelihoods equal the one-process run's."""
    orig, conv = pair
    env = {**os.environ, **ENV, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port()), "-m", "normswap", "eval", "--model", str(orig)]
    launch += ["--converted", str(conv), "--tasks", "normswap_mc", "--include-path", str(TASKS)]
    done = subprocess.run([*launch, "--report", str(tmp_path / "two.json")], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    one = one_process[1]["tasks"]["normswap_mc"]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["num_processes"] == 2 and done.stdout.count("same answer") == 1  # rank 0 prints
    two = two["tasks"]["normswap_mc"]
    assert [i["doc_id"] for i in two["per_item"]] == list(range(10))
    for a, b in zip(one["per_item"], two["per_item"], strict=True):
        assert a["answer"] == b["answer"]
        for side in (0, 1):
            # measured 0 here; a single process on more threads than torchrun's one per process sums in
            # another order (SmolLM2-135M: up to 1.6e-5 nats on 2 threads vs 1)
            assert max(abs(x - y) for x, y in zip(a["loglik"][side], b["loglik"][side], strict=True)) <= 1e-5
    for metric in ("acc", "acc_norm"):
        for key, value in one["metrics"][metric].items():
            assert two["metrics"][metric][key] == pytest.approx(value, rel=1e-12, abs=1e-15), (metric, key)


@pytest.mark.slow  # CI time; the tiny models' tests cover the same kinds
@pytest.mark.real
def test_tasks_smollm2(tmp_path):
    """SmolLM2-135M (GGUF) vs its conversion, saved and reloaded with the fused norms (load_pretrained):
    the same answer on every item. The README's command, without the CLI's second GGUF load and check."""
    pytest.importorskip("lm_eval")
    import copy

    import normswap
    from normswap.errors import NormswapError
    from normswap.io import load_model, load_pretrained, report_dict, save_converted
    from normswap.lmeval import paired_eval

    try:
        original, tokenizer, info = load_model("smollm2-135m")
    except NormswapError as error:
        if "cannot fetch" in str(error):
            pytest.skip(f"smollm2-135m not fetchable here: {error}")
        raise
    model = copy.deepcopy(original)
    report = normswap.convert(model)
    assert report.norms_folded == 61
    save_converted(model, tokenizer, report_dict(report, info), tmp_path / "out")
    del model
    converted = load_pretrained(tmp_path / "out")
    assert any("normswap" in type(m).__module__ for m in converted.modules())
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENV.items():
            mp.setenv(key, value)
        result = paired_eval(original, converted, tokenizer, ["normswap_mc"], include_path=str(TASKS))
    r = result["tasks"]["normswap_mc"]
    assert r["items"] == 10 and r["same_answer"] == 1.0 and r["changed"] == []
    longest = max(len(tokenizer(" " + c)["input_ids"]) for doc in _docs() for c in doc["choices"])
    assert r["max_abs_delta_loglik"] <= 2 * LOGIT_TOL * longest  # measured 1.05e-5
    assert r["metrics"]["acc"]["difference"] == 0 and r["metrics"]["acc"]["original"] == 0.8

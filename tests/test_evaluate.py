"""normswap eval: numbers against a float64 computation, and 1 vs 2 accelerate processes.

The converted model here is a deliberately wrong fold (Gemma's (1+w) folded as w at one site), so KL,
top-1 and the two perplexities differ and every one of them is exercised.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_check import byte_tokenizer, save_pair

from normswap.errors import NormswapError
from normswap.evaluate import evaluate, read_text, summarize, text_windows

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--max-tokens", "300", "--window", "64"]  # 5 windows, the last one partial (44 tokens)


@pytest.fixture
def pair(tmp_path):
    return save_pair(tmp_path, "gemma", ignore_offset_at={"model.layers.1.post_attention_layernorm"})


def _fp64_eval(orig_dir, conv_dir, windows):
    from transformers import AutoModelForCausalLM

    models = [
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval() for d in (orig_dir, conv_dir)
    ]
    nll, kl, agree, positions, targets = [0.0, 0.0], 0.0, 0, 0, 0
    for ids in windows:
        with torch.no_grad():
            lp = [m(input_ids=ids).logits[0].log_softmax(-1) for m in models]
        for i in range(2):
            nll[i] -= lp[i][:-1].gather(1, ids[0, 1:, None]).sum().item()
        kl += (lp[0].exp() * (lp[0] - lp[1])).sum().item()
        agree += (lp[0].argmax(-1) == lp[1].argmax(-1)).sum().item()
        positions += ids.shape[1]
        targets += ids.shape[1] - 1
    return {
        "ppl_original": math.exp(nll[0] / targets),
        "ppl_converted": math.exp(nll[1] / targets),
        "kl_mean": kl / positions,
        "top1_agreement": agree / positions,
        "tokens": positions,
    }


def test_text_windows_and_text_sources(tmp_path):
    tok = byte_tokenizer()
    windows = text_windows(tok, "abcdefghij", max_tokens=9, window=4)
    assert [w.tolist() for w in windows] == [[tok("abcd")["input_ids"]], [tok("efgh")["input_ids"]]]
    # the 1-token tail "i" is dropped: it predicts nothing
    text, source = read_text(min_chars=1000)
    assert source == "pydoc_data.topics" and len(text) >= 1000
    (tmp_path / "t.txt").write_text("hello there")
    assert read_text(tmp_path / "t.txt")[0] == "hello there"
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(NormswapError, match="empty"):
        read_text(tmp_path / "empty.txt")
    with pytest.raises(NormswapError, match="not both"):
        read_text(tmp_path / "t.txt", "wikitext")


def test_summarize_is_independent_of_gather_order():
    gen = torch.Generator().manual_seed(0)
    records = torch.rand(7, 8, generator=gen, dtype=torch.float64) * 100
    records[:, 0] = torch.arange(7)
    a = summarize(records)
    b = summarize(records[torch.randperm(7, generator=gen)])
    assert a == b  # sums taken in window order: bit-identical


def test_evaluate_matches_float64_reference(pair):
    from transformers import AutoModelForCausalLM

    orig_dir, conv_dir = pair
    windows = text_windows(byte_tokenizer(), read_text(min_chars=3000)[0], 300, 64)
    models = [AutoModelForCausalLM.from_pretrained(d).eval() for d in pair]
    got = evaluate(*models, windows, progress=False)
    want = _fp64_eval(orig_dir, conv_dir, windows)
    assert got["tokens"] == want["tokens"] == 300 and got["windows"] == 5 and got["num_processes"] == 1
    assert got["kl_mean"] > 1e-7  # the broken fold is visible (a correct one gives ~1e-15)
    # float32 forwards vs float64 ones: logits agree to ~1e-6 relative, so these to well within 1e-4
    for key in ("ppl_original", "ppl_converted", "kl_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
    assert got["top1_agreement"] == want["top1_agreement"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_two_processes_match_one(pair, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m normswap eval` on CPUs vs one in-process run.

    accelerate 1.15 starts several CPU processes for ``--cpu`` only through mpirun; ``--multi_gpu``
    (torchrun underneath) on a machine without accelerator devices gives a CPU (gloo) group.
    Takes about 20 s on 2 cores (process start-up, two imports of torch and transformers).
    """
    from normswap.cli import main

    orig_dir, conv_dir = pair
    common = ["--model", str(orig_dir), "--converted", str(conv_dir), *ARGS]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    one = CliRunner().invoke(main, ["eval", *common, "--report", str(tmp_path / "one.json")], env=env)
    assert one.exit_code == 0, one.output
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port()), "-m", "normswap", "eval", *common]
    done = subprocess.run(
        [*launch, "--report", str(tmp_path / "two.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert a["num_processes"] == 1 and b["num_processes"] == 2
    assert a["tokens"] == b["tokens"] == 300 and a["windows"] == b["windows"] == 5
    for key in ("ppl_original", "ppl_converted", "kl_mean", "top1_agreement"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    assert done.stdout.count("eval:") == 1  # only the main process prints the summary

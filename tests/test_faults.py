"""Fault injection: broken inputs, NaN/inf weights, a full disk, signals and concurrent runs during a save.

Each test asserts the exit code (0 success, 1 the check failed, 2 bad input, 130 interrupted, 143
terminated), the one line a failure prints, and that the input and the file system are as promised: the
input unchanged, nothing half-written, no hidden build folder or lock file left (field cases C18-C25 in
../shared/cases/README.md). C26-C30: nothing of the user's is lost: --overwrite replaces only what normswap
wrote, the previous output stays byte for byte until the new one is verified (a run killed at every stage
of the save, in memory and streamed), every input tensor reaches the output, token ids are checked against
the vocabulary and remote-code models stream, before any model runs.

The "tiny saved Llama" of the cases: vocab 49152 (SmolLM2's), hidden 64, 2 layers, norms re-randomized,
saved with ``save_pretrained`` beside SmolLM2's tokenizer (read from the cached smollm2-135m GGUF; where
that is not cached, a byte-level BPE trained on the check text stands in, so the suite needs no network).
"""

from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file

import normswap
from normswap import files
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.io import save_converted, shortnames

VOCAB = 49152
BROKEN = "model.layers.1.mlp.down_proj.weight"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line(result, code: int, *fragments: str) -> str:
    """Exit ``code`` with exactly one stderr line ``normswap: error: ...`` holding every fragment."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normswap: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def strict_json(path: Path):
    """Parse ``path`` rejecting the bare NaN/Infinity that only Python's json accepts."""

    def refuse(token):
        raise AssertionError(f"{path}: bare {token} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _tokenizer(folder: Path) -> None:
    """Save SmolLM2's tokenizer (cached GGUF) into ``folder``, else a byte-level BPE of the check text."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cached = shortnames.cached_path("smollm2-135m")
    if cached.is_file():
        AutoTokenizer.from_pretrained(cached.parent, gguf_file=cached.name).save_pretrained(folder)
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from normswap.check import default_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [default_text(100_000)], trainers.BpeTrainer(vocab_size=2000, initial_alphabet=alphabet)
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The tiny saved Llama of the cases (built once per module; tests work on copies)."""
    folder = tmp_path_factory.mktemp("tiny-llama") / "model"
    make_tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=False).save_pretrained(folder)
    _tokenizer(folder)
    return folder


@pytest.fixture
def src(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "src"))


def rewrite_weights(folder: Path, change) -> None:
    """Apply ``change(state_dict)`` to ``folder/model.safetensors``."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# -- C18: NaN and inf never pass --------------------------------------------------------------------------
def test_nan_in_the_model_is_refused_and_nothing_saved(src, tmp_path):
    """C18: one NaN in down_proj makes the original's logits NaN: refused (exit 2), saying so; not PASSED."""
    rewrite_weights(src, lambda t: t[BROKEN].view(-1).__setitem__(7, float("nan")))
    before = digests(src)
    out = tmp_path / "out"
    result = run("convert", src, "--output", out)
    assert_one_line(result, 2, "original model's logits are not finite", "NaN or infinite")
    assert "PASSED" not in result.stdout and not out.exists()
    assert digests(src) == before and hidden(tmp_path) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_norm_with_nonfinite_weight_is_listed(src, tmp_path, value):
    """C18: a norm whose weight is NaN/inf stays a site, not foldable, "weight not finite"; strict JSON."""
    norm = "model.layers.1.post_attention_layernorm"
    rewrite_weights(src, lambda t: t[f"{norm}.weight"].__setitem__(3, value))
    result = run("inspect", src, "--json", tmp_path / "sites.json")
    assert result.exit_code == 0, result.stderr
    sites = {s["name"]: s for s in strict_json(tmp_path / "sites.json")["sites"]}
    assert len(sites) == 5 and sites[norm]["foldable"] is False
    assert sites[norm]["reason"] == "weight not finite"
    assert sum(s["foldable"] for s in sites.values()) == 4
    assert_one_line(run("convert", src, "--output", tmp_path / "out"), 2, "not finite")
    assert not (tmp_path / "out").exists()


def test_nonfinite_converted_outputs_fail_every_metric():
    """C18: max() dropped a NaN (``max(0.0, nan) == 0.0``): every metric keeps it and the judge fails."""
    from normswap.check.metrics import logit_metrics
    from normswap.check.policy import default_tolerance, judge

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 50, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 50, (8,), generator=gen)
    for bad in (float("nan"), float("inf")):
        conv = ref.clone()
        conv[5, 3] = bad
        m = logit_metrics(ref, conv, targets)
        assert m["nonfinite_conv"] == 1 and m["nonfinite_ref"] == 0
        assert not m["max_abs"] <= 1.0  # NaN or inf, never a finite number hiding it
        failures = judge(m, default_tolerance("float32"), None)
        assert any("converted outputs hold 1 NaN or infinite" in f for f in failures), failures
    assert judge(logit_metrics(ref, ref.clone(), targets), default_tolerance("float32"), None) == []


def test_overflowing_perplexity_is_inf_and_reports_stay_json(tmp_path):
    """C11 variant: a mean NLL above 709 nats overflowed math.exp (a traceback); now inf, and a report
    holding inf or NaN is still strict JSON."""
    from normswap.check.metrics import logit_metrics, perplexity
    from normswap.evaluate import summarize

    logits = torch.tensor([[0.0, 2000.0], [0.0, 2000.0]], dtype=torch.float64)
    m = logit_metrics(logits, logits, torch.tensor([0, -1]))
    assert m["nll_ref"] == pytest.approx(2000.0) and perplexity(m["nll_ref"], m["n_targets"]) == float("inf")
    record = torch.tensor([[0, 2000.0, 2000.0, 0.0, 2, 2, 1, 0.0]], dtype=torch.float64)
    assert summarize(record)["ppl_original"] == float("inf")
    files.write_json(tmp_path / "r.json", {"ppl": float("inf"), "d": [float("nan"), -float("inf")]})
    assert strict_json(tmp_path / "r.json") == {"ppl": "inf", "d": ["nan", "-inf"]}


# -- C19: a checkpoint that does not match its config -----------------------------------------------------
@pytest.mark.parametrize(
    "fault, fragments",
    [
        ("missing", ["missing " + BROKEN]),
        ("unexpected", ["unexpected model.layers.9.extra.weight"]),
        ("shape", [BROKEN, "shape (3, 3)", "expects (64, 128)"]),
    ],
)
def test_checkpoint_that_does_not_match_its_config_is_refused(src, tmp_path, fault, fragments):
    """C19: transformers filled a missing tensor with random values (silenced); now exit 2, named."""

    def change(t):
        if fault == "missing":
            del t[BROKEN]
        elif fault == "unexpected":
            t["model.layers.9.extra.weight"] = torch.zeros(3)
        else:
            t[BROKEN] = torch.zeros(3, 3)

    rewrite_weights(src, change)
    before = digests(src)
    result = run("convert", src, "--output", tmp_path / "out", "--report", tmp_path / "r.json")
    assert_one_line(result, 2, "do not match its config", *fragments)
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()
    assert digests(src) == before


def test_converted_checkpoint_missing_a_tensor_is_refused(src, tmp_path):
    """C19, the reload path: ``load_pretrained`` (used by check and eval) refuses the same way."""
    out = tmp_path / "out"
    assert run("convert", src, "--output", out).exit_code == 0
    rewrite_weights(out, lambda t: t.pop(BROKEN))
    with pytest.raises(NormswapError, match=f"missing {BROKEN}"):
        normswap.load_pretrained(out)


# -- C20: no command writes over or into an input ---------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    ["eval-report-src", "eval-report-out", "check-report", "convert-report", "inspect-json", "bench-out"],
)
def test_no_output_lands_in_an_input(src, pristine, tmp_path, command):
    """C20: `eval --report SRC/config.json` replaced the input's config; every output of every command is
    checked against every input before any work (exit 2, inputs unchanged)."""
    out = tmp_path / "out"
    shutil.copytree(pristine, out)  # stands in for a converted checkpoint: only its paths matter here
    args = {
        "eval-report-src": ["eval", "--model", src, "--converted", out, "--max-tokens", 64,
                            "--report", src / "config.json"],
        "eval-report-out": ["eval", "--model", src, "--converted", out, "--report", out / "eval.json"],
        "check-report": ["check", src, out, "--report", out / "config.json"],
        "convert-report": ["convert", src, "--output", tmp_path / "new", "--report", src / "config.json"],
        "inspect-json": ["inspect", src, "--json", src / "model.safetensors"],
        "bench-out": ["bench", "--quick", "--model", src, "--out", src / "bench"],
    }[command]  # fmt: skip
    before, before_out = digests(src), digests(out)
    assert_one_line(run(*args), 2, "would overwrite or write into" if command != "bench-out" else "inside")
    assert digests(src) == before and digests(out) == before_out
    assert not (tmp_path / "new").exists() and not (src / "bench").exists()


def test_unwritable_output_directory_is_found_before_loading(src, tmp_path, monkeypatch):
    """C20: an output directory that cannot be created is refused before the model is loaded."""
    import normswap.io as io

    def never(*args, **kwargs):
        raise AssertionError("loaded the model before checking the output")

    monkeypatch.setattr(io, "load_model", never)
    (tmp_path / "a-file").write_text("x")
    result = run("convert", src, "--output", tmp_path / "a-file" / "out")
    assert_one_line(result, 2, "a-file is not a directory")


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    """A failing write keeps the previous file whole and leaves no temporary behind."""
    target = tmp_path / "r.json"
    files.write_json(target, {"a": 1})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(NormswapError, match=f"cannot write {target}: no space left on device"):
        files.write_json(target, {"a": 2})
    assert strict_json(target) == {"a": 1} and os.listdir(tmp_path) == ["r.json"]


# -- C21: a full disk --------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (root only; skipped elsewhere), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:  # a file still open there
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("streamed", [(), ("--max-memory", "64KB")], ids=["memory", "streamed"])
def test_full_disk_is_one_line_and_leaves_nothing(src, small_disk, tmp_path, streamed):
    """C21: a 31-line traceback ending in SafetensorError with exit 1; now exit 2, one line, the small
    filesystem empty, the report written elsewhere. Streamed, the check's localization records (a temporary
    file beside OUT) are written first: their full disk is the same one line (it was a traceback)."""
    before = digests(src)
    out, report = small_disk / "out", tmp_path / "r.json"
    result = run("convert", src, "--output", out, "--report", report, *streamed)
    assert_one_line(result, 2, f"cannot write {out}: no space left on device")
    assert os.listdir(small_disk) == []
    if not streamed:  # streamed, the check's records beside OUT fill the disk first: nothing is converted
        assert strict_json(report)["check"]["passed"] is True and strict_json(report)["saved"] is False
    assert digests(src) == before


def test_streamed_write_failure_is_one_line_and_the_report_says_what_was_converted(
    src, tmp_path, monkeypatch
):
    """C21, streamed: the shards are written before the check; a full disk there is one line (exit 2),
    nothing is left beside OUT, and ``--report`` still says what was converted (no check, not saved)."""
    import errno

    import normswap.stream.write as stream_write

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(stream_write, "write_shards", full)
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", src, "--output", out, "--report", report, "--max-memory", "64KB")
    assert_one_line(result, 2, f"cannot write {out}: no space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "src"]
    data = strict_json(report)
    assert data["saved"] is False and data["check"] is None
    assert data["norms_folded"] == data["norms_found"] > 0 and data["model"] == str(src)


def test_any_writer_exception_is_one_line(tmp_path):
    """C21: tokenizers raise plain ``Exception``; every failure of a writer becomes one line."""
    model = make_tiny_model("llama")

    class Tokenizer:
        def save_pretrained(self, path):
            raise Exception("Tokenizer.save failed\nwith details on a second line")  # noqa: TRY002

    with pytest.raises(NormswapError) as error:
        save_converted(model, Tokenizer(), {}, tmp_path / "out")
    assert str(error.value) == f"cannot write {tmp_path / 'out'}: Exception: Tokenizer.save failed"
    assert os.listdir(tmp_path) == []


# -- signals during a save, stale build folders -----------------------------------------------------------
# Writers run in forked processes (fork: no second import of torch; the tiny tensors stay below torch's
# parallel grain, so no OpenMP pool is touched after the fork).
FORK = multiprocessing.get_context("fork")


def _slow_save(model, out: Path, ready) -> None:
    # A run started in the background by a non-interactive shell (as CI may be) inherits SIGINT ignored;
    # a user's terminal process has Python's handler, which is what this test is about.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real = type(model).save_pretrained

    def slow(self, path, **kwargs):
        real(self, path, **kwargs)
        ready.set()  # the weights are written, the save is mid-way
        time.sleep(60)

    type(model).save_pretrained = slow
    save_converted(model, None, {"run": "killed"}, out, overwrite=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_signal_during_save(tmp_path, sig):
    """SIGINT: the save cleans up at once. SIGKILL: its build folder and lock file stay, and the next save
    removes them. Either way the previous OUT stays whole."""
    out = tmp_path / "out"
    model = make_tiny_model("llama")
    save_converted(model, None, {"run": "first"}, out)
    before = digests(out)
    ready = FORK.Event()
    proc = FORK.Process(target=_slow_save, args=(model, out, ready))
    proc.start()
    assert ready.wait(60)
    os.kill(proc.pid, sig)
    proc.join(60)
    assert proc.exitcode not in (0, None)
    assert digests(out) == before
    if sig == signal.SIGINT:
        assert hidden(tmp_path) == []
    else:
        left = hidden(tmp_path)
        assert ".out.lock" in left and any(n.endswith(".partial") for n in left), left
        save_converted(model, None, {"run": "next"}, out, overwrite=True)
        assert hidden(tmp_path) == [] and strict_json(out / "normswap.json")["run"] == "next"


# -- C23: concurrent saves ---------------------------------------------------------------------------------
def _writer(model, out: Path, go, me: str, saves: int, results) -> None:
    go.wait(60)
    random.seed(me)
    counts = {"ok": 0, "in use": 0, "other": [], "saves": 0}
    i = 0
    # on a loaded machine one writer can find the other's lock at each of its turns: it goes on (up to 10x)
    # until one of its own saves went through
    while i < saves or (counts["ok"] == 0 and i < 10 * saves):
        try:
            save_converted(model, None, {"writer": me, "i": i}, out, overwrite=True)
            counts["ok"] += 1
        except NormswapError as error:
            if "in use" in str(error) and "\n" not in str(error):
                counts["in use"] += 1
            else:
                counts["other"].append(str(error))
        time.sleep(random.uniform(0, 0.01 if i < saves else 0.1))  # pauses give the other writer its turns
        i += 1
    counts["saves"] = i
    results.put(counts)


def test_concurrent_saves_are_safe(tmp_path):
    """C23: spurious "Directory not empty" errors and a leaked .old copy; now every save succeeds or says
    "in use", OUT always holds one complete checkpoint, nothing hidden is left."""
    out, saves = tmp_path / "out", 30
    model = make_tiny_model("llama")
    go, results = FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=_writer, args=(model, out, go, me, saves, results)) for me in "ab"]
    for proc in procs:
        proc.start()
    go.set()
    checks = 0
    while any(p.is_alive() for p in procs):
        if out.exists():  # once there, OUT is always a complete checkpoint (replaced in one step)
            assert (out / "model.safetensors").is_file() and (out / "normswap.json").is_file()
            checks += 1
        time.sleep(0.002)
    counts = [results.get(timeout=10) for _ in procs]
    assert all(p.exitcode == 0 for p in procs)
    assert all(c["other"] == [] and c["ok"] + c["in use"] == c["saves"] >= saves for c in counts), counts
    assert all(c["ok"] >= 1 for c in counts)
    assert os.listdir(tmp_path) == ["out"]
    assert strict_json(out / "normswap.json")["writer"] in ("a", "b") and checks > 0


def test_lock_held_elsewhere_is_in_use(tmp_path):
    """A save into an output that another process is writing fails at once, in one line."""
    out = tmp_path / "out"
    with files.output_lock(out):
        with pytest.raises(NormswapError, match=r"out is in use: another normswap process"):
            save_converted(make_tiny_model("llama"), None, {}, out)
    assert os.listdir(tmp_path) == []


# -- C24, C25 ----------------------------------------------------------------------------------------------
def test_convert_under_inference_mode_trains(input_ids):
    """C24: "Inference tensors cannot be saved for backward"; now the converted model trains."""
    model = make_tiny_model("llama")
    with torch.inference_mode():
        normswap.convert(model)
    assert not any(p.is_inference() for p in model.parameters())
    model.train()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_float64_model_passes_at_the_float64_tolerance(model_type, input_ids):
    """C25: the fused norm computed float64 inputs in float64, HF's norms in float32 (1.35e-7 > 1e-8).
    Measured now: 0 without folding; folding Llama 0, and Gemma's norms (weight product rounded to float32)
    are not folded in float64, since a fold would move the logits by 3.3e-8."""
    original = make_tiny_model(model_type).to(torch.float64)
    for fold in (False, True):
        converted = copy.deepcopy(original)
        report = normswap.convert(converted, fold=fold)
        assert all(s.compute_dtype == "float32" for s in report.sites)
        result = normswap.check(original, converted, input_ids)
        assert result.passed and result.max_abs_logit_diff <= 1e-8, result.failures
    if model_type == "gemma":
        assert report.norms_folded == 0 and "not exact" in report.sites[0].reason
    else:
        assert report.norms_folded == 5


def test_float64_fused_norms_match_hf_and_torch_bit_for_bit():
    """C25 at module level: HF's RMSNorm normalizes float64 in float32, nn.LayerNorm in float64; the
    probe tells them apart and the fused module reproduces each exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from normswap.probe import probe_module
    from normswap.swap import fused_module

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 64, generator=gen, dtype=torch.float64) * 3
    for module, compute in ((LlamaRMSNorm(64, eps=1e-6), "float32"), (torch.nn.LayerNorm(64), None)):
        module = module.double()
        with torch.no_grad():
            module.weight.add_(torch.rand(64, generator=gen, dtype=torch.float64) - 0.5)
        site = probe_module(module, (2, 4, 64), "norm")
        assert site.compute_dtype == compute
        with torch.no_grad():
            assert torch.equal(fused_module(site, module)(x), module(x))


# -- C26-C30: nothing of the user's is lost ---------------------------------------------------------------
# A tiny Llama with a byte-level tokenizer (257 ids) and a vocabulary of 260: quick to convert on 16 tokens.
SMALL_VOCAB = 260
FEW = ("--tokens", "16")


def tree(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (subfolders included)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def byte_tokenizer(folder: Path, offset: int = 0) -> Path:
    """A byte-level tokenizer of 257 ids (256 bytes and ``<|endoftext|>``), saved into ``folder``; its ids
    start at ``offset`` (a tokenizer of another model, whose ids the small models do not have)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: offset + i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = offset + len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def small_model(folder: Path, *, seed: int = 0, vocab: int = SMALL_VOCAB, shard: str | None = None) -> Path:
    model = make_tiny_model("llama", vocab_size=vocab, tie_word_embeddings=False, seed=seed)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return byte_tokenizer(folder)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("small") / "model", shard="40KB")


@pytest.fixture(scope="module")
def small_other(tmp_path_factory) -> Path:
    """The same shape with other weights: the previous checkpoint an --overwrite replaces."""
    return small_model(tmp_path_factory.mktemp("small-other") / "model", seed=1, shard="40KB")


STREAMED = ("--max-memory", "64KB")


@pytest.fixture(autouse=True)
def _no_collect(monkeypatch):
    """The streamed path collects garbage after every tensor (``release_memory``): 0.7 s each in a test
    process holding every earlier test's objects. It frees memory and changes no byte; skipped here."""
    import normswap.stream.store as stream_store
    import normswap.stream.write as stream_write

    monkeypatch.setattr(stream_store, "release_memory", lambda: None)
    monkeypatch.setattr(stream_write, "release_memory", lambda: None)


@pytest.fixture(scope="module")
def previous(small_other, tmp_path_factory) -> dict[tuple, Path]:
    """A complete earlier output of normswap of ``small_other``, in memory and streamed (copied per test)."""
    import normswap.stream.store as stream_store
    import normswap.stream.write as stream_write

    folders = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_store, "release_memory", lambda: None)  # as _no_collect
        patch.setattr(stream_write, "release_memory", lambda: None)
        for streamed in ((), STREAMED):
            out = tmp_path_factory.mktemp("previous") / "out"
            result = run("convert", small_other, "--output", out, *FEW, *streamed)
            assert result.exit_code == 0, result.output
            folders[streamed] = out
    return folders


def previous_output(previous: dict, out: Path, streamed=()) -> dict[str, str]:
    """Copy the earlier output into ``out`` (bytes and sizes kept: still normswap's); its files' digests."""
    shutil.copytree(previous[tuple(streamed)], out)
    return digests(out)


@pytest.mark.parametrize("where", ["dot", "absolute"])
def test_c26_overwrite_never_replaces_a_folder_normswap_did_not_write(small, tmp_path, monkeypatch, where):
    """C26: `--output . --overwrite` from a project folder deleted the project (and then exited 2, "not a
    model directory"); with its absolute path it exited 0. Now exit 2, one line naming it and what is in it,
    the folder byte-identical, nothing hidden left beside it."""
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "notes.txt").write_text("my notes\n")
    (proj / "src" / "train.py").write_text("print('train')\n")
    before, src_before = tree(proj), tree(small)
    if where == "dot":
        monkeypatch.chdir(proj)
    output = "." if where == "dot" else proj
    result = run("convert", small, "--output", output, "--overwrite", *FEW)
    assert_one_line(result, 2, f"output directory {proj} is not a normswap output", "notes.txt, src/",
                    "--overwrite replaces only a directory that normswap wrote or an empty one")  # fmt: skip
    assert tree(proj) == before and tree(small) == src_before
    assert hidden(tmp_path) == [] and hidden(proj) == []


def test_c26_overwrite_replaces_an_empty_folder_or_an_earlier_output_only(small, previous, tmp_path):
    """The same kind: an empty folder and an earlier output are replaced; an earlier output to which a file
    was added, or whose file changed size, is refused in one line naming the file, and left as it is."""
    (tmp_path / "empty").mkdir()
    assert run("convert", small, "--output", tmp_path / "empty", "--overwrite", *FEW).exit_code == 0
    out = tmp_path / "out"
    previous_output(previous, out)
    assert run("convert", small, "--output", out, "--overwrite", *FEW).exit_code == 0
    (out / "my-notes.md").write_text("mine\n")
    before = digests(out)
    assert_one_line(run("convert", small, "--output", out, "--overwrite", *FEW), 2,
                    "holds what normswap did not write: my-notes.md")  # fmt: skip
    assert digests(out) == before
    (out / "my-notes.md").unlink()
    with open(out / "config.json", "a") as f:
        f.write("\n")
    assert_one_line(run("convert", small, "--output", out, "--overwrite", *FEW), 2,
                    "holds files changed since normswap wrote them: config.json")  # fmt: skip
    assert hidden(tmp_path) == []


def test_c26_dot_inside_an_earlier_output_is_replaced(small, previous, tmp_path, monkeypatch):
    """`--output . --overwrite` from inside an earlier output replaces it (the working directory moves with
    the exchange); a relative --report is still written where it was asked for."""
    out = tmp_path / "out"
    previous_output(previous, out)
    monkeypatch.chdir(out)
    result = run("convert", small, "--output", ".", "--overwrite", "--report", "../r.json", *FEW)
    assert result.exit_code == 0, result.output
    assert strict_json(tmp_path / "r.json")["verify"]["passed"] and hidden(tmp_path) == []
    assert strict_json(out / "normswap.json")["model"] == str(small)


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_c27_failed_verification_keeps_the_previous_output(small, previous, tmp_path, monkeypatch, streamed):
    """C27: a failed fresh-load verification exited 1 "nothing saved" with the previous output already
    deleted. Now the new output is verified beside OUT and replaces it only when it passed: exit 1, OUT
    byte-identical to the previous checkpoint, the report says why."""
    import normswap.io.verify as io_verify
    import normswap.stream.verify as stream_verify

    out, report = tmp_path / "out", tmp_path / "r.json"
    before = previous_output(previous, out, streamed)
    target, name = (stream_verify, "verify_streamed") if streamed else (io_verify, "verify_saved")
    real = getattr(target, name)

    def failing(*args, **kwargs):
        result = real(*args, **kwargs)
        assert result.passed  # the real result, marked failed
        result.passed, result.failures = False, ["injected failure"]
        return result

    monkeypatch.setattr(target, name, failing)
    result = run("convert", small, "--output", out, "--overwrite", "--report", report, *FEW, *streamed)
    assert result.exit_code == 1, result.output
    assert "verification of the saved checkpoint FAILED; nothing saved" in result.stderr
    assert digests(out) == before and hidden(tmp_path) == []
    data = strict_json(report)
    assert data["saved"] is False and data["verify"]["failures"] == ["injected failure"]
    assert data["verify"]["path"] == str(out)


@pytest.mark.parametrize(
    "streamed, stage, error",
    [
        ((), "written", KeyboardInterrupt),
        (STREAMED, "finished", KeyboardInterrupt),
        ((), "weights", "full"),
        (STREAMED, "shard", "full"),
    ],  # fmt: skip
)
def test_interrupt_or_full_disk_at_a_stage_keeps_the_previous_output(small, previous, tmp_path, monkeypatch,
                                                                     streamed, stage, error):  # fmt: skip
    """Ctrl-C after the new output is written or its manifest finished, a full disk while the weights are
    written: exit 130 or 2 (one line), OUT byte-identical to the previous checkpoint, nothing hidden left."""
    from normswap.io import staging

    out = tmp_path / "out"
    before = previous_output(previous, out, streamed)

    def stop(name):
        if name == stage:
            raise KeyboardInterrupt if error is KeyboardInterrupt else OSError(28, "No space left on device")

    monkeypatch.setattr(staging, "at_stage", stop)
    result = run("convert", small, "--output", out, "--overwrite", *FEW, *streamed)
    if error is KeyboardInterrupt:
        assert result.exit_code == 130, result.output
    else:
        assert_one_line(result, 2, f"cannot write {out}: no space left on device")
    assert digests(out) == before and hidden(tmp_path) == []


# Killing a run at every stage of an --overwrite convert. The run is a forked copy of this process (torch is
# imported once), limited to one thread (no OpenMP pool is used after the fork), that SIGKILLs itself when
# the save reaches the stage (``normswap.io.staging.at_stage``, a hook that does nothing otherwise).
MEMORY_STAGES = ["staged", "weights", "written", "verified", "finished", "exchanged", "removed"]
STREAMED_STAGES = ["staged", "shard", "written", "verified", "finished", "exchanged", "removed"]


def _killed_run(args, stage: str, no_exchange: bool) -> None:
    from normswap.io import staging

    torch.set_num_threads(1)

    def die(name):
        if name == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    staging.at_stage = die
    if no_exchange:
        staging._exchange = lambda a, b: False
    result = CliRunner().invoke(main, args)
    os._exit(10 + result.exit_code)  # reached only when the stage never came


def _kill_at(args, stage: str, no_exchange: bool = False) -> None:
    proc = FORK.Process(target=_killed_run, args=(args, stage, no_exchange))
    proc.start()
    proc.join(300)
    assert proc.exitcode == -signal.SIGKILL, (stage, proc.exitcode)


def _same_new_output(out: Path, reference: Path) -> bool:
    """``out`` is the verified new checkpoint: every file as in a complete run, its manifest says verified."""
    have, want = digests(out), digests(reference)
    have.pop("normswap.json"), want.pop("normswap.json")
    manifest, expected = strict_json(out / "normswap.json"), strict_json(reference / "normswap.json")
    return have == want and manifest["verify"]["passed"] and manifest["sites"] == expected["sites"]


@pytest.mark.parametrize(
    "streamed, stages",
    [((), MEMORY_STAGES), (STREAMED, STREAMED_STAGES), ((), ["finished", "aside"])],
    ids=["memory", "streamed", "no-exchange"],
)
def test_killed_at_every_stage_leaves_one_complete_checkpoint(small, previous, tmp_path, streamed, stages):
    """SIGKILL at each stage of `convert --overwrite`: OUT is byte for byte the previous checkpoint (up to the
    exchange) or the verified new one (after it), and stays so when the next save to OUT clears what the
    killed run left (or, where paths cannot be exchanged in one step, renames the previous checkpoint
    back). The third row exchanges by two renames (as off Linux) and is killed between them."""
    from normswap.io.staging import Staging

    reference = tmp_path / "reference"
    assert run("convert", small, "--output", reference, *FEW, *streamed).exit_code == 0
    out = tmp_path / "out"
    args = ["convert", str(small), "--output", str(out), "--overwrite", *FEW, *streamed]
    for stage in stages:
        shutil.rmtree(out, ignore_errors=True)
        before = previous_output(previous, out, streamed)
        _kill_at(args, stage, no_exchange="aside" in stages)
        if stage == "aside":  # killed between the two renames: OUT is missing until the next save
            assert not out.exists() and any(n.endswith(".old") for n in hidden(tmp_path)), stage
        elif stage in ("exchanged", "removed"):
            assert _same_new_output(out, reference), stage
        else:
            assert digests(out) == before, stage
        with Staging(out, overwrite=True):  # what the next save does first, under the lock
            pass
        assert hidden(tmp_path) == [], stage
        new = stage in ("exchanged", "removed")
        assert _same_new_output(out, reference) if new else digests(out) == before, stage
    result = run(*args)
    assert result.exit_code == 0 and _same_new_output(out, reference) and hidden(tmp_path) == []


# SIGTERM (what `kill`, `timeout` and `docker stop` send) at stages of an --overwrite convert, in a forked run
# (as _killed_run) that signals itself when the save reaches the stage: handled as Ctrl-C is, exit 143.
def _terminated_run(args, stage: str, results) -> None:
    from normswap.io import staging

    torch.set_num_threads(1)

    def terminate(name):
        if name == stage:
            os.kill(os.getpid(), signal.SIGTERM)

    staging.at_stage = terminate
    result = CliRunner().invoke(main, args)
    results.put((result.exit_code, result.stdout, result.stderr))


BEFORE = "normswap: terminated by SIGTERM {where}; {out} is as it was before (the new checkpoint {why} and "
BEFORE += "is removed)"
NOT_IN_PLACE, PARTIAL = ("while saving", "had not replaced it"), ("while saving", "was not complete")
CONVERTING = ("during convert", "had not replaced it")  # streamed: the shards are written as they convert
TERM_LINES = {
    (): {"staged": NOT_IN_PLACE, "weights": PARTIAL, "verified": NOT_IN_PLACE, "finished": NOT_IN_PLACE},
    STREAMED: {"staged": CONVERTING, "shard": CONVERTING, "written": PARTIAL, "verified": NOT_IN_PLACE,
               "finished": NOT_IN_PLACE},
}  # fmt: skip


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_sigterm_at_a_stage_cleans_up_and_says_what_the_output_holds(small, previous, tmp_path, streamed):
    """SIGTERM exited 143 with no line and left the hidden build folder (hundreds of MB for a real model)
    and the lock file beside OUT. Now, at each stage of the save: exit 143, one line saying which checkpoint
    OUT holds, OUT byte-identical to the previous checkpoint (before the exchange) or the verified new one
    (after it), nothing hidden left beside it."""
    reference = tmp_path / "reference"
    assert run("convert", small, "--output", reference, *FEW, *streamed).exit_code == 0
    out = tmp_path / "out"
    args = ["convert", str(small), "--output", str(out), "--overwrite", *FEW, *streamed]
    for stage, (where, why) in [*TERM_LINES[tuple(streamed)].items(), ("exchanged", (None, None))]:
        shutil.rmtree(out, ignore_errors=True)
        before = previous_output(previous, out, streamed)
        results = FORK.Queue()
        proc = FORK.Process(target=_terminated_run, args=(args, stage, results))
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0, (stage, proc.exitcode)  # not killed by the signal: it was handled
        code, stdout, stderr = results.get(timeout=60)
        assert code == 143 and stdout == "", (stage, code, stdout, stderr)
        if why is None:
            line = f"normswap: terminated by SIGTERM after the save; {out} holds the new, verified checkpoint"
            assert _same_new_output(out, reference), stage
        else:
            line = BEFORE.format(where=where, out=out, why=why)
            assert digests(out) == before, stage
        assert stderr.splitlines() == [line], (stage, stderr)
        assert hidden(tmp_path) == [], (stage, hidden(tmp_path))


# A signal whose KeyboardInterrupt Python drops: raised inside a finalizer, it is printed ("Exception ignored
# in ...") and the run goes on. Measured on main: of 11 SIGINT/SIGTERM moments of a streamed --overwrite
# run, one was lost so; the run exchanged OUT 5 s later and then exited 130 "after the command finished".
class _Finalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10_000))  # the handler runs here: its KeyboardInterrupt is printed and dropped


def _swallowing_run(args, stage: str, results) -> None:
    from normswap.io import staging

    torch.set_num_threads(1)

    def swallow(name):
        if name == stage:
            _Finalizer()  # collected at once

    dropped = []
    sys.unraisablehook = lambda what: dropped.append(type(what.exc_value).__name__)  # Python's "ignored"
    staging.at_stage = swallow
    result = CliRunner().invoke(main, args)
    results.put((result.exit_code, result.stdout, result.stderr, dropped))


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_an_interrupt_python_dropped_still_stops_the_exchange(small, previous, tmp_path, streamed):
    """SIGINT whose KeyboardInterrupt is lost in a finalizer just before the exchange (the manifest written):
    the exchange is refused all the same (the signal set a flag, asked at the commit), exit 130, one line
    saying OUT is as it was, OUT byte-identical, nothing hidden left. (tests/test_faults.py's slow
    test_random_interrupts_never_replace_the_output sends 50 signals at random moments.)"""
    out = tmp_path / "out"
    before = previous_output(previous, out, streamed)
    args = ["convert", str(small), "--output", str(out), "--overwrite", *FEW, *streamed]
    results = FORK.Queue()
    proc = FORK.Process(target=_swallowing_run, args=(args, "finished", results))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, proc.exitcode
    code, stdout, stderr, dropped = results.get(timeout=60)
    assert dropped == ["KeyboardInterrupt"]  # Python dropped it ("Exception ignored in ...")
    line = BEFORE.replace("terminated by SIGTERM", "interrupted")
    line = line.format(where="while saving", out=out, why="had not replaced it")
    assert code == 130 and stderr.splitlines()[-1] == line and stdout == "", (code, stdout, stderr)
    assert digests(out) == before and hidden(tmp_path) == []


# 50 signals at random moments of `normswap convert --overwrite` processes (what a user's Ctrl-C or `kill`
# meets: interpreter start, imports, loading, converting, saving, verifying, the exchange, the summary, the
# interpreter's shutdown). The process records when it reaches each stage of the save (monotonic clock,
# the same for every process of the machine); the test records when its kill() returned.
_DRIVER = """
import importlib.machinery, os, sys, time
stamps = open(os.environ["NORMSWAP_TEST_STAMPS"], "a", buffering=1)
class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), 2)
        sum(range(10_000))  # the SIGINT handler runs here: Python prints its KeyboardInterrupt and drops it
def at(name):
    stamps.write(f"{name} {time.monotonic()}\\n")
    if name == os.environ.get("NORMSWAP_TEST_DROP"):
        Finalizer()
class Hook:  # sets at_stage when the command imports normswap.io.staging (not earlier: its imports are slow)
    def find_spec(self, name, path, target=None):
        if name != "normswap.io.staging":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module
        def exec_module(module):
            run_module(module)
            module.at_stage = at
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Hook())
sys.argv = ["normswap", *sys.argv[1:]]
from normswap.__main__ import run
at("started")
run()
"""


def _signalled(args, out: Path, stamps: Path, after, sig, **env) -> dict:
    """Run ``normswap *args`` as a process and send it ``sig``: ``after`` seconds after its start, or, with
    ``after`` a (stage, seconds), that long after it reached the stage of the save; never with None."""
    stamps.write_text("")
    env = dict(os.environ, NORMSWAP_TEST_STAMPS=str(stamps), OMP_NUM_THREADS="1", **env)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(normswap.__file__).parents[1]), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    sent = None
    if isinstance(after, tuple):
        stage, delay = after
        while proc.poll() is None and f"{stage} " not in stamps.read_text():
            time.sleep(0.005)
        after = time.monotonic() - start + delay
    if after is not None:
        try:
            proc.wait(max(after - (time.monotonic() - start), 0))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, sig)
            sent = time.monotonic()
    stdout, stderr = proc.communicate(timeout=600)
    times = {}
    for line in stamps.read_text().splitlines():
        name, at = line.split()
        times[name] = float(at) - start
    return {"code": proc.returncode, "stdout": stdout, "stderr": stderr, "times": times,
            "sent": None if sent is None else sent - start, "end": time.monotonic() - start}  # fmt: skip


def _judge(run_: dict, out: Path, before: dict, reference: Path, sig) -> str:
    """What the signalled run left, as one word, after asserting that it is one of the promised outcomes:
    OUT the previous checkpoint byte for byte (and the line says so), or the verified new one (the exit 0,
    the line says so, or the process ended by the signal after the summary, quietly)."""
    code, stderr, sent, times = run_["code"], run_["stderr"], run_["sent"], run_["times"]
    lines = stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    new = out.exists() and _same_new_output(out, reference)
    old = out.exists() and digests(out) == before
    assert hidden(out.parent) == [], (run_, hidden(out.parent))
    assert new or old, run_
    if sent is not None and ("started" not in times or sent < times["started"]):  # Python's own start
        assert old, run_  # (a signal in its site import is "Fatal Python error: init_import_site", exit 1)
        return "ended before normswap started"
    if sent is not None and ("finished" not in times or sent < times["finished"]):
        assert old, ("the signal came before the commit, yet OUT was replaced", run_)
    if code == 0:
        assert new and "saved:" in run_["stdout"], run_
        return "finished"
    if code == -sig:  # the system's default, in the interpreter's shutdown after the command
        assert new and "saved:" in run_["stdout"] and sent > times["exchanged"], run_  # after the summary
        assert "Traceback" not in stderr and "normswap:" not in stderr, run_
        return "ended quietly after the summary"
    assert code == 128 + sig, run_
    if old:
        assert " is as it was before" in last or last.endswith("nothing was written"), run_
        return "stopped, OUT as before"
    assert last.endswith(" holds the new, verified checkpoint") or last.endswith(" wrote is complete"), run_
    assert sent >= times["finished"], run_
    return "stopped after the exchange, OUT new"


@pytest.mark.slow  # ~10 min: 50 runs of a process (torch imported in each); the forked tests above cover it
@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_random_interrupts_never_replace_the_output(small, previous, tmp_path, streamed, runs=25):
    """SIGINT or SIGTERM at 25 random moments of an --overwrite run (each of in memory and streamed): OUT is
    the previous checkpoint byte for byte whenever the signal came before the commit, and whenever the exit
    says the run stopped with OUT as it was; else the verified new one, never anything between. Half the
    moments fall anywhere in the run, half within 1 s after a stage of the save (its start, every file
    written: the verification), 0.1 s after its manifest, or 5 s after the exchange (the summary, the
    interpreter's shutdown).
    Then one run drops a KeyboardInterrupt in a finalizer just before the exchange (the moment no timed
    signal hits: the tiny model's last stages take milliseconds): exit 130, OUT as it was."""
    out, stamps, reference = tmp_path / "work" / "out", tmp_path / "stamps", tmp_path / "reference"
    out.parent.mkdir()
    args = ["convert", small, "--output", out, "--overwrite", *FEW, *streamed]
    assert run("convert", small, "--output", reference, *FEW, *streamed).exit_code == 0
    before = previous_output(previous, out, streamed)
    ends = []
    for _ in range(2):  # runs without a signal: their length (the first may read a cold cache)
        full = _signalled(args, out, stamps, None, None)
        assert full["code"] == 0 and _same_new_output(out, reference), full
        ends.append(full["end"])
    rng, seen = random.Random(37), {}
    for i in range(runs):
        shutil.rmtree(out)
        previous_output(previous, out, streamed)
        sig = rng.choice([signal.SIGINT, signal.SIGTERM])
        if i % 2:
            after = rng.uniform(0.0, min(ends))
        else:
            stage = rng.choice(["staged", "written", "finished", "exchanged", "exchanged"])
            after = (stage, rng.uniform(0, {"staged": 1.0, "written": 1.0, "finished": 0.1}.get(stage, 5.0)))
        result = _signalled(args, out, stamps, after, sig)
        outcome = _judge(result, out, before, reference, sig)
        seen[outcome] = seen.get(outcome, 0) + 1
        if result["sent"] is None:
            when = "not sent: the run had ended"
        else:  # the last stage of the save the run had reached when the signal was sent
            reached = [name for name, at in result["times"].items() if at <= result["sent"]]
            when = f"sent after stage {reached[-1]}" if reached else "sent before the save began"
        at = f"{after:5.2f} s" if isinstance(after, float) else f"{after[1]:.3f} s after {after[0]}"
        print(f"{i:2d} {sig.name} at {at} ({when}; the run's exchange at "
              f"{result['times'].get('exchanged', float('nan')):.2f} s, its end {result['end']:.2f} s): "
              f"exit {result['code']}, {outcome}")  # fmt: skip
    print(seen)
    assert sum(seen.values()) == runs
    shutil.rmtree(out)
    previous_output(previous, out, streamed)
    dropped = _signalled(args, out, stamps, None, None, NORMSWAP_TEST_DROP="finished")
    assert "Exception ignored" in dropped["stderr"] and "KeyboardInterrupt" in dropped["stderr"], dropped
    outcome = _judge(dropped, out, before, reference, signal.SIGINT)
    assert dropped["code"] == 130 and outcome == "stopped, OUT as before", dropped
    print("a KeyboardInterrupt dropped before the exchange:", dropped["stderr"].splitlines()[-1])


# -- C30: token ids outside the vocabulary ----------------------------------------------------------------
def no_forward(monkeypatch):
    """From here on, any forward of a Llama fails the test: the refusals below come before a model runs."""
    from transformers import LlamaForCausalLM

    def ran(*args, **kwargs):
        raise AssertionError("a model ran before the input was checked")

    monkeypatch.setattr(LlamaForCausalLM, "forward", ran)


def _largest_id(tokenizer_dir: Path, tokens: int = 16) -> int:
    from transformers import AutoTokenizer

    from normswap.check import default_input_ids

    return int(default_input_ids(AutoTokenizer.from_pretrained(tokenizer_dir), tokens).max())


@pytest.mark.parametrize("case", ["A-tokenizer", "B-streamed", "C-own-tokenizer", "D-eval", "E-check"])
def test_c30_ids_beyond_the_vocabulary_are_refused_before_any_model_runs(small, tmp_path, monkeypatch, case):
    """C30: ids of another tokenizer (a wrong --tokenizer; a directory whose own tokenizer has more ids
    than vocab_size) ended in an IndexError traceback in convert, streamed convert and eval. Now exit 2,
    one line naming the largest id and the vocabulary size; nothing written, the input unchanged."""
    other = byte_tokenizer(tmp_path / "other-tokenizer", offset=30000)  # ids 30000-30256: beyond 260
    if case.startswith(("C", "D", "E")):
        model = small_model(tmp_path / "own", vocab=200)  # its byte tokenizer has 257 ids
        vocab, largest = 200, _largest_id(model)
    else:
        model, vocab, largest = small, SMALL_VOCAB, _largest_id(other)
    assert largest >= vocab
    before = tree(model)
    no_forward(monkeypatch)
    out = tmp_path / "out"
    args = {
        "A-tokenizer": ["convert", model, "--output", out, "--tokenizer", other, *FEW],
        "B-streamed": ["convert", model, "--output", out, "--tokenizer", other, *FEW, *STREAMED],
        "C-own-tokenizer": ["convert", model, "--output", out, *FEW],
        "D-eval": ["eval", "--model", model, "--converted", model, "--max-tokens", 16, "--window", 16],
        "E-check": ["check", model, model, *FEW],
    }[case]
    assert_one_line(run(*args), 2, f"gives token id {largest}, beyond", f"(vocab_size {vocab})")
    assert not out.exists() and tree(model) == before and hidden(tmp_path) == []


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
def test_tokenizer_option_tokenizes_the_check_and_the_output_keeps_the_models_own(small, tmp_path, streamed):
    """``--tokenizer`` of another model (whose ids fit) replaced the model's tokenizer in the output (a fresh
    user's SmolLM2 output shipped BERT's WordPiece); it tokenizes the check's text only."""
    other = byte_tokenizer(tmp_path / "other-tokenizer", offset=1)  # ids 1-257: fit vocab_size 260
    out = tmp_path / "out"
    result = run(
        "convert", small, "--output", out, "--tokenizer", other, *FEW, *(STREAMED if streamed else ())
    )
    assert result.exit_code == 0, result.stderr
    saved, own = (json.loads((d / "tokenizer.json").read_text()) for d in (out, small))
    assert saved["model"]["vocab"] == own["model"]["vocab"]  # ids from 0: the model's own, not other's
    assert json.loads((out / "normswap.json").read_text())["check_input"]["tokenizer"] == str(other.resolve())


# -- files given by name: only normswap's own are replaced ------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "inspect", "check"])
def test_named_file_is_replaced_only_when_normswap_wrote_it(src, tmp_path, command):
    """``--report``/``--json`` onto a user's file (a fresh user's notes.md was silently replaced by a JSON
    report) is refused in one line, the file untouched and nothing written; a report of an earlier run and
    an empty file are replaced."""
    notes = tmp_path / "notes.md"
    notes.write_text("my precious notes\n")
    args = {
        "convert": lambda file, out: ["convert", src, "-o", out, "--tokens", 16, "--report", file],
        "inspect": lambda file, out: ["inspect", src, "--json", file],
        "check": lambda file, out: ["check", src, src, "--tokens", 16, "--report", file],
    }[command]
    assert_one_line(run(*args(notes, tmp_path / "out1")), 2, str(notes), "normswap did not write it")
    assert notes.read_text() == "my precious notes\n" and not (tmp_path / "out1").exists()
    report = tmp_path / "r.json"
    report.write_text("")  # empty: nothing to lose
    first = run(*args(report, tmp_path / "out2"))
    assert first.exit_code == 0, first.stderr
    assert files.written_by_normswap(report) and json.loads(report.read_text())[files.VERSION_KEY]
    again = run(*args(report, tmp_path / "out3"))  # the earlier run's report is replaced
    assert again.exit_code == 0, again.stderr
    user_json = tmp_path / "mine.json"
    user_json.write_text('{"model": "mine"}')  # JSON, but not normswap's
    assert_one_line(run(*args(user_json, tmp_path / "out4")), 2, "normswap did not write it")
    assert user_json.read_text() == '{"model": "mine"}'


def test_zoo_output_replaces_its_own_table_only(tmp_path):
    """``zoo --output`` replaces a table it generated (docs/COVERAGE.md's header), not another file."""
    mine = tmp_path / "table.md"
    mine.write_text("# my table\n")
    assert_one_line(run("zoo", "--only", "llama", "--output", mine), 2, "normswap did not write it")
    assert mine.read_text() == "# my table\n"
    coverage = Path(__file__).parents[1] / "docs" / "COVERAGE.md"
    assert files.written_by_normswap(coverage)


# -- C28: tensors that transformers ignores on load -------------------------------------------------------
def _mtp_tensors(config, seed: int = 3) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's multi-token-prediction tensors, named as it ships them (layer 61 of a 61-layer model)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config.hidden_size, config.vocab_size
    shapes = {
        "model.layers.61.enorm.weight": (hidden,),
        "model.layers.61.hnorm.weight": (hidden,),
        "model.layers.61.eh_proj.weight": (hidden, 2 * hidden),
        "model.layers.61.shared_head.norm.weight": (hidden,),
        "model.layers.61.shared_head.head.weight": (vocab, hidden),
        "model.layers.61.embed_tokens.weight": (vocab, hidden),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def deepseek_with_mtp(folder: Path, **overrides) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny DeepSeek-V3 in two shards, plus a third shard of MTP tensors listed in the index."""
    model = make_tiny_model("deepseek_v3", tie_word_embeddings=False, vocab_size=SMALL_VOCAB, **overrides)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=size * 3 // 4)
    byte_tokenizer(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    mtp = _mtp_tensors(model.config)
    save_file(mtp, folder / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    index["metadata"]["total_size"] += sum(t.numel() * 4 for t in mtp.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return model, mtp


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_c28_tensors_the_loader_skips_reach_the_output(tmp_path, streamed):
    """C28: DeepSeek-V3's MTP layer (transformers skips model.layers.61.* on load) was silently dropped.
    Now every input tensor reaches the output, bit for bit; the report and the summary list them; the final
    norm, whose output they may read, stays unfolded; the output is verified and reloads in transformers
    within 1e-5 of the original. The tiny model has routed experts (transformers stacks them as it loads and
    writes them back per expert: not taken for skipped tensors), also streamed."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    model, mtp = deepseek_with_mtp(src)
    before = tree(src)
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", src, "--output", out, "--report", report, *FEW, *streamed)
    assert result.exit_code == 0, result.output
    assert "carried:  6 tensors the model class does not run" in result.stdout
    assert "model.norm kept unfolded" in result.stdout
    data = strict_json(report)
    assert ("streamed" in data) == bool(streamed)
    assert sorted(data["carried"]["tensors"]) == sorted(mtp) and data["verify"]["passed"]
    assert data["carried"]["norms_kept_unfolded"] == ["model.norm"]
    final = next(s for s in data["sites"] if s["name"] == "model.norm")
    assert not final["folded"] and "kept unfolded" in final["reason"]
    saved = tensors_of(out)
    assert set(tensors_of(src)) <= set(saved)  # every input tensor, by name
    index = json.loads((out / "model.safetensors.index.json").read_text())  # lists every file and byte
    assert set(index["weight_map"]) == set(saved)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    for name, tensor in mtp.items():
        assert torch.equal(saved[name], tensor), name  # unchanged, bit for bit
    assert torch.equal(saved["model.norm.weight"], model.model.norm.weight.detach())
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, SMALL_VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (reloaded(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-5
    assert tree(src) == before


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_c28_one_file_input_gives_one_file_output(tmp_path, streamed):
    """The output keeps the input's layout also with carried tensors: a one-file checkpoint holding MTP
    tensors stays one file (in memory they were written to a second shard with an index), every tensor
    bit for bit."""
    src = tmp_path / "src"
    model = make_tiny_model("deepseek_v3", tie_word_embeddings=False, vocab_size=SMALL_VOCAB)
    model.save_pretrained(src)
    byte_tokenizer(src)
    mtp = _mtp_tensors(model.config)
    save_file(
        load_file(src / "model.safetensors") | mtp, src / "model.safetensors", metadata={"format": "pt"}
    )
    out = tmp_path / "out"
    result = run("convert", src, "--output", out, *FEW, *streamed)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    saved = tensors_of(out)
    assert set(tensors_of(src)) <= set(saved)
    assert all(torch.equal(saved[name], tensor) for name, tensor in mtp.items())
    assert strict_json(out / "normswap.json")["verify"]["passed"]


@pytest.mark.parametrize(
    "option", [("--norm", "rmsnorm"), ("--rotate", "hadamard")], ids=["center", "rotate"]
)
def test_c28_centering_or_rotation_refuses_a_checkpoint_with_skipped_tensors(tmp_path, option):
    """Centering (--norm rmsnorm) and rotation change the embeddings and the residual stream the MTP tensors
    read: refused in one line naming them, before anything is written."""
    src = tmp_path / "src"
    deepseek_with_mtp(src)
    before = tree(src)
    result = run("convert", src, "--output", tmp_path / "out", *option, *FEW)
    assert_one_line(result, 2, "6 tensors the model class does not run", "model.layers.61.",
                    f"that {' '.join(option)} changes")  # fmt: skip
    assert tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from normswap.io.shards import CheckpointReader

    reader = CheckpointReader(folder)
    return {name: reader.read(name) for name in reader.tensors}


# -- C29: --max-memory with --trust-remote-code -----------------------------------------------------------
REMOTE_FILES = {
    "configuration_tiny_remote.py": (
        "from transformers import LlamaConfig\n\n\n"
        "class TinyRemoteConfig(LlamaConfig):\n"
        '    model_type = "tiny_remote"\n'
    ),
    "modeling_tiny_remote.py": (
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_tiny_remote import TinyRemoteConfig\n\n\n"
        "class TinyRemoteForCausalLM(LlamaForCausalLM):\n"
        "    config_class = TinyRemoteConfig\n"
    ),
}


def remote_model(folder: Path) -> Path:
    """The small Llama as a model with its own code: configuration and modeling files named by auto_map."""
    small_model(folder)
    for name, text in REMOTE_FILES.items():
        (folder / name).write_text(text)
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "model_type": "tiny_remote",
        "architectures": ["TinyRemoteForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("budget", ["10GiB", "64KB"], ids=["A-fits", "B-streamed"])
def test_c29_remote_code_with_max_memory(tmp_path, budget):
    """C29: the streamed opener looked the config class up in transformers' Auto mapping (a KeyError
    traceback, even for a model that fits). Now (A) converts in memory as without --max-memory, (B)
    streams: the output holds the model's code, reloads in plain transformers within 1e-5 of the original,
    and is verified."""
    from transformers import AutoModelForCausalLM

    src = remote_model(tmp_path / "src")
    before = tree(src)
    out, plain = tmp_path / "out", tmp_path / "plain"
    result = run("convert", src, "--output", out, "--trust-remote-code", "--max-memory", budget, *FEW)
    assert result.exit_code == 0, result.output
    data = strict_json(out / "normswap.json")
    assert data["verify"]["passed"] and data["architecture"] == "TinyRemoteForCausalLM"
    assert ("streamed" in data) == (budget == "64KB")
    if budget == "10GiB":
        assert run("convert", src, "--output", plain, "--trust-remote-code", *FEW).exit_code == 0
        assert tensors_of(out).keys() == tensors_of(plain).keys()
        assert all(torch.equal(tensors_of(out)[k], t) for k, t in tensors_of(plain).items())
    original = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(reloaded).__name__ == "TinyRemoteForCausalLM"
    ids = torch.randint(0, SMALL_VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reloaded(ids).logits - original(ids).logits).abs().max().item() < 1e-5
    assert tree(src) == before


def test_c28_same_kind_qwen3_next_mtp_and_the_python_api(tmp_path):
    """The same kind through the Python API, on Qwen3-Next's `mtp.*` tensors: save_converted with the input
    path carries them when the final norm was kept unfolded, and refuses in one line when it was folded."""
    from normswap.io import carry, load_model, report_dict
    from normswap.walk import walk

    src = tmp_path / "src"
    model = make_tiny_model("qwen3_next", vocab_size=SMALL_VOCAB, tie_word_embeddings=False)
    model.save_pretrained(src)
    gen = torch.Generator().manual_seed(4)
    mtp = {
        "mtp.fc.weight": torch.randn(64, 128, generator=gen),
        "mtp.norm.weight": torch.randn(64, generator=gen),
    }
    save_file(mtp, src / "mtp.safetensors", metadata={"format": "pt"})
    (src / "model.safetensors").rename(src / "model-00001.safetensors")
    weight_map = dict.fromkeys(load_file(src / "model-00001.safetensors"), "model-00001.safetensors")
    index = {"metadata": {}, "weight_map": weight_map | dict.fromkeys(mtp, "mtp.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.randint(0, SMALL_VOCAB, (1, 16), generator=gen)

    loaded = load_model(src)
    assert carry.gather(loaded.info, loaded.model).skipped == list(mtp)
    folded = normswap.convert(loaded.model, input_ids=ids)
    with pytest.raises(
        NormswapError, match="2 tensors the model class does not run .* model.norm, folded here"
    ):
        save_converted(loaded.model, None, report_dict(folded, loaded.info), tmp_path / "out", input_path=src)
    assert not (tmp_path / "out").exists()

    loaded = load_model(src)
    traced = walk(loaded.model, ids)
    assert carry.keep_final_norms(loaded.model, traced.sites, list(mtp)) == ["model.norm"]
    report = normswap.convert(loaded.model, input_ids=ids, traced=traced)
    out = save_converted(
        loaded.model, None, report_dict(report, loaded.info), tmp_path / "out", input_path=src
    )
    saved = tensors_of(out)
    assert all(torch.equal(saved[name], tensor) for name, tensor in mtp.items())


def test_c28_bin_checkpoint_tensors_reach_the_output(tmp_path):
    """The same kind in a PyTorch .bin checkpoint: its MTP tensors are read from the .bin file (memory-mapped)
    and reach the (safetensors) output unchanged."""
    src = tmp_path / "src"
    model, mtp = deepseek_with_mtp(tmp_path / "safetensors")
    src.mkdir()
    shutil.copy(tmp_path / "safetensors" / "config.json", src)
    byte_tokenizer(src)
    torch.save(model.state_dict() | mtp, src / "pytorch_model.bin")
    out = tmp_path / "out"
    result = run("convert", src, "--output", out, *FEW)
    assert result.exit_code == 0, result.output
    saved = tensors_of(out)
    assert all(torch.equal(saved[name], tensor) for name, tensor in mtp.items())


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_stale_rotary_buffers_are_carried_and_the_final_norm_still_folds(small, tmp_path, streamed):
    """An old checkpoint's per-layer `rotary_emb.inv_freq` (transformers drops it by its generic rule; the
    class computes it itself): carried over like every input tensor, but it reads no hidden state, so every
    norm folds as without it."""
    src = Path(shutil.copytree(small, tmp_path / "src"))
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    rewrite = load_file(src / shard) | {name: torch.arange(8, dtype=torch.float32)}
    save_file(rewrite, src / shard, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    result = run("convert", src, "--output", out, *FEW, *streamed)
    assert result.exit_code == 0, result.output
    data = strict_json(out / "normswap.json")
    assert data["carried"]["tensors"] == [name] and data["carried"]["norms_kept_unfolded"] == []
    assert data["norms_folded"] == data["norms_found"] == 5
    assert torch.equal(tensors_of(out)[name], torch.arange(8, dtype=torch.float32))


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_files_transformers_writes_are_not_listed_as_copied(small, tmp_path, streamed):
    """An input holding only what ``save_pretrained`` writes (config, tokenizer files) has nothing copied:
    no ``copied:`` line and no ``carried`` entry (they were listed although transformers' own were kept)."""
    out = tmp_path / "out"
    result = run("convert", small, "--output", out, *FEW, *streamed)
    assert result.exit_code == 0, result.output
    assert "copied:" not in result.stdout
    assert "carried" not in strict_json(out / "normswap.json")


@pytest.mark.parametrize("streamed", [(), STREAMED], ids=["memory", "streamed"])
def test_other_files_of_the_input_are_copied(small, tmp_path, streamed, monkeypatch):
    """Every other file of the input (model card, licence, a sentence-transformers pipeline in a subfolder)
    reaches the output byte for byte, never over what transformers wrote; weight files of the original, one
    larger than the limit and hidden folders are not copied (the first two named); the output is still an
    earlier normswap output for --overwrite."""
    from normswap.io import carry

    src = Path(shutil.copytree(small, tmp_path / "src"))
    (src / "README.md").write_text("# Tiny model\nA model card.\n")
    (src / "LICENSE").write_text("Permission is granted ...\n")
    (src / "1_Pooling").mkdir()  # a sentence-transformers pipeline beside the weights
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}\n')
    (src / "modules.json").write_text("[]\n")
    (src / "NOTICE-data.txt").write_bytes(b"x" * 4096)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / "pytorch_model.bin").write_bytes(b"the original's weights in another format")
    (src / "training_args.bin").write_bytes(b"pickle")
    monkeypatch.setattr(carry, "FILE_LIMIT", 1024)
    config = json.dumps(json.loads((src / "config.json").read_text()), indent=7).encode()  # not as HF writes
    (src / "config.json").write_bytes(config)
    out = tmp_path / "out"
    result = run("convert", src, "--output", out, *FEW, *streamed)
    assert result.exit_code == 0, result.output
    copied = ["1_Pooling/config.json", "LICENSE", "README.md", "modules.json"]
    for rel in copied:
        assert (out / rel).read_bytes() == (src / rel).read_bytes()
    assert (out / "config.json").read_bytes() != config  # what transformers writes is never overwritten
    for rel in ("NOTICE-data.txt", ".git", "pytorch_model.bin", "training_args.bin"):
        assert not (out / rel).exists()
    assert f"copied:   {', '.join(copied)} (other files of the input); not copied: NOTICE-data.txt" in (
        result.stdout
    )
    carried = strict_json(out / "normswap.json")["carried"]
    assert carried["files"] == copied and carried["tensors"] == []
    assert sorted(carried["not_copied"]) == [
        "NOTICE-data.txt (larger than 1024 bytes)",
        "pytorch_model.bin (weights or training state of the original, not the converted model's)",
        "training_args.bin (weights or training state of the original, not the converted model's)",
    ]
    assert run("convert", src, "--output", out, "--overwrite", *FEW, *streamed).exit_code == 0


def test_api_failed_verification_keeps_the_previous_output(small, previous, tmp_path):
    """save_converted(..., expected=...) verifies beside the output: a failure raises one line and leaves
    the previous checkpoint byte for byte."""
    from normswap.io import load_model, record_expected, report_dict

    out = tmp_path / "out"
    before = previous_output(previous, out)
    loaded = load_model(small)
    ids = torch.randint(0, SMALL_VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    report = report_dict(normswap.convert(loaded.model, input_ids=ids), loaded.info)
    expected = record_expected(loaded.model, ids)
    expected.outputs = expected.outputs + 1  # the saved copy cannot reproduce these
    with pytest.raises(
        NormswapError, match=r"verification of the checkpoint for .* failed .* left as it was"
    ):
        save_converted(loaded.model, None, report, out, overwrite=True, expected=expected)
    assert digests(out) == before and hidden(tmp_path) == []
    assert not report["verify"]["passed"] and report["verify"]["path"] == str(out)
    expected = record_expected(loaded.model, ids)
    save_converted(loaded.model, None, report, out, overwrite=True, expected=expected)
    assert strict_json(out / "normswap.json")["verify"]["passed"]

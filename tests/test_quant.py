"""``normswap.quantize`` (round-to-nearest fake quantization) and ``normswap eval --quantize``.

Every fake-quantized number is compared with a hand-written float64 quantizer (a loop over rows, not the
module's vectorized ``rtn``) applied to what each ``nn.Linear`` / ``Conv1D`` receives, captured by forward
hooks: the module under test finds its linear ops from the forward's torch functions, the reference from
module types, so the two also cross-check which ops are quantized.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
from click.testing import CliRunner
from test_check import save_pair
from torch import nn

import normswap
from normswap.evaluate import evaluate, evaluate_quantized, summarize_quantized
from normswap.quantize import SCHEMES, get_scheme, quantized, rtn

F64 = 1e-12  # float64 rounding of a few hundred products of O(1) numbers


def hand_quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., n) float64, each row quantized symmetrically to ``2^(b-1) - 1`` levels a side: (values,
    per-row scales), one row at a time."""
    levels = 2 ** (bits - 1) - 1
    rows = x.reshape(-1, x.shape[-1])
    out, scales = torch.empty_like(rows), torch.empty(rows.shape[0], dtype=rows.dtype)
    for i, row in enumerate(rows):
        scale = max(abs(v) for v in row.tolist()) / levels
        scales[i] = scale
        out[i] = torch.tensor(
            [round(v / scale) * scale if scale else 0.0 for v in row.tolist()], dtype=x.dtype
        )
    return out.reshape(x.shape), scales


def linear_modules(model):
    """Reference list: ``(name, module, weight as out x in)`` of every nn.Linear / Conv1D but the head."""
    head = model.get_output_embeddings()
    found = []
    for name, m in model.named_modules():
        if m is head:
            continue
        if isinstance(m, nn.Linear):
            found.append((name, m, lambda m=m: m.weight))
        elif type(m).__name__ == "Conv1D":
            found.append((name, m, lambda m=m: m.weight.t()))
    return found


def capture(model, ids):
    """Every linear module's (input, output) on ``ids``, in float64, through forward hooks."""
    seen, handles = {}, []
    for name, m, _ in linear_modules(model) + [("head", model.get_output_embeddings(), None)]:
        hook = lambda mod, args, out, name=name: seen.__setitem__(name, (args[0].double(), out.double()))  # noqa: E731
        handles.append(m.register_forward_hook(hook))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    for h in handles:
        h.remove()
    return seen, logits


# ---------------------------------------------------------------- the grid
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_rtn_lies_on_the_grid_within_half_a_step(bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, dtype=torch.float64, generator=gen)
    x[1, 3] = 80.0  # an outlier row
    x[2] = 0.0  # a zero row stays zero
    q = rtn(x, bits)
    ref, scales = hand_quantize_rows(x, bits)
    levels = 2 ** (bits - 1) - 1
    assert q.dtype == x.dtype and q.shape == x.shape
    assert (q - ref).abs().max().item() <= F64 * 100
    nonzero = scales > 0
    steps = q[nonzero] / scales[nonzero, None]
    assert (steps - steps.round()).abs().max().item() <= 1e-9  # integers times the row's scale
    assert steps.abs().max().item() <= levels + 1e-9
    assert ((q - x).abs()[nonzero] <= scales[nonzero, None] / 2 + 1e-12).all()
    assert (q[2] == 0).all()
    # each row uses at most 2^b - 1 values (-L .. L), and the row's extreme lands on +-L exactly
    assert max(len(set(r.tolist())) for r in steps.round()) <= 2**bits - 1
    assert (steps.abs().amax(-1).round() == levels).all()


def test_rtn_keeps_dtype_and_rounds_in_float32():
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = rtn(x, 6)
    _, scales = hand_quantize_rows(x.double(), 6)
    assert q.dtype == torch.bfloat16
    # within half a step of x, plus the final rounding to bfloat16 (8 significant bits: 2^-8 relative)
    error = (q.double() - x.double()).abs()
    assert (error <= scales[:, None] / 2 + q.double().abs() * 2**-8 + 1e-12).all()


def test_schemes_table_and_unknown_name():
    own = {n: (s.activation_bits, s.weight_bits) for n, s in SCHEMES.items() if s.library is None}
    assert own == {"a8": (8, None), "a6": (6, None), "a4": (4, None), "w4": (None, 4), "w4a4": (4, 4)}
    library = {n: (s.activation_bits, s.weight_bits, s.group_size, s.method)
               for n, s in SCHEMES.items() if s.library == "llmcompressor"}  # fmt: skip
    assert library == {"w8a8": (8, 8, None, "rtn"), "w4a16": (None, 4, 64, "rtn"),
                       "w4a16-gptq": (None, 4, 64, "gptq"), "w4a8-gptq": (8, 4, 64, "gptq")}  # fmt: skip
    with pytest.raises(normswap.NormswapError, match="unknown quantization scheme 'a5'; known: a8, a6"):
        get_scheme("a5")


# ---------------------------------------------------------------- every linear op, the head left out
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("scheme", ["a6", "w4"])
def test_fake_quant_matches_hand_quantized_linears(tiny_model, input_ids, model_type, scheme):
    model = tiny_model(model_type, dtype=torch.float64, vocab_size=128)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    float_seen, _ = capture(model, input_ids)
    with quantized(model, scheme) as mode:
        seen, logits = capture(model, input_ids)
    expected = {f"{name}.weight" for name, _, _ in linear_modules(model)}
    assert mode.ops == expected and len(expected) >= 8  # every linear op of the decoder, not lm_head
    bits = SCHEMES[scheme]
    for name, m, weight in linear_modules(model):
        x, out = seen[name]
        w, b = weight().double(), (m.bias.double() if m.bias is not None else 0.0)
        if bits.activation_bits:
            ref = hand_quantize_rows(x, bits.activation_bits)[0] @ w.T + b
        else:  # per output channel: one scale per row of w (out x in)
            ref = x @ hand_quantize_rows(w, bits.weight_bits)[0].T + b
        assert (out - ref).abs().max().item() <= F64 * max(1.0, ref.abs().max().item()), name
    x, out = seen["head"]
    head = model.get_output_embeddings()
    assert (out - x @ head.weight.double().T).abs().max().item() <= F64  # the head: never quantized
    assert (seen["head"][1] - float_seen["head"][1]).abs().max().item() > 1e-6  # but upstream changed
    assert torch.isfinite(logits).all()
    for n, p in model.state_dict().items():  # the model itself is untouched
        assert torch.equal(p, before[n]), n


class Custom(nn.Module):
    """Linear ops without nn.Linear: ``x @ W.t()``, ``addmm(b, x, V)``, and a buffer matmul (not a weight)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(12, 8, dtype=torch.float64, generator=gen))
        self.v = nn.Parameter(torch.randn(12, 5, dtype=torch.float64, generator=gen))
        self.b = nn.Parameter(torch.randn(5, dtype=torch.float64, generator=gen))
        self.register_buffer("rot", torch.randn(5, 5, dtype=torch.float64, generator=gen))

    def forward(self, x):
        h = torch.relu(x @ self.w.t())
        return torch.addmm(self.b, h, self.v) @ self.rot


def test_linear_ops_found_from_the_forward_not_module_types():
    model = Custom()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with quantized(model, "w4") as mode, torch.no_grad():
        got = model(x)
    assert mode.ops == {"w", "v"}  # the buffer's matmul is not a linear op of the model's weights
    wq = hand_quantize_rows(model.w.detach(), 4)[0]  # w: out x in, a scale per output row
    vq = hand_quantize_rows(model.v.detach().t(), 4)[0].t()  # v: in x out, a scale per output column
    ref = (torch.relu(x @ wq.t()) @ vq + model.b.detach()) @ model.rot
    assert (got - ref).abs().max().item() <= F64 * 10
    with quantized(model, "a4"), torch.no_grad():
        got = model(x)
    h = torch.relu(hand_quantize_rows(x, 4)[0] @ model.w.detach().t())
    ref = (hand_quantize_rows(h, 4)[0] @ model.v.detach() + model.b.detach()) @ model.rot
    assert (got - ref).abs().max().item() <= F64 * 10


# ---------------------------------------------------------------- evaluation
def _windows(ids):
    return [ids[i : i + 1] for i in range(ids.shape[0])]


def _hand_ppl_kl(reference, model, windows, scheme):
    nll = kl = 0.0
    positions = targets = 0
    for ids in windows:
        with torch.no_grad():
            lp0 = reference(input_ids=ids, use_cache=False).logits[0].double().log_softmax(-1)
            with quantized(model, scheme):
                lp1 = model(input_ids=ids, use_cache=False).logits[0].double().log_softmax(-1)
        nll -= lp1[:-1].gather(1, ids[0, 1:, None]).sum().item()
        kl += (lp0.exp() * (lp0 - lp1)).sum().item()
        positions, targets = positions + ids.shape[1], targets + ids.shape[1] - 1
    return math.exp(nll / targets), kl / positions


@pytest.fixture
def rotated_pair(tiny_model, input_ids):
    original = tiny_model("llama", vocab_size=128)
    rotated = copy.deepcopy(original)
    normswap.convert(rotated, input_ids=input_ids, rotate="hadamard")
    return original, rotated


def test_evaluate_quantized_report_and_numbers(rotated_pair, input_ids, capsys):
    original, rotated = rotated_pair
    windows = _windows(input_ids)
    result = evaluate_quantized(original, rotated, windows, ["a8", "w4"], progress=True)
    assert list(result) == ["a8", "w4"]
    for name, entry in result.items():
        assert entry["linear_ops"] == 14 and entry["description"] == SCHEMES[name].description
        for side, model in (("original", original), ("converted", rotated)):
            assert set(entry[side]) == {"ppl", "kl", "top1_agreement"}
            ppl, kl = _hand_ppl_kl(original, model, windows, name)
            assert math.isfinite(entry[side]["ppl"]) and math.isfinite(entry[side]["kl"])
            # float32 logits summed in float64 here and there: 1e-6 relative
            assert entry[side]["ppl"] == pytest.approx(ppl, rel=1e-6)
            assert entry[side]["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-9)
    err = capsys.readouterr().err
    assert err.count("quantized a8 (8-bit activations per token") == 1 and "quantized w4 (" in err
    # sanity: 8-bit per-token activations move a model's perplexity by well under 1% (each input entry by
    # at most max|x|/254); the rotated model (the same function) as little as the original
    float_ppl = evaluate(original, rotated, windows, progress=False)
    for side in ("original", "converted"):
        assert result["a8"][side]["ppl"] == pytest.approx(float_ppl[f"ppl_{side}"], rel=0.01)
        assert result["a8"][side]["kl"] < 1e-3


def test_summarize_quantized_is_independent_of_order():
    rows = torch.tensor(
        [[1, 10.0, 12.0, 0.5, 0.7, 7, 6, 8, 7], [0, 9.0, 11.0, 0.25, 0.5, 8, 8, 8, 7]]
    ).double()
    a, b = summarize_quantized(rows), summarize_quantized(rows.flip(0))
    assert a == b
    assert a["original"]["ppl"] == pytest.approx(math.exp(19.0 / 14))
    assert a["converted"]["kl"] == pytest.approx(1.2 / 16)
    assert a["original"]["top1_agreement"] == pytest.approx(15 / 16)


def test_cli_eval_quantize_end_to_end(tmp_path):
    from normswap.cli import main

    orig, conv = save_pair(tmp_path, "llama")
    report = tmp_path / "r.json"
    args = ["eval", "--model", str(orig), "--converted", str(conv), "--max-tokens", "96", "--window", "48"]
    result = CliRunner().invoke(main, [*args, "--quantize", "a6", "--quantize", "w4", "--quantize", "a6",
                                       "--report", str(report)])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert list(data["quantized"]) == ["a6", "w4"]  # each scheme once, in the order given
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["quantized", "original", "ppl"])
    for offset, name in enumerate(["float", "a6", "w4"], start=1):
        cells = lines[header + offset].split()
        assert cells[0] == name
        if name == "float":
            assert float(cells[1]) == pytest.approx(data["ppl_original"], rel=1e-4)
            continue
        q = data["quantized"][name]
        assert float(cells[1]) == pytest.approx(q["original"]["ppl"], rel=1e-4)
        assert float(cells[3]) == pytest.approx(q["converted"]["ppl"], rel=1e-4)
        assert float(cells[4]) == pytest.approx(q["converted"]["kl"], rel=1e-3)
        # the hand-folded copy is the same function: it quantizes to finite numbers close to the original's
        assert math.isfinite(q["converted"]["ppl"]) and q["original"]["ppl"] > 1


def test_cli_eval_quantize_refusals(tmp_path):
    from normswap.cli import main

    args = ["eval", "--model", "x", "--converted", "y"]
    bad = CliRunner().invoke(main, [*args, "--quantize", "a5"])
    assert bad.exit_code == 2 and "'a5' is not one of 'a8', 'a6', 'a4', 'w4', 'w4a4', 'w8a8'" in bad.output
    orig, conv = save_pair(tmp_path, "llama")
    tasks = CliRunner().invoke(main, ["eval", "--model", str(orig), "--converted", str(conv), "--tasks",
                                      "normswap_mc", "--quantize", "a8"])  # fmt: skip
    assert tasks.exit_code == 2 and "--quantize applies to the perplexity evaluation" in tasks.output


# ---------------------------------------------------------------- the convert summary
def test_convert_summary_says_folded_weights_quantize_worse():
    from normswap.summary import QUANTIZE_EXAMPLE, quantize_line, summary

    report = {"model": "smollm2-135m", "dtype": "float32", "norms_found": 3, "norms_folded": 3,
              "norms_swapped": 3}  # fmt: skip
    lines = [line for line in summary(report, "out", None).splitlines() if line.startswith("quantize:")]
    assert lines == [
        f"quantize: folded weights can quantize worse than the original's (measured on {QUANTIZE_EXAMPLE}); "
        "--rotate hadamard spreads activation outliers; measure yours: normswap eval --model smollm2-135m "
        "--converted out --quantize w4 --quantize a6"
    ]
    for other in ({"rotation": {"kind": "hadamard"}}, {"norms_folded": 0}):  # rotated, or nothing folded
        assert quantize_line(report | other, "out") is None


# ---------------------------------------------------------------- llm-compressor (the quant extra)
HAVE_LLMC = importlib.util.find_spec("llmcompressor") is not None


@pytest.mark.skipif(HAVE_LLMC, reason="llm-compressor is installed")
def test_llmcompressor_schemes_without_it_name_the_install(tmp_path):
    from normswap.cli import main

    orig, conv = save_pair(tmp_path, "llama")
    result = CliRunner().invoke(main, ["eval", "--model", str(orig), "--converted", str(conv), "--quantize",
                                       "w4a16-gptq"])  # fmt: skip
    assert result.exit_code == 2
    assert "--quantize w4a16-gptq needs llm-compressor: pip install -e '.[quant]'" in result.output


@pytest.mark.quant
@pytest.mark.skipif(not HAVE_LLMC, reason="needs llm-compressor (pip install -e '.[quant]')")
def test_llmcompressor_quantizes_copies_of_the_rotated_and_original(rotated_pair, input_ids):
    from test_check import byte_tokenizer

    original, rotated = rotated_pair
    before = {n: p.clone() for n, p in original.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    calibration = [torch.randint(0, 128, (1, 32), generator=gen) for _ in range(4)]
    schemes = ["w8a8", "w4a16", "w4a16-gptq", "w4a8-gptq"]
    result = evaluate_quantized(original, rotated, _windows(input_ids), schemes, progress=False,
                                calibration=calibration, tokenizer=byte_tokenizer())  # fmt: skip
    float_ppl = evaluate(original, rotated, _windows(input_ids), progress=False)["ppl_original"]
    assert list(result) == schemes
    for entry in result.values():
        assert entry["linear_ops"] == 14 and "llm-compressor" in entry["description"]
        o, c = entry["original"], entry["converted"]
        # finite, and (4-bit weights of a tiny random model move its perplexity by well under 5%) close to
        # the float model's and to each other's: the rotated model quantizes as well as the original here
        assert math.isfinite(o["ppl"]) and math.isfinite(c["ppl"]) and c["kl"] > 0
        assert o["ppl"] == pytest.approx(float_ppl, rel=0.05) and c["ppl"] == pytest.approx(
            o["ppl"], rel=0.05
        )
    for n, p in original.state_dict().items():  # quantized as copies
        assert torch.equal(p, before[n]), n


@pytest.mark.quant
@pytest.mark.skipif(not HAVE_LLMC, reason="needs llm-compressor (pip install -e '.[quant]')")
def test_cli_eval_gptq_of_a_rotated_output(tmp_path):
    """A saved ``normswap convert --rotate hadamard`` output, loaded by ``eval`` and quantized by GPTQ through
    llm-compressor's ``oneshot`` beside the original: both finite, the rotated one close to the original's."""
    from normswap.check.text import default_text
    from normswap.cli import main

    orig, _ = save_pair(tmp_path, "llama")
    rotated = tmp_path / "rotated"
    done = CliRunner().invoke(main, ["convert", str(orig), "--rotate", "hadamard", "-o", str(rotated)])
    assert done.exit_code == 0, done.output
    assert (rotated / "normswap" / "rotation.safetensors").is_file()
    text = tmp_path / "calibration.txt"
    text.write_text(default_text()[-4000:])
    report = tmp_path / "r.json"
    args = ["eval", "--model", str(orig), "--converted", str(rotated), "--max-tokens", "96", "--window", "48",
            "--quantize", "w4a16-gptq", "--calibration", str(text), "--calibration-samples", "4",
            "--calibration-length", "64", "--report", str(report)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    got = json.loads(report.read_text())
    entry = got["quantized"]["w4a16-gptq"]
    assert entry["linear_ops"] == 14  # 2 layers x 7 Linear, lm_head left out
    o, c = entry["original"], entry["converted"]
    # the float rotated model computes the original's function (float32 rounding only); 4-bit weights of
    # this tiny random model (vocabulary 260: perplexity near 260) move its perplexity by well under 5%
    assert got["ppl_converted"] == pytest.approx(got["ppl_original"], rel=1e-4)
    assert math.isfinite(o["ppl"]) and math.isfinite(c["ppl"]) and o["kl"] > 0 and c["kl"] > 0
    assert o["ppl"] == pytest.approx(got["ppl_original"], rel=0.05)
    assert c["ppl"] == pytest.approx(o["ppl"], rel=0.05)
    assert any(line.split()[:1] == ["w4a16-gptq"] for line in result.output.splitlines())
    assert " | INFO - " not in result.stdout  # llm-compressor's log (it writes to stdout) is silenced


@pytest.mark.quant
@pytest.mark.skipif(not HAVE_LLMC, reason="needs llm-compressor (pip install -e '.[quant]')")
def test_llmcompressor_quantizes_a_model_loaded_from_gguf(tiny_gguf, input_ids):
    """A GGUF file loads into float weights, with a config that records GGUF quantization (which oneshot
    refuses): the copy is quantized from the float weights, the loaded model left as it was."""
    from normswap.io import load_model
    from normswap.quantize import llmc

    loaded = load_model(str(tiny_gguf))
    assert loaded.model.config.quantization_config is not None
    before = {n: p.clone() for n, p in loaded.model.state_dict().items()}
    quantized = llmc.quantize_copy(loaded.model, SCHEMES["w4a16"], [input_ids[:1]], loaded.tokenizer)
    assert llmc.quantized_ops(quantized) > 0
    with torch.no_grad():
        a = loaded.model(input_ids=input_ids).logits
        b = quantized(input_ids=input_ids).logits
    assert torch.isfinite(b).all() and 0 < (a - b).abs().max().item()
    for n, p in loaded.model.state_dict().items():
        assert torch.equal(p, before[n]), n


@pytest.mark.quant
@pytest.mark.skipif(not HAVE_LLMC, reason="needs llm-compressor (pip install -e '.[quant]')")
def test_gptq_solves_on_one_thread_on_the_cpu_with_the_same_numbers(rotated_pair, input_ids, monkeypatch):
    """GPTQ's column loop runs with one torch thread on a CPU (the calibration forwards keep theirs), the
    thread count is restored after, and the weights are those of llm-compressor's own GPTQModifier."""
    import contextlib

    from llmcompressor.modifiers.gptq import base
    from test_check import byte_tokenizer

    from normswap.quantize import llmc

    _, rotated = rotated_pair
    solve, seen = base.quantize_weight, []

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return solve(*args, **kwargs)

    monkeypatch.setattr(base, "quantize_weight", spy)
    calibration, tok, scheme = [input_ids[:1], input_ids[1:]], byte_tokenizer(), SCHEMES["w4a16-gptq"]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours = llmc.quantize_copy(rotated, scheme, calibration, tok)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setattr(llmc, "one_thread", contextlib.nullcontext)  # llm-compressor's threads
        theirs = llmc.quantize_copy(rotated, scheme, calibration, tok)
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(threads)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], rotated.state_dict()[n]) for n in a if n in rotated.state_dict())


@pytest.mark.quant
@pytest.mark.skipif(not HAVE_LLMC, reason="needs llm-compressor (pip install -e '.[quant]')")
def test_gptq_calibrates_in_the_order_given(tiny_model):
    """The calibration windows reach the model in the order given, whatever torch's global generator
    (oneshot's default sampler shuffles by it): the Hessians then sum in one order, and the original
    quantized in two evals gets the same weights. Seen by a hook on the embedding (deep-copied with it)."""
    from test_check import byte_tokenizer

    from normswap.quantize import llmc

    model = tiny_model("llama", vocab_size=128)
    gen = torch.Generator().manual_seed(3)
    calibration = [torch.randint(0, 128, (1, 24), generator=gen) for _ in range(8)]
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].tolist()))
    copies = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        seen.clear()
        copies.append(llmc.quantize_copy(model, SCHEMES["w4a16-gptq"], calibration, byte_tokenizer()))
        given = [ids.tolist() for ids in calibration]  # in each pass (calibrating, then propagating)
        assert seen and len(seen) % len(given) == 0 and seen == given * (len(seen) // len(given))
    a, b = (c.state_dict() for c in copies)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_calibration_windows_default_is_not_the_eval_text(tmp_path):
    from test_check import byte_tokenizer

    from normswap.check.text import default_text
    from normswap.evaluate import calibration_windows

    tok, full = byte_tokenizer(), default_text()
    windows = calibration_windows(tok, None, 3, 8, eval_chars=1000)
    assert [w.shape for w in windows] == [(1, 8)] * 3
    assert torch.cat(windows, 1)[0].tolist() == tok(full)["input_ids"][-24:]  # the end of pydoc topics
    with pytest.raises(normswap.NormswapError, match="would overlap the evaluation text; pass --calibration"):
        calibration_windows(tok, None, 3, 8, eval_chars=len(full))
    text = tmp_path / "c.txt"
    text.write_text("calibrate on this text, please")
    first = calibration_windows(tok, text, 2, 5, eval_chars=None)
    assert torch.cat(first, 1)[0].tolist() == tok("calibrate on this text, please")["input_ids"][:10]
    with pytest.raises(normswap.NormswapError, match="fewer than the 4 x 10 asked for"):
        calibration_windows(tok, text, 4, 10, eval_chars=None)

"""The checker: metrics against float64 references, the tolerance policy, localization, lean mode, CLI.

Conversions here are done by hand (``manual_fold``: float64 products written back in the model's dtype),
independent of normswap's own fold, so a checker bug cannot hide behind a matching fold bug.
Tolerances: a correct float32 fold of these tiny models moves logits by ~1e-7 (measured 2e-7); folding
Gemma's (1+w) as w moves them by ~0.5. Metrics are compared with a direct float64 computation to 1e-9
relative (both sides compute in float64; only summation order differs).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_model

from normswap.check import check, compare, default_input_ids, default_text, reference_outputs, upcast
from normswap.check.metrics import logit_metrics, next_token_targets, summarize_logits
from normswap.check.policy import default_tolerance, judge
from normswap.sites import Consumer, NormSite
from normswap.stream.records import DiskRecords


# ---------------------------------------------------------------- helpers (also used by test_evaluate)
def decoder_sites(model) -> list[NormSite]:
    """NormSite records of a Llama/Gemma-style decoder, consumers named by hand (not by the walk)."""
    cfg = model.config
    offset = 1.0 if cfg.model_type.startswith("gemma") else 0.0

    def site(name, consumers):
        ops = [Consumer(c, f"{c}.weight", "linear", 1) for c in consumers]
        return NormSite(name, "rmsnorm", offset, cfg.rms_norm_eps, "weight", None, (cfg.hidden_size,),
                        "llama", "float32", ops, foldable=True)  # fmt: skip

    sites = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        sites.append(site(f"{p}.input_layernorm", [f"{p}.self_attn.{x}_proj" for x in "qkv"]))
        sites.append(site(f"{p}.post_attention_layernorm", [f"{p}.mlp.{x}_proj" for x in ("gate", "up")]))
    sites.append(site("model.norm", ["lm_head"]))
    return sites


@torch.no_grad()
def manual_fold(model, sites, *, ignore_offset_at=()) -> None:
    """Fold each site's scale (offset + w) into its consumers in float64; the norm keeps its identity.

    Sites named in ``ignore_offset_at`` are folded wrongly, with ``w`` instead of ``offset + w``.
    """
    modules = dict(model.named_modules())
    if model.lm_head.weight is model.get_input_embeddings().weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    for s in sites:
        w = modules[s.name].weight
        scale = w.double() + (0.0 if s.name in ignore_offset_at else s.offset)
        for c in s.consumers:
            weight = modules[c.module].weight
            weight.copy_((weight.double() * scale).to(weight.dtype))
        w.fill_(1.0 - s.offset)
        s.act("fold", folded=True)
        s.act("swap", swapped=True)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ``<eos>``), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def save_pair(tmp_path, model_type="llama", ignore_offset_at=()):
    """Save a tiny model (vocab 260, byte tokenizer) and a hand-folded copy; return both directories."""
    model = make_tiny_model(model_type, vocab_size=260, tie_word_embeddings=False)
    tok = byte_tokenizer()
    orig, conv = tmp_path / "orig", tmp_path / "conv"
    model.save_pretrained(orig)
    tok.save_pretrained(orig)
    manual_fold(model, decoder_sites(model), ignore_offset_at=ignore_offset_at)
    model.save_pretrained(conv)
    tok.save_pretrained(conv)
    return orig, conv


def fp64_reference(original, converted, input_ids):
    """KL(original || converted) per token, perplexities and top-1 agreement from float64 copies."""
    la, lb = (copy.deepcopy(m).double()(input_ids=input_ids).logits.reshape(-1, m.config.vocab_size)
              for m in (original, converted))  # fmt: skip
    pa, pb = la.log_softmax(-1), lb.log_softmax(-1)
    kl = (pa.exp() * (pa - pb)).sum(-1)
    tgt = input_ids[:, 1:].reshape(-1)
    rows = torch.arange(input_ids.shape[1] - 1)
    rows = (rows[None, :] + input_ids.shape[1] * torch.arange(input_ids.shape[0])[:, None]).reshape(-1)
    ppl = [math.exp(-p[rows, tgt].mean().item()) for p in (pa, pb)]
    return {"kl": kl, "ppl": ppl, "top1": (la.argmax(-1) == lb.argmax(-1)).double().mean().item()}


# ---------------------------------------------------------------- default text
def test_default_input_ids_is_deterministic_real_text():
    tok = byte_tokenizer()
    ids = default_input_ids(tok, 300)
    assert ids.shape == (1, 300) and ids.dtype == torch.long
    assert torch.equal(ids, default_input_ids(tok, 300))
    assert tok.decode(ids[0]) == default_text()[:300]  # byte tokens: one token per ASCII character
    with pytest.raises(ValueError, match="at least 2"):
        default_input_ids(tok, 1)


# ---------------------------------------------------------------- metrics
def test_logit_metrics_match_float64_reference():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(40, 300, generator=gen) * 4
    b = a + 0.3 * torch.randn(40, 300, generator=gen)
    ids = torch.randint(0, 300, (2, 20), generator=gen)
    targets = next_token_targets(ids)
    m = logit_metrics(a, b, targets)
    pa, pb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    kl = (pa.exp() * (pa - pb)).sum(-1)
    assert m["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-9)
    assert m["kl_max"] == pytest.approx(kl.max().item(), rel=1e-9)
    assert m["max_abs"] == pytest.approx((a - b).abs().max().item(), rel=1e-12)
    assert m["top1"] == (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    overlap = [
        len(set(x.topk(5).indices.tolist()) & set(y.topk(5).indices.tolist())) / 5
        for x, y in zip(a, b, strict=True)
    ]
    assert m["top5"] == pytest.approx(sum(overlap) / len(overlap), rel=1e-12)
    has = targets >= 0
    assert m["n_targets"] == 38
    assert m["nll_ref"] == pytest.approx(-pa[has, targets[has]].sum().item(), rel=1e-12)


def test_summary_reference_gives_same_top1_ppl_and_kl_lower_bound():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(24, 500, generator=gen) * 3
    b = a + 0.2 * torch.randn(24, 500, generator=gen)
    targets = next_token_targets(torch.randint(0, 500, (1, 24), generator=gen))
    exact = logit_metrics(a, b, targets)
    lean = logit_metrics(summarize_logits(a, targets, k=16), b, targets)
    assert not lean["exact"] and exact["exact"]
    for key in ("top1", "nll_ref", "nll_conv", "n_targets"):
        assert lean[key] == pytest.approx(exact[key], rel=1e-12)
    # coarse-grained KL (top-16 + the rest) is a lower bound of the true KL (data-processing inequality)
    assert 0 < lean["kl_mean"] <= exact["kl_mean"]
    assert lean["max_abs"] <= exact["max_abs"]
    # with every token kept the summary is exact
    full = logit_metrics(summarize_logits(a, targets, k=500), b, targets)
    assert full["kl_mean"] == pytest.approx(exact["kl_mean"], rel=1e-9)


def test_top1_flip_allowed_only_at_near_ties():
    a = torch.tensor([[1.0, 1.00001, -5.0], [3.0, 0.0, 0.0]])
    tol = default_tolerance("float32")
    b = a.clone()
    b[0, 0] += 2e-5  # flips row 0, whose top-2 margin 1e-5 is below 2 x the 2e-4 tolerance: a near-tie
    m = logit_metrics(a, b, torch.tensor([-1, -1]))
    assert m["top1"] == 0.5 and m["flip_margins"] == [pytest.approx(1e-5, rel=1e-2)]  # float32 spacing at 1.0
    assert judge(m, tol, None) == []
    b = a.clone()
    b[1, 1] += 3.5  # flips row 1 at margin 3: fails top-1 (and max abs)
    failures = judge(logit_metrics(a, b, torch.tensor([-1, -1])), tol, None)
    assert any("top-1" in f for f in failures) and any("max abs" in f for f in failures)


# ---------------------------------------------------------------- float32 checks on tiny models
@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_correct_manual_fold_passes(model_type, input_ids):
    original = make_tiny_model(model_type, tie_word_embeddings=False)
    converted = copy.deepcopy(original)
    sites = decoder_sites(converted)
    manual_fold(converted, sites)
    result = check(original, converted, input_ids, sites=sites, greedy_tokens=4)
    assert result.passed, result.summary()
    assert result.max_abs_logit_diff < 1e-5 and result.top1_agreement == 1.0
    assert result.divergence is None and result.greedy_agreement == 1.0
    ref = fp64_reference(original, converted, input_ids)
    assert result.kl_max < 1e-9 and ref["kl"].max().item() < 1e-9
    assert result.ppl_original == pytest.approx(ref["ppl"][0], rel=1e-6)  # float32 forward vs float64
    json.dumps(result.to_dict())
    assert result.peak_rss_mib > 0 and result.reference_mib > 0


@pytest.mark.parametrize("records", [None, DiskRecords], ids=["in-memory", "on-disk"])
@pytest.mark.parametrize(
    "bad_site", ["model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm"]
)
def test_gemma_offset_ignored_fails_and_is_localized(bad_site, records, input_ids):
    """Also with the localization records in a temporary file (``DiskRecords``, the streamed path's)."""
    original = make_tiny_model("gemma", tie_word_embeddings=False)
    converted = copy.deepcopy(original)
    sites = decoder_sites(converted)
    reference = reference_outputs(original, input_ids, sites=sites, records=records)
    manual_fold(converted, sites, ignore_offset_at={bad_site})
    result = compare(reference, converted, input_ids, sites=sites, records=records)
    if records is not None:
        assert isinstance(reference.captures, DiskRecords) and len(reference.captures) > 0
    assert not result.passed
    assert result.max_abs_logit_diff > 1e-2  # measured ~0.5
    ref = fp64_reference(original, converted, input_ids)
    assert result.kl_mean == pytest.approx(ref["kl"].mean().item(), rel=1e-3)
    div = result.divergence
    assert div["site"] == bad_site and div["role"] == "consumer output"
    assert div["layer"] == int(re.search(r"\.(\d+)\.", bad_site).group(1))
    assert div["action"] == "folded into its consumers and swapped"
    assert div["point"].split(":")[0] in div["consumers"]
    assert bad_site in result.summary()


def test_localization_with_names_only_points_upstream(input_ids):
    original = make_tiny_model("gemma", tie_word_embeddings=False)
    converted = copy.deepcopy(original)
    sites = decoder_sites(converted)
    names = [s.name for s in sites]
    reference = reference_outputs(original, input_ids, sites=names)
    manual_fold(converted, sites, ignore_offset_at={"model.layers.0.post_attention_layernorm"})
    div = compare(reference, converted).divergence
    # the MLP of layer 0 is wrong, so the next norm input (layer 1's input_layernorm) differs first
    # without consumers the MLP output is not probed: layer 0's output is the first point that differs,
    # right after the broken norm's input still matched
    assert div["point"] == "model.layers.0:output" and div["role"] == "layer output"
    assert div["last_match"] == "model.layers.0.post_attention_layernorm:input#0"
    assert div["suspect"] == "model.layers.0.post_attention_layernorm"


def test_lean_summary_reference_judges_like_full(input_ids):
    original = make_tiny_model("llama", tie_word_embeddings=False)
    converted = copy.deepcopy(original)
    manual_fold(converted, decoder_sites(converted))
    full = compare(reference_outputs(original, input_ids), converted)
    lean = compare(reference_outputs(original, input_ids, max_logits_bytes=0), converted)
    assert full.exact and not lean.exact and full.passed and lean.passed
    assert lean.ppl_original == pytest.approx(full.ppl_original, rel=1e-12)
    assert lean.top1_agreement == full.top1_agreement


def test_compare_rejects_other_input_ids(input_ids):
    model = make_tiny_model("llama")
    reference = reference_outputs(model, input_ids)
    with pytest.raises(ValueError, match="input_ids differ"):
        compare(reference, model, input_ids.flip(1))
    with pytest.raises(ValueError, match="integer tensor"):
        reference_outputs(model, input_ids.float())


def test_encoder_compares_last_hidden_state(input_ids):
    original = make_tiny_model("bert")
    same = copy.deepcopy(original)
    result = check(original, same, input_ids)
    assert result.output == "last_hidden_state" and result.passed and result.max_abs_logit_diff == 0.0
    assert result.kl_mean is None and result.ppl_original is None
    broken = copy.deepcopy(original)
    with torch.no_grad():
        broken.encoder.layer[1].output.LayerNorm.bias.add_(1e-2)
    result = check(original, broken, input_ids)
    assert not result.passed and result.max_abs_logit_diff == pytest.approx(1e-2, rel=1e-3)


# ---------------------------------------------------------------- half precision
def test_forward_of_a_model_returning_a_plain_tensor_keeps_every_row():
    """A model whose forward returns the logits tensor itself: the check compares all B x T rows (it used to
    index the tensor like a tuple and compare batch row 0 only)."""
    from normswap.check.core import _forward
    from normswap.zoo import CustomLM

    model = CustomLM().eval()
    ids = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        kind, out = _forward(model, ids)
        want = model(ids).reshape(-1, 128)
    # an output without a name is judged as hidden states (normswap.check.policy)
    assert kind == "last_hidden_state" and out.shape == (24, 128) and torch.equal(out, want)


def test_upcast_restores_mixed_dtypes_bit_exactly():
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    model.model.norm.weight.data = model.model.norm.weight.data.float()  # a float32 norm in a bf16 model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with upcast(model):
        assert all(p.dtype == torch.float32 for p in model.parameters())
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_policy(dtype, input_ids):
    original = make_tiny_model("gemma", dtype=dtype, tie_word_embeddings=False)
    good, bad = copy.deepcopy(original), copy.deepcopy(original)
    manual_fold(good, decoder_sites(good))
    bad_sites = decoder_sites(bad)
    manual_fold(bad, bad_sites, ignore_offset_at={"model.layers.1.input_layernorm"})
    reference = reference_outputs(original, input_ids, sites=bad_sites)
    ok = compare(reference, good)
    assert ok.passed, ok.summary()
    assert ok.half_precision["original"]["max_abs"] > 0  # the original's own rounding error is measured
    assert ok.divergence is None
    broken = compare(reference, bad, sites=bad_sites)
    assert not broken.passed and broken.divergence["site"] == "model.layers.1.input_layernorm"
    tol = default_tolerance(dtype)
    orig_err, conv_err = broken.half_precision["original"], broken.half_precision["converted"]
    assert conv_err["max_abs"] > tol["k"] * orig_err["max_abs"] + tol["abs"]


def test_judge_half_rule():
    tol = {"k": 2.0, "abs": 0.05, "kl_abs": 1e-4}
    orig = {"max_abs": 0.5, "kl_mean": 1e-3}
    assert judge({}, tol, {"original": orig, "converted": {"max_abs": 1.04, "kl_mean": 2.0e-3}}) == []
    failures = judge({}, tol, {"original": orig, "converted": {"max_abs": 1.06, "kl_mean": 2.2e-3}})
    assert len(failures) == 2 and "max abs" in failures[0] and "KL" in failures[1]
    with pytest.raises(ValueError, match="no tolerance policy"):
        default_tolerance(torch.int8)


# ---------------------------------------------------------------- normswap check A B
def test_cli_check_exit_codes(tmp_path):
    from normswap.cli import main

    env = {"HF_HUB_OFFLINE": "1"}
    runner = CliRunner()
    orig, conv = save_pair(tmp_path / "good")
    result = runner.invoke(main, ["check", str(orig), str(conv), "--tokens", "64", "--report",
                                  str(tmp_path / "r.json")], env=env)  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["tokens"] == 64 and report["max_abs_logit_diff"] < 1e-5
    orig, bad = save_pair(tmp_path / "bad", "gemma", ignore_offset_at={"model.layers.1.input_layernorm"})
    result = runner.invoke(main, ["check", str(orig), str(bad), "--tokens", "64"], env=env)
    assert result.exit_code == 1 and "FAIL" in result.output
    # with a manifest (sites folded, not swapped: plain modules load), the failing site is named
    sites = [
        {**s.to_dict(), "folded": True, "swapped": False} for s in decoder_sites(make_tiny_model("gemma"))
    ]
    (bad / "normswap.json").write_text(json.dumps({"sites": sites}))
    result = runner.invoke(main, ["check", str(orig), str(bad), "--tokens", "64"], env=env)
    assert result.exit_code == 1
    assert "of norm model.layers.1.input_layernorm differs; model.layers.1.input_layernorm was folded" in (
        result.output
    )
    result = runner.invoke(main, ["check", str(orig), str(tmp_path / "missing")], env=env)
    assert result.exit_code == 2 and "missing" in result.output
    assert os.listdir(tmp_path / "bad" / "orig")  # inputs untouched


def test_cli_check_zero_tolerance_and_different_models(tmp_path):
    """``--max-abs 0`` is a tolerance, not "unset"; two different models are bad input, not a traceback."""
    from normswap.cli import main

    env = {"HF_HUB_OFFLINE": "1"}
    runner = CliRunner()
    orig, conv = save_pair(tmp_path / "good")
    result = runner.invoke(main, ["check", str(orig), str(conv), "--tokens", "64", "--max-abs", "0"], env=env)
    assert result.exit_code == 1 and "FAIL" in result.output  # a fold moves logits by ~1e-7, not 0
    assert runner.invoke(main, ["check", str(orig), str(conv), "--max-abs", "-1"], env=env).exit_code == 2
    _, bad = save_pair(tmp_path / "other", "gemma", ignore_offset_at=set())
    sites = [
        {**s.to_dict(), "folded": True, "swapped": False} for s in decoder_sites(make_tiny_model("gemma"))
    ]
    (bad / "normswap.json").write_text(json.dumps({"sites": sites}))
    gpt2 = tmp_path / "gpt2"
    make_tiny_model("gpt2", vocab_size=260).save_pretrained(gpt2)
    byte_tokenizer().save_pretrained(gpt2)
    result = runner.invoke(main, ["check", str(gpt2), str(bad), "--tokens", "64"], env=env)
    assert result.exit_code == 2, result.output
    assert "are different models: model_type gpt2 vs gemma" in result.output


# ---------------------------------------------------------------- a converted folder lacking what it names
def _converted_gpt2(tmp_path, *args):
    """A tiny GPT-2 (vocab 260, byte tokenizer) and its ``normswap convert`` output with ``args``."""
    from normswap.cli import main

    orig, out = tmp_path / "orig", tmp_path / "out"
    make_tiny_model("gpt2", vocab_size=260).save_pretrained(orig)
    byte_tokenizer().save_pretrained(orig)
    result = CliRunner().invoke(main, ["convert", str(orig), "-o", str(out), "--tokens", "32", *args])
    assert result.exit_code == 0, result.output
    return orig, out


@pytest.fixture(scope="module")
def rotated_gpt2(tmp_path_factory):
    """``_converted_gpt2`` with ``--rotate hadamard --rotate-heads``, once for the module (copy it to change
    it)."""
    return _converted_gpt2(tmp_path_factory.mktemp("rotated"), "--rotate", "hadamard", "--rotate-heads")


def _check(orig, conv, report):
    from normswap.cli import main

    args = ["check", str(orig), str(conv), "--tokens", "32", "--report", str(report)]
    return CliRunner().invoke(main, args, env={"HF_HUB_OFFLINE": "1"})


def _damage_q(folder, how):
    import shutil

    from safetensors.torch import load_file, save_file

    path = folder / "normswap" / "rotation.safetensors"
    if how == "folder missing":
        shutil.rmtree(folder / "normswap")
        return
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
        return
    q = load_file(str(path))["Q"]
    q = q[:32, :32].contiguous() if how == "wrong shape" else q.clone().index_fill_(0, torch.tensor([0]), 0.5)
    save_file({"Q": q}, str(path))


@pytest.mark.parametrize(
    "how, says",
    [
        ("folder missing", "normswap/rotation.safetensors is missing (a copy without its normswap/ folder?)"),
        ("wrong shape", "normswap/rotation.safetensors holds a Q of shape (32, 32), not 64 x 64"),
        (
            "changed",
            "normswap/rotation.safetensors holds another Q than the one recorded (its SHA-256 differs",
        ),
        ("truncated", "normswap/rotation.safetensors cannot be read ("),
    ],
)
def test_check_of_a_rotated_copy_without_its_q(rotated_gpt2, tmp_path, how, says):
    """A rotated output whose Q is gone (copied without its ``normswap/`` folder), of another shape, not the
    recorded one, or unreadable: the stream cannot be compared (the check used to compare the rotated
    stream with the original's and fail "by the localization" in the embeddings, while the logits differ by
    3e-7). One warning line names the file and what is wrong; the stream's records are left out; the logits
    decide: PASS, exit 0 (docs/CHECKING.md). With a layer-1 weight changed by 5% the logits still fail it."""
    import shutil

    from safetensors.torch import load_file, save_file

    orig, out = rotated_gpt2[0], tmp_path / "copy"
    shutil.copytree(rotated_gpt2[1], out)
    _damage_q(out, how)
    result = _check(orig, out, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("  warning: ")]
    assert "check PASS" in result.output and any(says in w and "the logits decide" in w for w in warnings)
    assert ("normswap/inputs_embeds.json is missing" in result.output) is (how == "folder missing")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["divergence"] is None and report["max_abs_logit_diff"] <= 1e-5
    assert report["transform"]["unavailable"] and len(report["warnings"]) == len(warnings)
    hidden = [e for e in report["contract"] if e["output"].startswith("hidden_states")]
    assert hidden and all(
        e["status"] == "changed by design" and "not compared" in e["reason"] for e in hidden
    )
    weights = load_file(str(out / "model.safetensors"))
    weights["transformer.h.1.mlp.c_fc.weight"] *= 1.05
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    result = _check(orig, out, tmp_path / "r.json")
    assert result.exit_code == 1 and "check FAIL" in result.output, result.output


def test_check_of_a_centered_copy_without_centering_json(tmp_path):
    """The check does not need ``centering.json`` (centering's map of the stream is the mean over the
    hidden axis, which normswap.json records): PASS with no divergence, exit 0, and one warning line that
    it is missing (vectors given as inputs_embeds need it)."""
    orig, out = _converted_gpt2(tmp_path, "--norm", "rmsnorm")
    (out / "centering.json").unlink()
    result = _check(orig, out, tmp_path / "r.json")
    assert result.exit_code == 0 and "check PASS" in result.output, result.output
    [warning] = [line for line in result.output.splitlines() if line.startswith("  warning: ")]
    assert "centering.json is missing" in warning and "inputs_embeds must be mapped with it" in warning
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["divergence"] is None and report["transform"]["unavailable"] is None


def test_saved_q_without_a_recorded_digest_must_be_orthogonal(tmp_path):
    """A manifest written without the matrices' SHA-256: Q is accepted when orthogonal, refused otherwise."""
    from safetensors.torch import save_file

    from normswap.convert import saved_q

    rotation = {"file": "normswap/rotation.safetensors", "matrices": {"Q": {"size": 8}}}
    (tmp_path / "normswap").mkdir()
    q = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    q = q.contiguous()
    save_file({"Q": q}, str(tmp_path / "normswap" / "rotation.safetensors"))
    got, why = saved_q(rotation, tmp_path)
    assert why is None and torch.equal(got, q)
    save_file({"Q": q * 1.001}, str(tmp_path / "normswap" / "rotation.safetensors"))
    got, why = saved_q(rotation, tmp_path)
    assert (
        got is None
        and why == "normswap/rotation.safetensors holds a Q that is not orthogonal (changed or corrupt)"
    )

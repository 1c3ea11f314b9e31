"""``rotate="learned"`` (``normswap.rotate.learn``): ``Q = Q0 R`` with ``R`` trained for a fake quantizer.

Every learned ``Q`` is checked as any rotation is: orthogonal in float64, the converted model's logits the
original's and its hidden states the original's (centered, for a LayerNorm model) times ``Q``, computed
here from the unconverted model. The learning itself is checked against its own definition: the proxy it
trains computes the rotated model's function for any orthogonal ``R`` (compared with the rotated model's
forward), the loss it reports is the fake-quantized model's (recomputed with ``normswap.quantize``), and a
few steps lower it on the batch they train on.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_rotated, assert_smollm2_rotated, hidden_outputs, make_tiny_model

import normswap
from normswap.config import ConvertOptions, OptionError
from normswap.quantize import quantized
from normswap.rotate import learn

TOL = 1e-5  # float32 logits and hidden states of a tiny model (entries ~1): rounding of a few hundred terms
ORTHO = 1e-12  # float64 rounding of Q Qᵀ for n = 64


def _calibration(n: int = 4, length: int = 16, seed: int = 7) -> list[torch.Tensor]:
    ids = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))
    return list(ids.split(1))


FEW = learn.Settings(target="w4a4", steps=3, batch=2, length=16, samples=4, lr=1e-2)


def _learned(model, ids, heads=False, settings=FEW):
    return normswap.convert(model, rotate="learned", rotate_heads=heads, rotate_learn=settings,
                            rotate_calibration=_calibration(), input_ids=ids)  # fmt: skip


@pytest.mark.parametrize("name,heads,centered", [("llama", True, False), ("gpt2", False, True)])
def test_learned_q_is_orthogonal_and_keeps_the_function(input_ids, name, heads, centered):
    model = make_tiny_model(name, vocab_size=128)
    original = copy.deepcopy(model)
    report = _learned(model, input_ids, heads)
    rotation = report.rotation
    q = rotation.Q
    eye = torch.eye(q.shape[0], dtype=torch.float64)
    assert (q @ q.T - eye).abs().max().item() <= ORTHO
    assert rotation.kind == "learned" and rotation.matrices["Q"].kind == "learned"
    assert "learned Q0 R" in rotation.matrices["Q"].description
    hadamard = normswap.convert(
        copy.deepcopy(original), rotate="hadamard", rotate_heads=heads, input_ids=input_ids
    )
    assert (q - hadamard.rotation.Q).abs().max().item() > 1e-3  # R moved Q away from Q0
    if heads:  # H stays the randomized Hadamard one of the seed
        assert torch.equal(rotation.matrices["H"].values, hadamard.rotation.matrices["H"].values)
    if centered:  # a LayerNorm stream: Q 1 = 1 kept through the learning
        ones = torch.ones(q.shape[0], dtype=torch.float64)
        assert (q @ ones - ones).abs().max().item() <= ORTHO and rotation.matrices["Q"].keeps_ones
    assert_rotated(hidden_outputs(original, input_ids), hidden_outputs(model, input_ids), q, centered, TOL)
    entry = rotation.to_dict()["learned"]
    assert entry["steps"] == 3 and entry["target"] == "w4a4" and len(entry["losses"]) == 3


def test_learning_is_deterministic_for_a_seed(input_ids):
    first = _learned(make_tiny_model("llama", vocab_size=128), input_ids).rotation
    second = _learned(make_tiny_model("llama", vocab_size=128), input_ids).rotation
    assert torch.equal(first.Q, second.Q)
    assert first.learned["losses"] == second.learned["losses"]


@pytest.mark.parametrize("name,heads", [("llama", True), ("gpt2", True), ("qwen2", False), ("opt", False)])
def test_the_proxy_computes_the_rotated_models_function(input_ids, name, heads):
    """For a random orthogonal R (Q 1 = 1 kept for a LayerNorm stream), the proxy's float logits equal the
    Q0-rotated model's: every use of a tensor that holds Q is seen (linear maps, Conv1D's addmm, tables)."""
    model = make_tiny_model(name, vocab_size=128)
    report = normswap.convert(model, rotate="hadamard", rotate_heads=heads, input_ids=input_ids)
    keep = report.rotation.matrices["Q"].keeps_ones
    assert learn.proxy_error(model, report.rotation.tensors, input_ids, seed=3, keep_ones=keep) <= TOL


def test_the_loss_is_the_fake_quantized_models_and_a_few_steps_lower_it(input_ids):
    """The step-0 loss is the Q0 model's next-token loss under normswap.quantize's a4 (R = I); twenty steps
    on one batch lower the loss on that batch, recomputed here from the learned R. The tiny model gets an
    outlier feature in its stream (one embedding column x20, as real models have a few) and sharper logits
    (lm_head x10), so that 4-bit per-token activations cost it something a rotation can win back."""
    model = make_tiny_model("llama", vocab_size=128)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        model.model.embed_tokens.weight[:, 3].mul_(20.0)
    report = normswap.convert(model, rotate="hadamard", input_ids=input_ids)
    batch = _calibration(2, 32)
    ids = torch.cat(batch)
    with torch.no_grad(), quantized(model, "a4"):
        logits = model(input_ids=ids, use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    settings = learn.Settings(target="a4", steps=20, batch=2, length=32, samples=2, lr=1e-2)
    done = learn.learn(model, report.rotation.tensors, batch, settings)
    assert abs(done.losses[0] - expected.item()) <= 1e-5 * expected.item()
    proxy = learn.Proxy(model, report.rotation.tensors, settings.scheme)
    proxy.begin(done.r.float())
    with torch.no_grad(), proxy:
        after = learn._loss(model, ids).item()
    assert abs(after - done.final_loss) <= 1e-4 * after  # the reported loss is the learned R's
    assert after < done.losses[0] - 0.02, (done.losses[0], after)  # measured: 6.82 -> 6.74


def test_orthogonalize_and_cayley():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(32, 32, generator=gen, dtype=torch.float64)
    for keep in (False, True):
        r = learn.cayley(p, keep)
        assert (r @ r.T - torch.eye(32, dtype=torch.float64)).abs().max().item() <= ORTHO
        if keep:
            ones = torch.ones(32, dtype=torch.float64)
            assert (r @ ones - ones).abs().max().item() <= ORTHO
    near = learn.cayley(p) + 1e-6 * torch.randn(32, 32, generator=gen, dtype=torch.float64)
    fixed = learn.orthogonalize(near)
    assert (fixed @ fixed.T - torch.eye(32, dtype=torch.float64)).abs().max().item() <= ORTHO
    assert (fixed - near).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(rotate_steps=3), "need rotate='learned'"),
        (dict(rotate="hadamard", rotate_target="a4"), "need rotate='learned'"),
        (dict(rotate="learned", max_memory="1GB"), "cannot stream"),
        (dict(rotate="learned", rotate_target="w8a8"), "rotate_target must be one of"),
        (dict(rotate="learned", rotate_samples=1, rotate_batch=2), "at least rotate_batch"),
        (dict(rotate="learned", rotate_lr=-1.0), "rotate_lr must be a positive number"),
        (dict(rotate="learned", rotate_steps=0), "rotate_steps must be an integer of at least 1"),
    ],
)
def test_option_refusals(options, match):
    with pytest.raises(OptionError, match=match):
        ConvertOptions(**options)


def test_api_refusals_change_nothing(input_ids):
    model = make_tiny_model("llama", vocab_size=128)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="needs calibration token ids"):
        normswap.convert(model, rotate="learned", input_ids=input_ids)
    with pytest.raises(ValueError, match="fewer than rotate_length=16"):
        normswap.convert(model, rotate="learned", rotate_learn=FEW, rotate_calibration=_calibration(4, 8),
                         input_ids=input_ids)  # fmt: skip
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_cli_refuses_in_one_line(tmp_path):
    from normswap.cli import main

    src, out = tmp_path / "src", tmp_path / "out"
    make_tiny_model("llama", vocab_size=128).save_pretrained(src)
    usage = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--rotate-steps", "3"])
    assert (
        usage.exit_code == 2 and "--rotate-steps" in usage.output and "need --rotate learned" in usage.output
    )
    no_text = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--rotate", "learned"])
    assert no_text.exit_code == 2 and no_text.output.count("\n") == 1 and "tokenizer" in no_text.output
    assert not out.exists()


@pytest.mark.real
@pytest.mark.slow  # about 20 minutes on 2 cores; the tiny models above cover the kind in the default run
def test_smollm2_learned_command(tmp_path):
    """The acceptance command: passes the check and the verification, loads in plain transformers, hidden
    states the original's times the saved Q."""
    from safetensors.torch import load_file

    from normswap.cli import main
    from normswap.rotate import ROTATION_FILE

    out, report = tmp_path / "out", tmp_path / "r.json"
    result = CliRunner().invoke(
        main, ["convert", "smollm2-135m", "--rotate", "learned", "-o", str(out), "--report", str(report)]
    )
    if result.exit_code == 2 and "cannot fetch" in result.output:
        pytest.skip(result.output.strip())
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["check"]["passed"] and data["verify"]["passed"] and data["rotation"]["kind"] == "learned"
    q = load_file(str(out / ROTATION_FILE))["Q"]
    assert (q @ q.T - torch.eye(q.shape[0], dtype=torch.float64)).abs().max().item() <= 1e-12
    assert_smollm2_rotated(out, q)

"""BatchNorm in eval mode and affine-only norms: found by behaviour, folded where exact, refused otherwise.

Every model here has its per-channel maps re-randomized (running mean U(-0.5, 0.5), running variance
1 + U(-0.5, 0.5), weight 1 + U(-0.5, 0.5), bias U(-0.5, 0.5)): at their initial values (0, 1, 1, 0) a
BatchNorm is almost the identity and hides every fold error. Outputs are compared with the unconverted
deepcopy; tolerance 1e-5 (float32, outputs of size ~1): a correct fold moves them by rounding only
(measured 1e-7 .. 2e-6 here), a wrong axis, channel map or shift moves them by 1e-2 or more.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.affine import probe_affine
from normswap.sites import NormSite
from normswap.zoo import randomize_constants, tiny_model

TOL = 1e-5


@torch.no_grad()
def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every BatchNorm / hand-written per-channel module of ``model`` moved away from its identity, by class
    (not through normswap, so a module normswap misses still computes a non-identity map)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if not isinstance(module, _PerChannel) or not t.is_floating_point():
                continue
            base = 1.0 if name in ("weight", "running_var", "g", "v") else 0.0
            t.copy_(base + torch.rand(t.shape, generator=gen, dtype=torch.float64) - 0.5)
    return model


class Gauge(nn.Module):
    """A frozen BatchNorm written by hand, with buffers named so that the names say nothing."""

    def __init__(self, channels: int):
        super().__init__()
        for name in ("g", "h", "m", "v"):
            self.register_buffer(name, torch.zeros(channels))

    def forward(self, x):
        scale = self.g * torch.rsqrt(self.v + 1e-3)
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return x * scale.view(shape) + (self.h - self.m * scale).view(shape)


_PerChannel = (nn.BatchNorm1d, nn.BatchNorm2d, Gauge)


def _convert(model: nn.Module, x: torch.Tensor, x_check: torch.Tensor, **options):
    reference = copy.deepcopy(model)
    report = normswap.convert(model, example_inputs=(x,), **options)
    with torch.no_grad():
        diff = (reference(x_check) - model(x_check)).abs().max().item()
    return report, {s.name: s for s in report.sites}, diff


# -- probing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, shape, kind, axis, eps",
    [
        (nn.BatchNorm1d(8), (2, 8, 5), "batchnorm", 1, 1e-5),
        (nn.BatchNorm1d(8), (4, 8), "batchnorm", 1, 1e-5),
        (nn.BatchNorm2d(6, eps=1e-3), (2, 6, 4, 4), "batchnorm", 1, 1e-3),
        (nn.BatchNorm1d(8, affine=False), (2, 8, 5), "batchnorm", 1, 1e-5),
        (Gauge(6), (2, 6, 3, 3), "batchnorm", 1, 1e-3),
        (nn.BatchNorm1d(8), (8, 8, 8), "batchnorm", 1, 1e-5),  # every axis as long as the channels
    ],
)
def test_probe_finds_a_batchnorm_by_behaviour(module, shape, kind, axis, eps):
    _randomize(module).eval()
    site = probe_affine(module, shape, "m")
    assert site is not None and (site.kind, site.axis) == (kind, axis)
    assert site.eps == pytest.approx(eps, rel=1e-3)
    roles = {"weight": site.weight, "bias": site.bias, "mean": site.mean, "var": site.var}
    affine = not isinstance(module, nn.BatchNorm1d) or module.affine
    assert {r for r, attr in roles.items() if attr} == {"mean", "var"} | (
        {"weight", "bias"} if affine else set()
    )
    if isinstance(module, Gauge):
        assert roles == {"weight": "g", "bias": "h", "mean": "m", "var": "v"}
    assert site.swappable is False and site.stats["input_shape"] == list(shape)


def test_probe_finds_nonorm_and_rejects_what_is_not_a_fixed_per_channel_map():
    from transformers.models.mobilebert.modeling_mobilebert import NoNorm

    nonorm = NoNorm(8)
    with torch.no_grad():
        nonorm.weight.uniform_(0.5, 1.5), nonorm.bias.uniform_(-0.5, 0.5)
    site = probe_affine(nonorm, (2, 5, 8), "n")
    assert (site.kind, site.axis, site.weight, site.bias, site.mean, site.var) == (
        "affine",
        2,
        "weight",
        "bias",
        None,
        None,
    )
    batch_stats = nn.BatchNorm1d(8, track_running_stats=False).eval()  # normalizes by the batch even in eval
    for module, shape in ((batch_stats, (2, 8, 5)), (nn.PReLU(8), (2, 5, 8)), (nn.LayerNorm(8), (2, 5, 8))):
        assert probe_affine(module, shape, "x") is None


# -- folding ------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """conv -> BN (producer fold); BN -> 1x1 conv (consumer fold); BN -> zero-padded depthwise conv (consumer
    refused, producer used); BN -> reflect-padded depthwise conv (consumer, shift exact); BN -> grouped
    conv."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(c)
        self.bn1 = nn.BatchNorm2d(c)
        self.point = nn.Conv2d(c, 2 * c, 1)
        self.pre = nn.Conv2d(2 * c, c, 1)
        self.bn2 = nn.BatchNorm2d(c)
        self.depth = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.bn3 = nn.BatchNorm2d(c)
        self.reflect = nn.Conv2d(c, 2 * c, 3, padding=1, groups=c, padding_mode="reflect")
        self.bn4 = Gauge(2 * c)
        self.grouped = nn.Conv2d(2 * c, c, 1, groups=4)

    def forward(self, x):
        x = torch.relu(self.bn0(self.stem(x)))
        x = torch.relu(self.point(self.bn1(x)))
        x = torch.relu(self.depth(self.bn2(self.pre(x))))
        x = torch.relu(self.reflect(self.bn3(x)))
        return self.grouped(self.bn4(x))


def test_batchnorms_fold_into_convolutions_along_their_channels():
    torch.manual_seed(0)
    model = _randomize(ConvNet()).eval()
    report, sites, diff = _convert(model, torch.randn(2, 3, 8, 8), torch.randn(3, 3, 10, 6))
    assert diff < TOL
    assert all(s.folded for s in sites.values()), {n: s.reason for n, s in sites.items()}
    assert sites["bn0"].producer.module == "stem" and not sites["bn0"].consumers  # feeds relu: backwards
    assert sites["bn1"].producer is None and [c.module for c in sites["bn1"].consumers] == ["point"]
    assert (
        sites["bn2"].producer.module == "pre"
    )  # the depthwise conv zero-pads: a shift would miss the border
    assert [c.module for c in sites["bn3"].consumers] == ["reflect"] and sites["bn3"].consumers[0].groups == 8
    assert sites["bn4"].kind == "batchnorm" and sites["bn4"].consumers[0].groups == 4
    assert report.norms_folded == 5 and report.norms_swapped == 0
    for site in report.sites:  # what normswap.json stores reads back as the same record
        assert NormSite.from_dict(json.loads(json.dumps(site.to_dict()))) == site
    x = torch.randn(2, 8, 4, 4)
    assert torch.equal(model.bn1(x), x)  # identity left behind, bit for bit (running var 1 - eps)


def test_producer_fold_matches_the_float64_formula():
    torch.manual_seed(0)
    model = _randomize(nn.Sequential(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6), nn.ReLU())).eval()
    conv, bn = model[0], model[1]
    a = (bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)).detach()
    s = (bn.bias.double() - bn.running_mean.double() * a).detach()
    weight = (conv.weight.double() * a[:, None, None]).float()
    bias = (conv.bias.double() * a + s).float()
    _, sites, diff = _convert(model, torch.randn(2, 4, 9), torch.randn(2, 4, 7))
    assert sites["1"].folded and diff < TOL
    assert torch.equal(conv.weight, weight) and torch.equal(conv.bias, bias)


class Sequence(nn.Module):
    """BatchNorm1d on (B, C, T), read by a Linear after a transpose (channels last: foldable) or over T."""

    def __init__(self, c: int = 8, t: int = 6, over_time: bool = False):
        super().__init__()
        self.over_time = over_time
        self.bn = nn.BatchNorm1d(c)
        self.mix = nn.Linear(t if over_time else c, 5)

    def forward(self, x):
        y = self.bn(x)
        return self.mix(y if self.over_time else y.transpose(1, 2))


def test_a_linear_reading_the_channel_axis_takes_the_fold_one_reading_another_axis_refuses_it():
    torch.manual_seed(0)
    model = _randomize(Sequence()).eval()
    _, sites, diff = _convert(model, torch.randn(2, 8, 6), torch.randn(3, 8, 6))
    assert sites["bn"].folded and sites["bn"].consumers[0].axis == 1 and diff < TOL
    model = _randomize(Sequence(over_time=True)).eval()
    _, sites, diff = _convert(model, torch.randn(2, 8, 6), torch.randn(3, 8, 6))
    assert not sites["bn"].folded and diff == 0
    assert "feeds linear along another axis in mix" in sites["bn"].reason


def test_refusals_name_what_blocks_the_fold():
    torch.manual_seed(0)

    class Shared(nn.Module):  # the conv's output also feeds the residual; the BN feeds a bias-free linear
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.out = nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4), nn.Linear(4, 3, bias=False)

        def forward(self, x):
            h = self.conv(x)
            return self.out((self.bn(h) + h).transpose(1, 2)), self.out(self.bn(h).transpose(1, 2))

    model = _randomize(Shared()).eval()
    sites = {s.name: s for s in normswap.inspect(model, example_inputs=(torch.randn(2, 4, 5),))}
    reason = sites["bn"].reason
    assert not sites["bn"].foldable
    assert "output feeds add" in reason and "it is called 2 times" in reason

    model = _randomize(nn.Sequential(nn.Conv1d(4, 4, 1, bias=False), nn.BatchNorm1d(4), nn.Tanh())).eval()
    model[1].train()
    sites = normswap.inspect(model, example_inputs=(torch.randn(2, 4, 5),))
    assert "training mode" in sites[0].reason and not sites[0].foldable
    model.eval()
    sites = normswap.inspect(model, example_inputs=(torch.randn(2, 4, 5),))
    assert sites[0].reason == "output feeds tanh in 2; producer 0 has no bias to absorb the shift"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_identity_left_behind_returns_the_input_bit_for_bit(dtype):
    """var = fl(1 - eps): in float32 var + eps rounds back to exactly 1; in half precision the variance
    rounds to 1 and x / sqrt(1 + 1e-5) rounds back to x (5e-6 is far below half an ulp)."""
    from normswap.affine_fold import identity_error

    torch.manual_seed(0)
    model = _randomize(nn.Sequential(nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4), nn.ReLU())).eval().to(dtype)
    report = normswap.convert(model, example_inputs=(torch.randn(2, 4, 5, dtype=dtype),))
    assert report.sites[0].folded
    x = torch.randn(3, 4, 7).to(dtype) * 100
    assert torch.equal(model[1](x), x)
    # an eps the module does not use: its identity would be off, and is refused
    wrong = dataclasses.replace(report.sites[0], eps=0.1)
    assert "is not exact in" in identity_error(wrong, model[1])


def test_a_pure_scale_folds_into_a_bias_free_producer():
    class LayerScale(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.gamma = nn.Parameter(torch.rand(c) + 0.5)

        def forward(self, x):
            return x * self.gamma

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), LayerScale(8), nn.GELU()).eval()
    _, sites, diff = _convert(model, torch.randn(2, 3, 6), torch.randn(4, 5, 6))
    site = sites["1"]
    assert (site.kind, site.weight, site.bias, site.producer.module) == ("affine", "gamma", None, "0")
    assert site.folded and diff < TOL and torch.equal(model[1].gamma, torch.ones(8))


def test_a_fold_that_would_overflow_float16_is_refused_before_anything_is_written():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()).eval()
    with torch.no_grad():
        model[0].weight.fill_(100.0)
        model[1].weight.fill_(1000.0)  # 100 * 1000 / sqrt(1 + eps) > 65504
    model = model.half()
    before = copy.deepcopy(model.state_dict())
    report = normswap.convert(model, example_inputs=(torch.randn(3, 4, dtype=torch.float16),))
    site = report.sites[0]
    assert not site.folded and site.reason.startswith("fold overflows float16 (0.weight")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_batchnorm_the_trace_never_reaches_is_listed():
    class Idle(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.idle = nn.Linear(4, 4), nn.BatchNorm2d(6)

        def forward(self, x):
            return self.used(x)

    sites = normswap.inspect(Idle(), example_inputs=(torch.randn(2, 4),))
    assert [(s.name, s.kind, s.reached, s.reason) for s in sites] == [
        ("idle", "batchnorm", False, "not reached by the trace")
    ]


# -- transformers models: the acceptance of the issue ------------------------------------------------------


def _save_and_reload(model, report, inputs, tmp_path):
    """Save with ``save_converted``, verify the fresh load (bit-identical tensors and outputs), and load the
    directory in plain transformers."""
    from transformers import AutoModel

    from normswap.io import record_expected, save_converted, verify_saved

    expected = record_expected(model, inputs)
    out = save_converted(model, None, {"sites": [s.to_dict() for s in report.sites]}, tmp_path / "out")
    assert verify_saved(out, expected).passed
    return AutoModel.from_pretrained(out).eval()


@pytest.mark.parametrize("model_type", ["wav2vec2-conformer", "mobilebert"])
def test_speech_and_nonorm_models_convert_save_and_reload_exactly(model_type, tmp_path):
    from normswap.check import compare, reference_outputs

    model = tiny_model(model_type)  # every norm re-randomized, BatchNorm running statistics too
    inputs = normswap.zoo.example_inputs(model)  # not what the conversion traces with
    reference = copy.deepcopy(model)
    recorded = reference_outputs(model, inputs, sites=normswap.inspect(model))  # the lean check
    report = normswap.convert(model)
    checked = compare(recorded, model, sites=report.sites)
    assert checked.passed and checked.output == "last_hidden_state" and checked.max_abs_logit_diff < TOL
    assert checked.divergence is None  # a fold into a producer changes no point the check probes
    per_channel = [s for s in report.sites if s.kind in ("batchnorm", "affine")]
    assert per_channel and all(s.folded or (s.reason and not s.foldable) for s in per_channel)
    if model_type == "wav2vec2-conformer":  # depthwise conv without bias -> BN -> activation
        assert [s.kind for s in per_channel] == ["batchnorm", "batchnorm"]
        assert all("depthwise_conv has no bias to absorb the shift" in s.reason for s in per_channel)
        bn = reference.encoder.layers[0].conv_module.batch_norm
        assert (bn.running_mean.abs() > 0.05).any() and (bn.running_var - 1).abs().max() > 0.05
    else:
        assert {s.kind for s in per_channel} == {"affine"} and sum(s.folded for s in per_channel) == 6
    before = normswap.zoo.model_outputs(reference, inputs)
    assert (before - normswap.zoo.model_outputs(model, inputs)).abs().max().item() < TOL
    reloaded = _save_and_reload(model, report, inputs, tmp_path)
    assert (before - normswap.zoo.model_outputs(reloaded, inputs)).abs().max().item() < TOL


def test_cli_converts_a_speech_model_on_a_random_waveform(tmp_path):
    from normswap.cli import main

    tiny_model("wav2vec2-conformer").save_pretrained(tmp_path / "w2v")
    runner = CliRunner()
    listed = runner.invoke(main, ["inspect", str(tmp_path / "w2v")], catch_exceptions=False)
    assert listed.exit_code == 0 and "batchnorm" in listed.output and "over axis 1 of 2x64x" in listed.output
    result = runner.invoke(
        main,
        [
            "convert",
            str(tmp_path / "w2v"),
            "--output",
            str(tmp_path / "out"),
            "--report",
            str(tmp_path / "r.json"),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["check_input"]["input"] == "input_values" and report["check"]["passed"]
    assert report["verify"]["passed"] and report["check"]["max_abs_logit_diff"] < TOL
    refused = runner.invoke(
        main, ["convert", str(tmp_path / "w2v"), "-o", str(tmp_path / "o2"), "--tokens", "8"]
    )
    assert refused.exit_code == 2 and "--tokens does not apply" in refused.output
    checked = runner.invoke(
        main, ["check", str(tmp_path / "w2v"), str(tmp_path / "out")], catch_exceptions=False
    )
    assert checked.exit_code == 0 and "PASS" in checked.output and "last_hidden_state" in checked.output


def test_tiny_model_moves_batchnorm_statistics():
    model = tiny_model("resnet")
    x = normswap.zoo.example_inputs(model)
    sites = normswap.inspect(model, example_inputs=x)
    assert sites and all(s.kind == "batchnorm" for s in sites)
    for s in sites:
        bn = model.get_submodule(s.name)
        assert (bn.running_var - 1).abs().max() > 0.05 and bn.running_mean.abs().max() > 0.05
        assert (bn.weight - 1).abs().max() > 0.05 and bn.bias.abs().max() > 0.05


def test_randomize_constants_moves_batchnorm_by_parameter_and_statistics_by_torch_name():
    """By parameter and by torch's buffer names, not through normswap: the conv weight (random at
    initialization) and ``num_batches_tracked`` (an integer) stay; each moved tensor is within 0.5 of its
    initial constant and no longer constant."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = randomize_constants(model, seed=5)
    assert moved == ["1.weight", "1.bias", "1.running_mean", "1.running_var"]
    after = model.state_dict()
    assert {k for k in after if not torch.equal(before[k], after[k])} == set(moved)
    for name in moved:
        off = (after[name] - before[name]).abs()
        assert off.max() <= 0.5 and off.max() > 0.2 and after[name].std() > 0.1
    assert randomize_constants(model, seed=5) == []  # nothing constant is left

"""The converted model's contract beyond logits (../shared/cases/README.md, C31-C37): what users rely on --
hidden states, the base model's output, fine-tuning after load, the probe's measurements, ``inspect``'s
verdicts, localization after centering -- is checked, kept, or stated.

Tolerances: float32 logits and hidden states of tiny models (size ~1) match to about 1e-6 after a correct
fold (1e-5 allows rounding); every fault these cases come from was off by 0.02 or more (C31: 1.57, C32: 0.025,
C33: 0.50, C34: 0.30, C35: 0.187).
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.io import report_dict, save_converted

TOL = 1e-5


def _saved_llama(tmp_path, tiny_model):
    """A tiny untied Llama (norms re-randomized), converted and saved with its manifest; (original, dir)."""
    model = tiny_model("llama", tie_word_embeddings=False)
    original = copy.deepcopy(model)
    report = normswap.convert(model)
    out = save_converted(model, None, report_dict(report), tmp_path / "out")
    return original, out


def _lm_loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# -- C35: training a model loaded with fused norms ---------------------------------------------------------


@pytest.mark.parametrize("trainable", [False, True], ids=["folded", "trainable_norm_weights"])
@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "sgd"])
def test_c35_training_after_load_pretrained(tmp_path, tiny_model, input_ids, optimizer, trainable):
    """After 3 optimizer steps on a model from ``load_pretrained`` (fused AdamW updates in place without
    bumping a version counter), eval logits equal a fresh load given the same state dict, normswap's and
    plain transformers' (the case measured 0.187 off). With ``trainable_norm_weights`` the folded norms'
    weights are parameters, are trained, and the fresh loads follow them."""
    from transformers import AutoModelForCausalLM

    _, out = _saved_llama(tmp_path, tiny_model)
    model = normswap.load_pretrained(out, trainable_norm_weights=trainable)
    norms = [m for m in model.modules() if isinstance(m, normswap.kernels.FusedRMSNorm)]
    assert len(norms) == 5 and all(m.identity_weight != trainable for m in norms)
    with torch.no_grad():
        model(input_ids=input_ids)  # one forward first, as in the case
    params = list(model.parameters())
    make = {
        "adamw-fused": lambda: torch.optim.AdamW(params, lr=0.05, fused=True),
        "adamw-foreach": lambda: torch.optim.AdamW(params, lr=0.05, foreach=True),
        "sgd": lambda: torch.optim.SGD(params, lr=0.5),
    }[optimizer]()
    model.train()
    for _ in range(3):
        make.zero_grad()
        _lm_loss(model, input_ids).backward()
        make.step()
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=input_ids).logits
    state = model.state_dict()
    if trainable:  # the norm weights moved away from the identity
        assert not torch.equal(state["model.norm.weight"], torch.ones(64))
    fresh = normswap.load_pretrained(out)
    fresh.load_state_dict(state)
    plain = AutoModelForCausalLM.from_pretrained(out)
    plain.load_state_dict(state)
    with torch.no_grad():
        for other in (fresh, plain):
            assert (other(input_ids=input_ids).logits - trained).abs().max().item() <= 1e-6


# -- C33: torch's nn.RMSNorm(eps=None) in half precision ----------------------------------------------------


class _TorchNormLM(torch.nn.Module):
    """Pre-norm blocks with ``nn.RMSNorm(64)`` (eps=None: the op's compute type's machine epsilon), a final
    parameter-free ``nn.RMSNorm``, embeddings of std 0.05 (mean square 2.5e-3: bfloat16's eps 7.8e-3 would
    dominate it, float32's 1.2e-7 does not)."""

    def __init__(self, vocab=128, d=64, layers=2, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(d) for _ in range(layers))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d) for _ in range(layers))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(2 * d, d) for _ in range(layers))
        self.final = torch.nn.RMSNorm(d, elementwise_affine=False)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            self.embed.weight.normal_(0, 0.05, generator=gen)
            for norm in self.norms:
                norm.weight.copy_(1 + torch.rand(d, generator=gen) - 0.5)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for norm, up, down in zip(self.norms, self.ups, self.downs, strict=True):
            h = h + down(torch.nn.functional.gelu(up(norm(h))))
        return self.head(self.final(h))


@pytest.mark.parametrize("case", ["A-float32", "B-bfloat16", "C-cast-after", "D-float32-norm-weights"])
def test_c33_torch_rmsnorm_eps_none_in_its_compute_dtype(input_ids, case):
    """The probe measures eps as the module runs (input dtype, parameter dtypes): float32's 1.19e-7 also
    for bfloat16 inputs (the case measured bfloat16's 7.8e-3 and 0.50 off); each converted model passes the
    check against its original at its precision."""
    original = _TorchNormLM()
    if case == "B-bfloat16":
        original = original.bfloat16()
    elif case == "D-float32-norm-weights":
        original = original.bfloat16()
        for norm in original.norms:
            norm.float()
    converted = copy.deepcopy(original)
    report = normswap.convert(converted, input_ids=input_ids)
    f32 = torch.finfo(torch.float32).eps
    assert {s.eps for s in report.sites} == {f32}, [(s.name, s.eps) for s in report.sites]
    assert report.norms_folded == 2 and report.norms_swapped == 3
    if case == "C-cast-after":
        original, converted = original.bfloat16(), converted.bfloat16()
    result = normswap.check(original, converted, input_ids)
    assert result.passed, result.summary()
    if case == "A-float32":
        assert result.max_abs_logit_diff <= TOL


# -- C34: two norm modules holding one Parameter ------------------------------------------------------------


class _SharedNormLM(torch.nn.Module):
    """Pre-norm blocks in which ``pattern`` shares something: ``"tied-norms"`` (the norms of blocks 0 and 1
    hold one weight Parameter), ``"tied-with-unfoldable"`` (the same, and block 1's norm output also feeds a
    product, so that norm cannot fold), ``"weight-read-elsewhere"`` (block 0's norm weight also scales block
    1's MLP output), ``"norm-twice"`` (one norm module called by both blocks), ``"two-heads"`` (the final norm
    feeds two heads), ``"shared-mlp"`` (one MLP used by both blocks), ``"looped"`` (one block run twice)."""

    def __init__(self, pattern, vocab=128, d=64, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.pattern = pattern
        self.embed = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(d, eps=1e-6) for _ in range(2))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d) for _ in range(2))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(2 * d, d) for _ in range(2))
        self.final = torch.nn.RMSNorm(d, eps=1e-6)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head2 = torch.nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for norm in (*self.norms, self.final):
                norm.weight.copy_(1 + torch.rand(d, generator=gen) - 0.5)
        if pattern in ("tied-norms", "tied-with-unfoldable"):
            self.norms[1].weight = self.norms[0].weight

    def block(self, i, h):
        j = {"norm-twice": 0, "shared-mlp": 0, "looped": 0}.get(self.pattern, i)
        norm = self.norms[0 if self.pattern in ("norm-twice", "looped") else i]
        x = norm(h)
        if self.pattern == "tied-with-unfoldable" and i == 1:
            x = x * x.sigmoid()  # not a linear use: this norm cannot fold
        y = self.downs[j](torch.nn.functional.gelu(self.ups[j](x)))
        if self.pattern == "weight-read-elsewhere" and i == 1:
            y = y * self.norms[0].weight  # the Parameter is read outside its norm too
        return h + y

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for i in range(2):
            h = self.block(i, h)
        out = self.final(h)
        logits = self.head(out)
        return logits + self.head2(out) if self.pattern == "two-heads" else logits


@pytest.mark.parametrize(
    "pattern",
    [
        "tied-norms",
        "tied-with-unfoldable",
        "weight-read-elsewhere",
        "norm-twice",
        "two-heads",
        "shared-mlp",
        "looped",
    ],  # fmt: skip
)
def test_c34_norms_sharing_a_parameter(input_ids, pattern):
    """Within 1e-5 of the original, or the fold refused with the holders named (the case: both tied norms
    folded, the second folding the identity the first left: 0.30 off)."""
    original = _SharedNormLM(pattern)
    converted = copy.deepcopy(original)
    report = normswap.convert(converted, input_ids=input_ids)
    with torch.no_grad():
        diff = (converted(input_ids) - original(input_ids)).abs().max().item()
    assert diff <= TOL, f"{pattern}: {diff:.3g}"
    sites = {s.name: s for s in report.sites}
    if pattern == "tied-norms":  # both holders fold, once: each consumer took the original weight
        assert sites["norms.0"].folded and sites["norms.1"].folded
    if pattern == "tied-with-unfoldable":
        assert not sites["norms.0"].folded and "norms.1" in sites["norms.0"].reason
    if pattern == "weight-read-elsewhere":
        assert not sites["norms.0"].folded and "the model's forward" in sites["norms.0"].reason
    if pattern in ("norm-twice", "two-heads", "shared-mlp", "looped"):
        assert report.norms_folded >= 1


# -- C36: inspect says what convert will do -----------------------------------------------------------------


def _run_cli(*args):
    from click.testing import CliRunner

    from normswap.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _overflow_llama(path):
    """A tiny float16 Llama whose final norm has weight 200 on channel 5 and whose lm_head reads that channel
    with weight 400 in one row: the fold needs 8e4 > 65504. The stream's channel 5 is zero, so the original's
    logits stay finite."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from normswap.zoo import BASE_CONFIG

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BASE_CONFIG, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + torch.rand(p.shape) - 0.5)
        model.model.norm.weight[5] = 200.0
        model.lm_head.weight[3, 5] = 400.0
        model.model.embed_tokens.weight[:, 5] = 0.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[5] = 0.0
            layer.mlp.down_proj.weight[5] = 0.0
    model.half().save_pretrained(path)
    return path


@pytest.mark.parametrize("model", ["overflow", "llama", "gpt2"])
def test_c36_inspect_gives_convert_s_verdict(tmp_path, model):
    """``inspect --json`` names, per norm, the verdict ``convert --report`` reaches (the case: inspect said
    foldable where convert refused "fold overflows float16")."""
    import json

    if model == "overflow":
        src, dtype = _overflow_llama(tmp_path / "src"), "float16"
    else:
        from normswap.zoo import tiny_model

        src, dtype = tmp_path / "src", "float32"
        tiny_model(model, tie_word_embeddings=True).save_pretrained(src)
    listed = _run_cli("inspect", src, "--dtype", dtype, "--json", tmp_path / "sites.json")
    assert listed.exit_code == 0, listed.output
    done = _run_cli("convert", src, "--output", tmp_path / "out", "--dtype", dtype, "--tokens", 16,
                    "--report", tmp_path / "r.json")  # fmt: skip
    assert done.exit_code in (0, 1), done.output
    said = {
        s["name"]: (s["foldable"], s["reason"])
        for s in json.loads((tmp_path / "sites.json").read_text())["sites"]
    }
    report = json.loads((tmp_path / "r.json").read_text())
    did = {s["name"]: (s["folded"], s["reason"]) for s in report["sites"]}
    assert said == did
    if model == "overflow":
        assert "fold overflows float16" in said["model.norm"][1]


# -- C31 / C32: hidden states, stated and checked -----------------------------------------------------------


def _outputs(model, ids, **kw):
    """Logits, every hidden state and the base model's last hidden state, float64."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, **kw)
        base = model.base_model(input_ids=ids).last_hidden_state
    return out.logits.double(), [h.double() for h in out.hidden_states], base.double()


def _contract(report):
    return {e["output"]: e for e in report["check"]["contract"]}


@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep-hidden-states"])
def test_c31_hidden_states_after_folding_the_final_norm(tmp_path, tiny_model, input_ids, keep):
    """The default convert says, per output, what holds: every hidden state the same but the final norm's
    output (hidden_states[-1], model.last_hidden_state: its weight is in lm_head now), as an independent
    reload measures (the case: 1.57 off, a value head 0.45, nothing said). ``--keep-hidden-states`` keeps
    them all, a value head on hidden_states[-1] included, and the check requires it."""
    import json

    from transformers import AutoModelForCausalLM

    model = tiny_model("llama", tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "src")
    flags = ["--keep-hidden-states"] if keep else []
    done = _run_cli("convert", tmp_path / "src", "--output", tmp_path / "out", "--tokens", 32,
                    "--report", tmp_path / "r.json", *flags)  # fmt: skip
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "r.json").read_text())
    contract = _contract(report)
    assert list(contract) == ["logits", *(f"hidden_states[{i}]" for i in range(3)), "model.last_hidden_state"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    head = torch.nn.Linear(64, 1).double()  # a value head on the last hidden state (trl, reward models)
    logits, hidden, base = _outputs(model, input_ids)
    logits2, hidden2, base2 = _outputs(reloaded, input_ids)
    assert (logits2 - logits).abs().max().item() <= TOL
    changed = {"hidden_states[2]", "model.last_hidden_state"} if not keep else set()
    measured = {f"hidden_states[{i}]": (hidden2[i] - hidden[i]).abs().max().item() for i in range(3)}
    measured["model.last_hidden_state"] = (base2 - base).abs().max().item()
    for name, diff in measured.items():
        entry = contract[name]
        if name in changed:
            assert entry["status"] == "changed by design" and "model.norm" in entry["reason"], entry
            assert diff > 1e-2, (name, diff)
        else:
            assert entry["status"] == "same" and diff <= TOL, (name, entry, diff)
    value_diff = (head(hidden2[-1]) - head(hidden[-1])).abs().max().item()
    assert (value_diff <= TOL) == keep
    sites = {s["name"]: s for s in report["sites"]}
    assert sites["model.norm"]["folded"] != keep
    assert ("contract:" in done.stdout) and (("changed by design" in done.stdout) != keep)
    if keep:
        assert "returned as a model output" in sites["model.norm"]["reason"]


def _centered(t: torch.Tensor) -> torch.Tensor:
    return t - t.mean(-1, keepdim=True)


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_c32_hidden_states_after_centering(tmp_path, tiny_model, input_ids, model_type):
    """After ``--norm rmsnorm`` the report states the centered residual stream (and centering.json the
    inputs_embeds transform, proved on the check's ids); independently, every hidden state of the reload --
    plain transformers and ``load_pretrained`` -- is the original's centered (the case: moved by 0.025-0.05,
    nothing said), and the saved transform maps the original's inputs_embeds onto the converted model's."""
    import json

    from transformers import AutoModelForCausalLM

    from normswap.center import inputs

    model = tiny_model(model_type)
    model.save_pretrained(tmp_path / "src")
    done = _run_cli("convert", tmp_path / "src", "--output", tmp_path / "out", "--tokens", 32, "--norm",
                    "rmsnorm", "--report", tmp_path / "r.json")  # fmt: skip
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "r.json").read_text())
    contract = _contract(report)
    transform = inputs.load(tmp_path / "out")
    assert transform["verified"]["passed"]
    logits, hidden, base = _outputs(model, input_ids)
    for reloaded in (
        AutoModelForCausalLM.from_pretrained(tmp_path / "out"),
        normswap.load_pretrained(tmp_path / "out"),
    ):
        logits2, hidden2, base2 = _outputs(reloaded, input_ids)
        assert (logits2 - logits).abs().max().item() <= TOL
        for i in range(len(hidden)):
            entry = contract[f"hidden_states[{i}]"]
            same = (hidden2[i] - hidden[i]).abs().max().item()
            centered = (hidden2[i] - _centered(hidden[i])).abs().max().item()
            if entry["status"] == "same":
                assert same <= TOL
            else:
                assert entry["relation"] == "centered" and entry["file"] == "centering.json", entry
                assert centered <= TOL < same, (i, centered, same)
        assert any(e["relation"] == "centered" for e in contract.values())
        embeds = model.get_input_embeddings()(input_ids)
        with torch.no_grad():
            out = reloaded(inputs_embeds=inputs.apply(transform, embeds)).logits.double()
        assert (out - logits).abs().max().item() <= TOL


# -- C37: localization after centering ----------------------------------------------------------------------


def test_c37_localization_compares_like_with_like_after_centering(tmp_path, tiny_model, tiny_gguf):
    """``normswap check SRC OUT`` on a correct centered conversion passes with no divergence; with one
    consumer weight of layer 1 scaled by 1.05 it fails and names layer 1 (the case: both blamed layer 0,
    where the stream is centered by design)."""
    import json

    from safetensors.torch import load_file, save_file

    from normswap.io import load_model

    tokenizer = load_model(tiny_gguf).tokenizer
    tiny_model("gpt2").save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    done = _run_cli("convert", tmp_path / "src", "--output", tmp_path / "out", "--tokens", 32, "--norm",
                    "rmsnorm")  # fmt: skip
    assert done.exit_code == 0, done.output
    import shutil

    shutil.copytree(tmp_path / "out", tmp_path / "bad")
    tensors = load_file(tmp_path / "bad" / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"] *= 1.05
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    good = _run_cli(
        "check", tmp_path / "src", tmp_path / "out", "--tokens", 32, "--report", tmp_path / "g.json"
    )
    assert good.exit_code == 0, good.output
    assert json.loads((tmp_path / "g.json").read_text())["divergence"] is None
    bad = _run_cli(
        "check", tmp_path / "src", tmp_path / "bad", "--tokens", 32, "--report", tmp_path / "b.json"
    )
    assert bad.exit_code == 1, bad.output
    divergence = json.loads((tmp_path / "b.json").read_text())["divergence"]
    assert divergence["layer"] == 1, divergence


@pytest.mark.parametrize(
    ("model_type", "options", "weight"),
    [
        ("llama", ["--rotate", "hadamard", "--rotate-heads"], "model.layers.1.mlp.gate_proj.weight"),
        ("gpt2", ["--rotate", "hadamard", "--rotate-heads"], "transformer.h.1.mlp.c_fc.weight"),
        ("gpt2", ["--rotate", "hadamard"], "transformer.h.1.mlp.c_fc.weight"),
    ],
    ids=["llama-heads", "gpt2-heads", "gpt2"],
)
def test_check_command_localizes_a_rotated_directory(
    tmp_path, tiny_model, tiny_gguf, model_type, options, weight
):
    """``normswap check SRC OUT`` on a rotated directory (the stream map read from normswap.json and the
    saved Q): a correct output reports no divergence, and one with a layer-1 weight changed is named at
    layer 1. A fresh user saw a first divergence at layer 0 on correct outputs with --rotate-heads (value
    projections, rotated per head) and at GPT-2's ln_f (scale folded, bias kept), and layer 0 blamed for a
    layer-15 fault."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from normswap.io import load_model

    load_model(tiny_gguf).tokenizer.save_pretrained(tmp_path / "src")
    tiny_model(model_type).save_pretrained(tmp_path / "src")
    done = _run_cli("convert", tmp_path / "src", "--output", tmp_path / "out", "--tokens", 32, *options)
    assert done.exit_code == 0, done.output
    assert "first divergence" not in done.output
    shutil.copytree(tmp_path / "out", tmp_path / "bad")
    tensors = load_file(tmp_path / "bad" / "model.safetensors")
    tensors[weight].view(-1)[::7] *= 1.5
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    for name, code in (("out", 0), ("bad", 1)):
        checked = _run_cli("check", tmp_path / "src", tmp_path / name, "--tokens", 32, "--report",
                           tmp_path / f"{name}.json")  # fmt: skip
        assert checked.exit_code == code, checked.output
        divergence = json.loads((tmp_path / f"{name}.json").read_text())["divergence"]
        assert (divergence is None) if code == 0 else (divergence["layer"] == 1), divergence


def _localized(entry_name: str, options: dict, perturb: bool):
    """Convert the zoo row ``entry_name`` with ``options`` and compare it with its reference through the
    check's localization (the CLI's route: sites, rotated reference, stream transform); with ``perturb``,
    first scale every 7th entry of one consumer weight of layer 1 by 1.5."""
    from normswap.check import compare, reference_outputs
    from normswap.convert import stream_transform
    from normswap.rotate import rotate_reference
    from normswap.walk import walk
    from normswap.zoo import ZOO, example_inputs
    from normswap.zoo import tiny_model as zoo_model

    entry = next(e for e in ZOO if e.name == entry_name)
    model = zoo_model(entry.model_type, **entry.overrides)
    ids = example_inputs(model)
    traced = walk(model, ids)
    reference = reference_outputs(model, ids, sites=traced.sites)
    report = normswap.convert(model, input_ids=ids, traced=traced, **options)
    if report.rotation is not None:
        rotate_reference(reference, report.rotation)
    if perturb:  # the first weight matrix of a consumer of a layer-1 norm, every 7th entry (not a scale a
        # per-head norm after it would normalize away)
        site = next(s for s in report.sites if s.consumers and ".1." in f".{s.name}.")
        held = model.get_submodule(site.consumers[0].module)
        weight = next(p for p in held.parameters(recurse=False) if p.ndim >= 2)
        with torch.no_grad():
            weight.view(-1)[::7] *= 1.5
    return compare(reference, model, ids, sites=report.sites, transform=stream_transform(report))


_LOCALIZED = [
    "gpt2", "bloom", "phimoe", "dbrx", "cohere-qknorm", "persimmon", "gpt_oss", "qwen2_moe",
]  # fmt: skip


@pytest.mark.parametrize("options", [{"norm": "rmsnorm"}, {"rotate": "hadamard"}], ids=["center", "rotate"])
@pytest.mark.parametrize("name", _LOCALIZED)
def test_localization_after_centering_and_rotation(name, options):
    """C37's whole kind: after centering or rotation, a correct conversion reports no divergence, and a
    consumer weight of layer 1 with every 7th entry scaled by 1.5 fails and is found at layer 1. The rows
    are the shapes that broke it: fused MoE experts that read a norm and write the stream (phimoe, dbrx,
    gpt_oss, qwen2_moe), expert outputs recorded as rows of selected tokens (dbrx), per-head q/k LayerNorms
    whose inputs centering centers per head (cohere, persimmon), an embedding norm reading a rewritten table
    (bloom)."""
    from normswap.center import CenteringError
    from normswap.rotate import RotationError

    try:
        good = _localized(name, options, perturb=False)
    except (CenteringError, RotationError) as refused:  # not this row's conversion: nothing to localize
        pytest.skip(str(refused))
    assert good.passed and good.divergence is None, good.divergence
    bad = _localized(name, options, perturb=True)
    assert not bad.passed and bad.divergence["layer"] == 1, bad.divergence


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"norm": "rmsnorm"}, {"rotate": "hadamard"}], ids=["center", "rotate"])
def test_localization_after_centering_and_rotation_whole_zoo(options):
    """Every zoo row that centers or rotates (token-id inputs): no divergence on the correct conversion."""
    from normswap.center import CenteringError
    from normswap.rotate import RotationError
    from normswap.zoo import ZOO, example_inputs
    from normswap.zoo import tiny_model as zoo_model

    spurious = {}
    for entry in ZOO:
        if not isinstance(example_inputs(zoo_model(entry.model_type, **entry.overrides)), torch.Tensor):
            continue
        try:
            result = _localized(entry.name, options, perturb=False)
        except (CenteringError, RotationError):
            continue
        if result.divergence is not None or not result.passed:
            spurious[entry.name] = result.divergence
    assert not spurious, spurious


@pytest.mark.parametrize(("model_type", "overrides", "kind"), [
    ("bloom", {}, "rewrite"), ("opt", {"word_embed_proj_dim": 32}, "none"), ("gpt_neox", {}, "center"),
])  # fmt: skip
def test_inputs_embeds_transform_per_architecture(tiny_model, input_ids, model_type, overrides, kind):
    """What a centered model expects as ``inputs_embeds`` is read from the centering plan: BLOOM's table
    feeds its embedding norm (rewritten), OPT's ``project_in`` is centered in its place (unchanged), GPT-NeoX
    writes the table into the stream (centered). Each maps the original's embeddings onto logits within
    1e-5, and the check passes with no divergence."""
    from normswap.center import inputs
    from normswap.check import compare, reference_outputs
    from normswap.convert import stream_transform

    model = tiny_model(model_type, **overrides)
    original = copy.deepcopy(model)
    reference = reference_outputs(model, input_ids, sites=normswap.inspect(model))
    report = normswap.convert(model, norm="rmsnorm", input_ids=input_ids)
    transform = report.centering["inputs"]
    assert transform["kind"] == kind
    embeds = original.get_input_embeddings()(input_ids)
    with torch.no_grad():
        got = model(inputs_embeds=inputs.apply(transform, embeds)).logits
        want = original(input_ids=input_ids).logits
    assert (got - want).abs().max().item() <= TOL
    result = compare(reference, model, input_ids, sites=report.sites, transform=stream_transform(report))
    assert result.passed and result.divergence is None, result.summary()


def test_contract_lines_group_runs_of_outputs():
    """The CLI's contract lines: the main output alone, then runs of one verdict on one line, each run's
    largest differences."""
    from normswap.check.contract import lines

    def entry(output, status="same", diff=1e-7, rel=1e-8, reason=None):
        return {"output": output, "status": status, "max_abs_diff": diff, "rel_error": rel, "reason": reason}

    why = "the weight of norm model.norm is folded into lm_head"
    folded = [
        entry(name, "changed by design", reason=why)
        for name in ("hidden_states[2]", "model.last_hidden_state")
    ]
    same = [entry("hidden_states[0]", diff=2e-7), entry("hidden_states[1]", rel=3e-8)]
    text = lines([entry("logits", rel=None), *same, *folded])
    assert [t.split("  ")[0] for t in text] == [
        "logits",
        "hidden_states[0..1]",
        "hidden_states[2], model.last_hidden_state",
    ]
    assert text[1].endswith("same (max diff 2e-07, relative 3e-08)") and text[2].endswith(why)


def test_contract_lines_in_half_precision_say_what_holds():
    """In bfloat16 "same" read "same (max diff 1)": the lines now say "same within bfloat16 rounding" and the
    numbers the rule compares, with 3 significant digits (1.03, not 1); float32 lines are as they were."""
    from normswap.check.contract import lines

    contract = [
        {"output": "logits", "status": "same", "max_abs_diff": 1.03125, "rel_error": None, "threshold": None},
        {"output": "hidden_states[0]", "status": "same", "max_abs_diff": 0.0, "rel_error": 0.0,
         "threshold": 0.01},
        {"output": "hidden_states[1]", "status": "same", "max_abs_diff": 229.4, "rel_error": 0.02534,
         "threshold": 0.01 + 2 * 0.01304},
    ]  # fmt: skip
    check = {
        "dtype": "bfloat16",
        "tolerance": {"k": 2.0, "localize_rtol": 0.01},
        "half_precision": {"original": {"max_abs": 0.9375}, "converted": {"max_abs": 1.0883}},
    }
    assert lines(contract, check) == [
        "logits               same within bfloat16 rounding (max diff 1.03; vs float32 1.09, the "
        "original's own 0.938)",
        "hidden_states[0..1]  same within bfloat16 rounding (vs float32: max diff 229, relative 0.0253 <= "
        "0.01 + 2 x the original's own 0.013)",
    ]
    assert (
        lines(contract, {"dtype": "float32"})
        == lines(contract)
        == [
            "logits               same (max diff 1)",
            "hidden_states[0..1]  same (max diff 2.3e+02, relative 0.025)",
        ]
    )


def test_contract_lines_of_a_bfloat16_conversion(tiny_model, input_ids):
    """A bfloat16 Llama converted and checked: the numbers on its lines are those of an independent run of
    the original, the converted model and the original upcast to float32, and the relative error of each
    hidden state is within the bound the line states."""
    from normswap.check import compare, reference_outputs
    from normswap.check.contract import lines

    model = tiny_model("llama", tie_word_embeddings=False).bfloat16()
    original, upcast = copy.deepcopy(model), copy.deepcopy(model).float()
    reference = reference_outputs(model, input_ids, sites=normswap.inspect(model, input_ids))
    report = normswap.convert(model)
    result = compare(reference, model, input_ids, sites=report.sites)
    assert result.passed, result.summary()
    with torch.no_grad():
        orig, conv, f32 = (
            m(input_ids=input_ids, output_hidden_states=True) for m in (original, model, upcast)
        )
    diff = (conv.logits.double() - orig.logits.double()).abs().max().item()
    conv32 = (conv.logits.double() - f32.logits.double()).abs().max().item()
    own32 = (orig.logits.double() - f32.logits.double()).abs().max().item()
    text = [line.split(None, 1) for line in lines(result.contract, result.to_dict())]  # [label, verdict]
    assert text[0] == [
        "logits",
        f"same within bfloat16 rounding (max diff {diff:.3g}; vs float32 {conv32:.3g}, the original's own "
        f"{own32:.3g})",
    ]

    def rel(a, b):  # of a from the float32 run b, as the contract measures it (float64)
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    hidden = range(len(orig.hidden_states) - 1)  # the last one is the final norm's output, folded by design
    worst = max(rel(conv.hidden_states[i], f32.hidden_states[i]) for i in hidden)
    own = max(rel(orig.hidden_states[i], f32.hidden_states[i]) for i in hidden)
    biggest = max(
        (conv.hidden_states[i].double() - f32.hidden_states[i].double()).abs().max().item() for i in hidden
    )
    assert text[1] == [
        f"hidden_states[0..{hidden[-1]}]",
        f"same within bfloat16 rounding (vs float32: max diff {biggest:.3g}, relative {worst:.3g} <= 0.01 + "
        f"2 x the original's own {own:.3g})",
    ]
    assert worst <= 0.01 + 2 * own


def test_c34_tied_norm_whose_partner_is_blocked_later_does_not_fold(input_ids):
    """Two norms holding one weight, where the fold plan blocks one of them for another reason (its fold would
    overflow float16): the other must not fold either, or its reset would change the blocked one."""
    model = _SharedNormLM("tied-norms")
    with torch.no_grad():
        model.norms[0].weight[5] = 200.0
        model.ups[1].weight[:, 5] = 400.0  # 8e4 > 65504 once folded: only norms.1's fold overflows
    sites = {s.name: s for s in normswap.inspect(model.half(), input_ids)}
    assert "fold overflows float16" in sites["norms.1"].reason
    assert not sites["norms.0"].foldable and "norms.1" in sites["norms.0"].reason

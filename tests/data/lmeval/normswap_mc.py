"""Loader of the local task normswap_mc (normswap_mc.yaml): the JSONL file beside it, no network."""

import json
from pathlib import Path


def load(**_metadata):
    """``{"test": datasets.Dataset}`` of the 10 questions in normswap_mc.jsonl."""
    import datasets

    lines = Path(__file__).with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}

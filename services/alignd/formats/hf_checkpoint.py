"""Hugging Face safetensors checkpoints: the one reader and the two writers.

A checkpoint directory holds safetensors shards ``model-00001-of-0000N.safetensors`` and an
index ``model.safetensors.index.json`` whose ``weight_map`` says which shard holds each
tensor (a lone ``model.safetensors`` without index is read too), plus ``config.json`` and
whatever else the model ships. The learner's published versions use this layout, and so do
the NVFP4 checkpoints ``alignd convert`` writes.

Reading (:class:`HFCheckpoint`)
    The index is checked when the directory is opened: every shard it names must be a
    relative path inside the directory (``../x`` or ``/x`` is a :class:`LayoutError`, so an
    index never makes a reader open a file elsewhere). Whether the shards exist is checked by
    :meth:`~HFCheckpoint.check_shards` (:class:`MissingShardError` naming the shard and its
    tensors). :meth:`~HFCheckpoint.iter_tensors` yields tensors one shard at a time;
    :meth:`~HFCheckpoint.headers` reads the shard headers only (names, shapes, dtypes), and
    checks that index and shards agree both ways.

Writing
    :func:`write_shards` writes tensors from any iterable of ``(name, tensor)``, closing a
    shard when the next tensor would pass ``shard_bytes``, then the index: a writer never
    needs all its weights in one dict. :class:`ShardWriter` writes one shard whose header is
    fixed before any tensor is known, each tensor at its offset, so an exporter holds one
    tensor (or one fused group) at a time whatever the shard size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import safetensors.torch
import torch
from alignclient.errors import DTypeError, InputError, LayoutError, MissingShardError
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: ModelOpt's own description of a quantized checkpoint, beside ``config.json``.
HF_QUANT_CONFIG = "hf_quant_config.json"
#: libalign's record of a directory it wrote (an export, a weight-store version); written last.
MANIFEST_NAME = "manifest.json"

#: safetensors dtype codes and the torch dtypes they hold.
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_CODES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code; DTypeError for one libalign cannot read."""
    if code not in ST_DTYPES:
        raise DTypeError(f"safetensors dtype {code!r} is not supported by the converter")
    return torch.empty((), dtype=ST_DTYPES[code]).element_size()


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def items(tensors: Tensors) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs from a mapping or an iterable of pairs."""
    return iter(tensors.items()) if isinstance(tensors, Mapping) else iter(tensors)


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a checkpoint, as its shard header describes it."""

    name: str
    shard: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return math.prod(self.shape) * itemsize(self.dtype)


def check_shard_name(shard: Any, where: Path) -> str:
    """``shard`` if it is a relative path inside the checkpoint, else LayoutError."""
    ok = isinstance(shard, str) and shard not in ("", ".") and "\\" not in shard \
        and "\x00" not in shard
    if ok:
        p = PurePosixPath(shard)
        ok = not p.is_absolute() and ".." not in p.parts
    if not ok:
        raise LayoutError(f"{where}: shard {str(shard)[:200]!r} is not a relative path inside "
                          f"the checkpoint")
    return shard


class HFCheckpoint:
    """Read access to one safetensors checkpoint directory (see module doc)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise LayoutError(f"checkpoint directory {self.path} {what}")
        index_file = self.path / INDEX_NAME
        self.indexed = index_file.exists()
        if self.indexed:
            try:
                index = json.loads(index_file.read_text())
                self.weight_map: dict[str, str] = dict(index["weight_map"])
                self.metadata: dict[str, Any] = dict(index.get("metadata") or {})
            except (ValueError, KeyError, TypeError) as e:
                raise LayoutError(f"{index_file}: not a safetensors index ({e})") from e
            for shard in set(self.weight_map.values()):
                check_shard_name(shard, index_file)
        elif (self.path / SINGLE_NAME).is_file():
            with safe_open(self.path / SINGLE_NAME, framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_NAME)
            self.metadata = {}
        else:
            raise LayoutError(f"{self.path}: neither {INDEX_NAME} nor {SINGLE_NAME}")

    def shards(self) -> dict[str, list[str]]:
        """Shard file name -> tensor names it holds, in index order; shards sorted."""
        out: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            out.setdefault(shard, []).append(name)
        return dict(sorted(out.items()))

    def check_shards(self) -> None:
        """Raise MissingShardError for the first shard the index names but the disk lacks."""
        for shard, names in self.shards().items():
            if not (self.path / shard).is_file():
                raise MissingShardError(shard, names, str(self.path))

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as ``(name, tensor)``, one shard at a time."""
        self.check_shards()
        for shard, names in self.shards().items():
            try:
                f = safe_open(self.path / shard, framework="pt")
            except Exception as e:  # safetensors' own error type: truncated or foreign file
                raise LayoutError(f"shard {shard!r} of {self.path} is unreadable: {e}") from e
            with f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise LayoutError(f"tensor {name!r}: the index puts it in {shard}, "
                                          f"which does not hold it")
                    yield name, f.get_tensor(name)

    def headers(self) -> tuple[list[str], dict[str, SourceTensor], dict[str, dict[str, str]]]:
        """Shard names, tensors and per-shard metadata, from the shard headers only.

        Index and shards must agree: a tensor in a shard the index does not map there, or an
        index entry its shard lacks, is a :class:`LayoutError`; a dtype libalign cannot read
        is a :class:`DTypeError`.
        """
        self.check_shards()
        tensors: dict[str, SourceTensor] = {}
        metadata: dict[str, dict[str, str]] = {}
        shards = list(self.shards())
        for shard in shards:
            with safe_open(self.path / shard, framework="pt") as f:
                metadata[shard] = dict(f.metadata() or {})
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if self.weight_map.get(name) != shard:
                        raise LayoutError(f"tensor {name!r} is in shard {shard!r} but the index "
                                          f"puts it in {self.weight_map.get(name)!r}")
                    sl = f.get_slice(name)
                    tensors[name] = SourceTensor(name, shard, tuple(sl.get_shape()), sl.get_dtype())
        absent = sorted(set(self.weight_map) - set(tensors))
        if absent:
            raise LayoutError(f"{len(absent)} tensor(s) named in the index are not in their "
                              f"shard, first {absent[0]!r} (index says {self.weight_map[absent[0]]!r})")
        for t in tensors.values():
            itemsize(t.dtype)
        return shards, tensors, metadata

    @property
    def total_bytes(self) -> int:
        """Total tensor bytes the shards hold (from the shard files' sizes if unknown)."""
        if "total_size" in self.metadata:
            return int(self.metadata["total_size"])
        return sum((self.path / s).stat().st_size for s in self.shards())


def write_shards(out: Path, tensors: Tensors, *, shard_bytes: int,
                 metadata: Mapping[str, Any] | None = None,
                 what: str = "the checkpoint") -> dict[str, Any]:
    """Write ``tensors`` into the directory ``out`` as numbered shards plus an index; return it.

    A shard is closed when the next tensor would take it past ``shard_bytes`` (a tensor
    larger than that gets a shard of its own). The index's metadata holds ``total_size`` and
    ``metadata``. ``what`` names the checkpoint in errors (a tensor given twice, a value
    that is not a tensor).
    """
    out = Path(out)
    weight_map: dict[str, str] = {}
    parts: list[str] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        """Write the pending tensors as the next part file."""
        nonlocal shard, size
        part = f"part-{len(parts):05d}.safetensors"
        safetensors.torch.save_file(shard, out / part)
        for n in shard:
            weight_map[n] = part
        parts.append(part)
        shard, size = {}, 0

    for name, t in items(tensors):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if name in weight_map or name in shard:
            raise InputError(f"tensor {name!r} appears twice in {what}")
        nb = tensor_nbytes(t)
        if shard and size + nb > shard_bytes:
            flush()
        shard[name] = t.detach().contiguous().cpu()
        size += nb
        total += nb
    if shard or not parts:
        flush()
    names = {p: f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i, p in enumerate(parts)}
    for p, n in names.items():
        os.rename(out / p, out / n)
    index = {"metadata": {"total_size": total, **(metadata or {})},
             "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1))
    return index


class ShardWriter:
    """One safetensors file whose header is fixed up front; tensors are written at their offsets.

    Tensors are laid out by decreasing element size (as safetensors does), so every
    tensor starts aligned to its dtype. Each :meth:`write` hashes what it writes.
    """

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str]):
        if sys.byteorder != "little":
            raise LayoutError("safetensors files are little-endian; this host is not")
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        self._slots: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        order = sorted(entries, key=lambda e: -torch.empty((), dtype=e[2]).element_size())
        for name, shape, dtype in order:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            self._slots[name] = (offset, n, tuple(shape), dtype)
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_bytes = offset
        self._start = 8 + len(raw)
        self._sha: dict[str, str] = {}
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> str:
        """Write tensor ``name`` (shape and dtype as declared); return its SHA-256."""
        offset, _, shape, dtype = self._slots[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise LayoutError(f"{name}: produced {tuple(t.shape)} {t.dtype}, the shard header "
                              f"declares {shape} {dtype}")
        if name in self._sha:
            raise LayoutError(f"{name} written twice to {self.path.name}")
        buf = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.seek(self._start + offset)
        self._f.write(buf)
        self._sha[name] = hashlib.sha256(buf).hexdigest()
        return self._sha[name]

    def close(self) -> None:
        """Check every declared tensor was written, then close the file."""
        missing = sorted(set(self._slots) - set(self._sha))
        self._f.close()
        if missing:
            raise LayoutError(f"{self.path.name}: {len(missing)} tensor(s) never written, "
                              f"first {missing[0]!r}")
        if self.path.stat().st_size != self._start + self.data_bytes:
            raise LayoutError(f"{self.path.name} has {self.path.stat().st_size} bytes, expected "
                              f"{self._start + self.data_bytes}")

    def abort(self) -> None:
        """Close without checks (the directory is being discarded)."""
        self._f.close()

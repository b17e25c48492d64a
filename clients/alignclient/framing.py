"""The binary framing of a batched guidance fetch (``POST /v1/guidance/{version}:batch``).

A guidance record is opaque bytes, often megabytes, so many records travel in one
``application/octet-stream`` body instead of JSON (no base64, no copies into text).
The body is a header, then one frame per record, all integers little-endian::

    magic    4 bytes  b"LAGB"  (libalign guidance batch)
    count    u32      number of frames that follow
    frame    count times:
        id_len   u16      length of the rollout id in bytes (UTF-8; ids are ASCII)
        id       id_len bytes
        size     u64      length of the record in bytes
        record   size bytes

Frames come in the order the rollout ids were asked for; with ``missing="skip"`` the
absent ones are simply left out. :func:`iter_frames` produces the body piece by piece
(the server streams it; records are never concatenated into one buffer there) and
:func:`decode_frames` parses a whole body, checking that it ends exactly after the last
frame.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping

from .errors import FramingError

MAGIC = b"LAGB"
_HEADER = struct.Struct("<4sI")
_ID_LEN = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
MEDIA_TYPE = "application/octet-stream"


def iter_frames(records: Mapping[str, bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """The body for ``records`` (rollout id -> record), as a sequence of pieces."""
    yield _HEADER.pack(MAGIC, len(records))
    for rid, blob in records.items():
        key = rid.encode()
        yield _ID_LEN.pack(len(key)) + key + _SIZE.pack(len(blob))
        yield blob


def encode_frames(records: Mapping[str, bytes | memoryview]) -> bytes:
    """The whole body for ``records`` in one buffer."""
    return b"".join(bytes(p) for p in iter_frames(records))


def decode_frames(body: bytes | memoryview) -> dict[str, bytes]:
    """Rollout id -> record from a batch body; FramingError if it is malformed."""
    mv = memoryview(body)
    if len(mv) < _HEADER.size:
        raise FramingError(f"batch body of {len(mv)} bytes is shorter than its header")
    magic, count = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FramingError(f"batch body starts with {bytes(magic)!r}, not {MAGIC!r}")
    off = _HEADER.size
    out: dict[str, bytes] = {}
    for i in range(count):
        if off + _ID_LEN.size > len(mv):
            raise FramingError(f"frame {i} of {count}: body ends inside its id length")
        (n,) = _ID_LEN.unpack_from(mv, off)
        off += _ID_LEN.size
        if off + n + _SIZE.size > len(mv):
            raise FramingError(f"frame {i} of {count}: body ends inside its id or size")
        rid = bytes(mv[off : off + n]).decode()
        off += n
        (size,) = _SIZE.unpack_from(mv, off)
        off += _SIZE.size
        if off + size > len(mv):
            raise FramingError(f"frame {i} ({rid!r}): record of {size} bytes runs past the body")
        out[rid] = bytes(mv[off : off + size])
        off += size
    if off != len(mv):
        raise FramingError(f"{len(mv) - off} bytes after the last of {count} frames")
    return out

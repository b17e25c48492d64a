"""One conversion without Redis: a published BF16 directory to a store version.

This is the whole data path of the converter service (read shards, quantize selected
tensors with :func:`libalign.ops.quantize`, write an atomic, checksummed store version)
with none of the messaging around it, so a benchmark can time publish -> converted ->
ready-to-load and a script can convert a directory by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from alignclient.errors import SpecError

from alignd.formats.hf_checkpoint import HFCheckpoint
from alignd.formats.selection import make_select
from alignd.formats.weight_store import DEFAULT_SHARD_BYTES, WeightStore
from libalign.gemm import get_path
from libalign.spec import PRESETS, NumericsSpec


def resolve_spec(spec: NumericsSpec | str) -> NumericsSpec:
    """A NumericsSpec from itself or from a preset name."""
    if isinstance(spec, NumericsSpec):
        return spec
    if spec not in PRESETS:
        raise SpecError(f"unknown preset {spec!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[spec]


def target_spec(default: NumericsSpec, target_path: str | None) -> tuple[NumericsSpec, bool]:
    """``(spec, quantize)`` for a version converted for ``target_path``.

    None keeps the converter's preset; a quantized execution path brings its weight spec
    (``nvfp4_naive`` stores one outer scale per expert); ``bf16`` stores everything
    unquantized (``quantize`` False), so a bf16 sampler loads through the same flow.
    """
    if target_path is None:
        return default, True
    path = get_path(target_path)
    if not path.quantized:
        return default, False
    return path.weight_spec, True


def convert_published(
    src_dir: Path | str,
    store: WeightStore,
    version_id: str,
    spec: NumericsSpec | str = "minite",
    *,
    all_linear: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
    device: str = "cpu",
    quantize: bool = True,
) -> dict[str, Any]:
    """Convert the published version in ``src_dir`` into ``store`` as ``version_id``.

    Every shard is checked to exist before anything is written. Returns the manifest.
    ``quantize=False`` stores every tensor unquantized (a version for a bf16 sampler).
    """
    spec = resolve_spec(spec)
    pub = HFCheckpoint(Path(src_dir))
    pub.check_shards()
    source = {"path": str(pub.path), "tensors": len(pub.weight_map), "bytes": pub.total_bytes}
    extra = {"all_linear": all_linear, "quantized": quantize}
    return store.write_version(
        version_id, pub.iter_tensors(), spec,
        select=make_select(all_linear) if quantize else (lambda name, t: False),
        shard_bytes=shard_bytes, source=source, extra=extra,
        overwrite=overwrite, on_step=on_step, device=device,
    )

"""One conversion without Redis: a published BF16 directory to a store version.

This is the whole data path of the converter service (read shards, quantize selected
tensors with :func:`libalign.kernels.quantize`, write an atomic, checksummed store version)
with none of the messaging around it, so a benchmark can time publish -> converted ->
ready-to-load and a script can convert a directory by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from alignclient.errors import AlignError, SpecError
from safetensors import safe_open

from alignd.formats.hf_checkpoint import HFCheckpoint
from alignd.formats.manifest import Manifest
from alignd.formats.selection import (
    fused_groups,
    is_expert_weight,
    is_never_quantized,
    make_select,
)
from alignd.formats.weight_store import DEFAULT_SHARD_BYTES, WeightStore, named_error
from libalign.gemm import get_path
from libalign.models.kv_cache import KVScales, kv_scales_for, kv_spec_of
from libalign.spec import PRESETS, NumericsSpec, shared_outer_amax
from libalign.spec.presets import SGLANG_KV_DTYPES


def kv_manifest(kv_format: str | None, scales: KVScales | None = None) -> dict | None:
    """What a version's manifest says of the sampler's KV cache: the KV preset, SGLang's
    ``--kv-cache-dtype`` for it (None where SGLang cannot write it) and the global scales
    (with their source) of a format that takes them (None: SGLang's default 1.0); None
    without a KV format."""
    if kv_format is None:
        if scales is not None:
            raise SpecError("KV scales without a KV format")
        return None
    spec = kv_spec_of(kv_format)
    if scales is not None:  # refused by a format that takes none
        kv_scales_for(spec, scales, scales.layers)
    return {"format": spec.name, "sglang_kv_cache_dtype": SGLANG_KV_DTYPES.get(spec.name),
            "scales": None if scales is None else scales.to_dict()}


def path_kv_format(path: str | None) -> str | None:
    """The KV preset execution path ``path`` stores K and V in (None: the model's dtype, or no
    path named): what a version converted for that path says in its manifest."""
    if path is None:
        return None
    kv = get_path(path).kv_spec
    return None if kv is None else kv.name


def path_kv_scales(path: str | None, scales: KVScales | None) -> KVScales | None:
    """The global K/V scales a version for sampler path ``path`` names: the configured
    ``scales`` (``kv_scales_file``) when the path's KV format takes them
    (``kv_sglang_nvfp4``), else None. The converter, a learner that converts its own
    versions and a learner that writes K/V on such a path all ask here, so they agree."""
    kv = path_kv_format(path)
    if kv is None or kv_spec_of(kv).outer_source != "given":
        return None
    return scales


def load_kv_scales(path: Path | str | None) -> KVScales | None:
    """:class:`KVScales` from a JSON file of :meth:`KVScales.to_dict`'s form (None: no file);
    SpecError naming the file when it cannot be read or holds no valid scales."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"KV scales file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"KV scales file {str(path)!r} holds no {{source, k, v}} object")
    return KVScales.from_dict(data)


def check_kv_manifest(extra: Mapping[str, Any], kv_format: str | None) -> KVScales | None:
    """The global K/V scales a sampler running KV format ``kv_format`` must write with, from a
    version's manifest ``extra`` (None: the format takes none, or the version names none and
    SGLang's default 1.0 holds).

    SpecError with ``field="kv.format"`` when the version was made for another KV format than
    the sampler runs (a version without the field was made for K and V in the model's dtype),
    and with ``field="kv.scales"`` when its scales cannot be read: the sampler loads nothing.
    """
    kv = extra.get("kv") or {}
    made = kv.get("format")
    if made != kv_format:
        raise SpecError(f"field kv.format: the version was made for KV format {made!r}, the "
                        f"sampler runs {kv_format!r}", field="kv.format")
    if kv.get("scales") is None:
        return None
    try:
        return KVScales.from_dict(kv["scales"])
    except AlignError as e:
        raise SpecError(f"field kv.scales: {e}", field="kv.scales") from None


def check_kv_scales(extra: Mapping[str, Any], kv_format: str, scales: KVScales) -> None:
    """Refuse a version whose K/V global scales are not ``scales``, the ones a learner writing
    KV format ``kv_format`` uses (a version that names none holds SGLang's default 1.0).

    Only a version made for the same KV format is compared (with another one, or none, the
    sampler's K/V are not the learner's format anyway). SpecError with ``field="kv.scales"``
    naming the first layer and site (``k_scale``/``v_scale``) whose values differ, both values
    and their sources: a learner and a sampler on different scales would compute different K/V
    bits for the same tokens, and δ would measure the configuration, not the execution.
    """
    if (extra.get("kv") or {}).get("format") != kv_format:
        return
    made = check_kv_manifest(extra, kv_format) or KVScales.default(scales.layers)
    if made.layers != scales.layers:
        raise SpecError(f"field kv.scales: the version's K/V scales cover {made.layers} layers, "
                        f"the learner's {scales.layers}", field="kv.scales")
    for layer in range(made.layers):
        for site in ("k", "v"):
            a, b = made.scale(layer, site), scales.scale(layer, site)
            if a != b:
                raise SpecError(
                    f"field kv.scales: layer {layer} {site}_scale is {a!r} in the version "
                    f"({made.source}) and {b!r} in the learner ({scales.source}); give both the "
                    "same kv_scales_file", field="kv.scales")


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


def fused_outer_amax(pub: HFCheckpoint, spec: NumericsSpec, *, all_linear: bool = False
                     ) -> dict[str, torch.Tensor]:
    """The shared outer maximum of each 2-D tensor in a fused group (an expert's
    ``gate_proj``/``up_proj``, ``q/k/v_proj`` under ``all_linear``), by member name.

    A sampler that fuses the siblings into one GEMM keeps one outer scale for them (SGLang's
    ``w13`` takes one ``weight_scale_2``), so they must be quantized with one maximum, as
    ``alignd convert`` does; each member is read once more for it. Empty for the ``row`` and
    ``none`` outer domains (every row is its own domain; nothing to share) and for MXFP4.
    """
    if spec.is_mx or spec.outer_domain not in ("tensor", "expert"):
        return {}
    _shards, tensors, _meta = pub.headers()
    names = [n for n, t in tensors.items() if len(t.shape) == 2 and n.endswith(".weight")
             and (is_expert_weight(n) or (all_linear and not is_never_quantized(n)))]
    out: dict[str, torch.Tensor] = {}
    for members in fused_groups(names).values():
        xs = []
        for name in members:
            with safe_open(pub.path / pub.weight_map[name], framework="pt") as f:
                xs.append(f.get_tensor(name))
        try:
            amax = shared_outer_amax(xs, spec)
        except AlignError as e:
            raise named_error(e, " + ".join(members)) from e
        out.update({m: amax.clone() for m in members})  # no two stored tensors share memory
    return out


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
    share_fused: bool = False,
    on_tensor: Callable[[str], None] | None = None,
    kv_format: str | None = None,
    kv_scales: KVScales | None = None,
) -> Manifest:
    """Convert the published version in ``src_dir`` into ``store`` as ``version_id``.

    Every shard is checked to exist before anything is written. Returns the manifest.
    ``quantize=False`` stores every tensor unquantized (a version for a bf16 sampler);
    ``share_fused`` quantizes fused siblings with one outer maximum (:func:`fused_outer_amax`:
    what a ModelOpt export for SGLang needs). ``on_tensor`` is called with each tensor's name
    after it is read and before it is quantized; what it raises abandons the conversion (the
    staging directory is removed, the store is untouched). ``kv_format`` names the KV preset the
    sampler runs (and ``kv_scales`` its per-layer global scales, where it takes them): the
    manifest's ``extra["kv"]`` says which (:func:`kv_manifest`).
    """
    spec = resolve_spec(spec)
    kv = kv_manifest(kv_format, kv_scales)
    pub = HFCheckpoint(Path(src_dir))
    pub.check_shards()
    source = {"path": str(pub.path), "tensors": len(pub.weight_map), "bytes": pub.total_bytes}
    extra = {"all_linear": all_linear, "quantized": quantize, "fused_share_outer": share_fused}
    if kv is not None:
        extra["kv"] = kv
    amax = fused_outer_amax(pub, spec, all_linear=all_linear) if share_fused and quantize else {}
    tensors = pub.iter_tensors()
    if on_tensor is not None:
        tensors = _told(tensors, on_tensor)
    return store.write_version(
        version_id, tensors, spec,
        select=make_select(all_linear) if quantize else (lambda name, t: False),
        shard_bytes=shard_bytes, source=source, extra=extra,
        overwrite=overwrite, on_step=on_step, device=device, outer_amax=amax,
    )


def _told(tensors: Iterable[tuple[str, Any]], on_tensor: Callable[[str], None]
          ) -> Iterator[tuple[str, Any]]:
    """``tensors``, calling ``on_tensor(name)`` before each is passed on."""
    for name, value in tensors:
        on_tensor(name)
        yield name, value

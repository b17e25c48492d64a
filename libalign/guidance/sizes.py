"""How many bytes of guidance a generated token costs: the planning side of :mod:`libalign.guidance`.

A record (:class:`~libalign.guidance.GuidanceRecord`) keeps, for every row it guides, ``b``
low bits of each E2M1 code, one block-scale byte per block (16 values for NVFP4, 32 for
MXFP4), a 4-byte row scale and the row's index (4 bytes of position, plus 2 of expert or
head where a site has several rows a token). Per value that is ``b + 8/16`` bits: 1.5 bits
at ``b = 1``, 4.5 at ``b = 4`` (the full code), so a ``b = 1`` record is a third of a full one.

Per token and recorded layer the sites hold:

* ``fc1``: ``hidden`` values in one row (the expert input, shared by the token's experts);
* ``fc2``: ``top_k * moe_intermediate`` values in ``top_k`` rows (one per routed expert);
* K and V (``k``, ``v``): ``2 * kv_heads * head_dim`` values in ``2 * kv_heads`` rows (one
  per key/value head), at the KV format's block size.

Routing replay (R3) adds a routing record per token: ``top_k`` expert ids at *every* MoE layer
(one byte each up to 256 experts, two above; :mod:`libalign.routing.records`), plus two bytes
of bf16 gate weight per id where the learner takes the sampler's weights (``record``).

:func:`trace_reference_size` reproduces TRACE's own accounting (codes and block scales only:
about 45 KiB of activation and 5.6 KiB of KV guidance per token for a 35B MoE with hidden
size 2048, 40 layers and 256 KV values per layer, at 4.5 bits a value).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from libalign.errors import SpecError
from libalign.guidance.records import ACT_SITES, select_layers
from libalign.routing.records import bytes_per_token as routing_bytes_per_token
from libalign.routing.records import config_moe_layers
from libalign.spec import PRESETS
from libalign.spec.constants import BLOCK_SIZE
from libalign.spec.presets import KV_PRESETS
from libalign.spec.rounding import GUIDE_BITS


def size_per_token(*, hidden: int, moe_intermediate: int, top_k: int, layers: int, bits: int,
                   sites: Iterable[str] = ACT_SITES, kv_values: int = 0, kv_rows: int = 0,
                   kv_block: int = BLOCK_SIZE, kv_layers: int | None = None,
                   row_scale: bool = True, index: bool = True) -> dict[str, float]:
    """Bytes of guidance per token, by part, for a model with ``layers`` recorded MoE layers.

    ``fc1`` records ``hidden`` values per token, ``fc2`` ``top_k * moe_intermediate``;
    ``kv_values`` adds that many K and V values per layer (``kv_layers`` of them, default
    ``layers``) in ``kv_rows`` rows (``2 * kv_heads``; 0 counts codes and scales only, as
    TRACE does) with one block scale per ``kv_block`` values. ``row_scale``/``index`` count
    the 4-byte row scale and the row index. The ``kv`` part is K and V in full (codes, block
    and row scales, index); the other parts are the activation sites'.
    """
    if bits not in GUIDE_BITS:
        raise SpecError(f"guidance keeps 1, 2, 3 or 4 bits per value, got {bits!r}")
    if kv_block not in (BLOCK_SIZE, 32):
        raise SpecError(f"KV block size must be 16 (NVFP4) or 32 (MXFP4), got {kv_block!r}")
    sites = tuple(sites)
    unknown = set(sites) - set(ACT_SITES)
    if unknown:
        raise SpecError(f"unknown sites {sorted(unknown)}; activation sites are {ACT_SITES} "
                        "(K and V are counted by kv_values)")
    values = rows = idx = 0
    if "fc1" in sites:
        values, rows, idx = values + hidden, rows + 1, idx + 4
    if "fc2" in sites:
        values, rows, idx = values + top_k * moe_intermediate, rows + top_k, idx + 6 * top_k
    kv_layers = layers if kv_layers is None else kv_layers
    kv = kv_values * (bits / 8 + 1 / kv_block) + kv_rows * ((4 if row_scale else 0) +
                                                           (6 if index else 0))
    out = {
        "code_bits": layers * values * bits / 8,
        "block_scales": layers * values / BLOCK_SIZE,
        "row_scales": layers * rows * 4 if row_scale else 0,
        "index": layers * idx if index else 0,
        "kv": kv_layers * kv,
    }
    out["total"] = sum(out.values())
    return out


def size_for_config(config, *, bits: int, last_layers: int | str | None = None,
                    sites: Iterable[str] = ACT_SITES, kv: bool = False,
                    kv_spec: str = "kv_nvfp4", routing: str | None = None) -> dict[str, float]:
    """:func:`size_per_token` for a Hugging Face MoE config (``hidden_size``,
    ``moe_intermediate_size``, ``num_experts_per_tok``, ``num_hidden_layers``, and
    ``mlp_only_layers``/``decoder_sparse_step`` where present), recording the last
    ``last_layers`` MoE layers (all by default; ``"half"``: the latter half, TRACE's choice);
    ``kv`` counts K and V of the last ``last_layers`` decoder layers as records in ``kv_spec``
    (a KV preset: ``kv_nvfp4``, ``kv_mxfp4``, ``kv_sglang_nvfp4``, ``kv_sglang_fp4_mx_block16``)
    hold them.
    ``routing`` adds the R3 record of every MoE layer (``num_experts`` sets the id width):
    ``"ids"`` (the learner recomputes gate weights) or ``"weights"`` (it takes the sampler's);
    the ``routing`` part is 0 without it.
    """
    if routing not in (None, "ids", "weights"):
        raise SpecError(f"routing must be 'ids' or 'weights' (or None), got {routing!r}")
    get = _getter(config)
    n = int(get("num_hidden_layers"))
    moe = config_moe_layers(config)
    layers = len(select_layers(moe, last_layers))
    heads = int(get("num_key_value_heads", 0) or 0)
    head_dim = _head_dim(get)
    if kv and kv_spec not in KV_PRESETS:
        raise SpecError(f"unknown KV format {kv_spec!r}; KV presets are {KV_PRESETS}")
    out = size_per_token(hidden=int(get("hidden_size")),
                          moe_intermediate=int(get("moe_intermediate_size")),
                          top_k=int(get("num_experts_per_tok")), layers=layers, bits=bits,
                          sites=sites, kv_values=2 * heads * head_dim if kv else 0,
                          kv_rows=2 * heads if kv else 0,
                          kv_block=PRESETS[kv_spec].block_size if kv else BLOCK_SIZE,
                          kv_layers=len(select_layers(range(n), last_layers)))
    out["routing"] = 0 if routing is None else routing_bytes_per_token(
        len(moe), int(get("num_experts_per_tok")), int(get("num_experts", 0) or 0),
        weights=routing == "weights")
    out["total"] += out["routing"]
    return out


def trace_reference_size(bits: int = 4, tokens_per_trajectory: int = 256 * 1024,
                         trajectories: int = 4096, *, hidden: int = 2048, kv_values: int = 256,
                         layers: int = 40) -> dict[str, float]:
    """TRACE's accounting, codes and block scales only, per token and per RL step: ``hidden``
    activation values (the paper's D1) and ``kv_values`` KV values (its D2) per MoE layer over
    ``layers`` MoE layers. The defaults are the paper's 35B MoE (D1 = 2048, D2 = 256, 40 MoE
    layers); :func:`trace_dims` reads them from a model's config."""
    act = size_per_token(hidden=hidden, moe_intermediate=0, top_k=0, layers=layers, bits=bits,
                         sites=("fc1",), row_scale=False, index=False)
    kv = size_per_token(hidden=0, moe_intermediate=0, top_k=0, layers=layers, bits=bits,
                        sites=(), kv_values=kv_values, row_scale=False, index=False)
    per_token = act["total"] + kv["total"]
    return {"activation_bytes": act["total"], "kv_bytes": kv["total"], "per_token_bytes": per_token,
            "per_step_bytes": per_token * tokens_per_trajectory * trajectories}


def trace_dims(config) -> dict[str, int]:
    """The paper's dimensions of a Hugging Face MoE config: ``hidden`` (D1, ``hidden_size``),
    ``kv_values`` (D2, the width of one of a layer's K and V projections:
    ``num_key_value_heads * head_dim``) and ``layers`` (the MoE layers), the keywords of
    :func:`trace_reference_size`."""
    get = _getter(config)
    return {"hidden": int(get("hidden_size")),
            "kv_values": int(get("num_key_value_heads", 0) or 0) * _head_dim(get),
            "layers": len(config_moe_layers(config))}


def _getter(config):
    """``get(key, default)`` over a config dict or object."""
    if isinstance(config, Mapping):
        return lambda k, d=None: config.get(k, d)
    return lambda k, d=None: getattr(config, k, d)


def _head_dim(get) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads``."""
    return int(get("head_dim", 0) or (int(get("hidden_size")) //
                                      max(1, int(get("num_attention_heads", 1)))))

"""The quantization configs an NVFP4 export writes beside its weights.

A loader decides how to read a checkpoint from ``config.json``'s ``quantization_config``
(and, for ModelOpt, ``hf_quant_config.json``): which modules are quantized, in which
format, with which group size. Each function here builds one of those dicts from an
:class:`~alignd.formats.export_plan.ExportPlan`:

* ModelOpt NVFP4 (what SGLang's ``modelopt_fp4``, vLLM and TensorRT-LLM load): weights and
  activations 4-bit float in groups of 16; the modules kept in high precision under
  ``exclude_modules`` / ``ignore``;
* compressed-tensors ``nvfp4-pack-quantized``, weight-only (``input_activations: null``, like
  its ``NVFP4A16`` preset): a weight converter sees no activations, so it writes no
  activation scale;
* compressed-tensors ``mxfp4-pack-quantized`` for an MXFP4 preset, weight-only like its
  ``MXFP4A16`` preset (group strategy, group size 32, uint8 E8M0 scales, no global scale):
  what vLLM's and SGLang's ``CompressedTensorsW4A16Mxfp4`` load;
* libalign's own ``libalign_minite`` (:func:`minite_quantization_config`): the row-scaled
  ``minite`` spec in the ModelOpt tensor layout with ``weight_scale_2`` ``[N, 1]``, what
  ``alignd.sampler.sglang_quant`` (``--quantization libalign_minite``) loads.

Every config carries a ``libalign`` note (producer, preset, full numerics spec, whether the
outer scale is per row) so a reader can tell how the bits were computed; with a row-scaled
preset the note says that stock loaders, which expect one ``weight_scale_2`` per weight,
cannot load the checkpoint.
"""

from __future__ import annotations

from typing import Any

import libalign
from alignd.formats.export_plan import ExportPlan

#: The SGLang quantization method that loads row-scaled ``minite`` exports, the spec it
#: serves and the execution path it stands for (``alignd.sampler.sglang_quant``).
MINITE_METHOD = "libalign_minite"
MINITE_SPEC = "minite"
MINITE_PATH = "nvfp4_minite"


def libalign_note(plan: ExportPlan) -> dict[str, Any]:
    """What libalign records about how the export's bits were computed."""
    note = {
        "producer": f"libalign {libalign.__version__}",
        "preset": plan.preset,
        "numerics_spec": plan.spec.to_dict(),
        "outer_scale": ("none (MXFP4: E8M0 block scales only)" if plan.spec.is_mx
                        else "per_row" if plan.row_scaled else "per_tensor"),
        "input_scale": "not written: activation scales need calibration data",
        "fused_groups_share_outer_scale": bool(plan.groups),
    }
    if plan.row_scaled:
        note["weight_scale_2_layout"] = (
            "fp32 [N, 1]: one decode scale (row amax / 2688) per output row. Stock loaders "
            "(SGLang modelopt_fp4, vLLM, TensorRT-LLM) expect a scalar per weight and cannot "
            "load this checkpoint; use libalign's sampler adapter.")
    return note


def manifest_notes(plan: ExportPlan) -> list[str]:
    """Plain-language notes for the export's manifest."""
    notes = ["input_scale is not written: activation scales need calibration data, which a "
             "weight converter does not see"]
    if plan.row_scaled:
        notes.append(libalign_note(plan)["weight_scale_2_layout"])
    if plan.groups:
        notes.append("members of each fused group (gate/up, q/k/v) share one outer scale")
    return notes


def modelopt_hf_quant_config(plan: ExportPlan) -> dict[str, Any]:
    """``hf_quant_config.json`` for a ModelOpt NVFP4 export."""
    return {
        "producer": {"name": "libalign", "version": libalign.__version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": list(plan.excluded_modules),
        },
    }


def modelopt_quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ModelOpt (ModelOpt's own converted form)."""
    hf = modelopt_hf_quant_config(plan)
    return {
        "config_groups": {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"],
        }},
        "ignore": list(plan.excluded_modules),
        "quant_algo": "NVFP4",
        "producer": hf["producer"],
        "quant_method": "modelopt",
        "libalign": libalign_note(plan),
    }


def minite_quantization_config(exclude_modules: list[str] | None = None) -> dict[str, Any]:
    """``quantization_config`` (and ``hf_quant_config.json``) of a ``minite`` export for
    SGLang's ``libalign_minite`` method: the method, the spec, the modules kept unquantized."""
    return {"quant_method": MINITE_METHOD, "spec": MINITE_SPEC,
            "exclude_modules": sorted(exclude_modules or [])}


def compressed_tensors_quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """``quantization_config`` for compressed-tensors ``nvfp4-pack-quantized`` (or, for an
    MXFP4 preset, ``mxfp4-pack-quantized``), weight-only."""
    if plan.spec.is_mx:
        return _compressed_tensors_mxfp4_config(plan)
    return {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                        "strategy": "tensor_group", "dynamic": False,
                        "scale_dtype": "torch.float8_e4m3fn"},
            "input_activations": None,
            "output_activations": None,
        }},
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": list(plan.excluded_modules),
        "libalign": libalign_note(plan),
    }


def _compressed_tensors_mxfp4_config(plan: ExportPlan) -> dict[str, Any]:
    """compressed-tensors' ``MXFP4A16`` scheme as its ``quantization_config`` serializes it."""
    return {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                        "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8",
                        "zp_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
        }},
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": list(plan.excluded_modules),
        "libalign": libalign_note(plan),
    }

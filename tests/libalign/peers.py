"""Adapters that call the real peer quantizers and return their raw bits.

Each adapter returns ``(packed uint8 [..., K/2], block-scale bytes uint8 [..., K/16],
outer scale fp32)`` exactly as the library produced them, in the library's own outer
convention. Nothing here re-implements a peer: it only calls its public functions the
way that library's own flow does.
"""

from __future__ import annotations

import torch


def torchao(x: torch.Tensor):
    """torchao 0.18 ``NVFP4Tensor.to_nvfp4`` with ``per_tensor_scale = amax / 2688``.

    2-D: one scale; 3-D: per-expert scales of shape [E, 1, 1] (torchao's MoE convention).
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    if x.ndim == 2:
        pts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    else:
        pts = per_tensor_amax_to_scale(torch.amax(torch.abs(x), dim=(1, 2))).view(-1, 1, 1)
    t = NVFP4Tensor.to_nvfp4(x.contiguous(), block_size=16, per_tensor_scale=pts)
    return t.qdata.view(torch.uint8), t.scale.view(torch.uint8), pts.reshape(-1)


def modelopt(x: torch.Tensor):
    """ModelOpt 0.47 ``NVFP4QTensor.quantize(x, 16)`` (dynamic, per-tensor)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt, wsf, wsf2 = NVFP4QTensor.quantize(x.clone(), 16)
    return qt._quantized_data.view(torch.uint8), wsf.view(torch.uint8), wsf2.reshape(-1)


def modelopt_dequantize(packed, scale_bytes, wsf2, shape, dtype=torch.float32):
    """ModelOpt's own (non-fast) dequantization of a packed NVFP4 weight."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt = NVFP4QTensor(torch.Size(shape), dtype, packed.clone())
    return qt.dequantize(dtype=dtype, scale=scale_bytes.view(torch.float8_e4m3fn),
                         double_scale=wsf2.reshape(()), block_sizes={-1: 16})


def torchao_dequantize(packed, scale_bytes, pts, shape, dtype=torch.float32):
    """torchao's ``NVFP4Tensor.dequantize`` of the given bits."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    pts = pts.reshape(()) if len(shape) == 2 else pts.reshape(-1, 1, 1)
    t = NVFP4Tensor(packed.clone(), scale_bytes.view(torch.float8_e4m3fn).clone(), 16,
                    torch.bfloat16, pts)
    return t.dequantize(dtype)


def _ct_scheme():
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4", targets=["Linear"])


def compressed_tensors(x: torch.Tensor):
    """compressed-tensors 0.20 NVFP4 (``nvfp4-pack-quantized``) for a 2-D weight.

    Global scale from ``generate_gparam`` over the tensor's min/max (in the weight dtype,
    as llm-compressor's min-max observer feeds it), group scales from
    ``compute_dynamic_scales_and_zp``, codes and stored scale from the NVFP4 compressor.
    On CPU every step runs compressed-tensors' eager torch fallback.
    """
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils import (
        compute_dynamic_scales_and_zp,
        generate_gparam,
    )

    scheme = _ct_scheme()
    flat = x.reshape(1, 1, -1)
    gs = generate_gparam(torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1)))
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=scheme.weights, module=None,
                                              global_scale=gs)
    sd = NVFP4PackedCompressor.compress(
        {"weight": x, "weight_scale": scale, "weight_global_scale": gs, "weight_zero_point": zp},
        scheme,
    )
    return (sd["weight_packed"].view(torch.uint8), sd["weight_scale"].view(torch.uint8),
            sd["weight_global_scale"].reshape(-1))


def compressed_tensors_dequantize(packed, scale_bytes, global_scale):
    """compressed-tensors' ``NVFP4PackedCompressor.decompress`` (returns bf16)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    sd = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale_bytes.view(torch.float8_e4m3fn),
         "weight_global_scale": global_scale.reshape(1)},
        _ct_scheme(),
    )
    return sd["weight"]

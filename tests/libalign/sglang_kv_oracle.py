"""Independent oracles of SGLang's two FP4 KV-cache writes, ported line for line from their
sources into scalar numpy float32 arithmetic (one IEEE rounding per operation), so they share
no code with libalign's spec.

``flashinfer_kv_quantize`` ports FlashInfer's exact-math FP4 quantizer,
``cvt_warp_fp16_to_fp4`` under ``DISABLE_FP4_QUANT_FAST_MATH`` (flashinfer-ai/flashinfer
``fb28d7242b3506a2348265962041acc1fb56cca4``,
``csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh`` lines 479-493, commit of the
file ``c2853079cfc6c5bdaaeb12a3c1602a4380dbe89f``), fed as SGLang 0.5.23 feeds FlashInfer its
per-layer global scale (``srt/layers/quantization/kvfp4_tensor.py``,
``NVFP4KVQuantizeUtil.quantize``: ``global_scale_inv = 1.0 / global_scale``), and the read of
``NVFP4KVQuantizeUtil.dequantize`` (``(e2m1 * block_scale) * global_scale``).

``sglang_block16_quantize`` ports ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` (same file)
as ``torch.compile`` runs it: every step in fp32.
"""

from __future__ import annotations

import math

import numpy as np
import torch

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3(v: np.float32) -> tuple[int, np.float32]:
    """``__nv_fp8_e4m3(v)`` (round to nearest even, saturating to 448): byte and value."""
    t = torch.tensor([min(float(v), 448.0)], dtype=torch.float32).to(torch.float8_e4m3fn)
    return int(t.view(torch.uint8)), F(t.to(torch.float32).item())


def _e2m1_rn(z: np.float32) -> int:
    """``cvt.rn.satfinite.e2m1x2.f32`` of one value: nearest, ties to even, saturate to 6; the
    sign bit is the input's (so -0.0 and tiny negatives give 0x8)."""
    a = min(abs(float(z)), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))  # tie: even code
    return best | (8 if math.copysign(1.0, float(z)) < 0 else 0)


def flashinfer_kv_quantize(rows: torch.Tensor, g: float) -> tuple[np.ndarray, np.ndarray]:
    """``[n, K]`` rows (bf16/fp16/fp32) under decode scale ``g``: (codes ``[n, K]``, scale bytes)."""
    x = rows.to(torch.float32).numpy()
    n, k = x.shape
    sf_scale = F(1.0) / F(g)  # SGLang: 1.0 / global_scale
    fp4_max_inv = F(1.0) / F(6.0)
    codes = np.zeros((n, k), dtype=np.uint8)
    scales = np.zeros((n, k // 16), dtype=np.uint8)
    for r in range(n):
        for b in range(k // 16):
            blk = x[r, 16 * b:16 * b + 16]
            vmax = F(np.max(np.abs(blk)))
            sf_value = F(vmax * F(sf_scale * fp4_max_inv)) if vmax != 0 else F(0.0)
            byte, sf_value = _e4m3(sf_value)
            scales[r, b] = byte
            if vmax != 0:
                inner = F(sf_value * F(F(1.0) / sf_scale))
                with np.errstate(divide="ignore"):
                    out_scale = F(min(F(F(1.0) / inner), FLT_MAX))
            else:
                out_scale = F(0.0)
            for i, v in enumerate(blk):
                codes[r, 16 * b + i] = _e2m1_rn(F(v * out_scale))
    return codes, scales


def flashinfer_kv_dequantize(codes: np.ndarray, scales: np.ndarray, g: float) -> np.ndarray:
    """SGLang's read: ``(e2m1 * float(block_scale)) * global_scale`` in fp32."""
    s = torch.tensor(scales).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    vals = np.array([(-1.0 if c & 8 else 1.0) * E2M1[c & 7] for c in codes.reshape(-1)],
                    dtype=np.float32).reshape(codes.shape)
    return (vals * np.repeat(s, 16, axis=-1)).astype(np.float32) * F(g)


def sglang_block16_quantize(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``batched_quantize`` of ``[n, K]`` rows as compiled (fp32 steps): (codes, scale bytes)."""
    x = rows.to(torch.float32).numpy()
    n, k = x.shape
    bounds = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    codes = np.zeros((n, k), dtype=np.uint8)
    scales = np.zeros((n, k // 16), dtype=np.uint8)
    floor = F(1e-10)
    for r in range(n):
        for b in range(k // 16):
            blk = x[r, 16 * b:16 * b + 16]
            q = max(F(F(np.max(np.abs(blk))) / F(6.0)), floor)
            e = math.ceil(float(np.float32(math.log2(float(q)))))  # fp32 log2, then ceil
            scales[r, b] = e + 127
            for i, v in enumerate(blk):
                z = F(v / F(2.0 ** e))
                mag = sum(abs(float(z)) >= t for t in bounds)
                codes[r, 16 * b + i] = mag | (8 if z < 0 else 0)
    return codes, scales

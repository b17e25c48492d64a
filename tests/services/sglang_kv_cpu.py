"""Run with SGLang on PYTHONPATH (tests/services/test_sglang_kv.py): SGLang's own FP4 KV-cache
code on the CPU against libalign's KV presets.

* ``FP4MXBlock16KVCacheMethod.quantize_and_store`` (``--kv-cache-dtype fp4_mx_block16``, which
  calls ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` under ``torch.compile``, as SGLang
  runs it) writes K and V rows of bf16, fp16 and fp32 caches full of exact ties, zero and -0.0
  blocks, tiny and huge blocks, block maxima next to powers of two; its buffers equal
  ``kv_sglang_fp4_mx_block16``'s codes and bytes bit for bit, and its read
  (``dequantize_kv_tensor``) equals libalign's dequantize;
* its ``compute_cell_size`` equals libalign's bytes a token;
* SGLang's registry names the two presets' ``--kv-cache-dtype`` values, and
  ``NVFP4KVCacheMethod.load_scales_from_model`` picks the per-layer global scales libalign's
  ``KVScales.from_checkpoint`` picks (checkpoint scale, 1.0 where a layer has none).

Prints one ``ok ...`` line per check; the eager (uncompiled) function's differences are
printed for information (it rounds its scale arithmetic to bf16).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

# see tests/services/sglang_quant_cpu.py: torchvision's fake kernels need these schemas
_tv = torch.library.Library("torchvision", "FRAGMENT")
_tv.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_tv.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (  # noqa: E402
    KV_CACHE_QUANT_REGISTRY,
    FP4MXBlock16KVCacheMethod,
    NVFP4KVCacheMethod,
)
from sglang.srt.layers.quantization.kvfp4_tensor import FP4MXBlock16KVQuantizeUtil  # noqa: E402

from libalign.models.kv_cache import KVScales  # noqa: E402
from libalign.spec import PRESETS, dequantize, quantize  # noqa: E402
from libalign.spec.presets import SGLANG_KV_DTYPES  # noqa: E402

MX16 = PRESETS["kv_sglang_fp4_mx_block16"]


def cache_rows(dtype: torch.dtype, tokens: int = 96, heads: int = 4, dim: int = 64) -> torch.Tensor:
    """``[tokens, heads, dim]`` K rows rich in the cases where quantizers disagree."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, heads, dim, generator=g) * torch.logspace(-12, 30, tokens).reshape(-1, 1, 1)
    x[0] = 0
    x[1, 0] = -0.0
    k = torch.randint(-20, 20, (tokens, heads, 1), generator=g).float()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    t = mids[torch.randint(0, 8, (tokens, heads, dim), generator=g)]
    t = t * torch.where(torch.rand(tokens, heads, dim, generator=g) < 0.5, -1.0, 1.0)
    t[..., ::16] = 6.0
    x[2:40] = (t * 2.0 ** k)[2:40]
    x[40:60, :, ::16] = 6.0 * 2.0 ** k[40:60] * (1 + 2.0 ** -7)
    x[60:70, :, ::16] = 1.5 * 2.0 ** k[60:70]
    x[70:74] = torch.randn(4, heads, dim, generator=g) * 1e-40
    if dtype == torch.float32:
        x[74:80, :, ::16] = 6.0 * 2.0 ** k[74:80] * (1 + 2.0 ** -22)
        x[80:84, :, ::16] = 6.0 * 2.0 ** k[80:84] * (1 + 2.0 ** -20)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


def check_block16() -> None:
    method = FP4MXBlock16KVCacheMethod()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        k = cache_rows(dtype)
        v = -k.flip(0)
        t, h, d = k.shape
        buf = method.create_buffers(t + 4, h, d, 1, "cpu")
        loc = torch.arange(2, t + 2)
        method.quantize_and_store(buf["k_buffer"][0], buf["v_buffer"][0], buf["k_scale_buffer"][0],
                                  buf["v_scale_buffer"][0], loc, k, v)
        for name, x in (("k", k), ("v", v)):
            q = quantize(x.reshape(t * h, d), MX16)
            codes = buf[f"{name}_buffer"][0][loc].view(torch.uint8)
            scales = buf[f"{name}_scale_buffer"][0][loc].view(torch.uint8)
            assert torch.equal(codes, q.codes.reshape(t, h, d // 2)), (dtype, name, "codes")
            assert torch.equal(scales, q.block_scales.view(torch.uint8).reshape(t, h * d // 16)), \
                (dtype, name, "scales")
            read = method.dequantize_kv_tensor(buf[f"{name}_buffer"][0][loc],
                                               buf[f"{name}_scale_buffer"][0][loc], 0,
                                               dtype=torch.float32)
            assert torch.equal(read, dequantize(q).reshape(t, h, d)), (dtype, name, "read")
        eager = FP4MXBlock16KVQuantizeUtil.batched_quantize._torchdynamo_orig_callable(k)
        q = quantize(k.reshape(t * h, d), MX16)
        differ = (eager[1] != q.block_scales.view(torch.uint8).reshape(t, -1)).sum().item()
        print(f"info eager {dtype}: {differ} scale bytes differ from the compiled function's")
    print("ok block16 store")
    heads, dim, layers = 4, 128, 48
    cell = method.compute_cell_size(heads, dim, layers, 1)
    per_row = dim // 2 + dim // 16
    assert cell == 2 * heads * layers * per_row, cell
    print("ok cell size")


def check_registry_and_scales() -> None:
    assert set(SGLANG_KV_DTYPES.values()) <= set(KV_CACHE_QUANT_REGISTRY), KV_CACHE_QUANT_REGISTRY
    assert KV_CACHE_QUANT_REGISTRY["nvfp4"] is NVFP4KVCacheMethod
    print("ok registry")
    layers = 3
    attn = [types.SimpleNamespace(layer_id=i, k_scale=ks, v_scale=vs)
            for i, (ks, vs) in enumerate(((0.0123, 0.5), (None, None), (1.0, 3e-3)))]
    model = types.SimpleNamespace(layers=[types.SimpleNamespace(
        self_attn=types.SimpleNamespace(attn=a)) for a in attn])
    method = NVFP4KVCacheMethod(num_layers=layers, device="cpu")
    method.load_scales_from_model(model)
    mine = KVScales.from_checkpoint({i: a.k_scale for i, a in enumerate(attn)},
                                    {i: a.v_scale for i, a in enumerate(attn)}, layers)
    assert torch.equal(method.k_scales_gpu, torch.tensor(mine.k, dtype=torch.float32)), \
        (method.k_scales_gpu, mine)
    assert torch.equal(method.v_scales_gpu, torch.tensor(mine.v, dtype=torch.float32))
    print("ok global scales")


if __name__ == "__main__":
    check_block16()
    check_registry_and_scales()

"""Pins that the spec computes the same bits on a CUDA device as on the CPU.

The spec is the oracle for the GPU kernels, so its own arithmetic must not depend on
the device (PyTorch lowers some ops differently on CUDA, e.g. division by a Python float).
"""

import pytest
import torch

from libalign.spec import PRESETS, dequantize, quantize
from tests.libalign import inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(inputs.FAMILIES))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cuda_bits_equal_cpu_bits(preset, family, dtype):
    """Codes, block-scale bytes, outer-scale bits and dequantized values: CUDA == CPU."""
    x = inputs.FAMILIES[family]((3, 96, 512), dtype=dtype)
    if preset == "compressed_tensors":
        x = x[0]
    spec = PRESETS[preset]
    cpu = quantize(x, spec)
    gpu = quantize(x.cuda(), spec)
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.block_scales.view(torch.uint8).cpu(), cpu.block_scales.view(torch.uint8))
    if cpu.outer_scale is None:  # MXFP4: block scales only
        assert gpu.outer_scale is None
    else:
        assert torch.equal(gpu.outer_scale.cpu().view(torch.int32),
                           cpu.outer_scale.view(torch.int32))
    d_gpu = dequantize(gpu, torch.float32).cpu()
    assert torch.equal(d_gpu.view(torch.int32), dequantize(cpu, torch.float32).view(torch.int32))


def test_stochastic_rounding_is_reproducible_on_cuda():
    """A seeded CUDA generator reproduces the codes on the device."""
    spec = PRESETS["minite"].replace(stochastic_rounding=True)
    x = torch.randn(64, 256, device="cuda")
    a = quantize(x, spec, generator=torch.Generator("cuda").manual_seed(5))
    b = quantize(x, spec, generator=torch.Generator("cuda").manual_seed(5))
    assert a.bitwise_equal(b)

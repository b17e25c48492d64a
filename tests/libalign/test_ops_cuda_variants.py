"""Every device test of ``test_ops_kernels`` again on each CUDA quantize kernel variant.

The CUDA library has two quantize kernels: a register-resident one (a group of lanes holds
a whole row; ``auto`` picks it wherever a row fits) and the shared-memory one (rows too
long for registers). ``auto`` alone would leave the second untested at the shapes the
first takes, so this module re-collects the device tests of
:mod:`tests.libalign.test_ops_kernels` (and the batched ``quantize_many`` ones of
:mod:`tests.libalign.test_ops_many`) under a ``device`` fixture that forces each variant
(:func:`libalign.kernels.cuda_kernel_variant`). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from alignclient.errors import SpecError

from libalign.kernels import native, ops
from tests.libalign.test_ops_kernels import (  # noqa: F401  (re-collected here)
    test_4over6_edge_cases_match_spec,
    test_4over6_error_order_decides_like_spec,
    test_4over6_families_match_spec,
    test_4over6_nonfinite_raises_like_spec,
    test_4over6_property_matches_spec,
    test_families_match_spec,
    test_nonfinite_raises_like_spec,
    test_nonfinite_saturate_matches_spec,
    test_out_buffers_are_reused_with_spec_bits,
    test_property_any_kernel_spec_matches,
    test_quantize_many_matches_spec_and_raises_like_quantize,
    test_rows_longer_than_shared_memory_match_spec,
    test_shape_classes_match_spec,
    test_shared_outer_amax_for_gate_and_up,
    test_swizzled_scales_equal_swizzled_spec,
    test_undefined_scale_raises_like_spec,
    test_zero_rows_and_zero_experts,
)
from tests.libalign.test_ops_many import (  # noqa: F401  (re-collected here)
    test_batch_equals_spec_per_tensor,
    test_first_flagged_tensor_raises_its_spec_error,
)


@pytest.fixture(params=[pytest.param(v, marks=pytest.mark.gpu) for v in ("staged", "registers")])
def device(request):
    """'cuda', with every quantize call served by one kernel variant."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if native.load("cuda") is None:
        pytest.fail("the CUDA kernel did not build on a machine with a CUDA device")
    with ops.cuda_kernel_variant(request.param):
        yield "cuda"


def test_variant_names_are_checked():
    """An unknown variant name is refused before anything changes."""
    variant = ops.cuda_kernel_variant("fast")
    with pytest.raises(SpecError, match="unknown CUDA kernel variant"):
        variant.__enter__()

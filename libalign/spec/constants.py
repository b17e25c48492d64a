"""Numbers that define NVFP4 and MXFP4. Numbers only: no logic, no torch.

NVFP4 stores each element as a 4-bit E2M1 float (1 sign, 2 exponent, 1 mantissa bit,
exponent bias 1, no Inf, no NaN), one FP8 E4M3 scale per 16 consecutive elements along
the last dimension, and an FP32 outer scale per tensor, per expert or per row.

MXFP4 (OCP Microscaling) stores the same E2M1 elements with one E8M0 scale (a bare
power of two, 8 exponent bits, bias 127) per 32 consecutive elements and no outer scale.
"""

# --- E2M1 (the element format) -------------------------------------------------------
#: Magnitudes of the eight non-negative E2M1 codes 0x0..0x7; code | 0x8 is the negative.
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Value of every 4-bit code 0x0..0xF (0x8 is negative zero).
E2M1_VALUES: tuple[float, ...] = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)
#: Largest E2M1 magnitude.
E2M1_MAX: float = 6.0
#: Midpoints between neighbouring magnitudes. A value exactly on a midpoint goes to the
#: neighbour whose mantissa bit is 0 (the even code): 0.25->0, 0.75->1, 1.25->1,
#: 1.75->2, 2.5->2, 3.5->4, 5->4.
E2M1_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_SIGN_BIT: int = 0x8

# --- E4M3 (the block-scale format, torch.float8_e4m3fn) -------------------------------
E4M3_MAX: float = 448.0  # 0x7E; 0x7F and 0xFF are NaN; there is no Inf
E4M3_EXPONENT_BIAS: int = 7
E4M3_MANTISSA_BITS: int = 3
E4M3_MIN_NORMAL: float = 2.0**-6  # 0x08; torch.finfo(float8_e4m3fn).tiny
E4M3_MIN_SUBNORMAL: float = 2.0**-9  # 0x01
E4M3_NAN_BITS: int = 0x7F

# --- E8M0 (the MXFP4 block-scale format, torch.float8_e8m0fnu) ----------------------
#: A byte ``b`` is the scale 2^(b - 127): 0x00 is 2^-127, 0xFE is 2^127, 0xFF is NaN.
E8M0_EXPONENT_BIAS: int = 127
E8M0_NAN_BITS: int = 0xFF
#: floor(log2(6)): the exponent of E2M1's largest power of two, 4 = 2^2. OCP's scale is
#: 2^(floor(log2(amax)) - 2).
E2M1_MAX_POW2: int = 2
MX_BLOCK_SIZE: int = 32

# --- blocks and the outer scale ------------------------------------------------------
BLOCK_SIZE: int = 16
#: E4M3_MAX * E2M1_MAX: the outer encode scale maps a tensor's (row's) amax to 2688 so
#: that the largest block scale lands on 448.
FP8_TIMES_FP4_MAX: float = E4M3_MAX * E2M1_MAX
FLT_MAX: float = 3.4028234663852886e38
#: miniTE's floor on the row maximum before forming the encode scale.
MINITE_AMAX_FLOOR: float = 1e-12

# --- scale layouts -------------------------------------------------------------------
#: The 128x4 swizzle used by cuBLAS / CUTLASS block-scaled GEMMs: a tile of 128 rows by
#: 4 scale columns is stored as 512 contiguous bytes, rows interleaved 32 x 4.
SWIZZLE_ROWS: int = 128
SWIZZLE_COLS: int = 4

# --- the fixed 16-point Hadamard transform -------------------------------------------
HADAMARD_SIZE: int = 16
#: Fixed sign mask applied before the transform (the one TransformerEngine publishes).
HADAMARD_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

"""float8 e4m3 K/V storage on the host: the format, and the NumPy quantisation and dequantisation.

The format is OCP's E4M3 ("e4m3fn", CUDA's ``__nv_fp8_e4m3``): sign, 4 exponent bits (bias 7),
3 mantissa bits, no infinities, largest finite value 448, NaN = ``S.1111.111``. NumPy has no
float8, so planes hold the bits as uint8 (on the host and on the device alike).

Scales are float32, one per (layer, KV head) for K and one for V: a stored value ``b`` means
``VALUES[b] * scale``. Quantising ``x`` stores ``round(float32(x) / scale)`` in e4m3: the quotient
rounded to float32 (IEEE division), then to the nearest e4m3 value, ties to even, saturating at
+-448 (infinities too). A NaN is stored as the NaN ``0x7F`` (whatever its sign), so a NaN written
into the cache reads back as NaN, as it would from an fp16 cache, rather than as a plausible
number. The device's ``write_kv`` (``cuda_src/write.cu``) computes the same bits.
"""

import numpy as np

MAX = 448.0
NAN_BITS = 0x7F


def _values() -> np.ndarray:
    """The float64 value of every byte (NaN at 0x7F and 0xFF)."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = np.where(bits & 0x80, -magnitude, magnitude)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values


VALUES = _values()
_POSITIVE = VALUES[:0x7F]  # codes 0..126 ascending: 0, the subnormals, the normals up to 448


def quantise(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The e4m3 bits (uint8, x's shape) of ``x`` [..., kv_heads, head_dim] with float32 ``scale``
    [kv_heads] (see the module's docstring for the rounding, saturation and NaN)."""
    y = np.asarray(x).astype(np.float32) / np.asarray(scale, np.float32)[:, None]
    a = np.abs(y).astype(np.float64)
    hi = np.clip(np.searchsorted(_POSITIVE, a), 1, 0x7E)
    lo = hi - 1
    below, above = a - _POSITIVE[lo], _POSITIVE[hi] - a
    code = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= MAX, 0x7E, code)
    bits = (code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)
    bits[np.isnan(y)] = NAN_BITS
    return bits


def dequantise(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Float64 values of FP8 ``bits`` [..., kv_heads, block_size, head_dim] with float32 ``scale``
    [kv_heads]: exact (a 4-bit mantissa times a float32 fits a float64)."""
    return VALUES[bits] * np.asarray(scale, np.float64)[:, None, None]

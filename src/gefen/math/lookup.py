"""O(1) nearest-code search: exact decision thresholds plus a 4096-bucket lookup table (algorithm.md §4.9).

The nearest-code rule of §4.8 (``gefen.math.codebook.nearest_code``: lower bound, then the fp32 distance
comparison with ties to the lower index) is a monotone step function of the fp32 input ``u`` on ``[-1, 1]``.
So it is fully described by ``K - 1`` fp32 *thresholds* ``t_k = max{u : nearest(u) <= k}``, found once per
codebook by bisection over the ordered fp32 bit patterns using that very rule, and then
``nearest(u) = #{k : t_k < u}``. Counting is O(1): the bucket ``b = clamp(floor((u + 1)·2048), 0, 4095)``
(fp32) tells how many thresholds lie in earlier buckets (``lut[b]``), and at most ``steps`` further compares
against thresholds inside bucket ``b`` finish the count. Because the thresholds come from the reference rule
itself, the result equals ``nearest_code`` for every fp32 ``u`` in ``[-1, 1]``, bit for bit, including within
one ulp of a midpoint (where a plain "compare with the midpoint" shortcut would flip).

Values outside ``[-1, 1]`` never occur (``u = m / max|m|``) and are clamped to the end codes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from gefen.math.codebook import nearest_code

__all__ = ["LOOKUP_BUCKETS", "NearestCodeTable", "build_nearest_table", "nearest_code_fast", "gather"]

#: Number of buckets over ``[-1, 1]`` (bucket width 2**-11), as in algorithm.md §4.9.
LOOKUP_BUCKETS = 4096


class NearestCodeTable(NamedTuple):
    """Everything :func:`nearest_code_fast` needs for one codebook, on one device.

    Attributes:
        thresholds: (K - 1 + steps,) fp32; ``t_k`` ascending, padded with ``+inf``.
        lut: (4097,) int32; ``lut[b]`` = number of thresholds whose bucket is ``< b``.
        steps: maximum number of thresholds below 1 in one bucket (compares after the table look-up).
        codebook: (K,) fp32, the codebook the table was built from.
    """

    thresholds: Tensor
    lut: Tensor
    steps: int
    codebook: Tensor


def _bucket(v: Tensor) -> Tensor:
    """``clamp(floor((v + 1)·2048), 0, 4095)`` in fp32 arithmetic, as int32 (v >= -1, so trunc == floor)."""
    return (v + 1.0).mul_(LOOKUP_BUCKETS / 2).to(torch.int32).clamp_(0, LOOKUP_BUCKETS - 1)


def _ordered_key(x: Tensor) -> Tensor:
    """Map fp32 values to int64 keys with the same order (adjacent floats -> adjacent keys)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_key(key: Tensor) -> Tensor:
    bits = torch.where(key >= 0, key, (-key) | 0x80000000)
    return bits.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32).view(torch.float32)


@torch.no_grad()
def build_nearest_table(codebook: Tensor) -> NearestCodeTable:
    """Exact thresholds and bucket table of a codebook.

    Args:
        codebook: (K,) fp32, non-decreasing, ``K >= 1``, on any device.

    Returns:
        :class:`NearestCodeTable` on ``codebook.device``.

    Source: algorithm.md §4.8 (rule), §4.9 (bucket table).
    """
    cpu = codebook.detach().to("cpu", torch.float32).contiguous()
    k = cpu.numel()
    lo = _ordered_key(torch.tensor([-1.0])).expand(k - 1).clone()  # nearest(lo) <= k holds for every k
    hi = _ordered_key(torch.tensor([1.0])).expand(k - 1).clone()
    ks = torch.arange(k - 1)
    for _ in range(33):  # bisection over ~2**31 keys: lo always satisfies, hi may not
        mid = (lo + hi + 1) // 2
        ok = nearest_code(_from_key(mid), cpu) <= ks
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    thresholds = _from_key(lo)
    counts = torch.bincount(_bucket(thresholds).to(torch.int64), minlength=LOOKUP_BUCKETS)
    lut = torch.zeros(LOOKUP_BUCKETS + 1, dtype=torch.int32)
    lut[1:] = torch.cumsum(counts, 0).to(torch.int32)
    # Thresholds at +1 (trailing copies of the +1 code) are never below an input u <= 1: no compare needed.
    below_one = torch.bincount(_bucket(thresholds[thresholds < 1.0]).to(torch.int64), minlength=LOOKUP_BUCKETS)
    steps = int(below_one.max()) if k > 1 else 0
    padded = torch.cat([thresholds, torch.full((steps,), float("inf"))])
    dev = codebook.device
    return NearestCodeTable(padded.to(dev), lut.to(dev), steps, codebook.detach().to(torch.float32))


def nearest_code_fast(u: Tensor, table: NearestCodeTable) -> Tensor:
    """Nearest codebook index of every element, identical to ``nearest_code`` on ``[-1, 1]``.

    Args:
        u: fp32, any shape, values in ``[-1, 1]`` (normalised first moment), on the table's device.
        table: from :func:`build_nearest_table`.

    Returns:
        int32 indices, the shape of ``u``.

    Source: algorithm.md §4.8, §4.9.
    """
    index = gather(table.lut, _bucket(u))
    for _ in range(table.steps):
        index += gather(table.thresholds, index) < u
    return index


def gather(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` for a small 1-D table (``index_select`` is ~2x faster than advanced indexing on CPU)."""
    return torch.index_select(values, 0, index.reshape(-1)).view(index.shape)

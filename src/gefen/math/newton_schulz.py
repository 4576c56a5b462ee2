"""Muon's orthogonalisation: the quintic Newton–Schulz iteration in bf16, its schedules, NorMuon and the
learning-rate shape ratio.

Symbols (algorithm.md §7): ``U`` the (Nesterov) momentum of a 2-D parameter ``(R, C)``, ``O = NS(U)`` its
approximate orthogonalisation (singular values pushed towards 1), ``(a, b, c)`` the coefficients of one
iteration ``X <- a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "NS_SCHEDULES",
    "STANDARD_COEFFICIENTS",
    "resolve_schedule",
    "newton_schulz",
    "bf16_gemm_is_native",
    "cpu_has_bf16_gemm",
    "normuon_",
    "adjust_lr_ratio",
    "ADJUST_LR_FNS",
]

#: Coefficients of the classic Muon iteration (Jordan et al. 2024), applied ``ns_steps`` times.
STANDARD_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: Named fixed schedules (algorithm.md §7.2): each fixes its own iteration count.
NS_SCHEDULES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "tuned3": ((5.0067, -14.4125, 10.6001), (3.7534, -6.8083, 3.3840), (3.2080, -4.3501, 2.0330)),
    "tuned4": (
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    ),
}

#: Accepted ``adjust_lr_fn`` values.
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def resolve_schedule(
    ns_schedule: str | Sequence[Sequence[float]] | None,
    ns_steps: int,
    ns_coefficients: Sequence[float] | None = None,
) -> tuple[tuple[float, float, float], ...]:
    """The list of ``(a, b, c)`` iterations a ``(ns_schedule, ns_steps, ns_coefficients)`` setting means.

    Args:
        ns_schedule: ``None`` or ``"standard"`` (``ns_coefficients`` × ``ns_steps``), ``"tuned3"``,
            ``"tuned4"``, or an explicit list of 1..99 ``(a, b, c)`` triples of finite numbers.
        ns_steps: iterations of the standard schedule, ``1 <= ns_steps < 100`` (checked, then ignored, by the
            others).
        ns_coefficients: the ``(a, b, c)`` of the standard schedule, three finite numbers (``torch.optim.Muon``'s
            option; ``None``: ``STANDARD_COEFFICIENTS``). With another schedule it must be ``None`` or the
            standard triple: the two options would both choose the iteration.

    Returns:
        A tuple of float triples.

    Raises:
        ValueError: unknown name, bad ``ns_steps``, malformed or non-finite triples, empty or too long list,
            ``ns_coefficients`` other than the standard ones together with another schedule.
        TypeError: ``ns_steps`` is not an int.

    Source: algorithm.md §7.2.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(f"ns_steps={ns_steps!r} must be an int")
    if not 1 <= ns_steps < 100:  # checked under every schedule: an option never holds a value it would refuse later
        raise ValueError(f"ns_steps={ns_steps} must be in [1, 100)")
    coefficients = STANDARD_COEFFICIENTS if ns_coefficients is None else _triple(ns_coefficients, "ns_coefficients")
    if ns_schedule is None or ns_schedule == "standard":
        return (coefficients,) * ns_steps
    if coefficients != STANDARD_COEFFICIENTS:
        raise ValueError(
            f"ns_coefficients={coefficients!r} and ns_schedule={ns_schedule!r} both choose the "
            "Newton-Schulz iteration; pass one (ns_coefficients=(a, b, c) with ns_steps=k is "
            "ns_schedule=[(a, b, c)] * k)"
        )
    if isinstance(ns_schedule, str):
        if ns_schedule not in NS_SCHEDULES:
            raise ValueError(
                f"unknown ns_schedule {ns_schedule!r}; use 'standard', 'tuned3', 'tuned4' or a list of (a, b, c)"
            )
        return NS_SCHEDULES[ns_schedule]
    steps = list(ns_schedule)
    if not 1 <= len(steps) < 100:
        raise ValueError(f"an explicit ns_schedule needs 1..99 (a, b, c) triples, got {len(steps)}")
    return tuple(_triple(triple, f"ns_schedule[{i}]") for i, triple in enumerate(steps))


def _triple(triple: Sequence[float], where: str) -> tuple[float, float, float]:
    """One ``(a, b, c)`` iteration as floats.

    Raises:
        ValueError: not three finite real numbers.
    """
    try:
        values = tuple(float(x) for x in triple)
    except (TypeError, ValueError):
        values = ()
    if isinstance(triple, (str, bytes)) or len(values) != 3 or not all(math.isfinite(x) for x in values):
        raise ValueError(f"{where}={triple!r} must be three finite numbers (a, b, c)")
    return values  # type: ignore[return-value]


def bf16_gemm_is_native(device: torch.device) -> bool:
    """Whether bf16 matrix products on ``device`` run on bf16 matrix instructions.

    True on CUDA and on CPUs with AVX-512 BF16 or AMX tiles (torch's own probes); False on other CPUs (AVX2,
    plain AVX-512, ARM without a probe), where torch's bf16 GEMM falls back to a scalar loop that measured
    ~100x slower than its fp32 GEMM (1.2 vs 117 GFLOP/s, 512x512, 2-core AMD EPYC with AVX2). There
    :func:`newton_schulz` runs each product as an fp32 GEMM of the bf16 operands, rounded to bf16 once (see there).

    Args:
        device: the device of the matrices.

    Returns:
        A bool, fixed for a given machine (no timing probe, so ``deterministic=True`` runs take the same path).
    """
    return device.type != "cpu" or _CPU_BF16_GEMM


def cpu_has_bf16_gemm() -> bool:
    """torch's probes for AVX-512 BF16 or AMX tiles on this CPU (False in a torch without them). Read once at import
    into ``_CPU_BF16_GEMM``, so a compiled step reads a constant instead of calling the probes."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


_CPU_BF16_GEMM = cpu_has_bf16_gemm()


def _addmm_bf16(bias: Tensor, left: Tensor, right: Tensor, beta: float, alpha: float, native: bool) -> Tensor:
    """``beta·bias + alpha·(left @ right)`` of bf16 matrices, bf16 result: one bf16 ``addmm`` where the device has
    bf16 matrix instructions, else the same sum as an fp32 ``addmm`` of the (exactly widened) bf16 operands and
    one rounding to bf16 — what a bf16 GEMM computes (fp32 accumulation, one rounding), up to the order of the
    fp32 sums."""
    if native:
        return torch.addmm(bias, left, right, beta=beta, alpha=alpha)
    return torch.addmm(bias.float(), left.float(), right.float(), beta=beta, alpha=alpha).to(torch.bfloat16)


def newton_schulz(update: Tensor, schedule: Sequence[tuple[float, float, float]], eps: float) -> Tensor:
    """Approximately orthogonalise a matrix with the quintic Newton–Schulz iteration, in bf16.

    ``X = U / max(‖U‖_F, eps)`` (on the wide orientation, rows <= cols), then per ``(a, b, c)``:
    ``A = X·Xᵀ``, ``M = b·A + c·A·A`` (one ``addmm``), ``X = a·X + M·X`` (one ``addmm``) — the grouping of
    algorithm.md §7.2, which matters in bf16. ``X``, ``A`` and ``M`` are bf16 values throughout; each product
    accumulates in fp32 and rounds to bf16 once. On a CPU without bf16 matrix instructions
    (:func:`bf16_gemm_is_native` False) the products run as fp32 GEMMs of the bf16 operands followed by that one
    rounding: the same values up to the order of the fp32 sums (a few elements per 10⁴ differ by one bf16 ulp per
    product, as between two GPU models), ~30x faster than torch's bf16 GEMM there (0.29 s → 0.011 s for a
    256x256 matrix, 5 iterations).

    Args:
        update: (R, C) any floating dtype.
        schedule: iterations from :func:`resolve_schedule`.
        eps: > 0; floor of the Frobenius norm (an all-zero input gives zeros, not NaN).

    Returns:
        (R, C) bf16.

    Source: Jordan et al. 2024 (Muon); algorithm.md §7.2.
    """
    native = bf16_gemm_is_native(update.device)
    x = update.to(torch.bfloat16)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.mT
    x = x / x.norm().clamp_min(eps)
    for a, b, c in schedule:
        gram = x @ x.mT if native else (x.float() @ x.float().mT).to(torch.bfloat16)
        poly = _addmm_bf16(gram, gram, gram, b, c, native)
        x = _addmm_bf16(x, poly, x, a, 1.0, native)
    return x.mT if transposed else x


def normuon_(
    update: Tensor,
    v: Tensor,
    step: int | Tensor,
    beta: float,
    eps: float,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """NorMuon row normalisation of an orthogonalised update, in place; updates the row second moment.

    ``n_r = ‖O_r‖₂`` (fp32); ``v_r <- β·v_r + (1−β)·n_r²/C``; ``d_r = sqrt(v_r / (1 − β^t)) + ε``;
    ``φ = sqrt(Σ n_r²) / max(sqrt(Σ (n_r/d_r)²), tiny)``; ``O_r <- O_r · φ / d_r``. ``φ`` restores the
    Frobenius norm of ``O``, so the lr calibration of ``adjust_lr_fn`` is unchanged.

    Args:
        update: (R, C) ``O`` (bf16 or fp32), modified in place.
        v: (R,) fp32 row EMA, modified in place.
        step: NorMuon counter after increment (``t >= 1``): an int, or a 0-dim float64 device tensor
            (``capturable=True``; same float64 arithmetic, no host read).
        beta: ``β ∈ [0, 1)``.
        eps: ``ε > 0``.
        reduce: for a matrix whose rows are split over ranks (``update`` and ``v`` hold this rank's rows): sums
            the fp32 ``(2,)`` tensor ``[Σ n_r², Σ (n_r/d_r)²]`` over the ranks in place, so ``φ`` is the full
            matrix's; ``None`` for a whole matrix.

    Returns:
        ``update``.

    Source: algorithm.md §7.4.
    """
    norms = update.float().norm(dim=1)
    v.mul_(beta).add_(norms.square() / update.shape[1], alpha=1.0 - beta)
    denom = (v / (1.0 - beta**step)).sqrt_().add_(eps)
    sums = torch.stack([norms.square().sum(), (norms / denom).square().sum()])
    if reduce is not None:
        sums = reduce(sums)
    scaled = sums[1].sqrt().clamp_min(1.1754943508222875e-38)
    phi = sums[0].sqrt() / scaled
    return update.mul_((phi / denom).unsqueeze(1).to(update.dtype))


def adjust_lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Shape factor applied to Muon's lr: ``η_adj = η·ratio``.

    Args:
        adjust_lr_fn: ``None``/``"original"`` → ``sqrt(max(1, R/C))``; ``"match_rms_adamw"`` →
            ``0.2·sqrt(max(R, C))`` (update RMS comparable to AdamW's).
        rows, cols: ``R``, ``C`` of the parameter.

    Returns:
        The ratio (float).

    Raises:
        ValueError: another ``adjust_lr_fn``.

    Source: algorithm.md §7.6.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} must be None, 'original' or 'match_rms_adamw'")

"""``Gefen``: the AdamW drop-in with an 8-bit codebook first moment and a block-shared or factored second moment."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gefen.errors import StepError
from gefen.hyperparams import as_float, refuse_torch_only_options
from gefen.math.codebook import (
    CODEBOOK_SIZE,
    HISTOGRAM_BINS,
    accumulate_histogram_,
    fit_codebook,
    zero_code_index,
)
from gefen.math.lookup import NearestCodeTable, build_nearest_table
from gefen.math.moments import (
    apply_update_,
    bias_correction,
    block_second_moment_,
    block_step_size,
    factored_denominator,
    factored_root_parts,
    factored_second_moment_,
    update_quantized_moment,
)
from gefen.math.period import find_period
from gefen.optim._base import GefenOptimizer, WorkItem
from gefen.state import STEP, ParamState, SecondMomentKind, init_state, is_factorable

__all__ = ["Gefen"]

#: Elements per chunk of the update on the CPU (rounded to whole blocks/rows): small enough for the cache.
_CHUNK_ELEMENTS = 1 << 17
#: The same on accelerators, where each pass is a kernel launch: large enough to keep launches few.
_CHUNK_ELEMENTS_ACCELERATOR = 1 << 22


class Gefen(GefenOptimizer):
    r"""AdamW with ~1 byte/param of state: 8-bit codebook first moment, block or factored second moment.

    For a parameter ``p`` of ``N`` elements with block period ``P`` (``B = N / P`` blocks, row-major), at its
    ``t``-th update with gradient ``g`` (everything in fp32):

    .. math::

        v &\leftarrow \beta_2 v + (1-\beta_2)\,\overline{g^2}
            \quad\text{(per block; or Adafactor rows/cols for 2-D, default)}\\
        m &= \operatorname{lerp}(c[\mathrm{idx}]\,a,\; g,\; 1-\beta_1),\quad
            a_b = \max_{j\in b}|m_j|,\quad \mathrm{idx} = \operatorname{nearest}(c, m/a)\\
        \hat m &= c[\mathrm{idx}]\,a,\qquad
        s = \frac{1/(1-\beta_1^t)}{\sqrt{v/(1-\beta_2^t)} + \epsilon}\\
        p &\leftarrow p\,(1-\eta\lambda) - \eta\, s\, \hat m

    with ``η = lr``, ``(β1, β2) = betas``, ``ε = eps``, ``λ = weight_decay``, ``c`` the 256-entry fp32 codebook,
    ``idx`` the stored uint8 codes and ``a`` the stored fp32 per-block magnitudes. Differences from AdamW: the
    update uses the re-quantized first moment ``m̂`` (not the exact EMA), and the second moment is shared per block
    (or factored). Source: arXiv 2606.13894; algorithm.md §6.2, §6.4 and the decisions of §13.

    The first ``step()`` that sees gradients does two things once, before any update:

    * **period search** per parameter from its first gradient (algorithm.md §3.2 + the §3.4 fallback); the
      period is frozen and checkpointed. A parameter that first gets a gradient later is searched then, and
      starts its own bias-correction warm-up (per-parameter ``step`` counters).
    * **codebook**: one 256-code fp32 codebook per optimizer, fitted by exact optimal 1-D k-means on the
      4096-bin histogram of block-normalised gradients of every parameter with a gradient, ±1 pinned and an
      exact 0 code (algorithm.md §4, §13.2, §13.10). Frozen and checkpointed.

    State per parameter (see :mod:`gefen.state`): uint8 codes ``(B, P)``, fp32 magnitudes ``(B,)``, fp32 second
    moment ``(B,)`` or ``(R,) + (C,)`` when factored, int64 ``step`` and ``period``: about
    ``1 + 4/P + 4(R+C)/N`` bytes/param for factored 2-D weights and ``1 + 8/P`` for block tensors.

    Args:
        params: iterable of tensors, of ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or of
            param-group dicts. Caller's groups are kept; per-group ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``factored_v_2d`` are honoured.
        lr: η, float ``>= 0`` or a 1-element tensor. Recommended: about 0.6–1× your tuned AdamW lr (see the
            README's lr rule).
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        eps: ε, finite and ``> 0``; added to the bias-corrected root as in AdamW.
        weight_decay: λ ``>= 0``, decoupled (``p ← p·(1 − ηλ)``).
        factored_v_2d: factored (Adafactor row/column) second moment for 2-D parameters whose statistics cost
            at most 0.5 byte/param (``8·(R + C) <= R·C``; thin matrices keep the block form); ``False`` uses one
            value per block for every tensor.
        **torch_options: ``torch.optim.AdamW`` options, accepted only at their "off" value (``maximize=False``,
            ``amsgrad=False``, ``capturable=False``, ``differentiable=False``, ``foreach``/``fused`` ``None`` or
            ``False``) so AdamW call sites keep working; anything else is refused.

    Raises:
        ConfigError: (a ``ValueError``) invalid hyperparameters, empty, complex or duplicate parameters, an
            AdamW option Gefen does not implement (e.g. ``maximize=True``).
        TypeError: ``params`` is a single tensor or holds a non-tensor; ``factored_v_2d`` is not a bool; an
            unknown keyword argument.

    Example:
        >>> import torch, gefen
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = gefen.Gefen(model.named_parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss = model(torch.randn(16, 64)).square().mean()
        >>> loss.backward()
        >>> opt.step()
        >>> row = opt.state_report()[0]  # the (32, 64) weight
        >>> row["name"], row["second_moment"], 2048 % row["period"] == 0
        ('weight', 'factored', True)
    """

    kind = "Gefen"

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        factored_v_2d: bool = True,
        **torch_options: Any,
    ) -> None:
        refuse_torch_only_options("Gefen", torch_options)
        if not isinstance(factored_v_2d, bool):
            raise TypeError(f"Gefen factored_v_2d={factored_v_2d!r} must be a bool (True or False).")
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, list) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "factored_v_2d": factored_v_2d,
        }
        super().__init__(params, defaults)

    def _second_moment_kind(self, param: Tensor, group: Mapping[str, Any]) -> SecondMomentKind:
        return "factored" if group.get("factored_v_2d", True) and is_factorable(tuple(param.shape)) else "block"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; it runs first, with
                gradients enabled.

        Returns:
            The closure's return value, or ``None``.

        Raises:
            StepError: a gradient is sparse, complex, of another shape or device, or (on a parameter's first
                update) not finite in fp32. Nothing has been changed when it is raised.
            ConfigError: a param group's hyperparameter became invalid.
        """
        loss = self._evaluate_closure(closure)
        plan = self._prepare()
        fresh = [item for work in plan for item in work if not self._has_state(item.param)]
        periods = self._search_periods(fresh)  # also refuses non-finite first gradients
        starting = [item for item in fresh if id(item.param) in periods]
        if self._codebook is None and starting:
            self._set_codebook(self._learn_codebook(starting, periods))
        if not any(plan):
            return loss
        zero_code = zero_code_index(self._codebook) if starting else 0
        for group, work in zip(self.param_groups, plan):
            for item in work:
                if not self._has_state(item.param):
                    if id(item.param) not in periods:  # all-zero first gradient: only the decoupled decay
                        zero = torch.zeros((), device=item.param.device).expand(item.param.shape)
                        decay = as_float(group["weight_decay"])
                        apply_update_(item.param, zero, as_float(group["lr"]), decay, 0.0)
                        continue
                    kind = self._second_moment_kind(item.param, group)
                    self.state[item.param] = init_state(item.param, periods[id(item.param)], kind, zero_code)
                self._update(item, group)
        self._global_step += 1
        return loss

    def _has_state(self, param: Tensor) -> bool:
        # ``self.state`` is a defaultdict: a mere read (``opt.state[p]``) creates an empty entry.
        return STEP in self.state.get(param, ())

    def _search_periods(self, fresh: list[WorkItem]) -> dict[int, int]:
        """Period of every parameter starting now, from its first non-zero gradient.

        A parameter whose gradient is exactly zero everywhere carries no information for the period search or
        the codebook: it gets no state yet (its first moment and second moment would both stay 0) and starts at
        its first non-zero gradient. Refuses gradients that are not finite in fp32 before anything changes.
        """
        periods = {}
        for item in fresh:
            g32 = item.grad.to(torch.float32)
            if not bool(torch.isfinite(g32).all()):
                raise StepError(
                    f"Gefen: the first gradient of {item.name} has NaN or Inf values (in float32); the period "
                    "search and the codebook need finite gradients (use torch.amp.GradScaler, which skips such "
                    "steps, or skip the step yourself). Nothing was changed."
                )
            if bool(g32.any()):
                periods[id(item.param)] = find_period(g32)
        return periods

    def _learn_codebook(self, starting: list[WorkItem], periods: dict[int, int]) -> Tensor:
        device = starting[0].grad.device
        counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=device)
        for item in starting:
            accumulate_histogram_(counts, item.grad.to(device), periods[id(item.param)])
        active = int((counts > 0).sum())
        if active < CODEBOOK_SIZE - 1:
            n_elements = sum(item.param.numel() for item in starting)
            warnings.warn(
                f"Gefen learned its codebook from the first step's gradients of only {len(starting)} parameter(s) "
                f"({n_elements} elements), which fill {active} of the 4096 histogram bins: the 8-bit first moment "
                f"will have only about {active + 2} distinct levels for the whole run. Make the first step() see "
                "representative gradients of all the parameters you train (the codebook is frozen after it).",
                stacklevel=5,  # _learn_codebook <- step <- no_grad <- torch step hooks <- caller
            )
        return fit_codebook(counts)

    def _nearest_table(self, device: torch.device) -> NearestCodeTable:
        """The nearest-code table of the codebook on ``device`` (built once per codebook and device)."""
        table = self._tables.get(device)
        if table is None:
            table = build_nearest_table(self._codebook.to(device))
            self._tables[device] = table
        return table

    def _update(self, item: WorkItem, group: Mapping[str, Any]) -> None:
        """Apply §6.2 / §6.4 to one parameter, in chunks of whole blocks (and whole rows when factored).

        Chunking bounds the transient memory to a few bytes per element of one chunk and keeps every pass in
        cache; per-block reductions never straddle a chunk, so the result does not depend on the chunk size.
        """
        state = self.state[item.param]
        view = ParamState.from_dict(state)
        beta1, beta2 = (as_float(b) for b in group["betas"])
        lr, eps, weight_decay = as_float(group["lr"]), as_float(group["eps"]), as_float(group["weight_decay"])
        table = self._nearest_table(item.param.device)
        period, numel = view.period, item.param.numel()
        view.step.add_(1)
        t = int(view.step)
        bc1, bc2 = bias_correction(beta1, t), bias_correction(beta2, t)
        grad = item.grad.reshape(-1)
        if view.kind == "factored":
            rows, cols = item.param.shape
            factored_second_moment_(
                view.second_moment_row, view.second_moment_col, grad.to(torch.float32).view(rows, cols), beta2
            )
            row_root, col_root = factored_root_parts(view.second_moment_row, view.second_moment_col, bc2)
            unit = math.lcm(period, cols)
        else:
            unit = period
        target = _CHUNK_ELEMENTS if item.param.device.type == "cpu" else _CHUNK_ELEMENTS_ACCELERATOR
        chunk = max(unit, (target // unit) * unit)
        work = item.param.view(-1) if item.param.is_contiguous() else item.param.reshape(-1).clone()
        for start in range(0, numel, chunk):
            stop = min(start + chunk, numel)
            blocks = slice(start // period, stop // period)
            g_blocks = grad[start:stop].to(torch.float32).view(-1, period)
            moment = update_quantized_moment(view.codes[blocks], view.scale[blocks], g_blocks, table, beta1)
            if view.kind == "factored":
                denominator = factored_denominator(row_root[start // cols : stop // cols], col_root, eps)
                direction = moment.m_hat.view(-1).div_(denominator.view(-1))
                scale = 1.0 / bc1
            else:
                v = block_second_moment_(view.second_moment[blocks], g_blocks, beta2)
                direction = moment.m_hat.mul_(block_step_size(v, bc1, bc2, eps))
                scale = 1.0
            view.codes[blocks] = moment.codes
            view.scale[blocks] = moment.scale
            apply_update_(work[start:stop], direction, lr, weight_decay, scale)
        if work.data_ptr() != item.param.data_ptr():
            item.param.copy_(work.view_as(item.param))

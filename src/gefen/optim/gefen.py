"""``Gefen``: the AdamW drop-in with an 8-bit codebook first moment and a block-shared or factored second moment."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gefen._warnings import warn_user
from gefen.amp import unusable_names, usable_flags
from gefen.checkpoint import StagedLoad
from gefen.errors import ConfigError, StepError
from gefen.hyperparams import as_float
from gefen.kernels import auto_backend, group_backend, native_status, native_supports
from gefen.kernels.compiled import (
    COMPILED_DTYPES,
    KernelSignature,
    as_float32,
    compile_supported,
    constants_on,
    fused_by_default,
    host_only,
    kernel_grad,
    lerp_high,
)
from gefen.kernels.fused import fused_step_, lookup_table_as_float
from gefen.kernels.scalars import APPLY, StepScalars
from gefen.math.codebook import (
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
    sharded_factored_second_moment_,
    update_quantized_moment,
)
from gefen.nonfinite import PendingCheck
from gefen.optim._base import GefenOptimizer, StepSkip, WorkItem
from gefen.optim._capture import capturing, check_capture, check_not_inference
from gefen.optim._first_step import FirstHistogram, checkable_in_histogram, search_periods
from gefen.optim._native import run_native_jobs
from gefen.sharding import (
    all_reduce_,
    collective_device,
    init_sharded_state,
    local_state,
)
from gefen.state import (
    STEP,
    ParamState,
    SecondMomentKind,
    init_state,
    second_moment_kind,
)

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

    * **period search** per parameter from its first gradient (algorithm.md §3.2 + the §3.4 fallback), then the
      one block rule of every parameter, sharded or not (:func:`gefen.math.period.row_aligned_period`): a block
      never straddles a row (dim-0 slice), and a 1-D parameter has one-element blocks. The period is frozen and
      checkpointed. A parameter that first gets a gradient later is searched then, and starts its own
      bias-correction warm-up (per-parameter ``step`` counters).
    * **codebook**: one 256-code fp32 codebook per optimizer, fitted by exact optimal 1-D k-means on the
      4096-bin histogram of block-normalised gradients of every parameter with a gradient, ±1 pinned and an
      exact 0 code (algorithm.md §4, §13.2, §13.10). Frozen and checkpointed.

    State per parameter (see :mod:`gefen.state`): uint8 codes ``(B, P)``, fp32 magnitudes ``(B,)``, fp32 second
    moment ``(B,)`` or ``(R,) + (C,)`` when factored, int64 ``step`` and ``period``: about
    ``1 + 4/P + 4(R+C)/N`` bytes/param for factored 2-D weights, ``1 + 8/P`` for block tensors and 9 for 1-D
    ones. Under FSDP2 (``Shard(0)`` DTensors) each rank holds its rows of every state tensor (the factored column
    moment whole) and the step is the single-process step (:mod:`gefen.sharding`).

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
        backend: how the update runs (:mod:`gefen.kernels`; all give the same codes and magnitudes, second
            moments equal up to the summation order). ``"auto"`` (default): the native C kernels on the CPU
            (:mod:`gefen.kernels.native`; one warning and the eager step where the library is missing), the compiled
            step on CUDA, the eager step otherwise (float64, other devices). ``"native"``: require the native
            kernels (``ConfigError`` at construction where they cannot run). ``"compiled"``: one
            ``torch.compile``\ d kernel per parameter signature (inductor C++ on CPU / Triton on CUDA; compile time
            once per signature, reported by :attr:`compile_time_s`; ``StepError`` before any change if a kernel fails
            to compile). ``"eager"``: the torch reference (:mod:`gefen.kernels.reference`). Per param group too.
        fused: deprecated alias of ``backend``: ``True`` is ``"compiled"``, ``False`` is ``"eager"``, ``None`` leaves
            ``backend`` as given; a value that contradicts an explicit ``backend`` is refused (``ConfigError``).
        deterministic: bit-identical results for identical inputs on the same hardware and thread count,
            including the first step (period search, codebook). Every reduction of ours already runs in a fixed
            order (integer histograms, no float atomics); this flag additionally builds compiled kernels with
            inductor's ``deterministic`` option, refuses non-finite gradients by default (``nonfinite="raise"``;
            ``"skip"`` is allowed) and is recorded in checkpoints: loading a checkpoint saved under the other
            policy is refused.
        capturable: per-step values live on the device (step counters int64 on the parameter's device, a tensor
            ``lr`` is read on device, the global step is a device counter), so ``step()`` makes no host sync after
            its first call and can be traced by ``torch.compile(fullgraph=True)`` or captured in a CUDA graph.
            The first step of a parameter (period search, codebook) is host-driven: run at least one eager
            step before capturing; a parameter seen for the first time under capture is refused.
        nonfinite: what a step does when a gradient holds NaN/Inf (see :mod:`gefen.nonfinite`). ``"skip"`` (the
            default): the step changes nothing at all (parameters, state, codebook, counters, global step), warns
            naming the parameters and counts itself in :attr:`skipped_steps` (saved in checkpoints). ``"raise"``:
            refuse it (``StepError``, nothing changed; the default under ``deterministic=True``).
            ``"propagate"`` (old name ``"ignore"``): let them through like ``torch.optim.AdamW``; a parameter's
            first gradient is still checked (the period search and codebook need finite values); the default
            under ``capturable=True``, which refuses the other two. On a steady step the step applies the policy
            itself before its first write (the CPU's native library in its own passes; the compiled kernels under
            ``"skip"`` on the device, the skip then counted and warned about when the host next looks, see
            :mod:`gefen.nonfinite`); otherwise one min/max reduction per gradient and one host read per step.
        **torch_options: ``torch.optim.AdamW`` options, accepted only at their "off" value (``maximize=False``,
            ``amsgrad=False``, ``differentiable=False``, ``foreach`` ``None`` or ``False``) so AdamW call sites
            keep working; anything else is refused.

    Mixed precision: ``torch.amp.GradScaler`` works unchanged. fp32/bf16 gradients take the scaler's ordinary
    path; true fp16 gradients use the optimizer-side protocol (:mod:`gefen.amp`): an overflow step changes
    nothing at all (no codebook, period, counter, state or parameter).

    Raises:
        ConfigError: (a ``ValueError``) invalid hyperparameters, empty, complex or duplicate parameters, an
            AdamW option Gefen does not implement (e.g. ``maximize=True``), an unknown ``nonfinite``, or a policy
            combination that cannot be honoured (``deterministic=True`` with ``nonfinite="propagate"``;
            ``capturable=True`` with ``deterministic=True`` or ``nonfinite="skip"``/``"raise"``, which need a
            host read).
        TypeError: ``params`` is a single tensor or holds a non-tensor; ``factored_v_2d``, ``deterministic`` or
            ``capturable`` is not a bool; an unknown keyword argument.

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
    #: Its step can apply the ``nonfinite`` policy itself (see :meth:`_defers_finite_check`).
    _checks_finite_in_step = True

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        factored_v_2d: bool = True,
        backend: str = "auto",
        fused: bool | None = None,
        deterministic: bool = False,
        capturable: bool = False,
        nonfinite: str | None = None,
        **torch_options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, list) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "factored_v_2d": factored_v_2d,
        }
        self._init_optimizer(
            params,
            defaults,
            flags={"factored_v_2d": factored_v_2d},
            backend=backend,
            fused=fused,
            deterministic=deterministic,
            capturable=capturable,
            nonfinite=nonfinite,
            torch_options=torch_options,
        )

    def _publish_load(self, staged: StagedLoad) -> None:
        """Publish a load, keeping each group's live ``backend`` and ``fused``: saved hyperparameters win as in
        ``torch.optim``, but these say how this process runs the step, not how the run trains (every path gives the same
        state), so a checkpoint never switches them."""
        live = [(group.get("backend"), group.get("fused")) for group in self.param_groups]
        super()._publish_load(staged)
        for group, (backend, fused) in zip(self.param_groups, live):
            group["backend"], group["fused"] = backend, fused

    def _check_group_tensors(self, group: Mapping[str, Any], tensors: list[Tensor], where: str) -> None:
        backend = group_backend(group)
        if backend == "auto" and any(tensor.device.type == "cpu" for tensor in tensors):
            native_status()  # load the native library now (~1 ms, once per process), not inside the first step
        if backend == "native":
            for i, tensor in enumerate(tensors):
                reason = native_supports(tensor, tensor.dtype)
                if reason:
                    raise ConfigError(
                        f"{where}['params'][{i}]: backend='native' cannot step it: {reason}. Pass backend='auto' "
                        "(native where it can, eager elsewhere) or backend='eager'."
                    )
            return
        if backend != "compiled":
            return
        if not compile_supported():
            raise ConfigError(
                f"{where}: fused=True needs torch.compile, which is not supported on this Python/platform; "
                "pass fused=None (use it where available) or fused=False."
            )
        for i, tensor in enumerate(tensors):
            if tensor.dtype not in COMPILED_DTYPES or tensor.device.type not in ("cpu", "cuda"):
                raise ConfigError(
                    f"{where}['params'][{i}] is {tensor.dtype} on {tensor.device.type}; fused=True supports "
                    "float32/bfloat16/float16 parameters on CPU and CUDA. Pass fused=None to run the others "
                    "on the eager path."
                )

    def _second_moment_kind(self, param: Tensor, group: Mapping[str, Any]) -> SecondMomentKind:
        # the same on 1 or N ranks: a row-sharded factored moment all-reduces its column statistics each step
        return second_moment_kind(self.kind, tuple(param.shape), group)

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
                update) not finite in fp32; or ``fused=True`` and a kernel could not be compiled. Nothing has
                been changed when it is raised.
            ConfigError: a param group's hyperparameter became invalid.
        """
        if self.capturable:
            return self._step(closure)
        return self._host_step(closure)

    @host_only
    def _host_step(self, closure: Callable[[], Any] | None) -> Any:
        """The ``capturable=False`` step, never traced by ``torch.compile``: it reads counters and hyperparameters
        on the host and runs its own compiled kernels (``fused``). Under ``torch.compile(opt.step)`` it runs as
        is (dynamo steps around it); under ``fullgraph=True`` dynamo refuses it before anything runs."""
        return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        check_capture(self)
        check_not_inference(self.kind)
        self._settle_pending_check()  # the previous step, if it was decided on the device
        loss, plan, skip, deferred = self._preflight(closure)  # deferred: the policy is applied below
        if skip is not None:  # GradScaler overflow or NaN/Inf under nonfinite="skip": nothing changes
            self._record_skip(skip)
            return loss
        fresh = [(item, group) for group, work in zip(self.param_groups, plan) for item in work]
        fresh = [(item, group) for item, group in fresh if not self._has_state(item.param)]
        histogram = None
        if fresh and self._codebook is None:  # learned from this step's first gradients, checking those left to it
            histogram = FirstHistogram(self._first_gradients_checked_later(plan))
        periods, bad = search_periods(fresh, histogram)
        if bad:  # a first gradient the preflight left to the histogram: nothing has changed
            self._record_skip(StepSkip(nonfinite=True, names=tuple(self._apply_finite_policy(bad))))
            return loss
        starting = [item for item, _ in fresh if id(item.param) in periods]
        codebook, codebook_warning = self._codebook, None
        if histogram is not None and starting:
            codebook, codebook_warning = histogram.codebook(starting)
        jobs = [
            (item, group)
            for group, work in zip(self.param_groups, plan)
            for item in work
            if self._has_state(item.param) or id(item.param) in periods
        ]
        kernels = self._compile_jobs(jobs, codebook, periods) if jobs and not self.capturable else {}
        check_in_native, device_flags = False, None
        if deferred:
            check_in_native, device_flags, bad = self._deferred_finite_check(jobs, kernels)
            if bad:  # checked on the host here: nothing has changed
                self._record_skip(StepSkip(nonfinite=True, names=tuple(bad)))
                return loss
        # ---- nothing above has changed the optimizer; from here on the step is applied
        if codebook is not self._codebook:
            self._set_codebook(codebook)
            if codebook_warning is not None:  # only for a codebook that is kept (not for a refused step)
                warn_user(codebook_warning)
        if not any(plan):
            return loss
        zero_code = zero_code_index(codebook) if starting else 0
        for group, work in zip(self.param_groups, plan):
            for item in work:
                if self._has_state(item.param):
                    continue
                if id(item.param) in periods:
                    kind = self._second_moment_kind(item.param, group)
                    period = periods[id(item.param)]
                    if item.shard is not None:
                        self.state[item.param] = init_sharded_state(item.target, item.shard, period, kind, zero_code)
                    else:
                        self.state[item.param] = init_state(
                            item.param, period, kind, zero_code, counters_on_device=self.capturable
                        )
                else:  # all-zero first gradient: only the decoupled decay
                    zero = torch.zeros((), device=item.target.device).expand(item.target.shape)
                    apply_update_(item.target, zero, as_float(group["lr"]), as_float(group["weight_decay"]), 0.0)
        bad = self._run_native(
            [(item, group) for item, group in jobs if kernels.get(id(item.param)) == "native"], check_in_native
        )
        if bad:  # the native call refused the step before any write: nothing has changed
            self._record_skip(StepSkip(nonfinite=True, names=tuple(self._apply_finite_policy(bad))))
            return loss
        left = self._run_compiled(
            [
                (item, group, kernels[id(item.param)])
                for item, group in jobs
                if isinstance(kernels.get(id(item.param)), KernelSignature)
            ],
            device_flags,
        )
        advance = bool(jobs)  # a step that only saw all-zero first gradients (e.g. DCP's hidden init step) did not
        if device_flags is not None:  # the global step moves when the pending check is settled
            advance = False
            on_host = self._pending_check is not None and self._pending_check.event is None
            if (left or on_host) and not self._settle_pending_check():
                return loss  # skipped: every kernel write was masked, and nothing else has run
        if self.capturable:
            for item, group in jobs:
                self._update_on_device(item, group)
        else:
            self._update_all([(i, g) for i, g in jobs if id(i.param) not in kernels or id(i.param) in left])
        if advance:
            self._advance_global_step()
        return loss

    def _deferred_finite_check(
        self, jobs: list[tuple[WorkItem, Mapping[str, Any]]], kernels: Mapping[int, KernelSignature | str]
    ) -> tuple[bool, Tensor | None, list[str]]:
        """Where a deferred ``nonfinite`` check (see :meth:`_defers_finite_check`) runs, now that the backends
        are chosen: inside the native call when every parameter steps natively; on the device under ``"skip"``
        when every parameter runs a compiled kernel on one device (the flags mask the kernels' writes, see
        :class:`gefen.nonfinite.PendingCheck`); otherwise as the host read, here, before any write.

        Returns:
            ``(check_in_native, device_flags, bad)``: ``device_flags`` (n,) bool on the device or ``None``; ``bad``
            the unusable gradients found by the host read (the step must be skipped when it is not empty).

        Raises:
            StepError: an unusable gradient under ``"raise"`` (nothing changed).
        """
        chosen = [kernels.get(id(item.param)) for item, _ in jobs]
        if all(kind == "native" for kind in chosen):
            return True, None, []
        compiled = all(isinstance(kind, KernelSignature) for kind in chosen)
        if self.nonfinite == "skip" and compiled and len({item.param.device for item, _ in jobs}) == 1:
            return False, usable_flags([item.grad for item, _ in jobs]), []
        return False, None, self._apply_finite_policy(unusable_names([(item.name, item.grad) for item, _ in jobs]))

    def _update_all(self, jobs: list[tuple[WorkItem, Mapping[str, Any]]]) -> None:
        """The eager update of ``jobs`` in order (GefenMuon overrides it to batch sharded Newton–Schulz)."""
        for item, group in jobs:
            self._update(item, group)

    def _check_fresh_under_capture(self, plan: list[list[WorkItem]]) -> None:
        fresh = [item for work in plan for item in work if not self._has_state(item.param)]
        if fresh and self.capturable and capturing():
            raise StepError(
                f"{self.kind}(capturable=True): {fresh[0].name} gets its first gradient inside a torch.compile "
                "trace or CUDA-graph capture, but a parameter's first step (period search, codebook) runs on the "
                "host. Run eager warm-up steps in which every trained parameter has a gradient, then capture."
            )

    def _update_on_device(self, item: WorkItem, group: Mapping[str, Any]) -> None:
        """``capturable=True``: one parameter's step with every per-step value computed on its device.

        The same §6.2 / §6.4 chain as the compiled kernels (:mod:`gefen.kernels.fused`), called directly so that a
        ``torch.compile`` of the whole ``step()`` fuses it and a CUDA graph can capture it; the constants come
        from :meth:`gefen.kernels.scalars.StepScalars.compiled_row_on_device` (step counter and ``lr`` read on the
        device).
        """
        view = ParamState.from_dict(self.state[item.param])
        beta1, beta2 = (as_float(b) for b in group["betas"])
        view.step.add_(1)
        factored = view.kind == "factored"
        record = StepScalars(beta1, beta2, as_float(group["eps"]), 0.0, as_float(group["weight_decay"]))
        scalars = record.compiled_row_on_device(view.step, group["lr"], factored)
        device, high = item.param.device, lerp_high(self._ema_weight(group))
        tables, steps = self._fused_tables(device), self._nearest_table(device).steps
        fused_step_(item.param, item.grad, view, scalars, tables, steps, high)

    # ------------------------------------------------------------------ compiled fast path
    def _signature(self, item: WorkItem, group: Mapping[str, Any], periods: Mapping[int, int]) -> KernelSignature:
        if self._has_state(item.param):
            view = ParamState.from_dict(self.state[item.param])
            kind, period = view.kind, view.period
        else:
            kind, period = self._second_moment_kind(item.param, group), periods[id(item.param)]
        numel = item.param.numel()
        shape = tuple(item.param.shape) if kind == "factored" else (numel // period, period)
        weight = as_float32(self._ema_weight(group))  # torch tests its lerp branch on the fp32 weight
        grad_dtype = torch.float32 if item.grad.dtype == torch.float64 else item.grad.dtype  # cast in _run_compiled
        return KernelSignature(
            "momentum" if kind.startswith("momentum") else kind,
            shape,
            period,
            item.param.dtype,
            grad_dtype,
            item.param.device.type,
            self._nearest_table(item.param.device, self._pending_codebook).steps,
            abs(weight) >= 0.5,
            self.deterministic,
        )

    def _ema_weight(self, group: Mapping[str, Any]) -> float:
        """The first-moment EMA weight ``1 − β1`` of a group (GefenMuon: ``1 − momentum``)."""
        return 1.0 - as_float(group["betas"][0])

    def _compile_jobs(
        self, jobs: list[tuple[WorkItem, Mapping[str, Any]]], codebook: Tensor | None, periods: Mapping[int, int]
    ) -> dict[int, KernelSignature | str]:
        """Choose the backend of every parameter (:mod:`gefen.kernels`: the one dispatch point) and compile new
        signatures, before any state changes.

        Returns:
            ``id(param) -> signature`` of the parameters that run compiled, ``id(param) -> "native"`` of those that
            run natively; the others run eagerly.

        Raises:
            StepError: a param group with ``fused=True`` has a signature that failed to compile.
        """
        chosen: dict[int, KernelSignature | str] = {}
        auto_choices: dict[tuple[str, torch.dtype, torch.dtype], tuple[str, str]] = {}
        self._pending_codebook = codebook
        try:
            default = fused_by_default() if any(group_backend(group) == "auto" for _, group in jobs) else False
            for item, group in jobs:
                backend = group_backend(group)
                if item.shard is not None:  # sharded parameters: this rank's rows natively, or the eager step
                    distributed = group.get("sharded_mode") == "distributed"  # GefenMuon's owner buckets: eager
                    unsupported = native_supports(item.target, item.grad.dtype)
                    if backend in ("auto", "native") and not distributed and not unsupported:
                        chosen[id(item.param)] = "native"
                    continue
                if backend == "auto":
                    key = (item.param.device.type, item.param.dtype, item.grad.dtype)
                    decided = auto_choices.get(key)  # the same answer for every parameter of this kind
                    if decided is None:
                        decided = auto_choices[key] = auto_backend(item.param, item.grad.dtype, default)
                    backend, reason = decided
                    if reason and not self._warned_native:
                        self._warned_native = True
                        warn_user(
                            f"{self.kind}: the native CPU backend is unavailable ({reason}); using the eager step "
                            "(same results, slower). backend='native' would raise instead."
                        )
                    if backend == "native":  # auto_backend chose it: native_supports holds
                        chosen[id(item.param)] = "native"
                        continue
                if backend == "native":
                    reason = native_supports(item.param, item.grad.dtype)
                    if reason:
                        raise StepError(
                            f"{self.kind}(backend='native'): {item.name} cannot run natively: {reason}. Nothing "
                            "was changed; pass backend='auto' or backend='eager'."
                        )
                    chosen[id(item.param)] = "native"
                    continue
                fused = True if backend == "compiled" and group_backend(group) == "compiled" else None
                wanted = backend == "compiled"
                if fused and not compile_supported():
                    raise StepError(
                        "Gefen(fused=True): torch.compile is unavailable or disabled here (TORCH_COMPILE_DISABLE "
                        "or torch._dynamo.config.disable). Nothing was changed; pass fused=None or fused=False."
                    )
                if not wanted or not compile_supported():
                    continue
                signature = self._signature(item, group, periods)
                if not signature.eligible():
                    if fused:
                        raise StepError(
                            f"Gefen(fused=True): {item.name} is {item.param.dtype} on {item.param.device.type}, "
                            "which the compiled step does not support (float32/bfloat16/float16 on CPU or CUDA). "
                            "Nothing was changed; put it in a param group with fused=None or fused=False."
                        )
                    continue
                try:
                    self._kernels.prepare(signature, item.param.device, self._fused_tables(item.param.device))
                except Exception as exc:
                    if fused:
                        raise StepError(
                            f"Gefen(fused=True): compiling the step of {item.name} {signature} failed: "
                            f"{type(exc).__name__}: {exc}. Nothing was changed; pass fused=None to fall back "
                            "to the eager path, or fix the torch.compile toolchain (a C++ compiler on CPU)."
                        ) from exc
                    if not self._warned_fallback:
                        self._warned_fallback = True
                        warn_user(
                            f"Gefen: torch.compile could not build the fused step ({type(exc).__name__}: {exc}); "
                            "using the eager step for the affected parameters (same results, slower)."
                        )
                    continue
                chosen[id(item.param)] = signature
        finally:
            self._pending_codebook = None
        return chosen

    def _run_native(self, jobs: list[tuple[WorkItem, Mapping[str, Any]]], check: bool = False) -> list[str]:
        """Apply the native CPU backend to ``jobs`` in one library call (see :func:`run_native_jobs`).

        Returns:
            With ``check`` (see :meth:`_defers_finite_check`), the names of the parameters whose gradients are
            unusable, and then nothing was changed; otherwise ``[]``.
        """
        if not jobs:
            return []
        return run_native_jobs(self.state, jobs, self._nearest_table(torch.device("cpu")), check)

    def _defers_finite_check(self, plan: list[list[WorkItem]]) -> bool:
        """Whether the step applies its ``nonfinite`` policy itself, after choosing the backends and before its
        first write (see :meth:`_deferred_finite_check`), instead of the preflight's host read: inside the native
        call on the CPU (one read of the gradients fewer), on the device for the compiled kernels (no host read).

        True for a steady step under ``"skip"`` or ``"raise"``: no parameter starts now (no period search, codebook
        or initial decay runs before the backends are chosen), none is sharded (ranks agree on skips before any
        step), not ``capturable``, and no :class:`gefen.GefenMuonHybrid` applied the policy already. Asked
        once per step, by the preflight.
        """
        if not self._checks_finite_in_step or self.nonfinite == "propagate" or self.capturable:
            return False
        if self.__dict__.get("_finite_checked") or not any(plan):
            return False
        return all(item.shard is None and self._has_state(item.param) for work in plan for item in work)

    def _first_gradients_checked_later(self, plan: list[list[WorkItem]]) -> frozenset[int]:
        """The parameters whose first gradients the step checks in its codebook histogram instead of the
        preflight (see :class:`gefen.optim._first_step.FirstHistogram`): one read of them fewer in a first step.

        Those starting now with a native-checkable gradient (:func:`~gefen.optim._first_step.checkable_in_histogram`)
        while the codebook is still to be learned, under ``"skip"`` or ``"raise"``, not ``capturable``, and when
        no :class:`gefen.GefenMuonHybrid` applied the policy already (GefenMuon checks in its preflight). The
        preflight asks once per step; the step asks again (the same answer: nothing changed in between).
        """
        if not self._checks_finite_in_step or self.nonfinite == "propagate" or self.capturable:
            return frozenset()
        if self._codebook is not None or self.__dict__.get("_finite_checked") or self._any_shard() is not None:
            return frozenset()
        return frozenset(
            id(item.param)
            for work in plan
            for item in work
            if not self._has_state(item.param) and checkable_in_histogram(item)
        )

    def _run_compiled(
        self, jobs: list[tuple[WorkItem, Mapping[str, Any], KernelSignature]], flags: Tensor | None = None
    ) -> set[int]:
        """Apply the compiled kernels; per-step constants of all parameters go to each device in one copy.

        ``flags`` ((n,) bool on the one device of all ``jobs``, see :meth:`_deferred_finite_check`): the step is
        decided on the device: its apply entry (:data:`gefen.kernels.fused.APPLY`) is ``all(flags)``, so a skipped
        step writes nothing, and the counters move when the :class:`gefen.nonfinite.PendingCheck` this leaves in
        ``self._pending_check`` is settled.

        A parameter's ``step`` counter moves only after its kernel ran. If a kernel fails here (dynamo recompiles
        when a guard on global state fails, e.g. another thread count or autocast, and that recompilation can
        fail), its signature is marked failed, one warning is given, and that parameter and every later one are
        returned for the eager path, so the step is still applied whole and consistently; with ``fused=True`` the
        next step is then refused before any change.

        Returns:
            ``id(param)`` of the parameters left for the eager path.
        """
        rows: dict[torch.device, list[list[float]]] = {}
        records: dict[int, StepScalars] = {}  # one per group and step
        for item, group, signature in jobs:
            step = int(ParamState.from_dict(self.state[item.param]).step) + 1
            record = records.get(id(group))
            if record is None:
                record = records[id(group)] = StepScalars.of_group(group)
            row = record.compiled_row(step, signature.kind == "factored")
            rows.setdefault(item.param.device, []).append(row)
        constants = {dev: constants_on(dev, r) for dev, r in rows.items()}
        if flags is not None:
            for table in constants.values():
                table[:, APPLY] = flags.all().to(table.dtype)  # on the device: no host read
            self._pending_check = PendingCheck.of(
                flags,
                [item.name for item, _, _ in jobs],
                [ParamState.from_dict(self.state[item.param]).step for item, _, _ in jobs],
            )
        scalars = {dev: iter(table) for dev, table in constants.items()}
        for position, (item, _group, signature) in enumerate(jobs):
            device = item.param.device
            view = ParamState.from_dict(self.state[item.param])
            codebook, lut, thresholds = self._fused_tables(device)
            # plain contiguous tensors: the graphs were compiled for them (dynamo guards on requires_grad, strides)
            param = item.param.detach()
            work = param if param.is_contiguous() else param.contiguous()
            grad = kernel_grad(item.grad, signature.shape)
            second = (
                (view.second_moment_row, view.second_moment_col) if view.kind == "factored" else (view.second_moment,)
            )
            constants = next(scalars[device])
            try:
                self._kernels.run(
                    signature,
                    work.view(signature.shape),
                    grad,
                    view.codes,
                    view.scale,
                    *second,
                    codebook,
                    lut,
                    thresholds,
                    constants,
                )
            except Exception as exc:  # recorded in self._kernels.failures by run()
                warn_user(
                    f"Gefen: the compiled step of {item.name} failed inside step() ({type(exc).__name__}: {exc}); "
                    "this step was completed on the eager path for it and the parameters after it (same math). "
                    "fused=None keeps using the eager path for this signature; fused=True refuses the next step."
                )
                if self._pending_check is not None:  # the eager path advances the counters of the rest itself
                    del self._pending_check.counters[position:]
                return {id(it.param) for it, _, _ in jobs[position:]}
            if work is not param:
                param.copy_(work)
            if flags is None:
                view.step.add_(1)
        return set()

    def _has_state(self, param: Tensor) -> bool:
        # ``self.state`` is a defaultdict: a mere read (``opt.state[p]``) creates an empty entry.
        return STEP in self.state.get(param, ())

    def _nearest_table(self, device: torch.device, codebook: Tensor | None = None) -> NearestCodeTable:
        """The nearest-code table of ``codebook`` (default: the published one) on ``device``, built once.

        The cache entry remembers the codebook tensor it was built from and is used only for that very tensor,
        so a codebook learned in a step that is then refused can never leave a stale table behind.
        """
        return self._cached(("table", device), codebook, lambda cb: build_nearest_table(cb.to(device)))

    def _fused_tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``(codebook, lut as fp32, thresholds)`` of the pending or published codebook on ``device``."""

        def build(codebook: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            table = self._nearest_table(device, codebook)
            return table.codebook, lookup_table_as_float(table.lut), table.thresholds

        return self._cached(("fused", device), self._pending_codebook, build)

    def _cached(self, key: tuple[str, torch.device], codebook: Tensor | None, build: Callable[[Tensor], Any]) -> Any:
        codebook = self._codebook if codebook is None else codebook
        entry = self._tables.get(key)
        if entry is None or entry[0] is not codebook:
            entry = (codebook, build(codebook))
            self._tables[key] = entry
        return entry[1]

    def _update(self, item: WorkItem, group: Mapping[str, Any]) -> None:
        """Apply §6.2 / §6.4 to one parameter, in chunks of whole blocks (and whole rows when factored).

        Chunking bounds the transient memory to a few bytes per element of one chunk and keeps every pass in
        cache; per-block reductions never straddle a chunk, so the result does not depend on the chunk size.
        """
        view = ParamState.from_dict(local_state(self.state[item.param]))
        beta1, beta2 = (as_float(b) for b in group["betas"])
        lr, eps, weight_decay = as_float(group["lr"]), as_float(group["eps"]), as_float(group["weight_decay"])
        target = item.target
        table = self._nearest_table(target.device)
        period, numel = view.period, target.numel()
        view.step.add_(1)
        t = int(view.step)
        bc1, bc2 = bias_correction(beta1, t), bias_correction(beta2, t)
        grad = item.grad.reshape(-1)
        if view.kind == "factored":
            rows, cols = target.shape
            g2d = grad.to(torch.float32).view(rows, cols)
            mean = None
            if item.shard is None:
                factored_second_moment_(view.second_moment_row, view.second_moment_col, g2d, beta2)
            else:  # this rank's rows: the column statistic and the row mean over all ranks (one all-reduce)
                group = item.shard.group
                mean = sharded_factored_second_moment_(
                    view.second_moment_row,
                    view.second_moment_col,
                    g2d,
                    beta2,
                    item.shard.rows,
                    lambda piece: piece.copy_(all_reduce_(piece.to(collective_device(item.shard)), group, "sum")),
                )
            row_root, col_root = factored_root_parts(view.second_moment_row, view.second_moment_col, bc2, mean)
            unit = math.lcm(period, cols)
        else:
            unit = period
        size = _CHUNK_ELEMENTS if target.device.type == "cpu" else _CHUNK_ELEMENTS_ACCELERATOR
        chunk = max(unit, (size // unit) * unit)
        work = target.view(-1) if target.is_contiguous() else target.reshape(-1).clone()
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
        if work.data_ptr() != target.data_ptr():
            target.copy_(work.view_as(target))

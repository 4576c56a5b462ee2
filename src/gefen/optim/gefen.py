"""``Gefen``: the AdamW drop-in with an 8-bit codebook first moment and a block-shared or factored second moment."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gefen._warnings import warn_user
from gefen.amp import unusable_names
from gefen.checkpoint import StagedLoad
from gefen.errors import ConfigError, StepError
from gefen.hyperparams import as_float
from gefen.kernels.backends import StepContext, StepJob, StepOutcome, group_backend
from gefen.kernels.compiled import host_only
from gefen.kernels.fused import fused_step_, lookup_table_as_float
from gefen.kernels.native import native_status
from gefen.kernels.scalars import StepScalars, lerp_high
from gefen.math.codebook import (
    zero_code_index,
)
from gefen.math.lookup import NearestCodeTable, build_nearest_table
from gefen.math.moments import (
    apply_update_,
)
from gefen.optim._base import GefenOptimizer, StepSkip, WorkItem
from gefen.optim._capture import capturing, check_capture, check_not_inference
from gefen.optim._dropin import as_torch_betas, check_adamw_flags
from gefen.optim._first_step import FirstHistogram, checkable_in_histogram, search_periods
from gefen.sharding import (
    gather_block_jobs_,
    init_sharded_state,
    local_state,
    state_shard,
    write_block_jobs_,
)
from gefen.state import (
    FIRST_MOMENT_CODES,
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
      one layout rule of every parameter, sharded or not (:func:`gefen.math.period.layout_period`): a block
      never straddles a row (dim-0 slice) of more than 8 elements, and a tensor with shorter rows (1-D, ``(R, 1)``)
      keeps the period of its flattened gradient, its blocks spanning rows. The period is frozen and
      checkpointed. A parameter that first gets a gradient later is searched then, and starts its own
      bias-correction warm-up (per-parameter ``step`` counters).
    * **codebook**: one 256-code fp32 codebook per optimizer, fitted by exact optimal 1-D k-means on the
      4096-bin histogram of block-normalised gradients of every parameter with a gradient, ±1 pinned and an
      exact 0 code (algorithm.md §4, §13.2, §13.10). Frozen and checkpointed.

    State per parameter (see :mod:`gefen.state`): uint8 codes ``(B, P)``, fp32 magnitudes ``(B,)``, fp32 second
    moment ``(B,)`` or ``(R,) + (C,)`` when factored, int64 ``step`` and ``period``: about
    ``1 + 4/P + 4(R+C)/N`` bytes/param for factored 2-D weights and ``1 + 8/P`` for block tensors, with ``P > 8``
    for every tensor of more than 8 elements. Under FSDP2 (``Shard(0)`` DTensors) each rank holds its rows of every
    state tensor (the factored column moment whole; its blocks, for blocks spanning rows) and the step is the
    single-process step (:mod:`gefen.sharding`).

    Args:
        params: iterable of tensors, of ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or of
            param-group dicts. Caller's groups are kept; per-group ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``factored_v_2d`` are honoured.
        lr: η, float ``>= 0`` or a 1-element tensor. Recommended: about 0.6–1× your tuned AdamW lr (see the
            README's lr rule).
        betas: ``(β1, β2)``, each in ``[0, 1)`` (floats, or 1-element tensors stored 0-dim as AdamW stores them).
        eps: ε, finite and ``> 0``; added to the bias-corrected root as in AdamW.
        weight_decay: λ ``>= 0``, decoupled (``p ← p·(1 − ηλ)``); default ``1e-2``, AdamW's.
        amsgrad: AdamW's positional option, accepted only as ``False`` (``ConfigError`` otherwise).
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
            to compile). ``"triton"``: hand-written multi-tensor Triton kernels on CUDA
            (:mod:`gefen.kernels.triton_step`; one device plan reused while the same tensors step, the
            ``nonfinite="skip"`` decision on the device; opt-in until checked on a GPU). ``"eager"``: the torch
            reference (:mod:`gefen.kernels.eager`). Per param group too; the choice is made in one place,
            :class:`gefen.kernels.backends.Backends`.
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
            step before capturing; a parameter seen for the first time under capture is refused. On CUDA the
            steady step runs on the Triton backend (the state's device counters advanced by its kernels), else
            parameter by parameter through :func:`gefen.kernels.fused.fused_step_` (what ``torch.compile`` traces).
        nonfinite: what a step does when a gradient holds NaN/Inf (see :mod:`gefen.nonfinite`). ``"skip"`` (the
            default): the step changes nothing at all (parameters, state, codebook, counters, global step), warns
            naming the parameters and counts itself in :attr:`skipped_steps` (saved in checkpoints). ``"raise"``:
            refuse it (``StepError``, nothing changed; the default under ``deterministic=True``).
            ``"propagate"`` (old name ``"ignore"``): let them through like ``torch.optim.AdamW``; a parameter's
            first gradient is still checked (the period search and codebook need finite values); the default
            under ``capturable=True``, which refuses ``"raise"`` and takes ``"skip"`` decided on the device by the
            Triton backend (counters and skips counted there, reported when the host reads ``skipped_steps``; a
            captured step on another backend is refused). On a steady step the step applies the policy
            itself before its first write (the CPU's native library in its own passes; the compiled kernels under
            ``"skip"`` on the device, the skip then counted and warned about when the host next looks, see
            :mod:`gefen.nonfinite`); otherwise one min/max reduction per gradient and one host read per step.
        **torch_options: ``torch.optim.AdamW``'s other options, accepted at the values Gefen implements so AdamW
            call sites keep working (``maximize=False``, ``differentiable=False``; ``foreach`` ``None``, ``False``
            or ``True``, which only picks torch's loop and has no effect here); anything else is refused. The same
            keys in a param group are checked the same way (``capturable`` there must equal the optimizer's);
            Gefen's groups do not store them (README, "torch.optim compatibility").

    Mixed precision: ``torch.amp.GradScaler`` works unchanged. fp32/bf16 gradients take the scaler's ordinary
    path; true fp16 gradients use the optimizer-side protocol (:mod:`gefen.amp`): an overflow step changes
    nothing at all (no codebook, period, counter, state or parameter).

    Raises:
        ConfigError: (a ``ValueError``) invalid hyperparameters, empty, complex or duplicate parameters, an
            AdamW option Gefen does not implement (e.g. ``maximize=True``), an unknown ``nonfinite``, or a policy
            combination that cannot be honoured (``deterministic=True`` with ``nonfinite="propagate"``;
            ``capturable=True`` with ``deterministic=True`` or ``nonfinite="raise"``, which need a host read).
        StepError: (at ``step()``) under ``capturable=True, nonfinite="skip"``, a step inside a CUDA-graph capture
            or ``torch.compile`` trace whose parameters are not all on the Triton backend (nothing changed).
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
    _skips_on_device = True  # capturable=True may take nonfinite="skip" (decided by the Triton backend)

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
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
            "betas": as_torch_betas(betas),
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
            torch_options={"amsgrad": amsgrad, **torch_options},
        )

    def _check_group(self, group: Mapping[str, Any], index: int) -> None:
        """AdamW's implementation flags in a group: honoured at the values Gefen implements, refused otherwise
        (never ignored; see :func:`gefen.optim._dropin.check_adamw_flags`). Not inside a ``torch.compile`` trace:
        dynamo writes ``capturable=True`` into the groups it traces (and the eager steps before it checked them)."""
        if not torch.compiler.is_compiling():
            check_adamw_flags(group, f"{self.kind} param_groups[{index}]", self.capturable)

    def _publish_load(self, staged: StagedLoad) -> None:
        """Publish a load, keeping each group's live ``backend`` and ``fused``: saved hyperparameters win as in
        ``torch.optim``, but these say how this process runs the step, not how the run trains (every path gives the same
        state), so a checkpoint never switches them."""
        live = [(group.get("backend"), group.get("fused")) for group in self.param_groups]
        super()._publish_load(staged)
        for group, (backend, fused) in zip(self.param_groups, live):
            group["backend"], group["fused"] = backend, fused

    def _check_group_tensors(
        self, group: Mapping[str, Any], tensors: list[Tensor], where: str, labels: list[str]
    ) -> None:
        backend = group_backend(group)
        if backend == "auto":
            if any(tensor.device.type == "cpu" for tensor in tensors):
                native_status()  # load the native library now (~1 ms, once per process), not inside the first step
            return
        if backend == "eager":
            return
        chosen = self._backends.get(backend)
        unavailable = chosen.available()
        if backend == "compiled" and unavailable:
            raise ConfigError(
                f"{where}: fused=True needs torch.compile, which is not supported on this Python/platform; "
                "pass fused=None (use it where available) or fused=False."
            )
        for i, tensor in enumerate(tensors):
            reason = chosen.supports(tensor, tensor.dtype, False)
            if not reason:
                continue
            if backend == "compiled":
                raise ConfigError(
                    f"{labels[i]} is {tensor.dtype} on {tensor.device.type}; fused=True supports "
                    "float32/bfloat16/float16 parameters on CPU and CUDA. Pass fused=None to run the others "
                    "on the eager path."
                )
            raise ConfigError(
                f"{labels[i]}: backend={backend!r} cannot step it: {reason}. Pass backend='auto' "
                f"({backend} where it can, another backend elsewhere) or backend='eager'."
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
        """checks -> first step (periods, codebook) -> backends chosen and prepared -> publish -> backends run."""
        check_capture(self)
        check_not_inference(self.kind)
        self._settle_pending_check(wait=False)  # earlier steps decided on the device whose flags have arrived
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
        zero_code = zero_code_index(codebook) if starting else 0
        new_states = {  # fresh state tensors, published only once every check below has passed
            id(item.param): self._initial_state(item, group, periods[id(item.param)], zero_code)
            for item, group in fresh
            if id(item.param) in periods
        }
        jobs = self._jobs(plan, new_states)
        self._pending_codebook = codebook
        try:
            parts = self._dispatch(jobs) if jobs else []
            if any(not getattr(b, "device_counters", False) for part in parts for b, _ in part):
                self._settle_pending_check()  # a backend that reads the host's step counters: bring them up to date
            check, bad = self._step_check(parts, deferred)
        finally:
            self._pending_codebook = None
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
        for item, group in fresh:
            if id(item.param) in new_states:
                self.state[item.param] = new_states[id(item.param)]
            else:  # all-zero first gradient: only the decoupled decay
                zero = torch.zeros((), device=item.target.device).expand(item.target.shape)
                apply_update_(item.target, zero, as_float(group["lr"]), as_float(group["weight_decay"]), 0.0)
        status = "applied"
        for part in parts:  # one part (Gefen); GefenMuon's parts bound the transient m-hat buffers
            status = self._run_backends(part, check)
            if status == "refused":
                return loss
            self._finish_jobs([job for _, batch in part for job in batch])
        # A step that saw only all-zero first gradients (e.g. DCP's hidden init step) does not count; a step decided
        # on the device counts when it is settled ("pending"), or on the device itself ("counted", capturable=True).
        if status == "applied" and jobs:
            self._advance_global_step()
        return loss

    def _initial_state(self, item: WorkItem, group: Mapping[str, Any], period: int, zero_code: int) -> dict[str, Any]:
        """A parameter's first state (zeros, codes at the zero code), not yet published."""
        kind = self._second_moment_kind(item.param, group)
        if item.shard is not None:
            return init_sharded_state(item.target, item.shard, period, kind, zero_code)
        return init_state(item.param, period, kind, zero_code, counters_on_device=self.capturable)

    def _jobs(self, plan: list[list[WorkItem]], new_states: Mapping[int, dict[str, Any]]) -> list[StepJob]:
        """One :class:`gefen.kernels.backends.StepJob` per parameter that steps now (with state, or starting),
        with one per-step record per param group."""
        jobs = []
        for group, work in zip(self.param_groups, plan):
            scalars = None
            for item in work:
                state = new_states.get(id(item.param))
                if state is None:
                    if not self._has_state(item.param):
                        continue  # an all-zero first gradient
                    state = self.state[item.param]
                if scalars is None:
                    scalars = self._step_scalars(group)
                local = local_state(state)
                shard = item.shard
                if shard is not None:  # blocks straddling rows are sharded by blocks (gefen.sharding)
                    shard = state_shard(shard, local[FIRST_MOMENT_CODES].shape[-1])
                jobs.append(StepJob(item.name, item.param, item.target, item.grad, local, group, scalars, shard))
        gather_block_jobs_(jobs)  # those step on the elements of this rank's blocks
        return jobs

    def _step_scalars(self, group: Mapping[str, Any]) -> StepScalars:
        """The group's per-step record (GefenMuon: its momentum as ``beta1``)."""
        return StepScalars.of_group(group)

    def _context(self) -> StepContext:
        def table(device: torch.device) -> NearestCodeTable:
            return self._nearest_table(device, self._pending_codebook)

        return StepContext(self.kind, table, self.deterministic, self._settle_pending_check, self.capturable)

    def _dispatch(self, jobs: list[StepJob]) -> list[list[tuple[Any, list[StepJob]]]]:
        """Choose every job's backend (:class:`gefen.kernels.backends.Backends`, the one dispatch point) and
        prepare each batch (compilations, plans) of each part (:meth:`_job_parts`), before any state changes. Jobs a
        backend cannot prepare go to the eager backend.

        Returns:
            Per part, its ``(backend, jobs)`` batches.

        Raises:
            StepError: a param group asked for a backend that cannot step one of its parameters, or could not
                prepare it; nothing has been changed.
        """
        if self.capturable and torch.compiler.is_compiling():  # a torch.compile trace: the per-parameter path
            return [[(self._on_device, part)] for part in self._job_parts(jobs)]
        chosen: list[tuple[StepJob, str]] = []
        cache: dict[tuple[str, str, torch.dtype, torch.dtype, bool], tuple[str, str]] = {}
        for job in jobs:
            requested = group_backend(job.group)
            key = (requested, job.target.device.type, job.target.dtype, job.grad.dtype, job.shard is not None)
            decided = cache.get(key)  # the same answer for every parameter of this kind
            if decided is None:
                sharded = job.shard is not None
                decided = cache[key] = self._backends.choose(requested, job.target, job.grad.dtype, sharded)
            name, reason = decided
            if requested == "auto" and reason and not self._warned_native:
                self._warned_native = True
                warn_user(  # reason: "the <name> backend is unavailable: <why>"
                    f"{self.kind}: {reason}; using the eager step (same results, slower). Asking for that backend "
                    "explicitly (backend=...) would raise instead."
                )
            elif requested != "auto" and reason:
                if job.shard is not None:
                    name = "eager"  # this rank's rows of a sharded parameter step eagerly where the backend cannot
                elif name != "compiled":  # the compiled backend refuses in prepare, with its fused=True messages
                    raise StepError(
                        f"{self.kind}(backend={requested!r}): {job.name} cannot run on it: {reason}. Nothing was "
                        "changed; pass backend='auto' or backend='eager'."
                    )
            chosen.append((job, name))
        context = self._context()
        name_of = {id(job): name for job, name in chosen}
        parts = []
        for part in self._job_parts(jobs):
            batches = self._backends.batches([(job, name_of[id(job)]) for job in part])
            if self.capturable:  # device counters: the Triton backend where chosen, else the per-parameter path
                captured = [(b, batch) for b, batch in batches if getattr(b, "captures", False)]
                rest = [job for b, batch in batches if not getattr(b, "captures", False) for job in batch]
                batches = captured + ([(self._on_device, rest)] if rest else [])
            left: list[StepJob] = []
            for backend, batch in batches:
                left.extend(backend.prepare(batch, context))
            if left:  # to the eager step (capturable: the per-parameter device step, which reads nothing)
                moved = {id(job) for job in left}
                fallback = self._on_device if self.capturable else self._backends.get("eager")
                kind = type(fallback)
                kept = [(b, [j for j in batch if id(j) not in moved]) for b, batch in batches if type(b) is not kind]
                fallback_jobs = [j for b, batch in batches if type(b) is kind for j in batch] + left
                batches = [(b, batch) for b, batch in kept if batch] + [(fallback, fallback_jobs)]
            parts.append(batches)
        return parts

    def _job_parts(self, jobs: list[StepJob]) -> list[list[StepJob]]:
        """The jobs in the order and parts the backends run them: each part is run, then finished
        (:meth:`_finish_jobs`), before the next. Gefen: one part."""
        return [jobs]

    def _step_check(self, parts: list[list[tuple[Any, list[StepJob]]]], deferred: bool) -> tuple[str, list[str]]:
        """Where a deferred ``nonfinite`` check (see :meth:`_defers_finite_check`) runs, now that the backends
        are chosen: inside the backend's own pass when one backend that can check on the host runs the whole
        step (the native library); on the device under ``"skip"`` when one backend that decides on the device
        runs it on one device; otherwise as the host read, here, before any write.

        Returns:
            ``(check, bad)``: the ``check`` mode for the backend's run (``""``, ``"host"`` or ``"device"``) and the
            unusable gradients found by the host read (the step must be skipped when it is not empty).

        Raises:
            StepError: an unusable gradient under ``"raise"`` (nothing changed).
        """
        if not deferred:
            return "", []
        batches = [pair for part in parts for pair in part]
        if len(batches) == 1:
            backend, batch = batches[0]
            if backend.checks == "host":
                return "host", []
            one_device = len({job.target.device for job in batch}) == 1
            if backend.checks == "device" and self.nonfinite == "skip" and one_device:
                return "device", []
        if self.capturable and capturing():
            job, name = next((job, b.name) for b, batch in batches for job in batch if b.checks != "device")
            raise StepError(
                f"{self.kind}(capturable=True, nonfinite='skip') decides a steady step on the device, which only the "
                f"Triton backend does (CUDA, fp32/bf16/fp16, unsharded, not inside torch.compile); {job.name} runs "
                f"on the {name} step here, whose check would read the host inside a capture. Nothing was changed; "
                "use nonfinite='propagate' (with torch.amp.GradScaler for overflow) or capture without it."
            )
        named = [(job.name, job.grad) for _, batch in batches for job in batch]
        return "", self._apply_finite_policy(unusable_names(named))

    def _run_backends(self, batches: list[tuple[Any, list[StepJob]]], check: str) -> str:
        """Run every batch on its backend; jobs a backend hands back run on the eager backend.

        Returns:
            ``"applied"``; ``"refused"`` when the backend's own check refused the step (nothing written; the skip
            recorded); ``"settled"`` or ``"pending"`` for a step decided on the device, settled here (the counters
            and global step moved, or the skip was recorded: then nothing else ran) or later.
        """
        context = self._context()
        status = "applied"
        for backend, batch in batches:
            outcome = backend.run(batch, context, check)
            if outcome.unusable:  # the backend refused the step before any write: nothing has changed
                self._record_skip(StepSkip(nonfinite=True, names=tuple(self._apply_finite_policy(outcome.unusable))))
                return "refused"
            if outcome.applied is not None:  # capturable=True: decided and counted on the device
                self._count_on_device(outcome.applied)
                status = "counted"
            if outcome.pending is not None:
                self._pending_checks.append(outcome.pending)
                status = "pending"
                if outcome.left or outcome.pending.event is None:  # decide now: the eager rest must not run on NaN
                    if not self._settle_pending_check():
                        return "refused"  # skipped: every kernel write was masked, and nothing else has run
                    status = "settled"
            left = {id(job) for job in outcome.left}
            for job in batch:  # what state_report() names as each parameter's backend
                self._stepped_by[id(job.param)] = "eager" if id(job) in left else backend.name
            if outcome.left:
                self._backends.get("eager").run(outcome.left, context)
        return status

    @property
    def _on_device(self) -> _OnDeviceBackend:
        """The per-parameter device step as a backend (stateless: a thin wrapper made on demand, never pickled)."""
        return _OnDeviceBackend(self._update_on_device)

    def _finish_jobs(self, jobs: list[StepJob]) -> None:
        """What follows the backends' update: a parameter sharded by blocks writes its rows from every rank's
        updated blocks (:func:`gefen.sharding.write_block_jobs_`). GefenMuon: Newton–Schulz and the parameter
        write."""
        write_block_jobs_(jobs)

    def _check_fresh_under_capture(self, plan: list[list[WorkItem]]) -> None:
        fresh = [item for work in plan for item in work if not self._has_state(item.param)]
        if fresh and self.capturable and capturing():
            raise StepError(
                f"{self.kind}(capturable=True): {fresh[0].name} gets its first gradient inside a torch.compile "
                "trace or CUDA-graph capture, but a parameter's first step (period search, codebook) runs on the "
                "host. Run eager warm-up steps in which every trained parameter has a gradient, then capture."
            )

    def _update_on_device(self, job: StepJob) -> None:
        """``capturable=True``: one parameter's step with every per-step value computed on its device.

        The same §6.2 / §6.4 chain as the compiled kernels (:mod:`gefen.kernels.fused`), called directly so that a
        ``torch.compile`` of the whole ``step()`` fuses it and a CUDA graph can capture it; the constants come
        from :meth:`gefen.kernels.scalars.StepScalars.compiled_row_on_device` (step counter and ``lr`` read on the
        device).
        """
        view = ParamState.from_dict(job.state)
        view.step.add_(1)
        scalars = job.scalars.compiled_row_on_device(view.step, job.group["lr"], view.kind == "factored")
        device, high = job.param.device, lerp_high(1.0 - job.scalars.beta1)
        tables, steps = self._fused_tables(device), self._nearest_table(device).steps
        fused_step_(job.param, job.grad, view, scalars, tables, steps, high)

    def _defers_finite_check(self, plan: list[list[WorkItem]]) -> bool:
        """Whether the step applies its ``nonfinite`` policy itself, after choosing the backends and before its
        first write (see :meth:`_deferred_finite_check`), instead of the preflight's host read: inside the native
        call on the CPU (one read of the gradients fewer), on the device for the compiled kernels (no host read).

        True for a steady step under ``"skip"`` or ``"raise"``: no parameter starts now (no period search, codebook
        or initial decay runs before the backends are chosen), none is sharded (ranks agree on skips before any
        step), and no :class:`gefen.GefenMuonHybrid` applied the policy already. Asked once per step, by the
        preflight. (``capturable=True`` takes ``"skip"`` only: decided on the device by the Triton backend.)
        """
        if not self._checks_finite_in_step or self.nonfinite == "propagate":
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


class _OnDeviceBackend:
    """``capturable=True``: the per-parameter device step (:meth:`Gefen._update_on_device`; GefenMuon's momentum) as
    a backend, for the parameters no capturing backend (``captures = True``: the Triton one) runs. It reads nothing
    on the host and keeps its counters in the optimizer's device state; no ``nonfinite`` check of its own."""

    name = "per-parameter device"
    checks = ""
    device_counters = True

    def __init__(self, update: Callable[[StepJob], None]) -> None:
        self._update = update

    def prepare(self, jobs: list[StepJob], context: StepContext) -> list[StepJob]:
        return []

    def run(self, jobs: list[StepJob], context: StepContext, check: str = "") -> StepOutcome:
        for job in jobs:
            self._update(job)
        return StepOutcome()

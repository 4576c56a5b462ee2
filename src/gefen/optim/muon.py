"""``GefenMuon``: Muon (Newton–Schulz-orthogonalised momentum) with Gefen's 8-bit codebook momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from gefen.errors import ConfigError
from gefen.hyperparams import as_float, check_bool, check_decay_rate, check_eps
from gefen.kernels.backends import StepJob
from gefen.kernels.compiled import kernel_grad, lerp_high
from gefen.kernels.fused import fused_momentum_, write_param_
from gefen.kernels.scalars import COMPILED_LAYOUT, StepScalars
from gefen.math.moments import apply_update_
from gefen.math.newton_schulz import (
    ADJUST_LR_FNS,
    STANDARD_COEFFICIENTS,
    adjust_lr_ratio,
    newton_schulz,
    normuon_,
    resolve_schedule,
)
from gefen.optim._param_input import given_names, param_label
from gefen.optim.gefen import Gefen
from gefen.sharding import (
    BlockShard,
    RowShard,
    all_reduce_,
    as_sharded,
    collective_device,
    gather_blocks,
    gather_rows,
    gather_rows_to,
    local,
    local_state,
    scatter_rows_from,
)
from gefen.state import (
    NORMUON_STEP,
    NORMUON_V,
    ParamState,
    SecondMomentKind,
    drop_normuon_state,
    normuon_state,
    second_moment_kind,
)

__all__ = ["GefenMuon", "SHARDED_MODES"]

#: ``sharded_mode`` values (see :class:`GefenMuon`).
SHARDED_MODES = ("exact", "distributed", "approx")
#: Elements of ``m̂`` (fp32) live at once in a step: the momenta of consecutive parameters are computed together up to
#: this many elements (64 MiB), then orthogonalised and written, before the next part (see ``GefenMuon._job_parts``).
MOMENTUM_PART_ELEMENTS = 1 << 24


class GefenMuon(Gefen):
    r"""Muon with ~1 byte/param of state: 8-bit codebook momentum, Newton–Schulz in bf16, optional NorMuon.

    For a 2-D parameter ``W`` (R×C) with gradient ``G`` (fp32), momentum ``β``, at each step:

    .. math::

        m &= \operatorname{lerp}(c[\mathrm{idx}]\,a,\; G,\; 1-\beta),\quad a_b = \max_{j\in b}|m_j|,\quad
            \mathrm{idx} = \operatorname{nearest}(c, m/a),\quad \hat m = c[\mathrm{idx}]\,a\\
        U &= \beta\hat m + (1-\beta)G \ \text{(Nesterov; else } U = \hat m)\\
        O &= \mathrm{NS}(U) \ \text{(bf16; then NorMuon row normalisation if enabled)}\\
        W &\leftarrow W(1-\eta\lambda) - \eta\,r(R, C)\,O

    with ``r`` the ``adjust_lr_fn`` ratio. The quantized momentum (period search, codebook, block magnitudes)
    is Gefen's machinery; there is no second moment and no bias correction. Source: arXiv 2606.13894 and
    Jordan et al. 2024 (Muon); algorithm.md §7 and §13.7.

    State per parameter: uint8 codes ``(B, P)``, fp32 magnitudes ``(B,)``, int64 ``step`` and ``period``, and
    with ``normuon=True`` an fp32 ``(R,)`` row EMA plus its counter: about ``1 + 4/P (+ 4/C)`` bytes/param. Every
    shape keeps blocks of more than 8 elements (:func:`gefen.math.period.layout_period`; a ``(R, C <= 8)`` matrix
    takes the period of its flattened gradient), and a matrix with rows of fewer than 8 elements is stepped without
    NorMuon, whose per-row statistic would cost ``4/C`` bytes per element there
    (:func:`gefen.state.has_row_statistics`).
    The codebook (256 fp32) is the optimizer's own, learned on the first step from every parameter's gradient.

    Args:
        params: 2-D tensors, ``(name, tensor)`` pairs or param-group dicts. Anything that is not 2-D
            (embeddings are 2-D but belong to the backup: use :class:`gefen.GefenMuonHybrid`; biases, norms,
            conv weights, flattened 1-D shards of ZeRO-style wrappers) is refused.
        lr: η >= 0 (float or 1-element tensor).
        weight_decay: λ >= 0, decoupled, with the raw lr.
        momentum: β in ``[0, 1)``.
        nesterov: use the Nesterov combination ``U = β·m̂ + (1−β)·G``.
        ns_coefficients: ``(a, b, c)`` of each iteration of the ``standard`` schedule (three finite numbers),
            as in ``torch.optim.Muon``.
        eps: > 0, floor of the Frobenius norm in Newton–Schulz.
        ns_steps: iterations of the ``standard`` schedule, ``1 <= ns_steps < 100``.
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, R/C))``) or ``"match_rms_adamw"``
            (``0.2·sqrt(max(R, C))``, so an AdamW-scale lr fits).
        ns_schedule: ``None``/``"standard"`` (``ns_coefficients`` × ``ns_steps``), ``"tuned3"``, ``"tuned4"`` or a
            list of ``(a, b, c)``; another schedule than the standard one takes the default ``ns_coefficients``.
        normuon: NorMuon row normalisation of ``O`` (algorithm.md §7.4); not applied to matrices with rows of
            fewer than 8 elements (see above).
        normuon_beta2: NorMuon EMA decay in ``[0, 1)``.
        normuon_eps: NorMuon ε > 0.
        sharded_mode: how a sharded (FSDP2 ``Shard(0)`` DTensor) parameter is orthogonalised; ignored for plain
            tensors (hardening.md §5.2, algorithm.md §7.7). ``"exact"``: every rank all-gathers the full update
            matrix and runs Newton–Schulz on it, then keeps its rows: the same result as one process (equal up to
            the order of floating-point sums in NorMuon's two norms). ``"distributed"``: each matrix has one owner
            rank (its position among the optimizer's sharded parameters modulo the world size) that gathers it,
            runs Newton–Schulz and scatters the rows back, owners working in parallel on buckets of ``world``
            matrices: bit-identical to ``"exact"``, with 1/world of its Newton–Schulz work per rank.
            ``"approx"``: Newton–Schulz of each rank's own rows only, no gather (cheaper; not equivalent). In
            every mode the momentum is sharded like the parameter and the period and codebook are the same on
            every rank, so checkpoints reshard between modes and world sizes.
        backend, fused: how the quantized momentum runs, as for :class:`gefen.Gefen` (default ``"auto"``: natively
            on the CPU, bit-identical to the eager momentum). Newton–Schulz runs as torch matmuls either way.
        deterministic, capturable, nonfinite: as for :class:`gefen.Gefen` (recorded in checkpoints, device-side
            counters, NaN/Inf policy); GradScaler's fp16 protocol works the same way.

    Raises:
        ConfigError: a parameter is not 2-D; invalid hyperparameters; ``backend="compiled"``/``"native"`` with
            float64 parameters (or ``"native"`` without the library); a
            policy combination that cannot be honoured (see :class:`gefen.Gefen`).
        TypeError: a non-bool flag, a non-int ``ns_steps``, an unknown keyword.
    """

    kind = "GefenMuon"
    _module_hint = (
        "its 2-D hidden weights as (name, tensor) pairs, or use gefen.GefenMuonHybrid(model), which routes the "
        "embeddings, heads, norms and biases to a backup optimizer"
    )
    #: Its backends cover the momentum of one parameter at a time: the check stays before the step.
    _checks_finite_in_step = False
    _skips_on_device = False

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = STANDARD_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_schedule: str | Sequence[Sequence[float]] | None = None,
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        sharded_mode: str = "exact",
        backend: str = "auto",
        fused: bool | None = None,
        deterministic: bool = False,
        capturable: bool = False,
        nonfinite: str | None = None,
        **torch_options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_schedule": ns_schedule,
            "normuon": normuon,
            "normuon_beta2": normuon_beta2,
            "normuon_eps": normuon_eps,
            "sharded_mode": sharded_mode,
        }
        self._init_optimizer(
            params,
            defaults,
            flags={"nesterov": nesterov, "normuon": normuon},
            backend=backend,
            fused=fused,
            deterministic=deterministic,
            capturable=capturable,
            nonfinite=nonfinite,
            torch_options=torch_options,
        )

    # ------------------------------------------------------------------ hooks of the shared machinery
    def _check_defaults(self, defaults: Mapping[str, Any]) -> None:
        _check_muon_group(defaults, "GefenMuon")

    def _check_group(self, group: Mapping[str, Any], index: int) -> None:
        where = f"GefenMuon param_groups[{index}]"
        _check_muon_group(group, where)
        names = given_names(group["params"], group.get("param_names"))
        for i, p in enumerate(group["params"]):
            if isinstance(p, Tensor) and p.dim() != 2:
                raise ConfigError(
                    f"{param_label(where, i, names[i])} now has shape {tuple(p.shape)}; GefenMuon steps 2-D matrices "
                    "only. A wrapper (e.g. DeepSpeed ZeRO) replaced the parameters by flat partitions after the "
                    "optimizer was built, which Muon cannot orthogonalise; nothing was changed. Use DDP, or "
                    "gefen.Gefen for ZeRO."
                )

    def _check_group_tensors(
        self, group: Mapping[str, Any], tensors: list[Tensor], where: str, labels: list[str]
    ) -> None:
        _check_muon_group(group, where)
        super()._check_group_tensors(group, tensors, where, labels)  # fused=True: dtypes and devices it supports
        for label, tensor in zip(labels, tensors):
            if tensor.dim() != 2:
                raise ConfigError(
                    f"{label} has shape {tuple(tensor.shape)}; GefenMuon optimizes 2-D hidden "
                    "weights only. Use gefen.GefenMuonHybrid (Muon for 2-D hidden weights, Gefen or AdamW for "
                    "embeddings, heads, norms, biases and the rest), which also catches flattened 1-D shards."
                )

    def _second_moment_kind(self, param: Tensor, group: Mapping[str, Any]) -> SecondMomentKind:
        return second_moment_kind(self.kind, tuple(param.shape), group)

    def _step_scalars(self, group: Mapping[str, Any]) -> StepScalars:
        return StepScalars.of_group(group, "momentum")

    def _update_on_device(self, job: StepJob) -> None:
        """``capturable=True``: the quantized momentum by :func:`gefen.kernels.fused.fused_momentum_`, called
        directly (a ``torch.compile`` of the whole step fuses it; no host read); the rest in :meth:`_finish_jobs`."""
        view = ParamState.from_dict(job.state)
        device = job.target.device
        out = torch.empty(tuple(view.codes.shape), dtype=torch.float32, device=device)
        codebook, lut, thresholds = self._fused_tables(device)
        weight = 1.0 - job.scalars.beta1
        fused_momentum_(
            kernel_grad(job.grad, tuple(view.codes.shape)),
            view.codes,
            view.scale,
            out,
            codebook,
            lut,
            thresholds,
            torch.full((len(COMPILED_LAYOUT),), weight, dtype=torch.float32, device=device),
            steps=self._nearest_table(device).steps,
            lerp_high=lerp_high(weight),
        )
        view.step.add_(1)
        job.out = out

    # ------------------------------------------------------------------ the Muon update
    def _job_parts(self, jobs: list[StepJob]) -> list[list[StepJob]]:
        """Parts whose ``m̂`` buffers (fp32, 4 bytes per element) are live together: consecutive jobs up to
        :data:`MOMENTUM_PART_ELEMENTS` elements (one job at the least), then each bucket of sharded ``"distributed"``
        parameters whole (``world`` matrices, in the order :meth:`_finish_jobs` forms them). Every part is run and
        orthogonalised before the next, so the step's transient memory stays bounded whatever the model's size. The
        collectives follow the job order on every rank, whatever the parts."""
        plain = [job for job in jobs if not _bucketed(job)]
        bucketed = [job for job in jobs if _bucketed(job)]
        parts: list[list[StepJob]] = []
        size = 0
        for job in plain:
            if parts and size + job.target.numel() <= MOMENTUM_PART_ELEMENTS and size:
                parts[-1].append(job)
                size += job.target.numel()
            else:
                parts.append([job])
                size = job.target.numel()
        world = bucketed[0].shard.world if bucketed else 1
        parts.extend(bucketed[start : start + world] for start in range(0, len(bucketed), max(world, 1)))
        return parts

    def _finish_jobs(self, jobs: list[StepJob]) -> None:
        """Algorithm.md §7.1 after the quantized momentum (each job's ``out``, from its backend): Nesterov,
        Newton–Schulz and the parameter write. Sharded ``"distributed"`` parameters go in buckets of ``world``
        matrices: each bucket's gathers to their owners, the owners' Newton–Schulz (in parallel across ranks), and
        the scatters back (hardening.md §5.2)."""
        bucketed = [job for job in jobs if _bucketed(job)]
        for job in jobs:
            if not _bucketed(job):
                self._orthogonal_update(job)
        if not bucketed:
            return
        world = bucketed[0].shard.world
        if world < 2:
            for job in bucketed:
                self._orthogonal_update(job)
            return
        owners = self._owners()
        for start in range(0, len(bucketed), world):
            bucket = bucketed[start : start + world]
            updates = [self._direction(job) for job in bucket]
            full: dict[int, Tensor] = {}
            for job, update in zip(bucket, updates):
                gathered = gather_rows_to(update, job.shard, owners[id(job.param)])
                if gathered is not None:
                    full[id(job.param)] = gathered
            for job in bucket:
                if id(job.param) in full:
                    full[id(job.param)] = self._orthogonalize(full[id(job.param)], job.group)
            for job, update in zip(bucket, updates):
                like = torch.empty_like(update, dtype=torch.bfloat16)  # NS output dtype: "exact"'s bits
                rows = scatter_rows_from(full.get(id(job.param)), like, job.shard, owners[id(job.param)])
                self._finish(job, rows)
                job.out = None

    def _orthogonal_update(self, job: StepJob) -> None:
        """Newton–Schulz of one job's update (of the full matrix when row-sharded ``"exact"``) and its write."""
        update = self._direction(job)
        shard = job.shard
        if isinstance(shard, BlockShard):  # a matrix sharded by blocks: the full update from every rank's blocks
            rows = shard.rows
            full = gather_blocks(update, shard).view(rows.shape)
            if job.group.get("sharded_mode", "exact") == "approx":
                orthogonal = self._orthogonalize(full[rows.start : rows.stop], job.group)
            else:
                orthogonal = self._orthogonalize(full, job.group)[rows.start : rows.stop]
            job.out = None
            self._finish(replace(job, target=local(job.param), shard=rows), orthogonal)
            return
        if shard is None or job.group.get("sharded_mode", "exact") == "approx":
            orthogonal = self._orthogonalize(update, job.group)
        else:  # exact (and distributed outside of a bucket): Newton–Schulz of the full matrix, keep our rows
            orthogonal = self._orthogonalize(gather_rows(update, shard), job.group)[shard.start : shard.stop]
        self._finish(job, orthogonal)
        job.out = None  # its m-hat buffer is free from here

    def _owners(self) -> dict[int, int]:
        """Owner rank of every sharded ``"distributed"`` parameter: its position among all of the optimizer's
        parameters in those groups (whether or not they have a gradient now) modulo the world size."""
        eligible = [p for g in self.param_groups if g.get("sharded_mode") == "distributed" for p in g["params"]]
        owners = {}
        for position, p in enumerate(eligible):
            shard = self._shard_of(p)
            if shard is not None:
                owners[id(p)] = position % shard.world
        return owners

    def _direction(self, job: StepJob) -> Tensor:
        """The matrix to orthogonalise from the job's ``m̂``: ``U = β·m̂ + (1−β)·G`` (Nesterov) or ``m̂``, fp32 of
        the target's shape (for a matrix sharded by blocks, the flat elements of this rank's blocks)."""
        assert job.out is not None, "a backend fills every momentum job's out"
        beta = job.scalars.beta1
        m_hat = job.out.view(job.target.shape)
        if not job.group["nesterov"]:
            return m_hat
        return m_hat.mul_(beta).add_(job.grad.to(torch.float32), alpha=1.0 - beta)

    @staticmethod
    def _orthogonalize(update: Tensor, group: Mapping[str, Any]) -> Tensor:
        """Newton–Schulz of ``update`` with the group's schedule (an empty matrix stays empty)."""
        if update.numel() == 0:
            return update
        schedule = resolve_schedule(group["ns_schedule"], group["ns_steps"], group.get("ns_coefficients"))
        return newton_schulz(update, schedule, as_float(group["eps"]))

    def _finish(self, job: StepJob, orthogonal: Tensor) -> None:
        """NorMuon (if on) and the decoupled-decay update of this rank's rows with ``O`` (``orthogonal``)."""
        item, group = job, job.group
        state = self.state[item.param]
        rows, cols = item.param.shape  # the global shape sets the lr ratio
        target = item.target
        if self._second_moment_kind(item.param, group) == "momentum_normuon":  # normuon, rows long enough
            if NORMUON_V not in state:  # turned on after the state was created
                fresh = normuon_state(target.shape[0], target.device, target.device if self.capturable else None)
                if item.shard is not None:
                    fresh[NORMUON_V] = as_sharded(fresh[NORMUON_V], item.shard, (rows,))
                state.update(fresh)
            state[NORMUON_STEP].add_(1)
            reduce = None
            if item.shard is not None and group.get("sharded_mode", "exact") != "approx":
                shard = item.shard

                def reduce(sums: Tensor) -> Tensor:  # on the mesh's device (CPU-offloaded shards of a CUDA mesh)
                    return all_reduce_(sums.to(collective_device(shard)), shard.group, "sum").to(sums.device)

            normuon_(
                orthogonal,
                local_state(state)[NORMUON_V],
                state[NORMUON_STEP].double() if self.capturable else int(state[NORMUON_STEP]),
                as_float(group["normuon_beta2"]),
                as_float(group["normuon_eps"]),
                reduce=reduce,
            )
        else:
            drop_normuon_state(state)
        ratio = adjust_lr_ratio(group["adjust_lr_fn"], rows, cols)
        if self.capturable:  # lr read on the device
            lr, device = group["lr"], target.device
            eta = (
                lr.to(device, torch.float64).reshape(())
                if isinstance(lr, Tensor)
                else torch.full((), lr, dtype=torch.float64, device=device)
            )
            decay = (1.0 - eta * as_float(group["weight_decay"])).float()
            write_param_(target.detach(), orthogonal.float(), decay, (-eta * ratio).float())
            return
        if target.numel():
            apply_update_(target, orthogonal, as_float(group["lr"]), as_float(group["weight_decay"]), ratio)


def _bucketed(job: StepJob) -> bool:
    """Whether ``job`` goes in a ``"distributed"`` owner bucket: a row-sharded matrix of such a group (one sharded by
    blocks gathers its full update on every rank, as ``"exact"``)."""
    return isinstance(job.shard, RowShard) and job.group.get("sharded_mode") == "distributed"


def _check_muon_group(group: Mapping[str, Any], where: str) -> None:
    """Validate the Muon options present in ``group`` (raises ConfigError; TypeError for non-int ns_steps)."""
    if "momentum" in group:
        check_decay_rate(group["momentum"], f"{where}['momentum']")
    if "normuon_beta2" in group:
        check_decay_rate(group["normuon_beta2"], f"{where}['normuon_beta2']")
    if "normuon_eps" in group:
        check_eps(group["normuon_eps"], f"{where}['normuon_eps']")
    for flag in ("nesterov", "normuon"):
        if flag in group:
            check_bool(group[flag], f"{where}['{flag}']")
    if group.get("adjust_lr_fn") not in ADJUST_LR_FNS:
        raise ConfigError(
            f"{where}['adjust_lr_fn']={group.get('adjust_lr_fn')!r} must be None, 'original' or 'match_rms_adamw'."
        )
    if group.get("sharded_mode", "exact") not in SHARDED_MODES:
        raise ConfigError(f"{where}['sharded_mode']={group.get('sharded_mode')!r} must be one of {SHARDED_MODES}.")
    if "ns_steps" in group or "ns_schedule" in group or "ns_coefficients" in group:
        try:
            resolve_schedule(group.get("ns_schedule"), group.get("ns_steps", 5), group.get("ns_coefficients"))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None

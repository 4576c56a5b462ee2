"""``GefenMuon``: Muon (Newton–Schulz-orthogonalised momentum) with Gefen's 8-bit codebook momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gefen._warnings import warn_user
from gefen.errors import ConfigError
from gefen.hyperparams import as_float, check_bool, check_decay_rate, check_eps
from gefen.kernels.compiled import KernelSignature, constants_on, kernel_grad, lerp_high
from gefen.kernels.fused import fused_momentum_, write_param_
from gefen.kernels.native import native_step
from gefen.kernels.scalars import COMPILED_LAYOUT
from gefen.math.moments import apply_update_, update_quantized_moment
from gefen.math.newton_schulz import ADJUST_LR_FNS, adjust_lr_ratio, newton_schulz, normuon_, resolve_schedule
from gefen.optim._base import WorkItem
from gefen.optim.gefen import Gefen
from gefen.sharding import all_reduce_, as_sharded, gather_rows, gather_rows_to, local_state, scatter_rows_from
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
    with ``normuon=True`` an fp32 ``(R,)`` row EMA plus its counter: about ``1 + 4/P (+ 4/C)`` bytes/param.
    The codebook (256 fp32) is the optimizer's own, learned on the first step from every parameter's gradient.

    Args:
        params: 2-D tensors, ``(name, tensor)`` pairs or param-group dicts. Anything that is not 2-D
            (embeddings are 2-D but belong to the backup: use :class:`gefen.GefenMuonHybrid`; biases, norms,
            conv weights, flattened 1-D shards of ZeRO-style wrappers) is refused.
        lr: η >= 0 (float or 1-element tensor).
        weight_decay: λ >= 0, decoupled, with the raw lr.
        momentum: β in ``[0, 1)``.
        nesterov: use the Nesterov combination ``U = β·m̂ + (1−β)·G``.
        ns_steps: iterations of the ``standard`` schedule, ``1 <= ns_steps < 100``.
        eps: > 0, floor of the Frobenius norm in Newton–Schulz.
        ns_schedule: ``None``/``"standard"``, ``"tuned3"``, ``"tuned4"`` or a list of ``(a, b, c)``.
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, R/C))``) or ``"match_rms_adamw"``
            (``0.2·sqrt(max(R, C))``, so an AdamW-scale lr fits).
        normuon: NorMuon row normalisation of ``O`` (algorithm.md §7.4).
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
    #: Its backends cover the momentum of one parameter at a time: the check stays before the step.
    _checks_finite_in_step = False

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        eps: float = 1e-7,
        *,
        ns_schedule: str | Sequence[Sequence[float]] | None = None,
        adjust_lr_fn: str | None = None,
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
            "ns_steps": ns_steps,
            "eps": eps,
            "ns_schedule": ns_schedule,
            "adjust_lr_fn": adjust_lr_fn,
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
        for i, p in enumerate(group["params"]):
            if isinstance(p, Tensor) and p.dim() != 2:
                raise ConfigError(
                    f"{where}['params'][{i}] now has shape {tuple(p.shape)}; GefenMuon steps 2-D matrices only. A "
                    "wrapper (e.g. DeepSpeed ZeRO) replaced the parameters by flat partitions after the optimizer "
                    "was built, which Muon cannot orthogonalise; nothing was changed. Use DDP, or gefen.Gefen "
                    "for ZeRO."
                )

    def _check_group_tensors(self, group: Mapping[str, Any], tensors: list[Tensor], where: str) -> None:
        _check_muon_group(group, where)
        super()._check_group_tensors(group, tensors, where)  # fused=True: dtypes and devices it supports
        for i, tensor in enumerate(tensors):
            if tensor.dim() != 2:
                raise ConfigError(
                    f"{where}['params'][{i}] has shape {tuple(tensor.shape)}; GefenMuon optimizes 2-D hidden "
                    "weights only. Use gefen.GefenMuonHybrid (Muon for 2-D hidden weights, Gefen or AdamW for "
                    "embeddings, heads, norms, biases and the rest), which also catches flattened 1-D shards."
                )

    def _second_moment_kind(self, param: Tensor, group: Mapping[str, Any]) -> SecondMomentKind:
        return second_moment_kind(self.kind, tuple(param.shape), group)

    def _ema_weight(self, group: Mapping[str, Any]) -> float:
        return 1.0 - as_float(group["momentum"])

    def _run_compiled(
        self, jobs: list[tuple[WorkItem, Mapping[str, Any], KernelSignature]], flags: Tensor | None = None
    ) -> set[int]:
        """Muon's compiled path covers the quantized momentum; the rest of each update runs in :meth:`_update`.
        ``flags`` is never set (``_checks_finite_in_step`` is False)."""
        for item, group, signature in jobs:
            self._update(item, group, signature)
        return set()

    def _run_native(self, jobs: list[tuple[WorkItem, Mapping[str, Any]]], check: bool = False) -> list[str]:
        """The native backend covers the quantized momentum; the rest of each update runs in :meth:`_update`.
        ``check`` is never set (``_checks_finite_in_step`` is False): the policy ran before the step."""
        for item, group in jobs:
            self._update(item, group, "native")
        return []

    def _native_momentum(self, item: WorkItem, view: ParamState, beta: float) -> Tensor:
        """``m̂`` (fp32, (B, P)) from the native library, with the state updated in place."""
        table = self._nearest_table(torch.device("cpu"))
        blocks = tuple(view.codes.shape)
        out = torch.empty(blocks, dtype=torch.float32)
        if out.numel() == 0:  # a rank without rows of a sharded parameter
            return out
        native_step(
            "momentum",
            grad=kernel_grad(item.grad, (item.grad.numel(),)),
            codes=view.codes,
            scale=view.scale,
            tables=(table.codebook, table.lut, table.thresholds),
            steps=table.steps,
            period=view.period,
            beta1=beta,
            out=out.view(-1),
        )
        return out

    def _update_on_device(self, item: WorkItem, group: Mapping[str, Any]) -> None:
        """``capturable=True``: the same update with the momentum's pure function called directly and the
        counters, NorMuon bias correction and ``lr`` read on the device (see :meth:`_update`)."""
        self._update(item, group)

    def _momentum_on_device(self, item: WorkItem, view: ParamState, beta: float) -> Tensor:
        """``m̂`` (fp32, (B, P)) with the state updated in place, by :func:`gefen.kernels.fused.fused_momentum_`."""
        device = item.param.device
        blocks = tuple(view.codes.shape)
        out = torch.empty(blocks, dtype=torch.float32, device=device)
        codebook, lut, thresholds = self._fused_tables(device)
        weight = torch.full((len(COMPILED_LAYOUT),), 1.0 - beta, dtype=torch.float32, device=device)
        fused_momentum_(
            kernel_grad(item.grad, blocks),
            view.codes,
            view.scale,
            out,
            codebook,
            lut,
            thresholds,
            weight,
            steps=self._nearest_table(device).steps,
            lerp_high=lerp_high(1.0 - beta),
        )
        return out

    def _compiled_momentum(
        self, item: WorkItem, view: ParamState, signature: KernelSignature, beta: float
    ) -> Tensor | None:
        """``m̂`` from the compiled kernel (state updated in place), or ``None`` after a failure (eager then)."""
        device = item.param.device
        out = torch.empty(signature.shape, dtype=torch.float32, device=device)
        grad = kernel_grad(item.grad, signature.shape)
        codebook, lut, thresholds = self._fused_tables(device)
        try:
            self._kernels.run(
                signature,
                item.param.detach().reshape(signature.shape),  # unused by the kernel; same shape as compiled
                grad,
                view.codes,
                view.scale,
                out,
                codebook,
                lut,
                thresholds,
                _muon_constants(device, beta),
            )
        except Exception as exc:  # recorded in self._kernels.failures by run()
            warn_user(
                f"GefenMuon: the compiled momentum of {item.name} failed inside step() ({type(exc).__name__}: "
                f"{exc}); it runs on the eager path from now on (same math)."
            )
            return None
        return out

    # ------------------------------------------------------------------ the Muon update
    def _update(self, item: WorkItem, group: Mapping[str, Any], signature: KernelSignature | str | None = None) -> None:
        """Apply algorithm.md §7.1 to one 2-D parameter (the momentum through a compiled kernel if given)."""
        update = self._direction(item, group, signature)
        shard = item.shard
        if shard is None or group.get("sharded_mode", "exact") == "approx":
            orthogonal = self._orthogonalize(update, group)
        else:  # exact (and distributed outside of a bucket): Newton–Schulz of the full matrix, keep our rows
            orthogonal = self._orthogonalize(gather_rows(update, shard), group)[shard.start : shard.stop]
        self._finish(item, group, orthogonal)

    def _update_all(self, jobs: list[tuple[WorkItem, Mapping[str, Any]]]) -> None:
        """Eager updates; sharded ``"distributed"`` parameters go in buckets of ``world`` matrices: all momenta
        first, then each bucket's gathers to their owners, the owners' Newton–Schulz (in parallel across ranks),
        and the scatters back (hardening.md §5.2)."""
        bucketed = [(i, g) for i, g in jobs if i.shard is not None and g.get("sharded_mode") == "distributed"]
        for item, group in jobs:
            if not (item.shard is not None and group.get("sharded_mode") == "distributed"):
                self._update(item, group)
        if not bucketed:
            return
        world = bucketed[0][0].shard.world  # type: ignore[union-attr]
        if world < 2:
            for item, group in bucketed:
                self._update(item, group)
            return
        owners = self._owners()
        for start in range(0, len(bucketed), world):
            bucket = bucketed[start : start + world]
            updates = [self._direction(item, group) for item, group in bucket]
            full: dict[int, Tensor] = {}
            for (item, _g), update in zip(bucket, updates):
                assert item.shard is not None
                owner = owners[id(item.param)]
                gathered = gather_rows_to(update, item.shard, owner)
                if gathered is not None:
                    full[id(item.param)] = gathered
            for item, group in bucket:
                if id(item.param) in full:
                    full[id(item.param)] = self._orthogonalize(full[id(item.param)], group)
            for (item, group), update in zip(bucket, updates):
                assert item.shard is not None
                like = torch.empty_like(update, dtype=torch.bfloat16)  # NS output dtype: "exact"'s bits
                rows = scatter_rows_from(full.get(id(item.param)), like, item.shard, owners[id(item.param)])
                self._finish(item, group, rows)

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

    def _direction(
        self, item: WorkItem, group: Mapping[str, Any], signature: KernelSignature | str | None = None
    ) -> Tensor:
        """Update the quantized momentum of one parameter (this rank's rows) and return the matrix to
        orthogonalise: ``U = β·m̂ + (1−β)·G`` (Nesterov) or ``m̂``, fp32 of the target's shape."""
        view = ParamState.from_dict(local_state(self.state[item.param]))
        beta = as_float(group["momentum"])
        rows, cols = item.target.shape
        grad = item.grad.to(torch.float32)
        if signature == "native":
            m_hat: Tensor | None = self._native_momentum(item, view, beta)
        elif isinstance(signature, KernelSignature):
            m_hat = self._compiled_momentum(item, view, signature, beta)
        else:
            m_hat = None
        if self.capturable:
            m_hat = self._momentum_on_device(item, view, beta)
        if m_hat is None:
            moment = update_quantized_moment(
                view.codes, view.scale, grad.reshape(-1, view.period), self._nearest_table(grad.device), beta
            )
            view.codes.copy_(moment.codes)
            view.scale.copy_(moment.scale)
            m_hat = moment.m_hat
        view.step.add_(1)
        m_hat = m_hat.view(rows, cols)
        return m_hat.mul_(beta).add_(grad, alpha=1.0 - beta) if group["nesterov"] else m_hat

    @staticmethod
    def _orthogonalize(update: Tensor, group: Mapping[str, Any]) -> Tensor:
        """Newton–Schulz of ``update`` with the group's schedule (an empty matrix stays empty)."""
        if update.numel() == 0:
            return update
        schedule = resolve_schedule(group["ns_schedule"], group["ns_steps"])
        return newton_schulz(update, schedule, as_float(group["eps"]))

    def _finish(self, item: WorkItem, group: Mapping[str, Any], orthogonal: Tensor) -> None:
        """NorMuon (if on) and the decoupled-decay update of this rank's rows with ``O`` (``orthogonal``)."""
        state = self.state[item.param]
        rows, cols = item.param.shape  # the global shape sets the lr ratio
        target = item.target
        if group["normuon"]:
            if NORMUON_V not in state:  # turned on after the state was created
                fresh = normuon_state(target.shape[0], target.device, target.device if self.capturable else None)
                if item.shard is not None:
                    fresh[NORMUON_V] = as_sharded(fresh[NORMUON_V], item.shard, (rows,))
                state.update(fresh)
            state[NORMUON_STEP].add_(1)
            reduce = None
            if item.shard is not None and group.get("sharded_mode", "exact") != "approx":
                shard = item.shard

                def reduce(sums: Tensor) -> Tensor:
                    return all_reduce_(sums, shard.group, "sum")

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


def _muon_constants(device: torch.device, beta: float) -> Tensor:
    """The compiled momentum kernel's constants: entry 0 is the EMA weight ``1 − β`` (fp32, on ``device``)."""
    return constants_on(device, [[1.0 - beta] + [0.0] * (len(COMPILED_LAYOUT) - 1)])[0]


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
    if "ns_steps" in group or "ns_schedule" in group:
        try:
            resolve_schedule(group.get("ns_schedule"), group.get("ns_steps", 5))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None

"""One table-driven catalogue of bad inputs and faults (hardening.md §6 and §10), for every Gefen optimizer.

The catalogue is one table per optimizer (:data:`CATALOGUE`: ``gefen``, ``muon``, ``hybrid_gefen``,
``hybrid_adamw``), each a list of :class:`Case`; what differs between the optimizers under test (the model, how the
optimizer is built, the options of a true-fp16 rig) is data too (:data:`OPTIMIZERS`), so the drivers read the tables
and never ask which optimizer they hold. Each case names the phase (``construct``, ``step`` or ``load``), the fault,
the exception it must raise and a regex of its message. A few parametrized drivers run them:

* construct: the constructor raises.
* step: the fault is applied to a rig on its very first step (no state, the codebook must stay ``None``) and after
  two good steps; ``step()`` raises and afterwards everything is bit-identical (parameter values and dtypes, the full
  ``state_dict()`` including the nested hybrid halves, every codebook, every global step, the live state containers
  and tensor objects); a later good step then gives the same parameters and state as a control that never saw the
  fault. ``exc=None`` marks a documented contrast (the call must *not* raise).
* amp: true fp16 parameters with ``torch.amp.GradScaler("cpu")`` and an ``inf`` in one gradient: ``scaler.step``
  changes nothing, the scale is halved, and the next step matches a control.
* load: a corrupted copy of a real (``torch.save``/``torch.load`` round-tripped) checkpoint is refused, nothing
  changes, the caller's dict is not mutated, and a later good step matches a control.

Tensors are compared bit for bit (dtype, shape and raw bytes), which is ``torch.equal`` plus NaN payloads.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import gefen
from gefen import CheckpointError, ConfigError, StepError
from gefen.checkpoint import GROUP_METADATA_KEY, METADATA_KEY, SCHEMA_VERSION
from gefen.checkpoint_hybrid import split_hybrid_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Gefen learned its codebook:UserWarning")

KINDS = ("gefen", "muon", "hybrid_gefen", "hybrid_adamw")
NAN, INF = float("nan"), float("inf")
WARM = 2  # good steps before a fault "after warm-up"
FAULT_SEED, GOOD_SEED = 50, 100


class Boom(Exception):
    """Raised by a user closure."""


# ============================================================================================ rigs
def _matrices() -> nn.Module:
    """GefenMuon's model: it takes 2-D matrices only."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False))


def _embedding_and_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32), nn.Linear(32, 16))


def _gefen_in_two_groups(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    """0.weight (embedding), 1.weight, 1.bias | 2.weight, 2.bias (two caller groups, so group mirrors can
    disagree)."""
    named = list(model.named_parameters())
    return gefen.Gefen([{"params": named[:3]}, {"params": named[3:], "weight_decay": 0.1}], **kw)


def _muon_in_two_groups(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    """0.weight | 1.weight, NorMuon on (its state has normuon_v / normuon_step)."""
    named = list(model.named_parameters())
    return gefen.GefenMuon([{"params": named[:1]}, {"params": named[1:]}], normuon=True, **kw)


def _hybrid(backup: str) -> Callable[..., torch.optim.Optimizer]:
    """Muon half: 1.weight, 2.weight; backup half: 0.weight (embedding), 1.bias, 2.bias."""

    def build(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
        kw.setdefault("backup_optimizer", backup)
        return gefen.GefenMuonHybrid(model, **kw)

    return build


@dataclass(frozen=True)
class Optimizer:
    """What differs between the optimizers under test.

    Attributes:
        model: builds the (seeded) model.
        build: ``(model, **options) -> optimizer``.
        amp_options: options a true-fp16 rig adds (the case's own options win).
    """

    model: Callable[[], nn.Module]
    build: Callable[..., torch.optim.Optimizer]
    amp_options: dict[str, Any] = field(default_factory=dict)


OPTIMIZERS: dict[str, Optimizer] = {
    "gefen": Optimizer(_embedding_and_linears, _gefen_in_two_groups),
    "muon": Optimizer(_matrices, _muon_in_two_groups),
    "hybrid_gefen": Optimizer(_embedding_and_linears, _hybrid("gefen")),
    # torch AdamW keeps fp16 moments: eps=1e-8 would round to 0 (0/0 = NaN)
    "hybrid_adamw": Optimizer(_embedding_and_linears, _hybrid("adamw"), amp_options={"eps": 1e-3}),
}


def _model(kind: str) -> nn.Module:
    return OPTIMIZERS[kind].model()


def _build(kind: str, model: nn.Module, **options: Any) -> torch.optim.Optimizer:
    """The optimizer under test."""
    return OPTIMIZERS[kind].build(model, **{"lr": 1e-2, "fused": False, **options})


@dataclass
class Rig:
    kind: str
    model: nn.Module
    opt: Any
    scaler: torch.amp.GradScaler | None = None
    closure: Callable[[], Any] | None = None
    calls: list[str] = field(default_factory=list)

    def param(self, name: str) -> nn.Parameter:
        return dict(self.model.named_parameters())[name]


def _set_grads(rig: Rig, seed: int) -> None:
    """Deterministic dense gradients 0.01·N(0,1) for every parameter (scaled by the rig's GradScaler if any)."""
    gen = torch.Generator().manual_seed(seed)
    params = list(rig.model.parameters())
    loss = sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in params) * 0.01
    for p in params:
        p.grad = None
    (loss if rig.scaler is None else rig.scaler.scale(loss)).backward()


def _step(rig: Rig) -> Any:
    if rig.scaler is None:
        return rig.opt.step()
    out = rig.scaler.step(rig.opt)
    rig.scaler.update()
    return out


def _fresh(kind: str, options: dict[str, Any], amp: bool = False) -> Rig:
    model = _model(kind)
    opts = dict(options)
    if amp:
        model.half()
        opts = {**OPTIMIZERS[kind].amp_options, **opts}
    rig = Rig(kind, model, _build(kind, model, **opts))
    if amp:
        rig.scaler = torch.amp.GradScaler("cpu")
    return rig


def _warm(rig: Rig, steps: int) -> Rig:
    for s in range(steps):
        _set_grads(rig, s)
        _step(rig)
    return rig


def _key(options: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(options.items()))


_TEMPLATES: dict[Any, Rig] = {}


def _rig(kind: str, options: dict[str, Any], warm: int) -> Rig:
    """A rig after ``warm`` good steps (fp32; warm rigs are deep copies of one cached template)."""
    if warm == 0:
        return _fresh(kind, options)
    key = (kind, _key(options), warm)
    if key not in _TEMPLATES:
        _TEMPLATES[key] = _warm(_fresh(kind, options), warm)
    model, opt = copy.deepcopy((_TEMPLATES[key].model, _TEMPLATES[key].opt))
    return Rig(kind, model, opt)


_CONTROLS: dict[Any, tuple[list[torch.Tensor], dict[str, Any]]] = {}


def _control(kind: str, options: dict[str, Any], warm: int, amp: bool = False) -> tuple[list[Any], dict[str, Any]]:
    """Parameters and state dict of a freshly built optimizer that never saw a fault: warm-up, then the good step."""
    key = (kind, _key(options), warm, amp)
    if key not in _CONTROLS:
        rig = _warm(_fresh(kind, options, amp), warm)
        _set_grads(rig, GOOD_SEED)
        _step(rig)
        _CONTROLS[key] = ([p.detach().clone() for p in rig.model.parameters()], copy.deepcopy(rig.opt.state_dict()))
    return _CONTROLS[key]


def _assert_matches_control(rig: Rig, options: dict[str, Any], warm: int, amp: bool = False) -> None:
    params, state_dict = _control(rig.kind, options, warm, amp)
    _set_grads(rig, GOOD_SEED)
    _step(rig)
    for (name, p), q in zip(rig.model.named_parameters(), params):
        _assert_same(p.detach(), q, f"param {name} after a good step")
    _assert_same(_uncounted(rig.opt.state_dict()), _uncounted(state_dict), "state_dict after a good step")


def _uncounted(state_dict: Any) -> Any:
    """A state dict without its ``skipped_steps`` counters (the one thing a skipped step changes; compared
    separately)."""
    if isinstance(state_dict, dict):
        return {k: _uncounted(v) for k, v in state_dict.items() if k != "skipped_steps"}
    if isinstance(state_dict, list):
        return [_uncounted(v) for v in state_dict]
    return state_dict


# ============================================================================================ comparisons
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Recursive bit-identity of nested dicts/lists/tuples/tensors/scalars (NaN equals NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape, a.layout, a.device) == (b.dtype, b.shape, b.layout, b.device), path
        assert torch.equal(_bits(a), _bits(b)), path
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _children(opt: Any) -> list[Any]:
    return opt._children() if isinstance(opt, gefen.GefenMuonHybrid) else [opt]


def _snapshot(rig: Rig) -> dict[str, Any]:
    children = _children(rig.opt)
    return {
        "params": [(n, p.detach().clone()) for n, p in rig.model.named_parameters()],
        "state_dict": _uncounted(copy.deepcopy(rig.opt.state_dict())),
        "skipped_steps": rig.opt.skipped_steps,
        "codebooks": [copy.deepcopy(getattr(c, "codebook", None)) for c in children],
        "global_steps": [getattr(c, "global_step", None) for c in children],
        # the live containers and tensor objects themselves (a refusal must not swap them)
        "objects": [
            (
                id(c.state),
                id(c.param_groups),
                [id(g) for g in c.param_groups],
                {id(p): {k: id(v) for k, v in s.items()} for p, s in c.state.items()},
            )
            for c in children
        ],
    }


def _assert_unchanged(rig: Rig, before: dict[str, Any]) -> None:
    after = _snapshot(rig)
    for (name, old), (_, new) in zip(before["params"], after["params"]):
        _assert_same(new, old, f"param {name}")
    _assert_same(after["state_dict"], before["state_dict"], "state_dict")
    _assert_same(after["codebooks"], before["codebooks"], "codebook")
    assert after["global_steps"] == before["global_steps"]
    assert after["skipped_steps"] == before["skipped_steps"]
    assert after["objects"] == before["objects"], "live state / param_groups objects were replaced"


# ============================================================================================ the catalogue
@dataclass(frozen=True)
class Case:
    """One bad input or fault.

    Attributes:
        id: test id.
        phase: ``construct`` | ``step`` | ``load``.
        fault: construct: ``() -> None`` (``None``: build with ``options``); step: ``(rig) -> undo | None``,
            applied after the step's gradients are set; load: ``(checkpoint, rig) -> dict to load``.
        exc: expected exception type; ``None``: must not raise (documented contrast / skipped AMP step).
        match: regex the message must contain.
        warm: good steps before the fault (0: the very first step / a fresh optimizer).
        options: keyword arguments of the optimizer under test.
        source: load only: keyword arguments of the optimizer that saved the checkpoint.
        amp: step only: true fp16 parameters driven by ``torch.amp.GradScaler("cpu")``.
        after: extra check ``(rig) -> None`` once the fault was refused.
        xfail: reason, for a known source discrepancy (strict).
        kind: ``gefen`` | ``muon`` | ``hybrid_gefen`` | ``hybrid_adamw``: the table the case is in (set by
            :data:`CASES`).
    """

    id: str
    phase: str
    fault: Callable[..., Any] | None
    exc: type[BaseException] | None
    match: str = ""
    warm: tuple[int, ...] = (0, WARM)
    options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    amp: bool = False
    after: Callable[[Rig], None] | None = None
    xfail: str | None = None
    kind: str = ""


# -------------------------------------------------------------------------------------------- construct
def construct(id: str, exc: type[BaseException], match: str, fault=None, **options: Any) -> Case:
    return Case(id, "construct", fault, exc, match, warm=(), options=options)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape))


def _in_two_groups(w: nn.Parameter) -> Any:
    return gefen.Gefen([{"params": [w]}, {"params": [w]}], fused=False)


def _duplicate(make: Callable[[nn.Parameter], Any]) -> Callable[[], Any]:
    """Build an optimizer with one parameter passed twice: ``make(w)``."""
    w = _param(4, 4)
    return lambda: make(w)


# -------------------------------------------------------------------------------------------- step faults
def step(id: str, fault, exc, match: str, warm=(0, WARM), xfail=None, after=None, **options) -> Case:
    return Case(id, "step", fault, exc, match, warm=warm, options=options, xfail=xfail, after=after)


def _sparse(name: str):
    def fault(rig: Rig) -> None:
        p = rig.param(name)
        p.grad = p.grad.to_sparse()

    return fault


def _regrad(name: str, make: Callable[[torch.Tensor], torch.Tensor]):
    """Swap the gradient's payload through ``.data`` (the ``.grad`` setter itself refuses other dtypes/shapes)."""

    def fault(rig: Rig) -> None:
        p = rig.param(name)
        p.grad.data = make(p)

    return fault


def _poison(name: str, value: float):
    def fault(rig: Rig) -> None:
        rig.param(name).grad.view(-1)[3] = value

    return fault


def _closure_raises(rig: Rig):
    def closure() -> Any:
        raise Boom("boom from the user's closure")

    rig.closure = closure
    return lambda: setattr(rig, "closure", None)


def _set_group(index: int, **values: Any):
    def fault(rig: Rig):
        group = rig.opt.param_groups[index]
        old = {k: group[k] for k in values}
        group.update(values)
        return lambda: group.update(old)

    return fault


def _amp_controls(**attrs: Any):
    def fault(rig: Rig):
        for k, v in attrs.items():
            setattr(rig.opt, k, v)
        return lambda: [delattr(rig.opt, k) for k in attrs]

    return fault


def _flatten_param(name: str):
    """What ZeRO does to a Muon group: the 2-D parameter's storage is swapped for a flat 1-D partition."""

    def fault(rig: Rig):
        p = rig.param(name)
        saved_data, saved_grad = p.data, p.grad
        p.data = saved_data.reshape(-1).clone()
        p.grad = saved_grad.reshape(-1).clone()

        def undo() -> None:
            p.data = saved_data
            p.grad = None

        return undo

    return fault


_SKIPPED = r"skipped this step because the gradients of {} hold NaN/Inf.*nothing was changed \(1 skipped step"
PROPAGATE = {"nonfinite": "propagate"}


def _bad_gradients(kind: str, targets: dict[str, str]) -> list[Case]:
    """A sparse, complex, wrong-shape and int64 gradient on each target parameter (``name: label`` in the ids)."""
    return [
        c
        for name, label in targets.items()
        for c in (
            step(f"sparse grad/{kind}/{label}", _sparse(name), StepError, rf"{re.escape(name)}.*sparse_coo"),
            step(
                f"complex grad/{kind}/{label}",
                _regrad(name, lambda p: torch.ones(p.shape, dtype=torch.complex64)),
                StepError,
                rf"{re.escape(name)}.*complex64",
            ),
            step(
                f"wrong-shape grad/{kind}/{label}",
                _regrad(name, lambda p: torch.ones(p.shape[0] + 1, *p.shape[1:])),
                StepError,
                rf"{re.escape(name)}.*shape \((17|33)\b",
            ),
            step(
                f"int64 grad/{kind}/{label}",
                _regrad(name, lambda p: torch.ones(p.shape, dtype=torch.int64)),
                StepError,
                rf"{re.escape(name)}.*int64",
            ),
        )
    ]


def _nan_skipped(kind: str, *names: str) -> list[Case]:
    """Under the default nonfinite="skip" a NaN gradient skips the step (first or later): warned, counted, nothing
    else changes."""
    return [
        step(
            f"NaN grad, default skips/{kind}/{name}", _poison(name, NAN), UserWarning, _SKIPPED.format(re.escape(name))
        )
        for name in names
    ]


def _malformed_amp_controls(kind: str) -> list[Case]:
    """GradScaler controls set by hand (malformed): refused before anything changes."""
    return [
        step(f"{what}/{kind}", _amp_controls(**attrs), StepError, pattern)
        for what, attrs, pattern in (
            ("found_inf 2 elements", {"found_inf": torch.zeros(2), "grad_scale": None}, r"found_inf must be a 1-el"),
            ("grad_scale=0", {"found_inf": torch.zeros(1), "grad_scale": torch.tensor([0.0])}, r"grad_scale=0\.0 must"),
            ("grad_scale=inf", {"found_inf": torch.zeros(1), "grad_scale": torch.tensor([INF])}, r"grad_scale=inf mu"),
            ("only found_inf", {"found_inf": torch.zeros(1)}, r"only 'found_inf'"),
        )
    ]


def _closure_raising(kind: str) -> Case:
    """A user closure that raises: the exception propagates, nothing changed."""
    return step(f"closure raises/{kind}", _closure_raises, Boom, r"boom")


def _nan_after_warm_up(kind: str, name: str) -> list[Case]:
    """A NaN gradient on ``name`` after warm-up: refused under nonfinite='raise' and deterministic=True; the
    documented contrast: "propagate" (like AdamW) lets it through."""
    pattern = rf"{re.escape(name)} has NaN/Inf"
    return [
        step(
            f"NaN grad after warm-up, nonfinite='raise'/{kind}",
            _poison(name, NAN),
            StepError,
            pattern + r".*nonfinite=.?raise",
            warm=(WARM,),
            nonfinite="raise",
        ),
        step(
            f"NaN grad after warm-up, deterministic=True/{kind}",
            _poison(name, NAN),
            StepError,
            pattern + r".*deterministic=True",
            warm=(WARM,),
            deterministic=True,
        ),
        step(
            f"NaN grad after warm-up, propagate (contrast)/{kind}",
            _poison(name, NAN),
            None,
            "",
            warm=(WARM,),
            **PROPAGATE,
        ),
    ]


# -------------------------------------------------------------------------------------------- AMP overflow
def _amp(id: str, name: str) -> Case:
    return Case(id, "step", _poison(name, INF), None, "skipped: nothing changes, scale halved", amp=True)


# -------------------------------------------------------------------------------------------- load faults
def load(
    id: str,
    fault,
    exc=CheckpointError,
    match="",
    warm=(0, WARM),
    options=None,
    source=None,
    after=None,
    xfail=None,
) -> Case:
    return Case(
        id,
        "load",
        fault,
        exc,
        match,
        warm=warm,
        options=options or {},
        source=source or {},
        after=after,
        xfail=xfail,
    )


def _edit(mutate: Callable[[dict[str, Any]], Any]):
    """A load fault that edits (its own deep copy of) the checkpoint in place."""

    def fault(sd: dict[str, Any], rig: Rig) -> dict[str, Any]:
        mutate(sd)
        return sd

    return fault


def _as_schema1_reversed(sd: dict[str, Any]) -> None:
    """A hybrid checkpoint relabelled schema 1 (Muon groups first, by then) with its groups reversed."""
    mirrors = [sd["gefen_hybrid"]] + [g["gefen_hybrid"] for g in sd["param_groups"]]
    for meta in {id(m): m for m in mirrors}.values():
        meta["schema_version"] = 1
    sd["param_groups"].reverse()


def _metas(sd: dict[str, Any]) -> list[dict[str, Any]]:
    """The top-level metadata and every group mirror (after a torch.load they are one object; dedupe by id)."""
    top = [sd[METADATA_KEY]] if METADATA_KEY in sd else []  # a hybrid's halves carry the group mirrors only
    found = top + [g[GROUP_METADATA_KEY] for g in sd["param_groups"]]
    return list({id(m): m for m in found}.values())


def _set_meta(**values: Any):
    return _edit(lambda sd: [m.update(values) for m in _metas(sd)])


def _change_one_mirror(sd: dict[str, Any]) -> None:
    mirror = sd["param_groups"][1][GROUP_METADATA_KEY]
    sd["param_groups"][1][GROUP_METADATA_KEY] = dict(mirror, global_step=mirror["global_step"] + 1)


def _codebook(change: Callable[[torch.Tensor], torch.Tensor]):
    def mutate(sd: dict[str, Any]) -> None:
        new = change(_metas(sd)[0]["codebook"].clone())
        for m in _metas(sd):
            m["codebook"] = new

    return _edit(mutate)


def _swap(t: torch.Tensor) -> torch.Tensor:
    t[[10, 200]] = t[[200, 10]]
    return t


def _nan_at(t: torch.Tensor, i: int = 7) -> torch.Tensor:
    t.view(-1)[i] = NAN
    return t


def _entry(index: int, key: str, value: Any = None, fn: Callable[[torch.Tensor], Any] | None = None, pop=False):
    """Edit ``state[index][key]``: replace it, transform it, or delete it."""

    def mutate(sd: dict[str, Any]) -> None:
        entry = sd["state"][index]
        if pop:
            del entry[key]
        else:
            entry[key] = fn(entry[key]) if fn is not None else value

    return _edit(mutate)


def _as_halves(sd: dict[str, Any]) -> dict[str, Any]:
    """A hybrid checkpoint (torch's layout) rewritten in the gefen 0.1 halves layout, which loads by migration."""
    split = split_hybrid_state_dict(sd)
    return {
        "muon": _from_zero(split.muon),
        "backup": _from_zero(split.backup),
        "backup_optimizer": split.backup_optimizer,
        "deterministic": split.deterministic,
        "skipped_steps": split.skipped_steps,
    }


def _from_zero(half: dict[str, Any] | None) -> dict[str, Any] | None:
    """A half's state dict with its parameter indices renumbered from 0, as its child's own state_dict() has them."""
    if half is None:
        return None
    pids = [pid for g in half["param_groups"] for pid in g["params"]]
    index = {pid: i for i, pid in enumerate(pids)}
    groups = [dict(g, params=[index[pid] for pid in g["params"]]) for g in half["param_groups"]]
    return {"state": {index[pid]: v for pid, v in half["state"].items()}, "param_groups": groups}


def _half(half: str, fault):
    """Apply a native fault to one half of a hybrid checkpoint (loaded through the halves layout's migration)."""

    def wrapped(sd: dict[str, Any], rig: Rig) -> dict[str, Any]:
        halves = _as_halves(sd)
        halves[half] = fault(halves[half], rig)
        return halves

    return wrapped


def _halves(mutate: Callable[[dict[str, Any]], Any]):
    """A load fault that edits the halves-layout form of a hybrid checkpoint."""

    def fault(sd: dict[str, Any], rig: Rig) -> dict[str, Any]:
        halves = _as_halves(sd)
        mutate(halves)
        return halves

    return fault


def _neg(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[0] = -1.0
    return t


def _extra_group(sd: dict[str, Any]) -> None:
    sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))


def _prehook_replaces(bad_fault):
    """A load pre-hook returns a corrupted replacement of the (good) dict it is given."""

    def fault(sd: dict[str, Any], rig: Rig) -> dict[str, Any]:
        def pre(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
            rig.calls.append("pre")
            return bad_fault(copy.deepcopy(state_dict), rig)

        rig.opt.register_load_state_dict_pre_hook(pre)
        rig.opt.register_load_state_dict_post_hook(lambda opt: rig.calls.append("post"))
        return sd

    return fault


def _pre_once_post_never(rig: Rig) -> None:
    assert rig.calls == ["pre"]


_bad_codes = _entry(1, "first_moment_codes", fn=lambda t: t.float())


def _prehook_case(corrupt) -> Case:
    """A load pre-hook returns a replacement corrupted by ``corrupt`` (its codebook stripped)."""
    return load(
        "load pre-hook returns a corrupted replacement",
        _prehook_replaces(corrupt),
        match=r"no frozen codebook",
        after=_pre_once_post_never,
    )


def _hybrid_layout() -> list[Case]:
    """The hybrid's layout (torch's, over both halves; and gefen 0.1's halves layout, loaded by migration)."""
    return [
        load(
            "flat {state, param_groups} dict",
            lambda sd, rig: {"state": {}, "param_groups": []},
            match=r"not a GefenMuonHybrid checkpoint",
        ),
        load(
            "the muon half on its own",
            lambda sd, rig: _as_halves(sd)["muon"],
            match=r"not a GefenMuonHybrid checkpoint: the 'gefen_hybrid' entry is missing",
        ),
        load(
            "halves layout: missing backup half (key)",
            _halves(lambda sd: sd.pop("backup")),
            match=r"not a GefenMuonHybrid checkpoint",
        ),
        load(
            "halves layout: missing backup half (None)",
            _halves(lambda sd: sd.update(backup=None)),
            match=r"backup half does not match",
        ),
        load(
            "backup groups dropped",
            _edit(lambda sd: sd.update(param_groups=[g for g in sd["param_groups"] if g["hybrid_half"] == "muon"])),
            match=r"backup half does not match|no param group lists",
        ),
        load(
            "a group without hybrid_half",
            _edit(lambda sd: sd["param_groups"][0].pop("hybrid_half")),
            match=r"param_groups\[0\]\['hybrid_half'\]=None must be",
        ),
        load(
            "groups in another order of halves than the live list's",
            _edit(lambda sd: sd["param_groups"].reverse()),
            match=r"belong to the halves \['backup', 'muon'\], this hybrid's to \['muon', 'backup'\]",
        ),
        load(
            "schema 1: a Muon group after the backup groups",
            _edit(_as_schema1_reversed),
            match=r"Muon group after backup groups; schema 1",
        ),
        load(
            "hybrid metadata copies differ",
            _edit(lambda sd: sd["param_groups"][0].update(gefen_hybrid={**sd["gefen_hybrid"], "skipped_steps": 7})),
            match=r"hybrid metadata.*copies differ",
        ),
        load(
            "hybrid schema_version 3",
            _edit(lambda sd: sd["gefen_hybrid"].update(schema_version=3)),
            match=r"hybrid checkpoint schema_version=3",
        ),
        load(
            "hybrid skipped_steps -1",
            _edit(lambda sd: sd["gefen_hybrid"].update(skipped_steps=-1)),
            match=r"hybrid skipped_steps=-1",
        ),
        load(
            "a state entry no group lists",
            _edit(lambda sd: sd["state"].update({999: sd["state"][0]})),
            match=r"\[999\], which no param group lists",
        ),
        load("muon half codebook with NaN", _half("muon", _codebook(_nan_at)), match=r"muon half.*NaN"),
        load(
            "muon half normuon_step missing",
            _half("muon", _entry(0, "normuon_step", pop=True)),
            match=r"muon half.*has keys",
        ),
        load(
            "muon half momentum=1.0",
            _half("muon", _edit(lambda sd: sd["param_groups"][0].update(momentum=1.0))),
            match=r"muon half.*momentum",
        ),
        load(
            "extra backup param group",
            _half("backup", _edit(_extra_group)),
            match=r"backup half.*different number of parameter groups",
        ),
    ]


# ============================================================================================ the tables
# per-parameter state of the checkpoints below: index 1 = 1.weight (factored for Gefen); 2 = 1.bias (block);
# 4 = 2.bias (Gefen's last parameter)
GEFEN: list[Case] = [
    # construct
    construct("deterministic=1", TypeError, r"deterministic=1 must be a bool", deterministic=1),
    construct("deterministic='true'", TypeError, r"deterministic='true' must be a bool", deterministic="true"),
    construct("capturable=1", TypeError, r"capturable=1 must be a bool", capturable=1),
    construct("nonfinite='maybe'", ConfigError, r"nonfinite='maybe'", nonfinite="maybe"),
    construct(
        "deterministic+propagate", ConfigError, r"refuses to let non-finite", deterministic=True, nonfinite="propagate"
    ),
    # capturable+skip is accepted by Gefen (decided on the device by the Triton backend; refused inside a capture on
    # any other backend: tests/optim/test_triton_capturable.py)
    construct(
        "capturable+deterministic",
        ConfigError,
        r"capturable=True.*deterministic=True",
        capturable=True,
        deterministic=True,
    ),
    construct(
        "capturable+raise", ConfigError, r"capturable=True.*nonfinite='raise'", capturable=True, nonfinite="raise"
    ),
    construct("eps=0", ConfigError, r"\['eps'\]=0\.0 must be a finite number > 0", eps=0.0),
    construct("eps=-1", ConfigError, r"\['eps'\]=-1.* > 0", eps=-1.0),
    construct("eps=nan", ConfigError, r"\['eps'\]=nan.* > 0", eps=NAN),
    construct("eps=inf", ConfigError, r"\['eps'\]=inf.* > 0", eps=INF),
    construct("betas=(0.9,1.0)", ConfigError, r"\['betas'\]\[1\]=1\.0 must be a number in \[0, 1\)", betas=(0.9, 1.0)),
    construct("lr=-1", ConfigError, r"\['lr'\]=-1\.0 must be a finite number >= 0", lr=-1.0),
    construct("lr=2-element tensor", ConfigError, r"1-element", lr=torch.tensor([1e-3, 2e-3])),
    construct("weight_decay=-0.1", ConfigError, r"\['weight_decay'\]=-0\.1", weight_decay=-0.1),
    construct("empty params", ValueError, r"empty", fault=lambda: gefen.Gefen([], fused=False)),
    construct(
        "duplicate param",
        ConfigError,
        r"same parameter twice",
        fault=_duplicate(lambda w: gefen.Gefen([w, w], fused=False)),
    ),
    construct(
        "param in two groups",
        ConfigError,
        r"param_groups\[1\]\['params'\]\[0\] is already in this Gefen as param_groups\[0\]\['params'\]\[0\]",
        fault=lambda: _in_two_groups(_param(4, 4)),
    ),
    # step: the bad gradient goes to the second parameter
    *_bad_gradients("gefen", {"1.weight": "1.weight"}),
    *_nan_skipped("gefen", "1.weight"),
    step("huge grad, default skips/gefen", _poison("1.weight", 1e20), UserWarning, _SKIPPED.format("1.weight")),
    # under "propagate" a parameter's first gradient is still refused (period search and codebook)
    step(
        "NaN first grad/gefen/propagate",
        _poison("1.weight", NAN),
        StepError,
        r"1\.weight has NaN/Inf",
        warm=(0,),
        **PROPAGATE,
    ),
    # finite but beyond sqrt(float32 max): its square (the second moment) would overflow
    step(
        "huge first grad/gefen/propagate",
        _poison("1.weight", 1e20),
        StepError,
        r"1\.weight.*sums of squares overflow",
        warm=(0,),
        **PROPAGATE,
    ),
    step(
        "huge grad/gefen/nonfinite=raise",
        _poison("1.weight", -1.5e19),  # its square is finite, its row sums are not
        StepError,
        r"1\.weight.*sums of squares overflow.*nonfinite='raise'",
        warm=(WARM,),
        nonfinite="raise",
    ),
    *_malformed_amp_controls("gefen"),
    _closure_raising("gefen"),
    step("lr=nan by hand/gefen", _set_group(1, lr=NAN), ConfigError, r"param_groups\[1\]\['lr'\]=nan"),
    *_nan_after_warm_up("gefen", "1.weight"),
    # AMP
    _amp("fp16 GradScaler overflow/gefen", "1.weight"),
    # load: policy
    load(
        "deterministic ckpt into non-deterministic",
        lambda sd, rig: sd,
        match=r"deterministic=True.*"
        r"intentional state migration",
        source={"deterministic": True},
    ),
    load(
        "non-deterministic ckpt into deterministic",
        lambda sd, rig: sd,
        match=r"deterministic=False.*"
        r"intentional state migration",
        options={"deterministic": True},
    ),
    load("deterministic tag 'true'", _set_meta(deterministic="true"), match=r"must be a bool"),
    load("deterministic tag 1", _set_meta(deterministic=1), match=r"must be a bool"),
    load("deterministic tag None (v2)", _set_meta(deterministic=None), match=r"must be a bool"),
    # load: metadata copies
    load(
        "mirror on only some groups",
        _edit(lambda sd: sd["param_groups"][1].pop(GROUP_METADATA_KEY)),
        match=r"present on only some parameter groups",
    ),
    load("one mirror's global_step changed", _edit(_change_one_mirror), match=r"inconsistent"),
    load(
        "top-level global_step changed",
        _edit(lambda sd: sd.__setitem__(METADATA_KEY, dict(sd[METADATA_KEY], global_step=7))),
        match=r"inconsistent",
    ),
    load("codebook stripped (top level and mirrors)", _set_meta(codebook=None), match=r"no frozen codebook"),
    load("codebook with 255 entries", _codebook(lambda t: t[:255].clone()), match=r"codebook.*\(256,\)"),
    load("codebook with NaN", _codebook(_nan_at), match=r"codebook.*NaN"),
    load("codebook unsorted", _codebook(_swap), match=r"codebook.*not sorted"),
    load("newer schema_version", _set_meta(schema_version=SCHEMA_VERSION + 1), match=r"newer"),
    load("other optimizer kind", _set_meta(optimizer="GefenMuon"), match=r"saved by optimizer 'GefenMuon'"),
    # load: per-parameter state
    load("codes as float32", _bad_codes, match=r"first_moment_codes'\] has dtype torch.float32"),
    load("magnitude negative", _entry(1, "first_moment_scale", fn=_neg), match=r"scale'\] has negative"),
    load(
        "second moment NaN (factored)",
        _entry(1, "second_moment_row", fn=_nan_at),
        match=r"second_moment_row'\] has negative or non-finite",
    ),
    load(
        "second moment NaN (block)",
        _entry(2, "second_moment", fn=lambda t: _nan_at(t, 0)),
        match=r"'second_moment'\] has negative or non-finite",
    ),
    load("step=tensor([1.,2.])", _entry(1, "step", torch.tensor([1.0, 2.0])), match=r"\['step'\] must be"),
    load("step=1.5", _entry(1, "step", 1.5), match=r"\['step'\]=1\.5"),
    load("step=2**70", _entry(1, "step", 2**70), match=r"does not fit the int64"),
    load("non-string state key", _entry(1, 7, torch.zeros(1)), match=r"non-string keys"),
    load(
        "param_names shorter than params",
        _edit(lambda sd: sd["param_groups"][0].update(param_names=["0.weight"])),
        match=r"param_names.*one name",
    ),
    load("step=True", _entry(1, "step", True), match=r"\['step'\]=True"),
    load("step=-1", _entry(1, "step", -1), match=r"\['step'\]=-1 must be >= 1"),
    load("period=0", _entry(1, "period", torch.tensor(0)), match=r"\['period'\]=0 does not divide"),
    load("period not dividing", _entry(2, "period", torch.tensor(7)), match=r"\['period'\]=7 does not div"),
    load("factored entry without second_moment_col", _entry(1, "second_moment_col", pop=True), match=r"has keys"),
    load(
        "invalid counter only on the last parameter",
        _entry(4, "step", torch.tensor(-3)),
        match=r"state\[4\] \(2\.bias\)\['step'\]=-3",
    ),
    # load: groups
    load("extra param group", _edit(_extra_group), match=r"different number of parameter groups"),
    load(
        "eps=0 in a saved group",
        _edit(lambda sd: sd["param_groups"][0].update(eps=0.0)),
        match=r"param_groups\[0\]\['eps'\]=0\.0",
    ),
    load(
        "betas=(0.9,1.0) in a saved group",
        _edit(lambda sd: sd["param_groups"][1].update(betas=(0.9, 1.0))),
        match=r"param_groups\[1\]\['betas'\]",
    ),
    # load: hooks
    _prehook_case(_set_meta(codebook=None)),
]

MUON: list[Case] = [
    # construct
    construct("deterministic=1", TypeError, r"deterministic=1 must be a bool", deterministic=1),
    construct("capturable=1", TypeError, r"capturable=1 must be a bool", capturable=1),
    construct("nonfinite='maybe'", ConfigError, r"nonfinite='maybe'", nonfinite="maybe"),
    construct("capturable+skip", ConfigError, r"capturable=True.*nonfinite='skip'", capturable=True, nonfinite="skip"),
    construct(
        "capturable+deterministic",
        ConfigError,
        r"capturable=True.*deterministic=True",
        capturable=True,
        deterministic=True,
    ),
    construct("eps=0", ConfigError, r"\['eps'\]=0\.0", eps=0.0),
    construct("eps=nan", ConfigError, r"\['eps'\]=nan", eps=NAN),
    construct("normuon_eps=0", ConfigError, r"normuon_eps", normuon_eps=0.0),
    construct("lr=-1", ConfigError, r"\['lr'\]=-1\.0", lr=-1.0),
    construct("lr=2-element tensor", ConfigError, r"1-element", lr=torch.tensor([1e-3, 2e-3])),
    construct("weight_decay=-0.1", ConfigError, r"\['weight_decay'\]=-0\.1", weight_decay=-0.1),
    construct("momentum=1.0", ConfigError, r"\['momentum'\]=1\.0 must be a number in \[0, 1\)", momentum=1.0),
    construct(
        "1-D parameter",
        ConfigError,
        r"shape \(16,\); GefenMuon optimizes 2-D",
        fault=lambda: gefen.GefenMuon([_param(16)], fused=False),
    ),
    construct("empty params", ValueError, r"empty", fault=lambda: gefen.GefenMuon([], fused=False)),
    construct(
        "duplicate param",
        ConfigError,
        r"same parameter twice",
        fault=_duplicate(lambda w: gefen.GefenMuon([w, w], fused=False)),
    ),
    # step: the bad gradient goes to the second parameter
    *_bad_gradients("muon", {"1.weight": "1.weight"}),
    *_nan_skipped("muon", "1.weight"),
    step(
        "NaN first grad/muon/propagate",
        _poison("1.weight", NAN),
        StepError,
        r"1\.weight has NaN/Inf",
        warm=(0,),
        **PROPAGATE,
    ),
    *_malformed_amp_controls("muon"),
    _closure_raising("muon"),
    step("lr=nan by hand/muon", _set_group(1, lr=NAN), ConfigError, r"param_groups\[1\]\['lr'\]=nan"),
    step("muon param flattened to 1-D (ZeRO)", _flatten_param("1.weight"), ValueError, r"2-D"),
    *_nan_after_warm_up("muon", "1.weight"),
    # AMP
    _amp("fp16 GradScaler overflow/muon", "1.weight"),
    # load: policy
    load(
        "deterministic ckpt into non-deterministic",
        lambda sd, rig: sd,
        match=r"deterministic=True",
        source={"deterministic": True},
    ),
    load("deterministic tag 1", _set_meta(deterministic=1), match=r"must be a bool"),
    # load: metadata copies
    load(
        "mirror on only some groups",
        _edit(lambda sd: sd["param_groups"][0].pop(GROUP_METADATA_KEY)),
        match=r"present on only some parameter groups",
    ),
    load("one mirror's global_step changed", _edit(_change_one_mirror), match=r"inconsistent"),
    load("codebook stripped (top level and mirrors)", _set_meta(codebook=None), match=r"no frozen codebook"),
    load("codebook with NaN", _codebook(_nan_at), match=r"codebook.*NaN"),
    load("other optimizer kind", _set_meta(optimizer="Gefen"), match=r"saved by optimizer 'Gefen'"),
    # load: per-parameter state (index 1 = 1.weight, the last parameter)
    load("codes as float32", _bad_codes, match=r"first_moment_codes'\] has dtype torch.float32"),
    load(
        "group lacks a hyperparameter",
        _edit(lambda sd: sd["param_groups"][0].pop("nesterov")),
        match=r"lacks the hyperparameters \['nesterov'\]",
    ),
    load("step=tensor(nan)", _entry(1, "step", torch.tensor(NAN)), match=r"\['step'\] must be"),
    load("normuon_v negative", _entry(1, "normuon_v", fn=_neg), match=r"normuon_v'\] has negative"),
    load("normuon_step missing", _entry(1, "normuon_step", pop=True), match=r"has keys"),
    load(
        "invalid counter only on the last parameter",
        _entry(1, "normuon_step", torch.tensor(99)),
        match=r"normuon_step'\]=99 must be in",
    ),
    # load: groups
    load("extra param group", _edit(_extra_group), match=r"different number of parameter groups"),
    load(
        "eps=0 in a saved group",
        _edit(lambda sd: sd["param_groups"][1].update(eps=0.0)),
        match=r"param_groups\[1\]\['eps'\]",
    ),
    load(
        "momentum=1.0 in a saved group",
        _edit(lambda sd: sd["param_groups"][0].update(momentum=1.0)),
        match=r"momentum",
    ),
    load(
        "normuon_eps=0 in a saved group",
        _edit(lambda sd: sd["param_groups"][0].update(normuon_eps=0.0)),
        match=r"normuon_eps",
    ),
    # load: hooks
    _prehook_case(_set_meta(codebook=None)),
]

HYBRID_GEFEN: list[Case] = [
    # construct
    construct("deterministic=1", TypeError, r"deterministic=1 must be a bool", deterministic=1),
    construct("capturable=1", TypeError, r"capturable=1 must be a bool", capturable=1),
    construct(
        "deterministic+propagate", ConfigError, r"refuses to let non-finite", deterministic=True, nonfinite="propagate"
    ),
    construct("capturable+skip", ConfigError, r"capturable=True.*nonfinite='skip'", capturable=True, nonfinite="skip"),
    construct(
        "capturable+raise", ConfigError, r"capturable=True.*nonfinite='raise'", capturable=True, nonfinite="raise"
    ),
    construct("eps=0", ConfigError, r"GefenMuonHybrid: eps=0\.0", eps=0.0),
    construct("betas=(0.9,1.0)", ConfigError, r"GefenMuonHybrid: betas\[1\]", betas=(0.9, 1.0)),
    construct("momentum=1.0", ConfigError, r"\['momentum'\]=1\.0", momentum=1.0),
    construct("backup_optimizer='sgd'", ConfigError, r"backup_optimizer='sgd'", backup_optimizer="sgd"),
    construct(
        "no params",
        ConfigError,
        r"got no parameter",
        fault=lambda: gefen.GefenMuonHybrid(nn.ReLU(), lr=1e-3, fused=False),
    ),
    construct(
        "duplicate param",
        ConfigError,
        r"'b\.weight' is the same tensor as 'a\.weight'.*listed twice",
        fault=_duplicate(lambda w: gefen.GefenMuonHybrid([("a.weight", w), ("b.weight", w)], lr=1e-3, fused=False)),
    ),
    # step: the bad gradient goes once to each half
    *_bad_gradients("hybrid_gefen", {"2.weight": "muon-half", "1.bias": "backup-half"}),
    *_nan_skipped("hybrid_gefen", "2.weight", "1.bias"),
    step(
        "NaN first grad/hybrid_gefen/muon-half/propagate",
        _poison("2.weight", NAN),
        StepError,
        r"2\.weight has NaN/Inf",
        warm=(0,),
        **PROPAGATE,
    ),
    step(
        "NaN first grad/hybrid_gefen/backup-half/propagate",
        _poison("1.bias", NAN),
        StepError,
        r"1\.bias has NaN/Inf",
        warm=(0,),
        **PROPAGATE,
    ),
    *_malformed_amp_controls("hybrid_gefen"),
    _closure_raising("hybrid_gefen"),
    step("lr=nan by hand/hybrid_gefen/muon-half", _set_group(0, lr=NAN), ConfigError, r"'lr'\]=nan"),
    step("lr=nan by hand/hybrid_gefen/backup-half", _set_group(1, lr=NAN), ConfigError, r"'lr'\]=nan"),
    *_nan_after_warm_up("hybrid_gefen", "1.bias"),
    # AMP
    _amp("fp16 GradScaler overflow/hybrid_gefen/muon-half", "2.weight"),
    _amp("fp16 GradScaler overflow/hybrid_gefen/backup-half", "1.bias"),
    # load
    load(
        "non-deterministic ckpt into deterministic",
        lambda sd, rig: sd,
        match=r"deterministic=False.*intentional state migration",
        options={"deterministic": True},
    ),
    _prehook_case(_half("muon", _set_meta(codebook=None))),
    *_hybrid_layout(),
    load(
        "backup_optimizer 'adamw' into a gefen-backed hybrid",
        _edit(lambda sd: sd["gefen_hybrid"].update(backup_optimizer="adamw")),
        match=r"backup optimizer is 'adamw'",
    ),
    load("backup half: codes as float32", _half("backup", _bad_codes), match=r"backup half.*dtype torch.float32"),
    load(
        "backup half: second moment NaN",
        _half("backup", _entry(2, "second_moment", fn=lambda t: _nan_at(t, 0))),
        match=r"backup half.*non-finite",
    ),
    load(
        "backup half: betas (0.9,1.0)",
        _half("backup", _edit(lambda sd: sd["param_groups"][0].update(betas=(0.9, 1.0)))),
        match=r"backup half.*betas",
    ),
]

HYBRID_ADAMW: list[Case] = [
    # construct
    construct("deterministic='true'", TypeError, r"deterministic.*must be a bool", deterministic="true"),
    construct("nonfinite='maybe'", ConfigError, r"nonfinite='maybe'", nonfinite="maybe"),
    construct("eps=-1", ConfigError, r"GefenMuonHybrid: eps=-1\.0", eps=-1.0),
    construct("betas=(0.9,1.0)", ConfigError, r"GefenMuonHybrid: betas\[1\]", betas=(0.9, 1.0)),
    construct("lr=-1", ConfigError, r"GefenMuonHybrid: lr=-1\.0", lr=-1.0),
    construct(
        "capturable with adamw backup",
        ConfigError,
        r"capturable=True, backup_optimizer='adamw'.*not supported",
        capturable=True,
    ),
    # step: the bad gradient goes once to each half
    *_bad_gradients("hybrid_adamw", {"2.weight": "muon-half", "1.bias": "backup-half"}),
    *_nan_skipped("hybrid_adamw", "2.weight", "1.bias"),
    step(
        "NaN first grad/hybrid_adamw/muon-half/propagate",
        _poison("2.weight", NAN),
        StepError,
        r"2\.weight has NaN/Inf",
        warm=(0,),
        **PROPAGATE,
    ),
    *_malformed_amp_controls("hybrid_adamw"),
    _closure_raising("hybrid_adamw"),
    step("lr=nan by hand/hybrid_adamw/muon-half", _set_group(0, lr=NAN), ConfigError, r"'lr'\]=nan"),
    step("lr=nan by hand/hybrid_adamw/backup-half", _set_group(1, lr=NAN), ConfigError, r"lr"),
    *_nan_after_warm_up("hybrid_adamw", "1.bias"),
    step(
        "inf grad after warm-up, nonfinite='raise'/hybrid_adamw/muon-half",
        _poison("2.weight", INF),
        StepError,
        r"2\.weight has NaN/Inf",
        warm=(WARM,),
        nonfinite="raise",
    ),
    # AMP
    _amp("fp16 GradScaler overflow/hybrid_adamw/muon-half", "2.weight"),
    _amp("fp16 GradScaler overflow/hybrid_adamw/backup-half", "0.weight"),
    # load
    load(
        "deterministic ckpt into non-deterministic",
        lambda sd, rig: sd,
        match=r"deterministic=True.*intentional state migration",
        source={"deterministic": True},
    ),
    load(
        "hybrid policy tag not a bool",
        _edit(lambda sd: sd["gefen_hybrid"].update(deterministic="yes")),
        match=r"hybrid deterministic policy must be a bool",
    ),
    _prehook_case(_half("muon", _set_meta(codebook=None))),
    *_hybrid_layout(),
    load(
        "backup_optimizer 'gefen' into an adamw-backed hybrid",
        _edit(lambda sd: sd["gefen_hybrid"].update(backup_optimizer="gefen")),
        match=r"backup optimizer is 'gefen'",
    ),
    load(
        "AdamW backup state missing 'step'",
        _half("backup", _entry(1, "step", pop=True)),
        match=r"backup half.*KeyError: 'step'",
        warm=(0, WARM),
    ),
]

#: The catalogue: one table per optimizer.
CATALOGUE: dict[str, list[Case]] = {
    "gefen": GEFEN,
    "muon": MUON,
    "hybrid_gefen": HYBRID_GEFEN,
    "hybrid_adamw": HYBRID_ADAMW,
}
CASES: list[Case] = [dataclasses.replace(c, kind=kind) for kind, cases in CATALOGUE.items() for c in cases]


def _ids(cases: list[Case]) -> list[str]:
    return [f"{c.id}[{c.kind}]" if c.kind not in c.id else c.id for c in cases]


def _params(phase: str, amp: bool = False) -> list[Any]:
    out = []
    for c in CASES:
        if c.phase != phase or c.amp != amp:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
        warms = c.warm if phase != "construct" else (None,)
        for w in warms:
            suffix = "" if w is None else ("/first" if w == 0 else f"/after-{w}")
            out.append(pytest.param(c, w, id=_ids([c])[0] + suffix, marks=marks))
    return out


# ============================================================================================ drivers
def test_catalogue_is_large_and_ids_are_unique() -> None:
    assert len(CASES) >= 45
    ids = [p.id for phase in ("construct", "step", "load") for p in _params(phase)] + [
        p.id for p in _params("step", True)
    ]
    assert len(ids) == len(set(ids))
    assert {c.kind for c in CASES} == set(KINDS)
    assert tuple(CATALOGUE) == tuple(OPTIMIZERS) == KINDS and all(CATALOGUE.values())


@pytest.mark.parametrize(("case", "warm"), _params("construct"))
def test_construct_faults(case: Case, warm: None) -> None:
    with pytest.raises(case.exc, match=case.match):
        if case.fault is not None:
            case.fault()
        else:
            _build(case.kind, _model(case.kind), **case.options)


@pytest.mark.parametrize(("case", "warm"), _params("step"))
def test_step_faults(case: Case, warm: int) -> None:
    rig = _rig(case.kind, case.options, warm)
    _set_grads(rig, FAULT_SEED)
    before = _snapshot(rig)
    undo = case.fault(rig)
    if case.exc is None:  # documented contrast: not refused, the step is taken
        rig.opt.step(rig.closure)
        assert [getattr(c, "global_step", None) for c in _children(rig.opt)] != before["global_steps"]
        return
    if issubclass(case.exc, Warning):  # a skipped step: warned and counted, nothing else changes
        with pytest.warns(case.exc, match=case.match):
            rig.opt.step(rig.closure)
        before["skipped_steps"] += 1
    else:
        with pytest.raises(case.exc, match=case.match):
            rig.opt.step(rig.closure)
    if undo is not None:
        undo()
    _assert_unchanged(rig, before)
    if warm == 0:
        assert all(getattr(c, "codebook", None) is None for c in _children(rig.opt))
        assert all(len(c.state) == 0 for c in _children(rig.opt))
    assert not {"found_inf", "grad_scale"} & set(vars(rig.opt))
    _assert_matches_control(rig, case.options, warm)


@pytest.mark.parametrize(("case", "warm"), _params("step", amp=True))
def test_amp_overflow_changes_nothing(case: Case, warm: int) -> None:
    rig = _warm(_fresh(case.kind, case.options, amp=True), warm)
    assert all(p.dtype == torch.float16 for p in rig.model.parameters())
    _set_grads(rig, FAULT_SEED)
    case.fault(rig)
    assert rig.opt._step_supports_amp_scaling
    before = _snapshot(rig)
    scale = rig.scaler.get_scale()
    assert rig.scaler.step(rig.opt) is None
    rig.scaler.update()
    assert rig.scaler.get_scale() == scale / 2
    _assert_unchanged(rig, before)
    assert not {"found_inf", "grad_scale"} & set(vars(rig.opt))
    if warm == 0:
        assert all(getattr(c, "codebook", None) is None for c in _children(rig.opt))
    _assert_matches_control(rig, case.options, warm, amp=True)


_CHECKPOINTS: dict[Any, bytes] = {}


def _checkpoint(kind: str, source: dict[str, Any]) -> dict[str, Any]:
    """A fresh ``torch.load`` of a real checkpoint saved after two good steps."""
    key = (kind, _key(source))
    if key not in _CHECKPOINTS:
        buf = io.BytesIO()
        torch.save(_warm(_fresh(kind, source), WARM).opt.state_dict(), buf)
        _CHECKPOINTS[key] = buf.getvalue()
    return torch.load(io.BytesIO(_CHECKPOINTS[key]), weights_only=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("warm", [0, WARM])
def test_unmodified_checkpoint_is_accepted(kind: str, warm: int) -> None:
    """The baseline every load case corrupts is itself loadable (so each refusal is due to its fault)."""
    rig = _rig(kind, {}, warm)
    sd = _checkpoint(kind, {})
    rig.opt.load_state_dict(sd)
    _assert_same(rig.opt.state_dict(), _checkpoint(kind, {}), "reloaded state_dict")


@pytest.mark.parametrize(("case", "warm"), _params("load"))
def test_load_faults(case: Case, warm: int) -> None:
    rig = _rig(case.kind, case.options, warm)
    bad = case.fault(_checkpoint(case.kind, case.source), rig)
    frozen = copy.deepcopy(bad)
    before = _snapshot(rig)
    with pytest.raises(case.exc, match=case.match):
        rig.opt.load_state_dict(bad)
    _assert_same(bad, frozen, "caller's checkpoint")
    _assert_unchanged(rig, before)
    if case.after is not None:
        case.after(rig)
    if warm == 0:
        assert all(getattr(c, "codebook", None) is None for c in _children(rig.opt))
    _assert_matches_control(rig, case.options, warm)

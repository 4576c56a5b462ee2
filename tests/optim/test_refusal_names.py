"""Every refusal that concerns one parameter names it by the name the caller gave (issue 38), and changes nothing.

Each case builds the refusal with named parameters (``(name, tensor)`` pairs, a module's names) whose names appear
nowhere else in the call, so the message can only contain them if the library put them there; where two places are
involved (a tensor listed twice, a tensor already held), both names must appear.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import gefen
from gefen import CheckpointError, ConfigError, StepError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NAME, OTHER = "encoder.layer3.kernel", "decoder.proj_weight"


def _w(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape).to(dtype))


class _Held:
    """An optimizer built before the refusal, whose groups and state must survive it bit for bit."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.before = self._snapshot()

    def _snapshot(self) -> Any:
        groups = [(id(g), copy.deepcopy({k: v for k, v in g.items() if k != "params"}), [id(p) for p in g["params"]])
                  for g in self.opt.param_groups]  # fmt: skip
        return groups, copy.deepcopy(self.opt.state_dict())

    def assert_unchanged(self) -> None:
        groups, sd = self._snapshot()
        assert groups == self.before[0]
        _assert_same(sd, self.before[1], "state_dict")


def _assert_same(a: Any, b: Any, path: str) -> None:
    """Nested dicts/lists/tensors equal bit for bit (dtype, shape, values; NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _stepped(opt: Any, params: list[nn.Parameter]) -> Any:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


@dataclass(frozen=True)
class Case:
    """``make() -> held or None``: provokes the refusal (the optimizer it was raised against is ``held``, built
    beforehand, or ``None`` for a constructor)."""

    id: str
    exc: type[BaseException]
    names: tuple[str, ...]
    make: Callable[[list[_Held]], None]


def _add(opt_factory: Callable[[], Any], group: Callable[[], dict[str, Any]]) -> Callable[[list[_Held]], None]:
    def run(held: list[_Held]) -> None:
        held.append(_Held(opt_factory()))
        caller = group()
        kept = dict(caller)
        try:
            held[-1].opt.add_param_group(caller)
        finally:
            assert caller == kept, "the caller's group dict was changed by a refused add_param_group"

    return run


def _construct(factory: Callable[[], Any]) -> Callable[[list[_Held]], None]:
    return lambda held: factory()


W2, B1 = _w(8, 8), _w(8)


def _flattened_at_step(held: list[_Held]) -> None:
    w = _w(8, 8)
    opt = gefen.GefenMuon([(NAME, w)], fused=False)
    held.append(_Held(opt))
    w.data = w.data.reshape(-1)  # what ZeRO's flat partitions do after the optimizer was built
    w.grad = torch.randn_like(w)
    opt.step()


def _state_no_longer_fits(held: list[_Held]) -> None:
    w = _w(8, 8)
    opt = _stepped(gefen.Gefen([(NAME, w)], fused=False), [w])
    held.append(_Held(opt))
    w.data = torch.randn(4, 8)
    w.grad = torch.randn_like(w)
    opt.step()


def _grad_of_another_shape(held: list[_Held]) -> None:
    w = _w(8, 8)
    opt = gefen.Gefen([(OTHER, _w(4)), (NAME, w)], fused=False)
    held.append(_Held(opt))
    w.grad = torch.randn(8, 8)
    w.grad.data = torch.randn(4, 16)
    opt.step()


def _checkpoint_of_another_model(kind: type) -> Callable[[list[_Held]], None]:
    def run(held: list[_Held]) -> None:
        small, large = _w(16, 8), _w(32, 8)
        saved = _stepped(kind([(NAME, small)], fused=False), [small]).state_dict()
        opt = kind([(NAME, large)], fused=False)
        held.append(_Held(opt))
        opt.load_state_dict(saved)

    return run


def _hybrid(params: Any, **kw: Any) -> gefen.GefenMuonHybrid:
    return gefen.GefenMuonHybrid(params, lr=1e-3, **{"backend": "eager", **kw})


CASES = [
    # constructor: the tensor itself
    Case(
        "native can't step it",
        ConfigError,
        (NAME,),
        _construct(lambda: gefen.Gefen([(OTHER, _w(4)), (NAME, _w(4, dtype=torch.float64))], backend="native")),
    ),
    Case(
        "complex",
        ConfigError,
        (NAME,),
        _construct(lambda: gefen.Gefen([(OTHER, _w(4)), (NAME, nn.Parameter(torch.randn(4, dtype=torch.complex64)))])),
    ),
    Case(
        "integer",
        ConfigError,
        (NAME,),
        _construct(lambda: gefen.Gefen([(OTHER, _w(4)), (NAME, torch.zeros(4, dtype=torch.int64))])),
    ),
    Case("not a tensor", TypeError, (NAME,), _construct(lambda: gefen.Gefen([(OTHER, _w(4)), (NAME, [1.0])]))),
    Case(
        "a module in the list",
        TypeError,
        (NAME,),
        _construct(lambda: gefen.Gefen([(OTHER, _w(4)), (NAME, nn.Linear(2, 2))])),
    ),
    Case("muon 1-D", ConfigError, (NAME,), _construct(lambda: gefen.GefenMuon([(OTHER, _w(4, 4)), (NAME, _w(4))]))),
    Case(
        "muon native can't step it",
        ConfigError,
        (NAME,),
        _construct(lambda: gefen.GefenMuon([(NAME, _w(4, 4, dtype=torch.float64))], backend="native")),
    ),
    # constructor: a tensor in two places
    Case("twice in a group", ConfigError, (NAME, OTHER), _construct(lambda: gefen.Gefen([(OTHER, W2), (NAME, W2)]))),
    Case(
        "in two groups",
        ConfigError,
        (NAME, OTHER),
        _construct(lambda: gefen.Gefen([{"params": [(OTHER, W2)]}, {"params": [(NAME, W2)], "lr": 0.1}])),
    ),
    Case("muon twice", ConfigError, (NAME, OTHER), _construct(lambda: gefen.GefenMuon([(OTHER, W2), (NAME, W2)]))),
    Case("hybrid twice", ConfigError, (NAME, OTHER), _construct(lambda: _hybrid([(OTHER, W2), (NAME, W2)]))),
    Case(
        "hybrid twice across halves",
        ConfigError,
        (NAME, OTHER),
        _construct(
            lambda: _hybrid(
                [{"params": [(OTHER, W2)], "hybrid_half": "muon"}, {"params": [(NAME, W2)], "hybrid_half": "backup"}]
            )
        ),
    ),  # fmt: skip
    Case(
        "hybrid native can't step it",
        ConfigError,
        (NAME,),
        _construct(lambda: _hybrid([(OTHER, _w(4, 4)), (NAME, _w(4, dtype=torch.float64))], backend="native")),
    ),
    # add_param_group
    Case(
        "re-added",
        ConfigError,
        (NAME, OTHER),
        _add(lambda: gefen.Gefen([(OTHER, W2)]), lambda: {"params": [(NAME, W2)]}),
    ),
    Case(
        "re-added, named by param_names",
        ConfigError,
        (NAME, OTHER),
        _add(lambda: gefen.Gefen([(OTHER, W2)]), lambda: {"params": [W2], "param_names": [NAME]}),
    ),
    Case(
        "added twice in the new group",
        ConfigError,
        (NAME, OTHER),
        _add(lambda: gefen.Gefen([("x", B1)]), lambda: {"params": [(OTHER, W2), (NAME, W2)]}),
    ),
    Case(
        "added float64 with native",
        ConfigError,
        (NAME,),
        _add(
            lambda: gefen.Gefen([("x", B1)], backend="native"), lambda: {"params": [(NAME, _w(4, dtype=torch.float64))]}
        ),
    ),
    Case(
        "added 1-D to muon",
        ConfigError,
        (NAME,),
        _add(lambda: gefen.GefenMuon([("x", W2)]), lambda: {"params": [(NAME, _w(4))]}),
    ),
    Case(
        "hybrid re-added",
        ConfigError,
        (NAME, OTHER),
        _add(lambda: _hybrid([(OTHER, W2), ("b", B1)]), lambda: {"params": [(NAME, W2)]}),
    ),
    Case(
        "hybrid added 1-D to muon",
        ConfigError,
        (NAME,),
        _add(lambda: _hybrid([("x", W2), ("b", B1)]), lambda: {"params": [(NAME, _w(4))], "hybrid_half": "muon"}),
    ),
    # step
    Case("muon param flattened", ConfigError, (NAME,), _flattened_at_step),
    Case("state no longer fits", StepError, (NAME,), _state_no_longer_fits),
    Case("gradient of another shape", StepError, (NAME,), _grad_of_another_shape),
    # load
    Case(
        "checkpoint of another model/gefen",
        CheckpointError,
        (NAME, "different model"),
        _checkpoint_of_another_model(gefen.Gefen),
    ),  # fmt: skip
    Case(
        "checkpoint of another model/muon",
        CheckpointError,
        (NAME, "different model"),
        _checkpoint_of_another_model(gefen.GefenMuon),
    ),  # fmt: skip
]


def test_cases_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_refusal_names_the_parameter(case: Case) -> None:
    held: list[_Held] = []
    with pytest.raises(case.exc) as caught:
        case.make(held)
    message = str(caught.value)
    for name in case.names:
        assert name in message, f"{name!r} missing from: {message}"
    assert "param_groups" not in message or NAME in message
    for h in held:
        h.assert_unchanged()


def test_module_passed_as_params_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module.*model\.named_parameters\(\)"):
        gefen.Gefen(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"nn\.Module.*GefenMuonHybrid\(model\)"):
        gefen.GefenMuon(nn.Linear(2, 2))


@pytest.mark.parametrize("kind", [gefen.Gefen, gefen.GefenMuon, _hybrid])
def test_consumed_iterator_says_it_was_consumed(kind: Callable[..., Any]) -> None:
    model = nn.Linear(4, 4, bias=False)
    params = model.named_parameters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind(params)
    with pytest.raises(ConfigError, match=r"iterator: was it consumed already"):
        kind(params)


def test_hybrid_no_muon_warning_reads_well() -> None:
    with pytest.warns(UserWarning, match=r"2-D hidden weights that have at least one element") as record:
        _hybrid(nn.Sequential(nn.Embedding(4, 4), nn.LayerNorm(4)))
    assert all("weights with elements" not in str(w.message) for w in record)

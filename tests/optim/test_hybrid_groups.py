"""The param groups as torch.optim keeps them (issue 36): ``param_groups`` a plain list in ``add_param_group``'s
order, read, indexed, edited, extended and assigned as frameworks do, ``param_names`` written by torch's rules,
and a group listed twice numbered as torch numbers it. Mostly about :class:`gefen.GefenMuonHybrid`, whose list
spans two child optimizers (case 011: Lightning's ``BackboneFinetuning`` and its resume path).

References are computed independently: ``torch.optim.AdamW`` run through the same calls, or the same run without
the interruption, never numbers printed by the code under test.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gefen

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KINDS = ("gefen", "muon", "hybrid_gefen", "hybrid_adamw")


def _same(a: Any, b: Any) -> bool:
    """Equality of state dicts as torch's tests compare them: tensors by value, dtype and shape."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "gefen":
        return gefen.Gefen(params, lr=1e-2)
    if kind == "muon":
        return gefen.GefenMuon([p for p in params if p.dim() == 2], lr=1e-2)
    return gefen.GefenMuonHybrid(params, lr=1e-2, backup_optimizer=kind.split("_")[1])


@pytest.mark.parametrize("kind", KINDS)
def test_state_dicts_of_equal_optimizers_stay_equal_with_a_repeated_group(kind):
    """pytorch#36831: two optimizers with equal (not identical) parameters and state give equal state dicts, also
    once one lists its groups twice (``param_groups.extend(param_groups)``): a parameter listed again keeps its
    first index, so the last group of each names the same parameters with the same metadata. Gefen counted a
    repeated parameter twice in its ``stateful_params`` metadata."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4))
    x = torch.randn(6)

    def closure(opt, w, b):
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss

    opt = _optimizer(kind, [weight, bias])
    for _ in range(3):
        opt.step(lambda: closure(opt, weight, bias))
    weight_c, bias_c = (torch.nn.Parameter(p.detach().clone()) for p in (weight, bias))
    opt_c = _optimizer(kind, [weight_c, bias_c])
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(4):
        opt.step(lambda: closure(opt, weight, bias))
        opt_c.step(lambda: closure(opt_c, weight_c, bias_c))
    assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    assert _same(opt.state_dict(), opt_c.state_dict())
    count = len(opt_c.param_groups)
    opt_c.param_groups.extend(opt_c.param_groups)
    repeated = opt_c.state_dict()
    assert _same(opt.state_dict()["param_groups"][-1], repeated["param_groups"][-1])
    numbered = [g["params"] for g in repeated["param_groups"]]
    assert numbered[count:] == numbered[:count]


# ------------------------------------------------------------------------------------- the hybrid's list
BACKUPS = ("gefen", "adamw")


def _net() -> torch.nn.ModuleDict:
    """Case 011's model: a backbone of two bias-free matrices, a hidden matrix and a classifier with a bias."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {
            "backbone": torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 32, bias=False)),
            "hidden": torch.nn.Linear(32, 32, bias=False),
            "classifier": torch.nn.Linear(32, 4),
        }
    )


def _loss(net: torch.nn.ModuleDict, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    h = torch.relu(net["hidden"](torch.relu(net["backbone"](x))))
    return (net["classifier"](h) - y).pow(2).mean()


def _train(net: torch.nn.ModuleDict, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        opt.zero_grad()
        _loss(net, seed).backward()
        opt.step()


def _head(net: torch.nn.ModuleDict) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in net.named_parameters() if not n.startswith("backbone")]


def _hybrid(params: Any, backup: str, **kw: Any) -> gefen.GefenMuonHybrid:
    return gefen.GefenMuonHybrid(params, lr=1e-2, backup_optimizer=backup, **kw)


@pytest.mark.parametrize("backup", BACKUPS)
def test_add_param_group_appends_whichever_half_owns_the_group_case_011(backup):
    """Case 011: the new group is ``param_groups[-1]`` (the Muon half's group, then a backup one), the earlier
    groups keep their indices, the list is a plain list, and each dict is the one its half steps with: an lr
    written through ``param_groups[i]`` is the lr that half uses."""
    net = _net()
    opt = _hybrid(_head(net), backup)
    before = list(opt.param_groups)
    assert type(opt.param_groups) is list and opt.param_groups is opt.param_groups
    backbone = list(net["backbone"].parameters())
    opt.add_param_group({"params": backbone, "lr": 1e-3})  # bare tensors, as BackboneFinetuning passes them
    assert opt.param_groups[-1]["params"] == backbone and opt.param_groups[:-1] == before
    assert opt.param_groups[-1] is opt.muon.param_groups[-1] and opt.param_groups[-1]["lr"] == 1e-3
    extra = torch.nn.Parameter(torch.zeros(4))
    group = {"params": [extra], "lr": 5e-3}
    opt.add_param_group(group)
    assert opt.param_groups[-1] is group and group is opt.backup.param_groups[-1]  # the caller's dict, as in torch
    assert group["params"] == [extra] and group["betas"] == (0.9, 0.999)  # defaults filled in
    assert [g["hybrid_half"] for g in opt.param_groups] == ["muon", "backup", "muon", "backup"]
    _train(net, opt, range(1))  # states exist; now freeze the backbone through its lr
    opt.param_groups[2]["lr"] = 0.0
    frozen = [p.detach().clone() for p in backbone]
    moving = net["hidden"].weight.detach().clone()
    _train(net, opt, range(1, 2))
    assert all(torch.equal(p, q) for p, q in zip(backbone, frozen))
    assert not torch.equal(net["hidden"].weight, moving)


def _reference_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The same groups (same parameters, same lrs, same order) for torch.optim.AdamW."""
    return [{"params": list(g["params"]), "lr": g["lr"]} for g in opt.param_groups]


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: 0.9**epoch),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers_made_before_add_param_group_see_the_groups_as_on_adamw(name):
    """pytorch#79888 / Lightning#12141: a scheduler made before a group is added sees the hybrid's groups as it sees
    torch.optim.AdamW's: the same lr in every group after every step, and the same error where torch has one."""
    net = _net()
    opt = _hybrid(_head(net), "gefen", backup_lr=5e-3)
    reference = torch.optim.AdamW(_reference_groups(opt), lr=1e-2)
    schedulers = [SCHEDULERS[name](o) for o in (opt, reference)]
    backbone = list(net["backbone"].parameters())
    for epoch in range(6):
        if epoch == 2:
            for o in (opt, reference):
                o.add_param_group({"params": backbone, "lr": 1e-3})
        _train(net, opt, range(epoch, epoch + 1))
        outcomes = []
        for scheduler in schedulers:
            try:
                scheduler.step(1.0) if name == "ReduceLROnPlateau" else scheduler.step()
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 -- torch's own outcome is the reference
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1], epoch
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in reference.param_groups], epoch
        assert [sorted(g) for g in _reference_groups(opt)] == [sorted(g) for g in _reference_groups(reference)]
        assert ["initial_lr" in g for g in opt.param_groups] == ["initial_lr" in g for g in reference.param_groups]


def _lightning_resume(backup: str, named: bool) -> tuple[torch.nn.ModuleDict, torch.nn.ModuleDict, Any, Any]:
    """Case 011 (B): train, unfreeze (add_param_group), train, save the model, the groups as names (Lightning's
    ``BaseFinetuning._store``) and the optimizer; rebuild a frozen model and optimizer, assign the groups, load.
    Returns the uninterrupted net and optimizer and the resumed ones, at the same point."""

    def build(net):
        head = _head(net) if named else [p for _, p in _head(net)]
        return _hybrid(head, backup)

    net = _net()
    opt = build(net)
    _train(net, opt, range(2))
    opt.add_param_group({"params": list(net["backbone"].parameters()), "lr": 1e-3})
    _train(net, opt, range(2, 4))
    names = {p: n for n, p in net.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in opt.param_groups]  # fmt: skip
    checkpoint = copy.deepcopy({"model": net.state_dict(), "optimizer": opt.state_dict(), "groups": groups})
    fresh = _net()
    fresh.load_state_dict(checkpoint["model"])
    resumed = build(fresh)
    by_name = dict(fresh.named_parameters())
    resumed.param_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [by_name[n] for n in g["params"]]}
        for g in checkpoint["groups"]
    ]
    resumed.load_state_dict(checkpoint["optimizer"])
    return net, fresh, opt, resumed


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
@pytest.mark.parametrize("backup", BACKUPS)
def test_lightning_resume_assigns_groups_then_loads_like_the_uninterrupted_run(backup, named):
    """Case 011 (B): ``optimizer.param_groups = groups`` rebuilt from saved metadata, then ``load_state_dict``; the
    next steps equal the uninterrupted run's bit for bit, in parameters, lrs and state dicts."""
    net, fresh, opt, resumed = _lightning_resume(backup, named)
    assert [g["hybrid_half"] for g in resumed.param_groups] == ["muon", "backup", "muon"]
    assert resumed.param_groups[2] is resumed.muon.param_groups[1]
    _train(net, opt, range(4, 7))
    _train(fresh, resumed, range(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters()))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in resumed.param_groups]
    assert _same(opt.state_dict(), resumed.state_dict())


def test_assigning_groups_that_cannot_be_placed_changes_nothing():
    """Where the hybrid cannot hold a group as torch would (its parameters route to both halves, or the half
    refuses them) the assignment raises with the supported way and the hybrid keeps its former list and halves."""
    net = _net()
    opt = _hybrid(net, "gefen")
    groups, muon_groups, backup_groups = opt.param_groups, opt.muon.param_groups, opt.backup.param_groups
    matrix, vector = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    attempts = [
        ([*groups, {"params": [matrix, vector]}], gefen.ConfigError, r"both halves.*hybrid_half"),
        ([*groups, {"params": [vector], "hybrid_half": "muon"}], gefen.ConfigError, r"2-D"),
        ([*groups, ["not", "a", "dict"]], TypeError, r"param_groups\[2\] is a list"),
        ([*groups, {"params": {matrix}}], TypeError, r"set"),
        ([{"lr": 0.1, "params": list(groups[0]["params"]) + list(groups[1]["params"])}], gefen.ConfigError, "both"),
    ]
    for value, error, match in attempts:
        given = copy.copy(value[-1])
        with pytest.raises(error, match=match):
            opt.param_groups = value
        assert opt.param_groups is groups and value[-1] == given  # the caller's dict untouched
        assert opt.muon.param_groups is muon_groups and opt.backup.param_groups is backup_groups


@pytest.mark.parametrize("backup", BACKUPS)
def test_list_edits_reach_the_halves_as_on_adamw(backup):
    """Groups deleted from, appended to or re-inserted in the list are stepped (or not) as torch.optim.AdamW steps
    the same list: a deleted group's parameters stay put, an appended dict is the one its half steps with (its
    defaults filled in; ``zero_grad`` reaches it at once), and the state dict follows the list's order."""
    net = _net()
    opt = _hybrid(net, backup)
    hidden = net["hidden"].weight
    removed = opt.param_groups.pop(0)  # the Muon group
    _train(net, opt, range(1))
    assert torch.equal(hidden, _net()["hidden"].weight)  # not stepped
    opt.param_groups.append(removed)
    extra = torch.nn.Parameter(torch.ones(4))
    added = {"params": [extra], "lr": 0.1}
    opt.param_groups.append(added)
    extra.grad = torch.ones(4)
    opt.zero_grad()  # torch's zero_grad over the list, the appended group included
    assert extra.grad is None
    loss_extra = lambda: _loss(net, 9) + extra.sum()  # noqa: E731
    opt.zero_grad()
    loss_extra().backward()
    opt.step()
    assert opt.param_groups[-1] is added and added["hybrid_half"] == "backup" and "betas" in added
    assert opt.backup.param_groups[-1] is added and not torch.equal(extra, torch.ones(4))
    assert not torch.equal(hidden, _net()["hidden"].weight)
    sd = opt.state_dict()
    assert [g["hybrid_half"] for g in sd["param_groups"]] == ["backup", "muon", "backup"]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4], [5]]


@pytest.mark.parametrize("backup", BACKUPS)
@pytest.mark.parametrize("named0,named1", [(True, True), (True, False), (False, True), (False, False)])
def test_param_names_follow_torch_rules_and_round_trip(backup, named0, named1):
    """torch's ``test_can_load_from_to_named_state_dict`` rules: a hybrid built from bare tensors writes no
    ``param_names``; a named state dict loads into an unnamed hybrid (which takes the names) and back; names stay
    wherever one of the two had them."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)

    def build(named):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = _hybrid(net.named_parameters() if named else net.parameters(), backup)
        assert named or any("without names" in str(w.message) for w in caught)
        return opt

    def step(opt):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()

    opt = build(named0)
    for _ in range(3):
        step(opt)
    saved = copy.deepcopy(opt.state_dict())
    expected = [["0.weight", "2.weight"], ["0.bias", "2.bias"]]  # the Muon group, then the backup group
    assert [g.get("param_names") for g in saved["param_groups"]] == (expected if named0 else [None, None])
    other = build(named1)
    other.load_state_dict(saved)
    step(other)
    names = [g.get("param_names") for g in other.state_dict()["param_groups"]]
    assert names == (expected if named0 or named1 else [None, None])


def test_bare_tensors_join_a_named_hybrid_with_names_and_names_do_not_join_an_unnamed_one():
    """A named hybrid names a bare tensor ``param_groups[i][j]`` (Lightning adds bare tensors; torch would refuse
    the group); a hybrid without names refuses named parameters, as torch does, and changes nothing."""
    net = _net()
    opt = _hybrid(_head(net), "gefen")
    opt.add_param_group({"params": list(net["backbone"].parameters())})
    assert opt.param_groups[-1]["param_names"] == ["param_groups[2][0]", "param_groups[2][1]"]
    unnamed = _hybrid([p for _, p in _head(_net())], "gefen")
    groups = list(unnamed.param_groups)
    with pytest.raises(ValueError, match="names or none"):
        unnamed.add_param_group({"params": [("x", torch.nn.Parameter(torch.zeros(3)))]})
    assert unnamed.param_groups == groups and all("param_names" not in g for g in groups)


def test_constructor_takes_param_group_dicts_in_their_order():
    """Param-group dicts (as torch.optim takes them) keep their order and options; each is routed whole."""
    net = _net()
    given = [
        {"params": [(f"classifier.{n}", p) for n, p in net["classifier"].named_parameters()], "lr": 3e-3},
        {"params": [net["hidden"].weight], "param_names": ["hidden.weight"]},
        {"params": list(net["backbone"].named_parameters()), "lr": 1e-3},
    ]
    opt = _hybrid(given, "gefen")
    assert all(a is b for a, b in zip(opt.param_groups, given))  # the caller's dicts, as in torch
    assert [g["hybrid_half"] for g in opt.param_groups] == ["backup", "muon", "muon"]
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 1e-2, 1e-3]
    assert opt.muon.param_groups == opt.param_groups[1:] and opt.backup.param_groups == opt.param_groups[:1]
    assert opt.param_groups[0]["param_names"] == ["classifier.weight", "classifier.bias"]
    with pytest.raises(gefen.ConfigError, match="both halves"):
        _hybrid([{"params": [net["hidden"].weight, net["classifier"].bias]}], "gefen")
    with pytest.raises(ValueError, match="names or none"):
        _hybrid([{"params": [net["hidden"].weight]}, {"params": [("b", net["classifier"].bias)]}], "gefen")


# ------------------------------------------------------------------------------------- checkpoints
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class _Schema1Model(torch.nn.Module):
    """``scripts/make_hybrid_schema1_fixtures.py``'s model (same seed, same shapes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.hidden = torch.nn.Linear(16, 16, bias=False)
        self.head = torch.nn.Linear(16, 8)
        self.extra = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.extra_bias = torch.nn.Parameter(torch.zeros(8))


@pytest.mark.parametrize("backup", BACKUPS)
def test_schema1_checkpoint_loads_half_by_half_into_the_list_order(backup):
    """``tests/fixtures/schema1_hybrid_*.pt`` were written by the code before the list order (schema 1, Muon groups
    first: Muon, Muon(added), backup, backup(added)), after groups were added in the order Muon, backup. Today's
    hybrid, given the same calls, holds them as Muon, backup, Muon, backup; the checkpoint loads half by half, each
    group's own lr lands on its group, and the next step matches the old code's (bounds as in
    ``tests/test_checkpoint.py``'s schema-1 fixtures: 1e-5 of the update, one bf16 ulp for the Muon matrices). It
    is then saved in list order, as schema 2."""
    fixture = torch.load(FIXTURES / f"schema1_hybrid_{backup}.pt", weights_only=True)
    assert fixture["optimizer"]["gefen_hybrid"]["schema_version"] == 1
    model = _Schema1Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(fixture["params"][name])
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("extra")]
    opt = _hybrid(named, backup, backup_lr=5e-3, backend="eager")
    opt.add_param_group({"params": [model.extra], "lr": 2e-3})
    opt.add_param_group({"params": [model.extra_bias], "lr": 3e-3})
    assert [g["hybrid_half"] for g in opt.param_groups] == ["muon", "backup", "muon", "backup"]
    opt.load_state_dict(fixture["optimizer"])
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 5e-3, 2e-3, 3e-3]
    assert [g["params"] for g in opt.param_groups[2:]] == [[model.extra], [model.extra_bias]]
    for name, p in model.named_parameters():
        p.grad = fixture["grads"][name].clone()
    opt.step()
    for name, p in model.named_parameters():
        expected, before = fixture["expected_after"][name], fixture["params"][name]
        update = float((expected - before).abs().max())
        assert update > 1e-5, name
        muon = p.dim() == 2 and name in ("hidden.weight", "head.weight", "extra")
        # plus one fp32 ulp of the largest parameter: torch's AdamW (the backup) rounds p - lr·u differently by one
        # ulp on another CPU's vector path (an AVX-512 machine: 5.96e-8 on one element of embed.weight, 1.19e-5 of
        # the update), still 10^4x below a migration fault
        ulp = torch.finfo(torch.float32).eps * float(expected.abs().max())
        bound = update * (2**-8 if muon else 1e-5) + ulp
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=bound, msg=name)
    resaved = opt.state_dict()
    assert resaved["gefen_hybrid"]["schema_version"] == 2
    assert [g["hybrid_half"] for g in resaved["param_groups"]] == ["muon", "backup", "muon", "backup"]


def test_a_checkpoint_whose_groups_come_in_another_order_is_refused_before_anything_changes():
    """Schema 2 loads group by group: a checkpoint whose halves come in another order than the live list's
    (the groups were added in another order) is a CheckpointError naming the fix; nothing changes."""
    from gefen.digest import state_digest

    net = _net()
    opt = _hybrid(_head(net), "gefen")
    opt.add_param_group({"params": list(net["backbone"].parameters())})  # muon, backup, muon
    _train(net, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    other = _net()
    groups = [{"params": list(other["backbone"].parameters())}, {"params": [other["hidden"].weight]}]
    fresh = _hybrid([*groups, {"params": list(other["classifier"].parameters()), "hybrid_half": "backup"}], "gefen")
    assert [g["hybrid_half"] for g in fresh.param_groups] == ["muon", "muon", "backup"]
    before = state_digest(fresh.state_dict())
    with pytest.raises(gefen.CheckpointError, match=r"halves \['muon', 'backup', 'muon'\].*add_param_group"):
        fresh.load_state_dict(saved)
    assert state_digest(fresh.state_dict()) == before


@pytest.mark.parametrize("backup", BACKUPS)
def test_a_half_the_hybrid_was_built_without_is_built_for_its_first_group(backup):
    """Progressive unfreezing of a model whose trainable head has nothing for Muon: the backbone's matrices go to a
    Muon half built for them with the constructor's options; the run saves and resumes bit-exactly."""

    def build(net):
        opt = _hybrid([("classifier.weight", net["classifier"].weight)], backup, momentum=0.9)
        opt.add_param_group({"params": list(net["backbone"].parameters())})
        return opt

    net = _net()
    opt = build(net)
    assert isinstance(opt.muon, gefen.GefenMuon) and opt.muon.param_groups[0]["momentum"] == 0.9
    assert [g["hybrid_half"] for g in opt.param_groups] == ["backup", "muon"]
    _train(net, opt, range(2))
    twin = copy.deepcopy(net)
    resumed = build(twin)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(net, opt, range(2, 4))
    _train(twin, resumed, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_list_and_the_halves_in_step(how):
    """A deepcopy or pickle of a hybrid with an added group keeps the list order, its dicts shared with the halves,
    and steps as the original."""
    import pickle

    net = _net()
    opt = _hybrid(_head(net), "gefen")
    opt.add_param_group({"params": list(net["backbone"].parameters())})
    _train(net, opt, range(1))
    both = copy.deepcopy((net, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((net, opt)))
    net_c, opt_c = both
    assert [g["hybrid_half"] for g in opt_c.param_groups] == ["muon", "backup", "muon"]
    assert opt_c.param_groups[2] is opt_c.muon.param_groups[1]
    opt_c.param_groups[2]["lr"] = opt.param_groups[2]["lr"] = 5e-3
    _train(net, opt, range(1, 3))
    _train(net_c, opt_c, range(1, 3))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net_c.parameters()))

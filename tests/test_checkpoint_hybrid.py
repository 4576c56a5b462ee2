"""The hybrid's checkpoints (``gefen.checkpoint_hybrid``): the policy recorded in its ``gefen_hybrid`` entry, and
gefen 0.1's halves layout (committed fixtures) migrating to torch's layout."""

from __future__ import annotations

import pytest
import torch

import gefen
from tests.test_checkpoint import FIXTURES, _fixture_model, _fixture_optimizer


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_halves_layout_hybrid_fixture_migrates_and_continues(backup):
    """``tests/fixtures/halves_hybrid_*.pt`` were written by the code before the hybrid moved to torch's layout
    (``scripts/make_hybrid_halves_fixtures.py``): the halves layout loads by migration, the next step matches the
    old code's (the float32 bound of ``test_checkpoint.py``'s schema-1 fixtures), and the state is saved again in
    torch's layout."""
    fixture = torch.load(FIXTURES / f"halves_hybrid_{backup}.pt", weights_only=True)
    assert {"muon", "backup", "backup_optimizer"} <= set(fixture["optimizer"])
    model = _fixture_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(fixture["params"][name])
    opt = _fixture_optimizer(f"hybrid_{backup}", model, False)
    opt.load_state_dict(fixture["optimizer"])
    assert opt.muon.global_step == 2
    for name, p in model.named_parameters():
        p.grad = fixture["grads"][name].clone()
    opt.step()
    for name, p in model.named_parameters():
        expected, before = fixture["expected_after"][name], fixture["params"][name]
        update = float((expected - before).abs().max())
        assert update > 1e-4, name
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-5 * update, msg=name)
    resaved = opt.state_dict()
    assert {"state", "param_groups", "gefen_hybrid"} <= set(resaved)
    assert {g["hybrid_half"] for g in resaved["param_groups"]} == {"muon", "backup"}


def test_adamw_only_hybrid_records_its_policy_and_refuses_the_other():
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8))

    m = model()
    opt = gefen.GefenMuonHybrid(m, lr=1e-2, backup_optimizer="adamw", deterministic=True)
    assert opt.muon is None
    m(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["gefen_hybrid"]["deterministic"] is True
    other = gefen.GefenMuonHybrid(model(), lr=1e-2, backup_optimizer="adamw")
    with pytest.raises(gefen.CheckpointError, match="deterministic=True"):
        other.load_state_dict(sd)
    assert len(other.state) == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "version", [torch.zeros(3), torch.tensor(1), [1], 1.0, "1", None, True, 3], ids=lambda v: type(v).__name__
)
def test_hybrid_schema_version_of_another_type_is_a_checkpoint_error(version):
    """A ``schema_version`` edited to another type (a tensor, a list, a float, ...) in every metadata copy is refused
    with CheckpointError and changes nothing; a 3-element tensor used to raise torch's "Boolean value of Tensor with
    more than one value is ambiguous" RuntimeError (found by the malformed-checkpoint property test)."""
    import copy

    from gefen.checkpoint_hybrid import HYBRID_METADATA_KEY
    from gefen.digest import state_digest

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        return model, gefen.GefenMuonHybrid(model.named_parameters(), lr=1e-2, backup_lr=1e-2)

    model, opt = build()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    checkpoint = copy.deepcopy(opt.state_dict())
    copies = [checkpoint[HYBRID_METADATA_KEY]] + [
        g[HYBRID_METADATA_KEY] for g in checkpoint["param_groups"] if HYBRID_METADATA_KEY in g
    ]
    for meta in copies:
        meta["schema_version"] = copy.deepcopy(version)
    _, fresh = build()
    before = state_digest(fresh.state_dict())
    with pytest.raises(gefen.CheckpointError, match="schema_version"):
        fresh.load_state_dict(checkpoint)
    assert state_digest(fresh.state_dict()) == before

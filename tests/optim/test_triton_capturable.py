"""``Gefen(capturable=True)`` on the Triton backend, run by Triton's interpreter on the CPU.

Under ``capturable=True`` the step counters are device tensors that the Triton kernels advance themselves (iff the
step is applied), and ``nonfinite="skip"`` is decided and counted on the device: a steady step reads nothing on the
host, which is what a CUDA-graph capture needs (the capture itself runs in scripts/gpu_check.sh's CUDA tests). Here:
the same training as ``capturable=False``; a NaN step skipped with no host read, counted when the host looks; and a
clear refusal, before any write, where a captured step could not decide on the device.
"""

from __future__ import annotations

import pytest
import torch

import gefen
from gefen.errors import ConfigError, StepError

pytest.importorskip("triton")

from tests.triton_interpreter import HostReads, interpreted_kernels  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with interpreted_kernels():
        yield


def _model(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"weight": (24, 48), "bias": (24,), "conv": (4, 3, 16)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes.items()]


def _set_grads(params, step: int, nan: bool = False) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(100 + step)
    for i, (_, p) in enumerate(params):
        g = torch.randn(p.shape, generator=gen)
        if nan and i == 0:
            g[2, 3] = float("nan")
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)  # the same gradient tensors, as a captured graph's backward writes them


def test_capturable_skip_on_triton_trains_as_the_host_counted_run_and_reads_nothing() -> None:
    """Five steps, the fourth with a NaN: ``capturable=True`` equals ``capturable=False`` (both on Triton,
    ``nonfinite="skip"``) in every parameter and state tensor; its steady steps, the NaN one included, read nothing on
    the host; the skip is counted on the device and reported, with one warning, when the host looks."""
    runs = {}
    for capturable in (False, True):
        params = _model()
        opt = gefen.Gefen(params, lr=1e-2, weight_decay=0.1, backend="triton", capturable=capturable,
                          nonfinite="skip")  # fmt: skip
        for step in range(5):
            _set_grads(params, step, nan=step == 3)
            if not capturable and step == 3:
                with pytest.warns(UserWarning, match="weight"):
                    opt.step()
            elif capturable and step >= 1:
                with HostReads() as mode:
                    opt.step()
                assert mode.reads == 0, f"step {step}: {mode.reads} host reads"
            else:
                opt.step()
        if capturable:
            assert all(opt.state[p]["step"].device == p.device for _, p in params)
            with pytest.warns(UserWarning, match=r"1 step\(s\) were skipped on the device"):
                assert opt.skipped_steps == 1
        assert opt.skipped_steps == 1 and opt.global_step == 4
        runs[capturable] = (params, opt)
    (a, oa), (b, ob) = runs[False], runs[True]
    for (_, p), (_, q) in zip(a, b):
        assert torch.equal(p, q)
        for key, value in oa.state[p].items():
            assert torch.equal(value, ob.state[q][key].to(value.device)), key
        assert int(ob.state[q]["step"]) == 4


def test_capturable_skip_is_refused_inside_a_capture_where_the_device_cannot_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a backend that checks on the host (here the eager one), a step inside a capture (stood in for by
    ``capturing()``) is refused with a StepError naming the parameter and the way out; nothing changes. Outside a
    capture the same optimizer checks on the host as usual."""
    import gefen.optim.gefen as gefen_module

    params = _model()
    opt = gefen.Gefen(params, lr=1e-2, backend="eager", capturable=True, nonfinite="skip")
    _set_grads(params, 0)
    opt.step()  # the first step: on the host, outside any capture
    _set_grads(params, 1)
    before = [p.detach().clone() for _, p in params]
    state = {k: v.clone() for k, v in opt.state[params[0][1]].items()}
    monkeypatch.setattr(gefen_module, "capturing", lambda: True)
    with pytest.raises(StepError, match=r"nonfinite='skip'.*weight runs on the per-parameter device step"):
        opt.step()
    assert all(torch.equal(x, p) for x, (_, p) in zip(before, params))
    assert all(torch.equal(v, opt.state[params[0][1]][k]) for k, v in state.items())
    monkeypatch.undo()
    _set_grads(params, 2, nan=True)
    with pytest.warns(UserWarning, match="weight"):
        opt.step()
    assert opt.skipped_steps == 1


def test_capturable_skip_is_gefens_alone() -> None:
    """GefenMuon decides its ``nonfinite`` policy before the step (a host read): it still refuses the pair."""
    w = torch.nn.Parameter(torch.randn(8, 16))
    assert gefen.Gefen([w], capturable=True, nonfinite="skip").nonfinite == "skip"
    with pytest.raises(ConfigError, match=r"capturable=True.*nonfinite='skip'"):
        gefen.GefenMuon([w], capturable=True, nonfinite="skip")


def test_a_triton_plan_that_cannot_be_built_falls_back_to_the_device_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="auto"`` under ``capturable=True`` whose Triton plan fails to compile: the step runs on the
    per-parameter device step (which reads nothing on the host), not the eager one (which reads the counters), with
    one warning; the training equals a run that never tried Triton."""
    from gefen.kernels import backends
    from gefen.kernels.triton_plan import TritonPlan

    def broken(self: object) -> None:
        raise RuntimeError("no PTX for this device")

    runs = []
    for patched in (False, True):
        if patched:
            monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("triton",))
            monkeypatch.setattr(TritonPlan, "compile", broken)
        params = _model()
        opt = gefen.Gefen(params, lr=1e-2, capturable=True)
        for step in range(3):
            _set_grads(params, step)
            if patched and step == 0:  # the first step prepares (and fails to build) the plan
                with pytest.warns(UserWarning, match="no PTX for this device"):
                    opt.step()
            elif patched:
                with HostReads() as mode:
                    opt.step()
                assert mode.reads == 0
            else:
                opt.step()
        runs.append(params)
    for (_, p), (_, q) in zip(*runs):
        assert torch.equal(p, q)

"""GroupStale's round rules in one process, over the stand-in channel of ``test_checks``:
DC-ASGD per site, and the optimizer's momentum after a round."""

from __future__ import annotations

import torch

from medseg.distributed.sync.common import flat
from medseg.distributed.sync.gssp import GroupStale, _Round, dc_compensate
from tests.distributed.test_checks import _Channel, _model, _params, _train_step


def test_dc_compensate_reads_a_round_as_steps_of_one_mean_gradient() -> None:
    """Δ = −η τ ḡ compensated is −η τ (ḡ + λ ḡ⊙ḡ⊙d): DC-ASGD's rule on the round's mean gradient."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(50, generator=g, dtype=torch.float64)
    d = 0.1 * torch.randn(50, generator=g, dtype=torch.float64)
    lr, tau, lam = 0.01, 7, 0.5
    delta = -lr * tau * grad
    expected = -lr * tau * (grad + lam * grad * grad * d)
    assert torch.allclose(
        dc_compensate(delta, d, torch.zeros(50, dtype=torch.float64), lam, lr, tau), expected
    )


def test_dc_asgd_compensates_each_other_site_on_its_own() -> None:
    """S' = c_a Δ_a + c_b Δ'_b with Δ'_b from site b's own change and steps, not from the weighted sum."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lam, steps, weights = 0.8, [2, 5], [3.0, 1.0]
    engine = GroupStale(
        opt,
        model,
        _Channel(lambda x: x),
        period=2,
        staleness=1,
        dc_lambda=lam,
        compression="none",
        bits=4,
        weights=weights,
        steps=steps,
    )
    n = engine.numel
    g = torch.Generator().manual_seed(1)
    mine, theirs = 0.01 * torch.randn(n, generator=g), 0.01 * torch.randn(n, generator=g)
    w_then = _params(model).clone()
    w_now = w_then + 0.02 * torch.randn(n, generator=g)
    torch.nn.utils.vector_to_parameters(w_now, model.parameters())
    got = engine._checked_mean(_Round(0, None, [mine, theirs], mine, w_then))
    c_a, c_b = 0.75, 0.25
    want = c_a * mine + c_b * dc_compensate(theirs, w_now, w_then, lam, 0.05, steps[1])
    assert torch.allclose(got, want, atol=1e-7)
    # compensating the other site's weighted share as one sum (the earlier rule) is not the same
    summed = c_a * mine + dc_compensate(c_b * theirs, w_now, w_then, lam, 0.05, steps[1])
    assert not torch.allclose(got, summed, atol=1e-7)
    assert torch.equal(flat(list(model.parameters())), w_now)  # the leader only computes S'


def _adamw_engine(reset: bool) -> tuple[torch.nn.Module, GroupStale]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    other = lambda x: -0.5 * x  # noqa: E731  site b moved elsewhere: the round moves site a's model
    engine = GroupStale(
        opt,
        model,
        _Channel(other),
        period=1,
        staleness=0,
        dc_lambda=0.0,
        compression="none",
        bits=4,
        reset_momentum=reset,
    )
    return model, engine


def test_round_momentum_reset_zeroes_the_first_moment_and_keeps_the_second() -> None:
    for reset in (False, True):
        model, engine = _adamw_engine(reset)
        _train_step(model, engine)
        assert engine.stats.staleness == [0]  # the round was applied
        states = [engine.base.state[p] for p in model.parameters() if p in engine.base.state]
        assert states
        first = sum(float(s["exp_avg"].abs().sum()) for s in states)
        second = sum(float(s["exp_avg_sq"].abs().sum()) for s in states)
        assert second > 0
        assert (first == 0) == reset, f"reset={reset}: first moment sum {first}"


class _Landing:
    """A round's exchange that lands when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def wait(self) -> None:
        self.done = True

    def is_completed(self) -> bool:
        return self.done


def test_a_round_in_flight_when_the_step_begins_counts_even_if_it_lands_during_compute() -> None:
    chan = _Channel(lambda x: x)
    works: list[_Landing] = []

    def allgather(outs, mine, async_op=False, kind=""):
        outs[0], outs[1] = mine.clone(), mine.clone()
        works.append(_Landing())
        return works[-1]

    chan.leaders_pg.allgather = allgather
    model = _model()
    engine = GroupStale(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        chan,
        period=1,
        staleness=1,
        dc_lambda=0.0,
        compression="none",
        bits=4,
    )
    _train_step(model, engine)  # nothing in flight as it began; it submits round 0, which stays out
    assert engine.stats.inflight is False and len(engine.pending) == 1
    engine.zero_grad()  # the next step begins with round 0 in flight ...
    works[0].done = True  # ... and round 0 lands while it computes
    model(torch.randn(2, 1, 5, 5, 5)).square().mean().backward()
    engine.step()
    assert engine.stats.inflight is True

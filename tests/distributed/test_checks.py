"""Checked updates: what other sites send is checked before it is applied, and a diverged loss stops the
run before a checkpoint is written. Single process, no Horovod: the check functions, and the sync
classes' apply paths over a stand-in channel whose other site sends what the test says."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from medseg.distributed.comm.checks import (
    K_NORM,
    UpdateGuard,
    UpdateRefused,
    check_site_metrics,
    check_speeds,
    check_trained,
)
from medseg.distributed.comm.collectives import CompressedAllreduce
from medseg.distributed.comm.compression import encode, encoded_nbytes
from medseg.distributed.epoch_numbers import rank_numbers
from medseg.distributed.local_session import LocalSession
from medseg.distributed.session import HorovodSession
from medseg.distributed.sync.common import AverageCheck, StepStats, average_model, flat
from medseg.distributed.sync.gssp import GroupStale
from medseg.distributed.sync.local_sgd import LocalSGD
from medseg.errors import RunError

SITES = ["rank 0 (site a)", "rank 1 (site b)"]


def _attacks(own: torch.Tensor) -> dict[str, Any]:
    nan = own.clone()
    nan[3] = float("nan")
    inf = own.clone()
    inf[0] = float("inf")
    return {
        "NaN": (nan, "NaN or Inf"),
        "Inf": (inf, "NaN or Inf"),
        "1000x norm": (own * 1000, "exceeds"),
        "wrong shape": (own[:-1].clone(), "shape"),
        "wrong dtype": (own.double(), "dtype"),
    }


# -- the rule itself ------------------------------------------------------------------------------
def test_the_norm_rule_accepts_honest_sites_and_refuses_each_attack_naming_the_site() -> None:
    g = torch.Generator().manual_seed(0)
    guard = UpdateGuard("cross-site round")
    for _ in range(10):  # honest: another site's change a few times our own, in any direction
        own = torch.randn(100, generator=g) * 0.01
        other = torch.randn(100, generator=g) * 0.03
        guard.check([own, other], SITES, own=0, shape=(100,))
    assert len(guard.norms[SITES[1]]) == 8  # M accepted norms kept
    own = torch.randn(100, generator=g) * 0.01
    for name, (bad, why) in _attacks(own).items():
        before = list(guard.norms[SITES[1]])
        with pytest.raises(
            UpdateRefused, match=rf"rank 1 \(site b\): its cross-site round was refused.*{why}"
        ) as exc:
            guard.check([own, bad], SITES, own=0, shape=(100,))
        assert exc.value.source == SITES[1], name
        assert list(guard.norms[SITES[1]]) == before, f"{name}: a refused update entered the history"


def test_the_bound_is_k_times_the_larger_of_history_and_own() -> None:
    guard = UpdateGuard("round")
    assert guard.bound("b", own_norm=2.0) == K_NORM * 2.0  # no history yet: our own change
    guard.check([torch.ones(4), torch.ones(4) * 3], ["a", "b"], own=0)  # ||b|| = 6 accepted
    assert guard.bound("b", own_norm=0.0) == K_NORM * 6.0
    just_under = torch.ones(4) * (K_NORM * 3 - 1e-3)  # ||.|| just under 100 x 6
    guard.check([torch.zeros(4), just_under], ["a", "b"], own=0)
    with pytest.raises(UpdateRefused):
        guard.check([torch.zeros(4), torch.ones(4) * 1e9], ["a", "b"], own=0)


def test_a_non_finite_own_update_names_this_site_first() -> None:
    own = torch.full((5,), float("nan"))
    with pytest.raises(UpdateRefused, match="rank 0 \\(site a\\)"):
        UpdateGuard("round").check([own, own.clone()], SITES, own=0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "fast", True, None, 1e12])
def test_a_bad_reported_speed_is_refused_not_crashed_on(bad: Any) -> None:
    with pytest.raises(UpdateRefused, match=r"rank 1 \(site b\): its measured speed was refused"):
        check_speeds([3.0, bad], SITES, own=0)
    assert check_speeds([3.0, 1.5], SITES, own=0) == [3.0, 1.5]
    with pytest.raises(UpdateRefused, match="not a finite number > 0"):  # all zero: no ratio to catch it
        check_speeds([0.0, 0.0], SITES, own=1)


@pytest.mark.parametrize("val_cases", [0, -2, 2.5, True, None, "3"])
def test_val_cases_must_be_a_positive_int_when_the_site_scores(val_cases: Any) -> None:
    with pytest.raises(UpdateRefused, match="site b: its validation scores.*val_cases"):
        check_site_metrics("b", {"val_dice": 0.8, "val_cases": val_cases})


def test_site_scores_must_be_finite_and_a_site_without_cases_may_report_none() -> None:
    with pytest.raises(UpdateRefused, match="val_dice = nan is not finite"):
        check_site_metrics("b", {"val_dice": float("nan"), "val_cases": 3})
    check_site_metrics("b", {"val_cases": 0})
    check_site_metrics("b", {"val_dice": 0.8, "val_cases": 3, "val_hd95": None})


# -- the sync classes' apply paths over a stand-in channel --------------------------------------------
class _Work:
    def wait(self) -> None: ...

    def is_completed(self) -> bool:
        return True


class _Leaders:
    """The leaders' group: this site's own contribution, and the other site's from ``attack``."""

    def __init__(self, attack) -> None:
        self.attack = attack

    def allgather(
        self, outs: list[torch.Tensor], mine: torch.Tensor, async_op: bool = False, kind: str = ""
    ) -> Any:
        outs[0] = mine.clone()
        outs[1] = self.attack(mine.clone())
        return _Work() if async_op else None


class _Channel:
    """Two sites of one rank each; this rank is site a's (rank 0)."""

    def __init__(self, attack) -> None:
        self.rank, self.size, self.leader = 0, 2, 0
        self.groups, self.group = [[0], [1]], [0]
        self.leaders_pg = _Leaders(attack)
        self.group_pg = None
        self.is_leader = True

    def describe(self, rank: int) -> str:
        return SITES[rank]

    def group_broadcast(self, tensor: torch.Tensor) -> None: ...

    def group_mean_(self, tensor: torch.Tensor) -> None: ...


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.BatchNorm3d(2), torch.nn.Conv3d(2, 2, 1))


def _gssp(attack, compression: str = "none") -> tuple[torch.nn.Module, GroupStale]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = GroupStale(
        opt, model, _Channel(attack), period=1, staleness=0, dc_lambda=0.0, compression=compression, bits=4
    )
    return model, engine


def _train_step(model: torch.nn.Module, engine: Any) -> None:
    torch.manual_seed(1)
    engine.zero_grad()
    model(torch.randn(2, 1, 5, 5, 5)).square().mean().backward()
    engine.step()


def _params(model: torch.nn.Module) -> torch.Tensor:
    return flat(list(model.parameters()))


def _float_attacks() -> dict[str, tuple[Any, str]]:
    def at(i: int, v: float):
        def f(x: torch.Tensor) -> torch.Tensor:
            x[i] = v
            return x

        return f

    return {
        "NaN": (at(3, float("nan")), "NaN or Inf"),
        "Inf": (at(0, float("-inf")), "NaN or Inf"),
        "1000x norm": (lambda x: x * 1000, "exceeds"),
        "wrong shape": (lambda x: x[:-1].clone(), "shape"),
    }


@pytest.mark.parametrize("attack", list(_float_attacks()))
def test_gssp_never_applies_a_refused_round(attack: str) -> None:
    """Site b's round is NaN, Inf, 1000x the norm or the wrong shape: site a stops naming site b, and
    its parameters are what an honest round would have left (here: its own step, since an honest
    site b identical to a moves the model by (S − Δ_a) = 0)."""
    honest_model, honest = _gssp(lambda x: x)
    _train_step(honest_model, honest)
    fn, why = _float_attacks()[attack]
    model, engine = _gssp(fn)
    with pytest.raises(RunError, match=rf"rank 1 \(site b\): its cross-site round was refused.*{why}"):
        _train_step(model, engine)
    assert torch.equal(_params(model), _params(honest_model)), "the refused round was applied"
    assert not engine.stats.staleness  # no round was applied


def test_gssp_with_codes_refuses_a_non_finite_chunk_scale() -> None:
    """With 4-bit rounds the scale of a layer's encoding is NaN: it decodes to NaN and is refused."""

    def poisoned(codes: torch.Tensor) -> torch.Tensor:
        codes = codes.clone()
        codes[:4] = torch.tensor([float("nan")]).view(torch.uint8)  # the first layer's scale
        return codes

    honest_model, honest = _gssp(lambda x: x, "fixed")
    _train_step(honest_model, honest)
    model, engine = _gssp(poisoned, "fixed")
    with pytest.raises(RunError, match=r"site b\): its cross-site round was refused.*NaN or Inf"):
        _train_step(model, engine)
    assert torch.equal(_params(model), _params(honest_model))


@pytest.mark.parametrize("attack", list(_float_attacks()))
def test_a_refused_part_of_a_model_average_changes_nothing(attack: str) -> None:
    fn, why = _float_attacks()[attack]
    tensors = [torch.randn(3, 4), torch.randn(5)]
    channel = _Channel(lambda x: fn(x) if attack != "1000x norm" else x * 1e6)
    check = AverageCheck(channel, tensors)
    for t in tensors:
        t.add_(0.01)  # this site trained a little since the last average
    before = [t.clone() for t in tensors]
    with pytest.raises(
        RunError, match=rf"rank 1 \(site b\): its part of the model average was refused.*{why}"
    ):
        average_model(channel, tensors, StepStats(), check)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_an_honest_model_average_is_the_rank_weighted_mean_and_moves_the_reference() -> None:
    tensors = [torch.ones(4)]
    channel = _Channel(lambda x: x + 0.02)
    check = AverageCheck(channel, tensors)
    tensors[0].add_(0.01)
    average_model(channel, tensors, StepStats(), check)
    assert torch.allclose(tensors[0], torch.full((4,), 1.02))
    assert torch.equal(check.common, tensors[0])


def test_local_sgd_refuses_a_poisoned_average() -> None:
    model = _model()
    engine = LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.1), model, _Channel(lambda x: x * float("nan")), period=1
    )
    with pytest.raises(RunError, match=r"site b\): its part of the model average was refused"):
        _train_step(model, engine)


# -- compressed chunk scales (bsp's compressed allreduce) ------------------------------------------------
class _Transport:
    """Two workers; worker 1's encodings of this worker's chunk are ``attack``ed on the way."""

    pads_allgather = False

    def __init__(self, attack) -> None:
        self.attack = attack

    def size(self) -> int:
        return 2

    def index(self) -> int:
        return 0

    def describe(self, j: int) -> str:
        return SITES[j]

    def allreduce_mean(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return flat.clone()

    def alltoall(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str
    ) -> torch.Tensor:
        mine = send[: send_splits[0]]
        return torch.cat([mine, self.attack(mine.clone())])  # worker 1 "sends" a copy of ours

    def allgather(self, mine: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        return (
            torch.cat([mine, mine[: sizes[1]]])
            if sizes[1] <= mine.numel()
            else torch.cat([mine] * 2)[: sum(sizes)]
        )


def _scale(value: float):
    def f(buf: torch.Tensor) -> torch.Tensor:
        buf[:4] = torch.tensor([value]).view(torch.uint8)
        return buf

    return f


@pytest.mark.parametrize(
    ("value", "why"),
    [(float("nan"), "NaN or Inf"), (float("inf"), "NaN or Inf"), (-1.0, "negative"), (1e6, "exceeds")],
)
def test_a_bad_compressed_chunk_scale_is_refused_naming_the_worker(value: float, why: str) -> None:
    op = CompressedAllreduce(4, min_numel=16, transport=_Transport(_scale(value)))
    grads = {"w": torch.randn(64), "v": torch.randn(32)}
    with pytest.raises(RunError, match=rf"rank 1 \(site b\): its compressed chunk scales.*{why}"):
        op(grads)
    honest = CompressedAllreduce(4, min_numel=16, transport=_Transport(lambda b: b))
    out = honest(grads)
    assert out["w"].shape == (64,) and bool(torch.isfinite(out["w"]).all())
    assert encoded_nbytes(32, 4) == encode(torch.randn(32), 4).numel()


# -- a diverged loss stops the run before its checkpoint ---------------------------------------------------
def test_a_nan_gradient_is_never_stepped_or_sent() -> None:
    model, engine = _gssp(lambda x: x)
    before = _params(model).clone()
    engine.who = "rank 0 (site a)"
    engine.zero_grad()
    (model(torch.randn(1, 1, 5, 5, 5)).mean() * float("nan")).backward()
    with pytest.raises(RunError, match=r"training diverged on rank 0 \(site a\).*the step was not taken"):
        engine.step()
    assert torch.equal(_params(model), before) and engine.rounds == 0


def test_local_session_refuses_a_diverged_epoch_before_its_checkpoint() -> None:
    model = _model()
    session = LocalSession()
    session.prepare(lambda: 1, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert session.end_epoch(opt) == {}
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    with pytest.raises(
        RunError, match=r"training diverged on this process: 2\.bias holds NaN.*last good epoch"
    ):
        session.end_epoch(opt)
    bare = LocalSession()  # without prepare: the optimizer's parameters
    with pytest.raises(RunError, match="parameter"):
        bare.end_epoch(opt)
    check_trained([("x", torch.ones(2)), ("n", torch.tensor([1, 2]))])


# one rank's epoch numbers as the session makes them (the ``numbers`` part of an ``epoch-end`` message)
NUMBERS = rank_numbers(StepStats(steps=4), 8, 0, 2.0, 0.0, 1.0)


def test_site_metrics_from_a_site_that_speaks_for_another_or_weighs_zero_are_refused() -> None:
    """Rank 0 pools the sites' scores: rank 1 claiming site a's name, or val_cases 0, stops the job."""

    class _Gather:
        def __init__(self, entries: list) -> None:
            self.entries = entries

        def gather_json(self, value: Any, schema: str, kind: str = "") -> list:
            return self.entries

        def describe(self, r: int) -> str:
            return SITES[r]

    session = HorovodSession.__new__(HorovodSession)
    session.site, session.validates, session.is_chief, session.rank_sites = "a", True, True, ["a", "b"]
    session.groups, session.periods, session.wan_factor, session.exchange_s = [[0], [1]], [1, 1], 1, None
    session._numbers = NUMBERS
    a = {"numbers": NUMBERS, "site": ["a", {"val_dice": 0.8, "val_cases": 2}]}
    session.channel = _Gather([a, {"numbers": NUMBERS, "site": ["b", {"val_dice": 0.7, "val_cases": 3}]}])
    numbers, per_site = session.finish_epoch({})
    assert per_site["b"]["val_cases"] == 3 and numbers["dist_samples_per_s"] > 0
    assert session.finish_epoch(None)[1] is None  # validation not due: numbers only
    session.channel = _Gather([a, {"numbers": NUMBERS, "site": ["a", {"val_dice": 1.0, "val_cases": 10**6}]}])
    with pytest.raises(RunError, match=r"rank 1 \(site b\): its validation scores.*claim to be site 'a'"):
        session.finish_epoch({})
    session.channel = _Gather([a, {"numbers": NUMBERS, "site": ["b", {"val_dice": 0.7, "val_cases": 0}]}])
    with pytest.raises(RunError, match="val_cases 0 must be a positive integer"):
        session.finish_epoch({})
    assert math.isfinite(K_NORM)

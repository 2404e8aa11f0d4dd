"""Grouping by speed, data shares and straggler simulation (pure and fast: no collectives)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from medseg.distributed.sync.groups import (
    calinski_harabasz,
    choose_groups,
    epoch_rounds,
    fit_wan_factor,
    group_shares,
    kmeans_1d,
    parse_groups,
    profile_throughput,
    rank_share_indices,
    scale_periods,
    static_share,
    steps_per_epoch,
    wan_round_factor,
)
from medseg.distributed.testbed.straggler import Straggler, parse_straggler
from medseg.errors import ConfigError

TWO = [10, 10.2, 9.9, 5, 5.1, 4.9]
THREE = [10, 2.1, 6, 9.8, 6.2, 2, 10.1, 5.9, 1.9]


def _wss(values: np.ndarray, segments: list[np.ndarray]) -> float:
    return float(sum(((s - s.mean()) ** 2).sum() for s in segments))


# --- k-means ----------------------------------------------------------------------------------


def test_kmeans_two_clear_clusters_fastest_is_cluster_0() -> None:
    assert kmeans_1d(TWO, 2) == [0, 0, 0, 1, 1, 1]
    assert kmeans_1d([1.0, 20.0, 2.0, 21.0], 2) == [1, 0, 1, 0]


def test_kmeans_three_clusters_ordered_by_speed() -> None:
    labels = kmeans_1d(THREE, 3)
    assert labels == [0, 2, 1, 0, 1, 2, 0, 1, 2]


def test_kmeans_edge_k() -> None:
    assert kmeans_1d([3.0, 1.0, 2.0], 1) == [0, 0, 0]
    assert kmeans_1d([3.0, 1.0, 2.0], 3) == [0, 2, 1]
    with pytest.raises(ConfigError):
        kmeans_1d([1.0, 2.0], 3)
    with pytest.raises(ConfigError):
        kmeans_1d([1.0, 2.0], 0)
    with pytest.raises(ConfigError):
        kmeans_1d([], 1)


@pytest.mark.parametrize("trial", range(30))
def test_kmeans_is_optimal_against_brute_force(trial: int) -> None:
    rng = np.random.default_rng(trial)
    n = int(rng.integers(1, 9))
    k = int(rng.integers(1, n + 1))
    values = rng.gamma(2.0, 5.0, size=n).round(2)  # rounding makes ties appear too
    labels = kmeans_1d(values.tolist(), k)
    assert sorted(set(labels)) == list(range(k))
    got = _wss(values, [values[np.asarray(labels) == c] for c in range(k)])
    xs = np.sort(values)
    best = min(_wss(xs, np.split(xs, cuts)) for cuts in itertools.combinations(range(1, n), k - 1))
    assert got == pytest.approx(best, abs=1e-9)
    # cluster 0 is the fastest: cluster means decrease with the label
    means = [values[np.asarray(labels) == c].mean() for c in range(k)]
    assert means == sorted(means, reverse=True)


def test_kmeans_deterministic() -> None:
    values = [5.0, 5.0, 5.0, 5.0, 1.0]
    assert kmeans_1d(values, 3) == kmeans_1d(values, 3)


# --- Calinski-Harabasz -----------------------------------------------------------------------------


def test_calinski_harabasz_by_hand() -> None:
    values = [1.0, 2.0, 5.0, 6.0]
    # means 1.5 and 5.5, overall 3.5: B = 2*4 + 2*4 = 16, W = 4 * 0.25 = 1; CH = (16/1)/(1/2) = 32
    assert calinski_harabasz(values, [0, 0, 1, 1]) == pytest.approx(32.0)
    assert calinski_harabasz(values, [0, 0, 1, 1], noise_var=0.5) == pytest.approx(16.0)


def test_calinski_harabasz_edge_cases() -> None:
    assert calinski_harabasz([1.0, 2.0, 3.0], [0, 0, 0]) == 0.0
    assert calinski_harabasz([1.0, 1.0, 4.0, 4.0], [0, 0, 1, 1]) == math.inf
    assert calinski_harabasz([1.0, 2.0], [0, 1]) == math.inf
    assert calinski_harabasz([2.0, 2.0], [0, 1]) == 0.0
    with pytest.raises(ConfigError):
        calinski_harabasz([1.0, 2.0], [0])


# --- choose_groups --------------------------------------------------------------------------------


def test_choose_groups_two_clear_clusters() -> None:
    assert choose_groups(TWO) == [[0, 1, 2], [3, 4, 5]]


def test_choose_groups_three_clear_clusters() -> None:
    assert choose_groups(THREE) == [[0, 3, 6], [1, 5, 8], [2, 4, 7]]


def test_choose_groups_uniform_and_single() -> None:
    assert choose_groups([10.0, 10.3, 9.8, 10.1]) == [[0, 1, 2, 3]]
    assert choose_groups([7.0]) == [[0]]
    assert choose_groups([10.0, 10.0, 10.0]) == [[0, 1, 2]]
    # two ranks: CH cannot score k = n, so one group unless asked for two
    assert choose_groups([10.0, 5.0]) == [[0, 1]]
    assert choose_groups([10.0, 5.0], k=2) == [[0], [1]]


def test_choose_groups_given_k_and_k_max() -> None:
    # the 10s and 6s are 3.93 apart, the 6s and 2s 4.03: the two faster clusters merge
    assert choose_groups(THREE, k=2) == [[0, 2, 3, 4, 6, 7], [1, 5, 8]]
    assert choose_groups(THREE, k_max=2) == choose_groups(THREE, k=2)
    assert choose_groups(THREE, k=1) == [list(range(9))]
    assert choose_groups(THREE, k_max=1) == [list(range(9))]
    for bad in ({"k": 0}, {"k": 10}, {"k_max": 0}):
        with pytest.raises(ConfigError):
            choose_groups(THREE, **bad)
    with pytest.raises(ConfigError):
        choose_groups([])
    with pytest.raises(ConfigError):
        choose_groups([1.0, 0.0])


# --- parse_groups -----------------------------------------------------------------------------------


def test_parse_groups_valid_and_canonical() -> None:
    assert parse_groups([[0, 1], [2, 3]], 4) == [[0, 1], [2, 3]]
    assert parse_groups([[3, 2], [1, 0]], 4) == [[0, 1], [2, 3]]
    assert parse_groups("[[0, 2], [1]]", 3) == [[0, 2], [1]]


@pytest.mark.parametrize(
    ("spec", "world", "message"),
    [
        ([[0, 1], [2]], 4, "rank 3 is in no group"),
        ([[0, 1], [1, 2, 3]], 4, "rank 1 appears twice"),
        ([[0, 1, 1], [2, 3]], 4, "rank 1 appears twice"),
        ([[0, 1], [2, 3, 7]], 4, "rank 7 does not exist: world size 4"),
        ([[0, 1], [], [2, 3]], 4, "group 1 is empty"),
        ([[0, 1], [2, -1]], 4, "rank -1 does not exist"),
        ([[0, "a"]], 2, "not a rank number"),
        ("[[0,1", 2, "not a list of lists"),
        ([0, 1], 2, "must be a list of ranks"),
        ([[0]], 0, "world size must be"),
    ],
)
def test_parse_groups_errors(spec: object, world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_groups(spec, world)  # type: ignore[arg-type]


# --- shares and samples -------------------------------------------------------------------------


def test_group_shares_proportional() -> None:
    v = [30.0, 30.0, 10.0, 10.0, 20.0]
    shares = group_shares([[0, 1], [2, 3], [4]], v)
    assert sum(shares) == pytest.approx(1.0)
    assert shares == pytest.approx([0.6, 0.2, 0.2])
    with pytest.raises(ConfigError):
        group_shares([[0, 1]], v)


GROUPS = [[0, 3], [1, 2, 4]]
SHARES = [0.7, 0.3]


@pytest.mark.parametrize("n", [0, 1, 7, 100, 1001])
def test_rank_share_indices_partition(n: int) -> None:
    parts = [rank_share_indices(n, GROUPS, SHARES, r, epoch=2, seed=5) for r in range(5)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))  # disjoint and covering: each sample exactly once
    for g, share in zip(GROUPS, SHARES):
        for r in g:
            assert abs(len(parts[r]) - share * n / len(g)) <= 1.0
        sizes = [len(parts[r]) for r in g]
        assert max(sizes) - min(sizes) <= 1


def test_rank_share_indices_deterministic_and_epoch_dependent() -> None:
    a = rank_share_indices(200, GROUPS, SHARES, 3, epoch=1, seed=0)
    assert a == rank_share_indices(200, GROUPS, SHARES, 3, epoch=1, seed=0)
    assert a != rank_share_indices(200, GROUPS, SHARES, 3, epoch=2, seed=0)
    assert a != rank_share_indices(200, GROUPS, SHARES, 3, epoch=1, seed=1)


def test_rank_share_indices_largest_remainder() -> None:
    # quotas 3.33, 3.33, 3.33 of 10: floors 3+3+3, the one left over goes to group 0 (tie → first)
    sizes = [len(rank_share_indices(10, [[0], [1], [2]], [1, 1, 1], r, 0, 0)) for r in range(3)]
    assert sizes == [4, 3, 3]


def test_rank_share_indices_errors() -> None:
    with pytest.raises(ConfigError, match="rank 9"):
        rank_share_indices(10, GROUPS, SHARES, 9, 0, 0)
    with pytest.raises(ConfigError):
        rank_share_indices(10, GROUPS, [1.0], 0, 0, 0)
    with pytest.raises(ConfigError):
        rank_share_indices(10, [[0, 1], [1]], [0.5, 0.5], 0, 0, 0)
    with pytest.raises(ConfigError):
        rank_share_indices(10, GROUPS, SHARES, 0, -1, 0)


def test_steps_per_epoch_equalises_wall_time() -> None:
    v = [40.0, 40.0, 10.0, 10.0]
    groups = [[0, 1], [2, 3]]
    shares = group_shares(groups, v)
    steps = steps_per_epoch(1000, groups, shares, batch_size=8)
    assert steps == [50, 13]  # 400 samples per fast rank, 100 per slow rank
    assert steps_per_epoch(1000, groups, shares, batch_size=1000) == [1, 1]
    with pytest.raises(ConfigError):
        steps_per_epoch(1000, groups, shares, batch_size=0)


def test_static_share_partitions_by_speed_and_fills_whole_rounds() -> None:
    groups, periods = [[0, 1], [2]], [3, 1]  # group 0 three times as fast per rank as group 1
    parts = [static_share(70, groups, periods, batch_size=2, rank=r, seed=4) for r in range(3)]
    owned = [i for idx, _ in parts for i in idx]
    assert sorted(owned) == list(range(70))  # every case owned by exactly one rank
    assert [len(idx) for idx, _ in parts] == [30, 30, 10]  # shares 3:3:1
    # R = min(30 // 6, 30 // 6, 10 // 2) = 5 rounds: 5 * 3 * 2 per fast rank, 5 * 1 * 2 for the slow one
    assert [take for _, take in parts] == [30, 30, 10]
    assert static_share(70, groups, periods, 2, 0, 4) == parts[0]  # same answer on every call
    with pytest.raises(ConfigError, match="cannot give every rank"):
        static_share(5, groups, periods, batch_size=2, rank=0, seed=0)


def test_wan_round_factor_hides_the_exchange_behind_a_round() -> None:
    # group 0: 2 steps per round at 8 samples/s per rank, group 1: 1 step at 4 samples/s; 2 samples
    # per step: both compute a round in 0.5 s
    assert wan_round_factor(0.4, [2, 1], [8.0, 4.0], 2) == 1  # the exchange already fits a round
    assert wan_round_factor(1.2, [2, 1], [8.0, 4.0], 2) == 3  # ceil(1.2 / 0.5)
    assert wan_round_factor(2.0, [2, 1], [8.0, 4.0], 2) == 4  # exactly 4 rounds' compute
    # the faster group's round is the one that must cover the exchange
    assert wan_round_factor(1.2, [1, 1], [8.0, 4.0], 2) == 5  # ceil(1.2 / 0.25)
    assert wan_round_factor(100.0, [1, 1], [8.0, 4.0], 2, max_factor=16) == 16
    assert wan_round_factor(0.0, [1, 1], [8.0, 4.0], 2) == 1
    with pytest.raises(ValueError):
        wan_round_factor(1.0, [1, 1], [8.0, 0.0], 2)


def test_epoch_rounds_falls_with_a_common_round_factor() -> None:
    groups, periods = [[0, 1], [2]], [3, 1]
    assert epoch_rounds(70, groups, periods, 2) == 5  # as in the static_share test above
    # shares are unchanged by a common factor, so R falls by about that factor
    assert epoch_rounds(70, groups, [6, 2], 2) == 2
    assert epoch_rounds(70, groups, [18, 6], 2) == 0


def test_fit_wan_factor_keeps_the_epochs_rounds() -> None:
    # the benchmark's case: 128 cases, sites of 2 ranks, site a twice as fast (rounds [2, 1]),
    # batch 1: the base rounds give 21 per epoch, x5 gives 4, x4 gives 5, x3 gives 7
    groups, base = [[0, 1], [2, 3]], [2, 1]
    assert [epoch_rounds(128, groups, [p * m for p in base], 1) for m in (1, 3, 4, 5)] == [21, 7, 5, 4]
    assert fit_wan_factor(9, 128, groups, base, 1, min_rounds=4) == 5
    assert fit_wan_factor(9, 128, groups, base, 1, min_rounds=6) == 3
    assert fit_wan_factor(9, 128, groups, base, 1, min_rounds=1) == 9  # nothing to keep
    assert fit_wan_factor(2, 128, groups, base, 1, min_rounds=6) == 2  # already short enough
    # an epoch too small for the floor even at the base rounds keeps the base rounds
    assert epoch_rounds(12, groups, base, 1) == 2
    assert fit_wan_factor(9, 12, groups, base, 1, min_rounds=6) == 1
    with pytest.raises(ValueError):
        fit_wan_factor(9, 128, groups, base, 1, min_rounds=0)


def test_profile_throughput() -> None:
    calls = []

    def step() -> int:
        calls.append(1)
        time.sleep(0.01)
        return 4

    speed = profile_throughput(step, warmup=2, blocks=3, min_block_s=0.05)
    assert len(calls) >= 2 + 3 * 5  # warm-ups, then whole steps until each block reaches 50 ms
    assert 0 < speed <= 4 / 0.01 * 1.05  # sleep never undershoots; allow timer slack
    with pytest.raises(ConfigError):
        profile_throughput(step, blocks=0)


def test_profile_throughput_measures_a_cpu_quota_not_a_burst() -> None:
    """A quota lets short steps run at full speed and then stalls the process (like CFS
    throttling): 9 steps of 5 ms, then one held for 155 ms, i.e. 200 ms per 10 steps. The worker's
    real speed is 10 x 2 samples / 0.2 s = 100 samples/s; a single step says 400."""
    calls = []

    def step() -> int:
        calls.append(1)
        time.sleep(0.155 if len(calls) % 10 == 0 else 0.005)
        return 2

    speed = profile_throughput(step, warmup=0, blocks=3, min_block_s=0.4)
    assert 70 < speed < 130


# --- straggler --------------------------------------------------------------------------------


def test_parse_straggler_good() -> None:
    assert parse_straggler(None) is None
    assert parse_straggler("  ") is None
    assert parse_straggler("3:2.0") == (3, 2.0)
    assert parse_straggler(" 0 : 1 ") == (0, 1.0)


@pytest.mark.parametrize(
    "spec", ["3", "3:", ":2", "a:2", "3:x", "-1:2", "3:0.5", "3:nan", "3:inf", "1:2:3", "1.5:2"]
)
def test_parse_straggler_bad(spec: str) -> None:
    with pytest.raises(ConfigError):
        parse_straggler(spec)


def _busy(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def test_straggler_stretches_block() -> None:
    straggler = Straggler(2.0)
    t0 = time.perf_counter()
    with straggler:
        _busy(0.05)
    total = time.perf_counter() - t0
    # the block computed >= 50 ms, then slept as long again: >= 1.8x of the 50 ms is certain
    assert total >= 1.8 * 0.05
    assert straggler.slept_s >= 0.05
    assert straggler.slept_s <= total


def test_straggler_noop_and_errors() -> None:
    straggler = Straggler(1.0)
    with straggler:
        _busy(0.01)
    assert straggler.slept_s == 0.0
    with pytest.raises(ConfigError):
        Straggler(0.5)
    s = Straggler(3.0)
    with pytest.raises(RuntimeError), s:
        raise RuntimeError("boom")
    assert s.slept_s == 0.0
    assert Straggler.for_rank("2:3.0", rank=2).factor == 3.0
    assert Straggler.for_rank("2:3.0", rank=1).factor == 1.0
    assert Straggler.for_rank(None, rank=0).factor == 1.0


def test_scaled_rounds_take_equal_time_where_rounding_first_makes_the_fast_site_straggle() -> None:
    # three sites at 0.45, 0.40 and 0.30 core per rank: speeds 1.5 : 1.33 : 1
    speeds = [4.5, 4.0, 3.0]
    ratios = [v / min(speeds) for v in speeds]
    assert scale_periods(ratios, 1) == [2, 1, 1]  # no WAN factor: as before
    periods = scale_periods(ratios, 16)
    assert periods == [24, 21, 16]
    round_s = [p / v for p, v in zip(periods, speeds)]  # seconds of one round's compute per group
    assert max(round_s) / min(round_s) < 1.02
    first = [p * 16 for p in scale_periods(ratios, 1)]  # rounding before scaling: 32, 16, 16
    assert max(p / v for p, v in zip(first, speeds)) / min(round_s) > 1.3
    assert scale_periods([1.0, 0.01], 2) == [2, 1]  # never a round of no steps
    with pytest.raises(ValueError):
        scale_periods([1.0, 0.0], 4)

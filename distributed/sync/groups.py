"""Worker groups by measured speed, and each group's share of an epoch's samples.

Following Jiang et al. (CCGrid 2019), workers of similar speed train together in one group that
synchronises every step, and each group receives a share of the data proportional to its speed, so
that fast and slow groups finish an epoch in about the same wall time.

The pieces, in the order a launcher uses them:

1. :func:`profile_throughput` measures one worker's speed ``v_r`` in samples per second.
2. :func:`choose_groups` clusters the speeds with exact 1-D k-means (:func:`kmeans_1d`), picking the
   number of groups with the Calinski-Harabasz index (:func:`calinski_harabasz`); or
   :func:`parse_groups` validates groups written by the user.
3. :func:`group_shares` gives group ``g`` the share ``s_g = sum_{r in g} v_r / sum_r v_r``.
4. :func:`rank_share_indices` (and :func:`static_share`) deal the shuffled samples out:
   a contiguous block of ``~s_g * n`` samples per group, split as equally as possible among the
   group's ranks; :func:`steps_per_epoch` turns that into optimizer steps per group.

Everything here is deterministic and pure (no collectives): every rank computes the same answer
from the same inputs, which is what lets ranks agree on groups and samples without talking.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from medseg.config import DistConfig
from medseg.errors import ConfigError

log = logging.getLogger(__name__)

#: Speeds whose coefficient of variation ``std(v) / mean(v)`` is below this are treated as one
#: group: a spread under 10% is within what a few profiling steps measure from run to run, and
#: splitting such workers would only add cross-group staleness for no speed gain.
UNIFORM_CV = 0.1

#: Relative measurement noise assumed on each throughput when choosing the number of groups
#: (half of :data:`UNIFORM_CV`). Its variance ``(NOISE_REL * mean(v))**2`` floors the within-group
#: variance estimate in the Calinski-Harabasz score, so that splitting already tight clusters
#: (spreads of a few percent, i.e. measurement noise) is not rewarded; see :func:`choose_groups`.
NOISE_REL = 0.05


def groups_without_speeds(dist: DistConfig, hosts: list[str]) -> list[list[int]] | None:
    """The sync groups every rank can name from every rank's host alone: one per rank for ssp, one
    per host by default; ``None`` when rank 0 decides (explicit groups, or groups by speed)."""
    if dist.sync == "ssp":
        return [[r] for r in range(len(hosts))]
    if not dist.groups and dist.group_by == "host":
        return groups_by_host(hosts)
    return None


def groups_by_host(hosts: list[str]) -> list[list[int]]:
    """One group per host (``hosts[r]`` is rank r's), in order of each host's lowest rank."""
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    return sorted(by_host.values(), key=min)


def _as_speeds(values: Sequence[float], what: str = "throughputs") -> np.ndarray:
    """Return ``values`` as a float64 vector, rejecting empty, non-finite or non-positive speeds."""
    try:
        arr = np.asarray(list(values), dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a list of numbers, got {values!r}") from None
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(f"{what}: expected a non-empty list of numbers, got {values!r}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(f"{what}: every value must be finite, got {arr.tolist()}")
    return arr


def kmeans_1d(values: Sequence[float], k: int) -> list[int]:
    """Exact (globally optimal) 1-D k-means; return a cluster label per value.

    Minimises the within-cluster sum of squares ``W = sum_c sum_{i in c} (x_i - mean_c)**2`` over
    all partitions of ``values`` into ``k`` non-empty clusters. In one dimension an optimal
    partition is contiguous in sorted order (swapping two points between clusters whose ranges
    overlap never increases ``W``), so dynamic programming over the sorted values is exact:

        D[m][j] = min_{m-1 <= i < j} D[m-1][i] + cost(i, j),     D[0][0] = 0,

    where ``D[m][j]`` is the least ``W`` of the first ``j`` sorted values in ``m`` clusters and
    ``cost(i, j) = sum_{t=i}^{j-1} x_t**2 - (sum x_t)**2 / (j - i)`` comes from prefix sums in
    O(1). Time O(k n^2) (vectorised per ``m``), memory O(n^2 + k n).

    Values are sorted from highest to lowest (ties by input position), so **cluster 0 holds the
    highest values** (the fastest workers when values are speeds), cluster 1 the next, and so on.
    Ties in the DP go to the smallest split point, which makes the result deterministic.

    Raises :class:`ConfigError` if ``values`` is empty or not finite, or ``k`` is not in ``1..n``.
    """
    x = _as_speeds(values, "kmeans_1d values")
    n = x.size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ConfigError(f"kmeans_1d: k must be an integer in 1..{n} (the number of values), got {k!r}")
    order, arg = _kmeans_tables(x, k)
    return _backtrack(order, arg, k)


def _kmeans_tables(x: np.ndarray, k_max: int) -> tuple[list[int], np.ndarray]:
    """Run the k-means DP of :func:`kmeans_1d` once for every ``k <= k_max``.

    Returns the descending sort ``order`` of ``x`` and ``arg[m, j]``, the optimal start of the last
    of ``m`` clusters covering the first ``j`` sorted values. One table serves every ``k``, which
    is what makes trying all ``k`` in :func:`choose_groups` cost one DP rather than ``k_max``.
    Each layer is one vectorised ``min`` over an ``(n+1) x (n+1)`` cost matrix; ``argmin`` takes
    the first (smallest) split point on ties.
    """
    n = x.size
    order = sorted(range(n), key=lambda i: (-x[i], i))
    xs = x[order] - x.mean()  # centring keeps the prefix-sum costs numerically stable
    s1 = np.concatenate(([0.0], np.cumsum(xs)))
    s2 = np.concatenate(([0.0], np.cumsum(xs * xs)))
    i = np.arange(n + 1)[:, None]
    j = np.arange(n + 1)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        seg = s1[j] - s1[i]
        cost = np.maximum(0.0, s2[j] - s2[i] - seg * seg / (j - i))
    cost = np.where(j > i, cost, np.inf)  # cost[i, j]: values i..j-1 in one cluster
    dp = np.full(n + 1, np.inf)
    dp[0] = 0.0
    arg = np.zeros((k_max + 1, n + 1), dtype=np.int64)
    for m in range(1, k_max + 1):
        total = dp[:, None] + cost
        arg[m] = np.argmin(total, axis=0)
        dp = total[arg[m], np.arange(n + 1)]
    return order, arg


def _backtrack(order: list[int], arg: np.ndarray, k: int) -> list[int]:
    """Labels of the optimal ``k``-clustering from :func:`_kmeans_tables` (cluster 0 = highest)."""
    n = len(order)
    labels = [0] * n
    j = n
    for m in range(k, 0, -1):
        i = int(arg[m, j])
        for t in range(i, j):
            labels[order[t]] = m - 1
        j = i
    return labels


def calinski_harabasz(values: Sequence[float], labels: Sequence[int], noise_var: float = 0.0) -> float:
    """Calinski-Harabasz index of a clustering of 1-D ``values``; higher is better separated.

    With ``n`` values, ``k`` distinct labels, overall mean ``m`` and cluster means ``m_c``:

        B  = sum_c n_c (m_c - m)**2                     (between-cluster dispersion)
        W  = sum_c sum_{i in c} (x_i - m_c)**2          (within-cluster dispersion)
        CH = [B / (k - 1)] / [W / (n - k) + noise_var]

    ``noise_var`` (default 0, the textbook index) is an assumed measurement-noise variance added
    to the pooled within-cluster variance estimate ``W / (n - k)``; :func:`choose_groups` uses it
    so that clusters tighter than the measurement noise do not score as infinitely good.

    Edge cases: ``k == 1`` (B = 0, nothing to separate) gives ``0.0``; if the denominator is 0
    (``W == 0``, which includes ``k == n``, with ``noise_var == 0``) the result is ``+inf`` when
    ``B > 0`` and ``0.0`` when ``B == 0``. ``k == n`` with ``noise_var > 0`` uses only the noise
    term (``W / (n - k)`` is taken as 0).
    """
    x = _as_speeds(values, "calinski_harabasz values")
    lab = list(labels)
    if len(lab) != x.size:
        raise ConfigError(f"calinski_harabasz: {x.size} values but {len(lab)} labels")
    if noise_var < 0 or not math.isfinite(noise_var):
        raise ConfigError(f"calinski_harabasz: noise_var must be finite and >= 0, got {noise_var}")
    n = x.size
    clusters = sorted(set(lab))
    k = len(clusters)
    if k < 2:
        return 0.0
    lab_arr = np.asarray(lab)
    mean = float(x.mean())
    b = 0.0
    w = 0.0
    for c in clusters:
        xc = x[lab_arr == c]
        mc = float(xc.mean())
        b += xc.size * (mc - mean) ** 2
        w += float(((xc - mc) ** 2).sum())
    within = (w / (n - k) if n > k else 0.0) + noise_var
    if within <= 0.0:
        return math.inf if b > 0.0 else 0.0
    return (b / (k - 1)) / within


def _canonical(groups: list[list[int]]) -> list[list[int]]:
    """Sort each group's ranks, then the groups by their first rank."""
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def choose_groups(
    throughputs: Sequence[float], k: int | None = None, k_max: int | None = None
) -> list[list[int]]:
    """Group ranks by measured throughput ``v_r`` (samples/s of rank ``r``).

    With ``k`` given, the ranks are split into exactly ``k`` groups by :func:`kmeans_1d`
    (``ConfigError`` unless ``1 <= k <= n``).

    With ``k`` None the number of groups is chosen:

    * one group if ``n == 1`` or the speeds are nearly uniform, i.e. their coefficient of
      variation ``std(v) / mean(v)`` is below :data:`UNIFORM_CV` (0.1) — the index below cannot
      score ``k = 1``, so this test stands in for it;
    * otherwise every ``k`` in ``2 .. min(k_max or n - 1, n - 1)`` is clustered and the one with
      the highest Calinski-Harabasz index wins (the smallest ``k`` on ties). The index is computed
      with ``noise_var = (NOISE_REL * mean(v))**2``: throughputs measured over a few steps carry a
      few percent of noise, and without this floor the textbook index rewards splitting clusters
      that are already tight to within that noise (for ``[10, 10.2, 9.9, 5, 5.1, 4.9]`` it prefers
      4 groups over the obvious 2). ``k = n`` is never tried: every worker alone has ``W = 0``.
      With ``n == 2`` no ``k`` is left to try and the result is one group; pass ``k=2`` to split.

    Returns the groups as lists of ranks, each sorted, the groups sorted by their first rank.
    Throughputs must be positive (a worker that processes nothing cannot be given a share).
    """
    v = _as_speeds(throughputs)
    if np.any(v <= 0):
        raise ConfigError(f"throughputs: every worker's speed must be > 0 samples/s, got {v.tolist()}")
    n = v.size
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ConfigError(f"groups: the number of groups must be in 1..{n} (the world size), got {k!r}")
        return _labels_to_groups(kmeans_1d(v, k), k)
    if k_max is not None and (isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1):
        raise ConfigError(f"groups: the largest number of groups to try must be >= 1, got {k_max!r}")

    cv = float(v.std() / v.mean())
    hi = min(k_max if k_max is not None else n - 1, n - 1)
    if n == 1 or cv < UNIFORM_CV or hi < 2:
        log.info("groups: one group of %d ranks (speed CV %.3f, threshold %.2f)", n, cv, UNIFORM_CV)
        return [list(range(n))]

    noise_var = (NOISE_REL * float(v.mean())) ** 2
    order, arg = _kmeans_tables(v, hi)
    best_k, best_score, best_labels = 0, -math.inf, None
    for kk in range(2, hi + 1):
        labels = _backtrack(order, arg, kk)
        score = calinski_harabasz(v, labels, noise_var=noise_var)
        log.debug("groups: k=%d CH=%.4g", kk, score)
        if score > best_score:
            best_k, best_score, best_labels = kk, score, labels
    assert best_labels is not None
    groups = _labels_to_groups(best_labels, best_k)
    log.info("groups: %d groups chosen by Calinski-Harabasz (%.4g): %s", best_k, best_score, groups)
    return groups


def _labels_to_groups(labels: Sequence[int], k: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(k)]
    for rank, c in enumerate(labels):
        groups[c].append(rank)
    return _canonical(groups)


def parse_groups(spec: Sequence[Sequence[int]] | str, world_size: int) -> list[list[int]]:
    """Validate explicit groups such as ``[[0, 1], [2, 3]]`` against ``world_size`` ranks.

    ``spec`` is a list of lists of ranks, or the same written as a JSON string (for the command
    line). Every rank ``0 .. world_size - 1`` must appear exactly once and no group may be empty;
    otherwise :class:`ConfigError` names the problem ("rank 3 is in no group", "rank 1 appears
    twice", "rank 7 does not exist: world size 4", "group 1 is empty").

    Returns the groups in canonical form: each group's ranks sorted, groups sorted by first rank
    (the same form :func:`choose_groups` returns), so that group ids do not depend on spelling.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"groups: world size must be an integer >= 1, got {world_size!r}")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ConfigError(
                f"groups: {spec!r} is not a list of lists of ranks, e.g. [[0,1],[2,3]]"
            ) from None
    if not isinstance(spec, Sequence) or isinstance(spec, str):
        raise ConfigError(f"groups: expected a list of lists of ranks, e.g. [[0,1],[2,3]], got {spec!r}")
    seen: dict[int, int] = {}
    groups: list[list[int]] = []
    for gi, group in enumerate(spec):
        if not isinstance(group, Sequence) or isinstance(group, str):
            raise ConfigError(f"groups: group {gi} must be a list of ranks, got {group!r}")
        if len(group) == 0:
            raise ConfigError(f"groups: group {gi} is empty; every group needs at least one rank")
        for rank in group:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
                raise ConfigError(f"groups: group {gi} holds {rank!r}, which is not a rank number")
            rank = int(rank)
            if not 0 <= rank < world_size:
                raise ConfigError(
                    f"groups: rank {rank} does not exist: world size {world_size} (ranks 0..{world_size - 1})"
                )
            if rank in seen:
                where = "twice in group" if seen[rank] == gi else f"twice, in groups {seen[rank]} and"
                raise ConfigError(f"groups: rank {rank} appears {where} {gi}; each rank belongs to one group")
            seen[rank] = gi
        groups.append([int(r) for r in group])
    missing = [r for r in range(world_size) if r not in seen]
    if missing:
        which = f"rank {missing[0]} is" if len(missing) == 1 else f"ranks {missing} are"
        raise ConfigError(f"groups: {which} in no group (world size {world_size})")
    return _canonical(groups)


def group_shares(groups: Sequence[Sequence[int]], throughputs: Sequence[float]) -> list[float]:
    """Each group's share of an epoch's samples, proportional to its total speed.

        s_g = sum_{r in g} v_r / sum_r v_r,      sum_g s_g = 1.

    Per rank this is ``s_g / |g| = mean_{r in g} v_r / sum_r v_r``: a rank's samples are
    proportional to its group's mean speed, so every rank needs about the same wall time per epoch.
    ``groups`` must be a partition of ``0 .. len(throughputs) - 1`` (checked by
    :func:`parse_groups`).
    """
    v = _as_speeds(throughputs)
    if np.any(v <= 0):
        raise ConfigError(f"throughputs: every worker's speed must be > 0 samples/s, got {v.tolist()}")
    parse_groups([list(g) for g in groups], v.size)
    total = float(v.sum())
    return [float(sum(v[r] for r in g)) / total for g in groups]


def _rank_sizes(n_samples: int, groups: Sequence[Sequence[int]], shares: Sequence[float]) -> list[list[int]]:
    """Samples per rank, group by group: ``sizes[g][i]`` for the ``i``-th rank of ``sorted(groups[g])``.

    Group sizes are ``s_g * n`` rounded by largest remainder (floors first, then one extra sample
    to the groups with the largest fractional parts, lower group index first on ties), so they sum
    to ``n`` exactly; a group's size is then split as ``array_split`` does (the first
    ``size mod |g|`` ranks, in sorted order, get one more).
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0:
        raise ConfigError(f"share: number of samples must be an integer >= 0, got {n_samples!r}")
    world = sum(len(g) for g in groups)
    parse_groups([list(g) for g in groups], world)
    s = np.asarray(list(shares), dtype=np.float64)
    if s.shape != (len(groups),):
        raise ConfigError(f"share: {len(groups)} groups but {s.size} shares")
    if not np.all(np.isfinite(s)) or np.any(s < 0) or s.sum() <= 0:
        raise ConfigError(f"share: shares must be finite, >= 0 and not all 0, got {s.tolist()}")
    quota = s / s.sum() * n_samples
    sizes = np.floor(quota).astype(np.int64)
    rest = n_samples - int(sizes.sum())
    if rest > 0:
        frac = quota - sizes
        for g in sorted(range(len(groups)), key=lambda g: (-frac[g], g))[:rest]:
            sizes[g] += 1
    out = []
    for g, ranks in enumerate(groups):
        q, r = divmod(int(sizes[g]), len(ranks))
        out.append([q + (1 if i < r else 0) for i in range(len(ranks))])
    return out


def rank_share_indices(
    n_samples: int,
    groups: Sequence[Sequence[int]],
    shares: Sequence[float],
    rank: int,
    epoch: int,
    seed: int,
) -> list[int]:
    """The sample indices ``rank`` trains on in ``epoch``.

    ``range(n_samples)`` is shuffled by a permutation seeded with ``(seed, epoch)`` (numpy
    ``default_rng``, identical on every rank), cut into contiguous blocks, one per group in the
    order of ``groups``, of sizes ``~shares[g] * n_samples`` (largest-remainder rounding, so they
    sum to ``n_samples``), and each group's block is cut into as-equal-as-possible pieces for its
    ranks in sorted order. Across all ranks every sample is therefore used exactly once per epoch.
    ``shares`` are normalised by their sum.
    """
    sizes = _rank_sizes(n_samples, groups, shares)
    for name, val in (("epoch", epoch), ("seed", seed)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ConfigError(f"share: {name} must be an integer >= 0, got {val!r}")
    perm = np.random.default_rng([seed, epoch]).permutation(n_samples)
    start = 0
    for g, ranks in enumerate(groups):
        for r, size in zip(sorted(ranks), sizes[g]):
            if r == rank:
                return perm[start : start + size].tolist()
            start += size
    raise ConfigError(f"share: rank {rank!r} is in no group of {[list(g) for g in groups]}")


def steps_per_epoch(
    n_samples: int, groups: Sequence[Sequence[int]], shares: Sequence[float], batch_size: int
) -> list[int]:
    """Optimizer steps per epoch for each group: ``ceil(max_{r in g} n_r / batch_size)``.

    ``n_r`` is rank ``r``'s sample count from :func:`rank_share_indices`; ranks of a group step
    together, so the group runs as many steps as its largest rank needs. Since group ``g``'s ranks
    hold samples in proportion to the group's speed, groups of different speeds finish an epoch
    in about the same wall time (fast groups simply run more steps).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"share: batch size must be an integer >= 1, got {batch_size!r}")
    return [-(-max(s) // batch_size) for s in _rank_sizes(n_samples, groups, shares)]


def wan_round_factor(
    exchange_s: float,
    periods: Sequence[int],
    speeds: Sequence[float],
    samples_per_step: int,
    max_factor: int = 64,
) -> int:
    """The factor m every group's round length is multiplied by, so that rounds hide the WAN.

    Group g, of per-rank speed v_g (samples/s, measured) and period p_g (steps per round, from
    the speed ratio), computes a round in c_g = p_g · n / v_g seconds, n samples per step. The
    cross-group exchanges run asynchronously but one after another on the leaders' channel, so
    they keep pace with training only if one takes no longer than a round's compute:

        m = clamp(⌈t_x / min_g c_g⌉, 1, max_factor),

    t_x the measured time of one exchange. Longer rounds mean fewer exchanges per sample (bytes
    and round trips fall by m) at the price of m-times older deltas between groups: the trade-off
    of local SGD (Lin et al., ICLR 2020) and of Gaia's significance filter (NSDI 2017).
    """
    if exchange_s < 0 or samples_per_step < 1 or len(periods) != len(speeds) or min(speeds) <= 0:
        raise ValueError(
            f"wan_round_factor: exchange {exchange_s} s, periods {list(periods)}, speeds {list(speeds)}, "
            f"{samples_per_step} samples per step"
        )
    compute = min(p * samples_per_step / v for p, v in zip(periods, speeds))
    return max(1, min(max_factor, math.ceil(exchange_s / compute)))


def scale_periods(ratios: Sequence[float], factor: int) -> list[int]:
    """Steps per round of each group when every round is lengthened by ``factor``:

        p_g = max(1, round(m · r_g)),   r_g = v_g / min_h v_h,

    r_g the group's per-rank speed over the slowest group's (or a configured period), m the WAN
    factor. Rounding after scaling, not before, keeps a round's compute time c_g = p_g · n / v_g
    nearly equal across groups: at speed ratios 1.5 : 1.33 : 1 and m = 16, rounds of
    24 : 21 : 16 steps take the same time, where rounding first (2 : 1 : 1, times 16) makes the
    fastest group's round a third longer than the slowest's and leaves the others idle that long
    in every round.
    """
    if factor < 1 or not ratios or min(ratios) <= 0:
        raise ValueError(f"scale_periods: ratios {list(ratios)}, factor {factor}")
    return [max(1, round(r * factor)) for r in ratios]


def epoch_rounds(
    n_samples: int, groups: Sequence[Sequence[int]], periods: Sequence[int], batch_size: int
) -> int:
    """Rounds per epoch R = min over ranks of ⌊n_r / (b · period_g)⌋ (see :func:`static_share`).

    Shares are proportional to ``|g|·period_g``, so multiplying every period by the same factor
    leaves each rank's share ``n_r`` unchanged and divides R by about that factor.
    """
    groups = [list(g) for g in groups]
    sizes = _rank_sizes(n_samples, groups, [len(g) * p for g, p in zip(groups, periods)])
    return min(size // (batch_size * p) for p, row in zip(periods, sizes) for size in row)


def fit_wan_factor(
    factor: int,
    n_samples: int,
    groups: Sequence[Sequence[int]],
    ratios: Sequence[float],
    batch_size: int,
    min_rounds: int,
) -> int:
    """The largest m <= ``factor`` whose rounds (:func:`scale_periods` of ``ratios`` by m) leave an
    epoch at least ``min_rounds`` rounds (:func:`epoch_rounds`), or as many as rounds at m = 1
    give; 1 at least.

    A round boundary is where the groups' models meet; longer rounds mean fewer meetings per epoch
    and a longer drift between them, so the WAN factor of :func:`wan_round_factor` is capped here.
    """
    if min_rounds < 1:
        raise ValueError(f"fit_wan_factor: min_rounds must be >= 1, got {min_rounds}")
    need = min(min_rounds, epoch_rounds(n_samples, groups, scale_periods(ratios, 1), batch_size))
    m = max(1, factor)
    while m > 1 and epoch_rounds(n_samples, groups, scale_periods(ratios, m), batch_size) < need:
        m -= 1
    return m


def static_share(
    n_samples: int,
    groups: Sequence[Sequence[int]],
    periods: Sequence[int],
    batch_size: int,
    rank: int,
    seed: int,
) -> tuple[list[int], int]:
    """This rank's own samples for the whole run, and how many of them it trains on per epoch.

    A rank keeps the same samples every epoch, so it caches only those (and a disk cache shared by
    the ranks of a host is filled once). Rank r of group g gets a share proportional to
    ``period_g`` (its group's speed relative to the slowest): :func:`rank_share_indices` at epoch 0
    with shares ``|g|·period_g``. Every group must submit the same number of rounds per epoch
    (the cross-group collectives are matched by round), so an epoch is

        R = min over ranks of ⌊n_r / (b · period_g)⌋ rounds,

    and rank r trains on ``R · period_g · b`` of its samples each epoch, drawn anew each epoch (a
    permutation of its own samples seeded by the epoch), so over epochs it sees all of them.
    Returns ``(indices, per_epoch)``; raises ConfigError when some rank cannot fill one round.
    """
    groups = [list(g) for g in groups]
    weights = [len(g) * p for g, p in zip(groups, periods)]
    rounds = epoch_rounds(n_samples, groups, periods, batch_size)
    if rounds < 1:
        raise ConfigError(
            f"data: {n_samples} training cases cannot give every rank one batch of {batch_size} per round "
            f"(groups {groups}, steps per round {list(periods)}); lower train.batch_size or use more data"
        )
    g = next(i for i, grp in enumerate(groups) if rank in grp)
    indices = rank_share_indices(n_samples, groups, weights, rank, 0, seed)
    return indices, rounds * periods[g] * batch_size


def profile_throughput(
    step_fn: Callable[[], int], warmup: int = 2, blocks: int = 3, min_block_s: float = 0.4
) -> float:
    """Measure a worker's speed in samples per second: the median over ``blocks`` timed blocks.

    Runs ``step_fn`` (one step; returns the number of samples it processed) ``warmup`` times
    untimed (allocator, lazy initialisation, caches). A block then runs whole steps until at least
    ``min_block_s`` has passed and gives ``Σ samples / elapsed``. Blocks rather than single steps,
    because a CPU quota (a cgroup's ``cfs_quota_us`` per ``cfs_period_us``, typically 100 ms) lets a
    short step run at full speed and throttles the process later in the period: one step of a few
    tens of milliseconds measures the machine, several periods measure what training will get.
    The median of the blocks resists a one-off stall. On a GPU, ``step_fn`` must synchronise the
    device before returning, or the time measures launches only.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"profile: warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ConfigError(f"profile: blocks must be an integer >= 1, got {blocks!r}")
    for _ in range(warmup):
        step_fn()
    rates = []
    for _ in range(blocks):
        samples, tic = 0, time.perf_counter()
        while True:
            samples += int(step_fn())
            elapsed = time.perf_counter() - tic
            if elapsed >= min_block_s:
                break
        if samples < 0:
            raise ValueError(f"profile: step_fn reported {samples} samples processed; expected >= 0")
        rates.append(samples / elapsed if elapsed > 0 else math.inf)
    speed = sorted(rates)[len(rates) // 2]
    log.debug("profile: block rates %s samples/s, median %.2f", [round(r, 2) for r in rates], speed)
    return speed

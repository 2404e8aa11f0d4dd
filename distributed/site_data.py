"""Site-local datasets: each hospital's ranks read only that hospital's folder.

A config with ``sites: {a: {dir: /data/hospA}, b: {dir: /data/hospB}}`` and ``medseg train --np 4
--hosts a:2,b:2`` runs two ranks at each site. ``--hosts`` names sites; the launcher hands horovodrun
each site's ``host`` (its address or host name; the site's name when empty) and never opens a
site's folder. A rank finds its site from the host horovodrun started it on (``HOROVOD_HOSTNAME``)
and reads ``sites.<its site>.dir`` only: header facts first, then its own training cases and, on
the site's leader (its lowest rank), its own held-out cases.

Before anything trains, the sites compare header-level facts of their datasets over the job's own
channel (:func:`dataset_facts`: task, label names, modalities, image channels, case counts; no
voxel, no file name) and every rank stops with the same :class:`~medseg.errors.DataError` naming the
site and what differs when they do not match (:func:`compare_facts`).

Epochs and rounds with unequal sites (docs/design.md, "Sites of unequal size"). Site s holds n_s
training cases, split evenly among its k_s ranks (n_r = n_s / k_s, each rank keeps its own cases for
the whole run). A *round* of rank r is p_r steps of b cases, p_r its group's period (its measured
per-rank speed over the slowest group's; 1 for bsp and local-sgd, where every step is shared). All
ranks must take part in the same number of rounds per epoch (rounds, averages and bsp's allreduces
are matched one to one), so an *epoch* is

    R = max over ranks r of ceil(n_r / (b · p_r)) rounds,

the fewest rounds in which every site's every rank sees each of its own cases at least once. Rank r
then trains on R · p_r · b of its own cases per epoch: whole fresh permutations of them, one after
another (torch's ``RandomSampler`` without replacement), so a site with fewer cases per unit of
speed sees its cases more often in an epoch, never another site's.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from medseg.config import Config, TrainConfig
from medseg.datasets.decathlon import DatasetInfo
from medseg.errors import ConfigError, DataError

log = logging.getLogger(__name__)

FACT_KEYS = ("task", "labels", "modality", "channels")


def site_of(cfg: Config, host: str) -> str | None:
    """The site whose name or ``host`` is ``host`` (the ``-H`` entry a rank was started on)."""
    for name, sc in cfg.sites.items():
        if host in (name, sc.host):
            return name
    return None


def rank_sites(cfg: Config, hosts: list[str]) -> list[str]:
    """Every rank's site: the config's site whose name or host the rank was started on."""
    found = [site_of(cfg, h) for h in hosts]
    if None in found:
        host = hosts[found.index(None)]
        raise ConfigError(
            f"--hosts: rank {found.index(None)} runs on {host!r}, which is none of the config's sites "
            f"({', '.join(f'{n} (host {sc.host or n})' for n, sc in cfg.sites.items())})"
        )
    return [str(s) for s in found]


def agreed_site_cases(everyone: list[dict[str, Any]], sites: list[str], chief: bool) -> dict[str, int]:
    """Every site's training-case count once the facts every rank sent (``everyone``, in rank order;
    ``sites[r]`` is rank r's site) agree (:func:`compare_facts`); the chief logs what they agree on."""
    by_site: dict[str, dict[str, Any]] = {}
    for r, f in enumerate(everyone):
        by_site.setdefault(sites[r], f)
    compare_facts(by_site)
    cases = {s: int(f["train_cases"]) for s, f in by_site.items()}
    if chief:
        first = everyone[0]
        log.info(
            "sites %s: training cases %s, held-out cases %s; datasets agree on %s",
            list(by_site),
            cases,
            {s: f["val_cases"] for s, f in by_site.items()},
            {k: first[k] for k in ("task", "labels", "channels")},
        )
    return cases


def horovodrun_hosts(cfg: Config, hosts: str) -> tuple[str, list[str]]:
    """``--hosts a:2,b:2`` (site names) as horovodrun's ``-H`` (each site's host), and the sites in order.

    Without ``sites:`` in the config the string is returned as it is and every host is its own site.
    """
    out, names = [], []
    for item in hosts.split(","):
        name, _, slots = item.rpartition(":")
        if cfg.sites:
            site = name if name in cfg.sites else site_of(cfg, name)
            if site is None:
                raise ConfigError(
                    f"--hosts: {name!r} is not one of the config's sites ({', '.join(cfg.sites)}); "
                    "name each site, e.g. --hosts a:2,b:2"
                )
            name, label = cfg.sites[site].host or site, site
        else:
            label = name
        out.append(f"{name}:{slots}")
        names.append(label)
    if len(set(names)) != len(names):
        raise ConfigError(f"--hosts: {hosts} names a site twice; give each site once with its rank count")
    return ",".join(out), names


def _channels(path: str) -> int:
    """Image channels from a NIfTI header (4th dimension; 1 for a 3-D volume); no voxel is read."""
    import nibabel as nib

    shape = nib.load(path).header.get_data_shape()
    return int(shape[3]) if len(shape) > 3 else 1


def dataset_facts(info: DatasetInfo, n_train: int, n_val: int, train: TrainConfig) -> dict[str, Any]:
    """What a site tells the others about its dataset (header facts only: no voxel, no file name),
    and the settings its ranks decide early stopping by (each rank decides from the pooled scores)."""
    return {
        "task": info.task,
        "labels": {int(k): str(v) for k, v in info.labels.items()},
        "modality": {str(k): str(v) for k, v in info.modality.items()},
        "channels": _channels(info.training[0]["image"]) if info.training else None,
        "train_cases": n_train,
        "val_cases": n_val,
        "stopping": {
            "stop_at": train.stop_at,
            "min_epochs": train.min_epochs,
            "val_interval": train.val_interval,
        },
    }


def compare_facts(facts: dict[str, dict[str, Any]]) -> None:
    """Raise DataError naming the first site whose dataset differs from the first site's, and how."""
    sites = list(facts)
    ref = sites[0]
    for site in sites[1:]:
        for key in FACT_KEYS:
            mine, theirs = facts[site].get(key), facts[ref].get(key)
            if mine != theirs:
                raise DataError(
                    f"site {site}: its dataset's {key} {_show(mine)} differs from site {ref}'s {_show(theirs)}; "
                    "every site must hold the same task, labels, modalities and channels (nothing was trained)"
                )
    for site in sites[1:]:
        mine, theirs = facts[site].get("stopping"), facts[ref].get("stopping")
        if mine != theirs:
            raise ConfigError(
                f"site {site}: its train settings {_show(mine)} differ from site {ref}'s {_show(theirs)}; "
                "every rank decides early stopping from the same pooled scores, so every site's config "
                "must hold the same train.stop_at, min_epochs and val_interval (nothing was trained)"
            )
    for site, f in facts.items():
        if f.get("train_cases", 0) < 1:
            raise DataError(f"site {site}: its dataset has no training cases left after the validation split")


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return repr(value)


def site_share(
    rank_sites: list[str],
    site_cases: dict[str, int],
    periods: list[int],
    batch_size: int,
    rank: int,
    seed: int,
) -> tuple[list[int], int]:
    """Rank ``rank``'s own indices into its site's training cases, and how many it trains on per epoch.

    ``periods[r]`` is rank r's steps per round. See the module docstring for R; the site's cases are
    permuted once (seeded) and dealt to its ranks in turn, so the site's ranks together hold each of
    the site's cases exactly once.
    """
    counts: dict[int, int] = {}
    members: dict[str, list[int]] = {}
    for r, s in enumerate(rank_sites):
        members.setdefault(s, []).append(r)
    for s, ranks in members.items():
        n = site_cases[s]
        for i, r in enumerate(ranks):
            counts[r] = len(range(i, n, len(ranks)))
    if min(counts.values()) < 1:
        short = next(s for s, ranks in members.items() if any(counts[r] < 1 for r in ranks))
        raise ConfigError(
            f"site {short}: {site_cases[short]} training cases cannot give each of its "
            f"{len(members[short])} ranks one case; run fewer ranks there"
        )
    rounds = max(math.ceil(counts[r] / (batch_size * periods[r])) for r in counts)
    site = rank_sites[rank]
    order = np.random.RandomState(seed).permutation(site_cases[site])
    i = members[site].index(rank)
    mine = sorted(int(x) for x in order[i :: len(members[site])])
    return mine, rounds * periods[rank] * batch_size


def pool_metrics(per_site: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Case-weighted mean over sites of each numeric validation metric (``val_cases`` the weights).

    For Dice (a mean over cases) this is the mean over all sites' validation cases; for AUC it is
    the case-weighted mean of the sites' AUCs (no per-case score leaves a site).
    """
    keys = sorted({k for m in per_site.values() for k, v in m.items() if isinstance(v, float)})
    out: dict[str, Any] = {}
    for k in keys:
        pairs = [(m[k], m.get("val_cases", 1)) for m in per_site.values() if m.get(k) is not None]
        total = math.fsum(w for _, w in pairs)  # exact: every rank pools these and must agree
        out[k] = math.fsum(v * w for v, w in pairs) / total if total else None
    return out

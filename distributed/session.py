"""What the training loop asks of the distributed backend, whatever the synchronisation mode.

:class:`LocalSession` trains in one process and changes nothing. :class:`HorovodSession` runs
inside a rank started by horovodrun: it reports to the launcher over the network (heartbeats and
per-step records, :mod:`medseg.distributed.launch.heartbeat`), joins medseg's ``torch.distributed``
channel (:mod:`medseg.distributed.comm.channel`), measures each rank's speed on a batch made
beforehand, forms groups (by default one per host, i.e. per site), hands out each rank's own
cases, wraps the optimizer for the chosen mode, lets a test's emulation slow a rank down
(:mod:`medseg.distributed.emulation`), gathers the epoch's numbers on rank 0
(:mod:`medseg.distributed.epoch_numbers`) and keeps each rank's synchronisation state on its own
host (:mod:`medseg.distributed.sync_checkpoint`).

What a rank receives is a declared wire message (:mod:`medseg.distributed.comm.wire`), checked before
use (:mod:`medseg.distributed.comm.checks`); a diverged epoch stops before its checkpoint is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from medseg.config import Config
from medseg.distributed import channel_startup, emulation, sync_checkpoint
from medseg.distributed.background import InBackground
from medseg.distributed.comm import audit, auth
from medseg.distributed.comm.checks import (
    check_local_norm,
    check_site_entries,
    check_site_metrics,
    check_speeds,
    refuse_update,
)
from medseg.distributed.epoch_numbers import job_numbers, rank_numbers
from medseg.distributed.exchange_timing import time_round_exchange
from medseg.distributed.launch.heartbeat import BeatClient
from medseg.distributed.local_session import LocalSession
from medseg.distributed.sync.groups import (
    choose_groups,
    epoch_rounds,
    fit_wan_factor,
    groups_by_host,
    groups_without_speeds,
    parse_groups,
    profile_throughput,
    scale_periods,
    static_share,
    wan_round_factor,
)
from medseg.errors import ConfigError, RunError

log = logging.getLogger(__name__)

MAX_WAN_FACTOR = 64  # longest round, in multiples of the speed-ratio round
PROFILE_BLOCK_S = 0.4  # shortest timed block when measuring a rank's speed (several CPU-quota periods)


class HorovodSession(LocalSession):
    """A rank of a job started by :func:`medseg.distributed.launch.launcher.launch` (or a user's horovodrun)."""

    def __init__(self, cfg: Config) -> None:
        import horovod.torch as hvd

        if os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") and not hvd.gloo_built():
            # the launcher's horovodrun leaves this question to the ranks (medseg.distributed.launch.hvdrun)
            raise RunError(
                "this Python's Horovod was built without Gloo, which `medseg train --np` launches with; "
                "run `make setup` (it builds Horovod with HOROVOD_WITH_GLOO=1)"
            )
        rank = int(os.environ.get("HOROVOD_RANK", "0"))
        secret = auth.job_secret()  # the launcher's per-job secret (heartbeat MACs, the store's values)
        self.beats = BeatClient(rank, secret=secret)  # first, so the launcher hears from this rank at once
        self.beats.send({"ev": "started", "pid": os.getpid()})
        if cfg.sites:  # from here on, every message to another site (or the launcher) is logged
            audit.start(rank)
            if self.beats.sidecar_beat:  # the helper process repeats these bytes every few seconds
                audit.current().sent_report(self.beats.sidecar_beat)
        self.hvd, self.cfg, self.dist = hvd, cfg, cfg.dist
        # Horovod's stall inspector may warn; it must not shut the job down: the watchdog decides.
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(int(cfg.dist.timeout_s) // 2, 1)))
        os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "0"
        self.startup: dict[str, float] = {}  # seconds of each start-up phase
        assert secret is not None
        (self.channel, self.hosts, phases), self._horovod = channel_startup.start_rank(
            hvd,
            cfg.dist.sync,
            cfg.dist.timeout_s,
            secret,
            self.startup,
            lambda hosts: (
                groups_without_speeds(cfg.dist, hosts) if cfg.dist.sync in ("gssp", "ssp") else None
            ),
        )
        self.rank, self.size = self.channel.rank, self.channel.size
        self.is_chief = self.rank == 0
        self.startup.update(phases)
        self.rank_sites = self._sites(cfg)
        self.site = self.rank_sites[self.rank] if cfg.sites else None
        self.channel.name_ranks([f"site {s}" if cfg.sites else f"host {s}" for s in self.rank_sites])
        self.site_cases: dict[str, int] = {}
        if cfg.sites:
            log_ = audit.current()
            assert log_ is not None
            log_.open(cfg.run_dir / "audit" / f"{self.site}-rank{self.rank}.jsonl", self.rank_sites)
        # With site-local data each site's leader validates on its own held-out cases.
        self.validates = self.is_chief or (
            bool(cfg.sites) and self.rank == self.rank_sites.index(self.rank_sites[self.rank])
        )
        self.emulation = emulation.current()  # a no-op unless a test installed one
        self.groups: list[list[int]] = [list(range(self.size))]
        self.periods = [1]
        self.base_periods = [1]
        self.ratios = [1.0]  # each group's speed over the slowest's: rounds' lengths before rounding
        self.wan_factor = 1
        self.exchange_s: float | None = None
        self.setup_wan_bytes = 0
        self.probe_samples = 1
        self.group_index = 0
        self.speeds: list[float] = []
        self.compute_s = 0.0
        self.optimizer: Any = None
        self.epoch_tic = time.perf_counter()
        self.epoch_samples = 0
        self._numbers: dict[str, Any] = {}  # this rank's numbers of the epoch (end_epoch)
        self._step_tic = 0.0
        self._step_compute = 0.0

    def _startup_phase(self, name: str, tic: float) -> float:
        """Record the seconds since ``tic`` as start-up phase ``name``; the time now."""
        now = time.perf_counter()
        self.startup[name] = round(now - tic, 3)
        return now

    # -- sites ----------------------------------------------------------------------------------
    def _sites(self, cfg: Config) -> list[str]:
        """Every rank's site (:func:`~medseg.distributed.site_data.rank_sites`), or its host without sites."""
        from medseg.distributed.site_data import rank_sites

        return rank_sites(cfg, self.hosts) if cfg.sites else list(self.hosts)

    def data_dir(self, cfg: Config) -> str:
        return cfg.sites[self.site].dir if self.site is not None else cfg.data.dir

    def check_sites(self, facts: dict[str, Any]) -> None:
        """Compare the sites' dataset header facts over the channel; a mismatch stops every rank.

        A collective of its own, not profiling's barrier: ranks leave a gather at other moments
        than a barrier, which changes whether a site's ranks sharing one CPU quota are timed
        together, and with it the rounds (docs/benchmarks.md, "Profiling a site's ranks together")."""
        from medseg.distributed.site_data import agreed_site_cases

        if self.site is None:
            return
        tic = time.perf_counter()
        everyone = self.channel.gather_json(facts, "dataset-header", kind="dataset-header")
        self._startup_phase("dataset_agreed", tic)
        self.site_cases = agreed_site_cases(everyone, self.rank_sites, self.is_chief)

    # -- groups ---------------------------------------------------------------------------------
    def prepare(self, profile_step: Callable[[], int], model: torch.nn.Module | None = None) -> None:
        """Measure every rank's samples/s, form groups and their round lengths, build the channel's groups.

        With ``dist.hide_wan`` (gssp/ssp, periods measured, several groups, ``model`` given) the
        leaders also time one cross-group exchange of ``model``'s round payload and every round is
        lengthened by :meth:`_wan_factor`.

        Where the groups follow from what every rank already holds (one per host, or one per rank
        for ssp), their connections and the timed exchange run on a background thread while the
        ranks are profiled: the one waits on the WAN's round trips, the other on compute, and they
        use disjoint Gloo contexts (the groups' own; profiling uses the channel's world).
        """
        d = self.dist
        self.phase("profile")
        tic = time.perf_counter()
        profiles = d.sync in ("gssp", "ssp") and not d.periods
        early = groups_without_speeds(self.dist, self.hosts) if profiles else None
        connecting = None
        if early is not None:
            self.groups = early
            connecting = InBackground(self._connect_groups, self._hides_wan(model))
        if profiles:
            tic = self._profile(profile_step, tic)
        if early is None:
            self.groups = self._agreed_groups()
        if d.sync in ("gssp", "ssp", "local-sgd"):
            self._set_periods()
        self.group_index = next(i for i, g in enumerate(self.groups) if self.rank in g)
        tic = self._startup_phase("groups_agreed", tic)
        self.base_periods = list(self.periods)
        if connecting is not None:
            self.exchange_s = connecting.result()
            self._startup_phase("groups_joined", tic)
        else:
            self.exchange_s = self._connect_groups(self._hides_wan(model))
        if self.exchange_s is not None:
            self.wan_factor = self._wan_factor(self.exchange_s)
            self.periods = scale_periods(self.ratios, self.wan_factor)
        self.report({"ev": "startup", **self.startup})
        if self.is_chief:
            log.info(
                "sync %s: groups %s on hosts %s, rounds of %s steps, measured samples/s %s, "
                "cross-group exchange %s s",
                d.sync,
                self.groups,
                [sorted({self.hosts[r] for r in g}) for g in self.groups],
                self.periods,
                [round(v, 2) for v in self.speeds] or "not measured",
                round(self.exchange_s, 3) if self.exchange_s is not None else "not measured",
            )

    def _hides_wan(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        """``model`` when the leaders time a round's exchange to lengthen the rounds, else ``None``."""
        d = self.dist
        timed = d.sync in ("gssp", "ssp") and d.hide_wan and not d.periods and len(self.groups) > 1
        return model if timed else None

    def _profile(self, profile_step: Callable[[], int], tic: float) -> float:
        """Every rank's samples/s into ``self.speeds``: all ranks timed at once, after a barrier,
        under the same load as training itself; the median of several steps resists one-off stalls."""
        self.channel.barrier()
        tic = self._startup_phase("profile_barrier", tic)
        mine = self._time_steps(profile_step, self.dist.profile_steps)
        tic = self._startup_phase("profile_steps", tic)
        self.speeds = check_speeds(
            self.channel.gather_json(mine, "speed", kind="metrics"),
            [self.channel.describe(r) for r in range(self.size)],
            own=self.rank,
        )
        return self._startup_phase("profile_gather", tic)

    def _agreed_groups(self) -> list[list[int]]:
        """The groups when rank 0 decides them (explicit, by speed, or by host for local-sgd and
        fixed periods): every rank must agree, so rank 0's are the ones used. Other modes keep one
        group of every rank."""
        d = self.dist
        if d.sync not in ("gssp", "ssp", "local-sgd"):
            return self.groups
        groups = groups_without_speeds(self.dist, self.hosts)
        if groups is None:
            if d.groups:
                groups = parse_groups(d.groups, self.size)
            elif d.sync == "local-sgd":
                groups = groups_by_host(self.hosts)
            else:
                groups = choose_groups(self.speeds, k=d.num_groups or None)
        return self._checked_groups(self.channel.broadcast_json(groups, "groups"))

    def _set_periods(self) -> None:
        """Steps per round of each group: the config's, by measured speed, or one each."""
        d = self.dist
        if d.periods:
            if len(d.periods) != len(self.groups) or min(d.periods) < 1:
                raise ConfigError(
                    f"dist.periods: {d.periods} must give steps >= 1 for each of the {len(self.groups)} groups {self.groups}"
                )
            self.ratios = [float(p) for p in d.periods]
        elif self.speeds:
            self.ratios = self._speed_ratios(self.speeds)
        else:
            self.ratios = [1.0] * len(self.groups)
        self.periods = scale_periods(self.ratios, 1)

    def _connect_groups(self, timed_model: torch.nn.Module | None) -> float | None:
        """Build the channel's groups for ``self.groups``; with ``timed_model``, also time one round
        exchange (:func:`~medseg.distributed.exchange_timing.time_round_exchange`). Its phases are recorded under their own names."""
        tic = time.perf_counter()
        self.channel.set_groups(self.groups)
        tic = self._startup_phase("group_connections", tic)
        if timed_model is None:
            return None
        exchange_s, sent = time_round_exchange(self.channel, len(self.groups), self.dist, timed_model)
        self.setup_wan_bytes += sent  # reported with the first epoch, with the initial model broadcast
        self._startup_phase("exchange_timed", tic)
        return exchange_s

    def _checked_groups(self, groups: list[list[int]]) -> list[list[int]]:
        """Rank 0's groups, refused unless they partition the job's ranks."""
        every = sorted(r for g in groups for r in g)
        if every != list(range(self.size)):
            raise refuse_update(
                self.channel.describe(0), "groups", f"{groups} do not hold each of the {self.size} ranks once"
            )
        return groups

    def _wan_factor(self, exchange_s: float) -> int:
        """:func:`~medseg.distributed.sync.groups.wan_round_factor` for the measured speeds and exchange."""
        per_rank = [sum(self.speeds[r] for r in g) / len(g) for g in self.groups]
        return wan_round_factor(exchange_s, self.ratios, per_rank, self.probe_samples, MAX_WAN_FACTOR)

    def _speed_ratios(self, speeds: list[float]) -> list[float]:
        """Each group's mean per-rank speed over the slowest group's (its round's length in steps,
        before rounding: :func:`~medseg.distributed.sync.groups.scale_periods`)."""
        per_rank = [sum(speeds[r] for r in g) / len(g) for g in self.groups]
        ratios = [v / min(per_rank) for v in per_rank]
        return ratios if self.dist.balance_rounds else [float(max(1, round(r))) for r in ratios]

    def _time_steps(self, profile_step: Callable[[], int], blocks: int) -> float:
        """This rank's samples/s by :func:`~medseg.distributed.sync.groups.profile_throughput`.

        ``profile_step`` works on a batch made before timing starts, so loading is never timed.
        """

        def step() -> int:
            with self.compute():
                self.probe_samples = profile_step()
            return self.probe_samples

        speed = profile_throughput(step, warmup=2, blocks=blocks, min_block_s=PROFILE_BLOCK_S)
        self.compute_s = 0.0
        return speed

    def own_cases(self, n_items: int, batch_size: int, seed: int) -> tuple[list[int], int | None]:
        """This rank's cases (:func:`static_share`), after fitting the WAN factor to the epoch.

        The factor shrinks until an epoch holds ``dist.min_epoch_rounds`` rounds (or as many as
        rounds of the base periods give): the epoch's end waits for every round in flight, and
        with fewer rounds per epoch the groups drift apart for longer between exchanges. With
        site-local data (``sites:``) the rounds are the measured ones and the floor does not apply:
        :func:`~medseg.distributed.site_data.site_share` fits the epoch to each site's own cases.
        """
        if self.site is not None:
            from medseg.distributed.site_data import site_share

            period_of = {r: p for g, p in zip(self.groups, self.periods) for r in g}
            periods = [
                period_of.get(r, 1) if self.dist.sync in ("gssp", "ssp") else 1 for r in range(self.size)
            ]
            return site_share(self.rank_sites, self.site_cases, periods, batch_size, self.rank, seed)

        d = self.dist
        m = fit_wan_factor(self.wan_factor, n_items, self.groups, self.ratios, batch_size, d.min_epoch_rounds)
        need = min(d.min_epoch_rounds, epoch_rounds(n_items, self.groups, self.base_periods, batch_size))
        if m != self.wan_factor:
            if self.is_chief:
                log.warning(
                    "rounds of %s steps would leave fewer than %d rounds in an epoch of %d cases "
                    "(dist.min_epoch_rounds, or as many as its base rounds give): WAN factor %d lowered to %d",
                    scale_periods(self.ratios, self.wan_factor),
                    need,
                    n_items,
                    self.wan_factor,
                    m,
                )
            self.wan_factor = m
            self.periods = scale_periods(self.ratios, m)
        return static_share(n_items, self.groups, self.periods, batch_size, self.rank, seed)

    def share_state(self, state: Any) -> Any:
        """The chief's resume state (or a flag it decided) on every rank: tensors plus JSON
        (:data:`~medseg.distributed.comm.wire.TREES` ``shared-state``), never a pickle."""
        mine = state if self.is_chief else None
        kind = "parameters" if isinstance(mine, dict) else "control"
        return self.channel.broadcast_tree(mine, "shared-state", kind=kind)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
        from medseg.distributed.sync.bsp import BulkSynchronous
        from medseg.distributed.sync.common import one_initial_model
        from medseg.distributed.sync.gssp import GroupStale
        from medseg.distributed.sync.local_sgd import LocalSGD
        from medseg.distributed.sync.outer import OuterNesterov
        from medseg.distributed.sync.peers import DiLoCo, FedAvg
        from medseg.distributed.sync.rounds import site_lists

        d = self.dist
        if d.sync in ("gssp", "ssp") and d.compression == "fp16":
            raise ConfigError(
                "dist.compression: fp16 is Horovod's (bsp only); gssp/ssp rounds take none, fixed (dist.bits) or topk"
            )
        if one_initial_model(self.channel, model) and self.is_chief:
            # Gloo's broadcast sends the root's tensor to every other rank
            n = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
            self.setup_wan_bytes += n * 4 * sum(h != self.hosts[0] for h in self.hosts)
        self.model = model
        sites = site_lists(self.rank_sites)  # one per sites: entry, else per host
        if d.sync in ("bsp", "bsp-hier"):
            self._horovod.ended(None)
            self.optimizer = BulkSynchronous(
                optimizer,
                model,
                d.compression,
                d.bits,
                self.rank_sites,
                self.channel,
                hier=d.sync == "bsp-hier",
            )
        elif d.sync == "fedavg":
            self.optimizer = FedAvg(
                optimizer, model, self.channel, sites, d.local_epochs, d.local_steps, local_norm=d.local_norm
            )
        elif d.sync == "diloco":
            self.optimizer = DiLoCo(
                optimizer,
                model,
                self.channel,
                sites,
                d.inner_steps,
                d.outer_lr,
                d.outer_momentum,
                local_norm=d.local_norm,
            )
        elif d.sync == "local-sgd":
            self.optimizer = LocalSGD(optimizer, model, self.channel, d.period, local_norm=d.local_norm)
        else:
            self.optimizer = GroupStale(
                optimizer,
                model,
                self.channel,
                self.periods[self.group_index],
                d.staleness,
                d.dc_lambda,
                d.compression,
                d.bits,
                on_event=self.beats.send,
                local_norm=d.local_norm,
                weights=[len(g) * p for g, p in zip(self.groups, self.periods)],
                topk_fraction=d.topk_fraction,
                topk_bits=d.topk_bits,
                steps=list(self.periods),
                normalize_steps=d.normalize_steps,
                outer=OuterNesterov(d.outer_lr, d.outer_momentum) if d.outer == "nesterov" else None,
                reset_momentum=d.round_momentum == "reset",
            )
        self.optimizer.who = self.channel.describe(self.rank)
        return self.optimizer

    def gather_site_local(self, optimizer: Any) -> dict[str, Any] | None:
        """With ``dist.local_norm`` and sites: each site leader's normalisation tensors, on rank 0.

        Only these (a few kB per site) travel, for the bundle's per-site evaluation; every rank calls
        this. None elsewhere and on other ranks.
        """
        from medseg.distributed.comm.channel import gather_tree_to_root

        if not (self.dist.local_norm and self.site is not None):
            return None
        local = optimizer.sync_state().get("local") if self.channel.is_leader else None
        states, _ = gather_tree_to_root(
            self.channel.world, (self.site, local), "site-local", root=0, kind="optimizer-state"
        )
        if states is None:
            return None
        check_site_entries(states, self.rank_sites, self.channel.describe, "normalisation tensors")
        check_local_norm(states, optimizer.local, self.channel.describe)  # rank 0's own: the reference
        return {site: loc for site, loc in states if loc}

    def save_sync_state(self, optimizer: Any, run_dir: Path, epoch: int) -> dict[str, int] | None:
        """Write this rank's synchronisation state on its own host (:mod:`.sync_checkpoint`); return
        the marker the chief puts in its checkpoint, ``{"epoch": e, "ranks": n}``."""
        shard = sync_checkpoint.shard_name(self.rank, self.site, self.rank_sites)
        sync_checkpoint.save(optimizer.sync_state(), run_dir, epoch, self.rank, shard)
        return {"epoch": epoch, "ranks": self.size}

    def load_sync_state(self, optimizer: Any, run_dir: Path, marker: dict[str, int] | None) -> None:
        """Restore this rank's state of the checkpoint's epoch; without it, residuals restart (warned)."""
        if not marker:
            return
        shard = sync_checkpoint.shard_name(self.rank, self.site, self.rank_sites)
        state = sync_checkpoint.load(
            run_dir, shard, marker, self.rank, self.size, by_site=self.site is not None
        )
        if state is not None:
            optimizer.load_sync_state(state)

    # -- per step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        tic = time.perf_counter()
        with self.emulation.compute(self.rank):
            yield
        self._step_compute = time.perf_counter() - tic
        self.compute_s += self._step_compute

    def phase(self, what: str) -> None:
        self.beats.set_phase(what)
        self.emulation.enter_phase(what, self.rank)

    def report(self, record: dict[str, Any]) -> None:
        self.beats.send(record)

    def after_step(self, epoch: int, step: int, n_samples: int) -> None:
        self.emulation.after_step(self.rank, epoch, self.model)
        stats = self.optimizer.stats
        self.epoch_samples += n_samples
        self.beats.send(
            {
                "epoch": epoch,
                "step": step,
                "staleness": stats.last_staleness,
                "bytes": stats.bytes_sent,
                "wan_bytes": stats.wan_bytes,
                "compute_s": round(self._step_compute, 5),
                "site_s": round(stats.step_site_s, 5),
                "wan_s": round(stats.step_wan_s, 5),
                "inflight": stats.inflight,
                "group": self.group_index,
            }
        )

    def start_epoch(self, stop: bool = False, agreed: bool = False) -> bool:
        """Start the epoch's clocks; returns the early-stopping decision, the same on every rank.

        ``agreed``: every rank already holds the decision (``stop``, made by each from the pooled
        scores of :meth:`finish_epoch`, :attr:`scores_everywhere`), so no rank waits for another
        here: between sites a barrier costs WAN round trips every epoch (the first one too: no
        rank holds a stop then). Otherwise (rank 0 validating alone) every rank waits for rank 0
        (alive, in phase "wait") and its decision rides on the barrier (:meth:`~medseg.distributed.comm.channel.Channel.barrier_with`),
        so that the epoch clocks start together. Without it rank 0 writes its checkpoint while the
        others begin: a rank that needs rank 0 early in the epoch (its site's first step) counts that
        time as waiting in its epoch's numbers.
        """
        self.phase("wait")
        if not agreed:
            stop = bool(self.channel.barrier_with(int(stop), 0))
        self.phase("train")
        self.epoch_samples, self.epoch_tic, self.compute_s = 0, time.perf_counter(), 0.0
        return stop

    @property
    def scores_everywhere(self) -> bool:
        """With sites every rank receives every site's validation scores in :meth:`finish_epoch`;
        without them rank 0 alone validates."""
        return self.site is not None

    def end_epoch(self, optimizer: Any) -> dict[str, Any]:
        """Finish the epoch's synchronisation and note this rank's numbers (every rank calls this);
        they travel with the validation scores, in :meth:`finish_epoch`."""
        optimizer.end_epoch()
        self.check_diverged(optimizer, self.channel.describe(self.rank))
        stats = optimizer.stats
        wall = time.perf_counter() - self.epoch_tic
        self._numbers = rank_numbers(
            stats, self.epoch_samples, self.setup_wan_bytes, wall, self.emulation.slept_s, self.compute_s
        )
        stats.reset()
        self.setup_wan_bytes = 0  # set-up transfers are counted once, with the first epoch
        return {}

    def finish_epoch(
        self, metrics: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]] | None]:
        """The job's epoch numbers and each site's validation scores by site (on every rank).

        Every rank calls this after validation, with ``metrics`` its site's scores when validation
        was due at sites (``{}`` on a rank that does not validate) and None otherwise. Each rank's
        numbers and its site's scores travel in one message (``epoch-end``): between sites every
        collective costs WAN round trips, and this is the epoch's only one besides the rounds: every
        rank receives every site's scores, so each decides early stopping itself and the next
        :meth:`start_epoch` needs no barrier. The scores are None without sites or validation.
        """
        site = (
            (self.site, metrics) if metrics is not None and self.site is not None and self.validates else None
        )
        everyone = self.channel.gather_json(
            {"numbers": self._numbers, "site": site}, "epoch-end", kind="metrics"
        )
        numbers = job_numbers(
            [e["numbers"] for e in everyone], self.groups, self.periods, self.wan_factor, self.exchange_s
        )
        if metrics is None or self.site is None:
            return numbers, None
        entries = [e["site"] for e in everyone]
        check_site_entries(entries, self.rank_sites, self.channel.describe, "validation scores")
        for entry in filter(None, entries):
            check_site_metrics(entry[0], entry[1])
        return numbers, {s: m for s, m in filter(None, entries)}

    def close(self) -> None:
        self.beats.set_phase("done")  # the watchdog stops expecting beats from this rank
        self.beats.close()
        self.channel.close()
        try:
            if self._horovod.ended(self.dist.timeout_s):
                self.hvd.shutdown()
            else:
                log.warning("rank %d: hvd.init() had not ended; Horovod is left as it is", self.rank)
        except Exception as exc:  # a rank that trained on the channel alone: its run stands
            log.warning("rank %d: Horovod's init failed beside training (%s); not shut down", self.rank, exc)
        finally:
            audit.stop()


def open_session(cfg: Config) -> LocalSession:
    """The session for this process: Horovod's when started by the launcher, else a local one."""
    from medseg.distributed.launch.launcher import is_worker

    if cfg.dist.sync != "none" and is_worker():
        return HorovodSession(cfg)
    if cfg.sites:
        raise ConfigError(
            f"sites: a site-local job runs on several ranks, e.g. medseg train --config C --np N "
            f"--hosts {','.join(f'{s}:1' for s in cfg.sites)} (with dist.sync bsp, gssp, ssp or local-sgd)"
        )
    return LocalSession()

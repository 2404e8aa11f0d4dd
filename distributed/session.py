"""What the training loop asks of the distributed backend, whatever the synchronisation mode.

:class:`LocalSession` trains in one process and changes nothing. :class:`HorovodSession` runs
inside a rank started by horovodrun: it measures each rank's speed, forms groups, hands out each
rank's share of an epoch, wraps the optimizer for the chosen mode, slows a rank down when asked
(straggler simulation), writes a heartbeat line per step to ``<run>/ranks/rank-R.jsonl`` (which the
launcher watches) and gathers the epoch's numbers on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from medseg.config import Config
from medseg.distributed.groups import ShareSampler, choose_groups, parse_groups
from medseg.distributed.straggler import Straggler
from medseg.errors import ConfigError

log = logging.getLogger(__name__)


class LocalSession:
    """One process: the optimizer is used as it is and every sample is this rank's."""

    rank, size, is_chief = 0, 1, True

    def prepare(self, profile_step: Callable[[], int]) -> None:
        """Nothing to measure in one process."""

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module
    ) -> torch.optim.Optimizer:
        return optimizer

    def sampler(self, n_items: int, batch_size: int, seed: int) -> None:
        return None

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        yield

    def after_step(self, epoch: int, step: int, n_samples: int) -> None:
        """No heartbeat outside a launched job."""

    def beat(self, what: str) -> None:
        """No heartbeat outside a launched job."""

    def start_epoch(self) -> None:
        """Nothing to time in one process."""

    def end_epoch(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Nothing to shut down."""


class HorovodSession(LocalSession):
    """A rank of a job started by :func:`medseg.distributed.launcher.launch`."""

    def __init__(self, cfg: Config, straggler: str | None) -> None:
        import horovod.torch as hvd

        self.hvd, self.cfg, self.dist = hvd, cfg, cfg.dist
        timeout = str(int(cfg.dist.timeout_s))
        # Horovod's stall inspector: warn at half the timeout, shut the collectives down at the timeout.
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(int(cfg.dist.timeout_s) // 2, 1)))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", timeout)
        hvd.init(process_sets="dynamic")
        self.rank, self.size = hvd.rank(), hvd.size()
        self.is_chief = self.rank == 0
        self.straggler = Straggler.for_rank(straggler, self.rank)
        self.groups: list[list[int]] = [list(range(self.size))]
        self.periods = [1]
        self.group_index = 0
        self.group_set = hvd.global_process_set
        self.speeds: list[float] = []
        self.compute_s = 0.0
        ranks_dir = cfg.run_dir / "ranks"
        ranks_dir.mkdir(parents=True, exist_ok=True)
        self.beat_path = ranks_dir / f"rank-{self.rank}.jsonl"
        self._beat_file = open(self.beat_path, "a", buffering=1)  # noqa: SIM115 - kept open for the run
        (ranks_dir / f"rank-{self.rank}.pid").write_text(str(os.getpid()))
        self.optimizer: Any = None
        self.epoch_tic = time.perf_counter()
        self.epoch_samples = 0
        self.beat("started")

    # -- groups ---------------------------------------------------------------------------------
    def prepare(self, profile_step: Callable[[], int]) -> None:
        """Measure every rank's samples/s, form groups and their periods, register process sets."""
        hvd, d = self.hvd, self.dist
        if d.sync in ("gssp", "ssp"):
            # All ranks are timed at once, after a barrier, under the same load as training itself
            # (ranks sharing a machine slow each other down there too); the median of several steps
            # resists one-off stalls.
            hvd.barrier()
            mine = self._time_steps(profile_step, d.profile_steps)
            self.speeds = [float(v) for v in hvd.allgather_object(mine)]
            if d.sync == "ssp":
                self.groups = [[r] for r in range(self.size)]
            elif d.groups:
                self.groups = parse_groups(d.groups, self.size)
            else:
                self.groups = choose_groups(self.speeds, k=d.num_groups or None)
            # Every rank must agree on the groups: rank 0's decision is the one used.
            self.groups = hvd.broadcast_object(self.groups, root_rank=0, name="medseg.groups")
            self.periods = self._periods(self.speeds)
        self.group_index = next(i for i, g in enumerate(self.groups) if self.rank in g)
        for group in self.groups:  # every rank registers every set, in the same order
            ps = hvd.add_process_set(group) if 1 < len(group) < self.size else None
            if self.rank in group:
                self.group_set = (
                    ps if ps is not None else (hvd.global_process_set if len(group) == self.size else None)
                )
        if self.is_chief:
            log.info(
                "sync %s: groups %s, rounds of %s steps, measured samples/s %s",
                d.sync,
                self.groups,
                self.periods,
                [round(v, 2) for v in self.speeds] or "not measured",
            )

    def _periods(self, speeds: list[float]) -> list[int]:
        """Steps per round of each group: its mean per-rank speed over the slowest group's, rounded."""
        per_rank = [sum(speeds[r] for r in g) / len(g) for g in self.groups]
        return [max(1, round(v / min(per_rank))) for v in per_rank]

    def _time_steps(self, profile_step: Callable[[], int], steps: int) -> float:
        """Median samples/s of ``steps`` training steps after two warm-up steps."""
        for _ in range(2):  # first steps pay for allocation and lazy initialisation
            with self.compute():
                profile_step()
        rates = []
        for _ in range(steps):
            tic = time.perf_counter()
            with self.compute():
                n = profile_step()
            rates.append(n / (time.perf_counter() - tic))
        log.debug("rank %d profile rates %s", self.rank, [round(r, 2) for r in rates])
        return sorted(rates)[len(rates) // 2]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
        from medseg.distributed.sync import BulkSynchronous, GroupStale, LocalSGD

        hvd, d = self.hvd, self.dist
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if optimizer.state:  # a resumed run; a fresh optimizer is the same everywhere (and Horovod
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # would take a zero-gradient step)
        if d.sync == "bsp":
            self.optimizer = BulkSynchronous(optimizer, model, d.compression, d.bits)
        elif d.sync == "local-sgd":
            self.optimizer = LocalSGD(optimizer, model, d.period)
        else:
            self.optimizer = GroupStale(
                optimizer,
                model,
                self.groups,
                self.group_set,
                self.periods[self.group_index],
                d.staleness,
                d.dc_lambda,
                d.compression,
                d.bits,
            )
        return self.optimizer

    def sampler(self, n_items: int, batch_size: int, seed: int) -> ShareSampler:
        """This rank's items of each epoch: a share ∝ |g|·period_g, trimmed to whole rounds.

        Every group must submit the same number of rounds per epoch (the cross-group collectives
        are matched by round), so R = ⌊n / (b Σ_g |g| period_g)⌋ rounds and rank r of group g
        takes R·period_g·b items.
        """
        weights = [len(g) * p for g, p in zip(self.groups, self.periods)]
        rounds = n_items // (batch_size * sum(weights))
        if rounds < 1:
            raise ConfigError(
                f"data: {n_items} training cases cannot give every rank one batch of {batch_size} per round "
                f"(groups {self.groups}, periods {self.periods}); lower train.batch_size or use more data"
            )
        take = rounds * self.periods[self.group_index] * batch_size
        return ShareSampler(
            n_items, self.groups, [w / sum(weights) for w in weights], self.rank, seed=seed, limit=take
        )

    # -- per step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        tic = time.perf_counter()
        with self.straggler:
            yield
        self.compute_s += time.perf_counter() - tic

    def beat(self, what: str) -> None:
        self._beat_file.write(json.dumps({"t": round(time.time(), 3), "event": what}) + "\n")

    def after_step(self, epoch: int, step: int, n_samples: int) -> None:
        stats = self.optimizer.stats
        self.epoch_samples += n_samples
        record = {
            "t": round(time.time(), 3),
            "epoch": epoch,
            "step": step,
            "staleness": stats.last_staleness,
            "bytes": stats.bytes_sent,
        }
        self._beat_file.write(json.dumps(record) + "\n")

    def start_epoch(self) -> None:
        # Rank 0 validates between epochs while the others would run on and block in their first
        # collective: start every rank's epoch clock together, so epoch times measure training.
        self.hvd.barrier()
        self.epoch_samples, self.epoch_tic, self.compute_s = 0, time.perf_counter(), 0.0

    def end_epoch(self, optimizer: Any) -> dict[str, Any]:
        """Finish the epoch's synchronisation and gather its numbers (every rank calls this)."""
        optimizer.end_epoch()
        stats = optimizer.stats
        wall = time.perf_counter() - self.epoch_tic
        mine = {
            "samples": self.epoch_samples,
            "steps": stats.steps,
            "bytes": stats.bytes_sent,
            "wait_s": stats.wait_s,
            "max_staleness": max(stats.staleness, default=0),
            "wall_s": wall,
            "slept_s": self.straggler.slept_s,
            "compute_s": self.compute_s,
        }
        everyone = self.hvd.allgather_object(mine)
        stats.reset()
        slowest = max(r["wall_s"] for r in everyone)
        return {
            "dist_samples_per_s": sum(r["samples"] for r in everyone) / slowest,
            "dist_epoch_s": slowest,
            "dist_bytes_per_step": sum(r["bytes"] / max(r["steps"], 1) for r in everyone) / len(everyone),
            "dist_max_staleness": max(r["max_staleness"] for r in everyone),
            "dist_wait_s": max(r["wait_s"] for r in everyone),
            "dist_groups": self.groups,
            "dist_periods": self.periods,
            # samples/s of each rank over its own compute (forward, backward, straggler sleep)
            "dist_rank_speeds": [
                round(r["samples"] / r["compute_s"], 3) if r["compute_s"] else None for r in everyone
            ],
        }

    def close(self) -> None:
        self.beat("finished")
        self._beat_file.close()
        self.hvd.shutdown()


def open_session(cfg: Config, straggler: str | None = None) -> LocalSession:
    """The session for this process: Horovod's when started by the launcher, else a local one."""
    from medseg.distributed.launcher import is_worker

    if cfg.dist.sync != "none" and is_worker():
        return HorovodSession(cfg, straggler)
    if straggler:
        raise ConfigError("--straggler: only meaningful with --np N (several ranks)")
    return LocalSession()


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of a rank's random draws in an epoch (distinct per rank, repeatable per run)."""
    return (seed * 100_003 + epoch * 1_009 + rank) % (2**31) if rank else (seed * 100_003 + epoch) % (2**31)

"""Datasets and loaders for training: the Decathlon datalist, split, cached by MONAI.

Deterministic transforms are cached once (in memory with ``CacheDataset`` or on disk with
``PersistentDataset``, which keeps the affine only with ``track_meta=True``); random transforms run anew each epoch. Each epoch's random draws (shuffling,
patch positions, augmentation) are seeded from ``(seed, epoch)``, so an epoch is a function of the
weights it starts from and a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from monai import transforms as mt
from monai.data import CacheDataset, DataLoader, Dataset, PersistentDataset
from monai.data.utils import json_hashing
from torch.utils.data import RandomSampler

from medseg.checkpoint import allow_cache_globals
from medseg.config import Config
from medseg.datasets import checks
from medseg.datasets.decathlon import DatasetInfo, load_dataset, split_train_val
from medseg.distributed import LocalSession, epoch_seed
from medseg.errors import ConfigError, DataError
from medseg.training import transforms as tf

log = logging.getLogger(__name__)


@dataclass
class TrainData:
    info: DatasetInfo
    train_items: list[dict]
    val_items: list[dict]
    train_chain: mt.Compose
    train_loader: DataLoader
    val_loader: DataLoader | None
    cache_mb: float = 0.0  # resident memory the training cases added (their cache)


def _dataset(cfg: Config, items: list[dict], chain: mt.Compose, tag: str) -> Dataset:
    if cfg.data.cache == "memory":
        return CacheDataset(
            items, chain, cache_rate=1.0, num_workers=max(cfg.data.num_workers, 1), progress=False
        )
    if cfg.data.cache == "disk":
        cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else cfg.run_dir / "cache"
        # track_meta keeps the affine in the cached MetaTensors (read weights-only, with the numpy
        # header fields allowed); hashing the transforms makes a changed spacing or window miss the old cache.
        allow_cache_globals()
        return PersistentDataset(
            items,
            chain,
            cache_dir=cache_dir / tag,
            track_meta=True,
            weights_only=True,
            hash_transform=json_hashing,
        )
    return Dataset(items, chain)


def _build(cfg: Config, items: list[dict], chain: mt.Compose, tag: str, root: Path) -> Dataset:
    """Build (and, when cached, load) a dataset; a case that fails to load is a DataError."""
    missing = [
        it[k]
        for it in items
        for k in ("image", "label")
        if isinstance(it.get(k), str) and not Path(it[k]).exists()
    ]
    if missing:
        raise DataError(
            f"{missing[0]}: file not found ({len(missing)} missing in all); run `medseg data validate {root}`"
        )
    try:
        ds = _dataset(cfg, items, chain, tag)
        if cfg.data.cache == "disk":
            for i in range(len(ds)):  # fills the disk cache now, so load errors surface before training
                ds._cachecheck(items[i])
        return ds
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - MONAI wraps loader errors in RuntimeError
        root_exc: BaseException = exc
        while root_exc.__cause__ is not None:
            root_exc = root_exc.__cause__
        first_line = (str(root_exc).splitlines() or [""])[0]
        raise DataError(
            f"{root}: a {tag} case could not be loaded ({type(root_exc).__name__}: {first_line}); "
            f"run `medseg data validate {root}` to find it"
        ) from exc


def _rss_mb() -> float:
    """This process's resident memory in MB (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def path_digest(path: Path) -> str:
    """A folder named without its path (what a rank reports to the launcher unless
    ``data.share_paths``): the first 16 hex digits of BLAKE2b over the resolved path."""
    return "blake2b:" + hashlib.blake2b(str(Path(path).resolve()).encode(), digest_size=8).hexdigest()


def read_dataset(
    cfg: Config, data_dir: str | None = None, check_cases: bool = True
) -> tuple[DatasetInfo, list[dict], list[dict]]:
    """Read the dataset in ``data_dir`` (default ``cfg.data.dir``; headers only) and split it: info,
    train, validation. With site-local data each site splits its own cases the same way.

    ``check_cases=False`` leaves the case files unchecked but the first case's (the labels and
    duplicates are still checked): a rank of a multi-rank job checks the cases it loads, in
    :func:`make_train_data`.
    """
    info = load_dataset(data_dir or cfg.data.dir)
    if info.task != cfg.task:
        raise ConfigError(f"task: config says {cfg.task!r} but {info.json_path} holds a {info.task} dataset")
    if len(info.training) < 2:
        raise DataError(f"{info.json_path}: needs at least 2 training cases, found {len(info.training)}")
    # without case checks, the first case still is: its header gives the dataset's facts (sitedata)
    _check(info, None if check_cases else info.training[:1])
    train_items, val_items = split_train_val(info.training, cfg.data.val_fraction, cfg.train.seed)
    return info, train_items, val_items


def _check(info: DatasetInfo, cases: list[dict] | None) -> None:
    """The checks `medseg data validate` makes (label values read, images' headers only), on the
    files of ``cases`` (None: every case)."""
    checks.check_training_items(
        info.training,
        info.labels,
        info.task,
        str(info.json_path),
        f"run `medseg data validate {info.root}`",
        cases=cases,
    )


def _chains(cfg: Config) -> tuple[mt.Compose, mt.Compose]:
    """The task's training and validation transform chains."""
    if cfg.task == "segmentation":
        return tf.seg_train(cfg), tf.seg_val(cfg)
    return tf.cls_train(cfg), tf.cls_val(cfg)


def fill_disk_cache(cfg: Config) -> None:
    """Load every case of ``cfg``'s split into its disk cache (``data.cache: disk``), training and
    validation chains both, in this process; jobs started afterwards only read the cache."""
    if cfg.data.cache != "disk":
        raise ConfigError(f"fill_disk_cache needs data.cache: disk, not {cfg.data.cache!r}")
    info, train_items, val_items = read_dataset(cfg)
    train_chain, val_chain = _chains(cfg)
    _build(cfg, train_items, train_chain, "train", info.root)
    _build(cfg, val_items, val_chain, "val", info.root)


def make_train_data(
    cfg: Config,
    session: LocalSession | None = None,
    split: tuple[DatasetInfo, list[dict], list[dict]] | None = None,
    check_cases: bool = False,
) -> TrainData:
    """Build cached datasets and loaders over this rank's own cases (all of them in one process).

    In a multi-rank job each rank caches only the cases :meth:`own_cases` gives it, and trains on a
    fresh draw of ``per_epoch`` of them every epoch; validation cases are loaded by the chief alone
    (with site-local data, by each site's leader: that site's held-out cases).
    """
    session = session or LocalSession()
    info, train_items, val_items = split or read_dataset(cfg)
    own, per_epoch = session.own_cases(len(train_items), cfg.train.batch_size, cfg.train.seed)
    mine = [train_items[i] for i in own]
    val_items = val_items if session.validates else []
    if check_cases:  # ``split`` was read without them: every case is loaded, so checked, by one rank
        _check(info, mine + val_items)
    train_chain, val_chain = _chains(cfg)
    log.info(
        "%s: %d training cases (%d of them this rank's), %d validation cases",
        info.name,
        len(train_items),
        len(mine),
        len(val_items),
    )
    before = _rss_mb()
    train_ds = _build(cfg, mine, train_chain, "train", info.root)
    cache_mb = _rss_mb() - before
    log.info("training cases loaded: resident memory grew by %.0f MB for %d cases", cache_mb, len(mine))
    val_ds = _build(cfg, val_items, val_chain, "val", info.root) if val_items else None
    # One generator drives the draw of each epoch (reseeded by seed_epoch): all cases shuffled in
    # one process, a fresh draw of per_epoch of this rank's own cases in a multi-rank job.
    gen = torch.Generator()
    sampler = RandomSampler(train_ds, num_samples=per_epoch, generator=gen)
    train_loader = DataLoader(
        train_ds,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        num_workers=cfg.data.num_workers,
        generator=gen,
    )
    val_loader = (
        DataLoader(val_ds, batch_size=1, num_workers=cfg.data.num_workers) if val_ds is not None else None
    )
    return TrainData(info, mine, val_items, train_chain, train_loader, val_loader, cache_mb)


def seed_epoch(data: TrainData, seed: int, epoch: int, rank: int = 0) -> None:
    """Seed every random draw of ``epoch``: torch (dropout), the shuffle or share, MONAI's random transforms."""
    draws = epoch_seed(seed, epoch, rank)
    torch.manual_seed(draws)
    data.train_loader.generator.manual_seed(draws)
    data.train_chain.set_random_state(seed=draws)

"""The setting of ``medseg bench sites``: emulated sites, WAN scenarios, synchronisation configs, and
the training job every config runs.

Every config trains the same UNet on the same synthetic data (:data:`TRAIN_CASES` cases, a fifth
held out for validation) with the same optimiser, seed and epochs; only ``dist`` differs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from medseg.config import config_from_dict

SITES, CPU = "a:2,b:2", "a=0.5,b=0.25"
SCENARIOS = {"lan": "none", "wan100": "100mbit:10ms", "wan20": "20mbit:25ms", "wan20-secure": "20mbit:25ms"}
# A secure scenario runs its plain twin's WAN with the site link up (a WireGuard tunnel between the
# sites, every job socket bound to it): ``--secure`` adds it, and its figures are read against the twin's.
SECURE_TWIN = {"wan20-secure": "wan20"}
SECURE_TIME_LIMIT = 1.05  # time to Dice over the site link at most this times the same run in clear
CONFIGS: dict[str, dict[str, Any]] = {
    "bsp-none": {"sync": "bsp"},
    "bsp-fp16": {"sync": "bsp", "compression": "fp16"},
    "bsp-fixed4": {"sync": "bsp", "compression": "fixed", "bits": 4},
    "local-sgd": {"sync": "local-sgd", "period": 4},
    "gssp": {"sync": "gssp", "staleness": 2},
    "gssp-fixed4": {"sync": "gssp", "staleness": 2, "compression": "fixed", "bits": 4},
    "gssp-topk1": {"sync": "gssp", "staleness": 2, "compression": "topk", "topk_fraction": 0.01},
    # the peers a reviewer names (medseg.distributed.sync.peers): hierarchical bsp, FedAvg, DiLoCo
    "bsp-hier": {"sync": "bsp-hier"},
    "fedavg": {"sync": "fedavg", "local_epochs": 1},
    "diloco": {"sync": "diloco", "inner_steps": 500, "outer_lr": 0.7, "outer_momentum": 0.9},
}
QUICK_SCENARIOS = ("wan20", "lan")
QUICK_CONFIGS = ("bsp-none", "bsp-fixed4", "gssp", "gssp-fixed4")
DICE_TARGET = 0.8  # held-out Dice every config must reach (full run)
# The quick run's level: one that one seed reaches within the quick run's epochs, so that its time
# to Dice is measured for every config; a config that has not reached it after the equal epochs
# goes on (MAX_EPOCHS_FACTOR). The full run, with its seeds, carries DICE_TARGET.
QUICK_DICE_TARGET = 0.65
EPOCHS, QUICK_EPOCHS = 8, 4
MAX_EPOCHS_FACTOR = 2  # a config that has not reached the target after the equal epochs may go on this far
MODEL = {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1}
LR = 0.01
TRAIN_CASES = 160  # 128 for training (32 steps per bsp epoch at 4 ranks x batch 1), 32 held out


def job_config(
    name: str, dist: dict[str, Any], data_dir: Path, runs_dir: Path, epochs: int, seed: int, target: float
) -> dict:
    """One config of the benchmark: the same task, model and optimiser for every synchronisation mode.

    Every config trains at least ``epochs`` (the equal-epochs comparison) and stops once it has also
    reached the Dice ``target``, or after ``MAX_EPOCHS_FACTOR`` x ``epochs``.
    """
    return {
        "name": name,
        "task": "segmentation",
        "runs_dir": str(runs_dir),
        # one disk cache of the deterministic transforms for every job (filled by :func:`fill_cache`
        # before the first launch): launch start-up is not what the benchmark compares
        "data": {
            "dir": str(data_dir),
            "val_fraction": 0.2,
            "cache": "disk",
            "cache_dir": str(data_dir.parent / "cache"),
        },
        "transforms": {
            "spacing": [1.6, 1.6, 2.4],
            "window": [-150, 250],
            "patch": [16, 16, 16],
            "num_samples": 2,
        },
        "model": dict(MODEL),
        "train": {
            "epochs": MAX_EPOCHS_FACTOR * epochs,
            "min_epochs": epochs,
            "stop_at": target,
            "batch_size": 1,
            "lr": LR,
            "seed": seed,
            "threads": 1,
            "scheduler": "none",
        },
        "dist": {"timeout_s": 180, "profile_steps": 5, **dist},
    }


def fill_cache(data_dir: Path, seeds: int) -> float:
    """Fill the jobs' shared disk cache (every seed's training and validation split) in this
    process, at full speed, before the first launch; returns the seconds it took.

    Without it every rank of every job loads and resamples its own cases at its site's CPU quota.
    Most of a job's start-up is elsewhere (site b's ranks import torch and MONAI at 0.25 core and
    start well after site a's), so this saves seconds, not the start-up.
    """
    from medseg.training.data import fill_disk_cache

    t = time.perf_counter()
    for seed in range(seeds):
        fill_disk_cache(
            config_from_dict(job_config("cache", {"sync": "bsp"}, data_dir, data_dir.parent, 1, seed, 0.0))
        )
    return time.perf_counter() - t

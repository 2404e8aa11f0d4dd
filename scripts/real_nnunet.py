"""nnU-Net v2's side of the real-MR benchmark: its own virtual environment, its own recipe.

nnU-Net is never a dependency of medseg: ``make nnunet-deps`` installs it into ``.venv-nnunet`` and
this module only runs its command-line programs as subprocesses. Steps, each timed in CPU seconds
of the subprocess tree (``RUSAGE_CHILDREN`` deltas, user + system):

1. raw dataset: ``imagesTr/<case>_0000.nii.gz`` and ``labelsTr/<case>.nii.gz`` links for the
   training folder's cases, ``imagesTs`` links for the held-out cases, nnU-Net v2's ``dataset.json``;
2. ``nnUNetv2_plan_and_preprocess -c 3d_fullres`` (its fingerprint, plan and preprocessing);
3. ``splits_final.json`` with one fold: the same train / validation cases medseg uses;
4. ``nnUNetv2_train ... -tr <trainer> -device cpu`` (a shipped fixed-length trainer; it ends with
   its own validation on the fold's validation cases);
5. ``nnUNetv2_predict`` on the held-out images with its defaults (``checkpoint_final.pth``,
   test-time mirroring), ``-device cpu``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path

from real_split import Split, link

DATASET_ID = 4
DATASET_NAME = f"Dataset{DATASET_ID:03d}_Hippocampus"


def cpu_of(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Run ``cmd`` to the end; the CPU seconds (user + system) of it and every process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {done.returncode}; see {log}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def environment(work: Path) -> dict[str, str]:
    """nnU-Net's three folders under ``work``; its data-augmentation workers capped to the 2 cores."""
    env = dict(os.environ)
    for key in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        (work / key).mkdir(parents=True, exist_ok=True)
        env[key] = str(work / key)
    env.setdefault("nnUNet_n_proc_DA", "2")
    return env


def write_raw(
    source_info: dict[str, dict[str, str]], split: Split, labels: dict[int, str], work: Path
) -> Path:
    """nnU-Net v2's raw layout of the split: training cases in ``imagesTr``, held-out in ``imagesTs``."""
    raw = work / "nnUNet_raw" / DATASET_NAME
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (raw / sub).mkdir(parents=True, exist_ok=True)
    for cid in split.train + split.val:
        link(raw / "imagesTr" / f"{cid}_0000.nii.gz", source_info[cid]["image"])
        link(raw / "labelsTr" / f"{cid}.nii.gz", source_info[cid]["label"])
    for cid in split.held_out:
        link(raw / "imagesTs" / f"{cid}_0000.nii.gz", source_info[cid]["image"])
    meta = {
        "channel_names": {"0": "MRI"},
        "labels": {name: value for value, name in sorted(labels.items())},
        "numTraining": len(split.train) + len(split.val),
        "file_ending": ".nii.gz",
    }
    (raw / "dataset.json").write_text(json.dumps(meta, indent=1))
    return raw


def write_splits(split: Split, work: Path) -> None:
    """One fold, the same training / validation cases as medseg's run of this seed."""
    folder = work / "nnUNet_preprocessed" / DATASET_NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "splits_final.json").write_text(
        json.dumps([{"train": split.train, "val": split.val}], indent=1)
    )


def plan_and_preprocess(bin_dir: Path, env: dict[str, str], log: Path) -> float:
    cmd = [
        str(bin_dir / "nnUNetv2_plan_and_preprocess"),
        "-d",
        str(DATASET_ID),
        "-c",
        "3d_fullres",
        "-np",
        "2",
    ]
    return cpu_of(cmd, env, log)


def train(bin_dir: Path, env: dict[str, str], trainer: str, log: Path) -> float:
    cmd = [
        str(bin_dir / "nnUNetv2_train"),
        str(DATASET_ID),
        "3d_fullres",
        "0",
        "-tr",
        trainer,
        "-device",
        "cpu",
    ]
    return cpu_of(cmd, env, log)


def predict(bin_dir: Path, env: dict[str, str], trainer: str, work: Path, log: Path) -> tuple[Path, float]:
    out = work / f"pred-{trainer}"
    cmd = [
        str(bin_dir / "nnUNetv2_predict"),
        "-i", str(work / "nnUNet_raw" / DATASET_NAME / "imagesTs"),
        "-o", str(out),
        "-d", str(DATASET_ID), "-c", "3d_fullres", "-f", "0", "-tr", trainer,
        "-device", "cpu", "-npp", "1", "-nps", "1",
    ]  # fmt: skip
    return out, cpu_of(cmd, env, log)


def clear_results(work: Path, trainer: str) -> None:
    """A trainer's earlier result folder (so a new seed trains from scratch, not from its checkpoint)."""
    folder = work / "nnUNet_results" / DATASET_NAME / f"{trainer}__nnUNetPlans__3d_fullres"
    subprocess.run(["rm", "-rf", str(folder)], check=True)

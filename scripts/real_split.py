"""The fixed split of the real-MR benchmark (``scripts/bench_real.py``), as dataset folders.

Of a Decathlon-layout folder's labelled cases (sorted by image file name), a seeded shuffle
(``random.Random(0)``) holds out ``held_out`` cases (40 of Task04_Hippocampus's 200) that no system
trains or selects on. The rest form the training folder; inside it each system keeps
``val_fraction`` of the cases for its own monitoring, the same cases for both systems
(``medseg.datasets.decathlon.split_train_val`` with the run's seed; nnU-Net gets them as fold 0 of
its ``splits_final.json``). Folders hold symbolic links to the source files, never copies.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from medseg.datasets.decathlon import load_dataset, split_train_val


@dataclass
class Split:
    """Case ids (image file names without ``.nii.gz``) of each part."""

    train: list[str]  # trained on
    val: list[str]  # inside the training folder: each system's own monitoring / selection
    held_out: list[str]  # scored on, never trained or selected on


def case_id(path: str | Path) -> str:
    return Path(path).name.removesuffix(".nii.gz")


def make_split(source: Path, held_out: int, seed: int, val_fraction: float = 0.2) -> Split:
    """The held-out cases from a fixed shuffle (seed 0), the validation cases from the run's seed."""
    cases = sorted(load_dataset(source).training, key=lambda c: case_id(c["image"]))
    order = list(range(len(cases)))
    random.Random(0).shuffle(order)
    kept = sorted(order[held_out:])
    held = sorted(order[:held_out])
    train_items = [cases[i] for i in kept]
    trained, val = split_train_val(train_items, val_fraction, seed)
    return Split(
        train=[case_id(c["image"]) for c in trained],
        val=[case_id(c["image"]) for c in val],
        held_out=[case_id(cases[i]["image"]) for i in held],
    )


def link(path: Path, target: str | Path) -> None:
    """``path`` as a symbolic link to ``target`` (resolved), unless it exists already."""
    if not path.exists():
        path.symlink_to(Path(target).resolve())


def link_folder(source: Path, out: Path, ids: list[str]) -> Path:
    """A Decathlon-layout folder at ``out`` whose cases are links to ``source``'s files ``ids``."""
    info = load_dataset(source)
    by_id = {case_id(c["image"]): c for c in info.training}
    for sub in ("imagesTr", "labelsTr"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    training = []
    for cid in ids:
        for key, sub in (("image", "imagesTr"), ("label", "labelsTr")):
            link(out / sub / f"{cid}.nii.gz", by_id[cid][key])
        training.append({"image": f"./imagesTr/{cid}.nii.gz", "label": f"./labelsTr/{cid}.nii.gz"})
    raw = json.loads((source / "dataset.json").read_text())
    raw.update(training=training, numTraining=len(training), test=[], numTest=0)
    (out / "dataset.json").write_text(json.dumps(raw, indent=1))
    return out

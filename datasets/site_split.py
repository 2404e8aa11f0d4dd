"""Unlike hospitals from one labelled dataset: ``medseg data split-sites``.

A dataset in the Decathlon layout (e.g. the Medical Segmentation Decathlon's Task04_Hippocampus) is
dealt to named sites with unequal case counts. Each site gets two folders, each with its own
``dataset.json`` naming the original files (nothing is copied):

- ``<out>/<site>/``: the cases it trains on (and selects its checkpoint on);
- ``<out>/<site>-test/``: labelled cases held out at that site, never trained or selected on.

Unlike scanners: the cases stored with a given voxel type (``--stored-as uint8=c``: Task04 holds 157
float32 and 43 uint8 images, as two tools' exports would) all go to the named site, first; the rest
of every site is drawn at random (``seed``) from the other cases. The split is written to
``<out>/split.json`` and is the same for the same dataset, counts and seed.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import nibabel as nib

from medseg.datasets.decathlon import DatasetInfo, load_dataset
from medseg.errors import ConfigError, DataError


def parse_counts(text: str) -> dict[str, int]:
    """``a=90,b=60,c=50`` -> ``{"a": 90, "b": 60, "c": 50}`` (cases per site, held-out ones included)."""
    counts: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, n = item.partition("=")
        if not name.isidentifier() or not n.isdigit() or int(n) < 1 or name in counts:
            raise ConfigError(
                f"--sites: {item!r} is not SITE=CASES with a new site name (e.g. a=90,b=60,c=50)"
            )
        counts[name] = int(n)
    if len(counts) < 2:
        raise ConfigError("--sites: name two sites or more, e.g. a=90,b=60,c=50")
    return counts


def stored_dtype(path: str) -> str:
    """The voxel type an image is stored with, from its header (``float32``, ``uint8``, ...)."""
    try:
        return str(nib.load(path).get_data_dtype())
    except Exception as exc:  # nibabel raises many kinds on a damaged header
        raise DataError(f"{path}: cannot read its header ({type(exc).__name__}: {exc})") from None


def deal_cases(
    info: DatasetInfo, counts: dict[str, int], stored_as: tuple[str, str] | None, seed: int
) -> dict[str, list[dict[str, str]]]:
    """Each site's cases: those stored as ``stored_as[0]`` to site ``stored_as[1]`` first, the rest at
    random (``seed``); every case at most once."""
    cases = list(info.training)
    if sum(counts.values()) > len(cases):
        raise ConfigError(f"--sites asks for {sum(counts.values())} cases; {info.root} has {len(cases)}")
    rng = random.Random(seed)
    dealt: dict[str, list[dict[str, str]]] = {s: [] for s in counts}
    if stored_as is not None:
        dtype, site = stored_as
        if site not in counts:
            raise ConfigError(
                f"--stored-as {dtype}={site}: {site!r} is not one of the sites {', '.join(counts)}"
            )
        marked = [c for c in cases if stored_dtype(c["image"]) == dtype]
        if not marked:
            raise ConfigError(f"--stored-as {dtype}={site}: no image of {info.root} is stored as {dtype}")
        if len(marked) > counts[site]:
            raise ConfigError(
                f"--stored-as {dtype}={site}: {len(marked)} images are stored as {dtype}, "
                f"more than site {site}'s {counts[site]} cases"
            )
        dealt[site] = marked
        cases = [c for c in cases if c not in marked]
    rng.shuffle(cases)
    for site, n in counts.items():
        need = n - len(dealt[site])
        dealt[site] += cases[:need]
        cases = cases[need:]
    return dealt


def _write_folder(folder: Path, info: DatasetInfo, cases: list[dict[str, str]], role: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "name": f"{info.name} ({role})",
        "description": f"{role} of {info.name}; the files are the originals, named by absolute path",
        "task": info.task,
        "modality": info.modality,
        "labels": {str(k): v for k, v in info.labels.items()},
        "numTraining": len(cases),
        "training": [
            {"image": os.path.abspath(c["image"]), "label": os.path.abspath(c["label"])} for c in cases
        ],
        "test": [],
    }
    (folder / "dataset.json").write_text(json.dumps(meta, indent=1) + "\n")


def split_sites(
    data: Path,
    out: Path,
    counts: dict[str, int],
    test: int,
    stored_as: tuple[str, str] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Path]]:
    """Write every site's training and held-out folders (module docstring); returns their paths."""
    info = load_dataset(data)
    if info.task != "segmentation":
        raise ConfigError(f"split-sites: {data} is a {info.task} dataset; it splits segmentation datasets")
    if not 1 <= test < min(counts.values()):
        raise ConfigError(
            f"--test {test}: each site needs at least one training case beside its held-out ones"
        )
    dealt = deal_cases(info, counts, stored_as, seed)
    made: dict[str, dict[str, Path]] = {}
    record: dict[str, dict[str, list[str]]] = {}
    for site, cases in dealt.items():
        order = random.Random(f"{seed}:{site}").sample(cases, len(cases))
        held, train = order[:test], order[test:]
        made[site] = {"train": out / site, "test": out / f"{site}-test"}
        _write_folder(made[site]["train"], info, train, f"site {site}, training")
        _write_folder(made[site]["test"], info, held, f"site {site}, held out")
        record[site] = {
            "train": [Path(c["image"]).name for c in train],
            "test": [Path(c["image"]).name for c in held],
        }
    split = {
        "data": str(Path(data).resolve()),
        "seed": seed,
        "stored_as": list(stored_as or []),
        "sites": record,
    }
    (out / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    return made

"""nnU-Net v2 raw datasets, read as they are.

An nnU-Net v2 raw dataset folder holds ``dataset.json`` with ``channel_names`` (``{"0": "T1"}``),
``labels`` as name -> value (``{"background": 0, "Anterior": 1}``), ``numTraining`` and
``file_ending`` (``".nii.gz"``), and no ``training`` list. The cases are found by file name: images
``imagesTr/<case>_<XXXX><file_ending>`` (one file per channel, XXXX the 4-digit channel index),
labels ``labelsTr/<case><file_ending>``, optional test images in ``imagesTs/``. ``dataset.json`` may
instead list the cases in a ``dataset`` mapping ``{case: {"images": [...], "label": ...}}``.

:func:`read_nnunet_raw` turns such a folder into the fields of the Decathlon reader's ``DatasetInfo``
(``medseg.datasets.decathlon`` builds it; this module does not import that one). medseg refuses what
it cannot train as nnU-Net would: region-based labels, the ``ignore`` label, more than one channel
(medseg reads a multi-channel image as one 4D file) and image formats other than NIfTI.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from medseg.errors import DataError

FILE_ENDINGS = (".nii.gz", ".nii")
_CHANNEL_SUFFIX = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})$")
_SEE = "see README 'Data formats'"


def is_nnunet_raw(raw: Mapping[str, Any]) -> bool:
    """True when a parsed ``dataset.json`` is nnU-Net v2's: ``channel_names`` and ``file_ending``, no ``training``."""
    return "channel_names" in raw and "file_ending" in raw and "training" not in raw


def _channel_names(raw: Mapping[str, Any], json_path: Path) -> dict[str, str]:
    """``channel_names`` with keys "0".."n-1"; only one channel is accepted."""
    names = raw["channel_names"]
    if not isinstance(names, dict) or not names:
        raise DataError(f'{json_path}: key \'channel_names\' must be a non-empty object like {{"0": "MRI"}}')
    if sorted(names) != [str(i) for i in range(len(names))]:
        raise DataError(
            f"{json_path}: key 'channel_names' has keys {sorted(names)}; "
            f'number the channels "0", "1", ... in the order of their file suffixes _0000, _0001, ...'
        )
    if len(names) > 1:
        raise DataError(
            f"{json_path}: 'channel_names' declares {len(names)} channels {names}; medseg reads nnU-Net "
            "datasets with one channel only (a multi-channel image must be one 4D NIfTI file per case, "
            f"listed in a Decathlon 'training' list); {_SEE}"
        )
    return {str(k): str(v) for k, v in names.items()}


def _file_ending(raw: Mapping[str, Any], json_path: Path) -> str:
    ending = raw["file_ending"]
    if ending not in FILE_ENDINGS:
        raise DataError(
            f"{json_path}: 'file_ending' is {ending!r}; medseg reads NIfTI only, "
            f"so it must be one of {list(FILE_ENDINGS)}; convert the images to NIfTI"
        )
    return ending


def _labels(raw: Mapping[str, Any], json_path: Path) -> dict[int, str]:
    """nnU-Net's ``labels`` (name -> value) inverted to medseg's value -> name."""
    labels_raw = raw.get("labels")
    if not isinstance(labels_raw, dict) or not labels_raw:
        raise DataError(
            f'{json_path}: key \'labels\' must be a non-empty object like {{"background": 0, "organ": 1}}'
        )
    labels: dict[int, str] = {}
    for name, value in labels_raw.items():
        if isinstance(value, list | tuple):
            raise DataError(
                f"{json_path}: label '{name}' is region-based ({value!r}); medseg does not support "
                "nnU-Net's region-based labels (it trains one class per label value); "
                "give every label a single integer value"
            )
        if name == "ignore":
            raise DataError(
                f"{json_path}: label 'ignore' ({value!r}) is nnU-Net's ignore label for sparse annotation; "
                "medseg does not support it (it would train it as a class); remove it from 'labels' and the label files"
            )
        if not isinstance(value, int) or isinstance(value, bool):
            raise DataError(f"{json_path}: label '{name}' must be an integer value, got {value!r}")
        if value in labels:
            raise DataError(f"{json_path}: labels '{labels[value]}' and '{name}' share the value {value}")
        labels[value] = str(name)
    return labels


def _visible(folder: Path) -> list[os.DirEntry[str]]:
    """Entries of ``folder`` sorted by name, hidden ones (``.DS_Store``, ...) left out."""
    with os.scandir(folder) as it:
        return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)


def _scan_images(folder: Path, ending: str, n_channels: int, root: Path) -> dict[str, str]:
    """case -> path of its image in ``folder``, whose files must all be ``<case>_<XXXX><ending>``."""
    want = f"<case>_<XXXX>{ending} (XXXX a 4-digit channel index below {n_channels})"
    found: dict[str, dict[int, str]] = {}
    for entry in _visible(folder):
        rel = f"{folder.name}/{entry.name}"
        match = _CHANNEL_SUFFIX.match(entry.name[: -len(ending)]) if entry.name.endswith(ending) else None
        if match is None or not entry.is_file():
            raise DataError(f"{root}: {rel} is not an image file named {want}; rename or remove it")
        channel = int(match["channel"])
        if channel >= n_channels:
            raise DataError(
                f"{root}: {rel} is channel {channel}, but 'channel_names' declares {n_channels}; "
                "declare the channel or remove the file"
            )
        found.setdefault(match["case"], {})[channel] = os.path.join(folder, entry.name)
    for case, channels in found.items():
        for c in range(n_channels):
            if c not in channels:
                raise DataError(
                    f"{root}: case '{case}' has no {folder.name}/{case}_{c:04d}{ending}; "
                    f"every case needs one file per channel"
                )
    return {case: channels[0] for case, channels in found.items()}


def _scan_labels(root: Path, ending: str, cases: list[str]) -> dict[str, str]:
    """case -> ``labelsTr/<case><ending>`` for every case; no label file without images."""
    folder = root / "labelsTr"
    if not folder.is_dir():
        raise DataError(f"{root}: no labelsTr folder; nnU-Net keeps labelsTr/<case>{ending} beside imagesTr")
    labels: dict[str, str] = {}
    for entry in _visible(folder):
        case = entry.name[: -len(ending)] if entry.name.endswith(ending) else ""
        if case not in cases or not entry.is_file():
            raise DataError(
                f"{root}: labelsTr/{entry.name} is not the label of a case in imagesTr "
                f"(expected labelsTr/<case>{ending}); rename or remove it"
            )
        labels[case] = os.path.join(folder, entry.name)
    for case in cases:
        if case not in labels:
            raise DataError(
                f"{root}: case '{case}' has images but no label file; expected labelsTr/{case}{ending}"
            )
    return labels


def _scan_training(root: Path, ending: str, n_channels: int) -> list[dict[str, Any]]:
    images_dir = root / "imagesTr"
    if not images_dir.is_dir():
        raise DataError(
            f"{root}: no imagesTr folder; an nnU-Net dataset keeps imagesTr/<case>_0000{ending} there"
        )
    images = _scan_images(images_dir, ending, n_channels, root)
    if not images:
        return []
    labels = _scan_labels(root, ending, list(images))
    return [{"image": images[c], "label": labels[c]} for c in sorted(images)]


def _resolve(root: Path, path: Any, json_path: Path, key: str) -> str:
    """``path`` (environment variables expanded) made absolute against ``root``."""
    if not isinstance(path, str) or not path.strip():
        raise DataError(f"{json_path}: '{key}' must be a non-empty path string, got {path!r}")
    return os.path.normpath(os.path.join(root, os.path.expandvars(path)))


def _listed_training(raw: Mapping[str, Any], root: Path, json_path: Path) -> list[dict[str, Any]]:
    """The cases of an explicit ``dataset`` mapping ``{case: {"images": [path], "label": path}}``."""
    listed = raw["dataset"]
    if not isinstance(listed, dict):
        raise DataError(f"{json_path}: key 'dataset' must be an object mapping case names to their files")
    training = []
    for case, entry in listed.items():
        key = f"dataset.{case}"
        images = entry.get("images") if isinstance(entry, dict) else None
        if not isinstance(images, list) or len(images) != 1 or "label" not in entry:
            raise DataError(
                f'{json_path}: \'{key}\' must be {{"images": [one image path], "label": path}}, got {entry!r}'
            )
        image = _resolve(root, images[0], json_path, f"{key}.images[0]")
        training.append({"image": image, "label": _resolve(root, entry["label"], json_path, f"{key}.label")})
    return training


def _optional(raw: Mapping[str, Any], json_path: Path, key: str, kind: type, default: Any) -> Any:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{json_path}: key '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def read_nnunet_raw(raw: Mapping[str, Any], root: Path, json_path: Path) -> dict[str, Any]:
    """The ``DatasetInfo`` fields of the nnU-Net v2 raw dataset at ``root`` (``raw``: its dataset.json).

    Training items are ``{"image": path, "label": path}`` sorted by case; ``imagesTs`` images become
    ``test`` items. The folder is scanned for the cases (unless ``dataset`` lists them), so a missing
    label or channel file, or a file not named as nnU-Net expects, raises DataError naming it.
    """
    modality = _channel_names(raw, json_path)
    n_channels = len(modality)
    ending = _file_ending(raw, json_path)
    labels = _labels(raw, json_path)
    if "dataset" in raw:
        training = _listed_training(raw, root, json_path)
    else:
        training = _scan_training(root, ending, n_channels)
    test_dir = root / "imagesTs"
    test = _scan_images(test_dir, ending, n_channels, root) if test_dir.is_dir() else {}
    return {
        "root": root,
        "name": _optional(raw, json_path, "name", str, root.name),
        "task": "segmentation",
        "modality": modality,
        "labels": labels,
        "training": training,
        "test": [{"image": test[c]} for c in sorted(test)],
        "description": _optional(raw, json_path, "description", str, ""),
        "num_training": _optional(raw, json_path, "numTraining", int, None),
        "num_test": None,
    }

"""Medical Segmentation Decathlon datalists: read and write ``dataset.json``, split training cases.

A dataset folder holds ``dataset.json`` whose ``training`` list names image (and label) files relative
to the folder. Segmentation datasets label each image with a label volume; classification datasets
(``"task": "classification"``) label each image with an integer class named in ``labels``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from medseg.datasets import nnunet_layout
from medseg.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

DATASET_JSON = "dataset.json"
TASKS = ("segmentation", "classification")
_NOT_A_DATASET_HINT = "make one with `medseg data synth-seg` or see README 'Data formats'"

Task = Literal["segmentation", "classification"]
T = TypeVar("T")


@dataclass
class DatasetInfo:
    """A parsed ``dataset.json`` with every file path made absolute.

    ``training`` items are ``{"image": str, "label": str}`` for segmentation and
    ``{"image": str, "label": int}`` for classification; ``test`` items are ``{"image": str}``.
    ``num_training`` / ``num_test`` are the counts the file declares (None when absent).
    """

    root: Path
    name: str
    task: Task
    modality: dict[str, str]
    labels: dict[int, str]
    training: list[dict[str, Any]]
    test: list[dict[str, Any]] = field(default_factory=list)
    description: str = ""
    num_training: int | None = None
    num_test: int | None = None

    @property
    def json_path(self) -> Path:
        """Path of the ``dataset.json`` this was read from."""
        return self.root / DATASET_JSON


def _resolve(root: Path, rel: str) -> str:
    """Join ``rel`` (relative to ``root`` or absolute) onto ``root`` and normalise it."""
    return os.path.normpath(os.path.join(root, rel))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _path_str(value: Any, json_path: Path, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(
            f"{json_path}: key '{key}' must be a non-empty path string relative to the dataset folder, "
            f"got {value!r}; fix that entry"
        )
    return value


def _dataset_json_path(root: str | os.PathLike[str]) -> Path:
    """The resolved path of ``root/dataset.json``; DataError when the folder or file is missing."""
    root_path = Path(root).expanduser()
    json_path = root_path / DATASET_JSON
    if os.path.islink(root_path) and not root_path.exists():
        from medseg.datasets.checks import check_input_path

        check_input_path(root_path, "dataset folder")  # names a looping or dangling link
    if not root_path.is_dir():
        raise DataError(
            f"{root_path} is not a dataset folder: the folder does not exist; {_NOT_A_DATASET_HINT}"
        )
    if not json_path.is_file():
        raise DataError(f"{root_path} is not a dataset folder: no {DATASET_JSON}; {_NOT_A_DATASET_HINT}")
    return root_path.resolve() / DATASET_JSON


def _read_json_object(json_path: Path) -> dict[str, Any]:
    """The top-level JSON object of ``json_path``; DataError when unreadable, invalid or not an object."""
    try:
        text = json_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{json_path}: cannot be read ({exc}); check the file's permissions and encoding"
        ) from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{json_path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}; fix the file"
        ) from exc
    if not isinstance(raw, dict):
        raise DataError(f"{json_path}: the top level must be a JSON object, got {type(raw).__name__}")
    return raw


def _require(raw: dict[str, Any], json_path: Path, key: str, kind: type, kind_name: str) -> Any:
    """``raw[key]``, which must be present and of type ``kind``."""
    if key not in raw:
        raise DataError(f"{json_path}: required key '{key}' is missing; add it (see README 'Data formats')")
    value = raw[key]
    if not isinstance(value, kind):
        raise DataError(f"{json_path}: key '{key}' must be {kind_name}, got {type(value).__name__}")
    return value


def _optional(
    raw: dict[str, Any], json_path: Path, key: str, kind: type, kind_name: str, default: Any
) -> Any:
    """``raw[key]`` of type ``kind`` (never a bool), or ``default`` when absent or null."""
    if key not in raw or raw[key] is None:
        return default
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{json_path}: key '{key}' must be {kind_name}, got {type(value).__name__}")
    return value


def _parse_labels(labels_raw: dict[str, Any], json_path: Path) -> dict[int, str]:
    """``labels``: integer keys (written as strings) to name strings, at least one."""
    labels: dict[int, str] = {}
    for k, v in labels_raw.items():
        try:
            ik = int(k)
        except ValueError:
            raise DataError(
                f'{json_path}: key \'labels\' has key {k!r}, which is not an integer; use "0", "1", ...'
            ) from None
        if not isinstance(v, str):
            raise DataError(f"{json_path}: key 'labels.{k}' must be a name string, got {type(v).__name__}")
        labels[ik] = v
    if not labels:
        raise DataError(f"{json_path}: key 'labels' is empty; declare at least one label or class")
    return labels


def _parse_training(
    training_raw: list[Any], root_path: Path, json_path: Path, task: str
) -> list[dict[str, Any]]:
    """``training`` items with absolute image paths, and label paths (segmentation) or integer classes."""
    training: list[dict[str, Any]] = []
    for i, item in enumerate(training_raw):
        key = f"training[{i}]"
        if not isinstance(item, dict):
            raise DataError(f"{json_path}: '{key}' must be an object with 'image' and 'label', got {item!r}")
        if "image" not in item:
            raise DataError(f"{json_path}: '{key}' has no 'image' key; add the image path")
        if "label" not in item:
            raise DataError(f"{json_path}: '{key}' has no 'label' key; add the label")
        entry = dict(item)
        entry["image"] = _resolve(root_path, _path_str(item["image"], json_path, f"{key}.image"))
        if task == "segmentation":
            entry["label"] = _resolve(root_path, _path_str(item["label"], json_path, f"{key}.label"))
        elif not _is_int(item["label"]):
            raise DataError(
                f"{json_path}: '{key}.label' must be an integer class (a key of 'labels'), got {item['label']!r}"
            )
        training.append(entry)
    return training


def _parse_test(test_raw: list[Any], root_path: Path, json_path: Path) -> list[dict[str, Any]]:
    """``test`` items (image path strings or ``{"image": ...}`` objects) as objects with absolute paths."""
    test: list[dict[str, Any]] = []
    for i, item in enumerate(test_raw):
        key = f"test[{i}]"
        if isinstance(item, dict):
            if "image" not in item:
                raise DataError(f"{json_path}: '{key}' has no 'image' key; add the image path")
            entry = dict(item)
            entry["image"] = _resolve(root_path, _path_str(item["image"], json_path, f"{key}.image"))
        else:
            entry = {"image": _resolve(root_path, _path_str(item, json_path, key))}
        test.append(entry)
    return test


def load_dataset(root: str | os.PathLike[str]) -> DatasetInfo:
    """Read ``root/dataset.json`` (Decathlon layout) and resolve its paths against ``root``.

    An nnU-Net v2 raw dataset (``channel_names`` and ``file_ending``, no ``training`` list) is read by
    ``medseg.datasets.nnunet_layout``, which finds its cases in ``imagesTr`` / ``labelsTr``.
    Raises DataError when the folder or file is missing, the JSON is invalid, or a key is missing or
    has the wrong type. Files themselves are not opened here: see ``medseg.datasets.validate``.
    """
    json_path = _dataset_json_path(root)
    root_path = json_path.parent
    raw = _read_json_object(json_path)
    if nnunet_layout.is_nnunet_raw(raw):
        return DatasetInfo(**nnunet_layout.read_nnunet_raw(raw, root_path, json_path))

    task = _optional(raw, json_path, "task", str, "a string", "segmentation")
    if task not in TASKS:
        raise DataError(f"{json_path}: key 'task' must be one of {list(TASKS)}, got {task!r}")
    labels = _parse_labels(
        _require(raw, json_path, "labels", dict, "an object mapping label values to names"), json_path
    )
    modality_raw = _optional(raw, json_path, "modality", dict, 'an object like {"0": "CT"}', {})
    modality = {str(k): str(v) for k, v in modality_raw.items()}
    training_raw = _require(
        raw, json_path, "training", list, 'a list of {"image": ..., "label": ...} objects'
    )
    training = _parse_training(training_raw, root_path, json_path, task)
    test = _parse_test(
        _optional(raw, json_path, "test", list, "a list of image paths", []), root_path, json_path
    )

    info = DatasetInfo(
        root=root_path,
        name=_optional(raw, json_path, "name", str, "a string", root_path.name),
        task=task,
        modality=modality,
        labels=labels,
        training=training,
        test=test,
        description=_optional(raw, json_path, "description", str, "a string", ""),
        num_training=_optional(raw, json_path, "numTraining", int, "an integer", None),
        num_test=_optional(raw, json_path, "numTest", int, "an integer", None),
    )
    logger.debug("loaded %s: %s, %d training, %d test", json_path, task, len(training), len(test))
    return info


def _json_default(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def write_dataset_json(root: str | os.PathLike[str], info_dict: Mapping[str, Any]) -> Path:
    """Write ``info_dict`` as pretty JSON to ``root/dataset.json`` atomically; return the path.

    The file is written to a temporary name in ``root`` and renamed, so a reader never sees half a
    file. ``root`` is created if needed.
    """
    root_path = Path(root).expanduser()
    root_path.mkdir(parents=True, exist_ok=True)
    target = root_path / DATASET_JSON
    text = json.dumps(dict(info_dict), indent=2, default=_json_default) + "\n"
    fd, tmp_name = tempfile.mkstemp(prefix=f".{DATASET_JSON}.", suffix=".tmp", dir=root_path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    logger.info("wrote %s", target)
    return target


def split_train_val(items: Sequence[T], val_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Split ``items`` into (train, val) by a shuffle seeded with ``seed``.

    The same items, fraction and seed always give the same split; each part keeps the input order.
    With ``val_fraction > 0`` and at least 2 items, val has at least 1 item and train keeps at least 1.
    """
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(
            f"val_fraction must be in [0, 1), got {val_fraction}; set data.val_fraction to e.g. 0.2"
        )
    n = len(items)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    elif n < 2:
        n_val = 0
    order = list(range(n))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:n_val])
    train = [items[i] for i in range(n) if i not in val_idx]
    val = [items[i] for i in range(n) if i in val_idx]
    return train, val

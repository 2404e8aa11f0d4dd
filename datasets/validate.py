"""Check a Decathlon-layout dataset by opening every volume it lists.

``validate_dataset`` reads each training case (image and label) and each test image one at a time,
and reports per-case geometry plus a list of problems, each naming the file and the defect:
missing or unreadable files (including truncated ``.nii.gz``), images that are not 3D, NaN/Inf
voxels, label volumes whose shape or affine disagree with their image, label values or classes that
``dataset.json`` does not declare, and a ``numTraining`` that does not match the list. The checks
themselves live in :mod:`medseg.datasets.checks` (header size limits, the qform/sform policy, label
values, grids, duplicates), which ``train``, ``evaluate``, ``infer`` and the viewer call too.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from nibabel.filebasedimages import ImageFileError
from nibabel.spatialimages import HeaderDataError
from tqdm.auto import tqdm

from medseg.errors import DataError

from . import checks
from .decathlon import DatasetInfo, load_dataset

logger = logging.getLogger(__name__)

AFFINE_TOLERANCE = checks.AFFINE_TOLERANCE
PROGRESS_MIN_CASES = 10
_MAX_LISTED_VALUES = 10

# What reading a broken NIfTI raises: truncated gzip -> EOFError / zlib.error / OSError (BadGzipFile),
# short uncompressed data -> ValueError, unknown format -> ImageFileError, bad header -> HeaderDataError.
_LOAD_ERRORS = (EOFError, OSError, zlib.error, ValueError, ImageFileError, HeaderDataError)


@dataclass
class CaseRow:
    """One line of the report: a training case or a test image."""

    case: str
    split: str
    shape: tuple[int, ...] | None = None
    spacing: tuple[float, ...] | None = None
    labels: str = "-"
    problems: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """``"ok"`` or ``"FAIL"``."""
        return "FAIL" if self.problems else "ok"


@dataclass
class ValidationReport:
    """Result of ``validate_dataset``: one row per case and every problem found."""

    root: Path
    task: str
    rows: list[CaseRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def format_table(self) -> str:
        """Fixed-width table, one line per case, then the problems, then ``"N cases, M problems"``."""
        label_head = "class" if self.task == "classification" else "labels"
        header = ("case", "split", "shape", "spacing", label_head, "status")
        body = [
            (
                r.case,
                r.split,
                "x".join(str(s) for s in r.shape) if r.shape else "-",
                "x".join(f"{s:.2f}" for s in r.spacing) if r.spacing else "-",
                r.labels,
                r.status,
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

        def line(cells: tuple[str, ...]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        out = [line(header), line(tuple("-" * w for w in widths))]
        out += [line(row) for row in body]
        if self.problems:
            out += ["", "problems:"]
            out += [f"  - {p}" for p in self.problems]
        out += ["", f"{len(self.rows)} cases, {len(self.problems)} problems"]
        return "\n".join(out)


class _LoadFailed(Exception):
    """A volume could not be read; the message is the problem text."""


@dataclass
class _Volume:
    shape: tuple[int, ...]
    affine: np.ndarray


def _display(path: str, root: Path) -> str:
    """Path relative to the dataset folder when it lies inside it, else absolute."""
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return path


def _read(path: str, name: str) -> tuple[Any, np.ndarray, np.ndarray]:
    """Open a NIfTI file (header checks of ``checks.open_nifti``) and read all its voxels.

    Returns (image, voxels, affine); raises _LoadFailed with a problem text.
    """
    try:
        img, affine = checks.open_nifti(path, name)
        data = np.asanyarray(img.dataobj)  # nibabel is lazy: this is where truncated data fails
    except DataError as exc:
        raise _LoadFailed(str(exc)) from exc
    except _LOAD_ERRORS as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise _LoadFailed(
            f"{name}: cannot be read as NIfTI ({reason}); the file is corrupt or truncated, re-export or re-copy it"
        ) from exc
    return img, data, affine


def _spacing(affine: np.ndarray) -> tuple[float, ...]:
    return tuple(round(float(s), 2) for s in np.linalg.norm(affine[:3, :3], axis=0))


def _check_image(path: str, name: str, row: CaseRow, n_channels: int) -> _Volume | None:
    """Read an image, fill ``row``'s geometry and append its problems; return its geometry if read."""
    try:
        _, data, affine = _read(path, name)
    except _LoadFailed as exc:
        row.problems.append(str(exc))
        return None
    shape = tuple(int(s) for s in data.shape)
    row.shape = shape
    row.spacing = _spacing(affine)
    if len(shape) == 4:
        if shape[3] != n_channels:
            want = "a single channel" if n_channels == 1 else f"{n_channels} channels (one per modality)"
            row.problems.append(
                f"{name}: image is 4D with {shape[3]} channels last, expected 3D or {want}; "
                "split the volume or fix 'modality'"
            )
    elif len(shape) != 3:
        row.problems.append(f"{name}: image is {len(shape)}D with shape {shape}, expected a 3D volume")
    if np.issubdtype(data.dtype, np.floating) or np.issubdtype(data.dtype, np.complexfloating):
        n_nan = int(np.count_nonzero(np.isnan(data)))
        n_inf = int(np.count_nonzero(np.isinf(data)))
        if n_nan:
            row.problems.append(
                f"{name}: image has {n_nan} NaN voxels; replace them (e.g. with 0) before training"
            )
        if n_inf:
            row.problems.append(f"{name}: image has {n_inf} Inf voxels; clip or replace them before training")
    return _Volume(shape=shape[:3], affine=affine)


def _check_seg_label(path: str, name: str, image: _Volume | None, info: DatasetInfo, row: CaseRow) -> None:
    try:
        _, data, affine = _read(path, name)
    except _LoadFailed as exc:
        row.problems.append(str(exc))
        return
    shape = tuple(int(s) for s in data.shape)
    if len(shape) == 4 and shape[3] == 1:
        data = data[..., 0]
        shape = shape[:3]
    if image is not None:
        row.problems.extend(checks.geometry_problems(shape, affine, image.shape, image.affine, name))
    values = np.unique(data)
    row.problems.extend(checks.label_value_problems(values, info.labels, name))
    if not np.issubdtype(values.dtype, np.integer):
        values = values[np.isfinite(values) & (values == np.round(values))].astype(np.int64)
    found = [int(v) for v in values]
    row.labels = ",".join(str(v) for v in found[:_MAX_LISTED_VALUES]) + (
        ",..." if len(found) > _MAX_LISTED_VALUES else ""
    )


def _check_cls_label(label: Any, name: str, info: DatasetInfo, row: CaseRow) -> None:
    if isinstance(label, bool) or not isinstance(label, int | np.integer):
        row.labels = repr(label)
    else:
        row.labels = f"{int(label)} ({info.labels[int(label)]})" if int(label) in info.labels else str(label)
    row.problems.extend(checks.class_label_problems(label, info.labels, name))


def validate_dataset(root: str | os.PathLike[str]) -> ValidationReport:
    """Open every training case and test image of the dataset at ``root`` and report problems.

    Raises DataError (from ``load_dataset``) only when ``dataset.json`` itself is missing or malformed;
    every per-file defect becomes a problem in the report. Volumes are read one case at a time.
    """
    info = load_dataset(root)
    report = ValidationReport(root=info.root, task=info.task)
    n_channels = max(len(info.modality), 1)

    if info.num_training is not None and info.num_training != len(info.training):
        report.problems.append(
            f"dataset.json: numTraining is {info.num_training} but 'training' lists {len(info.training)} "
            f"cases; set numTraining to {len(info.training)}"
        )
    if info.num_test is not None and info.num_test != len(info.test):
        report.problems.append(
            f"dataset.json: numTest is {info.num_test} but 'test' lists {len(info.test)} images; "
            f"set numTest to {len(info.test)}"
        )
    report.problems.extend(checks.declared_label_problems(info.labels, "dataset.json", info.task))
    report.problems.extend(checks.duplicate_problems(info.training, lambda p: _display(p, info.root)))

    cases: list[tuple[str, dict[str, Any]]] = [("train", it) for it in info.training]
    cases += [("test", it) for it in info.test]
    bar = tqdm(
        cases,
        desc=f"validating {info.name}",
        unit="case",
        disable=True if len(cases) <= PROGRESS_MIN_CASES else None,
    )
    for split, item in bar:
        image_name = _display(item["image"], info.root)
        row = CaseRow(case=Path(item["image"]).name, split=split)
        image = _check_image(item["image"], image_name, row, n_channels)
        if split == "train":
            if info.task == "segmentation":
                _check_seg_label(item["label"], _display(item["label"], info.root), image, info, row)
            else:
                _check_cls_label(item["label"], image_name, info, row)
        report.rows.append(row)
        report.problems.extend(row.problems)
        logger.debug("%s %s: %s", split, row.case, row.status)

    n_fail = sum(1 for r in report.rows if r.problems)
    log = logger.info if report.ok else logger.warning
    log(
        "validated %s: %d cases, %d failed, %d problems",
        info.root,
        len(report.rows),
        n_fail,
        len(report.problems),
    )
    return report

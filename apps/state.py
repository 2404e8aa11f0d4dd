"""What the viewer keeps in a browser session between reruns (``st.session_state``).

Streamlit reruns the page script on every interaction; what must survive a rerun lives in the
session. Each kept thing has a :class:`Slot` (its session key, typed) and, where it has fields, a
dataclass: the loaded case, the model's result for it, a second mask to compare with, the user's
corrected mask, the input's trust warnings, the bytes of a pending upload, the last upload that
could not be read, and the model chosen for an upload. Widget values
(sliders, pickers) stay under their widget keys, as Streamlit requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import streamlit as st

from medseg.apps import export, render, upload
from medseg.apps.inference import Result

T = TypeVar("T")


class Slot(Generic[T]):
    """One value kept in the session under ``key``: absent (None) until set."""

    def __init__(self, key: str) -> None:
        self.key = key

    def get(self) -> T | None:
        return st.session_state.get(self.key)

    def set(self, value: T) -> None:
        st.session_state[self.key] = value

    def clear(self) -> None:
        st.session_state.pop(self.key, None)


@dataclass
class LoadedCase:
    """The input on show: one image read from an upload or a demo case, or why there is none.

    ``key`` names the input: ``("demo", path)`` or ``("upload", upload number, series UID or
    None)``. ``image`` is None when reading failed (``error`` says why) or when the upload holds
    several series and one has to be chosen (``series``).
    """

    key: tuple
    image: Any = None  # the (1, I, J, K) MetaTensor as read
    source: str = ""  # "NIfTI" or "DICOM"
    case: str = ""  # the case's name, for download file names
    view: render.ViewVolume | None = None  # the image in RAS order, for the static panels
    info: dict[str, str] = field(default_factory=dict)  # the metadata table (no identifiers)
    headers: list | None = None  # DICOM: the slice headers along k, for a DICOM-SEG export
    # DICOM: those headers as every DICOM-SEG of this case references them (UIDs filled in once;
    # ``panels.export.case_seg_sources``)
    seg_sources: export.SegSources | None = None
    error: str | None = None
    series: list[upload.SeriesChoice] | None = None
    # the scan as the viewport receives it: NIfTI-1 bytes, their id and file name
    nifti: bytes | None = None
    nifti_id: str = ""
    nifti_name: str = "scan.nii"


@dataclass
class CaseResult:
    """The model's result for a loaded case, with what the page draws and offers from it.

    ``key`` is ``(case key, bundle path, bundle mtime)``: a new case or model needs a new run.
    """

    key: tuple
    result: Result
    labels_view: np.ndarray | None  # the label map in the view's RAS order
    mask: bytes | None  # the mask download (.nii.gz on the image's own grid)
    names: dict[str, str]  # download file names: "mask", "seg"
    labels_nifti: bytes | None  # the label map as the viewport receives it
    labels_id: str
    dicom_seg: bytes | None = None
    dicom_seg_problem: str | None = None  # why a DICOM upload has no DICOM-SEG
    dicom_seg_note: str | None = None  # the DICOM-SEG's generated UIDs, if any


@dataclass
class SecondMask:
    """A second label map on the case's grid: an uploaded mask file or another model's result.

    ``source`` is ``("file", name)`` or ``("model", bundle path, bundle mtime)``.
    """

    case: tuple  # the key of the case it belongs to
    source: tuple
    name: str
    label: np.ndarray  # uint8 (I, J, K)
    nifti: bytes  # its outline, drawn as edges over the model's mask
    filled: bytes  # the label map itself, for the side-by-side viewer
    id: str


@dataclass
class Correction:
    """The model's mask with the user's brush edits applied, and its downloads.

    ``key`` is ``(labels id, edit step)``: it is rebuilt when the user edits again.
    """

    key: tuple
    label: Any  # the corrected (1, I, J, K) MetaTensor
    mask: bytes
    seg: bytes | None = None


@dataclass
class TrustNotes:
    """Where the input lies outside the model's training data; ``key`` as :class:`CaseResult`'s."""

    key: tuple
    warnings: list[str]
    note: str | None


@dataclass
class PendingUpload:
    """The files of the latest upload, taken out of the file picker (see ``panels.input``).

    ``files`` is emptied once the case is read and no series remains to be chosen. ``previous`` is
    the upload this one replaced (its files emptied, its own ``previous`` dropped): it becomes the
    latest again when this one cannot be read, so that the case on show stays.
    """

    id: int
    files: list[upload.UploadedBytes]
    case: str
    previous: PendingUpload | None = None


@dataclass
class UploadFailure:
    """An upload that could not be read, while the case before it stays on show.

    ``id`` is the failed upload's number, ``name`` what the user uploaded, ``message`` why it failed.
    """

    id: int
    name: str
    message: str


@dataclass
class ModelChoice:
    """The model the page chose for a new upload (see ``panels.model.choose_model``): ``bundle``
    is set as the sidebar picker's value before the picker is drawn; ``note`` says why, on ``case``'s page."""

    case: tuple
    bundle: str
    note: str


CASE: Slot[LoadedCase] = Slot("loaded")
RESULT: Slot[CaseResult] = Slot("result")
SECOND: Slot[SecondMask] = Slot("second")
CORRECTED: Slot[Correction] = Slot("corrected")
TRUST: Slot[TrustNotes] = Slot("trust")
UPLOAD: Slot[PendingUpload] = Slot("upload_files")
# counters that give a file picker a new key, so a taken file leaves it empty
UPLOAD_GEN: Slot[int] = Slot("upload_gen")
UPLOAD_FAILED: Slot[UploadFailure] = Slot("upload_failed")
MODEL_CHOICE: Slot[ModelChoice] = Slot("model_choice")
# (who put it there, bundle): the sidebar picker's model on the last run, and whether the page put
# it there ("page": the first offered, or one chosen for an upload) or the user ("user"): the
# page leaves a user's pick alone
PAGE_MODEL: Slot[tuple[str, str]] = Slot("page_model")
MASK_GEN: Slot[int] = Slot("mask_gen")
MASK_PROBLEM: Slot[str] = Slot("mask_problem")
# a click on "Run" kept until its result is stored (see ``panels.model``): the key it asked for
RUN_REQUESTED: Slot[tuple] = Slot("run_requested")
SECOND_REQUESTED: Slot[tuple] = Slot("second_requested")


def set_position(point: tuple[int, int, int]) -> None:
    """Move the static panels' slices (the ``pos_x``, ``pos_y``, ``pos_z`` sliders) to ``point``."""
    for axis, v in zip("xyz", point, strict=True):
        st.session_state[f"pos_{axis}"] = v

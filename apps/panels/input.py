"""The Input part of the page: an upload or a demo case, read once into the session's loaded case."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import streamlit as st

from medseg.apps import render, upload
from medseg.apps.messages import problem
from medseg.apps.panels.model import choose_model
from medseg.apps.registry import ModelInfo, demo_cases
from medseg.apps.state import (
    CASE,
    RESULT,
    SECOND,
    UPLOAD,
    UPLOAD_FAILED,
    UPLOAD_GEN,
    LoadedCase,
    PendingUpload,
    UploadFailure,
    set_position,
)
from medseg.apps.timings import mark

# early(volume, volume_id, affine, step) -> whether the viewport painted it
EarlyPaint = Callable[[upload.ViewerNifti, str, np.ndarray, int], bool]


def store_image(key: tuple, image: Any, source: str, case: str, headers: list | None = None) -> None:
    """Keep ``image`` as the loaded case; the previous case's result and second mask go."""
    view = render.to_view(image[0].numpy(), image.affine.numpy())
    CASE.set(
        LoadedCase(
            key=key,
            image=image,
            source=source,
            case=case,
            view=view,
            info=upload.describe(image, source),
            headers=headers,
        )
    )
    RESULT.clear()
    SECOND.clear()
    set_position(tuple(n // 2 for n in view.shape))


def store_error(key: tuple, message: str) -> None:
    CASE.set(LoadedCase(key=key, error=message))
    RESULT.clear()


def take_upload(limit: int) -> None:
    """The file picker; a new upload replaces the case once read (:func:`keep_case_after_failure`).

    Streamlit's multi-file picker adds a second drop to the first. So once files arrive they are
    taken out of the picker: their bytes go into the session (:data:`~medseg.apps.state.UPLOAD`)
    under a new upload number, the picker is drawn again under a new key (empty), and the page
    reruns. The case is read from the session's copy; the copy is kept only while a series has to
    be chosen.
    """
    gen = int(UPLOAD_GEN.get() or 0)
    files = st.file_uploader(
        f"A NIfTI file (.nii, .nii.gz), a zip of a DICOM series folder, or several DICOM files "
        f"(up to {limit} MB; nothing leaves this machine). A new upload replaces the current case "
        "once it has been read.",
        accept_multiple_files=True,
        key=f"upload_{gen}",
        max_upload_size=limit,
    )
    if files:
        mark("upload in")
        previous = UPLOAD.get()
        UPLOAD.set(
            PendingUpload(
                id=gen + 1,
                files=[upload.UploadedBytes(f.name, f.getvalue()) for f in files],
                case=upload.case_name([f.name for f in files]),
                previous=replace(previous, previous=None) if previous is not None else None,
            )
        )
        UPLOAD_GEN.set(gen + 1)
        UPLOAD_FAILED.clear()
        st.session_state.pop("series", None)
        st.rerun()


def keep_case_after_failure(pending: PendingUpload, key: tuple, message: str) -> bool:
    """An upload that cannot be read: the case on show (and its result, second mask and the user's
    corrections) stays, with the message above it; with no case on show, or for a series of the
    upload on show, the message is the case.

    The upload before the failed one becomes the latest again, so the next run finds the case on
    show already read. True when a case was kept.
    """
    kept = CASE.get()
    if kept is None or kept.image is None or kept.key[0] != "upload" or kept.key[:2] == key[:2]:
        # nothing on show in Upload mode (a demo case read earlier is not), or another series of
        # the same upload was chosen: the message is the case, the series picker stays
        store_error(key, message)
        return False
    names = ", ".join(f.name for f in pending.files[:3]) + (" …" if len(pending.files) > 3 else "")
    UPLOAD_FAILED.set(UploadFailure(pending.id, names, message))
    if pending.previous is not None:
        UPLOAD.set(pending.previous)
    else:
        UPLOAD.clear()
    return True


def show_upload_failure() -> None:
    """The last upload's message when it could not be read and the case before it stayed on show."""
    failed = UPLOAD_FAILED.get()
    if failed is None:
        return
    kept = CASE.get()
    said = failed.message if failed.message.startswith(failed.name) else f"{failed.name}: {failed.message}"
    st.error(f"{said.rstrip('.')}. Nothing was replaced: the case on show is still {kept.case}.")


def keep_direct_volume(loaded: LoadedCase, direct: upload.ViewerNifti | None, vid: str) -> None:
    """Keep the uploaded file as the viewport's volume when the full read agrees with its header's
    shape and geometry (it does unless the header check in ``viewer_nifti`` missed something)."""
    image = loaded.image
    if (
        direct is not None
        and int(image.shape[0]) == 1
        and tuple(int(s) for s in image.shape[1:]) == direct.shape
        and np.allclose(image.affine.numpy(), direct.affine, atol=1e-4)
    ):
        loaded.nifti, loaded.nifti_id, loaded.nifti_name = direct.data, vid, direct.name


def _choose_series(loaded: LoadedCase | None, base: tuple) -> tuple[list | None, str | None]:
    """The series found in this upload on an earlier run, and the one the user picks among them
    (at first the one on show: after a failed upload the picker's own value is gone)."""
    series = loaded.series if loaded and loaded.key[:2] == base else None
    if not series:
        return series, None
    uids = [c.uid for c in series]
    uid = st.selectbox(
        "This upload holds several series; choose one",
        uids,
        index=uids.index(loaded.key[2]) if loaded.key[2] in uids else 0,
        format_func=lambda u: next(c.label for c in series if c.uid == u),
        key="series",
    )
    return series, uid


def _paint_first(
    pending: PendingUpload, early: EarlyPaint | None, uid: str | None
) -> tuple[Any, str, str, bool]:
    """Send a NIfTI upload the viewport can show as it is before its voxels are read.

    Returns (the upload as the viewport's volume or None, its id, the id of what was painted,
    whether it was painted). A large scan paints first at reduced resolution; the full one follows
    once read.
    """
    direct = upload.viewer_nifti(pending.files) if early is not None and uid is None else None
    if direct is None:
        return None, "", "", False
    vid = f"upload-{pending.id}-{len(direct.data)}"
    preview = upload.preview_nifti(direct)  # inflated within its header's size, or None
    if preview is None and not upload.holds_its_header_size(direct):
        return None, "", "", False  # a gzip bomb goes to no browser; the read says why
    first, step = preview if preview is not None else (direct, 1)
    first_id = f"{vid}-preview{step}" if preview is not None else vid
    return direct, vid, first_id, early(first, first_id, direct.affine, step)


def _read_upload(
    info: ModelInfo, pending: PendingUpload, key: tuple, series: list | None, early: EarlyPaint | None
) -> None:
    """Read the pending upload (the series ``key[2]``, if chosen) into the loaded case, and choose
    the model that fits it; the case on show stays when it cannot be read."""
    uid = key[2]
    mark("read start")
    direct, vid, first_id, painted = _paint_first(pending, early, uid)
    chose = False
    with st.spinner("Reading the upload…"):
        try:
            result = upload.read_upload(pending.files, series_uid=uid)
        except Exception as e:  # noqa: BLE001 - shown in the page, the app keeps running
            if keep_case_after_failure(pending, key, problem(e)):
                st.rerun()  # the page (series picker, viewport) draws the case on show again
            result = None  # no case was on show: the message is the case (its series still offered)
        if result is not None and result.image is None:  # several series: ask, then read the chosen one
            CASE.set(LoadedCase(key=key))
            series = result.series
            st.session_state.pop("series", None)
        elif result is not None:
            store_image(key, result.image, result.source, pending.case, result.headers)
            keep_direct_volume(CASE.get(), direct, vid)
            series = series or (result.series if len(result.series) > 1 else None)
            chose = choose_model(info, CASE.get())
    loaded = CASE.get()
    loaded.series = series
    mark("read done")
    if not series:  # nothing left to choose: the bytes are not needed any more
        pending.files = []
    if loaded.image is None and series and uid is None:
        st.rerun()
    if chose or (painted and loaded.nifti_id != first_id):
        st.rerun()  # the model picker shows the chosen model; or the viewport draws what was read


def _upload_input(info: ModelInfo, early: EarlyPaint | None) -> bool:
    """The upload picker and, for a new upload or series, the read. False when there is no case."""
    take_upload(upload.max_upload_mb())
    pending = UPLOAD.get()
    loaded = CASE.get()
    if loaded is not None and loaded.key[0] != "upload":
        loaded = None  # a demo case was shown; the upload (if any) comes back
    if pending is None:
        return loaded is not None
    base = ("upload", pending.id)
    series, uid = _choose_series(loaded, base)
    key = (*base, uid)
    if loaded is not None and loaded.key == key:
        show_upload_failure()
        return True
    if not pending.files:
        return False  # read before and replaced by a demo case since: upload it again
    _read_upload(info, pending, key, series, early)
    show_upload_failure()
    return True


def _demo_input(info: ModelInfo) -> bool:
    """The demo case picker and, for a new case, the read. False when there are no demo cases."""
    cases = demo_cases(info, extra=[p for p in os.environ.get("MEDSEG_APP_DEMO", "").split(os.pathsep) if p])
    if not cases:
        st.info(f"No demo cases were found for {info.name} (its dataset folder is not on this machine).")
        return False
    case = st.selectbox("Demo case", [str(c) for c in cases], format_func=lambda p: Path(p).name, key="demo")
    key = ("demo", case)
    loaded = CASE.get()
    if loaded is None or loaded.key != key:
        with st.spinner("Reading the case…"):
            try:
                store_image(key, upload.read_path(case), "NIfTI", upload.case_name([case]))
            except Exception as e:  # noqa: BLE001
                store_error(key, problem(e))
    return True


def input_section(info: ModelInfo, early: EarlyPaint | None = None) -> LoadedCase | None:
    """Upload or demo case -> the loaded case in session state (read once per input); None when
    there is no image to show.

    ``early(volume, volume_id, affine, step)`` is called with a NIfTI upload that the viewport can
    show as it is (:func:`medseg.apps.upload.viewer_nifti`) before its voxels are read here: the
    scan paints while the server reads it. A large one goes as a reduced-resolution preview
    (:func:`medseg.apps.upload.preview_nifti`, every ``step``-th voxel; ``affine`` stays the
    upload's, for the readout), and the page reruns once it is read to send the full scan.
    """
    mode = st.radio("Input", ["Upload", "Demo case"], horizontal=True, key="input_mode")
    present = _upload_input(info, early) if mode == "Upload" else _demo_input(info)
    if not present:
        return None
    loaded = CASE.get()
    if loaded and loaded.error:
        st.error(loaded.error)
        return None
    return loaded if loaded and loaded.image is not None else None

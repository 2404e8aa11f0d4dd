"""The medseg viewer page: ``medseg app`` (or ``streamlit run apps/app.py``) serves it on localhost.

Streamlit reruns this script on every interaction. What is slow happens once and is kept: bundles
in ``st.cache_resource``, the model list in ``st.cache_data`` (briefly, so new runs appear), the
loaded image, its RAS view and the model's result in the session's state. A slider move therefore
only cuts and draws three slices.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import streamlit as st

from medseg.apps import render, review, trust, upload, viewport
from medseg.apps.export import dicom_seg_export, mask_nifti_bytes
from medseg.apps.inference import Result, run_model
from medseg.apps.messages import problem as _problem
from medseg.apps.registry import ModelInfo, default_folders, demo_cases, list_models
from medseg.bundle.export import Bundle, load_bundle

log = logging.getLogger("medseg.apps")

AUTO, CUSTOM = "Auto (1st–99th percentile)", "Custom"


def _mark(stage: str) -> None:
    """Append ``{"stage", "t"}`` (wall clock) to the file named by ``MEDSEG_APP_TIMINGS``, if set:
    the viewer benchmark's breakdown of a first paint (scripts/bench_viewer.py). Off by default."""
    path = os.environ.get("MEDSEG_APP_TIMINGS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"stage": stage, "t": time.time()}) + "\n")


@st.cache_resource(show_spinner="Loading the model…", max_entries=4)
def cached_bundle(path: str, mtime: float) -> Bundle:
    """One network per bundle file version, shared by every session of this server."""
    del mtime  # part of the cache key only
    return load_bundle(path)


@st.cache_data(ttl=20, show_spinner=False)
def cached_models(folders: tuple[str, ...]) -> tuple[list[ModelInfo], list[str]]:
    return list_models(list(folders))


@st.cache_data(ttl=60, show_spinner=False)
def _facts(bundle: str, mtime: float, _info: ModelInfo) -> trust.TrainingFacts:
    del bundle, mtime  # the cache key only
    return trust.training_facts(_info)


def cached_facts(info: ModelInfo) -> trust.TrainingFacts:
    """The training-set facts of a model, read once a minute at most (headers of its training images)."""
    return _facts(str(info.bundle), info.mtime, info)


def all_models() -> tuple[list[ModelInfo], list[str]]:
    """The models in the default folders and the one typed into 'Another model folder'."""
    extra = str(st.session_state.get("extra_folder", "") or "")
    folders = [str(p) for p in default_folders()] + ([extra.strip()] if extra.strip() else [])
    return cached_models(tuple(folders))


def sidebar_models() -> ModelInfo | None:
    st.sidebar.title("medseg viewer")
    st.sidebar.text_input(
        "Another model folder",
        key="extra_folder",
        help="A bundle folder, a run folder, or a folder of runs on this machine.",
    )
    models, problems = all_models()
    for p in problems:
        st.sidebar.warning(p)
    if not models:
        st.sidebar.error(
            "No trained models were found in the model folders. Type the folder of a trained model "
            "(or of several) into 'Another model folder' above."
        )
        return None
    by_path = {str(m.bundle): m for m in models}
    chosen = st.sidebar.selectbox("Model", list(by_path), format_func=lambda p: by_path[p].title, key="model")
    info = by_path[chosen]
    labels = ", ".join(f"{k}: {v}" for k, v in sorted(info.labels.items()))
    st.sidebar.markdown(
        f"**Task** {info.task} ({info.network})  \n**Labels** {labels}  \n"
        f"**Trained on** {info.modality or 'images'}, resampled to "
        f"{' × '.join(f'{s:g}' for s in info.spacing)} mm  \n"
        f"**Patch** {' × '.join(str(p) for p in info.patch)}  \n"
        f"**Model input** {info.intensity or f'window {info.window[0]:g} … {info.window[1]:g}'} "
        "(fixed by training; the display window below does not change it)"
    )
    facts = cached_facts(info)
    if info.metrics:
        st.sidebar.caption("Validation metrics")
        st.sidebar.table(
            pd.DataFrame(
                [
                    {"metric": k, "value": f"{v:.4g}" if isinstance(v, float) else str(v)}
                    for k, v in info.metrics.items()
                ]
            ),
            hide_index=True,
        )
        st.sidebar.caption(trust.metrics_source(info, facts))
    for line in trust.evaluation_lines(info):
        st.sidebar.caption(f"Evaluated on {line}")
    return info


def _reset_view(view: render.ViewVolume) -> None:
    for axis, n in zip("xyz", view.shape, strict=True):
        st.session_state[f"pos_{axis}"] = n // 2


def _store_image(key: Any, image: Any, source: str, case: str, headers: list | None = None) -> None:
    view = render.to_view(image[0].numpy(), image.affine.numpy())
    st.session_state["loaded"] = {
        "key": key,
        "image": image,
        "source": source,
        "case": case,
        "view": view,
        "info": upload.describe(image, source),
        "headers": headers,
        "error": None,
    }
    st.session_state.pop("result", None)
    st.session_state.pop("second", None)
    _reset_view(view)


def _store_error(key: Any, message: str) -> None:
    st.session_state["loaded"] = {"key": key, "image": None, "error": message}
    st.session_state.pop("result", None)


def _take_upload(limit: int) -> None:
    """The file picker; a new upload replaces the case.

    Streamlit's multi-file picker adds a second drop to the first. So once files arrive they are
    taken out of the picker: their bytes go into the session (``upload_files``) under a new upload
    number, the picker is drawn again under a new key (empty), and the page reruns. The case is
    read from the session's copy; the copy is kept only while a series has to be chosen.
    """
    gen = int(st.session_state.get("upload_gen", 0))
    files = st.file_uploader(
        f"A NIfTI file (.nii, .nii.gz), a zip of a DICOM series folder, or several DICOM files "
        f"(up to {limit} MB; nothing leaves this machine). A new upload replaces the current case.",
        accept_multiple_files=True,
        key=f"upload_{gen}",
        max_upload_size=limit,
    )
    if files:
        _mark("upload in")
        st.session_state["upload_files"] = {
            "id": gen + 1,
            "files": [upload.UploadedBytes(f.name, f.getvalue()) for f in files],
            "case": upload.case_name([f.name for f in files]),
        }
        st.session_state["upload_gen"] = gen + 1
        st.session_state.pop("series", None)
        st.rerun()


def _direct_volume(loaded: dict[str, Any], direct: upload.ViewerNifti | None, vid: str) -> None:
    """Keep the uploaded file as the viewport's volume when the full read agrees with its header's
    shape and geometry (it does unless the header check in ``viewer_nifti`` missed something)."""
    image = loaded["image"]
    if (
        direct is not None
        and int(image.shape[0]) == 1
        and tuple(int(s) for s in image.shape[1:]) == direct.shape
        and np.allclose(image.affine.numpy(), direct.affine, atol=1e-4)
    ):
        loaded.update(nifti=direct.data, nifti_id=vid, nifti_name=direct.name)


def input_section(info: ModelInfo, early: Any = None) -> dict[str, Any] | None:
    """Upload or demo case -> the loaded image in session state (loaded once per input).

    ``early(volume, volume_id, affine, step)`` is called with a NIfTI upload that the viewport can
    show as it is (:func:`medseg.apps.upload.viewer_nifti`) before its voxels are read here: the
    scan paints while the server reads it. A large one goes as a reduced-resolution preview
    (:func:`medseg.apps.upload.preview_nifti`, every ``step``-th voxel; ``affine`` stays the
    upload's, for the readout), and the page reruns once it is read to send the full scan.
    """
    mode = st.radio("Input", ["Upload", "Demo case"], horizontal=True, key="input_mode")
    loaded = st.session_state.get("loaded")
    if mode == "Upload":
        _take_upload(upload.max_upload_mb())
        pending = st.session_state.get("upload_files")
        if loaded is not None and loaded["key"][0] != "upload":
            loaded = None  # a demo case was shown; the upload (if any) comes back
        if pending is None:
            if loaded is None:
                return None
        else:
            base = ("upload", pending["id"])
            # several series were found in this upload on an earlier run: the user picks one
            series = loaded.get("series") if loaded and loaded["key"][:2] == base else None
            uid = None
            if series:
                uid = st.selectbox(
                    "This upload holds several series; choose one",
                    [c.uid for c in series],
                    format_func=lambda u: next(c.label for c in series if c.uid == u),
                    key="series",
                )
            key = (*base, uid)
            if (loaded is None or loaded["key"] != key) and not pending["files"]:
                return None  # read before and replaced by a demo case since: upload it again
            if loaded is None or loaded["key"] != key:
                _mark("read start")
                direct = upload.viewer_nifti(pending["files"]) if early is not None and uid is None else None
                vid = f"upload-{pending['id']}-{len(direct.data)}" if direct is not None else ""
                # a large scan paints first at reduced resolution; the full one follows once read
                preview = upload.preview_nifti(direct) if direct is not None else None
                first, step = preview if preview is not None else (direct, 1)
                first_id = f"{vid}-preview{step}" if preview is not None else vid
                painted = direct is not None and early(first, first_id, direct.affine, step)
                with st.spinner("Reading the upload…"):
                    try:
                        result = upload.read_upload(pending["files"], series_uid=uid)
                    except Exception as e:  # noqa: BLE001 - shown in the page, the app keeps running
                        _store_error(key, _problem(e))
                    else:
                        if result.image is None:  # several series: ask, then read the chosen one
                            st.session_state["loaded"] = {"key": key, "image": None, "error": None}
                            series = result.series
                            st.session_state.pop("series", None)
                        else:
                            _store_image(key, result.image, result.source, pending["case"], result.headers)
                            _direct_volume(st.session_state["loaded"], direct, vid)
                            series = series or (result.series if len(result.series) > 1 else None)
                st.session_state["loaded"]["series"] = series
                _mark("read done")
                if not series:  # nothing left to choose: the bytes are not needed any more
                    st.session_state["upload_files"] = {**pending, "files": []}
                if st.session_state["loaded"]["image"] is None and series and uid is None:
                    st.rerun()
                if painted and st.session_state["loaded"].get("nifti_id") != first_id:
                    st.rerun()  # a preview, refused, or read differently: the next run draws what was read
    else:
        cases = demo_cases(
            info, extra=[p for p in os.environ.get("MEDSEG_APP_DEMO", "").split(os.pathsep) if p]
        )
        if not cases:
            st.info(f"No demo cases were found for {info.name} (its dataset folder is not on this machine).")
            return None
        case = st.selectbox(
            "Demo case", [str(c) for c in cases], format_func=lambda p: Path(p).name, key="demo"
        )
        key = ("demo", case)
        if loaded is None or loaded["key"] != key:
            with st.spinner("Reading the case…"):
                try:
                    _store_image(key, upload.read_path(case), "NIfTI", upload.case_name([case]))
                except Exception as e:  # noqa: BLE001
                    _store_error(key, _problem(e))
    loaded = st.session_state.get("loaded")
    if loaded and loaded.get("error"):
        st.error(loaded["error"])
        return None
    return loaded if loaded and loaded.get("image") is not None else None


def download_names(case: str, model: str) -> dict[str, str]:
    """Download file names: case, then model, so two cases or two models never overwrite each other."""
    stem = f"{upload.safe_stem(case)}-{upload.safe_stem(model)}"
    return {"mask": f"{stem}-mask.nii.gz", "seg": f"{stem}-seg.dcm"}


def _dicom_seg(
    result: Result, loaded: dict[str, Any], bundle: Bundle, info: ModelInfo
) -> tuple[bytes | None, str | None, str | None]:
    """(DICOM-SEG bytes, why there is none, a note on generated UIDs) for a DICOM upload."""
    if not loaded.get("headers"):
        reason = (
            "its slices were unevenly spaced and were interpolated onto a regular grid, so the mask's "
            "slices are not the uploaded ones"
            if loaded["image"].meta.get("resampled")
            else "not every slice's header could be read again"
        )
        return None, f"No DICOM-SEG for this series: {reason}. The NIfTI mask is complete.", None
    try:
        export = dicom_seg_export(result.prediction.label, loaded["headers"], bundle.labels, info.name)
    except Exception as e:  # noqa: BLE001 - the NIfTI export still works
        return None, f"No DICOM-SEG for this series: {_problem(e)} The NIfTI mask is complete.", None
    note = None
    if export.generated:
        note = (
            "This series carries no usable "
            + ", ".join(export.generated)
            + " (it was probably anonymised). The DICOM-SEG uses newly generated UIDs for them: it "
            "holds the right slices and geometry, but a PACS will not link it to the series you "
            "uploaded by UID."
        )
    return export.data, None, note


def _ask(name: str, key: Any) -> None:
    st.session_state[name] = key


def model_section(info: ModelInfo, loaded: dict[str, Any]) -> Result | None:
    """The run button, the progress bar, and the result kept for this image and model.

    A click is kept in the session (``run_requested``) until the result is stored, not only in the
    button's one-run value: another rerun (the viewport reporting WebGL or an edit, any widget)
    stops a script run at its next Streamlit call, the progress bar's included, and the next run
    would see the button unpressed. With the request kept, that run starts the model again.
    """
    key = (loaded["key"], str(info.bundle), info.mtime)
    stored = st.session_state.get("result")
    if stored and stored["key"] == key:
        st.session_state.pop("run_requested", None)
        return stored["result"]
    verb = "segmentation" if info.task == "segmentation" else "classification"
    if st.session_state.get("run_requested") != key:
        st.button(
            f"Run {verb} with {info.name}",
            type="primary",
            key="run",
            on_click=_ask,
            args=("run_requested", key),
        )
        return None
    bar = st.progress(0.0, text="Loading the model…")
    try:
        bundle = cached_bundle(str(info.bundle), info.mtime)
        result = run_model(bundle, loaded["image"], progress=lambda f, t: bar.progress(f, text=t))
        labels_view = (
            render.labels_to_view(result.prediction.label[0].numpy(), loaded["view"])
            if result.prediction.label is not None
            else None
        )
        mask = mask_nifti_bytes(result.prediction.label) if result.prediction.label is not None else None
        labels_nifti = (
            viewport.nifti_bytes(
                result.prediction.label[0].numpy(), result.prediction.label.affine.numpy(), True
            )
            if result.prediction.label is not None
            else None
        )
    except Exception as e:  # noqa: BLE001 - a bad input or model is a message, not a crash
        st.session_state.pop("run_requested", None)
        bar.empty()
        st.error(_problem(e))
        return None
    dicom_seg, seg_problem, seg_note = None, None, None
    if mask is not None and loaded["source"] == "DICOM":
        bar.progress(1.0, text="Writing the DICOM-SEG export")
        dicom_seg, seg_problem, seg_note = _dicom_seg(result, loaded, bundle, info)
    bar.empty()
    st.session_state["result"] = {
        "key": key,
        "result": result,
        "labels_view": labels_view,
        "mask": mask,
        "dicom_seg": dicom_seg,
        "dicom_seg_problem": seg_problem,
        "dicom_seg_note": seg_note,
        "names": download_names(loaded["case"], info.name),
        "labels_nifti": labels_nifti,
        "labels_id": viewport.digest(labels_nifti) if labels_nifti is not None else "none",
    }
    st.session_state.pop("run_requested", None)
    if labels_view is not None:
        centre = render.label_centre(labels_view)
        if centre is not None:  # start the panels on the segmented region
            for axis, v in zip("xyz", centre, strict=True):
                st.session_state[f"pos_{axis}"] = v
    st.rerun()
    return None  # pragma: no cover - st.rerun does not return


def display_controls(loaded: dict[str, Any]) -> tuple[float, float, float, bool]:
    st.sidebar.subheader("Display")
    view: render.ViewVolume = loaded["view"]
    options = [AUTO, *render.WINDOW_PRESETS, CUSTOM]
    looks_ct = loaded["info"]["modality"] == "CT" or float(view.data.min()) < -500
    preset = st.sidebar.selectbox(
        "Display window / level (screen only)",
        options,
        index=1 if looks_ct else 0,
        key=f"preset_{looks_ct}",
        help="Changes how the scan is shown, not what the model sees (its input window is in the model card).",
    )
    if preset == AUTO:
        level, width = view.auto_window
    elif preset == CUSTOM:
        c1, c2 = st.sidebar.columns(2)
        level = c1.number_input("Display level", value=float(view.auto_window[0]), key="level")
        width = c2.number_input(
            "Display width", value=float(view.auto_window[1]), min_value=1e-3, key="width"
        )
    else:
        level, width = render.WINDOW_PRESETS[preset]
    opacity = st.sidebar.slider("Overlay opacity", 0.0, 1.0, 0.4, 0.05, key="opacity")
    crosshair = st.sidebar.checkbox("Crosshair", value=True, key="crosshair")
    return float(level), float(width), float(opacity), crosshair


INTERACTIVE, STATIC = "Interactive (WebGL)", "Static panels"


def static_panels(
    loaded: dict[str, Any],
    labels: np.ndarray | None,
    level: float,
    width: float,
    opacity: float,
    crosshair: bool,
) -> None:
    """Three linked panels: each slider moves its plane and the crosshair lines in the other two."""
    view: render.ViewVolume = loaded["view"]
    sizes = dict(zip("xyz", view.shape, strict=True))
    panels = (("axial", "z"), ("coronal", "y"), ("sagittal", "x"))
    cols = st.columns(3)
    for col, (plane, axis) in zip(cols, panels, strict=True):
        key, n = f"pos_{axis}", sizes[axis]
        # widget state is dropped on runs that do not draw the slider; keep it in range
        st.session_state[key] = min(max(int(st.session_state.get(key, n // 2)), 0), n - 1)
        with col:
            st.slider(f"{plane.capitalize()} slice ({axis})", 0, n - 1, key=key)
    point = (st.session_state["pos_x"], st.session_state["pos_y"], st.session_state["pos_z"])
    tag = "overlay" if labels is not None else "image"
    for col, (plane, _) in zip(cols, panels, strict=True):
        img = render.render_slice(view, plane, point, level, width, labels, opacity, crosshair)
        col.image(img, caption=f"{plane} · {tag}", width="stretch")
    st.caption(
        "Radiological convention: the patient's right is on the left in axial and coronal views; "
        "anterior is on the left in the sagittal view. Pixels are scaled to millimetres."
    )


def viewer(
    loaded: dict[str, Any],
    stored: dict[str, Any] | None,
    info: ModelInfo,
    second: dict[str, Any] | None,
    early: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The NiiVue viewport, or the static panels where WebGL (or the vendored viewer) is missing.

    The browser reports whether WebGL 2 works once the viewport starts; until it has (and in
    AppTest, which runs no JavaScript) the static panels are drawn as well, below it: the viewport's
    arguments go out first. Returns the viewport's report (with the user's label edits, if any), or
    None. ``early`` holds the report of a viewport already drawn in this run (the upload's first
    paint, before it was read): it is not drawn twice.
    """
    level, width, opacity, crosshair = display_controls(loaded)
    labels = stored["labels_view"] if stored is not None else None
    mode = st.sidebar.radio("Viewer", [INTERACTIVE, STATIC], key="viewer_mode", horizontal=True)
    show_static = mode == STATIC
    if mode == INTERACTIVE and not viewport.available():
        st.info("The interactive viewer is not part of this installation; showing static panels.")
        show_static = True
    elif mode == INTERACTIVE and early is not None:
        reported = early["report"]
        if reported is None:
            show_static = True
    elif mode == INTERACTIVE:
        side = bool(second and stored is not None and side_by_side(second))
        if "nifti" not in loaded:
            image = loaded["image"]
            loaded["nifti"] = viewport.nifti_bytes(image[0].numpy(), image.affine.numpy())
            loaded["nifti_id"] = viewport.digest(loaded["nifti"])
        lab_bytes, lab_id = None, "none"
        if stored is not None and stored.get("labels_nifti") is not None:
            lab_bytes, lab_id = stored["labels_nifti"], stored["labels_id"]
        _mark("viewport call")
        reported = viewport.viewport(
            loaded["nifti"],
            loaded["nifti_id"],
            loaded["image"].affine.numpy(),
            lab_bytes,
            lab_id,
            viewport.label_info(info.labels) if lab_bytes is not None else [],
            level,
            width,
            opacity,
            editable=lab_bytes is not None,
            second=second["nifti"] if second and lab_bytes is not None and not side else None,
            second_id=second["id"] if second and lab_bytes is not None else "none",
            second_name=second["name"] if second else "",
            volume_name=loaded.get("nifti_name", "scan.nii"),
            side_by_side=side,
            second_filled=second["filled"] if side else None,
            first_name=info.name,
        )
        if reported is None:
            show_static = True  # until the browser says whether WebGL works
        elif not reported.get("webgl", False):
            st.warning(
                "This browser cannot run WebGL, so the interactive viewer is off: these are static "
                "panels (no zoom, no click-to-crosshair)."
            )
            show_static = True
    if show_static:
        static_panels(loaded, labels, level, width, opacity, crosshair)
        return None
    return reported


def metadata_panel(loaded: dict[str, Any]) -> None:
    with st.expander("Image metadata (no patient identifiers are shown)", expanded=False):
        st.table(
            pd.DataFrame([{"field": k, "value": v} for k, v in loaded["info"].items()]),
            hide_index=True,
        )


def results_panel(info: ModelInfo, stored: dict[str, Any], warnings: list[str]) -> None:
    result: Result = stored["result"]
    st.caption(f"{result.model} answered in {result.seconds:.1f} s")
    if warnings:
        st.warning(
            f"This input lies outside what {result.model} was trained on ({len(warnings)} warning(s) "
            "above): do not rely on this result."
        )
    if result.task == "classification":
        probs = result.prediction.probabilities or {}
        best = max(probs, key=probs.get)
        st.success(f"Most likely: **{best}** (p = {probs[best]:.3f})")
        st.table(
            pd.DataFrame([{"class": k, "probability": f"{v:.4f}"} for k, v in probs.items()]),
            hide_index=True,
        )
        return
    legend = " ".join(
        f'<span style="color:{render.colour_hex(k)}">&#9632;</span> {name}'
        for k, name in sorted(info.labels.items())
        if k != 0
    )
    st.markdown(legend, unsafe_allow_html=True)
    st.table(
        pd.DataFrame(
            [
                {"label": v["label"], "voxels": int(v["voxels"]), "volume (mL)": f"{float(v['ml']):.2f}"}
                for v in result.volumes
            ]
        ),
        hide_index=True,
    )
    st.download_button(
        "Download mask (NIfTI, original geometry)",
        data=stored["mask"],
        file_name=stored["names"]["mask"],
        mime="application/gzip",
        key="download",
        on_click="ignore",
    )
    if stored.get("dicom_seg") is not None:
        st.download_button(
            "Download DICOM-SEG (references the uploaded series)",
            data=stored["dicom_seg"],
            file_name=stored["names"]["seg"],
            mime="application/dicom",
            key="download_seg",
            on_click="ignore",
        )
        if stored.get("dicom_seg_note"):
            st.info(stored["dicom_seg_note"])
    elif stored.get("dicom_seg_problem"):
        st.warning(stored["dicom_seg_problem"])


def corrections_panel(
    info: ModelInfo, loaded: dict[str, Any], stored: dict[str, Any], reported: dict[str, Any] | None
) -> None:
    """The user's brush and eraser edits: what changed, and the corrected mask's downloads."""
    st.subheader("Corrections")
    edits = (reported or {}).get("edits")
    if not edits or edits.get("base") != stored["labels_id"] or not edits.get("changed"):
        st.caption(
            "To correct the mask, press Brush or Eraser above the image and paint with the left "
            "button; Undo takes back the last stroke. The corrected mask can then be downloaded here."
        )
        return
    key = (stored["labels_id"], int(edits.get("seq", 0)))
    kept = st.session_state.get("corrected")
    if not kept or kept["key"] != key:
        try:
            label = review.edited_label(stored["result"].prediction.label, edits["runs"])
            kept = {"key": key, "label": label, "mask": mask_nifti_bytes(label), "seg": None, "problem": None}
            if loaded["source"] == "DICOM" and loaded.get("headers"):
                kept["seg"] = dicom_seg_export(
                    label, loaded["headers"], info.labels, info.name, corrected=True
                ).data
        except Exception as e:  # noqa: BLE001 - the page keeps working
            st.error(_problem(e))
            return
        st.session_state["corrected"] = kept
    voxel_ml = float(abs(np.linalg.det(np.asarray(kept["label"].affine)[:3, :3]))) / 1000.0
    fixed = kept["label"][0].numpy()
    steps = int(edits.get("seq", 0))
    st.caption(
        f"{int(edits['changed'])} voxels differ from {info.name}'s mask "
        f"(after {steps} edit step{'s' if steps != 1 else ''}: strokes and undos)."
    )
    st.table(
        pd.DataFrame(
            [
                {
                    "label": name,
                    "voxels": int((fixed == k).sum()),
                    "volume (mL)": f"{int((fixed == k).sum()) * voxel_ml:.2f}",
                }
                for k, name in sorted(info.labels.items())
                if k != 0
            ]
        ),
        hide_index=True,
    )
    stem = stored["names"]["mask"].removesuffix("-mask.nii.gz")
    st.download_button(
        "Download corrected mask (NIfTI, original geometry)",
        data=kept["mask"],
        file_name=f"{stem}-corrected-mask.nii.gz",
        mime="application/gzip",
        key="download_corrected",
        on_click="ignore",
    )
    if kept["seg"] is not None:
        st.download_button(
            "Download corrected DICOM-SEG",
            data=kept["seg"],
            file_name=f"{stem}-corrected-seg.dcm",
            mime="application/dicom",
            key="download_corrected_seg",
            on_click="ignore",
        )


def current_second(loaded: dict[str, Any]) -> dict[str, Any] | None:
    """The second mask kept for this case, if any, and if the Compare choice is its kind (a mask
    file or another model)."""
    second = st.session_state.get("second")
    if not second or second["case"] != loaded["key"]:
        return None
    want = {UPLOAD_MASK: "file", OTHER_MODEL: "model"}.get(st.session_state.get("compare", NO_SECOND))
    return second if second["source"][0] == want else None


def _keep_second(
    loaded: dict[str, Any], source: Any, name: str, label: np.ndarray, affine: np.ndarray
) -> None:
    nifti = viewport.nifti_bytes(review.outline(label), affine, True)  # drawn as edges
    st.session_state["second"] = {
        "case": loaded["key"],
        "source": source,
        "name": name,
        "label": np.asarray(label, dtype=np.uint8),
        "nifti": nifti,
        "filled": viewport.nifti_bytes(label, affine, True),  # for the side-by-side viewer
        "id": viewport.digest(nifti),
    }


NO_SECOND, UPLOAD_MASK, OTHER_MODEL = "Nothing", "A mask file", "Another model"
SIDE, EDGES = "Side by side (two linked viewers)", "As cyan edges on the model's view"


def _view_key(second: dict[str, Any]) -> str:
    return f"second_view_{second['source'][0]}"


def side_by_side(second: dict[str, Any]) -> bool:
    """Whether the second mask gets its own viewer: by default for another model's mask, not for a
    mask file (drawn as edges over the model's); the Compare panel's choice changes it."""
    default = SIDE if second["source"][0] == "model" else EDGES
    return st.session_state.get(_view_key(second), default) == SIDE


def compare_panel(
    info: ModelInfo, loaded: dict[str, Any], stored: dict[str, Any], second: dict[str, Any] | None
) -> None:
    """A second mask beside the model's (an uploaded label file or another model's result) and
    Dice per label between the two."""
    st.subheader("Compare")
    mode = st.radio(
        "Compare the model's mask with", [NO_SECOND, UPLOAD_MASK, OTHER_MODEL], horizontal=True, key="compare"
    )
    if mode == UPLOAD_MASK:
        gen = int(st.session_state.get("mask_gen", 0))
        file = st.file_uploader(
            "A label map of this case (.nii or .nii.gz, on the scan's own voxel grid)",
            type=["nii", "gz"],
            key=f"mask_upload_{gen}",
        )
        if file is not None:
            st.session_state["mask_gen"] = gen + 1  # taken out of the picker: a new file replaces it
            image = loaded["image"]
            try:
                label = review.read_mask(
                    file.name, file.getvalue(), tuple(image.shape[1:]), image.affine.numpy()
                )
            except Exception as e:  # noqa: BLE001 - shown in the page
                st.session_state["mask_problem"] = _problem(e)
            else:
                st.session_state.pop("mask_problem", None)
                _keep_second(loaded, ("file", file.name), file.name, label, image.affine.numpy())
            st.rerun()
        if st.session_state.get("mask_problem"):
            st.error(st.session_state["mask_problem"])
    elif mode == OTHER_MODEL:
        models, _ = all_models()
        others = [m for m in models if m.task == "segmentation" and str(m.bundle) != str(info.bundle)]
        if not others:
            st.info("There is no other segmentation model in the model folders to compare with.")
        else:
            by_path = {str(m.bundle): m for m in others}
            chosen = st.selectbox(
                "Second model", list(by_path), format_func=lambda p: by_path[p].title, key="second_model"
            )
            other = by_path[chosen]
            source = ("model", str(other.bundle), other.mtime)
            want = (loaded["key"], source)  # kept until the result is (see model_section)
            if second is not None and second["source"] == source:
                st.session_state.pop("second_requested", None)
            elif st.session_state.get("second_requested") != want:
                st.button(
                    f"Run {other.name} on this case",
                    key="run_second",
                    on_click=_ask,
                    args=("second_requested", want),
                )
            else:
                bar = st.progress(0.0, text="Loading the second model…")
                try:
                    bundle = cached_bundle(str(other.bundle), other.mtime)
                    result = run_model(bundle, loaded["image"], progress=lambda f, t: bar.progress(f, text=t))
                    label = result.prediction.label
                    if label is None:
                        raise ValueError(f"{other.name} gave no label map")
                except Exception as e:  # noqa: BLE001
                    st.session_state.pop("second_requested", None)
                    bar.empty()
                    st.error(_problem(e))
                else:
                    bar.empty()
                    _keep_second(loaded, source, other.name, label[0].numpy(), label.affine.numpy())
                    st.session_state.pop("second_requested", None)
                    st.rerun()
    second = current_second(loaded)
    if second is None:
        return
    model_mask = stored["result"].prediction.label[0].numpy()
    rows = review.dice_table(model_mask, second["label"], info.labels)
    choice = st.radio(
        "Show the second mask",
        [SIDE, EDGES],
        index=0 if side_by_side(second) else 1,
        key=_view_key(second),
        horizontal=True,
    )
    where = (
        f"Shown in a second viewer to the right of {info.name}'s (crosshair, slices, zoom and window linked)"
        if choice == SIDE
        else f"Shown in cyan beside {info.name}'s mask"
    )
    st.caption(f"{where}: {second['name']}. Dice = 2|A∩B| / (|A| + |B|), 1 is identical, 0 no overlap.")
    st.table(
        pd.DataFrame(
            [
                {
                    "label": r["label"],
                    f"{info.name} voxels": r["voxels A"],
                    f"{second['name']} voxels": r["voxels B"],
                    "Dice": "both empty" if r["Dice"] is None else f"{r['Dice']:.3f}",
                }
                for r in rows
            ]
        ),
        hide_index=True,
    )


def trust_section(info: ModelInfo, loaded: dict[str, Any]) -> list[str]:
    """Warnings where this input lies outside what the model was trained on (kept per image and model)."""
    key = (loaded["key"], str(info.bundle), info.mtime)
    kept = st.session_state.get("trust")
    if not kept or kept["key"] != key:
        facts = cached_facts(info)
        image = loaded["image"]
        warnings = trust.input_warnings(
            info,
            facts,
            image[0].numpy(),
            image.affine.numpy(),
            str(image.meta.get("modality", "") or ""),
            same_dataset=loaded["key"][0] == "demo",
        )
        kept = {"key": key, "warnings": warnings, "note": trust.facts_note(facts)}
        st.session_state["trust"] = kept
    for w in kept["warnings"]:
        st.warning(w, icon="⚠️")
    if kept["warnings"] and kept["note"]:
        st.caption(kept["note"])
    return kept["warnings"]


def main() -> None:
    st.set_page_config(page_title="medseg viewer", layout="wide")
    info = sidebar_models()
    if info is None:
        return
    # the page's two parts exist before anything is read, so the viewport can be drawn into the left
    # column while the upload is still being read (into ``head``, above it)
    head = st.container()
    top = st.columns([2, 1])
    early: dict[str, Any] = {}

    def paint_early(volume: upload.ViewerNifti, vid: str, affine: np.ndarray, step: int) -> bool:
        if st.session_state.get("viewer_mode", INTERACTIVE) != INTERACTIVE or not viewport.available():
            return False
        with top[0]:
            _mark("viewport call")
            early["report"] = viewport.viewport(
                volume.data,
                vid,
                affine,
                None,
                "none",
                [],
                None,
                None,
                0.4,
                volume_name=volume.name,
                preview=step,
            )
        return True

    with head:
        loaded = input_section(info, early=paint_early)
    if loaded is None:
        return
    with head:
        warnings = trust_section(info, loaded)
        result = model_section(info, loaded)
    stored = st.session_state.get("result") if result is not None else None
    second = current_second(loaded) if stored is not None else None
    with top[0]:  # drawn first: the viewport's report (the user's edits) feeds the panels beside it
        reported = viewer(loaded, stored, info, second, early or None)
    with top[1]:
        metadata_panel(loaded)
        if stored is not None:
            results_panel(info, stored, warnings)
            if stored["result"].task == "segmentation" and stored["result"].prediction.label is not None:
                corrections_panel(info, loaded, stored, reported)
                compare_panel(info, loaded, stored, second)
    st.caption("Research use only; not for clinical decisions.")
    _mark("script end")


main()

"""The medseg viewer page: ``medseg app`` (or ``streamlit run apps/app.py``) serves it on localhost.

Streamlit reruns this script on every interaction. What is slow happens once and is kept: bundles
in ``st.cache_resource``, the model list in ``st.cache_data`` (briefly, so new runs appear), the
loaded image, its RAS view and the model's result in the session's state. A slider move therefore
only cuts and draws three slices.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import streamlit as st

from medseg.apps import render, upload
from medseg.apps.export import mask_dicom_seg_bytes, mask_nifti_bytes
from medseg.apps.inference import Result, run_model
from medseg.apps.registry import ModelInfo, default_folders, demo_cases, list_models
from medseg.bundle import Bundle, load_bundle
from medseg.errors import MedsegError

log = logging.getLogger("medseg.apps")

AUTO, CUSTOM = "Auto (1st–99th percentile)", "Custom"


@st.cache_resource(show_spinner="Loading the model…", max_entries=4)
def cached_bundle(path: str, mtime: float) -> Bundle:
    """One network per bundle file version, shared by every session of this server."""
    del mtime  # part of the cache key only
    return load_bundle(path)


@st.cache_data(ttl=20, show_spinner=False)
def cached_models(folders: tuple[str, ...]) -> tuple[list[ModelInfo], list[str]]:
    return list_models(list(folders))


def _problem(e: BaseException) -> str:
    """A message for the page: medseg's own, or the exception's type and text (never a traceback)."""
    if isinstance(e, MedsegError):
        return str(e)
    log.exception("unexpected error in the viewer")
    return f"{type(e).__name__}: {e}"


def sidebar_models() -> ModelInfo | None:
    st.sidebar.title("medseg viewer")
    extra = st.sidebar.text_input(
        "Another model folder",
        key="extra_folder",
        help="A bundle folder, a run folder, or a folder of runs on this machine.",
    )
    folders = [str(p) for p in default_folders()] + ([extra.strip()] if extra.strip() else [])
    models, problems = cached_models(tuple(folders))
    for p in problems:
        st.sidebar.warning(p)
    if not models:
        st.sidebar.error(
            f"No trained models in {', '.join(folders)}. Train one with `medseg train`, "
            "or name a folder that holds a bundle."
        )
        return None
    by_path = {str(m.bundle): m for m in models}
    chosen = st.sidebar.selectbox("Model", list(by_path), format_func=lambda p: by_path[p].title, key="model")
    info = by_path[chosen]
    labels = ", ".join(f"{k}: {v}" for k, v in sorted(info.labels.items()))
    st.sidebar.markdown(
        f"**Task** {info.task} ({info.network})  \n**Labels** {labels}  \n"
        f"**Input spacing** {' × '.join(f'{s:g}' for s in info.spacing)} mm  \n"
        f"**Patch** {' × '.join(str(p) for p in info.patch)}  \n"
        f"**Intensities** {info.intensity or f'window {info.window[0]:g} … {info.window[1]:g}'}"
    )
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
    return info


def _reset_view(view: render.ViewVolume) -> None:
    for axis, n in zip("xyz", view.shape, strict=True):
        st.session_state[f"pos_{axis}"] = n // 2


def _store_image(key: Any, image: Any, source: str, headers: list | None = None) -> None:
    view = render.to_view(image[0].numpy(), image.affine.numpy())
    st.session_state["loaded"] = {
        "key": key,
        "image": image,
        "source": source,
        "view": view,
        "info": upload.describe(image, source),
        "headers": headers,
        "error": None,
    }
    st.session_state.pop("result", None)
    _reset_view(view)


def _store_error(key: Any, message: str) -> None:
    st.session_state["loaded"] = {"key": key, "image": None, "error": message}
    st.session_state.pop("result", None)


def input_section(info: ModelInfo) -> dict[str, Any] | None:
    """Upload or demo case -> the loaded image in session state (loaded once per input)."""
    mode = st.radio("Input", ["Upload", "Demo case"], horizontal=True, key="input_mode")
    loaded = st.session_state.get("loaded")
    if mode == "Upload":
        limit = upload.max_upload_mb()
        files = st.file_uploader(
            f"A NIfTI file (.nii, .nii.gz), a zip of a DICOM series folder, or several DICOM files "
            f"(up to {limit} MB; nothing leaves this machine)",
            accept_multiple_files=True,
            key="upload",
            max_upload_size=limit,
        )
        if not files:
            return None
        base = tuple((f.file_id, f.size) for f in files)
        # several series were found in this upload on an earlier run: the user picks one
        series = loaded.get("series") if loaded and loaded["key"][0] == base else None
        uid = None
        if series:
            uid = st.selectbox(
                "This upload holds several series; choose one",
                [c.uid for c in series],
                format_func=lambda u: next(c.label for c in series if c.uid == u),
                key="series",
            )
        key = (base, uid)
        if loaded is None or loaded["key"] != key:
            with st.spinner("Reading the upload…"):
                try:
                    result = upload.read_upload(
                        [upload.UploadedBytes(f.name, f.getvalue()) for f in files], series_uid=uid
                    )
                except Exception as e:  # noqa: BLE001 - shown in the page, the app keeps running
                    _store_error(key, _problem(e))
                else:
                    if result.image is None:  # several series: ask, then read the chosen one
                        st.session_state["loaded"] = {"key": key, "image": None, "error": None}
                        series = result.series
                        st.session_state.pop("series", None)
                    else:
                        _store_image(key, result.image, result.source, result.headers)
                        series = series or (result.series if len(result.series) > 1 else None)
            st.session_state["loaded"]["series"] = series
            if st.session_state["loaded"]["image"] is None and series and uid is None:
                st.rerun()
    else:
        cases = demo_cases(
            info, extra=[p for p in os.environ.get("MEDSEG_APP_DEMO", "").split(os.pathsep) if p]
        )
        if not cases:
            st.info(f"No demo cases found for {info.name} (looked in its dataset folder {info.data_dir!r}).")
            return None
        case = st.selectbox(
            "Demo case", [str(c) for c in cases], format_func=lambda p: Path(p).name, key="demo"
        )
        key = ("demo", case)
        if loaded is None or loaded["key"] != key:
            with st.spinner("Reading the case…"):
                try:
                    _store_image(key, upload.read_path(case), "NIfTI")
                except Exception as e:  # noqa: BLE001
                    _store_error(key, _problem(e))
    loaded = st.session_state.get("loaded")
    if loaded and loaded.get("error"):
        st.error(loaded["error"])
        return None
    return loaded if loaded and loaded.get("image") is not None else None


def model_section(info: ModelInfo, loaded: dict[str, Any]) -> Result | None:
    """The run button, the progress bar, and the result kept for this image and model."""
    key = (loaded["key"], str(info.bundle), info.mtime)
    stored = st.session_state.get("result")
    if stored and stored["key"] == key:
        return stored["result"]
    verb = "segmentation" if info.task == "segmentation" else "classification"
    if not st.button(f"Run {verb} with {info.name}", type="primary", key="run"):
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
    except Exception as e:  # noqa: BLE001 - a bad input or model is a message, not a crash
        bar.empty()
        st.error(_problem(e))
        return None
    dicom_seg, seg_problem = None, None
    if mask is not None and loaded.get("headers"):
        bar.progress(1.0, text="Writing the DICOM-SEG export")
        try:
            dicom_seg = mask_dicom_seg_bytes(
                result.prediction.label, loaded["headers"], bundle.labels, info.name
            )
        except Exception as e:  # noqa: BLE001 - the NIfTI export still works
            seg_problem = f"No DICOM-SEG export for this series: {_problem(e)}"
    bar.empty()
    st.session_state["result"] = {
        "key": key,
        "result": result,
        "labels_view": labels_view,
        "mask": mask,
        "dicom_seg": dicom_seg,
        "dicom_seg_problem": seg_problem,
    }
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
        "Window / level", options, index=1 if looks_ct else 0, key=f"preset_{looks_ct}"
    )
    if preset == AUTO:
        level, width = view.auto_window
    elif preset == CUSTOM:
        c1, c2 = st.sidebar.columns(2)
        level = c1.number_input("Level", value=float(view.auto_window[0]), key="level")
        width = c2.number_input("Width", value=float(view.auto_window[1]), min_value=1e-3, key="width")
    else:
        level, width = render.WINDOW_PRESETS[preset]
    opacity = st.sidebar.slider("Overlay opacity", 0.0, 1.0, 0.4, 0.05, key="opacity")
    crosshair = st.sidebar.checkbox("Crosshair", value=True, key="crosshair")
    return float(level), float(width), float(opacity), crosshair


def viewer(loaded: dict[str, Any], labels: np.ndarray | None) -> None:
    """Three linked panels: each slider moves its plane and the crosshair lines in the other two."""
    level, width, opacity, crosshair = display_controls(loaded)
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


def metadata_panel(loaded: dict[str, Any]) -> None:
    with st.expander("Image metadata (no patient identifiers are shown)", expanded=False):
        st.table(
            pd.DataFrame([{"field": k, "value": v} for k, v in loaded["info"].items()]),
            hide_index=True,
        )


def results_panel(info: ModelInfo, stored: dict[str, Any]) -> None:
    result: Result = stored["result"]
    st.caption(f"{result.model} answered in {result.seconds:.1f} s")
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
        file_name=f"{result.model}-mask.nii.gz",
        mime="application/gzip",
        key="download",
        on_click="ignore",
    )
    if stored.get("dicom_seg") is not None:
        st.download_button(
            "Download DICOM-SEG (references the uploaded series)",
            data=stored["dicom_seg"],
            file_name=f"{result.model}-seg.dcm",
            mime="application/dicom",
            key="download_seg",
            on_click="ignore",
        )
    elif stored.get("dicom_seg_problem"):
        st.warning(stored["dicom_seg_problem"])


def main() -> None:
    st.set_page_config(page_title="medseg viewer", layout="wide")
    info = sidebar_models()
    if info is None:
        return
    loaded = input_section(info)
    if loaded is None:
        return
    result = model_section(info, loaded)
    stored = st.session_state.get("result") if result is not None else None
    top = st.columns([2, 1])
    with top[1]:
        metadata_panel(loaded)
        if stored is not None:
            results_panel(info, stored)
    with top[0]:
        viewer(loaded, stored["labels_view"] if stored is not None else None)
    st.caption("Research use only; not for clinical decisions.")


main()

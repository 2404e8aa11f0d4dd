"""The image: the NiiVue viewport, or three static panels, and the sidebar's display controls."""

from __future__ import annotations

from typing import Any

import numpy as np
import streamlit as st

from medseg.apps import render, upload, viewport
from medseg.apps.panels.compare import side_by_side
from medseg.apps.registry import ModelInfo
from medseg.apps.state import CaseResult, LoadedCase, SecondMask
from medseg.apps.timings import mark

AUTO, CUSTOM = "Auto (1st–99th percentile)", "Custom"
WIDE, FULL = "Wide (0.1th–99.9th percentile)", "Full range (min–max)"
INTERACTIVE, STATIC = "Interactive (WebGL)", "Static panels"
# the viewport's widget key: its last report (edits, a dragged window) is in the session under it
VIEWPORT_KEY = "viewport"


def last_report() -> dict[str, Any]:
    """The viewport's last report ({} before it has sent one), readable before it is drawn."""
    try:
        value = st.session_state.get(VIEWPORT_KEY)
    except Exception:  # noqa: BLE001 - not a widget value yet in this session
        return {}
    return value if isinstance(value, dict) else {}


def looks_ct(loaded: LoadedCase) -> bool:
    """CT by its DICOM modality, or by intensities in Hounsfield units (air near -1000)."""
    return loaded.info.get("modality") == "CT" or float(loaded.view.data.min()) < -500


def window_presets(loaded: LoadedCase) -> dict[str, tuple[float, float]]:
    """(level, width) per choice: CT gets the CT presets (Hounsfield units), anything else windows
    from the scan's own intensities (percentiles of a strided sample, kept per case)."""
    view = loaded.view
    if looks_ct(loaded):
        return {AUTO: view.auto_window, **render.WINDOW_PRESETS}
    kept = st.session_state.get("mr_windows")
    if not kept or kept[0] != loaded.key:
        step = max(1, int(round((view.data.size / 2_000_000) ** (1 / 3))))
        sample = view.data[::step, ::step, ::step]
        lo, wlo, whi, hi = (float(v) for v in np.percentile(sample, [0, 0.1, 99.9, 100]))
        kept = (
            loaded.key,
            {WIDE: ((wlo + whi) / 2, max(whi - wlo, 1e-3)), FULL: ((lo + hi) / 2, max(hi - lo, 1e-3))},
        )
        st.session_state["mr_windows"] = kept
    return {AUTO: view.auto_window, **kept[1]}


def _case_tag(loaded: LoadedCase) -> str:
    """A short name of the case for the window widgets' keys: a new case starts from its defaults."""
    return viewport.digest(repr(loaded.key).encode())


def _window_keys(loaded: LoadedCase) -> tuple[str, str, str]:
    tag = _case_tag(loaded)
    return f"preset_{tag}", f"level_{tag}", f"width_{tag}"


def _apply_preset(loaded: LoadedCase) -> None:
    """The preset box changed: its level and width into the number boxes (Custom keeps theirs)."""
    preset, level, width = _window_keys(loaded)
    choice = st.session_state[preset]
    if choice != CUSTOM:
        st.session_state[level], st.session_state[width] = (float(v) for v in window_presets(loaded)[choice])


def _typed_window(loaded: LoadedCase) -> None:
    """A level or width typed in: the preset box says Custom."""
    st.session_state[_window_keys(loaded)[0]] = CUSTOM


def _take_dragged_window(loaded: LoadedCase, presets: dict[str, tuple[float, float]]) -> None:
    """Set the window widgets before they are drawn: the case's defaults the first time, then a
    window the user dragged in the viewport (reported once per drag) as Custom."""
    preset, level, width = _window_keys(loaded)
    if preset not in st.session_state:
        first = next(iter(render.WINDOW_PRESETS)) if looks_ct(loaded) else AUTO
        st.session_state[preset] = first
        st.session_state[level], st.session_state[width] = (float(v) for v in presets[first])
    dragged = last_report().get("window")
    seen = st.session_state.get("window_seen")
    if dragged and dragged.get("seq") != seen and dragged.get("volume") in (loaded.nifti_id, None, ""):
        st.session_state["window_seen"] = dragged.get("seq")
        st.session_state[preset] = CUSTOM
        st.session_state[level] = float(dragged["level"])
        st.session_state[width] = max(float(dragged["width"]), 1e-3)


def display_controls(loaded: LoadedCase) -> tuple[float, float, float, bool]:
    """The sidebar's display window, overlay opacity and crosshair: (level, width, opacity, crosshair).

    The presets are the modality's (CT: Hounsfield windows; other scans: percentiles of their own
    intensities); level and width are always shown and can be typed; a typed value or a window
    dragged in the viewport makes the preset box say Custom, and choosing a preset applies it again.
    """
    st.sidebar.subheader("Display")
    presets = window_presets(loaded)
    _take_dragged_window(loaded, presets)
    preset, level_key, width_key = _window_keys(loaded)
    st.sidebar.selectbox(
        "Display window / level (screen only)",
        [*presets, CUSTOM],
        key=preset,
        on_change=_apply_preset,
        args=(loaded,),
        help="Changes how the scan is shown, not what the model sees (its input window is in the model card). "
        "Right-drag on the image changes it too.",
    )
    c1, c2 = st.sidebar.columns(2)
    level = c1.number_input(
        "Display level", key=level_key, on_change=_typed_window, args=(loaded,), format="%g"
    )
    width = c2.number_input(
        "Display width", min_value=1e-3, key=width_key, on_change=_typed_window, args=(loaded,), format="%g"
    )
    opacity = st.sidebar.slider("Overlay opacity", 0.0, 1.0, 0.4, 0.05, key="opacity")
    crosshair = st.sidebar.checkbox("Crosshair", value=True, key="crosshair")
    return float(level), float(width), float(opacity), crosshair


def static_panels(
    loaded: LoadedCase,
    labels: np.ndarray | None,
    level: float,
    width: float,
    opacity: float,
    crosshair: bool,
) -> None:
    """Three linked panels: each slider moves its plane and the crosshair lines in the other two."""
    view = loaded.view
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


def interactive_wanted() -> bool:
    """Whether the viewport is to be drawn (the Viewer choice, and the vendored NiiVue present)."""
    return st.session_state.get("viewer_mode", INTERACTIVE) == INTERACTIVE and viewport.available()


def first_paint(
    volume: upload.ViewerNifti, volume_id: str, affine: np.ndarray, step: int
) -> dict[str, Any] | None:
    """Draw an upload's first paint, before the server has read it: the scan alone, in NiiVue's own
    window (``step`` > 1: a reduced-resolution preview). Returns the viewport's report."""
    mark("viewport call")
    spec = viewport.ViewportSpec(volume.data, volume_id, affine, volume_name=volume.name, preview=step)
    return viewport.viewport(spec, key=VIEWPORT_KEY)


def case_spec(
    loaded: LoadedCase,
    stored: CaseResult | None,
    info: ModelInfo,
    second: SecondMask | None,
    window: tuple[float, float, float],
) -> viewport.ViewportSpec:
    """The viewport of the loaded case: the scan, the model's label map (editable) once there is
    one, and a second mask as edges or in its own linked viewer. ``window`` is (level, width, opacity)."""
    side = bool(second and stored is not None and side_by_side(second))
    if loaded.nifti is None:
        image = loaded.image
        loaded.nifti = viewport.nifti_bytes(image[0].numpy(), image.affine.numpy())
        loaded.nifti_id = viewport.digest(loaded.nifti)
    lab_bytes, lab_id = None, "none"
    if stored is not None and stored.labels_nifti is not None:
        lab_bytes, lab_id = stored.labels_nifti, stored.labels_id
    level, width, opacity = window
    return viewport.ViewportSpec(
        volume=loaded.nifti,
        volume_id=loaded.nifti_id,
        affine=loaded.image.affine.numpy(),
        volume_name=loaded.nifti_name,
        labels=lab_bytes,
        labels_id=lab_id,
        labels_meta=viewport.label_info(info.labels) if lab_bytes is not None else [],
        level=level,
        width=width,
        opacity=opacity,
        editable=lab_bytes is not None,
        second=second.nifti if second and lab_bytes is not None and not side else None,
        second_id=second.id if second and lab_bytes is not None else "none",
        second_name=second.name if second else "",
        side_by_side=side,
        second_filled=second.filled if side else None,
        first_name=info.name,
    )


def viewer(
    loaded: LoadedCase,
    stored: CaseResult | None,
    info: ModelInfo,
    second: SecondMask | None,
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
    labels = stored.labels_view if stored is not None else None
    mode = st.sidebar.radio("Viewer", [INTERACTIVE, STATIC], key="viewer_mode", horizontal=True)
    show_static = mode == STATIC
    if mode == INTERACTIVE and not viewport.available():
        st.info("The interactive viewer is not part of this installation; showing static panels.")
        show_static = True
    elif mode == INTERACTIVE and early is not None:
        reported = early["report"]
        if reported is None:
            show_static = True
        else:
            # the first paint went out before the scan was read, in NiiVue's own window: draw the
            # page once more, now with the new case's display window (its preset box's)
            st.rerun()
    elif mode == INTERACTIVE:
        spec = case_spec(loaded, stored, info, second, (level, width, opacity))
        mark("viewport call")
        reported = viewport.viewport(spec, key=VIEWPORT_KEY)
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

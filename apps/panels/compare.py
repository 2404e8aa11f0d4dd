"""The Compare panel: a second mask beside the model's (an uploaded label file or another model's
result) and Dice per label between the two."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from medseg.apps import review, viewport
from medseg.apps.cache import all_models, cached_bundle
from medseg.apps.inference import run_model
from medseg.apps.messages import problem
from medseg.apps.registry import ModelInfo
from medseg.apps.state import (
    CORRECTED,
    MASK_GEN,
    MASK_PROBLEM,
    SECOND,
    SECOND_REQUESTED,
    CaseResult,
    LoadedCase,
    SecondMask,
)

NO_SECOND, UPLOAD_MASK, OTHER_MODEL = "Nothing", "A mask file", "Another model"
MODEL_MASK, CORRECTED_MASK = "The model's mask", "The corrected mask"
SIDE, EDGES = "Side by side (two linked viewers)", "As cyan edges on the model's view"


def current_second(loaded: LoadedCase) -> SecondMask | None:
    """The second mask kept for this case, if any, and if the Compare choice is its kind (a mask
    file or another model)."""
    second = SECOND.get()
    if not second or second.case != loaded.key:
        return None
    want = {UPLOAD_MASK: "file", OTHER_MODEL: "model"}.get(st.session_state.get("compare", NO_SECOND))
    return second if second.source[0] == want else None


def keep_second(loaded: LoadedCase, source: tuple, name: str, label: np.ndarray, affine: np.ndarray) -> None:
    nifti = viewport.nifti_bytes(review.outline(label), affine, True)  # drawn as edges
    SECOND.set(
        SecondMask(
            case=loaded.key,
            source=source,
            name=name,
            label=np.asarray(label, dtype=np.uint8),
            nifti=nifti,
            filled=viewport.nifti_bytes(label, affine, True),
            id=viewport.digest(nifti),
        )
    )


def _view_key(second: SecondMask) -> str:
    return f"second_view_{second.source[0]}"


def side_by_side(second: SecondMask) -> bool:
    """Whether the second mask gets its own viewer: by default for another model's mask, not for a
    mask file (drawn as edges over the model's); the Compare panel's choice changes it."""
    default = SIDE if second.source[0] == "model" else EDGES
    return st.session_state.get(_view_key(second), default) == SIDE


def _mask_file(loaded: LoadedCase) -> None:
    """The mask file picker; a file read is kept as the second mask (or why it could not be)."""
    gen = int(MASK_GEN.get() or 0)
    file = st.file_uploader(
        "A label map of this case (.nii or .nii.gz, on the scan's own voxel grid)",
        type=["nii", "gz"],
        key=f"mask_upload_{gen}",
    )
    if file is not None:
        MASK_GEN.set(gen + 1)  # taken out of the picker: a new file replaces it
        image = loaded.image
        try:
            label = review.read_mask(file.name, file.getvalue(), tuple(image.shape[1:]), image.affine.numpy())
        except Exception as e:  # noqa: BLE001 - shown in the page
            MASK_PROBLEM.set(problem(e))
        else:
            MASK_PROBLEM.clear()
            keep_second(loaded, ("file", file.name), file.name, label, image.affine.numpy())
        st.rerun()
    if MASK_PROBLEM.get():
        st.error(MASK_PROBLEM.get())


def _run_second(loaded: LoadedCase, other: ModelInfo, source: tuple) -> None:
    """Run ``other`` on the case and keep its label map as the second mask."""
    bar = st.progress(0.0, text="Loading the second model…")
    try:
        bundle = cached_bundle(str(other.bundle), other.mtime)
        result = run_model(bundle, loaded.image, progress=lambda f, t: bar.progress(f, text=t))
        label = result.prediction.label
        if label is None:
            raise ValueError(f"{other.name} gave no label map")
    except Exception as e:  # noqa: BLE001
        SECOND_REQUESTED.clear()
        bar.empty()
        st.error(problem(e))
    else:
        bar.empty()
        keep_second(loaded, source, other.name, label[0].numpy(), label.affine.numpy())
        SECOND_REQUESTED.clear()
        st.rerun()


def _other_model(info: ModelInfo, loaded: LoadedCase, second: SecondMask | None) -> None:
    """The second model picker and its run button; a click is kept as ``model_section``'s is."""
    models, _ = all_models()
    others = [m for m in models if m.task == "segmentation" and str(m.bundle) != str(info.bundle)]
    if not others:
        st.info("There is no other segmentation model in the model folders to compare with.")
        return
    by_path = {str(m.bundle): m for m in others}
    chosen = st.selectbox(
        "Second model", list(by_path), format_func=lambda p: by_path[p].title, key="second_model"
    )
    other = by_path[chosen]
    source = ("model", str(other.bundle), other.mtime)
    want = (loaded.key, source)  # kept until the result is
    if second is not None and second.source == source:
        SECOND_REQUESTED.clear()
    elif SECOND_REQUESTED.get() != want:
        st.button(
            f"Run {other.name} on this case", key="run_second", on_click=SECOND_REQUESTED.set, args=(want,)
        )
    else:
        _run_second(loaded, other, source)


def current_correction(stored: CaseResult) -> np.ndarray | None:
    """The corrected mask (I, J, K) the Corrections panel holds for the viewport's latest edits of
    this result's label map, or None (no edits, every edit undone, or kept for an older step)."""
    # the viewport's last report, under its widget key (viewer.VIEWPORT_KEY; viewer imports this module)
    edits = (st.session_state.get("viewport") or {}).get("edits") or {}
    kept = CORRECTED.get()
    if not edits.get("changed") or edits.get("base") != stored.labels_id or kept is None:
        return None
    if kept.key != (stored.labels_id, int(edits.get("seq", 0))):
        return None
    return np.asarray(kept.label[0].numpy(), dtype=np.uint8)


def _scored_mask(info: ModelInfo, stored: CaseResult) -> tuple[np.ndarray, str]:
    """The mask Compare scores and its name: the model's, or (when the Corrections panel holds one
    and the user picks it) the corrected one."""
    model_mask = stored.result.prediction.label[0].numpy()
    corrected = current_correction(stored)
    if corrected is None:
        return model_mask, info.name
    which = st.radio(
        "Score",
        [MODEL_MASK, CORRECTED_MASK],
        key="compare_scored",
        horizontal=True,
        help="The corrected mask is the model's with your brush and eraser edits (Corrections panel).",
    )
    if which == CORRECTED_MASK:
        return corrected, f"{info.name} (corrected)"
    return model_mask, info.name


def _dice(info: ModelInfo, stored: CaseResult, second: SecondMask) -> None:
    """How the second mask is shown, and Dice per label between it and the model's (or the
    corrected) mask."""
    mask, mask_name = _scored_mask(info, stored)
    rows = review.dice_table(mask, second.label, info.labels)
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
    st.caption(f"{where}: {second.name}. Dice = 2|A∩B| / (|A| + |B|), 1 is identical, 0 no overlap.")
    st.table(
        pd.DataFrame(
            [
                {
                    "label": r["label"],
                    f"{mask_name} voxels": r["voxels A"],
                    f"{second.name} voxels": r["voxels B"],
                    "Dice": "both empty" if r["Dice"] is None else f"{r['Dice']:.3f}",
                }
                for r in rows
            ]
        ),
        hide_index=True,
    )


def compare_panel(info: ModelInfo, loaded: LoadedCase, stored: CaseResult, second: SecondMask | None) -> None:
    """A second mask beside the model's (an uploaded label file or another model's result) and
    Dice per label between the two."""
    st.subheader("Compare")
    mode = st.radio(
        "Compare the model's mask with", [NO_SECOND, UPLOAD_MASK, OTHER_MODEL], horizontal=True, key="compare"
    )
    if mode == UPLOAD_MASK:
        _mask_file(loaded)
    elif mode == OTHER_MODEL:
        _other_model(info, loaded, second)
    second = current_second(loaded)
    if second is not None:
        _dice(info, stored, second)

"""The Corrections panel: the user's brush and eraser edits, what they changed, the corrected downloads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import streamlit as st

from medseg.apps import review
from medseg.apps.export import dicom_seg_export, mask_nifti_bytes
from medseg.apps.messages import problem
from medseg.apps.panels.export import case_seg_sources
from medseg.apps.registry import ModelInfo
from medseg.apps.state import CORRECTED, CaseResult, Correction, LoadedCase
from medseg.datasets.nifti import nifti_codes


def _corrected(
    info: ModelInfo, loaded: LoadedCase, stored: CaseResult, edits: dict[str, Any]
) -> Correction | None:
    """The model's mask with ``edits`` applied, kept per label map and edit step (None on failure,
    shown in the page)."""
    key = (stored.labels_id, int(edits.get("seq", 0)))
    kept = CORRECTED.get()
    if kept and kept.key == key:
        return kept
    try:
        label = review.edited_label(stored.result.prediction.label, edits["runs"])
        kept = Correction(key=key, label=label, mask=mask_nifti_bytes(label, nifti_codes(loaded.image)))
        if loaded.source == "DICOM" and loaded.headers:
            sources = case_seg_sources(loaded)  # the same referenced UIDs as the model's SEG
            kept.seg = dicom_seg_export(label, sources, info.labels, info.name, corrected=True).data
    except Exception as e:  # noqa: BLE001 - the page keeps working
        st.error(problem(e))
        return None
    CORRECTED.set(kept)
    return kept


def _volume_table(info: ModelInfo, kept: Correction) -> None:
    """Voxels and millilitres per foreground label of the corrected mask."""
    voxel_ml = float(abs(np.linalg.det(np.asarray(kept.label.affine)[:3, :3]))) / 1000.0
    fixed = kept.label[0].numpy()
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


def _downloads(stored: CaseResult, kept: Correction) -> None:
    stem = stored.names["mask"].removesuffix("-mask.nii.gz")
    st.download_button(
        "Download corrected mask (NIfTI, original geometry)",
        data=kept.mask,
        file_name=f"{stem}-corrected-mask.nii.gz",
        mime="application/gzip",
        key="download_corrected",
        on_click="ignore",
    )
    if kept.seg is not None:
        st.download_button(
            "Download corrected DICOM-SEG",
            data=kept.seg,
            file_name=f"{stem}-corrected-seg.dcm",
            mime="application/dicom",
            key="download_corrected_seg",
            on_click="ignore",
        )


def corrections_panel(
    info: ModelInfo, loaded: LoadedCase, stored: CaseResult, reported: dict[str, Any] | None
) -> None:
    """The user's brush and eraser edits (from the viewport's report): what changed, and the
    corrected mask's downloads."""
    st.subheader("Corrections")
    edits = (reported or {}).get("edits")
    if not edits or edits.get("base") != stored.labels_id or not edits.get("changed"):
        st.caption(
            "To correct the mask, press Brush or Eraser above the image and paint with the left "
            "button; Undo takes back the last stroke. The corrected mask can then be downloaded here."
        )
        return
    kept = _corrected(info, loaded, stored, edits)
    if kept is None:
        return
    steps = int(edits.get("seq", 0))
    st.caption(
        f"{int(edits['changed'])} voxels differ from {info.name}'s mask "
        f"(after {steps} edit step{'s' if steps != 1 else ''}: strokes and undos)."
    )
    _volume_table(info, kept)
    _downloads(stored, kept)

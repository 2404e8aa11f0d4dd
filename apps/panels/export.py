"""The result's downloads: the mask as NIfTI and, for a DICOM upload, as DICOM-SEG."""

from __future__ import annotations

import streamlit as st

from medseg.apps import upload
from medseg.apps.export import SegSources, dicom_seg_export, seg_sources
from medseg.apps.inference import Result
from medseg.apps.messages import problem
from medseg.apps.registry import ModelInfo
from medseg.apps.state import CaseResult, LoadedCase
from medseg.bundle.load import Bundle


def download_names(case: str, model: str) -> dict[str, str]:
    """Download file names: case, then model, so two cases or two models never overwrite each other."""
    stem = f"{upload.safe_stem(case)}-{upload.safe_stem(model)}"
    return {"mask": f"{stem}-mask.nii.gz", "seg": f"{stem}-seg.dcm"}


def case_seg_sources(loaded: LoadedCase) -> SegSources:
    """The loaded DICOM case's headers as its DICOM-SEGs reference them, made once per case: the
    model's SEG and every corrected SEG of an anonymised series share the UIDs made up for it."""
    if loaded.seg_sources is None:
        loaded.seg_sources = seg_sources(loaded.headers or [])
    return loaded.seg_sources


def dicom_seg(
    result: Result, loaded: LoadedCase, bundle: Bundle, info: ModelInfo
) -> tuple[bytes | None, str | None, str | None]:
    """(DICOM-SEG bytes, why there is none, a note on generated UIDs) for a DICOM upload."""
    if not loaded.headers:
        reason = (
            "its slices were unevenly spaced and were interpolated onto a regular grid, so the mask's "
            "slices are not the uploaded ones"
            if loaded.image.meta.get("resampled")
            else "not every slice's header could be read again"
        )
        return None, f"No DICOM-SEG for this series: {reason}. The NIfTI mask is complete.", None
    try:
        export = dicom_seg_export(result.prediction.label, case_seg_sources(loaded), bundle.labels, info.name)
    except Exception as e:  # noqa: BLE001 - the NIfTI export still works
        return None, f"No DICOM-SEG for this series: {problem(e)} The NIfTI mask is complete.", None
    note = None
    if export.generated:
        note = (
            "This series carries no usable "
            + ", ".join(export.generated)
            + " (it was probably anonymised). The DICOM-SEG uses newly generated UIDs for them: it "
            "holds the right slices and geometry, but a PACS will not link it to the series you "
            "uploaded by UID. Every DICOM-SEG of this case (a corrected one too) uses the same ones."
        )
    return export.data, None, note


def download_buttons(stored: CaseResult) -> None:
    """The mask's download, and the DICOM-SEG's (or why there is none)."""
    st.download_button(
        "Download mask (NIfTI, original geometry)",
        data=stored.mask,
        file_name=stored.names["mask"],
        mime="application/gzip",
        key="download",
        on_click="ignore",
    )
    if stored.dicom_seg is not None:
        st.download_button(
            "Download DICOM-SEG (references the uploaded series)",
            data=stored.dicom_seg,
            file_name=stored.names["seg"],
            mime="application/dicom",
            key="download_seg",
            on_click="ignore",
        )
        if stored.dicom_seg_note:
            st.info(stored.dicom_seg_note)
    elif stored.dicom_seg_problem:
        st.warning(stored.dicom_seg_problem)

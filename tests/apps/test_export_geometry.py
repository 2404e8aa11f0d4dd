"""Exports keep what the input said (issue 30, item 9): a NIfTI mask carries the scan's own sform and
qform codes, and every DICOM-SEG of one anonymised series (the model's and a corrected one)
references the same Study, Series, frame of reference and SOP instance UIDs, taken from the file
meta where the data set's were blanked.

Real scans from ``../shared/data`` (TotalSegmentator's example CT: sform code 2, qform code 0; a
Task04_Hippocampus MR: codes 1 and 1), through the page (``streamlit.testing`` AppTest) with the
tiny models trained once per session (``app_runs``).
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest

from medseg.apps import review
from medseg.apps.export import dicom_seg_export, mask_nifti_bytes
from medseg.apps.panels.export import case_seg_sources
from medseg.datasets.dicom.write import write_dicom_series
from medseg.datasets.nifti import nifti_codes
from medseg.inference.io import load_image
from tests.apps.test_app import errors, new_app, run_model, upload_files

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
CT = SHARED / "totalseg-examples" / "example_ct_sm.nii.gz"
MR = SHARED / "Task04_Hippocampus" / "imagesTr" / "hippocampus_001.nii.gz"
pytestmark = pytest.mark.skipif(
    not (CT.is_file() and MR.is_file()), reason=f"the shared real data ({CT}, {MR}) is not on this machine"
)


@pytest.mark.parametrize("path, codes", [(CT, (2, 0)), (MR, (1, 1))], ids=["ct-sform2", "mr-codes1"])
def test_the_mask_keeps_the_scans_sform_and_qform_codes(app_runs, monkeypatch, path: Path, codes) -> None:
    source = nib.load(path).header
    assert (int(source["sform_code"]), int(source["qform_code"])) == codes
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [(path.name, path.read_bytes())])
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    stored = at.session_state["result"]
    mask = nib.Nifti1Image.from_bytes(gzip.decompress(stored.mask))
    assert (int(mask.header["sform_code"]), int(mask.header["qform_code"])) == codes
    np.testing.assert_allclose(mask.affine, nib.load(path).affine, atol=1e-4)
    # the corrected mask is written by the same function with the same codes (panels/corrections.py)
    label = stored.result.prediction.label
    edited = review.edited_label(label, [])
    written = mask_nifti_bytes(edited, nifti_codes(at.session_state["loaded"].image))
    again = nib.Nifti1Image.from_bytes(gzip.decompress(written))
    assert (int(again.header["sform_code"]), int(again.header["qform_code"])) == codes


def anonymised_series(folder: Path) -> list[tuple[str, bytes]]:
    """The CT as a DICOM series whose data sets lost their UIDs and SOP class (the file meta keeps
    the SOP instance and class UIDs, as some anonymisers leave it)."""
    image = load_image(CT)
    write_dicom_series(
        image[0].numpy(), image.affine.numpy(), folder, patient_id="ANON", series_description="ct"
    )
    files = []
    for p in sorted(folder.iterdir()):
        ds = pydicom.dcmread(p)
        for name in (
            "StudyInstanceUID",
            "SeriesInstanceUID",
            "SOPInstanceUID",
            "FrameOfReferenceUID",
            "SOPClassUID",
        ):
            setattr(ds, name, "")
        buf = io.BytesIO()
        ds.save_as(buf, enforce_file_format=False)
        files.append((p.name, buf.getvalue()))
    return files


def references(seg: pydicom.Dataset) -> tuple:
    """What a SEG points at: its study, frame of reference, and each referenced series' instances."""
    series = [
        (s.SeriesInstanceUID, sorted(r.ReferencedSOPInstanceUID for r in s.ReferencedInstanceSequence))
        for s in seg.ReferencedSeriesSequence
    ]
    return seg.StudyInstanceUID, seg.FrameOfReferenceUID, series


def test_every_dicom_seg_of_a_case_references_the_same_series(app_runs, tmp_path, monkeypatch) -> None:
    files = anonymised_series(tmp_path / "anon")
    meta_uids = sorted(pydicom.dcmread(io.BytesIO(d)).file_meta.MediaStorageSOPInstanceUID for _, d in files)
    at = new_app(app_runs, monkeypatch)
    upload_files(at, files)
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    stored, loaded = at.session_state["result"], at.session_state["loaded"]
    assert stored.dicom_seg is not None, stored.dicom_seg_problem
    model_seg = hd.seg.segread(io.BytesIO(stored.dicom_seg))
    study, frame, series = references(model_seg)
    assert len(series) == 1 and series[0][1] == meta_uids  # the instances the file meta names
    # the note names only the UIDs that were made up, not those the file meta carries
    note = stored.dicom_seg_note
    assert "StudyInstanceUID" in note and "SeriesInstanceUID" in note and "FrameOfReferenceUID" in note, note
    assert "SOPInstanceUID" not in note and "SOPClassUID" not in note, note
    assert any(note in str(i.value) for i in at.info)

    # a corrected SEG, as the Corrections panel builds it (one voxel painted): the same references
    label = stored.result.prediction.label
    shape = tuple(int(s) for s in label.shape[1:])
    centre = int(np.ravel_multi_index(tuple(s // 2 for s in shape), shape, order="F"))
    corrected = review.edited_label(label, [[centre, 1, 1]])  # [start, length, value]
    labels = {0: "background", 1: "organ", 2: "lesion"}
    seg = dicom_seg_export(corrected, case_seg_sources(loaded), labels, "tiny-seg", corrected=True)
    fixed = hd.seg.segread(io.BytesIO(seg.data))
    assert references(fixed) == (study, frame, series)
    assert fixed.SeriesInstanceUID != model_seg.SeriesInstanceUID  # a SEG series of its own
    assert fixed.SegmentSequence[0].SegmentAlgorithmType == "SEMIAUTOMATIC"

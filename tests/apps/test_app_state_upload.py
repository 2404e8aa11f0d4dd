"""A new upload replaces the case only once it has been read, and the page starts on a model that
fits it (issue 30, items 7 and 9), driven by ``streamlit.testing`` AppTest through the real page.

The scans are real: TotalSegmentator's example CT and a Task04_Hippocampus MR from
``../shared/data``; the models are the tiny ones trained once per session (``app_runs``).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medseg.datasets.dicom.write import write_dicom_series
from medseg.inference.io import load_image
from tests.apps.test_app import assert_overlay, errors, new_app, page_text, run_model, upload_files

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
CT = SHARED / "totalseg-examples" / "example_ct_sm.nii.gz"
MR = SHARED / "Task04_Hippocampus" / "imagesTr" / "hippocampus_001.nii.gz"
pytestmark = pytest.mark.skipif(
    not (CT.is_file() and MR.is_file()), reason=f"the shared real data ({CT}, {MR}) is not on this machine"
)


def metadata(at) -> dict[str, str]:
    table = next(t.value for t in at.table if "field" in t.value.columns)
    return dict(zip(table["field"], table["value"], strict=True))


def png_of(path: Path) -> bytes:
    """A real screenshot-like PNG of the scan's middle axial slice."""
    data = load_image(path)[0].numpy()
    middle = data[:, :, data.shape[2] // 2]
    scaled = (255 * (middle - middle.min()) / max(float(np.ptp(middle)), 1e-6)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(scaled.T).save(buf, format="PNG")
    return buf.getvalue()


def test_a_failed_upload_keeps_the_case_and_its_result(app_runs, monkeypatch) -> None:
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("ct.nii.gz", CT.read_bytes())])
    assert not errors(at), errors(at)
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    assert_overlay(at)
    case, result = at.session_state["loaded"], at.session_state["result"]
    shape = metadata(at)["shape (voxels)"]
    assert shape == "122 × 101 × 30"

    whole = CT.read_bytes()
    bad = [
        ("screenshot.nii.gz", png_of(CT), "screenshot.nii.gz is a PNG image, not a NIfTI image"),
        ("ct-copy.nii.gz", whole[: len(whole) // 3], "ct-copy.nii.gz is cut short"),
        ("notes.txt", b"window 40 / 400\n", "notes.txt is a text file"),
    ]
    for name, data, words in bad:
        upload_files(at, [(name, data)])
        assert not at.exception, at.exception
        (msg,) = errors(at)
        assert msg.startswith(words), msg
        assert "Nothing was replaced: the case on show is still ct." in msg, msg
        # the same case object, the model's result for it (what the viewport's edits are based on)
        assert at.session_state["loaded"] is case and at.session_state["result"] is result, name
        assert metadata(at)["shape (voxels)"] == shape
        assert_overlay(at)
        assert not [b for b in at.button if b.key == "run"], name  # no new run asked for
        assert not at.file_uploader[0].value  # the picker is empty again

    # the message stays while the user works on the kept case, and goes with the next upload
    at.slider(key="pos_z").set_value(3).run()
    assert len(errors(at)) == 1 and at.session_state["result"] is result
    upload_files(at, [("hippocampus.nii.gz", MR.read_bytes())])
    assert not errors(at), errors(at)
    assert metadata(at)["shape (voxels)"] == " × ".join(str(s) for s in load_image(MR).shape[1:])
    assert "result" not in at.session_state  # a new case: the old result went with the old case


def test_a_failed_upload_keeps_the_chosen_series(app_runs, tmp_path, monkeypatch) -> None:
    image = load_image(CT)
    a, b = tmp_path / "a", tmp_path / "b"
    write_dicom_series(image[0].numpy(), image.affine.numpy(), a, series_description="full", patient_id="X")
    half = image[:, :, :, :12]
    write_dicom_series(half[0].numpy(), image.affine.numpy(), b, series_description="half", patient_id="X")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for folder in (a, b):
            for p in sorted(folder.iterdir()):
                zf.write(p, f"{folder.name}/{p.name}")
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("study.zip", buf.getvalue())])
    chooser = at.selectbox(key="series")
    chooser.select_index(next(n for n, o in enumerate(chooser.options) if "half" in o)).run()
    assert metadata(at)["slices"] == "12"

    upload_files(at, [("study2.zip", buf.getvalue()[:4000])])  # a zip cut short
    (msg,) = errors(at)
    assert "cut short" in msg and "Nothing was replaced" in msg, msg
    assert metadata(at)["slices"] == "12"
    chooser = at.selectbox(key="series")
    assert "half" in chooser.options[chooser.index]  # the series on show is still the chosen one
    run_model(at)
    assert not at.exception and len(errors(at)) == 1, errors(at)
    assert_overlay(at)


def test_a_series_that_fails_leaves_the_series_picker(app_runs, tmp_path, monkeypatch) -> None:
    """Another series of the upload on show that cannot be read: its message, and the picker to
    choose again (the upload is the same, so there is no earlier one to go back to)."""
    image = load_image(CT)
    a, b = tmp_path / "a", tmp_path / "b"
    write_dicom_series(image[0].numpy(), image.affine.numpy(), a, series_description="full", patient_id="X")
    write_dicom_series(image[0].numpy(), image.affine.numpy(), b, series_description="gap", patient_id="X")
    gap = sorted(b.iterdir())
    gap[len(gap) // 2].unlink()  # a missing slice: this series cannot be read
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for folder in (a, b):
            for p in sorted(folder.iterdir()):
                zf.write(p, f"{folder.name}/{p.name}")
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("study.zip", buf.getvalue())])
    chooser = at.selectbox(key="series")
    chooser.select_index(next(n for n, o in enumerate(chooser.options) if "full" in o)).run()
    assert metadata(at)["slices"] == "30" and not errors(at)
    chooser = at.selectbox(key="series")
    chooser.select_index(next(n for n, o in enumerate(chooser.options) if "gap" in o)).run()
    (msg,) = errors(at)
    assert "missing slice" in msg, msg
    chooser = at.selectbox(key="series")
    chooser.select_index(next(n for n, o in enumerate(chooser.options) if "full" in o)).run()
    assert metadata(at)["slices"] == "30" and not errors(at), errors(at)


def model_value(at) -> str:
    picker = at.selectbox(key="model")
    return picker.options[picker.index]


def test_the_page_starts_on_a_model_that_fits_the_upload(app_runs, monkeypatch) -> None:
    at = new_app(app_runs, monkeypatch, model=None)
    assert model_value(at).startswith("tiny-cls")  # the first offered, before anything is uploaded
    upload_files(at, [("ct.nii.gz", CT.read_bytes())])
    assert not errors(at) and not at.exception, errors(at)
    assert model_value(at).startswith("tiny-seg"), model_value(at)
    text = page_text(at)
    assert "Model chosen for this upload: tiny-seg, because it segments CT" in text, text
    assert any(b.label == "Run segmentation with tiny-seg" for b in at.button)
    run_model(at)
    assert_overlay(at)

    # a model the user picks stays picked through the next upload
    picker = at.selectbox(key="model")
    picker.select_index(next(n for n, o in enumerate(picker.options) if o.startswith("tiny-cls"))).run()
    upload_files(at, [("ct-again.nii.gz", CT.read_bytes())])
    assert model_value(at).startswith("tiny-cls"), model_value(at)
    assert "Model chosen for this upload" not in page_text(at)

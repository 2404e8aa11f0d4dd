"""The Streamlit viewer, driven by ``streamlit.testing`` AppTest against real bundles and real files.

Each flow runs the real page script with the tiny models trained once per session (``app_runs``):
NIfTI upload, DICOM zip and loose files, several series, demo case, bad uploads, model switch.
"""

from __future__ import annotations

import gzip
import io
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
from streamlit.testing.v1 import AppTest

import medseg.apps
from medseg.apps import render, upload
from medseg.bundle.load import load_bundle
from medseg.cli.main import main
from medseg.datasets.decathlon import load_dataset
from medseg.datasets.dicom.write import write_dicom_series
from medseg.inference.io import load_image
from medseg.inference.predict import label_volumes, predict

APP = Path(medseg.apps.__file__).with_name("app.py")
TIMEOUT = 180  # seconds per script run: long enough for inference on a busy 2-core machine
PATIENT = "DOE^JANE"  # a name written into DICOM headers that the page must never show
PATIENT_ID = "PID-0042-SECRET"


def new_app(runs: Path, monkeypatch: pytest.MonkeyPatch, model: str | None = "tiny-seg") -> AppTest:
    """A fresh session of the page with the models in ``runs``, ``model`` chosen."""
    monkeypatch.setenv("MEDSEG_APP_RUNS", str(runs))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    if model is not None:
        choice = at.selectbox(key="model")
        choice.select_index(next(n for n, t in enumerate(choice.options) if t.startswith(model + " ")))
        at.run()
    return at


def page_text(at: AppTest) -> str:
    """Everything the page shows as text (messages, markdown, tables, labels)."""
    parts: list[str] = []
    for kind in ("markdown", "caption", "error", "warning", "info", "success", "title", "subheader"):
        parts += [str(e.value) for e in getattr(at, kind)]
    parts += [t.value.to_string() for t in at.table]
    parts += [str(w.label) for w in (*at.selectbox, *at.button, *at.slider, *at.radio)]
    parts += [str(o) for s in at.selectbox for o in s.options]
    return "\n".join(parts)


def errors(at: AppTest) -> list[str]:
    return [str(e.value) for e in at.error]


def upload_files(at: AppTest, files: list[tuple[str, bytes]]) -> AppTest:
    at.file_uploader[0].set_value([(n, d, "application/octet-stream") for n, d in files])
    return at.run()


def run_model(at: AppTest) -> AppTest:
    (button,) = [b for b in at.button if b.key == "run"]
    return button.click().run()


def volume_table(at: AppTest):
    tables = [t.value for t in at.table if "volume (mL)" in t.value.columns]
    assert len(tables) == 1, page_text(at)
    return tables[0]


def assert_overlay(at: AppTest) -> None:
    captions = [c for img in at.image for c in img.captions]
    assert captions == ["axial · overlay", "coronal · overlay", "sagittal · overlay"], captions


@pytest.fixture(scope="module")
def seg_case(seg_data: Path) -> Path:
    return Path(load_dataset(seg_data).test[0]["image"])


@pytest.fixture(scope="module")
def expected(seg_run, seg_case: Path) -> dict:
    """What ``medseg infer``'s function gives on the test case: the page must show the same."""
    bundle = load_bundle(seg_run.run_dir)
    image = load_image(seg_case)
    pred = predict(bundle, image, device="cpu")
    return {
        "image": image,
        "label": pred.label,
        "volumes": {v["label"]: v for v in label_volumes(pred.label, bundle.labels)},
    }


def dicom_zip(folders: dict[str, Path]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for prefix, folder in folders.items():
            for p in sorted(folder.iterdir()):
                zf.write(p, f"{prefix}/{p.name}")
    return buf.getvalue()


def write_series(image, out: Path, **kw) -> Path:
    write_dicom_series(
        image[0].numpy(), image.affine.numpy(), out, patient_id=PATIENT_ID, series_description="CT test", **kw
    )
    return out


def test_nifti_upload_segment_and_export(app_runs, seg_case, expected, monkeypatch) -> None:
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("scan.nii.gz", seg_case.read_bytes())])
    assert not errors(at) and not at.exception
    assert [c for img in at.image for c in img.captions][0] == "axial · image"
    meta = next(t.value for t in at.table if "field" in t.value.columns)
    info = dict(zip(meta["field"], meta["value"], strict=True))
    shape = tuple(int(s) for s in expected["image"].shape[1:])
    assert info["shape (voxels)"] == " × ".join(map(str, shape))
    assert info["orientation"] == "LPS" and info["spacing (mm)"] == "0.8 × 0.8 × 2.4"

    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    assert_overlay(at)
    table = volume_table(at)
    assert list(table["label"]) == ["organ", "lesion"]
    for _, row in table.iterrows():
        want = expected["volumes"][row["label"]]
        assert row["voxels"] == want["voxels"] > 0
        assert float(row["volume (mL)"]) == pytest.approx(want["ml"], abs=0.006)

    # the exported mask: NIfTI on the upload's own grid, the same labels as medseg infer
    mask = at.session_state["result"].mask
    img = nib.Nifti1Image.from_bytes(gzip.decompress(mask))
    np.testing.assert_allclose(img.affine, expected["image"].affine.numpy(), atol=1e-5)
    assert img.shape == shape
    np.testing.assert_array_equal(np.asanyarray(img.dataobj), expected["label"][0].numpy())
    assert any(b.label.startswith("Download mask") for b in at.get("download_button"))

    # moving a slider re-renders that plane and moves the crosshair in the others
    urls = [i.proto.imgs[0].url for i in at.image]
    at.slider(key="pos_z").set_value(0).run()
    after = [i.proto.imgs[0].url for i in at.image]
    assert not at.exception and after[0] != urls[0] and after[1] != urls[1]


def test_dicom_zip_upload_hides_identifiers(app_runs, seg_case, expected, tmp_path, monkeypatch) -> None:
    image = expected["image"]
    folder = write_series(image, tmp_path / "series")
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("study.zip", dicom_zip({"CT": folder}))])
    assert not errors(at), errors(at)
    meta = next(t.value for t in at.table if "field" in t.value.columns)
    info = dict(zip(meta["field"], meta["value"], strict=True))
    assert info["source"] == "DICOM" and info["modality"] == "CT"
    assert info["slices"] == str(image.shape[3])
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    assert_overlay(at)
    table = volume_table(at)
    for _, row in table.iterrows():  # the same voxels as the NIfTI (int16 CT is written losslessly)
        assert abs(row["voxels"] - expected["volumes"][row["label"]]["voxels"]) <= 0.01 * row["voxels"] + 2
    text = page_text(at)
    assert PATIENT not in text and PATIENT_ID not in text and "DOE" not in text

    # DICOM-SEG: one frame per labelled source slice, equal to the mask at that slice's position
    stored = at.session_state["result"]
    assert any(b.label.startswith("Download DICOM-SEG") for b in at.get("download_button"))
    seg = hd.seg.segread(io.BytesIO(stored.dicom_seg))
    assert [d.SegmentLabel for d in seg.SegmentSequence] == ["organ", "lesion"]
    label = stored.result.prediction.label
    affine = np.asarray(label.affine, dtype=np.float64)
    checked = 0
    for path in sorted(folder.iterdir()):
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        ras = np.array([-1.0, -1.0, 1.0]) * np.array([float(v) for v in ds.ImagePositionPatient])
        k = int(round(float(np.linalg.solve(affine[:3, :3], ras - affine[:3, 3])[2])))
        frame = seg.get_pixels_by_source_instance(
            [ds.SOPInstanceUID], combine_segments=True, assert_missing_frames_are_empty=True
        )[0]
        np.testing.assert_array_equal(frame, label[0, :, :, k].numpy().T)
        checked += int(frame.any())
    assert checked > 0


def test_several_series_and_loose_dicom_files(app_runs, expected, tmp_path, monkeypatch) -> None:
    image = expected["image"]
    a = write_series(image, tmp_path / "a")
    cropped = image[:, :, :, : image.shape[3] // 2]
    b = tmp_path / "b"
    write_dicom_series(cropped[0].numpy(), image.affine.numpy(), b, series_description="half", patient_id="X")
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("two.zip", dicom_zip({"a": a, "b": b}))])
    assert not errors(at), errors(at)
    chooser = at.selectbox(key="series")
    assert len(chooser.options) == 2 and any("half" in o for o in chooser.options)
    chooser.select_index(next(n for n, o in enumerate(chooser.options) if "half" in o)).run()
    assert not errors(at), errors(at)
    meta = next(t.value for t in at.table if "field" in t.value.columns)
    assert dict(zip(meta["field"], meta["value"], strict=True))["slices"] == str(cropped.shape[3])

    # several loose .dcm files of one series
    files = [(p.name, p.read_bytes()) for p in sorted(a.iterdir())]
    upload_files(at, files)
    assert not errors(at), errors(at)
    meta = next(t.value for t in at.table if "field" in t.value.columns)
    assert dict(zip(meta["field"], meta["value"], strict=True))["slices"] == str(image.shape[3])
    run_model(at)
    assert_overlay(at)


def test_demo_case(app_runs, seg_case, monkeypatch) -> None:
    at = new_app(app_runs, monkeypatch)
    at.radio(key="input_mode").set_value("Demo case").run()
    demo = at.selectbox(key="demo")
    assert Path(demo.value).name == seg_case.name
    assert not errors(at)
    assert not at.warning, [w.value for w in at.warning]  # a case of the training dataset: no warning
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    assert_overlay(at)
    assert set(volume_table(at)["label"]) == {"organ", "lesion"}


def _nifti(array: np.ndarray, spacing=(1.0, 1.0, 1.0)) -> bytes:
    img = nib.Nifti1Image(array, np.diag([*spacing, 1.0]))
    return gzip.compress(img.to_bytes())


def _bad_uploads(seg_case: Path, tmp_path: Path, image) -> list[tuple[str, list[tuple[str, bytes]], str]]:
    good = seg_case.read_bytes()
    mixed_a = write_series(image, tmp_path / "m1", series_uid="1.2.826.0.1.3680043.8.498.1")
    mixed_b = tmp_path / "m2"
    write_dicom_series(
        image[0, :-4].numpy(),
        image.affine.numpy(),
        mixed_b,
        series_uid="1.2.826.0.1.3680043.8.498.1",
        patient_id="X",
    )
    return [
        (
            "not an image",
            [("scan.nii.gz", b"this is not a NIfTI file\n" * 40)],
            "is a text file, not a NIfTI",
        ),
        ("truncated", [("scan.nii.gz", good[: len(good) // 2])], "is cut short"),
        ("2D", [("slice.nii.gz", _nifti(np.zeros((32, 32, 1), np.float32)))], "2D"),
        ("2D array", [("plain.nii.gz", _nifti(np.zeros((32, 32), np.float32)))], "3D volume"),
        ("text file", [("notes.txt", b"hello")], "is a text file"),
        ("empty zip", [("empty.zip", dicom_zip({}))], "holds no DICOM files"),
        ("broken zip", [("cut.zip", dicom_zip({"a": mixed_a})[:500])], "zip"),
        ("mixed series", [("mixed.zip", dicom_zip({"a": mixed_a, "b": mixed_b}))], "differs between slices"),
    ]


def test_bad_uploads_show_messages_and_app_keeps_working(
    app_runs, seg_case, expected, tmp_path, monkeypatch
) -> None:
    at = new_app(app_runs, monkeypatch)
    for name, files, words in _bad_uploads(seg_case, tmp_path, expected["image"]):
        upload_files(at, files)
        assert not at.exception, (name, at.exception)
        msgs = errors(at)
        assert len(msgs) == 1 and words in msgs[0], (name, msgs)
        assert "Traceback" not in msgs[0] and "/tmp/medseg-upload" not in msgs[0], msgs[0]
        assert not at.image and not [b for b in at.button if b.key == "run"], name
    # a channel count the model does not take: the image shows, the model refuses in the page
    four_d = np.random.default_rng(0).normal(size=(24, 24, 16, 2)).astype(np.float32)
    upload_files(at, [("two-channel.nii.gz", _nifti(four_d))])
    assert not errors(at) and at.image
    run_model(at)
    assert not at.exception
    assert len(errors(at)) == 1 and "has 2 channels, model tiny-seg takes 1" in errors(at)[0]
    # and the app still segments a good upload afterwards
    upload_files(at, [("scan.nii.gz", seg_case.read_bytes())])
    run_model(at)
    assert not errors(at) and not at.exception
    assert_overlay(at)


def test_model_switch(app_runs, seg_case, cls_data, monkeypatch) -> None:
    at = new_app(app_runs, monkeypatch, model=None)
    models = at.selectbox(key="model")
    assert sorted(models.options) == ["tiny-cls (classification)", "tiny-seg (segmentation)"]
    seg = next(n for n, t in enumerate(models.options) if "segmentation" in t)
    cls = next(n for n, t in enumerate(models.options) if "classification" in t)
    models.select_index(seg).run()
    assert "organ" in page_text(at)  # the model card lists its labels
    upload_files(at, [("scan.nii.gz", seg_case.read_bytes())])
    run_model(at)
    assert_overlay(at)

    at.selectbox(key="model").select_index(cls).run()
    assert not at.exception
    assert [c for img in at.image for c in img.captions][0] == "axial · image"  # no stale overlay
    assert any(b.label == "Run classification with tiny-cls" for b in at.button)
    case = load_dataset(cls_data).test[0]["image"]
    upload_files(at, [("shape.nii.gz", Path(case).read_bytes())])
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    probs = next(t.value for t in at.table if "probability" in t.value.columns)
    assert list(probs["class"]) == ["sphere", "cube"]
    assert sum(float(p) for p in probs["probability"]) == pytest.approx(1.0, abs=1e-3)
    assert at.success and "Most likely" in at.success[0].value

    at.selectbox(key="model").select_index(seg).run()
    assert any(b.label == "Run segmentation with tiny-seg" for b in at.button)


def test_no_models_is_a_message(tmp_path, monkeypatch) -> None:
    at = new_app(tmp_path, monkeypatch, model=None)
    assert any("No trained models" in m for m in errors(at))


# --- rendering and upload helpers, without Streamlit -------------------------------------------


def test_render_orientation_and_aspect() -> None:
    # stored LPS (i -> left, j -> posterior) with 0.5 x 0.5 x 3 mm voxels; one bright voxel at the
    # patient's right, anterior, superior corner region
    shape = (40, 30, 10)
    data = np.zeros(shape, np.float32)
    affine = np.diag([-0.5, -0.5, 3.0, 1.0])
    i, j, k = 2, 3, 8  # low i = right (i runs to the left), low j = anterior, high k = superior
    data[i, j, k] = 1000
    view = render.to_view(data, affine)
    assert view.shape == (40, 30, 10) and view.spacing == (0.5, 0.5, 3.0)
    x, y, z = np.argwhere(view.data == 1000)[0]
    assert (x, y, z) == (shape[0] - 1 - i, shape[1] - 1 - j, k)  # RAS voxel order
    axial = render.cut(view.data, "axial", z)
    r, c = np.argwhere(axial == 1000)[0]
    assert r < axial.shape[0] / 2 and c < axial.shape[1] / 2  # anterior up, patient's right on the left
    img = render.render_slice(view, "coronal", (x, y, z), 40, 400, crosshair=False, max_side=300)
    assert img.size == (200, 300)  # 40 x 0.5 mm wide, 10 x 3 mm high: 20 mm by 30 mm
    labels = np.zeros(shape, np.uint8)
    labels[:, :, 5] = 2
    lab_view = render.labels_to_view(labels, view)
    panel = np.asarray(render.render_slice(view, "axial", (0, 0, 5), 50, 100, lab_view, 1.0, False))
    assert tuple(panel[5, 5]) == render.label_colour(2)
    panel = np.asarray(render.render_slice(view, "axial", (0, 0, 5), 50, 100, lab_view, 0.0, False))
    assert tuple(panel[5, 5]) == (0, 0, 0)


def test_window_presets() -> None:
    level, width = render.WINDOW_PRESETS["Lung"]
    values = np.array([[level - width, level, level + width]], np.float32)
    assert render.window(values, level, width).tolist() == [[0, 127, 255]]
    assert set(render.WINDOW_PRESETS) == {"Soft tissue", "Lung", "Bone", "Brain"}


def test_upload_limits(monkeypatch) -> None:
    monkeypatch.setenv("MEDSEG_APP_MAX_UPLOAD_MB", "1")
    with pytest.raises(upload.DataError, match="over the 1 MB limit"):
        upload.read_upload([upload.UploadedBytes("big.nii", b"\0" * (2 * 2**20))])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:  # a small zip that unpacks large
        zf.writestr("a.dcm", b"\0" * (3 * 2**20))
    with pytest.raises(upload.DataError, match="unpacks to 3 MB"):
        upload.read_upload([upload.UploadedBytes("bomb.zip", buf.getvalue())])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:  # names that climb out of the folder stay inside it
        zf.writestr("../../../etc/evil.nii.gz", b"junk")
    with pytest.raises(upload.DataError) as err:
        upload.read_upload([upload.UploadedBytes("evil.zip", buf.getvalue())])
    assert not Path("/etc/evil.nii.gz").exists() and "/tmp/medseg-upload" not in str(err.value)


def test_cli_app_refuses_a_missing_runs_folder(tmp_path, capsys) -> None:
    assert main(["app", "--runs", str(tmp_path / "nope"), "--port", "1"]) == 2
    assert "no such folder" in capsys.readouterr().err


# --- workflow fixes and trust signals ------------------------------------------------------------


def _blank_uids(folder: Path) -> None:
    """What an anonymiser leaves: Study, Series, SOP instance and frame of reference UIDs empty."""
    for p in sorted(folder.iterdir()):
        ds = pydicom.dcmread(p)
        for name in ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "FrameOfReferenceUID"):
            setattr(ds, name, "")
        ds.file_meta.MediaStorageSOPInstanceUID = "1.2.3"
        ds.save_as(p)


def test_replace_upload_names_uids_messages_and_trust(
    app_runs, seg_case, expected, tmp_path, monkeypatch
) -> None:
    at = new_app(app_runs, monkeypatch)
    # where the sidebar's metrics come from, and the model's input window apart from the display's
    sidebar = "\n".join(str(c.value) for c in at.sidebar.caption) + "\n".join(
        str(m.value) for m in at.sidebar.markdown
    )
    assert (
        "Measured on 2 validation case(s) of SynthCT (synthetic data); trained on 6 other case(s)" in sidebar
    )
    # the model's own input normalisation, labelled apart from the display window
    assert "**Model input** window -150 to 250" in sidebar and "fixed by training" in sidebar

    # an image unlike the training data: MR intensities, 2 mm voxels, a wider field of view
    anatomical = Path(nib.__file__).parent / "tests" / "data" / "anatomical.nii"
    upload_files(at, [("mr-head.nii", anatomical.read_bytes())])
    assert not errors(at) and not at.file_uploader[0].value  # the picker is empty again
    warned = "\n".join(str(w.value) for w in at.warning)
    assert "trained on synthetic images (SynthCT)" in warned
    assert "do not look like CT in Hounsfield units" in warned
    assert "of the voxels lie in the model's input window (-150 … 250)" in warned
    assert "Voxel size 2 × 2 × 2 mm differs more than 2× from the training images" in warned
    assert "Field of view" in warned and "front-back" in warned
    assert any(s.label.startswith("Display window / level (screen only)") for s in at.selectbox)

    # a second upload replaces the first (no "got 2 files"), and its warnings are its own
    upload_files(at, [("case-b.nii.gz", seg_case.read_bytes())])
    assert not errors(at), errors(at)
    meta = next(t.value for t in at.table if "field" in t.value.columns)
    assert dict(zip(meta["field"], meta["value"], strict=True))["spacing (mm)"] == "0.8 × 0.8 × 2.4"
    warned = "\n".join(str(w.value) for w in at.warning)
    assert "Hounsfield" not in warned and "Field of view" not in warned and "Voxel size" not in warned

    # an anonymised DICOM series (empty UIDs): the DICOM-SEG gets new UIDs and says so
    folder = write_series(expected["image"], tmp_path / "anon")
    _blank_uids(folder)
    upload_files(at, [(f"anon-{n:03d}.dcm", p.read_bytes()) for n, p in enumerate(sorted(folder.iterdir()))])
    assert not errors(at), errors(at)
    run_model(at)
    assert not errors(at) and not at.exception, errors(at)
    stored = at.session_state["result"]
    assert stored.dicom_seg is not None, stored.dicom_seg_problem
    notes = "\n".join(str(i.value) for i in at.info)
    assert "newly generated UIDs" in notes and "SOPInstanceUID" in notes
    seg = hd.seg.segread(io.BytesIO(stored.dicom_seg))
    assert [d.SegmentLabel for d in seg.SegmentSequence] == ["organ", "lesion"]
    refs = [r for s in seg.ReferencedSeriesSequence for r in s.ReferencedInstanceSequence]
    uids = [
        seg.StudyInstanceUID,
        seg.FrameOfReferenceUID,
        *[s.SeriesInstanceUID for s in seg.ReferencedSeriesSequence],
    ]
    uids += [r.ReferencedSOPInstanceUID for r in refs]
    assert len(refs) == expected["image"].shape[3] and all(pydicom.uid.UID(u).is_valid for u in uids), uids
    label = stored.result.prediction.label[0].numpy()
    assert int(seg.pixel_array.astype(bool).sum()) == int((label > 0).sum()) > 0
    # downloads are named after the case and the model
    assert len(at.get("download_button")) == 2
    assert stored.names == {"mask": "anon-tiny-seg-mask.nii.gz", "seg": "anon-tiny-seg-seg.dcm"}

    # a series with a missing slice: plain words, no command-line flag, no folder path
    gap = write_series(expected["image"], tmp_path / "gap")
    files = sorted(gap.iterdir())
    upload_files(at, [(p.name, p.read_bytes()) for n, p in enumerate(files) if n != len(files) // 2])
    (msg,) = errors(at)
    assert "missing slice" in msg and "upload the complete series" in msg, msg
    assert "--" not in msg and "resample=True" not in msg and "/" not in msg and "medseg " not in msg, msg


def test_app_command_stops_its_streamlit_server_on_ctrl_c(tmp_path) -> None:
    """``medseg app`` stopped with SIGINT takes its Streamlit child with it (SIGTERM: the browser test's fixture)."""
    signum = signal.SIGINT
    from tests.browser import alive, child_pids, free_port, wait_healthy

    port, log = free_port(), tmp_path / "app.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "medseg", "app", "--runs", str(tmp_path), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(f"http://localhost:{port}", proc, log)
        children = child_pids(proc.pid)
        assert children, "medseg app started no child process"
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
        deadline = time.time() + 10
        while any(alive(c) for c in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(c) for c in children), "the Streamlit server outlived medseg app"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.unit
def test_label_centre_is_the_middle_of_the_foregrounds_bounding_box() -> None:
    """Against the box read off ``np.nonzero``'s index arrays (the plain definition)."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        labels = np.zeros((13, 17, 9), np.uint8)
        for _ in range(rng.integers(0, 4)):
            labels[tuple(rng.integers(0, n) for n in labels.shape)] = rng.integers(1, 4)
        nz = np.nonzero(labels)
        want = tuple(int((a.min() + a.max()) // 2) for a in nz) if len(nz[0]) else None
        assert render.label_centre(labels) == want

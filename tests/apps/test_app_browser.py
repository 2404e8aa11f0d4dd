"""End to end in a real browser: ``medseg app`` on a free localhost port, Debian's chromium driven
headless by Selenium through Debian's chromium-driver (``make test`` installs both).

One browser session (browser tests are slow): upload a NIfTI and segment it (the volume table
shows ``medseg infer``'s numbers); in the NiiVue viewport click, scroll and drag the window with
real input events (Chrome DevTools Protocol) and compare the crosshair's world position, voxel,
intensity and label with nibabel; then upload an anonymised DICOM series (empty UIDs) as loose
files, which replaces the case, segment it and download the DICOM-SEG and the NIfTI mask under
the case's and the model's name. Screenshots go to the test's tmp folder and test-output/.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from medseg.bundle.load import load_bundle
from medseg.datasets.decathlon import load_dataset
from medseg.datasets.dicom.write import write_dicom_series
from medseg.inference.io import load_image
from medseg.inference.predict import label_volumes, predict
from tests.browser import RESULT_TIMEOUT, Viewport, chrome, serve_app


@pytest.fixture
def server(seg_run, tmp_path: Path):
    """``medseg app`` (the CLI) serving a runs folder that holds the tiny segmentation model."""
    runs = tmp_path / "runs"
    shutil.copytree(seg_run.run_dir / "bundle", runs / "tiny-seg" / "bundle")
    with serve_app(runs, tmp_path / "app.log") as url:
        yield url


@pytest.fixture
def browser(tmp_path: Path):
    b = chrome(tmp_path / "downloads")
    try:
        yield b
    finally:
        b.quit()


def body_text(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def click_button(driver: webdriver.Chrome, text: str) -> None:
    button = WebDriverWait(driver, RESULT_TIMEOUT).until(
        lambda d: d.find_element(By.XPATH, f"//button[contains(., '{text}')]")
    )
    button.click()


def _download_settled(path: Path, last_size: list[int]) -> bool:
    """True once the file exists, is not empty, no partial download sits beside it, and its size
    held still since the previous poll (Chromium may show the final name before the bytes land)."""
    if not path.is_file() or any(path.parent.glob("*.crdownload")):
        return False
    size = path.stat().st_size
    settled = size > 0 and size == last_size[0]
    last_size[0] = size
    return settled


def downloaded(folder: Path, name: str) -> Path:
    path = folder / name
    deadline = time.time() + 60
    last_size = [-1]
    while not _download_settled(path, last_size) and time.time() < deadline:
        time.sleep(0.2)
    listing = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else "no downloads"
    assert path.is_file() and path.stat().st_size > 0, listing
    return path


def anonymised_series(image, out: Path) -> list[Path]:
    """The case as a DICOM series whose Study, Series, SOP instance and frame of reference UIDs are empty."""
    write_dicom_series(image[0].numpy(), image.affine.numpy(), out, patient_id="X")
    files = sorted(out.iterdir())
    for p in files:
        ds = pydicom.dcmread(p)
        for name in ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "FrameOfReferenceUID"):
            setattr(ds, name, "")
        ds.save_as(p)
    named = [p.with_name(f"anon-{n:03d}.dcm") for n in range(len(files))]
    for p, q in zip(files, named, strict=True):
        p.rename(q)
    return named


def test_viewer_in_chromium(server, browser, seg_run, seg_data, tmp_path: Path) -> None:
    case = Path(load_dataset(seg_data).test[0]["image"])
    bundle = load_bundle(seg_run.run_dir)
    image = load_image(case)
    pred = predict(bundle, image, device="cpu")
    want = label_volumes(pred.label, bundle.labels)
    nii = nib.load(case)
    data, mask = np.asanyarray(nii.dataobj), pred.label[0].numpy()
    keep = Path(__file__).resolve().parents[2] / "test-output" / "test_app_browser"
    keep.mkdir(parents=True, exist_ok=True)

    browser.get(server)
    wait = WebDriverWait(browser, RESULT_TIMEOUT)
    try:
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]")).send_keys(str(case))
        click_button(browser, "Run segmentation with tiny-seg")
        wait.until(lambda d: "volume (mL)" in body_text(d))
        view = Viewport(browser)
        view.wait_volumes(2)  # the scan and the label map
        time.sleep(0.5)
    finally:
        browser.save_screenshot(str(tmp_path / "viewer.png"))
        shutil.copy(tmp_path / "viewer.png", keep / "viewer.png")
    body = body_text(browser)
    assert "Traceback" not in body and "Error" not in body
    assert "cannot run WebGL" not in body  # the interactive viewport is on, not the static fallback

    rows = browser.find_elements(By.CSS_SELECTOR, "[data-testid='stTable'] tbody tr")
    cells = [[c.text for c in r.find_elements(By.CSS_SELECTOR, "td,th")] for r in rows]
    shown = {r[-3]: (int(r[-2]), float(r[-1])) for r in cells if len(r) >= 3 and r[-3] in {"organ", "lesion"}}
    assert set(shown) == {"organ", "lesion"}, cells
    for v in want:
        assert shown[v["label"]][0] == v["voxels"]
        assert shown[v["label"]][1] == pytest.approx(v["ml"], abs=0.006)

    # click: the crosshair's world position is nibabel's affine applied to its voxel, and the
    # readout's intensity and label are that voxel's
    left, top, width, height = view.tile(0)  # axial
    points = []
    for fx in (0.3, 0.7):
        view.click(left + fx * width, top + 0.5 * height)
        loc = view.location()
        vox = np.round(loc["vox"]).astype(int)
        np.testing.assert_allclose((nii.affine @ [*vox, 1])[:3], loc["mm"], atol=1e-3)
        assert loc["value"] == pytest.approx(float(data[tuple(vox)]), abs=0.5)
        assert loc["label"] == mask[tuple(vox)]
        points.append(loc["mm"])
    # radiological convention: the left of the axial tile is the patient's right (larger RAS x)
    assert points[0][0] > points[1][0]

    # wheel: one slice per step along the axial normal (RAS voxel z)
    x, y = left + 0.5 * width, top + 0.5 * height
    view.click(x, y)
    before = view.location()["ras"]
    full = view.js("return window.medsegViewport.nv.canvas.width")
    view.js("window.medsegViewport.motionRestMs = 4000;")  # (200 ms) long enough to look at it here
    view.wheel(x, y, -120)
    WebDriverWait(browser, 10).until(lambda _: view.location()["ras"][2] != before[2])
    after = view.location()["ras"]
    assert abs(after[2] - before[2]) == 1 and after[:2] == before[:2]
    # no GPU here (SwiftShader): while the wheel turns the viewport draws at half resolution, says
    # so under the viewer, and is back at full resolution once scrolling rests (viewport.js)
    assert "SwiftShader" in view.js("return window.medsegViewport.software")
    assert "half resolution" in view.js("return document.getElementById('soft').textContent")
    width_now = lambda _=None: view.js("return window.medsegViewport.nv.canvas.width")  # noqa: E731
    moving = width_now()
    assert abs(moving - full / 2) <= 1, (moving, full)
    # a click while scrolling acts on the full-resolution frame, drawn at once: it lands on the
    # voxel the same click found before the scroll
    view.click(left + 0.3 * width, top + 0.5 * height)
    assert width_now() == full
    assert view.location()["mm"][:2] == pytest.approx(points[0][:2], abs=1e-6)
    # and without a click, full resolution comes back once scrolling has rested
    view.wheel(x, y, -120)
    WebDriverWait(browser, 10).until(lambda _: width_now() < full)
    WebDriverWait(browser, 10).until(lambda _: width_now() == full)
    view.js("window.medsegViewport.motionRestMs = 200;")

    # right-drag: window/level changes
    lo, hi = view.window()
    view.right_drag(x, y, 80, 40)
    WebDriverWait(browser, 10).until(lambda _: view.window() != (lo, hi))

    # an anonymised DICOM series as loose files: replaces the case; DICOM-SEG with generated UIDs
    files = anonymised_series(image, tmp_path / "anon")
    browser.find_element(By.CSS_SELECTOR, "input[type=file]").send_keys("\n".join(str(p) for p in files))
    click_button(browser, "Run segmentation with tiny-seg")
    wait.until(lambda d: "newly generated UIDs" in body_text(d))
    assert "got " not in body_text(browser)  # not added to the NIfTI upload
    click_button(browser, "Download DICOM-SEG")
    click_button(browser, "Download mask")
    downloads = tmp_path / "downloads"
    seg = hd.seg.segread(downloaded(downloads, "anon-tiny-seg-seg.dcm"))
    nifti = nib.load(downloaded(downloads, "anon-tiny-seg-mask.nii.gz"))
    got = np.asanyarray(nifti.dataobj)
    assert got.shape == mask.shape and int(seg.pixel_array.astype(bool).sum()) == int((got > 0).sum()) > 0
    browser.save_screenshot(str(keep / "viewer-dicom.png"))

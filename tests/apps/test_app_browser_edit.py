"""Edit and export in a real browser: brush, eraser and undo in the NiiVue viewport, then the
corrected mask downloaded as NIfTI and DICOM-SEG and read back with nibabel and highdicom.

``medseg app`` on a free port, Debian's chromium headless (tests/browser.py). An anonymised DICOM
series of the test case (empty UIDs) is uploaded and segmented; on the axial view three strokes are
drawn with real mouse events (CDP): a brush stroke with the lesion label, an eraser stroke, and a
third brush stroke that is undone. The strokes run along one screen row, so each covers one row of
voxels between the two voxels that a click at its ends selects (their world positions are read
from the viewport and checked against nibabel). The test checks the downloads:

- the corrected NIfTI has the scan's shape and affine;
- it differs from the model's own mask (downloaded from the same page) only on the two kept
  strokes: the brush row holds the lesion label, the eraser row holds 0, the undone row is the model's;
- the DICOM-SEG, frame by frame placed by its own plane positions through the NIfTI's affine,
  equals the corrected NIfTI voxel for voxel.

Then the corrected NIfTI is uploaded back as the second mask (Compare) and the page's Dice table is
checked against numpy; the screenshot of that layout is ``docs/viewer-review.png``.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from medseg.bundle.load import load_bundle
from medseg.datasets.decathlon import load_dataset
from medseg.inference.io import load_image
from medseg.inference.predict import predict
from tests.apps import test_app_browser as app_browser
from tests.apps.test_app_browser import anonymised_series, body_text, click_button, downloaded
from tests.browser import RESULT_TIMEOUT, Viewport

server, browser = app_browser.server, app_browser.browser  # the fixtures: medseg app, chromium

KEEP = Path(__file__).resolve().parents[2] / "test-output" / "test_app_browser_edit"


# Counts, from here on, the voxels sent to 3D textures (texSubImage3D) and the full rebuilds of the
# volumes' textures (NiiVue's updateGLVolume, refreshLayers) in the left viewer.
TRAFFIC = (
    "const s = window.medsegViewport, nv = s.nv, gl = nv.gl, t = {voxels: 0, rebuilds: 0}; s.traffic = t;"
    "const sub = gl.texSubImage3D.bind(gl);"
    "gl.texSubImage3D = (...a) => { t.voxels += a[5] * a[6] * a[7]; return sub(...a); };"
    "const proto = Object.getPrototypeOf(nv);"
    "for (const name of ['updateGLVolume', 'refreshLayers']) { const f = proto[name];"
    "  proto[name] = function (...a) { t.rebuilds++; return f.apply(this, a); }; }"
)


def stroke(view: Viewport, start: tuple[float, float], end: tuple[float, float], steps: int = 12) -> None:
    """Press the left button at ``start``, move to ``end`` in ``steps``, release."""
    view.mouse("mouseMoved", *start, button="none")
    view.mouse("mousePressed", *start, buttons=1)
    for n in range(1, steps + 1):
        f = n / steps
        view.mouse(
            "mouseMoved", start[0] + f * (end[0] - start[0]), start[1] + f * (end[1] - start[1]), buttons=1
        )
    # NiiVue handles at most one pointer move per animation frame: hold still at the end for a few
    # frames before letting go, as a hand does
    time.sleep(0.1)
    view.mouse("mouseMoved", *end, buttons=1)
    time.sleep(0.1)
    view.mouse("mouseReleased", *end)


def edits(view: Viewport) -> dict:
    return view.js(
        "const e = window.medsegViewport.edits; return e ? {seq: e.seq, changed: e.changed} : null;"
    )


def wait_seq(view: Viewport, seq: int) -> dict:
    WebDriverWait(view.d, 60).until(lambda _: (edits(view) or {}).get("seq") == seq)
    return edits(view)


def ends(view: Viewport, nii: nib.Nifti1Image, y: float, tile) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Click both ends of a stroke at height ``y`` (fraction of the tile); their stored voxels, checked
    against nibabel (world position = affine @ voxel), and the screen points."""
    left, top, width, height = tile
    points = [(left + fx * width, top + y * height) for fx in (0.25, 0.7)]
    voxels = []
    for p in points:
        view.click(*p)
        loc = view.location()
        vox = np.round(loc["vox"]).astype(int)
        np.testing.assert_allclose((nii.affine @ [*vox, 1])[:3], loc["mm"], atol=1e-3)
        voxels.append(vox)
    return voxels[0], voxels[1], tuple(points)


def row(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int, int]]:
    """The voxels from ``a`` to ``b``, which differ only along one axis (one screen row)."""
    axis = [n for n in range(3) if a[n] != b[n]]
    assert len(axis) == 1, (a, b)  # the stroke runs along one voxel axis
    (ax,) = axis
    lo, hi = sorted((int(a[ax]), int(b[ax])))
    out = []
    for v in range(lo, hi + 1):
        p = [int(x) for x in a]
        p[ax] = v
        out.append(tuple(p))
    return out


def seg_volume(
    seg: hd.seg.Segmentation, affine: np.ndarray, shape: tuple, foreground: list[int]
) -> np.ndarray:
    """The DICOM-SEG as a label volume on the NIfTI's grid: each frame put at the slice its own
    ImagePositionPatient (LPS) lies on, through ``affine`` (RAS)."""
    inv = np.linalg.inv(affine)
    out = np.zeros(shape, np.uint8)
    pixels = seg.pixel_array
    pixels = pixels[None] if pixels.ndim == 2 else pixels
    for f, group in enumerate(seg.PerFrameFunctionalGroupsSequence):
        x, y, z = (float(v) for v in group.PlanePositionSequence[0].ImagePositionPatient)
        i, j, k = np.round(inv @ [-x, -y, z, 1])[:3]
        assert (i, j) == (0, 0), "a frame does not start at the scan's first voxel"
        number = int(group.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
        frame = np.asarray(pixels[f]).T > 0  # rows run along j, columns along i
        out[:, :, int(k)][frame] = foreground[number - 1]
    return out


def script_state(driver) -> str:
    """The page's script-run state as Streamlit's frontend keeps it on its root element
    (``data-test-script-state``: running, rerunRequested, notRunning, ...), updated at once.

    Not the "running" icon in the toolbar: the frontend shows it only once a run has lasted 500 ms,
    so a run that has just started (or been requested) looks idle.
    """
    return driver.find_element(By.CSS_SELECTOR, "[data-testid='stApp']").get_attribute(
        "data-test-script-state"
    )


def wait_processed(driver, text: str) -> None:
    """Until ``text``, written by one particular script run, is on the page and that run has ended.

    The text must name that run's input unambiguously (here the edit's step number): a download
    button drawn by an earlier run still holds that run's file, and is replaced under the click.
    """
    WebDriverWait(driver, RESULT_TIMEOUT).until(lambda d: text in body_text(d))
    WebDriverWait(driver, RESULT_TIMEOUT).until(lambda d: script_state(d) == "notRunning")


def stored_voxel(view: Viewport, x: float, y: float) -> np.ndarray:
    view.click(x, y)
    return np.round(view.location()["vox"]).astype(int)


def goto_slice(view: Viewport, x: float, y: float, k: int) -> None:
    """Wheel (real events) over the axial tile until the crosshair is on stored slice ``k``."""
    now, delta = int(stored_voxel(view, x, y)[2]), -120
    for _ in range(400):
        if now == k:
            return
        view.wheel(x, y, delta)
        WebDriverWait(view.d, 10).until(lambda _, was=now: int(np.round(view.location()["vox"])[2]) != was)
        new = int(np.round(view.location()["vox"])[2])
        if abs(new - k) > abs(now - k):
            delta = -delta
        now = new
    raise AssertionError(f"the wheel did not reach slice {k}")


def test_edit_and_export_round_trip(server, browser, seg_run, seg_data, tmp_path: Path) -> None:
    KEEP.mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(seg_run.run_dir)
    lesion = next(k for k, v in bundle.labels.items() if v == "lesion")
    foreground = sorted(k for k in bundle.labels if k != 0)
    case = Path(load_dataset(seg_data).test[0]["image"])
    image = load_image(case)
    files = anonymised_series(image, tmp_path / "anon")
    # the model's own mask on the series, as the page computes it (the same reader and predict)
    series = load_image(tmp_path / "anon")
    model = predict(bundle, series, device="cpu").label[0].numpy().astype(np.uint8)
    affine = series.affine.numpy()
    downloads = tmp_path / "downloads"

    browser.get(server)
    wait = WebDriverWait(browser, RESULT_TIMEOUT)
    try:
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]")).send_keys(
            "\n".join(str(p) for p in files)
        )
        click_button(browser, "Run segmentation with tiny-seg")
        wait.until(lambda d: "volume (mL)" in body_text(d))
        view = Viewport(browser)
        view.wait_volumes(2)
        assert view.js("return getComputedStyle(document.getElementById('edit')).display") != "none"
        view.js("document.querySelector('[data-layout=axial]').click()")
        time.sleep(0.3)
        tile = view.tile(0)
        left, top, width, height = tile
        nii = nib.Nifti1Image(model, affine)  # nibabel's view of the page's grid
        # the axial slice with the most labelled voxels, and on it the row that crosses most labels
        k = int(np.argmax((model > 0).sum(axis=(0, 1))))
        goto_slice(view, left + 0.5 * width, top + 0.5 * height, k)
        i_lo, i_hi = sorted(
            int(stored_voxel(view, left + fx * width, top + 0.5 * height)[0]) for fx in (0.3, 0.7)
        )
        j_a = int(stored_voxel(view, left + 0.5 * width, top + 0.3 * height)[1])
        j_b = int(stored_voxel(view, left + 0.5 * width, top + 0.7 * height)[1])
        j_e = int(np.argmax((model[i_lo : i_hi + 1, :, k] > 0).sum(axis=0)))
        frac = lambda j: 0.3 + (j - j_a) * 0.4 / (j_b - j_a)  # noqa: E731 - screen row of voxel row j
        a1, a2, brush_pts = ends(view, nii, frac(j_e + 2), tile)
        e1, e2, erase_pts = ends(view, nii, frac(j_e), tile)
        u1, u2, undo_pts = ends(view, nii, frac(j_e - 2), tile)
        brush_row, erase_row, undo_row = row(a1, a2), row(e1, e2), row(u1, u2)
        assert model[tuple(np.array(erase_row).T)].any(), "the eraser row should cross a label"

        view.js(TRAFFIC)
        crosshair = view.location()["mm"]
        view.js(
            "const s = document.getElementById('pensize'); s.value = '1'; s.dispatchEvent(new Event('change'));"
            f"const p = document.getElementById('penlabel'); p.value = '{lesion}'; p.dispatchEvent(new Event('change'));"
            "document.getElementById('brush').click();"
        )
        stroke(view, *brush_pts)
        after_brush = wait_seq(view, 1)
        # painting leaves the crosshair where it was (at the undo row's end, not the brush row's)
        assert view.location()["mm"] == pytest.approx(crosshair, abs=1e-6)
        view.js("document.getElementById('eraser').click();")
        stroke(view, *erase_pts)
        after_erase = wait_seq(view, 2)
        view.js("document.getElementById('brush').click();")  # eraser -> brush
        stroke(view, *undo_pts)
        after_third = wait_seq(view, 3)
        view.js("document.getElementById('undo').click();")
        after_undo = wait_seq(view, 4)
        # the GPU got the strokes' voxels, not the label map
        traffic = view.js("return window.medsegViewport.traffic")
        # (all the steps together sent less than half the label map once; NiiVue sends all of it per move)
        assert traffic["rebuilds"] == 0 and 0 < traffic["voxels"] < 0.5 * model.size, traffic
        assert after_brush["changed"] > 0 and after_erase["changed"] > after_brush["changed"]
        assert (
            after_third["changed"] > after_erase["changed"]
            and after_undo["changed"] == after_erase["changed"]
        )

        # our stored-order copy of the drawing is NiiVue's own reorientation of it (its NIfTI writer)
        mismatch = view.js(
            "const s = window.medsegViewport, nv = s.nv, lab = s.edit.lab;"
            "const raw = nv.volumes[0].toUint8Array(nv.drawBitmap), off = raw.length - lab.img.length;"
            "let n = 0; for (let o = 0; o < lab.img.length; o++) if (raw[off + o] !== lab.img[o]) n++;"
            "return [n, Array.from(lab.permRAS)];"
        )
        assert mismatch[0] == 0, mismatch
        # the run that took the undo (step 4) has ended: its caption names the step; the erase
        # (step 2) left the same count, so the count alone could be an earlier run's page
        wait_processed(
            browser,
            f"{after_undo['changed']} voxels differ from tiny-seg's mask (after {after_undo['seq']} edit steps",
        )
        click_button(browser, "Download corrected DICOM-SEG")
        click_button(browser, "Download corrected mask")
        fixed_path = downloaded(downloads, "anon-tiny-seg-corrected-mask.nii.gz")
        fixed_nii = nib.load(fixed_path)
        seg = hd.seg.segread(downloaded(downloads, "anon-tiny-seg-corrected-seg.dcm"))

        # the corrected mask, uploaded back as the second mask: Dice against the model's
        view.js("document.getElementById('brush').click();")  # tools off: the overlays show
        browser.find_element(By.XPATH, "//label[.//p[text()='A mask file']]").click()
        wait.until(
            lambda d: (
                d.find_elements(By.CSS_SELECTOR, "input[type=file]")[-1:]
                and len(d.find_elements(By.CSS_SELECTOR, "input[type=file]")) == 2
            )
        )
        browser.find_elements(By.CSS_SELECTOR, "input[type=file]")[1].send_keys(str(fixed_path))
        # the caption comes before the Dice table in the same run: wait for that run to end
        wait_processed(browser, f"Shown in cyan beside tiny-seg's mask: {fixed_path.name}")
        view.wait_volumes(3)
        time.sleep(0.5)
        page = body_text(browser)
        # Compare scores the corrected mask on request: against itself, Dice 1
        browser.find_element(By.XPATH, "//label[.//p[text()='The corrected mask']]").click()
        wait_processed(browser, "tiny-seg (corrected) voxels")
        scored = body_text(browser)
    finally:
        browser.save_screenshot(str(tmp_path / "review.png"))
        shutil.copy(tmp_path / "review.png", KEEP / "viewer-review.png")
    assert "Traceback" not in page

    # original geometry
    fixed = np.asanyarray(fixed_nii.dataobj)
    assert fixed.shape == model.shape == tuple(image.shape[1:])
    np.testing.assert_allclose(fixed_nii.affine, affine, atol=1e-4)
    np.testing.assert_allclose(fixed_nii.affine, image.affine.numpy(), atol=1e-3)

    # only the kept strokes changed, each to what it painted
    changed = {tuple(int(v) for v in p) for p in np.argwhere(fixed != model)}
    assert changed, "the edits did not reach the export"
    assert changed <= set(brush_row) | set(erase_row), sorted(changed - set(brush_row) - set(erase_row))[:10]
    unpainted = [
        (p, int(fixed[p]), int(model[p])) for p in brush_row if p not in erase_row and fixed[p] != lesion
    ]
    assert not unpainted, (unpainted, brush_row[0], brush_row[-1])
    assert all(fixed[p] == 0 for p in erase_row)
    assert len(changed) == after_undo["changed"]
    assert any(model[p] != lesion for p in brush_row)  # the brush really painted something new
    for p in undo_row:  # the undone stroke left nothing behind
        if p not in brush_row and p not in erase_row:
            assert fixed[p] == model[p]

    # the DICOM-SEG is the same mask, at the same world positions
    assert seg.SeriesDescription.endswith("corrected")
    np.testing.assert_array_equal(seg_volume(seg, fixed_nii.affine, fixed.shape, foreground), fixed)

    # Dice of the corrected mask against the model's, as the page shows it
    for k in foreground:
        a, b = model == k, fixed == k
        if a.sum() + b.sum():
            dice = 2 * (a & b).sum() / (a.sum() + b.sum())
            name = bundle.labels[k]
            assert re.search(rf"{name}\s+{int(a.sum())}\s+{int(b.sum())}\s+{dice:.3f}", page), page
            assert re.search(rf"{name}\s+{int(b.sum())}\s+{int(b.sum())}\s+1\.000", scored), scored

"""Two models side by side on the same case, in a real browser (Debian's chromium, tests/browser.py).

``medseg app`` serves two segmentation models (the tiny UNet trained for 8 epochs and for 2). The
test case is uploaded and segmented with the first, then "Compare ... Another model" runs the
second on it. The page must then show two NiiVue viewers side by side in the viewport (one per
model, on the same scan) and the Dice table. Checked in the browser:

- both viewers hold the scan and one label map each, and those label maps are the two models'
  masks: the voxels where they differ are exactly numpy's ``first != second`` of ``predict``'s;
- both draw: with the overlays hidden the two canvases hold the same picture (the same scan, the
  same slices), with the overlays shown they differ, so the difference is the overlays;
- the crosshair is linked: a click and a wheel step in the left viewer move the right one to the
  same world position.

The screenshot is ``docs/viewer-compare.png`` (kept in test-output/test_app_browser_compare/).
"""

from __future__ import annotations

import base64
import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from medseg.bundle.load import load_bundle
from medseg.datasets.decathlon import load_dataset
from medseg.inference.io import load_image
from medseg.inference.predict import predict
from tests.apps import test_app_browser as app_browser
from tests.apps.test_app_browser import body_text, click_button
from tests.apps.test_app_review import second_run  # noqa: F401 - the second model (fixture)
from tests.browser import RESULT_TIMEOUT, Viewport, serve_app

browser = app_browser.browser  # the chromium fixture

KEEP = Path(__file__).resolve().parents[2] / "test-output" / "test_app_browser_compare"


@pytest.fixture
def two_model_server(seg_run, second_run, tmp_path: Path):  # noqa: F811 - the fixture above
    """``medseg app`` serving tiny-seg and tiny-seg-b (as test_app_browser's ``server`` serves one)."""
    runs = tmp_path / "runs"
    for run in (seg_run, second_run):
        shutil.copytree(run.run_dir / "bundle", runs / run.run_dir.name / "bundle")
    with serve_app(runs, tmp_path / "app.log") as url:
        yield url


SIDE_READY = (
    "const s = window.medsegViewport; return !!(s && s.sideId && s.nv2 && s.edit && s.nv.volumes.length === 1"
    " && s.nv2.medsegEdit && s.nv2.volumes.length === 1"
    " && getComputedStyle(document.getElementById('pane2')).display !== 'none');"
)


def pictures(view: Viewport, overlays: bool) -> list[np.ndarray]:
    """Both viewers' canvases as RGB arrays, drawn with the label overlays shown or hidden.

    The viewport's NiiVue draws on the next animation frame (``drawScene`` asks for one); the
    picture is read in the same call as the draw, so it is drawn at once with ``drawNow``."""
    urls = view.js(
        "const s = window.medsegViewport, out = [];"
        "for (const nv of [s.nv, s.nv2]) {"
        f"  nv.drawOpacity = {1.0 if overlays else 0.0}; nv.drawNow();"
        "  out.push(nv.canvas.toDataURL('image/png'));"
        "}"
        "return out;"
    )
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB")) for u in urls
    ]


def crosshair_mm(view: Viewport) -> list[list[float]]:
    return view.js(
        "const s = window.medsegViewport;"
        "return [s.nv, s.nv2].map(nv => Array.from(nv.frac2mm(nv.scene.crosshairPos)).slice(0, 3));"
    )


def test_two_models_side_by_side(two_model_server, browser, seg_run, second_run, seg_data, tmp_path) -> None:  # noqa: F811
    case = Path(load_dataset(seg_data).test[0]["image"])
    image = load_image(case)
    first = predict(load_bundle(seg_run.run_dir), image, device="cpu").label[0].numpy().astype(np.uint8)
    second = predict(load_bundle(second_run.run_dir), image, device="cpu").label[0].numpy().astype(np.uint8)
    assert (first != second).any(), "the two models must disagree somewhere for this test to mean anything"
    KEEP.mkdir(parents=True, exist_ok=True)

    browser.get(two_model_server)
    wait = WebDriverWait(browser, RESULT_TIMEOUT)
    try:
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]")).send_keys(str(case))
        click_button(browser, "Run segmentation with tiny-seg")
        wait.until(lambda d: "volume (mL)" in body_text(d))
        browser.find_element(By.XPATH, "//label[.//p[text()='Another model']]").click()
        click_button(browser, "Run tiny-seg-b on this case")
        wait.until(lambda d: "Shown in a second viewer" in body_text(d))
        view = Viewport(browser)
        WebDriverWait(browser, RESULT_TIMEOUT).until(lambda _: view.js(SIDE_READY))
        time.sleep(0.5)
    finally:
        browser.save_screenshot(str(tmp_path / "compare.png"))
        shutil.copy(tmp_path / "compare.png", KEEP / "viewer-compare.png")
    page = body_text(browser)
    assert "Traceback" not in page and "cannot run WebGL" not in page

    # two viewers next to each other, each about half the width
    boxes = view.js(
        "return ['gl', 'gl2'].map(id => { const r = document.getElementById(id).getBoundingClientRect();"
        " return [r.left, r.right, r.width, r.height]; });"
    )
    (l1, r1, w1, h1), (l2, r2, w2, h2) = boxes
    assert r1 <= l2 + 1 and w1 > 100 and abs(w1 - w2) < 2 and h1 == h2 > 100, boxes

    # each holds the scan and its model's labels; they differ exactly where the two masks do
    diff = view.js(
        "const s = window.medsegViewport, a = s.edit.lab.img, b = s.nv2.medsegEdit.lab.img;"
        "let n = 0; for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) n++;"
        "return [a.length, n, s.nv.volumes[0].img.length === s.nv2.volumes[0].img.length];"
    )
    assert diff == [first.size, int((first != second).sum()), True], diff

    # in the axial layout (the button sets both viewers): the same scan drawn in both (overlays
    # hidden), different overlays drawn over it
    view.js("document.querySelector('[data-layout=axial]').click()")
    assert view.js("const s = window.medsegViewport; return [s.nv.opts.sliceType, s.nv2.opts.sliceType]") == [
        0,
        0,
    ]
    windows = view.js(
        "const s = window.medsegViewport; return [s.nv, s.nv2].map(nv => [nv.volumes[0].cal_min, nv.volumes[0].cal_max]);"
    )
    assert windows[0] == windows[1], windows  # one display window for both
    plain = pictures(view, overlays=False)
    shown = pictures(view, overlays=True)
    assert plain[0].shape == plain[1].shape and plain[0].std() > 5  # a picture, not a blank canvas
    unequal = int((plain[0] != plain[1]).any(axis=2).sum())
    assert unequal == 0, f"the two viewers do not show the same scan and slice: {unequal} pixels differ"
    changed = [int((s != p).any(axis=2).sum()) for s, p in zip(shown, plain, strict=True)]
    assert min(changed) > 0, f"a viewer draws no overlay: {changed}"
    assert (shown[0] != shown[1]).any(axis=2).sum() > 0, "the two overlays look the same"

    # linked: a click and a wheel step in the left viewer move the right one's crosshair with it
    left, top, width, height = view.tile(0)
    for fx, fy in ((0.35, 0.45), (0.6, 0.55)):
        view.click(left + fx * width, top + fy * height)
        WebDriverWait(browser, 10).until(
            lambda _: np.allclose(*np.array(crosshair_mm(view)), atol=1e-3)  # noqa: B023
        )
    before = crosshair_mm(view)[1]
    view.wheel(left + 0.6 * width, top + 0.55 * height, -120)
    WebDriverWait(browser, 10).until(lambda _: crosshair_mm(view)[1] != before)
    a, b = crosshair_mm(view)
    np.testing.assert_allclose(a, b, atol=1e-3)

    # switching how the second mask is shown leaves nothing behind: as cyan edges, the left viewer
    # holds them (an overlay) and a legend row; side by side again, neither is left in it
    legend = "return !!document.querySelector('#labels [data-label=second]')"
    layers = "const s = window.medsegViewport; return [s.nv.volumes.length, !!s.sideId];"
    browser.find_element(By.XPATH, '//label[.//p[text()="As cyan edges on the model\'s view"]]').click()
    WebDriverWait(browser, RESULT_TIMEOUT).until(lambda _: view.js(layers) == [2, False] and view.js(legend))
    browser.find_element(By.XPATH, "//label[.//p[starts-with(text(), 'Side by side')]]").click()
    WebDriverWait(browser, RESULT_TIMEOUT).until(lambda _: view.js(layers)[1])
    time.sleep(0.5)
    assert view.js(layers) == [1, True] and not view.js(legend)

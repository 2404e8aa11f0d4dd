"""What a reader sees in the viewport, in a real browser (Debian's chromium, tests/browser.py): one
page session, several defects of issue 30 each checked where it showed.

The test case (CT-like, Hounsfield units) is uploaded and segmented with the tiny model; then:

- nothing is drawn while nothing changes (NiiVue's frames are counted over three idle seconds);
- the overlay blends with the anatomy with no tool on: the canvas drawn with the labels and
  without them gives, at every pixel the labels change, an alpha near the sidebar's opacity (0.4),
  and near 0.2 after the sidebar's slider is moved there with the keyboard;
- one orientation convention: letters on all four edges of each 2D tile, legible (15 px), the ones
  the radiological convention puts there; clicks on the left and right of the sagittal tile find
  anterior on the left, of the coronal tile the patient's right on the left; the page says so;
- window/level: CT presets for the CT; after a right-drag the preset box says Custom and the level
  and width boxes hold the dragged window; choosing "Soft tissue" again applies 40 / 400;
- a new case resets: with Brush on and the crosshair near an edge, an MR-like scan (positive
  intensities, another shape) is uploaded; the tool is off, the crosshair is at the new volume's
  centre, the readout gives that voxel's intensity in the new file (nibabel), the presets are the
  MR ones (no CT windows) and the window is the MR's auto window.

Screenshots go to test-output/test_app_browser_view/ (the see-through overlay and the letters are
``docs/viewer-overlay.png`` and ``docs/viewer-orientation.png``).
"""

from __future__ import annotations

import base64
import io
import shutil
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from medseg.datasets.decathlon import load_dataset
from tests.apps import test_app_browser as app_browser
from tests.apps.test_app_browser import body_text, click_button
from tests.browser import RESULT_TIMEOUT, Viewport

server, browser = app_browser.server, app_browser.browser  # the fixtures: medseg app, chromium

KEEP = Path(__file__).resolve().parents[2] / "test-output" / "test_app_browser_view"
WINDOW_BOX = "Display window / level (screen only)"


def canvas_pair(view: Viewport) -> tuple[np.ndarray, np.ndarray, list]:
    """The left viewer's canvas drawn as it is and with the drawing layer (the labels) hidden, and
    the label colours."""
    urls = view.js(
        "const s = window.medsegViewport, nv = s.nv, keep = nv.drawOpacity, out = [];"
        "nv.drawNow(); out.push(nv.canvas.toDataURL('image/png'));"
        "nv.drawOpacity = 0; nv.drawNow(); out.push(nv.canvas.toDataURL('image/png'));"
        "nv.drawOpacity = keep; nv.drawNow();"
        "return [out, s.labels.filter(l => l.value > 0).map(l => l.colour)];"
    )
    shown, plain = (
        np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB"), float)
        for u in urls[0]
    )
    return shown, plain, urls[1]


def overlay_alpha(view: Viewport) -> np.ndarray:
    """Per pixel the labels change: the alpha that blends the nearest label colour over the anatomy
    (least squares over R, G, B)."""
    shown, plain, colours = canvas_pair(view)
    changed = (np.abs(shown - plain).max(axis=2) > 8).reshape(-1)
    s, p = shown.reshape(-1, 3)[changed], plain.reshape(-1, 3)[changed]
    best = np.full(len(s), np.inf)
    alpha = np.zeros(len(s))
    for c in colours:
        d = np.asarray(c, float) - p
        a = ((s - p) * d).sum(axis=1) / np.maximum((d * d).sum(axis=1), 1.0)
        res = np.abs(s - (p + a[:, None] * d)).sum(axis=1)
        better = res < best
        best[better], alpha[better] = res[better], a[better]
    assert len(alpha) > 50, "the labels changed almost no pixel"
    return alpha


def select_box(driver, label: str):
    return driver.find_element(
        By.XPATH, f"//div[@data-testid='stSelectbox'][.//label[contains(., '{label}')]]"
    )


def selected(driver, label: str) -> str:
    """The select box's shown value (Streamlit 1.67: a combo box input)."""
    return select_box(driver, label).find_element(By.TAG_NAME, "input").get_attribute("value").strip()


def choose(driver, label: str, option: str | None = None) -> list[str]:
    """Open the select box ``label``: its options; clicks ``option`` if given (else closes it)."""
    select_box(driver, label).find_element(By.CSS_SELECTOR, "[aria-label='Open']").click()
    items = WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "[role='option']"))
    texts = [i.text.strip() for i in items]
    if option is None:
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        WebDriverWait(driver, 20).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "[role='option']"))
    else:
        next(i for i in items if i.text.strip() == option).click()
    return texts


def number(driver, label: str) -> float:
    box = driver.find_element(
        By.XPATH, f"//div[@data-testid='stNumberInput'][.//label[contains(., '{label}')]]"
    )
    return float(box.find_element(By.TAG_NAME, "input").get_attribute("value"))


def letters(view: Viewport) -> list[dict]:
    return view.js(
        "return Array.from(document.querySelectorAll('#pane1 .letters span')).map(s => {"
        " const r = s.getBoundingClientRect(); return {text: s.textContent, tile: +s.dataset.tile,"
        " x: r.left + r.width / 2, y: r.top + r.height / 2, px: parseFloat(getComputedStyle(s).fontSize)}; });"
    )


def mr_like(path: Path) -> tuple[Path, np.ndarray]:
    """A small MR-like scan: positive intensities, another shape and spacing than the test case."""
    rng = np.random.default_rng(1)
    data = (200 + 600 * rng.random((40, 36, 30))).astype(np.float32)
    data[10:30, 8:28, 5:25] += 400
    nib.save(nib.Nifti1Image(data, np.diag([1.2, 1.1, 1.5, 1.0])), path)
    return path, data


def check_orientation(view: Viewport, browser) -> None:
    spans = letters(view)
    want = {0: {"R", "L", "A", "P"}, 1: {"R", "L", "S", "I"}, 2: {"A", "P", "S", "I"}}
    for tile, names in want.items():
        left, top, width, height = view.tile(tile)
        mine = {s["text"]: s for s in spans if s["tile"] == tile}
        assert set(mine) == names, (tile, spans)
        assert all(s["px"] >= 14 for s in mine.values())
        by_x = sorted(mine.values(), key=lambda s: s["x"])
        by_y = sorted(mine.values(), key=lambda s: s["y"])
        frame = view.frame.rect  # the letters' boxes are in the frame's coordinates
        assert (
            by_x[0]["x"] + frame["x"] < left + 0.2 * width and by_x[-1]["x"] + frame["x"] > left + 0.8 * width
        )
        assert (
            by_y[0]["y"] + frame["y"] < top + 0.2 * height and by_y[-1]["y"] + frame["y"] > top + 0.8 * height
        )
        expect = {0: ("R", "L", "A", "P"), 1: ("R", "L", "S", "I"), 2: ("A", "P", "S", "I")}[tile]
        assert (by_x[0]["text"], by_x[-1]["text"], by_y[0]["text"], by_y[-1]["text"]) == expect, (tile, mine)
    # what the letters say is where the voxels are: left and right of the sagittal and coronal tiles
    for tile, axis in ((2, 1), (1, 0)):
        left, top, width, height = view.tile(tile)
        mm = []
        for fx in (0.3, 0.7):
            view.click(left + fx * width, top + 0.5 * height)
            mm.append(view.location()["mm"])
        assert mm[0][axis] > mm[1][axis], (tile, mm)  # anterior (sagittal) / patient's right on the left
    assert "Radiological convention" in view.js("return document.getElementById('convnote').textContent")


def test_viewer_view(server, browser, seg_data, tmp_path: Path) -> None:
    case = Path(load_dataset(seg_data).test[0]["image"])
    KEEP.mkdir(parents=True, exist_ok=True)
    browser.get(server)
    wait = WebDriverWait(browser, RESULT_TIMEOUT)
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]")).send_keys(str(case))
    click_button(browser, "Run segmentation with tiny-seg")
    wait.until(lambda d: "volume (mL)" in body_text(d))
    view = Viewport(browser)
    view.wait_volumes(2)
    time.sleep(1.0)

    # idle: no frame drawn while nothing changes
    frames = "return window.medsegViewport.nv.medsegFrames || 0"
    before = view.js(frames)
    time.sleep(3.0)
    assert view.js(frames) == before, "the viewport draws frames while nothing changes"

    # see-through labels with no tool on, at the sidebar's opacity
    assert view.js("return window.medsegViewport.tool") is None
    alpha = overlay_alpha(view)
    assert abs(np.median(alpha) - 0.4) < 0.06 and (alpha > 0.9).mean() < 0.05, np.percentile(
        alpha, [5, 50, 95]
    )
    browser.save_screenshot(str(KEEP / "viewer-overlay.png"))
    # the slider's thumb holds a visually hidden range input (React Aria), focused for the keyboard
    thumb = browser.find_element(By.XPATH, "//input[@type='range'][@aria-label='Overlay opacity']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].focus();", thumb)
    for _ in range(4):  # the keyboard, as a reader without a mouse moves it: 0.4 -> 0.2
        ActionChains(browser).send_keys(Keys.ARROW_LEFT).perform()
    WebDriverWait(browser, 60).until(
        lambda _: view.js("return window.medsegViewport.opacity") == pytest.approx(0.2)
    )
    alpha = overlay_alpha(view)
    assert abs(np.median(alpha) - 0.2) < 0.06, np.percentile(alpha, [5, 50, 95])

    # one orientation convention, said on screen, letters on every edge
    check_orientation(view, browser)
    browser.save_screenshot(str(KEEP / "viewer-orientation.png"))

    # window/level: CT presets; a drag shows as Custom with its values; a preset applies again
    assert selected(browser, WINDOW_BOX) == "Soft tissue"
    assert {"Soft tissue", "Lung", "Bone", "Brain", "Custom"} <= set(choose(browser, WINDOW_BOX))
    left, top, width, height = view.tile(0)
    view.right_drag(left + 0.5 * width, top + 0.5 * height, 90, 50)
    WebDriverWait(browser, 60).until(lambda d: selected(d, WINDOW_BOX) == "Custom")
    lo, hi = view.window()
    WebDriverWait(browser, 30).until(lambda d: abs(number(d, "Display width") - (hi - lo)) < 0.1)
    assert number(browser, "Display level") == pytest.approx((hi + lo) / 2, abs=0.1)
    choose(browser, WINDOW_BOX, "Soft tissue")
    WebDriverWait(browser, 60).until(lambda _: view.window() == pytest.approx((-160.0, 240.0)))

    # a new case over this one: brush on, crosshair near an edge first
    view.js("document.getElementById('brush').click();")
    assert view.js("return window.medsegViewport.tool") == "brush"
    view.js("document.getElementById('brush').click();")
    view.click(left + 0.08 * width, top + 0.1 * height)
    view.js("document.getElementById('brush').click();")
    mr_path, mr = mr_like(tmp_path / "mr.nii.gz")
    browser.find_element(By.CSS_SELECTOR, "input[type=file]").send_keys(str(mr_path))
    WebDriverWait(browser, RESULT_TIMEOUT).until(
        lambda _: view.js(
            "const s = window.medsegViewport; return !!(s.location && s.nv.volumes[0].dims[1] === 40)"
        )
    )
    WebDriverWait(browser, RESULT_TIMEOUT).until(lambda d: selected(d, WINDOW_BOX).startswith("Auto"))
    time.sleep(1.0)
    assert view.js("return window.medsegViewport.tool") is None
    assert "on" not in view.js("return document.getElementById('brush').className")
    loc = view.location()
    vox = np.round(loc["vox"]).astype(int)
    assert np.all(np.abs(vox - (np.array(mr.shape) - 1) / 2) <= 1), (vox, mr.shape)
    assert loc["value"] == pytest.approx(float(mr[tuple(vox)]), abs=0.5)
    assert f"intensity {float(mr[tuple(vox)]):.1f}" in loc["text"], loc["text"]
    options = choose(browser, WINDOW_BOX)
    assert not {"Soft tissue", "Lung", "Bone", "Brain"} & set(options), options
    lo, hi = view.window()
    p1, p99 = np.percentile(mr, [1, 99])
    assert lo == pytest.approx(p1, rel=0.05) and hi == pytest.approx(p99, rel=0.05), (lo, hi, p1, p99)
    shutil.copy(KEEP / "viewer-overlay.png", tmp_path / "viewer-overlay.png")

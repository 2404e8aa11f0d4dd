"""A failed upload keeps the case on show with the user's unsaved corrections (issue 30, item 7), in a
real browser: ``medseg app`` on a free port and Debian's headless Chromium (tests/browser.py).

TotalSegmentator's example CT (``../shared/data``) is uploaded and segmented with the tiny model; a
brush stroke is painted in the NiiVue viewport with real mouse events; then a PNG picture of the
scan, renamed ``.nii.gz``, is uploaded. The page must say what that file is, and the viewport must
still hold the same scan, the same label map and the stroke (its edit count and changed voxels), as
must the Corrections panel.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.apps import test_app_browser as app_browser
from tests.apps.test_app_browser import body_text, click_button
from tests.apps.test_app_browser_edit import edits, script_state, stroke, wait_seq
from tests.apps.test_app_state_upload import png_of
from tests.browser import RESULT_TIMEOUT, Viewport

server, browser = app_browser.server, app_browser.browser  # the fixtures: medseg app, chromium

CT = Path(__file__).resolve().parents[3] / "shared" / "data" / "totalseg-examples" / "example_ct_sm.nii.gz"
KEEP = Path(__file__).resolve().parents[2] / "test-output" / "test_upload_browser_keeps_edits"


def volume_ids(view: Viewport) -> list[str]:
    """The names NiiVue holds its volumes under (the scan's and the label map's)."""
    return view.js("return window.medsegViewport.nv.volumes.map(v => v.name)")


def idle(driver) -> None:
    WebDriverWait(driver, RESULT_TIMEOUT).until(lambda d: script_state(d) == "notRunning")


@pytest.mark.skipif(not CT.is_file(), reason=f"{CT} is not on this machine (shared real data)")
def test_a_failed_upload_keeps_the_strokes(server, browser, tmp_path: Path) -> None:
    KEEP.mkdir(parents=True, exist_ok=True)
    picture = tmp_path / "screenshot.nii.gz"
    picture.write_bytes(png_of(CT))
    browser.get(server)
    wait = WebDriverWait(browser, RESULT_TIMEOUT)
    try:
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]")).send_keys(str(CT))
        click_button(browser, "Run segmentation with tiny-seg")
        wait.until(lambda d: "volume (mL)" in body_text(d))
        view = Viewport(browser)
        view.wait_volumes(2)
        view.js("document.querySelector('[data-layout=axial]').click()")
        time.sleep(0.3)
        left, top, width, height = view.tile(0)
        view.js("document.getElementById('brush').click();")
        stroke(view, (left + 0.3 * width, top + 0.5 * height), (left + 0.7 * width, top + 0.5 * height))
        painted = wait_seq(view, 1)
        assert painted["changed"] > 0
        wait.until(lambda d: f"{painted['changed']} voxels differ" in body_text(d))
        idle(browser)
        volumes = volume_ids(view)

        browser.find_element(By.CSS_SELECTOR, "input[type=file]").send_keys(str(picture))
        wait.until(lambda d: "is a PNG image" in body_text(d))
        idle(browser)
        time.sleep(1.0)  # any re-render of the viewport would have happened by now
    finally:
        browser.save_screenshot(str(tmp_path / "after.png"))
        shutil.copy(tmp_path / "after.png", KEEP / "after.png")
    body = body_text(browser)
    assert "screenshot.nii.gz is a PNG image, not a NIfTI image" in body, body[:2000]
    assert "Nothing was replaced: the case on show is still example_ct_sm." in body, body[:2000]
    assert volume_ids(view) == volumes  # the same scan and label map in the viewport
    assert edits(view) == painted  # the stroke is still there, unsaved
    assert f"{painted['changed']} voxels differ" in body  # and the Corrections panel still offers it

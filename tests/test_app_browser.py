"""End to end in a real browser: ``medseg app`` on a free localhost port, Debian's chromium driven
headless by Selenium through Debian's chromium-driver (``make test`` installs both).

Uploads a NIfTI, runs segmentation, checks that coloured overlays and the volume table appear
with the numbers ``medseg infer``'s function gives, and saves screenshots under the test's tmp
folder.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from medseg.bundle import load_bundle
from medseg.datasets.decathlon import load_dataset
from medseg.infer import label_volumes, load_image, predict

START_TIMEOUT = 120
RESULT_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"medseg app exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"medseg app did not answer on {url} in {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def server(seg_run, tmp_path: Path):
    """``medseg app`` (the CLI) serving a runs folder that holds the tiny segmentation model."""
    runs = tmp_path / "runs"
    shutil.copytree(seg_run.run_dir / "bundle", runs / "tiny-seg" / "bundle")
    port = free_port()
    log = tmp_path / "app.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "medseg", "app", "--runs", str(runs), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://localhost:{port}"
    children: list[int] = []
    try:
        wait_healthy(url, proc, log)
        children = child_pids(proc.pid)
        yield url
    finally:
        proc.terminate()  # SIGTERM: medseg app passes it on to its Streamlit server
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.time() + 10
    while any(alive(c) for c in children) and time.time() < deadline:
        time.sleep(0.2)
    assert children and not any(alive(c) for c in children), "the Streamlit server outlived medseg app"


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are needed: run `make browser`"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1300"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        yield b
    finally:
        b.quit()


def tinted_pixels(png: bytes) -> int:
    """Pixels whose red and green differ clearly: label colours (grey has R = G, the crosshair too)."""
    rgb = np.asarray(Image.open(BytesIO(png)).convert("RGB")).astype(int)
    return int((np.abs(rgb[..., 0] - rgb[..., 1]) > 30).sum())


def test_upload_segment_in_chromium(server, browser, seg_run, seg_data, tmp_path: Path) -> None:
    case = Path(load_dataset(seg_data).test[0]["image"])
    bundle = load_bundle(seg_run.run_dir)
    want = label_volumes(predict(bundle, load_image(case), device="cpu").label, bundle.labels)

    browser.get(server)
    wait = WebDriverWait(browser, RESULT_TIMEOUT)
    try:
        file_input = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]"))
        file_input.send_keys(str(case))
        run = wait.until(
            lambda d: d.find_element(By.XPATH, "//button[contains(., 'Run segmentation with tiny-seg')]")
        )
        run.click()
        wait.until(lambda d: "sagittal · overlay" in d.find_element(By.TAG_NAME, "body").text)
        wait.until(lambda d: "volume (mL)" in d.find_element(By.TAG_NAME, "body").text)
        time.sleep(1.0)  # let the last images finish decoding before the screenshots
    finally:
        browser.save_screenshot(str(tmp_path / "viewer.png"))
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Traceback" not in body and "Error" not in body

    images = browser.find_elements(By.CSS_SELECTOR, "[data-testid='stImage'] img")
    assert len(images) == 3
    for n, img in enumerate(images):
        png = img.screenshot_as_png
        (tmp_path / f"panel-{n}.png").write_bytes(png)
        assert img.size["width"] > 100 and img.size["height"] > 100
    assert sum(tinted_pixels(img.screenshot_as_png) for img in images) > 50, "no label colours in the panels"

    rows = browser.find_elements(By.CSS_SELECTOR, "[data-testid='stTable'] tbody tr")
    cells = [[c.text for c in r.find_elements(By.CSS_SELECTOR, "td,th")] for r in rows]
    shown = {
        row[-3]: (int(row[-2]), float(row[-1]))
        for row in cells
        if len(row) >= 3 and row[-3] in {"organ", "lesion"}
    }
    assert set(shown) == {"organ", "lesion"}, cells
    for v in want:
        assert shown[v["label"]][0] == v["voxels"]
        assert shown[v["label"]][1] == pytest.approx(v["ml"], abs=0.006)
    assert (tmp_path / "viewer.png").stat().st_size > 10_000
    # also where CI can collect it (test-output/ is git-ignored)
    keep = Path(__file__).resolve().parents[1] / "test-output" / "test_app_browser"
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "viewer.png", keep / "viewer.png")

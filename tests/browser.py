"""Real-browser helpers shared by tests/apps/test_app_browser.py and scripts/bench_viewer.py.

``medseg app`` on a free localhost port, Debian's chromium headless through Selenium, and the
NiiVue viewport driven with real input events (Chrome DevTools Protocol ``Input.dispatchMouseEvent``)
and read back through the state its script keeps in ``window.medsegViewport``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

START_TIMEOUT = 120
RESULT_TIMEOUT = 240


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"medseg app exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise ServerError(f"medseg app did not answer on {url} in {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


# WebGL 2 without a GPU: Chrome's software rasteriser (SwiftShader), which newer Chrome only uses
# when asked; NiiVue needs WebGL 2.
CHROME_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--window-size=1600,1300",
    "--use-gl=angle",
    "--use-angle=swiftshader",
    "--enable-unsafe-swiftshader",
)


@contextmanager
def serve_app(runs: Path, log: Path) -> Iterator[str]:
    """``medseg app`` (the CLI) serving ``runs``; yields its URL. On exit it is stopped with SIGTERM,
    which it must pass on to its Streamlit server: a server that outlives it fails the test."""
    port = free_port()
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
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.time() + 10
    while any(alive(c) for c in children) and time.time() < deadline:
        time.sleep(0.2)
    assert children and not any(alive(c) for c in children), "the Streamlit server outlived medseg app"


def chrome(downloads: Path) -> webdriver.Chrome:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are needed: run `make browser`"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in CHROME_ARGS:
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads)})
    b = webdriver.Chrome(service=Service(driver), options=opts)
    b.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return b


class Viewport:
    """The NiiVue component's iframe, driven with real mouse events (CDP), read through its JS state."""

    def __init__(self, driver: webdriver.Chrome) -> None:
        self.d = driver
        self.frame = WebDriverWait(driver, RESULT_TIMEOUT).until(
            lambda d: d.find_element(By.CSS_SELECTOR, "iframe[src*='medseg_viewport']")
        )

    def js(self, script: str):
        self.d.switch_to.frame(self.frame)
        try:
            return self.d.execute_script(script)
        finally:
            self.d.switch_to.default_content()

    def wait_volumes(self, n: int) -> None:
        """Until the viewport shows ``n`` layers: the scan, the model's label map (in NiiVue's
        drawing layer) and a second mask's edges (an overlay volume), in that order."""
        WebDriverWait(self.d, RESULT_TIMEOUT).until(
            lambda _: self.js(
                "const s = window.medsegViewport; return !!(s && s.nv && s.nv.volumes.length + (s.edit ? 1 : 0) === "
                f"{n} && s.renderedAt)"
            )
        )

    def tile(self, plane: int) -> tuple[float, float, float, float]:
        """(left, top, width, height) in page CSS pixels of the 2D tile showing ``plane`` (0 axial)."""
        frame = self.frame.rect
        ltwh = self.js(
            "const nv = window.medsegViewport.nv; const r = nv.canvas.getBoundingClientRect();"
            f"const t = nv.screenSlices.find(s => s.axCorSag === {plane});"
            "const k = nv.uiData.dpr || 1; const [l, tp, w, h] = t.leftTopWidthHeight;"
            "return [r.left + l / k, r.top + tp / k, w / k, h / k];"
        )
        return frame["x"] + ltwh[0], frame["y"] + ltwh[1], ltwh[2], ltwh[3]

    def mouse(self, kind: str, x: float, y: float, button: str = "left", **extra) -> None:
        self.d.execute_cdp_cmd(
            "Input.dispatchMouseEvent",
            {"type": kind, "x": x, "y": y, "button": button, "clickCount": 1, **extra},
        )

    def click(self, x: float, y: float) -> None:
        self.mouse("mouseMoved", x, y, button="none")
        self.mouse("mousePressed", x, y, buttons=1)
        self.mouse("mouseReleased", x, y)

    def wheel(self, x: float, y: float, dy: float) -> None:
        self.mouse("mouseWheel", x, y, button="none", deltaX=0, deltaY=dy)

    def right_drag(self, x: float, y: float, dx: float, dy: float) -> None:
        self.mouse("mouseMoved", x, y, button="none")
        self.mouse("mousePressed", x, y, button="right", buttons=2)
        for f in (0.25, 0.5, 0.75, 1.0):
            self.mouse("mouseMoved", x + f * dx, y + f * dy, button="right", buttons=2)
        self.mouse("mouseReleased", x + dx, y + dy, button="right")

    def location(self) -> dict:
        return self.js(
            "const l = window.medsegViewport.location; if (!l) return null;"
            "return {mm: Array.from(l.values[0].mm).slice(0, 3), vox: l.storedVox, value: l.values[0].value,"
            " label: l.label === undefined ? null : l.label, text: document.getElementById('readout').textContent,"
            " ras: Array.from(window.medsegViewport.nv.frac2vox(window.medsegViewport.nv.scene.crosshairPos))};"
        )

    def window(self) -> tuple[float, float]:
        return tuple(self.js("const v = window.medsegViewport.nv.volumes[0]; return [v.cal_min, v.cal_max];"))

"""Viewer speed in a real browser (headless Chromium, WebGL through SwiftShader): the viewer's speed targets.

    .venv/bin/python scripts/bench_viewer.py [--run runs/demo-seg] [--markdown docs/benchmarks.md] [--shots docs]
    .venv/bin/python scripts/bench_viewer.py --first-paint-only   # the 512 x 512 x 300 first paint alone
    .venv/bin/python scripts/bench_viewer.py --edit-only [--markdown docs/benchmarks.md]   # editing rows

Starts ``medseg app`` with the model, drives Debian's chromium with real input events (Chrome
DevTools Protocol) and measures:

- first paint of a 512 x 512 x 300 CT in the viewport: from handing the file to the page's file
  input to the viewport's first drawn frame of that scan (the browser's clock and this process's
  are the same machine's wall clock; "drawn" is when the GPU has finished the frame). A scan that
  large is painted first as a reduced-resolution preview (1 voxel in n along each axis): that
  frame counts as the first paint, and the time the full-resolution scan's first frame is drawn
  is reported beside it;
- slice scrolling: one wheel step on the axial tile, in the page: from the wheel event's own
  timestamp (when the browser received the input) to the frame that shows the new slice finished
  on the (software) GPU (a 1-pixel ``readPixels`` after the draw waits for it), median over steps.
  With software WebGL the viewport draws at reduced resolution while slices scroll (``viewport.js``,
  motion resolution); the same steps with that switched off are measured in the same run as the
  full-resolution anchor, and so is the time until the full-resolution frame is back after the last
  step. Beside it, the WebDriver step: from sending the event to the crosshair having moved and the
  next animation frame (``gl.finish()`` inside it), which adds this process's round trips;
- click-to-crosshair: a left click on the axial tile, to the same point (WebDriver step);
- end to end on a 256 x 256 x 128 CT: upload, press Run, until the volume table and the label map
  in the viewport are shown.

Editing (``--edit-only``, its own ``bench:viewer-edit`` section): a real CT (TotalSegmentator's
``example_ct_sm.nii.gz``, 122 x 101 x 30) resampled to 512 x 512 x 300 in a temporary folder, uploaded
and segmented in the page (Run to the volume table and the labels drawn, against ``medseg infer`` on
the same file with the browser open), then 20 rounds of: Brush on, a 9-voxel brush stroke on the axial tile, Undo, Brush
off, each a real click or drag (CDP). Timed in the page from each input event's own timestamp to
the next frame finished on the GPU (a 1-pixel ``readPixels``): tool toggle and undo from their click,
a stroke as its slowest step (each pointer move and the release to the frame that shows it).

The WebDriver step times include this process's round trips (a few ms each), so they are upper
bounds. Ratios are measured / target (<= 1 meets it). Screenshots of the layout go to ``--shots``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.browser as tb  # noqa: E402
from tests.browser import Viewport, chrome, serve_app  # noqa: E402

RESULT_TIMEOUT = tb.RESULT_TIMEOUT = (
    1200  # a loaded shared machine can be slow; this measures, it does not gate
)

TARGETS = {"scroll_ms": 50.0, "click_ms": 100.0, "first_paint_s": 5.0, "segment_s": 30.0}
EDIT_TARGETS = {"stroke_ms": 150.0, "toggle_ms": 50.0, "undo_ms": 150.0, "infer_ratio": 1.2}
MARK, END = "<!-- bench:viewer -->", "<!-- /bench:viewer -->"
REAL_CT = ROOT.parent / "shared" / "data" / "totalseg-examples" / "example_ct_sm.nii.gz"


def big_ct(path: Path, shape=(512, 512, 300), spacing=(0.7, 0.7, 1.0)) -> Path:
    """A CT-like int16 volume: air, a body ellipse at soft tissue, a few brighter blobs, mild noise."""
    rng = np.random.default_rng(0)
    x, y = np.meshgrid(np.linspace(-1, 1, shape[0]), np.linspace(-1, 1, shape[1]), indexing="ij")
    body = (x / 0.8) ** 2 + (y / 0.6) ** 2 < 1
    vol = np.full(shape, -1000, np.int16)
    vol[body] = 40
    for _ in range(6):
        cx, cy, r = rng.uniform(-0.4, 0.4), rng.uniform(-0.3, 0.3), rng.uniform(0.05, 0.15)
        vol[(x - cx) ** 2 + (y - cy) ** 2 < r**2] = int(rng.integers(60, 400))
    vol += rng.normal(0, 10, shape).astype(np.int16)
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    nib.save(nib.Nifti1Image(vol, affine), path)
    return path


def real_ct(path: Path, source: Path = REAL_CT, shape=(512, 512, 300)) -> Path:
    """A real CT resampled (linear) to ``shape``, its affine scaled to match: same anatomy, same
    field of view, the voxel count of a full CT."""
    from scipy.ndimage import zoom

    src = nib.load(source)
    data = np.asanyarray(src.dataobj).astype(np.float32)
    factors = [n / m for n, m in zip(shape, data.shape, strict=True)]
    out = zoom(data, factors, order=1)
    affine = src.affine.copy()
    affine[:3, :3] = affine[:3, :3] @ np.diag([1 / f for f in factors])
    nib.save(nib.Nifti1Image(np.round(out).astype(np.int16), affine), path)
    return path


def seg_ct(out: Path) -> Path:
    from medseg.datasets.synthetic import make_seg_dataset

    make_seg_dataset(out, n_train=0, n_test=1, seed=7, size=256, z_factor=2)
    (path,) = sorted((out / "imagesTs").glob("*.nii.gz"))
    return path


def _upload(driver, path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, RESULT_TIMEOUT).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "input[type=file]")
    ).send_keys(str(path))


def _shot(driver, path: Path) -> None:
    """A screenshot; a renderer starved by a loaded machine may time out once, so it is retried."""
    from selenium.common.exceptions import TimeoutException

    for _ in range(3):
        try:
            driver.save_screenshot(str(path))
            return
        except TimeoutException:
            time.sleep(2)
    print(f"no screenshot {path.name}: the browser did not answer", flush=True)


def _frame_done(view: Viewport) -> None:
    """Return after the next animation frame in the viewport has been drawn and finished."""
    view.d.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "requestAnimationFrame(() => { window.medsegViewport.nv.gl.finish(); done(true); });"
    )


# In the page: each wheel event's timestamp (the browser's, when it received the input) and the
# frame drawn after it, forced to completion on the GPU (a 1-pixel readPixels waits for it; Chrome's
# gl.finish() does not). ``lat``: per wheel step, the event to that finished frame. With ``rest``
# set (arguments[1]), every frame is timed with its canvas width, to see the full-resolution frame
# come back after scrolling. Other frames (clicks) are left alone. Installed once per page;
# arguments[0] starts a new series.
PAGE_CLOCK = r"""
const s = window.medsegViewport, nv = s.nv, gl = nv.gl;
if (!s.benchClock) {
  const px = new Uint8Array(4), c = { wheel: null, lastWheel: null, rest: false, lat: [], frames: [] };
  s.benchClock = c;
  nv.canvas.addEventListener("wheel", (e) => { c.wheel = e.timeStamp; c.lastWheel = e.timeStamp; },
    { capture: true, passive: true });
  const core = nv.drawSceneCore.bind(nv);
  nv.drawSceneCore = (...a) => {
    const r = core(...a);
    if (c.wheel === null && !c.rest) return r;
    gl.readPixels(0, 0, 1, 1, gl.RGBA, gl.UNSIGNED_BYTE, px);
    const t = performance.now();
    c.frames.push([t, nv.canvas.width]);
    if (c.wheel !== null) { c.lat.push(t - c.wheel); c.wheel = null; }
    return r;
  };
}
const c = s.benchClock;
if (arguments[0]) { c.lat = []; c.frames = []; }
c.rest = !!arguments[1];
return { lat: c.lat, frames: c.frames, lastWheel: c.lastWheel };
"""


def measure_steps(view: Viewport, steps: int) -> dict[str, list[float]]:
    """WebDriver step times of ``steps`` wheel steps and clicks; the wheel steps' in-page times; ms
    from the last wheel step to the full-resolution frame back (``back_ms``: [] if none came)."""
    left, top, width, height = view.tile(0)
    x, y = left + width / 2, top + height / 2
    view.click(x, y)
    time.sleep(0.5)
    view.d.switch_to.frame(view.frame)
    full_width = view.d.execute_script("return window.medsegViewport.nv.canvas.width")
    view.d.execute_script(PAGE_CLOCK, True, False)
    scroll, click = [], []
    try:
        read = "return Array.from(window.medsegViewport.nv.frac2vox(window.medsegViewport.nv.scene.crosshairPos));"
        for n in range(steps):
            before = view.d.execute_script(read)
            s = time.perf_counter()
            view.wheel(x, y, -120 if (n // 10) % 2 == 0 else 120)
            while view.d.execute_script(read) == before:
                pass
            _frame_done(view)
            scroll.append((time.perf_counter() - s) * 1000)
        page = list(view.d.execute_script(PAGE_CLOCK, False, True)["lat"])
        time.sleep(1.0)  # well past the viewport's rest time, no input
        c = view.d.execute_script(PAGE_CLOCK, False, False)
        back = [t - c["lastWheel"] for t, w in c["frames"] if t > c["lastWheel"] and w == full_width][:1]
        for n in range(steps):
            fx = 0.3 + 0.4 * ((n * 7) % steps) / steps
            before = view.d.execute_script(read)
            s = time.perf_counter()
            view.click(left + fx * width, top + (0.35 + 0.3 * (n % 2)) * height)
            deadline = time.time() + 5
            while view.d.execute_script(read) == before and time.time() < deadline:
                pass
            _frame_done(view)
            click.append((time.perf_counter() - s) * 1000)
    finally:
        view.d.switch_to.default_content()
    return {"scroll_ms": page, "scroll_webdriver_ms": scroll, "click_ms": click, "back_ms": back}


def measure_scrolling(view: Viewport, steps: int) -> dict[str, float]:
    """Scroll and click steps as the viewport runs, then the scroll steps at full resolution."""
    software = view.js("return window.medsegViewport.software")
    got = measure_steps(view, steps)
    view.js("window.medsegViewport.motion = false;")
    try:
        anchor = measure_steps(view, steps)
    finally:
        view.js("window.medsegViewport.motion = !!window.medsegViewport.software;")
    med = statistics.median
    return {
        "renderer": software or "a GPU",
        "scroll_ms": med(got["scroll_ms"]),
        "scroll_max_ms": max(got["scroll_ms"]),
        "scroll_webdriver_ms": med(got["scroll_webdriver_ms"]),
        "full_resolution_back_ms": got["back_ms"][0] if got["back_ms"] else None,
        "scroll_full_resolution_ms": med(anchor["scroll_ms"]),
        "scroll_full_resolution_webdriver_ms": med(anchor["scroll_webdriver_ms"]),
        "click_ms": med(got["click_ms"]),
        "click_max_ms": max(got["click_ms"]),
    }


def anchor_read(big: Path) -> float:
    """The same-run anchor: seconds for this process to read ``big`` whole with nibabel (decompress
    and decode), a fixed piece of work that slows down with the machine's load as the page does."""
    t = time.perf_counter()
    np.asanyarray(nib.load(big).dataobj)
    return time.perf_counter() - t


def first_paint(driver, big: Path) -> float:
    """Seconds from handing ``big`` to the page's file input to the viewport's first frame of it."""
    old = None
    frames = driver.find_elements("css selector", "iframe[src*='medseg_viewport']")
    if frames:
        old = Viewport(driver).js("return window.medsegViewport && window.medsegViewport.loadedAt")
    t0 = time.time()
    _upload(driver, big)
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    view = Viewport(driver)  # waits for the component's frame (a first upload draws it)

    def painted(_) -> bool:
        try:
            return (view.js("return window.medsegViewport && window.medsegViewport.loadedAt") or 0) > (
                old or 0
            )
        except TimeoutException:  # the frame's renderer is busy with the volume: ask again
            return False

    WebDriverWait(driver, RESULT_TIMEOUT).until(painted)
    fp = view.js("return window.medsegViewport.loadedAt") / 1000 - t0
    first_paint.preview = view.js("return window.medsegViewport.timeline.preview || 0")
    first_paint.breakdown = breakdown(t0, view)
    if first_paint.preview:  # a reduced-resolution preview came first: wait for the full scan's frame

        def full(_) -> bool:
            try:
                return bool(
                    view.js("const t = window.medsegViewport.timeline; return !t.preview && !!t.drawn")
                )
            except TimeoutException:
                return False

        WebDriverWait(driver, RESULT_TIMEOUT).until(full)
        first_paint.full_s = view.js("return window.medsegViewport.timeline.drawn") / 1000 - t0
        for k, v in breakdown(t0, view).items():
            if k.startswith("viewport"):
                first_paint.breakdown[f"full: {k}"] = v
    else:
        first_paint.full_s = fp
    return fp


def breakdown(t0: float, view: Viewport) -> dict[str, float]:
    """Where the first paint's time went, in seconds since ``t0`` (the file handed to the page):
    the server's stage marks (``MEDSEG_APP_TIMINGS``, the last upload's) and the viewport's timeline
    (message in, scan parsed, added to NiiVue, first frame drawn), all on this machine's wall clock."""
    out: dict[str, float] = {}
    path = os.environ.get("MEDSEG_APP_TIMINGS")
    if path and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            mark = json.loads(line)
            if mark["t"] >= t0 and f"server {mark['stage']}" not in out:
                out[f"server {mark['stage']}"] = round(mark["t"] - t0, 3)
    tl = view.js("return window.medsegViewport.timeline") or {}
    for k in ("message", "parsed", "added", "drawn"):
        if tl.get(k):
            out[f"viewport {k}"] = round(tl[k] / 1000 - t0, 3)
    if tl.get("bytes"):
        out["viewport MB received"] = round(tl["bytes"] / 2**20, 1)
    return out


def measure_first_paint(driver, big: Path) -> dict:
    """:func:`first_paint` of ``big`` with its same-run anchor (:func:`anchor_read`), printed."""
    anchor = anchor_read(big)
    fp = first_paint(driver, big)
    print(
        f"first paint of 512x512x300 {fp:.1f} s (preview step {first_paint.preview or 'none'}; "
        f"full resolution drawn at {first_paint.full_s:.1f} s; anchor: nibabel reads it in {anchor:.1f} s)",
        flush=True,
    )
    return {
        "anchor_read_s": anchor,
        "first_paint_per_anchor": fp / anchor,
        "first_paint_s": fp,
        "first_paint_preview_step": first_paint.preview,
        "full_resolution_s": first_paint.full_s,
        "first_paint_mb": big.stat().st_size / 2**20,
        "first_paint_breakdown": first_paint.breakdown,
    }


def run_bench(run: Path, steps: int, shots: Path | None, only_first_paint: bool = False) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tmp = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    runs = tmp / "runs"
    runs.mkdir()
    (runs / "model").symlink_to(run.resolve())
    big = big_ct(tmp / "ct-512x512x300.nii.gz")
    small = None if only_first_paint else seg_ct(tmp / "data")
    log = tmp / "app.log"
    os.environ["MEDSEG_APP_TIMINGS"] = str(tmp / "timings.jsonl")  # the page's stage marks
    driver = None
    with serve_app(runs, log) as url:  # stops the app, and checks its Streamlit server went too
        try:
            driver = chrome(tmp / "downloads")
            # a renderer busy with a large volume may not answer a script call for minutes: measure, not fail
            driver.command_executor.client_config.timeout = RESULT_TIMEOUT
            driver.set_script_timeout(RESULT_TIMEOUT)
            driver.get(url)
            wait = WebDriverWait(driver, RESULT_TIMEOUT)
            if only_first_paint:  # the 512 x 512 x 300 CT as the session's first upload, nothing else
                return measure_first_paint(driver, big)

            # 256 x 256 x 128: upload, Run, until the table and the label map are shown
            t0 = time.time()
            _upload(driver, small)
            button = wait.until(
                lambda d: d.find_element(By.XPATH, "//button[contains(., 'Run segmentation')]")
            )
            t_upload = time.time() - t0
            button.click()
            wait.until(lambda d: "volume (mL)" in d.find_element(By.TAG_NAME, "body").text)
            view = Viewport(driver)
            view.wait_volumes(2)
            segment_s = time.time() - t0
            print(f"256x256x128 end to end {segment_s:.1f} s (upload {t_upload:.1f} s)", flush=True)
            time.sleep(1.0)
            if shots:
                shots.mkdir(parents=True, exist_ok=True)
                _shot(driver, shots / "viewer-multiplanar.png")
            steps_ms = measure_scrolling(view, steps)
            print(
                f"scroll median {steps_ms['scroll_ms']:.0f} ms in the page "
                f"({steps_ms['scroll_webdriver_ms']:.0f} ms WebDriver step; full resolution "
                f"{steps_ms['scroll_full_resolution_ms']:.0f} / {steps_ms['scroll_full_resolution_webdriver_ms']:.0f} ms; "
                f"full resolution back {_ms(steps_ms['full_resolution_back_ms'])} after the last step), "
                f"click median {steps_ms['click_ms']:.0f} ms",
                flush=True,
            )
            if shots:
                view.js(
                    "document.querySelector('[data-layout=axial]').click(); document.getElementById('outline').click();"
                )
                time.sleep(0.5)
                _shot(driver, shots / "viewer-axial-outline.png")
                view.js(
                    "document.querySelector('[data-layout=multi]').click(); document.getElementById('outline').click();"
                )

            # 512 x 512 x 300: from the file input to the viewport's first frame of it
            painted = measure_first_paint(driver, big)
        finally:
            if driver is not None:
                driver.quit()
    return {
        "segment_s": segment_s,
        "segment_upload_s": t_upload,
        **painted,
        **steps_ms,
        "steps": steps,
    }


def _ms(v: float | None) -> str:
    return "not seen" if v is None else f"{v:.0f} ms"


def markdown_section(r: dict) -> str:
    m = r["measured"]
    rows = [
        (
            "slice scroll, in the page: wheel event to the finished frame of the new slice, median of "
            + f"{m['steps']} (max {m['scroll_max_ms']:.0f} ms); reduced resolution while scrolling "
            + f"(full resolution back {_ms(m['full_resolution_back_ms'])} after the last step). "
            + f"Same steps at full resolution: {m['scroll_full_resolution_ms']:.0f} ms. "
            + f"WebDriver step (adds this script's round trips): {m['scroll_webdriver_ms']:.0f} ms, "
            + f"at full resolution {m['scroll_full_resolution_webdriver_ms']:.0f} ms",
            f"{m['scroll_ms']:.0f} ms",
            f"≤ {TARGETS['scroll_ms']:.0f} ms",
            m["scroll_ms"] / TARGETS["scroll_ms"],
        ),
        (
            "click to crosshair drawn, median of " + f"{m['steps']} (max {m['click_max_ms']:.0f} ms)",
            f"{m['click_ms']:.0f} ms",
            f"≤ {TARGETS['click_ms']:.0f} ms",
            m["click_ms"] / TARGETS["click_ms"],
        ),
        (
            f"first paint of a 512 × 512 × 300 CT after upload ({m['first_paint_mb']:.0f} MB .nii.gz)"
            + (
                f": a preview, 1 voxel in {m['first_paint_preview_step']} along each axis; "
                f"the full-resolution scan drawn at {m['full_resolution_s']:.1f} s"
                if m.get("first_paint_preview_step")
                else ": the full-resolution scan"
            ),
            f"{m['first_paint_s']:.1f} s",
            f"≤ {TARGETS['first_paint_s']:.0f} s",
            m["first_paint_s"] / TARGETS["first_paint_s"],
        ),
        (
            f"256 × 256 × 128 CT: upload, Run, table and label map shown (upload part {m['segment_upload_s']:.1f} s)",
            f"{m['segment_s']:.1f} s",
            f"≤ {TARGETS['segment_s']:.0f} s",
            m["segment_s"] / TARGETS["segment_s"],
        ),
    ]
    table = "\n".join(f"| {a} | {b} | {c} | {d:.2f} |" for a, b, c, d in rows)
    return f"""
## Viewer in a real browser: `.venv/bin/python scripts/bench_viewer.py --run {r["run"]}`

{r["date"]}, {r["machine"]} (1-minute load average {r["load_average"][0]} before, {r["load_average"][1]} after{": other work shared the cores" if max(r["load_average"]) > 1.5 else ""}); Debian's chromium headless,
WebGL 2 through {r["measured"].get("renderer", "SwiftShader")} (software, no GPU), real input events through the DevTools protocol.
The click's step time includes WebDriver round trips, so it is an upper bound.

| measure | time | target | ratio (≤ 1 meets) |
|---|---|---|---|
{table}

Screenshots: `docs/viewer-multiplanar.png` (the three planes, label overlay, readout, per-label
controls; the 3D render is its own layout), `docs/viewer-axial-outline.png` (single view, labels as
outlines).
"""


# In the page: for each editing input (a pointer move or release with a tool on, a click on Brush or
# Undo) the time from the event's own timestamp to the next frame drawn after its handlers ran,
# finished on the GPU (1-pixel readPixels). Installed once; arguments[0] clears the list.
EDIT_CLOCK = r"""
const s = window.medsegViewport, nv = s.nv, gl = nv.gl;
if (!s.editClock) {
  const px = new Uint8Array(4), c = { lat: [] };
  s.editClock = c;
  const finish = (tag, t0) => setTimeout(() => requestAnimationFrame(() => {
    gl.readPixels(0, 0, 1, 1, gl.RGBA, gl.UNSIGNED_BYTE, px);
    c.lat.push([tag, performance.now() - t0]);
  }), 0);
  nv.canvas.addEventListener("mousemove", (e) => { if (e.buttons === 1 && s.tool) finish("move", e.timeStamp); }, true);
  nv.canvas.addEventListener("mouseup", (e) => { if (s.tool) finish("up", e.timeStamp); }, true);
  for (const id of ["brush", "undo"]) document.getElementById(id).addEventListener("click", (e) => finish(id, e.timeStamp), true);
}
if (arguments[0]) s.editClock.lat = [];
return s.editClock.lat;
"""


def _button(view: Viewport, name: str) -> tuple[float, float]:
    frame = view.frame.rect
    x, y = view.js(
        f"const r = document.getElementById('{name}').getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2];"
    )
    return frame["x"] + x, frame["y"] + y


def _timed(view: Viewport, act, tags: set[str], until=None) -> list[float]:
    """Run ``act`` (real input events), wait for its latencies (and ``until``); those tagged ``tags``."""
    from selenium.webdriver.support.ui import WebDriverWait

    view.js(f"return (function () {{ {EDIT_CLOCK} }}).apply(null, [true]);")
    act()
    wait = WebDriverWait(view.d, RESULT_TIMEOUT)
    if until is not None:
        wait.until(lambda _: until())
    wait.until(
        lambda _: any(
            t in tags for t, _ in view.js(f"return (function () {{ {EDIT_CLOCK} }}).apply(null, [false]);")
        )
    )
    time.sleep(0.3)  # the last frames of the step
    got = view.js(f"return (function () {{ {EDIT_CLOCK} }}).apply(null, [false]);")
    return [ms for t, ms in got if t in tags]


def _settled(view: Viewport) -> None:
    """Until the page's script run that an edit's report started has ended (the Corrections panel
    has applied the edit on the server): the next step then meets the viewer alone."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def state(d) -> str:
        return d.find_element(By.CSS_SELECTOR, "[data-testid='stApp']").get_attribute(
            "data-test-script-state"
        )

    time.sleep(0.3)
    WebDriverWait(view.d, RESULT_TIMEOUT).until(lambda d: state(d) == "notRunning")


def measure_editing(view: Viewport, rounds: int) -> dict:
    """``rounds`` of Brush on, a 9-voxel stroke on the axial tile, Undo, Brush off (see the top)."""
    view.js(
        "const p = document.getElementById('pensize'); p.value = '9'; p.dispatchEvent(new Event('change'));"
    )
    left, top, width, height = view.tile(0)
    seq = lambda: view.js("return window.medsegViewport.edit.seq")  # noqa: E731
    toggle, stroke, moves, undo = [], [], [], []
    for n in range(rounds):
        toggle += _timed(view, lambda: view.click(*_button(view, "brush")), {"brush"})
        y = top + (0.35 + 0.3 * n / rounds) * height
        start, end = (left + 0.35 * width, y), (left + 0.65 * width, y)
        before = seq()

        def drag(a=start, b=end) -> None:
            view.mouse("mouseMoved", *a, button="none")
            view.mouse("mousePressed", *a, buttons=1)
            for k in range(1, 9):
                view.mouse("mouseMoved", a[0] + k / 8 * (b[0] - a[0]), a[1], buttons=1)
            view.mouse("mouseReleased", *b)

        steps = _timed(view, drag, {"move", "up"}, until=lambda b=before: seq() > b)
        stroke.append(max(steps))
        moves += steps
        _settled(view)
        before = seq()
        undo += _timed(
            view, lambda: view.click(*_button(view, "undo")), {"undo"}, until=lambda b=before: seq() > b
        )
        _settled(view)
        toggle += _timed(view, lambda: view.click(*_button(view, "brush")), {"brush"})
    med = statistics.median
    return {
        "rounds": rounds,
        "stroke_ms": med(stroke),
        "stroke_max_ms": max(stroke),
        "stroke_step_ms": med(moves),
        "toggle_ms": med(toggle),
        "toggle_max_ms": max(toggle),
        "undo_ms": med(undo),
        "undo_max_ms": max(undo),
    }


def browser_cpu_s(driver) -> float:
    """CPU seconds (user + system) used so far by the browser's processes (chromedriver's children):
    what the page costs a 2-core machine while the model runs beside it."""
    import psutil

    total = 0.0
    for proc in psutil.Process(driver.service.process.pid).children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def infer_cli_s(run: Path, scan: Path, out: Path) -> float:
    """Seconds ``medseg infer`` takes on ``scan`` (the same process start a user pays)."""
    import subprocess

    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "medseg",
            "infer",
            "--run",
            str(run),
            "--input",
            str(scan),
            "--output",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t


def run_edit_bench(run: Path, rounds: int, shots: Path | None) -> dict:
    """The editing rows: a real CT at 512 x 512 x 300, segmented in the page, edited ``rounds`` times."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tmp = Path(tempfile.mkdtemp(prefix="bench-viewer-edit-"))
    runs = tmp / "runs"
    runs.mkdir()
    (runs / "model").symlink_to(run.resolve())
    ct = real_ct(tmp / "ct-real-512x512x300.nii.gz")
    os.environ["MEDSEG_APP_TIMINGS"] = str(tmp / "timings.jsonl")  # where the page's run went
    driver = None
    with serve_app(runs, tmp / "app.log") as url:
        try:
            driver = chrome(tmp / "downloads")
            driver.command_executor.client_config.timeout = RESULT_TIMEOUT
            driver.set_script_timeout(RESULT_TIMEOUT)
            driver.get(url)
            wait = WebDriverWait(driver, RESULT_TIMEOUT)
            _upload(driver, ct)
            button = wait.until(
                lambda d: d.find_element(By.XPATH, "//button[contains(., 'Run segmentation')]")
            )
            view = Viewport(driver)  # the full-resolution scan drawn: the page idle, as a reader's
            wait.until(
                lambda _: view.js("const t = window.medsegViewport.timeline; return !t.preview && !!t.drawn")
            )
            time.sleep(2.0)
            idle0 = browser_cpu_s(driver)
            cli_before = infer_cli_s(run, ct, tmp / "cli-mask.nii.gz")  # the browser open, idle
            idle_cpu = browser_cpu_s(driver) - idle0  # what the idle page costs while nothing changes
            cpu0, t0 = browser_cpu_s(driver), time.time()
            button.click()
            wait.until(lambda d: "volume (mL)" in d.find_element(By.TAG_NAME, "body").text)
            view.wait_volumes(2)  # done when the reader sees both: the volumes and the labels drawn
            page_s = time.time() - t0
            stages = {k: v for k, v in breakdown(t0, view).items() if k.startswith("server")}
            stages["browser CPU s"] = round(browser_cpu_s(driver) - cpu0, 1)
            stages["browser CPU s while medseg infer ran (page idle)"] = round(idle_cpu, 1)
            print(f"inference in the page, seconds after the click: {stages}", flush=True)
            _settled(view)
            # before and after the page's run: the machine's load drifts while it is shared
            cli_s = (cli_before + infer_cli_s(run, ct, tmp / "cli-mask.nii.gz")) / 2
            print(f"inference: page {page_s:.1f} s, medseg infer {cli_s:.1f} s (mean of 2)", flush=True)
            got = measure_editing(view, rounds)
            if shots:
                _shot(driver, shots / "viewer-edit-ct.png")
        finally:
            if driver is not None:
                driver.quit()
    return {
        "infer_page_s": page_s,
        "infer_cli_s": cli_s,
        "infer_ratio": page_s / cli_s,
        "infer_stages": stages,
        **got,
    }


def markdown_edit_section(r: dict) -> str:
    m = r["measured"]
    rows = [
        (
            f"brush stroke to drawn (9 voxels wide, 8 moves), its slowest step, median of {m['rounds']} "
            f"(max {m['stroke_max_ms']:.0f} ms; each step's median {m['stroke_step_ms']:.0f} ms)",
            f"{m['stroke_ms']:.0f} ms",
            "≤ 150 ms",
            m["stroke_ms"] / EDIT_TARGETS["stroke_ms"],
        ),
        (
            f"tool toggle (Brush on or off) to the next frame, median of {2 * m['rounds']} (max {m['toggle_max_ms']:.0f} ms)",
            f"{m['toggle_ms']:.0f} ms",
            "≤ 50 ms",
            m["toggle_ms"] / EDIT_TARGETS["toggle_ms"],
        ),
        (
            f"undo of a stroke to drawn, median of {m['rounds']} (max {m['undo_max_ms']:.0f} ms)",
            f"{m['undo_ms']:.0f} ms",
            "≤ 150 ms",
            m["undo_ms"] / EDIT_TARGETS["undo_ms"],
        ),
        (
            f"inference in the page (Run to the volume table and the labels drawn): {m['infer_page_s']:.1f} s; `medseg infer` on the "
            f"same file, browser open and idle (mean of one run before and one after): {m['infer_cli_s']:.1f} s",
            f"{m['infer_ratio']:.2f} ×",
            "≤ 1.2 ×",
            m["infer_ratio"] / EDIT_TARGETS["infer_ratio"],
        ),
    ]
    table = "\n".join(f"| {a} | {b} | {c} | {d:.2f} |" for a, b, c, d in rows)
    return f"""
## Viewer editing at full CT size: `.venv/bin/python scripts/bench_viewer.py --edit-only --run {r["run"]}`

{r["date"]}, {r["machine"]}, run under `nice -n 5` (1-minute load average {r["load_average"][0]} before,
{r["load_average"][1]} after{": other work shared the cores" if max(r["load_average"]) > 1.5 else ""}); Debian's chromium headless, software WebGL
(SwiftShader), real input events. TotalSegmentator's `example_ct_sm.nii.gz` resampled to 512 × 512 × 300
(78.6 M voxels), segmented in the page with the model; timed in the page from each input event to the
next frame finished on the GPU; after a stroke or an undo the page's script run (the Corrections
panel applying the edit on the server) is let finish before the next step.

| measure | time | target | ratio (≤ 1 meets) |
|---|---|---|---|
{table}

Where the page's inference went, seconds after the click (server stage marks) and the browser's CPU:
{", ".join(f"{k}: {v}" for k, v in m.get("infer_stages", {}).items())}.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=Path("runs/demo-seg"), help="run or bundle folder")
    ap.add_argument("--steps", type=int, default=30, help="wheel steps and clicks to time")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument("--markdown", type=Path, help="update this file's bench:viewer section")
    ap.add_argument("--shots", type=Path, help="save screenshots of the layout in this folder")
    ap.add_argument(
        "--first-paint-only",
        action="store_true",
        help="measure only the first paint of the 512 x 512 x 300 CT (uploaded first; no --markdown)",
    )
    ap.add_argument(
        "--edit-only", action="store_true", help="measure only the editing rows (bench:viewer-edit)"
    )
    ap.add_argument("--rounds", type=int, default=20, help="editing rounds (stroke, undo, two toggles)")
    args = ap.parse_args(argv)
    if args.first_paint_only and args.markdown:
        ap.error("--first-paint-only measures one row; the bench:viewer section needs a full run")
    from medseg.bench.report import replace_section, write_json
    from medseg.bundle.load import find_bundle

    bundle = find_bundle(args.run)
    load_before = os.getloadavg()[0]
    if args.edit_only:
        measured = run_edit_bench(bundle, args.rounds, args.shots)
    else:
        measured = run_bench(bundle, args.steps, args.shots, args.first_paint_only)
    targets = EDIT_TARGETS if args.edit_only else TARGETS
    result = {
        "run": str(args.run),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "measured": measured,
        "ratios": {k: measured[k] / t for k, t in targets.items() if k in measured},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)
    if args.markdown and args.edit_only:
        replace_section(args.markdown, "viewer-edit", markdown_edit_section(result))
        print(f"wrote the bench:viewer-edit section of {args.markdown}")
    elif args.markdown:
        replace_section(args.markdown, "viewer", markdown_section(result))
        print(f"wrote the bench:viewer section of {args.markdown}")
    return 0 if all(v <= 1 for v in result["ratios"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a viewport scroll step's time goes: frame cost by variant, and the step itself.

    .venv/bin/python scripts/probe_viewer_frames.py [--run runs/demo-seg] [--steps 20]

Starts ``medseg app`` with the model, uploads the 256 x 256 x 128 CT of ``scripts/bench_viewer.py``,
runs the segmentation, then in the viewport's page:

- times NiiVue frames (``drawSceneCore``) under variants, each frame forced to completion with a
  1-pixel ``readPixels`` (Chrome's ``gl.finish()`` returns before SwiftShader has drawn), mean of 8;
- measures the benchmark's scroll and click steps (``bench_viewer.measure_steps``, median) as they
  are, without the readout's text update, in the axial layout and with nearest-neighbour sampling.

Prints one JSON object. An analysis tool: it changes the page's state as it goes and checks nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_viewer as bv  # noqa: E402

from tests.browser import Viewport, chrome, serve_app  # noqa: E402

FRAMES = r"""
const nv = window.medsegViewport.nv, gl = nv.gl, buf = new Uint8Array(4);
const px = () => gl.readPixels(0, 0, 1, 1, gl.RGBA, gl.UNSIGNED_BYTE, buf);
function t() { nv.drawNow(); px(); const a = performance.now(); for (let i = 0; i < 8; i++) { nv.drawNow(); px(); }
  return +((performance.now() - a) / 8).toFixed(1); }
const out = { canvas: [nv.canvas.width, nv.canvas.height] };
nv.setSliceType(3); out.multiplanar = t();
nv.setSliceType(0); out.axial = t();
nv.setSliceType(3);
const op = nv.drawOpacity; nv.drawOpacity = 0; out.labels_hidden = t(); nv.drawOpacity = op;
const cw = nv.opts.crosshairWidth; nv.opts.crosshairWidth = 0; out.no_crosshair = t(); nv.opts.crosshairWidth = cw;
nv.drawRimOpacity = 1; out.outlines = t(); nv.drawRimOpacity = -1;
nv.setInterpolation(true); out.nearest = t(); nv.setInterpolation(false);
let a = performance.now();
for (let i = 0; i < 8; i++) { gl.clear(gl.COLOR_BUFFER_BIT | gl.DEPTH_BUFFER_BIT); px(); }
out.clear_and_read = +((performance.now() - a) / 8).toFixed(1);
const w = nv.canvas.width, h = nv.canvas.height;
nv.canvas.width = Math.floor(w / 2); nv.canvas.height = Math.floor(h / 2); out.quarter_pixels = t();
nv.canvas.width = w; nv.canvas.height = h; nv.drawNow();
return out;
"""


def main(argv: list[str] | None = None) -> int:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "demo-seg")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="probe-viewer-"))
    runs = tmp / "runs"
    runs.mkdir()
    (runs / "model").symlink_to(args.run.resolve())
    ct = bv.seg_ct(tmp / "data")
    log = tmp / "app.log"
    driver = None
    result: dict = {}
    with serve_app(runs, log) as url:  # stops the app, and checks its Streamlit server went too
        try:
            driver = chrome(tmp / "downloads")
            driver.get(url)
            wait = WebDriverWait(driver, 600)
            bv._upload(driver, ct)
            wait.until(
                lambda d: d.find_element(By.XPATH, "//button[contains(., 'Run segmentation')]")
            ).click()
            wait.until(lambda d: "volume (mL)" in d.find_element(By.TAG_NAME, "body").text)
            view = Viewport(driver)
            view.wait_volumes(2)
            time.sleep(2.0)
            result["frame_ms"] = [view.js(FRAMES) for _ in range(2)]

            def steps(tag: str) -> None:
                got = bv.measure_steps(view, args.steps)
                result[f"step_ms {tag}"] = {k: round(statistics.median(v), 1) for k, v in got.items() if v}

            steps("as is")
            view.js("window.medsegViewport.nv.onLocationChange = () => {};")
            steps("no readout")
            view.js("window.medsegViewport.nv.setSliceType(0);")
            steps("axial, no readout")
            view.js("const nv = window.medsegViewport.nv; nv.setSliceType(3); nv.setInterpolation(true);")
            steps("nearest, no readout")
        finally:
            if driver is not None:
                driver.quit()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

// medseg viewport: NiiVue (vendored niivue.umd.js) inside a Streamlit custom component.
//
// Streamlit's component protocol is a few postMessage calls, written out here so no other npm
// package is needed: "componentReady" once, "render" messages in (args from Python), and
// "setComponentValue" / "setFrameHeight" out. The scan and the label map arrive as NIfTI bytes in
// the render message; nothing is fetched from anywhere.
(function () {
  "use strict";
  const SLICE = { axial: 0, coronal: 1, sagittal: 2, multi: 3, render: 4 };
  const state = {
    nv: null, ready: false, volumeId: null, labelsId: null, windowKey: null,
    labels: [], opacity: 0.5, outline: false, plane: 0, location: null,
    loadedAt: null, renderedAt: null, error: null,
    // editing: the brush and eraser paint NiiVue's drawing layer, loaded from the model's label map
    tool: null, editing: false, labelOrig: null, luts: null, editSeq: 0, edits: null,
    secondId: null, secondName: "",
    // side by side: a second NiiVue on the same scan with the second model's labels, crosshair linked
    nv2: null, sideId: null,
    // wall-clock ms of the last new scan's steps: message in, parsed, added, drawn (the benchmark
    // reads it); preview: n when that scan was a reduced-resolution preview (every n-th voxel)
    timeline: {},
    // software WebGL: the renderer's name (null with a GPU); motion: scrolling draws at reduced
    // resolution (on with software WebGL; the benchmark switches it off for its full-resolution anchor)
    software: null, motion: false, motionRestMs: 200,
  };
  window.medsegViewport = state; // read by the browser tests and the benchmark

  function send(type, data) {
    window.parent.postMessage(Object.assign({ isStreamlitMessage: true, type: type }, data || {}), "*");
  }
  function setValue(value) { send("streamlit:setComponentValue", { value: value, dataType: "json" }); }
  // what Python reads: WebGL works, and the edits made since the model's label map was loaded
  function report() { setValue(state.edits ? { webgl: true, edits: state.edits } : { webgl: true }); }
  function fitHeight() { send("streamlit:setFrameHeight", { height: document.body.scrollHeight + 4 }); }

  function arrayBuffer(bytes) {
    if (bytes instanceof ArrayBuffer) return bytes;
    return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
  }

  function fmt(v, d) { return (Math.round(v * 10 ** d) / 10 ** d).toFixed(d); }

  // voxel (i, j, k) of the file as stored, from a world position: inverse of the scan's affine
  function storedVoxel(mm) {
    const a = state.affine;
    if (!a) return null;
    const m = [[a[0][0], a[0][1], a[0][2]], [a[1][0], a[1][1], a[1][2]], [a[2][0], a[2][1], a[2][2]]];
    const det = m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0]) +
      m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]);
    const inv = [
      [(m[1][1] * m[2][2] - m[1][2] * m[2][1]) / det, (m[0][2] * m[2][1] - m[0][1] * m[2][2]) / det, (m[0][1] * m[1][2] - m[0][2] * m[1][1]) / det],
      [(m[1][2] * m[2][0] - m[1][0] * m[2][2]) / det, (m[0][0] * m[2][2] - m[0][2] * m[2][0]) / det, (m[0][2] * m[1][0] - m[0][0] * m[1][2]) / det],
      [(m[1][0] * m[2][1] - m[1][1] * m[2][0]) / det, (m[0][1] * m[2][0] - m[0][0] * m[2][1]) / det, (m[0][0] * m[1][1] - m[0][1] * m[1][0]) / det],
    ];
    const d = [mm[0] - a[0][3], mm[1] - a[1][3], mm[2] - a[2][3]];
    return inv.map((row) => Math.round(row[0] * d[0] + row[1] * d[1] + row[2] * d[2]));
  }

  function showLocation(data) {
    state.location = data;
    const vals = data.values || [];
    const mm = vals.length ? vals[0].mm : data.mm;
    data.storedVox = storedVoxel(mm); // NiiVue's own voxel indices are in its RAS-reordered copy
    const vox = data.storedVox || (vals.length ? vals[0].vox : data.vox);
    let text = `RAS ${fmt(mm[0], 1)}, ${fmt(mm[1], 1)}, ${fmt(mm[2], 1)} mm   voxel ${vox.map(Math.round).join(", ")}`;
    if (vals.length) text += `   intensity ${fmt(vals[0].value, 1)}`;
    const name = (v) => { const lab = state.labels.find((l) => l.value === v); return v === 0 ? "none" : lab ? lab.name : v; };
    if (vals.length > 1) text += `   label ${name(Math.round(vals[1].value))}`;
    document.getElementById("readout").textContent = text;
    if (typeof data.axCorSag === "number" && data.axCorSag >= 0 && data.axCorSag <= 2) state.plane = data.axCorSag;
  }

  function labelLut(colour) {
    const max = Math.max(1, ...state.labels.map((l) => l.value));
    const lut = { R: [], G: [], B: [], A: [], I: [], labels: [] };
    for (let i = 0; i <= max; i++) {
      const l = state.labels.find((x) => x.value === i);
      lut.I.push(i);
      const c = l ? colour || l.colour : [0, 0, 0];
      lut.R.push(c[0]);
      lut.G.push(c[1]);
      lut.B.push(c[2]);
      lut.A.push(l && i > 0 && l.shown ? (colour ? 255 : Math.round(255 * l.opacity)) : 0); // edges: opaque
      lut.labels.push(l ? l.name : i === 0 ? "" : String(i));
    }
    return lut;
  }

  const SECOND_COLOUR = [0, 230, 255]; // the second mask: its edges (made in Python) in cyan over the model's colours

  function applyLabels() {
    const nv = state.nv;
    if (!nv || nv.volumes.length < 2) return;
    nv.volumes[1].setColormapLabel(labelLut());
    // while a tool is on, the drawing layer shows the labels being edited and the overlay steps aside
    nv.volumes[1].opacity = state.tool ? 0.0 : 1.0;
    if (nv.volumes.length > 2) {
      nv.volumes[2].setColormapLabel(labelLut(SECOND_COLOUR));
      nv.volumes[2].opacity = state.secondShown === false ? 0.0 : 1.0;
    }
    if (state.editing) {
      nv.setDrawColormap(labelLut());
      nv.setDrawOpacity(state.tool ? 1.0 : 0.0);
    }
    nv.overlayOutlineWidth = state.outline ? 1 : 0;
    nv.updateGLVolume();
    const nv2 = state.nv2;
    if (nv2 && state.sideId && nv2.volumes.length > 1) {
      nv2.volumes[1].setColormapLabel(labelLut());
      nv2.overlayOutlineWidth = nv.overlayOutlineWidth;
      nv2.updateGLVolume();
    }
  }

  // NiiVue's own mapping (function iD in niivue.umd.js 0.69.0, used by loadDrawing): stored voxel
  // (a, s, t) of an image is element xlut[a] + ylut[s] + zlut[t] of its RAS-ordered drawing bitmap.
  function rasLuts(permRAS, dims) {
    const g = [0, 0, 0];
    for (let s = 0; s < 3; s++) for (let a = 0; a < 3; a++) if (Math.abs(permRAS[s]) - 1 === a) g[a] = s * Math.sign(permRAS[s]);
    let stride = 1;
    const step = [1, 1, 1], flip = [false, false, false];
    for (let s = 0; s < 3; s++) {
      for (let a = 0; a < 3; a++) {
        if (Math.abs(g[a]) === s) {
          step[a] = stride;
          if (g[a] < 0 || Object.is(g[a], -0)) flip[a] = true;
          stride *= dims[a + 1];
        }
      }
    }
    const lut = (n, k, f) => Array.from({ length: n }, (_, c) => (f ? n - 1 - c : c) * k);
    return [lut(dims[1], step[0], flip[0]), lut(dims[2], step[1], flip[1]), lut(dims[3], step[2], flip[2])];
  }

  // the model's label map becomes NiiVue's drawing layer (once per label map)
  function startEditing() {
    const nv = state.nv, lab = nv.volumes[1];
    state.luts = rasLuts(lab.permRAS, lab.hdr.dims);
    nv.loadDrawing(lab);
    state.editing = true;
  }

  // After each stroke or undo: copy the drawing into the overlay (stored order, so the readout and
  // the outline mode show the edit) and tell Python which voxels differ from the model's label map,
  // as runs [start, length, value] over the stored i-fastest order.
  function syncEdits() {
    const nv = state.nv, lab = nv.volumes[1], bmp = nv.drawBitmap;
    if (!state.editing || !lab || !bmp) return;
    const [xl, yl, zl] = state.luts, d = lab.hdr.dims, img = lab.img, orig = state.labelOrig;
    const runs = [];
    let o = 0, changed = 0, run = null;
    for (let t = 0; t < d[3]; t++) {
      for (let s = 0; s < d[2]; s++) {
        const base = yl[s] + zl[t];
        for (let a = 0; a < d[1]; a++, o++) {
          const v = bmp[xl[a] + base];
          img[o] = v;
          if (v !== orig[o]) {
            changed++;
            if (run && run[0] + run[1] === o && run[2] === v) run[1]++;
            else { run = [o, 1, v]; runs.push(run); }
          }
        }
      }
    }
    state.editSeq++;
    state.edits = { base: state.labelsId, seq: state.editSeq, changed: changed, runs: runs };
    document.getElementById("editcount").textContent = changed ? `${changed} voxels changed` : "no changes";
    applyLabels();
    report();
  }

  function penChoices() {
    const sel = document.getElementById("penlabel");
    sel.innerHTML = "";
    for (const l of state.labels.filter((x) => x.value > 0)) {
      const o = document.createElement("option");
      o.value = String(l.value);
      o.textContent = l.name;
      sel.appendChild(o);
    }
  }

  function setTool(tool) {
    const nv = state.nv;
    if (!nv || nv.volumes.length < 2) return;
    state.tool = state.tool === tool ? null : tool;
    if (state.tool && !state.editing) startEditing();
    nv.opts.penSize = parseInt(document.getElementById("pensize").value, 10);
    nv.setDrawingEnabled(!!state.tool);
    if (state.tool) nv.setPenValue(state.tool === "eraser" ? 0 : parseInt(document.getElementById("penlabel").value, 10), false);
    document.getElementById("brush").classList.toggle("on", state.tool === "brush");
    document.getElementById("eraser").classList.toggle("on", state.tool === "eraser");
    applyLabels();
  }

  function undo() {
    if (!state.editing) return;
    state.nv.drawUndo();
  }

  function hex(c) { return "#" + c.map((v) => v.toString(16).padStart(2, "0")).join(""); }

  function labelControls() {
    const box = document.getElementById("labels");
    box.innerHTML = "";
    for (const l of state.labels.filter((x) => x.value > 0)) {
      const row = document.createElement("label");
      row.innerHTML = `<input type="checkbox" ${l.shown ? "checked" : ""} title="show or hide">` +
        `<input type="color" value="${hex(l.colour)}" title="colour">` +
        `<span></span><input type="range" min="0" max="1" step="0.05" value="${l.opacity}" title="opacity">`;
      row.querySelector("span").textContent = l.name;
      const [shown, colour, , opacity] = row.querySelectorAll("input, span");
      shown.addEventListener("change", () => { l.shown = shown.checked; applyLabels(); });
      colour.addEventListener("input", () => {
        const v = colour.value;
        l.colour = [1, 3, 5].map((i) => parseInt(v.slice(i, i + 2), 16));
        applyLabels();
      });
      opacity.addEventListener("input", () => { l.opacity = parseFloat(opacity.value); applyLabels(); });
      row.dataset.label = l.name;
      box.appendChild(row);
    }
    if (state.nv && state.nv.volumes.length > 2) {
      const row = document.createElement("label");
      row.innerHTML = `<input type="checkbox" ${state.secondShown === false ? "" : "checked"} title="show or hide">` +
        `<span style="color:${hex(SECOND_COLOUR)}">&#9632;</span><span></span>`;
      row.querySelectorAll("span")[1].textContent = state.secondName || "second mask";
      const shown = row.querySelector("input");
      shown.addEventListener("change", () => { state.secondShown = shown.checked; applyLabels(); });
      row.dataset.label = "second";
      box.appendChild(row);
    }
  }

  function setLayout(name) {
    state.nv.setSliceType(SLICE[name]);
    if (state.nv2) state.nv2.setSliceType(SLICE[name]);
    for (const b of document.querySelectorAll("#bar [data-layout]")) b.classList.toggle("on", b.dataset.layout === name);
  }

  function zoom(factor) {
    const p = state.nv.scene.pan2Dxyzmm;
    state.nv.setPan2Dxyzmm([p[0], p[1], p[2], Math.min(Math.max(p[3] * factor, 0.25), 16)]);
  }

  function setWindow(level, width) {
    for (const nv of [state.nv, state.sideId ? state.nv2 : null]) {
      if (!nv || !nv.volumes.length) continue;
      const v = nv.volumes[0];
      v.cal_min = level - width / 2;
      v.cal_max = level + width / 2;
      nv.updateGLVolume();
    }
  }

  function step(delta) {
    const d = [0, 0, 0];
    d[[2, 1, 0][state.plane]] = delta; // axial moves along z, coronal along y, sagittal along x
    state.nv.moveCrosshairInVox(d[0], d[1], d[2]);
  }

  function wireControls(args) {
    for (const b of document.querySelectorAll("#bar [data-layout]")) b.addEventListener("click", () => setLayout(b.dataset.layout));
    document.getElementById("zoomin").addEventListener("click", () => zoom(1.25));
    document.getElementById("zoomout").addEventListener("click", () => zoom(0.8));
    document.getElementById("reset").addEventListener("click", () => {
      state.nv.setPan2Dxyzmm([0, 0, 0, 1]);
      if (state.lastArgs.level !== null && state.lastArgs.width !== null) setWindow(state.lastArgs.level, state.lastArgs.width);
    });
    const outline = document.getElementById("outline");
    outline.addEventListener("click", () => {
      state.outline = !state.outline;
      outline.classList.toggle("on", state.outline);
      for (const v of [state.nv, state.sideId ? state.nv2 : null]) {
        if (!v) continue;
        v.overlayOutlineWidth = state.outline ? 1 : 0; // a uniform of the slice shader: a new frame is enough
        v.drawScene();
      }
    });
    document.getElementById("brush").addEventListener("click", () => setTool("brush"));
    document.getElementById("eraser").addEventListener("click", () => setTool("eraser"));
    document.getElementById("undo").addEventListener("click", undo);
    document.getElementById("penlabel").addEventListener("change", () => { if (state.tool === "brush") state.nv.setPenValue(parseInt(document.getElementById("penlabel").value, 10), false); });
    document.getElementById("pensize").addEventListener("change", () => { state.nv.opts.penSize = parseInt(document.getElementById("pensize").value, 10); });
    const keys = { m: "multi", a: "axial", c: "coronal", s: "sagittal", r: "render" };
    document.getElementById("gl").addEventListener("keydown", (e) => {
      if (keys[e.key]) setLayout(keys[e.key]);
      else if (e.key === "ArrowUp" || e.key === "PageUp") { inMotion(); step(1); }
      else if (e.key === "ArrowDown" || e.key === "PageDown") { inMotion(); step(-1); }
      else if (e.key === "+" || e.key === "=") zoom(1.25);
      else if (e.key === "-") zoom(0.8);
      else if (e.key === "0") document.getElementById("reset").click();
      else if (e.key === "o") outline.click();
      else if (e.key === "b" && state.editable) setTool("brush");
      else if (e.key === "e" && state.editable) setTool("eraser");
      else if (e.key === "z" && state.editable) undo();
      else return;
      e.preventDefault();
      e.stopPropagation();
    }, true);
  }

  function options() {
    return {
      backColor: [0, 0, 0, 1],
      crosshairColor: [1, 1, 0, 1],
      isRadiologicalConvention: true,
      isOrientationTextVisible: true,
      show3Dcrosshair: true,
      // The multiplanar layout shows the three planes only: the 3D render is a ray cast per pixel,
      // which in software WebGL costs several times the three slices together on every scroll or
      // click frame. It has its own layout ("3D", key r).
      multiplanarShowRender: 0,
      dragMode: 9, // right-drag: windowing (horizontal: width, vertical: level)
      // left: crosshair, right: windowing, middle: pan (NiiVue's DRAG_MODE numbers)
      mouseEventConfig: { leftButton: { primary: 8 }, rightButton: 9, centerButton: 3 },
      isForceMouseClickToVoxelCenters: true, // the crosshair sits on a voxel: its mm is affine × voxel
      isResizeCanvas: true,
      loadingText: "loading the scan…",
    };
  }

  // NiiVue draws the whole canvas on each call of drawScene and then waits for the GPU
  // (gl.finish): a click calls it three times (press twice, release once), and adding a volume
  // blocks the page until its textures are built. With software WebGL each frame is expensive and
  // the page's other frames (Streamlit's, the same thread) wait. Here a call only asks for a frame:
  // the calls made before the next animation frame share one draw, and nothing waits for the GPU
  // (the browser shows the frame when the GPU has drawn it). ``drawNow`` draws at once.
  function oneFramePerTick(nv) {
    let frame = 0;
    const draw = () => {
      if (frame) { cancelAnimationFrame(frame); frame = 0; }
      nv.needsRefresh = false;
      return nv.drawSceneCore();
    };
    nv.drawScene = () => {
      if (!frame) frame = requestAnimationFrame(draw);
    };
    nv.drawNow = draw;
  }

  // Motion resolution. Without a GPU (Chrome's SwiftShader, Mesa's llvmpipe) a frame costs time in
  // proportion to its pixels, and a full-size canvas can take longer than the 50 ms a scroll step may
  // take (docs/benchmarks.md, "viewer", has the measurements). There,
  // while slices are scrolled (wheel, arrow and page keys) every frame is drawn at MOTION_SCALE of the
  // resolution along each axis (a quarter of the pixels, scaled up by the browser), and at full
  // resolution again once scrolling has rested for state.motionRestMs, or at once when a button is
  // pressed (a click, a brush stroke and a drag act on the full-resolution frame). Only the drawn
  // pixels change: crosshair, readout, mm and labels are the same at either resolution. The page
  // says so under the viewer. With a GPU a frame costs well under a millisecond, and nothing changes.
  const MOTION_SCALE = 0.5;
  let motionRest = 0, motionViewers = [];

  function softwareRenderer(gl) {
    const info = gl.getExtension("WEBGL_debug_renderer_info");
    const name = String(gl.getParameter(info ? info.UNMASKED_RENDERER_WEBGL : gl.RENDERER) || "");
    return /swiftshader|llvmpipe|softpipe|software/i.test(name) ? name : null;
  }

  // NiiVue maps a pointer to a tile with the layout of the last frame it drew, and the ratio of the
  // current canvas size: the frame at the new size is drawn at once, so the two never disagree.
  function drawScale(viewers, k) {
    for (const v of viewers) {
      v.opts.forceDevicePixelRatio = k === 1 ? 0 : (window.devicePixelRatio || 1) * k; // 0: the screen's
      v.resizeListener(); // canvas size from the ratio
      v.drawNow();
    }
  }

  function fullResolution() {
    if (!motionRest) return;
    clearTimeout(motionRest);
    motionRest = 0;
    drawScale(motionViewers, 1);
  }

  function inMotion() {
    if (!state.motion) return;
    if (motionRest) clearTimeout(motionRest);
    else {
      motionViewers = [state.nv, state.sideId ? state.nv2 : null].filter(Boolean); // linked: both move
      drawScale(motionViewers, MOTION_SCALE);
    }
    motionRest = setTimeout(fullResolution, state.motionRestMs);
  }

  // A wheel step goes to NiiVue first (its listener, added by attachToCanvas, comes before this
  // one), which finds the tile under the pointer in the layout of the last frame; the resolution
  // changes after. A button press restores full resolution before NiiVue sees it (capture).
  function watchMotion(canvas) {
    canvas.addEventListener("wheel", inMotion, { passive: true });
    canvas.addEventListener("pointerdown", fullResolution, { capture: true });
  }

  // Resolves once the GPU has finished everything asked of it so far, without blocking the page
  // (a WebGL 2 fence, polled).
  function gpuDone(gl) {
    const sync = gl.fenceSync(gl.SYNC_GPU_COMMANDS_COMPLETE, 0);
    gl.flush();
    return new Promise((resolve) => {
      const poll = () => {
        if (gl.getSyncParameter(sync, gl.SYNC_STATUS) === gl.SIGNALED) {
          gl.deleteSync(sync);
          resolve(Date.now());
        } else setTimeout(poll, 5);
      };
      setTimeout(poll, 0);
    });
  }

  async function init() {
    const canvas = document.getElementById("gl");
    const nv = new niivue.Niivue(options());
    await nv.attachToCanvas(canvas);
    oneFramePerTick(nv);
    state.software = softwareRenderer(nv.gl);
    state.motion = !!state.software;
    watchMotion(canvas);
    if (state.software) {
      document.getElementById("soft").textContent = "No GPU in this browser (software WebGL): while you scroll, " +
        "slices are drawn at half resolution; at full resolution again as soon as you stop.";
    }
    nv.onLocationChange = showLocation;
    nv.onDrawingChanged = (action) => { if (action === "draw" || action === "undo") syncEdits(); };
    // NiiVue 0.69.0 draws each pen segment from the new point towards the previous one, leaving the
    // new point itself for the next segment (drawPenLine): the last voxel of a stroke is never
    // painted. Paint it when the stroke ends, before NiiVue keeps the stroke for undo.
    const addUndo = nv.drawAddUndoBitmap.bind(nv);
    nv.drawAddUndoBitmap = (...rest) => {
      const p = nv.drawPenLocation;
      if (nv.opts.drawingEnabled && nv.drawBitmap && p && isFinite(p[0]) && nv.drawPenAxCorSag >= 0) {
        nv.drawPt(p[0], p[1], p[2], nv.opts.penValue);
        nv.refreshDrawing(false, false);
      }
      return addUndo(...rest);
    };
    nv.setSliceType(SLICE.multi);
    state.nv = nv;
    state.ready = true;
  }

  // Both viewers follow each other: crosshair (hence slices), zoom and pan, layout, window and the
  // 3D view. NiiVue passes a change on from the viewer that has the focus (the one clicked).
  const SYNC = { "2d": true, "3d": true, crosshair: true, zoomPan: true, sliceType: true, cal_min: true, cal_max: true };

  async function sideBySide(args) {
    const want = args.side_by_side && args.second_filled ? `${args.volume_id}/${args.second_id}` : null;
    if (want === state.sideId) return;
    const nv = state.nv;
    document.getElementById("pane2").style.display = want ? "block" : "none";
    for (const id of ["title1", "title2"]) document.getElementById(id).style.display = want ? "block" : "none";
    if (!want) {
      nv.broadcastTo([]);
      state.sideId = null;
      nv.resizeListener();
      return;
    }
    if (!state.nv2) {
      state.nv2 = new niivue.Niivue(options());
      await state.nv2.attachToCanvas(document.getElementById("gl2"));
      oneFramePerTick(state.nv2);
      watchMotion(state.nv2.canvas);
    }
    const nv2 = state.nv2;
    const scan = await loadNifti(args.volume, args.volume_name || "scan.nii");
    const labels = await loadNifti(args.second_filled, "second.nii");
    scan.cal_min = nv.volumes[0].cal_min;
    scan.cal_max = nv.volumes[0].cal_max;
    batch(nv2, () => {
      while (nv2.volumes.length) nv2.removeVolume(nv2.volumes[nv2.volumes.length - 1]);
      nv2.addVolume(scan);
      nv2.addVolume(labels);
      return true;
    });
    nv2.setSliceType(nv.opts.sliceType);
    nv2.scene.crosshairPos = nv2.mm2frac(nv.frac2mm(nv.scene.crosshairPos));
    nv.broadcastTo([nv2], SYNC);
    nv2.broadcastTo([nv], SYNC);
    nv2.onLocationChange = (data) => { state.location2 = data; };
    document.getElementById("title1").textContent = args.first_name || "model";
    document.getElementById("title2").textContent = args.second_name || "second model";
    state.sideId = want;
    nv.resizeListener();
    applyLabels();
  }

  function noWebGL(err) {
    state.error = String(err && err.message ? err.message : err);
    const box = document.getElementById("nogl");
    box.textContent = "This browser cannot run WebGL 2, so the interactive viewer is off; the page shows static panels instead.";
    box.style.display = "block";
    for (const id of ["bar", "wrap", "readout", "labels", "help"]) document.getElementById(id).style.display = "none";
    setValue({ webgl: false, reason: state.error });
    fitHeight();
  }

  // NiiVue rebuilds the textures of all its volumes (the scan's, with the 3D render's gradients)
  // on every addVolume, removeVolume and updateGLVolume. ``batch`` makes the changes inside ``fn``
  // (synchronous) rebuild once, at the end, and only if ``fn`` returns true.
  //
  // The rebuild renders the textures slice by slice and asks after each slice whether the target
  // is complete (gl.checkFramebufferStatus): in Chrome that question waits for the GPU process to
  // finish all the work before it, so the page's thread is held for the whole rebuild. The targets
  // are NiiVue's own RGBA texture layers, complete by construction; during the rebuild the
  // question is answered without the round trip, the work is queued, and the thread is free while
  // the GPU process builds (the next frame shows the result once it is done).
  function batch(nv, fn) {
    const update = nv.updateGLVolume;
    let changed = false;
    nv.updateGLVolume = () => {};
    try {
      changed = fn();
    } finally {
      delete nv.updateGLVolume; // back to NiiVue's own method
    }
    if (changed) {
      const gl = nv.gl;
      gl.checkFramebufferStatus = () => gl.FRAMEBUFFER_COMPLETE;
      try {
        update.call(nv);
      } finally {
        delete gl.checkFramebufferStatus; // back to WebGL's own method
      }
    }
    return changed;
  }

  function loadNifti(bytes, name) {
    return niivue.NVImage.loadFromUrl({ url: name, name: name, buffer: arrayBuffer(bytes) });
  }

  let queue = Promise.resolve();
  async function render(args) {
    state.lastArgs = args;
    document.getElementById("wrap").style.height = `${args.height || 600}px`;
    if (!state.nv && !state.error) {
      try {
        await init();
        wireControls(args);
        report();
      } catch (err) {
        noWebGL(err);
        return;
      }
    }
    if (state.error) return;
    const nv = state.nv;
    state.affine = args.affine;
    // Streamlit sends the arguments again on every rerun of the page; NiiVue rebuilds and draws only
    // when something in the viewport changed. The files are parsed first, then swapped in at once.
    const newVolume = args.volume_id !== state.volumeId;
    const newLabels = newVolume || args.labels_id !== state.labelsId || secondId(args) !== state.secondId;
    const preview = args.preview > 1 ? args.preview : 0; // every n-th voxel of a large scan, the full one follows
    const tl = newVolume ? { message: state.messageAt, bytes: args.volume.byteLength, preview: preview } : null;
    // .nii.gz: the uploaded file itself, NiiVue gunzips it
    const img = newVolume ? await loadNifti(args.volume, args.volume_name || "scan.nii") : null;
    if (tl) tl.parsed = Date.now();
    const lab = newLabels && args.labels ? await loadNifti(args.labels, "labels.nii") : null;
    const sec = lab && args.second ? await loadNifti(args.second, "second.nii") : null;
    // Building a scan's textures holds this thread, which the page around the viewport shares
    // (same site, same renderer) for seconds in software WebGL: first let the page finish what it
    // has to do (draw the Run button that came with this rerun), for at most half a second.
    if (img || lab) await new Promise((resolve) => requestIdleCallback(resolve, { timeout: 500 }));
    batch(nv, () => {
      if (newVolume) {
        while (nv.volumes.length) nv.removeVolume(nv.volumes[nv.volumes.length - 1]);
        nv.addVolume(img);
        state.timeline = tl;
        state.volumeId = args.volume_id;
        state.newVolume = true;
        state.labelsId = null;
        state.windowKey = null;
        document.getElementById("res").textContent = preview
          ? `Preview at reduced resolution (1 voxel in ${preview} along each axis); the full-resolution scan is on its way`
          : "";
      }
      if (newLabels) replaceLabels(args, lab, sec);
      const windowKey = `${args.level}/${args.width}`;
      // a new display preset from the page (drags change it in between); none yet: NiiVue's own window
      if (windowKey !== state.windowKey && args.level !== null && args.width !== null) {
        setWindow(args.level, args.width);
        state.windowKey = windowKey;
        return true;
      }
      return newVolume || newLabels;
    });
    if (tl) tl.added = Date.now();
    await sideBySide(args);
    state.editable = !!(args.editable && args.labels);
    document.getElementById("edit").style.display = state.editable ? "inline" : "none";
    state.renderedAt = Date.now();
    if (state.newVolume) { // first paint of this scan, once the GPU has drawn it (the benchmark reads it)
      state.newVolume = false;
      nv.drawNow();
      gpuDone(nv.gl).then((t) => {
        tl.drawn = t;
        if (state.timeline === tl) state.loadedAt = t;
      });
    }
    fitHeight();
  }

  // the overlays of a new scan, a new label map or a new second mask (inside a batch)
  function replaceLabels(args, lab, sec) {
    const nv = state.nv;
    if (state.tool) setTool(state.tool); // the tool goes off while the overlays are replaced
    if (state.editing) nv.closeDrawing();
    while (nv.volumes.length > 1) nv.removeVolume(nv.volumes[nv.volumes.length - 1]);
    if (args.labels_id !== state.labelsId) {
      state.editing = false;
      state.edits = null;
      document.getElementById("editcount").textContent = "";
    }
    state.labels = (args.label_info || []).map((l) => Object.assign({ shown: true, opacity: args.opacity }, l));
    state.secondName = args.second_name || "";
    if (lab) {
      nv.addVolume(lab);
      if (args.labels_id !== state.labelsId) state.labelOrig = Uint8Array.from(lab.img); // the model's, unedited
      if (sec) nv.addVolume(sec);
      if (state.edits) { // the second mask changed, the model's did not: keep the edits
        for (const [start, n, v] of state.edits.runs) lab.img.fill(v, start, start + n);
        state.editing = false; // the next tool reloads the drawing from the edited labels
      }
      applyLabels();
    }
    labelControls();
    penChoices();
    state.labelsId = args.labels_id;
    state.secondId = secondId(args);
  }

  function secondId(args) { return args.second_id || "none"; }

  window.addEventListener("message", (event) => {
    const data = event.data || {};
    if (data.type === "streamlit:render") {
      state.messageAt = Date.now();
      queue = queue.then(() => render(data.args)).catch((err) => {
        state.error = String(err);
        document.getElementById("readout").textContent = "The viewer could not show this scan: " + state.error;
        fitHeight();
      });
    }
  });
  send("streamlit:componentReady", { apiVersion: 1 });
})();

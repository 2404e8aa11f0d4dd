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
    // the model's label map lives in NiiVue's drawing layer (labels.js); the brush and eraser paint it
    tool: null, edit: null, edits: null,
    secondId: null, secondName: "", secondShown: true,
    // the display window the user dragged (reported to Python, which shows it as "Custom")
    windowSeq: 0, windowDragged: false,
    // radiological: patient's right on screen left, anterior on the left in sagittal views
    radiological: true,
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
  const { oneFramePerTick, softwareRenderer, inMotion, watchMotion, gpuDone, batch } = window.medsegFrames(state);

  function send(type, data) {
    window.parent.postMessage(Object.assign({ isStreamlitMessage: true, type: type }, data || {}), "*");
  }
  function setValue(value) { send("streamlit:setComponentValue", { value: value, dataType: "json" }); }
  // what Python reads: WebGL works, and the edits made since the model's label map was loaded
  function report() {
    const out = { webgl: true };
    if (state.edits) out.edits = state.edits;
    if (state.windowSeq) out.window = state.userWindow;
    setValue(out);
  }
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

  // the label at a stored voxel of the label map (the drawing layer's stored-order copy), or null
  function labelAt(vox) {
    const rec = state.edit;
    if (!rec || !vox) return null;
    const d = rec.lab.hdr.dims;
    if (vox.some((v, k) => v < 0 || v >= d[k + 1])) return null;
    return rec.lab.img[vox[0] + vox[1] * d[1] + vox[2] * d[1] * d[2]];
  }

  function showLocation(data) {
    if (state.nv.medsegPainting) return; // a brush stroke does not move the crosshair (labels.js)
    state.location = data;
    const vals = data.values || [];
    const mm = vals.length ? vals[0].mm : data.mm;
    data.storedVox = storedVoxel(mm); // NiiVue's own voxel indices are in its RAS-reordered copy
    const vox = data.storedVox || (vals.length ? vals[0].vox : data.vox);
    data.label = labelAt(data.storedVox);
    let text = `RAS ${fmt(mm[0], 1)}, ${fmt(mm[1], 1)}, ${fmt(mm[2], 1)} mm   voxel ${vox.map(Math.round).join(", ")}`;
    if (vals.length) text += `   intensity ${fmt(vals[0].value, 1)}`;
    const name = (v) => { const lab = state.labels.find((l) => l.value === v); return v === 0 ? "none" : lab ? lab.name : v; };
    if (data.label !== null) text += `   label ${name(data.label)}`;
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

  // Colours, opacities and outlines of the labels in both viewers: the drawing layer's colour
  // table and two uniforms (labels.js ``look``), one frame; no texture of a volume is rebuilt.
  function applyLabels() {
    for (const nv of [state.nv, state.sideId ? state.nv2 : null]) {
      if (nv && nv.drawBitmap) window.medsegLabels.look(nv, labelLut(), state.outline);
    }
  }

  // the second mask's cyan edges (an overlay volume): shown or hidden, its textures rebuilt once
  function applySecond() {
    const nv = state.nv;
    if (!nv || nv.volumes.length < 2) return;
    nv.volumes[1].setColormapLabel(labelLut(SECOND_COLOUR));
    nv.volumes[1].opacity = state.secondShown ? 1.0 : 0.0;
    batch(nv, () => true);
    nv.drawScene();
  }

  // After each stroke or undo (labels.js has folded it into the stored-order copy): the readout's
  // label, the count, and the report to Python, the voxels that differ from the model's label map
  // as runs [start, length, value] over the stored i-fastest order.
  function editStep() {
    const rec = state.edit;
    state.edits = { base: state.labelsId, seq: rec.seq, changed: rec.changed.size, runs: window.medsegLabels.runs(rec) };
    document.getElementById("editcount").textContent = rec.changed.size ? `${rec.changed.size} voxels changed` : "no changes";
    if (state.location) state.location.label = labelAt(state.location.storedVox);
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

  // NiiVue's calls, without the frame they ask for (nothing on the canvas changes)
  function quietly(nv, fn) {
    const draw = nv.drawScene;
    nv.drawScene = () => {};
    try { fn(); } finally { nv.drawScene = draw; }
  }

  // Brush, eraser or neither: the left button paints or sets the crosshair. The labels look the
  // same either way (the drawing layer shows them in every mode), so no frame is drawn.
  function setTool(tool) {
    const nv = state.nv;
    if (!nv || !state.edit) return;
    state.tool = state.tool === tool ? null : tool;
    quietly(nv, () => {
      nv.opts.penSize = parseInt(document.getElementById("pensize").value, 10);
      nv.setDrawingEnabled(!!state.tool);
      if (state.tool) nv.setPenValue(state.tool === "eraser" ? 0 : parseInt(document.getElementById("penlabel").value, 10), false);
    });
    document.getElementById("brush").classList.toggle("on", state.tool === "brush");
    document.getElementById("eraser").classList.toggle("on", state.tool === "eraser");
  }

  function undo() {
    if (state.edit) state.nv.drawUndo();
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
      row.dataset.value = String(l.value);
      box.appendChild(row);
    }
    if (state.nv && state.nv.volumes.length > 1) { // the second mask's edges, an overlay
      const row = document.createElement("label");
      row.innerHTML = `<input type="checkbox" ${state.secondShown ? "checked" : ""} title="show or hide">` +
        `<span style="color:${hex(SECOND_COLOUR)}">&#9632;</span><span></span>`;
      row.querySelectorAll("span")[1].textContent = state.secondName || "second mask";
      const shown = row.querySelector("input");
      shown.addEventListener("change", () => { state.secondShown = shown.checked; applySecond(); });
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

  // the display window of the scan in both viewers: its texture is rebuilt (as NiiVue's own
  // right-drag does), the label layers are not
  function setWindow(level, width) {
    for (const nv of [state.nv, state.sideId ? state.nv2 : null]) {
      if (!nv || !nv.volumes.length) continue;
      const v = nv.volumes[0];
      v.cal_min = level - width / 2;
      v.cal_max = level + width / 2;
      nv.refreshLayers(v, 0);
      nv.drawScene();
    }
    showWindow();
  }

  // the window's level and width, as the page's controls give them, beside the buttons
  function showWindow() {
    const nv = state.nv;
    if (!nv || !nv.volumes.length) return;
    const v = nv.volumes[0], width = v.cal_max - v.cal_min, level = (v.cal_max + v.cal_min) / 2;
    const d = Math.abs(width) >= 20 ? 0 : 2;
    document.getElementById("wl").textContent = `W ${fmt(width, d)}  L ${fmt(level, d)}`;
    return { level: level, width: width };
  }

  // A right-drag changes the window in NiiVue (windowingHandler); the new values show at once and
  // go to Python when the button is let go, where the preset box then says "Custom".
  function watchWindowing(nv) {
    const handler = nv.windowingHandler.bind(nv);
    nv.windowingHandler = (...rest) => {
      const out = handler(...rest);
      state.windowDragged = true;
      showWindow();
      return out;
    };
    window.addEventListener("pointerup", () => {
      if (!state.windowDragged) return;
      state.windowDragged = false;
      state.windowSeq++;
      state.userWindow = Object.assign({ seq: state.windowSeq, volume: state.volumeId }, showWindow());
      report();
    }, true);
  }

  // radiological (patient's right on the screen's left) or neurological (left on the left) in the
  // axial and coronal views of both viewers; sagittal views keep anterior on the left
  function setConvention(radiological) {
    state.radiological = radiological;
    for (const nv of [state.nv, state.nv2]) {
      if (!nv) continue;
      nv.opts.isRadiologicalConvention = radiological;
      nv.drawScene();
    }
    document.getElementById("convnote").textContent = radiological
      ? "Radiological convention: the patient's right is on the screen's left in axial and coronal views; anterior is on the left in sagittal views."
      : "Neurological convention: the patient's left is on the screen's left in axial and coronal views; anterior is on the left in sagittal views.";
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
      applyLabels(); // NiiVue's drawing rim: uniforms, a new frame is enough
    });
    document.getElementById("conv").addEventListener("change", (e) => setConvention(e.target.value === "radiological"));
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
      // radiological convention in every view: patient's right on the screen's left (axial,
      // coronal), anterior on the left in sagittal views, as the static panels and PACS show them;
      // the letters are the viewport's own, on all four edges of each tile (``placeLetters``)
      isRadiologicalConvention: true,
      sagittalNoseLeft: true,
      isOrientationTextVisible: false,
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
    window.medsegLabels.install(nv, editStep); // strokes and undo: deltas, sub-region uploads
    watchWindowing(nv);
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
    window.medsegLabels.close(nv2);
    batch(nv2, () => {
      while (nv2.volumes.length) nv2.removeVolume(nv2.volumes[nv2.volumes.length - 1]);
      nv2.addVolume(scan);
      return true;
    });
    window.medsegLabels.load(nv2, labels); // its labels in its drawing layer, as the left viewer's (not edited)
    nv2.opts.isRadiologicalConvention = nv.opts.isRadiologicalConvention;
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
    const newLabels = newVolume || args.labels_id !== state.labelsId;
    const newSecond = newVolume || secondKey(args) !== state.secondId;
    const preview = args.preview > 1 ? args.preview : 0; // every n-th voxel of a large scan, the full one follows
    // a new case, unless this is the full-resolution scan of the preview on show
    const newCase = newVolume && !state.previewShown;
    const tl = newVolume ? { message: state.messageAt, bytes: args.volume.byteLength, preview: preview } : null;
    // .nii.gz: the uploaded file itself, NiiVue gunzips it
    const img = newVolume ? await loadNifti(args.volume, args.volume_name || "scan.nii") : null;
    if (tl) tl.parsed = Date.now();
    const lab = newLabels && args.labels ? await loadNifti(args.labels, "labels.nii") : null;
    const sec = newSecond && args.second ? await loadNifti(args.second, "second.nii") : null;
    // Building a scan's textures holds this thread, which the page around the viewport shares
    // (same site, same renderer) for seconds in software WebGL: first let the page finish what it
    // has to do (draw the Run button that came with this rerun), for at most half a second.
    if (img || lab || sec) await new Promise((resolve) => requestIdleCallback(resolve, { timeout: 500 }));
    if (newLabels) {
      state.labels = (args.label_info || []).map((l) => Object.assign({ shown: true, opacity: args.opacity }, l));
      state.opacity = args.opacity;
      closeLabels();
    }
    const windowKey = `${args.level}/${args.width}`;
    // a new display preset from the page (drags change it in between); none yet: NiiVue's own window
    const newWindow = windowKey !== state.windowKey && args.level !== null && args.width !== null;
    if (img && newWindow) { // the new scan's texture is built with it
      img.cal_min = args.level - args.width / 2;
      img.cal_max = args.level + args.width / 2;
    }
    batch(nv, () => {
      if (newVolume) {
        while (nv.volumes.length) nv.removeVolume(nv.volumes[nv.volumes.length - 1]);
        nv.addVolume(img);
        state.timeline = tl;
        state.volumeId = args.volume_id;
        state.previewShown = !!preview;
        state.newVolume = true;
        document.getElementById("res").textContent = preview
          ? `Preview at reduced resolution (1 voxel in ${preview} along each axis); the full-resolution scan is on its way`
          : "";
      }
      if (newSecond) replaceSecond(args, sec);
      return newVolume || newSecond;
    });
    if (newCase) resetView();
    if (newLabels) showLabels(args, lab);
    if (newLabels || newSecond) labelControls();
    if (!newLabels && args.opacity !== state.opacity) setOpacity(args.opacity);
    if (newWindow) {
      if (!img) setWindow(args.level, args.width);
      state.windowKey = windowKey;
    }
    showWindow();
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

  // A new case: the crosshair at the centre of the volume, zoom and pan reset, and the readout
  // describing the new scan there (the tool went off with the old label map).
  function resetView() {
    const nv = state.nv;
    nv.scene.crosshairPos = nv.volumes.length ? nv.vox2frac(nv.frac2vox([0.5, 0.5, 0.5])) : [0.5, 0.5, 0.5]; // on a voxel
    nv.scene.pan2Dxyzmm = [0, 0, 0, 1];
    state.location = null;
    document.getElementById("readout").textContent = "Click the image to place the crosshair.";
    if (nv.volumes.length) nv.createOnLocationChange();
  }

  // the tool off and the label map out of the drawing layer (a new label map or a new scan follows)
  function closeLabels() {
    if (state.tool) setTool(state.tool);
    window.medsegLabels.close(state.nv);
    state.edit = null;
    state.edits = null;
    document.getElementById("editcount").textContent = "";
  }

  // the model's label map into the left viewer's drawing layer (after the scan's textures exist)
  function showLabels(args, lab) {
    if (lab) {
      state.edit = window.medsegLabels.load(state.nv, lab);
      applyLabels();
    }
    penChoices();
    state.labelsId = args.labels_id;
    if (state.location) showLocation(state.location); // the readout's label
  }

  // the second mask's edges as the only overlay volume (inside a batch); none in side-by-side mode
  function replaceSecond(args, sec) {
    const nv = state.nv;
    while (nv.volumes.length > 1) nv.removeVolume(nv.volumes[nv.volumes.length - 1]);
    state.secondName = args.second_name || "";
    state.secondShown = true;
    if (sec) {
      sec.setColormapLabel(labelLut(SECOND_COLOUR));
      sec.opacity = 1.0;
      nv.addVolume(sec);
    }
    state.secondId = secondKey(args);
  }

  // the sidebar's overlay opacity: every label's, their sliders with them
  function setOpacity(opacity) {
    state.opacity = opacity;
    for (const l of state.labels) l.opacity = opacity;
    for (const input of document.querySelectorAll("#labels input[type=range]")) input.value = String(opacity);
    applyLabels();
  }

  // what the left viewer draws over its labels: the second mask's edges (Python sends them only then)
  function secondKey(args) { return args.second ? args.second_id || "none" : "none"; }

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

// medseg viewport, the label map: shown and edited in NiiVue's drawing layer (niivue.umd.js 0.69.0).
//
// The model's label map is loaded into NiiVue's drawing bitmap once per label map (``loadDrawing``)
// and shown from there in every mode, with or without a tool on: the drawing's colour table
// carries each label's colour and opacity (alpha), so a change of opacity, colour or visibility
// is a 256-entry colour table on the GPU and one frame, and labels blend with the anatomy.
//
// Edits touch only the voxels they change. NiiVue's pen writes into the bitmap (``drawPt``,
// ``drawPenLine``); the box of voxels it wrote is uploaded as a sub-region of the drawing texture
// (``texSubImage3D`` with WebGL 2's unpack skip and row-length settings, straight from the
// bitmap), not the whole bitmap NiiVue's ``refreshDrawing`` would send. When a stroke ends its
// changes are kept as a delta (voxel indices, values before and after) found by comparing that
// box with the bitmap as it was after the previous step; Undo puts the values back and uploads
// that box. NiiVue's own undo keeps a compressed copy of the whole bitmap per stroke; it is
// replaced. Each step's delta is mapped to the label file's stored voxel order (see ``rasMap``)
// and folded into the set of voxels that differ from the model's map, which Python receives.
(function () {
  "use strict";

  // NiiVue's mapping between the label file's stored voxels and its RAS-ordered bitmap (function iD
  // in niivue.umd.js 0.69.0, used by loadDrawing: stored voxel (a, s, t) is bitmap element
  // xlut[a] + ylut[s] + zlut[t]), axis by axis: ``ras[a]`` is the RAS axis stored axis a runs
  // along, ``flip[a]`` whether it runs backwards.
  function rasMap(permRAS, dims) {
    const g = [0, 0, 0];
    for (let s = 0; s < 3; s++) for (let a = 0; a < 3; a++) if (Math.abs(permRAS[s]) - 1 === a) g[a] = s * Math.sign(permRAS[s]);
    const flip = [false, false, false], ras = [0, 0, 0], rasDims = [0, 0, 0];
    for (let a = 0; a < 3; a++) {
      ras[a] = Math.abs(g[a]);
      flip[a] = g[a] < 0 || Object.is(g[a], -0);
      rasDims[ras[a]] = dims[a + 1];
    }
    return { ras: ras, flip: flip, dims: [dims[1], dims[2], dims[3]], rasDims: rasDims };
  }

  // bitmap (RAS) element -> stored i-fastest index of the label file
  function storedIndex(map, i) {
    const [rx, ry] = map.rasDims;
    const r = [i % rx, Math.floor(i / rx) % ry, Math.floor(i / (rx * ry))];
    const [d1, d2] = map.dims;
    const c = [0, 1, 2].map((a) => (map.flip[a] ? map.dims[a] - 1 - r[map.ras[a]] : r[map.ras[a]]));
    return c[0] + c[1] * d1 + c[2] * d1 * d2;
  }

  // ``box`` grown to hold voxel ``p`` and ``r[k]`` voxels around it along each axis k
  function boxUnion(box, p, r, dims) {
    const lo = [0, 1, 2].map((k) => Math.max(0, Math.min(dims[k] - 1, Math.round(p[k]) - r[k])));
    const hi = [0, 1, 2].map((k) => Math.max(0, Math.min(dims[k] - 1, Math.round(p[k]) + r[k])));
    if (!box) return lo.concat(hi);
    return [0, 1, 2].map((k) => Math.min(box[k], lo[k])).concat([0, 1, 2].map((k) => Math.max(box[k + 3], hi[k])));
  }

  function union(a, b) {
    if (!a) return b ? b.slice() : null;
    if (!b) return a.slice();
    return [0, 1, 2].map((k) => Math.min(a[k], b[k])).concat([3, 4, 5].map((k) => Math.max(a[k], b[k])));
  }

  // the voxels in ``box`` of NiiVue's drawing texture, from its bitmap (nothing else is sent)
  function uploadBox(nv, box) {
    const gl = nv.gl, d = nv.back.dims;
    const [x0, y0, z0, x1, y1, z1] = box;
    gl.activeTexture(gl.TEXTURE7); // NiiVue's TEXTURE7_DRAW
    gl.bindTexture(gl.TEXTURE_3D, nv.drawTexture);
    gl.pixelStorei(gl.UNPACK_ALIGNMENT, 1);
    gl.pixelStorei(gl.UNPACK_ROW_LENGTH, d[1]);
    gl.pixelStorei(gl.UNPACK_IMAGE_HEIGHT, d[2]);
    gl.pixelStorei(gl.UNPACK_SKIP_PIXELS, x0);
    gl.pixelStorei(gl.UNPACK_SKIP_ROWS, y0);
    gl.pixelStorei(gl.UNPACK_SKIP_IMAGES, z0);
    try {
      gl.texSubImage3D(gl.TEXTURE_3D, 0, x0, y0, z0, x1 - x0 + 1, y1 - y0 + 1, z1 - z0 + 1, gl.RED, gl.UNSIGNED_BYTE, nv.drawBitmap);
    } finally {
      for (const p of [gl.UNPACK_ROW_LENGTH, gl.UNPACK_IMAGE_HEIGHT, gl.UNPACK_SKIP_PIXELS, gl.UNPACK_SKIP_ROWS, gl.UNPACK_SKIP_IMAGES]) gl.pixelStorei(p, 0);
    }
    nv.medsegUploads = (nv.medsegUploads || 0) + (x1 - x0 + 1) * (y1 - y0 + 1) * (z1 - z0 + 1); // voxels sent (tests read it)
  }

  // what changed inside ``box`` since the last step: indices, values before, values after
  function delta(bmp, kept, box, rx, ry) {
    const idx = [], before = [], after = [];
    const [x0, y0, z0, x1, y1, z1] = box;
    for (let z = z0; z <= z1; z++) {
      for (let y = y0; y <= y1; y++) {
        let i = x0 + rx * (y + ry * z);
        for (let x = x0; x <= x1; x++, i++) {
          if (bmp[i] !== kept[i]) {
            idx.push(i);
            before.push(kept[i]);
            after.push(bmp[i]);
            kept[i] = bmp[i];
          }
        }
      }
    }
    return { idx: Uint32Array.from(idx), before: Uint8Array.from(before), after: Uint8Array.from(after), box: box };
  }

  // The label map's editing record: the stored-order copy (readout, Python), the model's own values,
  // the bitmap as of the last step, the undo deltas, and the stored voxels that differ now.
  function record(nv, lab) {
    return {
      lab: lab,
      orig: Uint8Array.from(lab.img),
      map: rasMap(lab.permRAS, lab.hdr.dims),
      kept: nv.drawBitmap.slice(),
      undo: [],
      changed: new Map(),
      seq: 0,
      stroke: null, // the box the current stroke has written
      pending: null, // the box written but not yet uploaded
    };
  }

  // a step's delta into the stored-order copy and the set of changed voxels; ``values``: after or before
  function fold(rec, d, values) {
    const img = rec.lab.img, orig = rec.orig;
    for (let n = 0; n < d.idx.length; n++) {
      const s = storedIndex(rec.map, d.idx[n]), v = values[n];
      img[s] = v;
      if (v === orig[s]) rec.changed.delete(s);
      else rec.changed.set(s, v);
    }
    rec.seq++;
  }

  // the changed voxels as runs [start, length, value] over the stored i-fastest order
  function runs(rec) {
    const keys = Array.from(rec.changed.keys()).sort((a, b) => a - b);
    const out = [];
    let run = null;
    for (const o of keys) {
      const v = rec.changed.get(o);
      if (run && run[0] + run[1] === o && run[2] === v) run[1]++;
      else { run = [o, 1, v]; out.push(run); }
    }
    return out;
  }

  // NiiVue's pen paints where the crosshair would go (mouseClick moves the crosshair, then paints
  // there); while a tool is on, the crosshair (and so the readout and a linked viewer) stays put.
  function keepCrosshair(nv) {
    const click = nv.mouseClick.bind(nv);
    nv.mouseClick = (x, y, posChange = 0, isDelta = true) => {
      if (!nv.opts.drawingEnabled || posChange !== 0) return click(x, y, posChange, isDelta);
      const kept = nv.scene.crosshairPos.slice();
      nv.medsegPainting = true; // the viewport's readout ignores the location NiiVue reports meanwhile
      try {
        return click(x, y, posChange, isDelta);
      } finally {
        nv.scene.crosshairPos = kept;
        nv.medsegPainting = false;
      }
    };
  }

  // NiiVue's pen, refresh and undo, changed to keep deltas and upload boxes (see the top)
  function install(nv, onStep) {
    keepCrosshair(nv);
    const drawPt = nv.drawPt.bind(nv), drawPenLine = nv.drawPenLine.bind(nv), refresh = nv.refreshDrawing.bind(nv);
    const mark = (p) => {
      const rec = nv.medsegEdit;
      if (!rec) return;
      // the pen paints a square of penSize voxels in the plane it started on (0 axial: z fixed)
      const reach = Math.ceil(nv.opts.penSize / 2), normal = 2 - nv.drawPenAxCorSag, dims = nv.back.dims.slice(1, 4);
      const r = [0, 1, 2].map((k) => (k === normal ? 0 : reach));
      rec.stroke = boxUnion(rec.stroke, p, r, dims);
      rec.pending = boxUnion(rec.pending, p, r, dims);
    };
    nv.drawPt = (x, y, z, v, bmp) => { if (!bmp) mark([x, y, z]); return drawPt(x, y, z, v, bmp); };
    nv.drawPenLine = (a, b, v) => { mark(a); mark(b); return drawPenLine(a, b, v); };
    nv.refreshDrawing = (redraw = true, growing = false) => {
      const rec = nv.medsegEdit;
      if (!rec || growing || !rec.pending || !nv.drawTexture || nv.opts.is2DSliceShader) return refresh(redraw, growing);
      uploadBox(nv, rec.pending);
      rec.pending = null;
      if (redraw) nv.drawScene();
    };
    // called when a stroke ends (and by loadDrawing, before there is a record)
    nv.drawAddUndoBitmap = () => {
      const rec = nv.medsegEdit;
      if (!rec || !rec.stroke) return;
      // NiiVue 0.69.0 draws each pen segment from the new point towards the previous one, leaving
      // the new point for the next segment (drawPenLine): a stroke's last voxel is never painted.
      const p = nv.drawPenLocation;
      if (nv.opts.drawingEnabled && nv.drawBitmap && p && isFinite(p[0]) && nv.drawPenAxCorSag >= 0) nv.drawPt(p[0], p[1], p[2], nv.opts.penValue);
      if (rec.pending) nv.refreshDrawing(false);
      const [rx, ry] = nv.back.dims.slice(1, 3);
      const d = delta(nv.drawBitmap, rec.kept, rec.stroke, rx, ry);
      rec.stroke = null;
      if (!d.idx.length) return;
      rec.undo.push(d);
      fold(rec, d, d.after);
      onStep("draw");
    };
    nv.drawUndo = () => {
      const rec = nv.medsegEdit;
      if (!rec || !rec.undo.length) return;
      const d = rec.undo.pop();
      for (let n = 0; n < d.idx.length; n++) {
        nv.drawBitmap[d.idx[n]] = d.before[n];
        rec.kept[d.idx[n]] = d.before[n];
      }
      rec.pending = union(rec.pending, d.box);
      nv.refreshDrawing(true);
      fold(rec, d, d.before);
      onStep("undo");
    };
  }

  // the label map (a parsed NVImage, not added as a volume) into the drawing layer
  function load(nv, lab) {
    nv.medsegEdit = null;
    nv.loadDrawing(lab);
    nv.medsegEdit = record(nv, lab);
    return nv.medsegEdit;
  }

  function close(nv) {
    nv.medsegEdit = null;
    if (nv.drawBitmap) nv.closeDrawing();
  }

  // The colour table (a label's colour and opacity as alpha) and the outline look, without
  // rebuilding the volumes' textures: NiiVue's setDrawColormap, with its updateGLVolume narrowed
  // to the colour tables. Outlines: NiiVue's rim (pixels where the label changes) opaque, the fill
  // all but clear (a fill of exactly 0 would hide the rim too).
  function look(nv, lut, outline) {
    nv.updateGLVolume = () => nv.refreshColormaps();
    try {
      nv.setDrawColormap(lut);
    } finally {
      delete nv.updateGLVolume; // back to NiiVue's own method
    }
    nv.drawOpacity = outline ? 0.01 : 1.0;
    nv.drawRimOpacity = outline ? 1.0 : -1;
    nv.drawScene();
  }

  window.medsegLabels = { install: install, load: load, close: close, look: look, runs: runs, storedIndex: storedIndex, rasMap: rasMap };
})();

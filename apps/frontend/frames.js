// medseg viewport, frames: when NiiVue draws and at what resolution, the orientation letters over
// its tiles, and its texture rebuilds batched. ``window.medsegFrames(state)`` gives the functions,
// which read the viewport's state (viewport.js).
(function () {
  "use strict";
  window.medsegFrames = function (state) {
    // The letters on the left, right, top and bottom edge of a 2D tile (0 axial, 1 coronal, 2 sagittal).
    function edgeLetters(axCorSag, radiological) {
      const lr = radiological ? ["R", "L"] : ["L", "R"];
      if (axCorSag === 0) return [lr[0], lr[1], "A", "P"];
      if (axCorSag === 1) return [lr[0], lr[1], "S", "I"];
      return ["A", "P", "S", "I"]; // sagittalNoseLeft in both conventions
    }

    // Orientation letters over each 2D tile of ``nv`` (HTML over the canvas), placed again only when
    // the tiles or the convention changed since the last frame.
    function placeLetters(nv) {
      const box = nv.canvas.parentElement.querySelector(".letters");
      const k = nv.uiData.dpr || 1, rad = !!nv.opts.isRadiologicalConvention;
      const tiles = nv.screenSlices.filter((t) => t.axCorSag >= 0 && t.axCorSag <= 2 && t.leftTopWidthHeight);
      const key = JSON.stringify([rad, tiles.map((t) => [t.axCorSag, ...t.leftTopWidthHeight.map((v) => Math.round(v / k))])]);
      if (!box || box.dataset.key === key) return;
      box.dataset.key = key;
      box.innerHTML = "";
      for (const t of tiles) {
        const [l, tp, w, h] = t.leftTopWidthHeight.map((v) => v / k);
        const [left, right, top, bottom] = edgeLetters(t.axCorSag, rad);
        const spots = [[left, l + 4, tp + h / 2, "0,-50%"], [right, l + w - 4, tp + h / 2, "-100%,-50%"],
          [top, l + w / 2, tp + 4, "-50%,0"], [bottom, l + w / 2, tp + h - 4, "-50%,-100%"]];
        for (const [text, x, y, shift] of spots) {
          const span = document.createElement("span");
          span.textContent = text;
          span.dataset.tile = String(t.axCorSag);
          span.style.cssText = `left:${x}px;top:${y}px;transform:translate(${shift})`;
          box.appendChild(span);
        }
      }
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
        nv.medsegFrames = (nv.medsegFrames || 0) + 1; // frames drawn (the idle test reads it)
        const out = nv.drawSceneCore();
        placeLetters(nv);
        return out;
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

    return {
      placeLetters: placeLetters, oneFramePerTick: oneFramePerTick, softwareRenderer: softwareRenderer,
      inMotion: inMotion, watchMotion: watchMotion, gpuDone: gpuDone, batch: batch,
    };
  };
})();

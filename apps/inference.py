"""Running a model for the viewer: ``medseg.inference.predict.predict`` (the same call as ``medseg infer``) with progress.

``predict`` reports progress only after the sliding window; to move the bar during it, the
network is wrapped in a module that counts its forward calls against the number of window
batches the input will need. The arithmetic mirrors MONAI's ``sliding_window_inference``; if the
estimate is off, the bar is only less smooth, the result is the same.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import nibabel.orientations as nio
import numpy as np
import torch
from monai.data import MetaTensor

from medseg.bundle.load import Bundle
from medseg.inference.predict import Prediction, label_volumes, predict

log = logging.getLogger(__name__)

WINDOW_SHARE = 0.75  # of the progress bar, for the sliding window; the rest is inversion


@dataclass
class Result:
    """A model's output on one image, ready for display."""

    model: str
    task: str
    prediction: Prediction
    volumes: list[dict[str, float | int | str]]  # segmentation: per-label mL and voxels
    seconds: float


class _CountingNet(torch.nn.Module):
    """Calls the network and reports each finished batch of windows."""

    def __init__(self, net: torch.nn.Module, on_batch: Callable[[], None]) -> None:
        super().__init__()
        self.net = net
        self.on_batch = on_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.on_batch()
        return out


def window_batches(bundle: Bundle, image: MetaTensor) -> int:
    """How many network calls the sliding window will make on ``image`` (an estimate)."""
    cfg = bundle.config
    if cfg.task == "classification":
        return 1
    affine = np.asarray(image.affine, dtype=np.float64)
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    ornt = nio.ornt_transform(nio.io_orientation(affine), nio.axcodes2ornt("RAS"))
    extent = [0.0, 0.0, 0.0]  # mm along R, A, S
    for src, (dst, _) in enumerate(ornt):
        extent[int(dst)] = float(sizes[src]) * int(image.shape[1 + src])
    windows = 1
    for mm, target, roi in zip(extent, cfg.transforms.spacing, cfg.transforms.patch, strict=True):
        size = max(1, round(mm / target))
        if size <= roi:
            continue
        step = max(int(roi * (1 - cfg.infer.overlap)), 1)
        windows *= math.ceil((size - roi) / step) + 1
    return max(1, math.ceil(windows / cfg.infer.sw_batch_size))


def run_model(
    bundle: Bundle,
    image: MetaTensor,
    progress: Callable[[float, str], None] | None = None,
    device: str | torch.device | None = None,
) -> Result:
    """Segment or classify ``image`` with ``bundle`` through ``medseg.inference.predict.predict``."""
    start = time.perf_counter()
    total = window_batches(bundle, image)
    done = 0

    def on_batch() -> None:
        nonlocal done
        done += 1
        if progress:
            share = min(done / total, 1.0) * WINDOW_SHARE
            progress(share, f"sliding window: batch {min(done, total)} of ~{total}")

    def on_stage(fraction: float) -> None:
        if progress:
            progress(
                max(fraction, WINDOW_SHARE) if fraction < 1 else 1.0,
                "mapping back to the scan's grid" if fraction < 1 else "done",
            )

    counted = dataclasses.replace(bundle, model=_CountingNet(bundle.model, on_batch).eval())
    if progress:
        progress(0.0, "preparing the image (orientation, spacing, intensity window)")
    prediction = predict(counted, image, device=device, progress=on_stage)
    volumes = label_volumes(prediction.label, bundle.labels) if prediction.label is not None else []
    seconds = time.perf_counter() - start
    log.info("%s on %s: %.1f s", bundle.name, tuple(image.shape), seconds)
    return Result(bundle.name, bundle.task, prediction, volumes, seconds)

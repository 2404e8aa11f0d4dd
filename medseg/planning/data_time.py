"""Wall seconds the training's random transforms add to a step, measured on the dataset's own cases.

``medseg train`` draws each step's patches in its own process (``data.num_workers: 0``, the
default): ``RandCropByPosNegLabeld`` and the augmentation recipe
(:func:`medseg.training.transforms.seg_train`) run before the network's step, so under a wall-time
budget a step costs the network's forward and backward plus the drawing of its ``B`` patches. The
deterministic head of the chain (load, resample, normalise, crop to the body) is cached once per run
and left out.

Model: the draw costs ``d`` seconds per patch voxel, ``t_data = d B V``, so the step's time fit
``t = t0 + k B V`` becomes ``t0 + (k + d) B V``. ``d`` is the mean time of the random tail over
``repeats`` draws from each of up to ``cases`` training cases, one patch per draw, over the patch's
voxels. On Task04_Hippocampus (crop, three flips, intensity scale and shift; idle 2-core CPU) it
was 0.049 us per voxel, 4.4 ms per 40 x 56 x 40 patch: 22 ms of the planned UNet's 0.25 s step at
batch 5, about 9%.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

from medseg.planning.memory_model import config_at


def data_s_per_voxel(base: dict[str, Any], patch: list[int], cases: int = 4, repeats: int = 3) -> float:
    """``d``: seconds of the random transforms per patch voxel, at ``patch`` (one patch per draw)."""
    import monai.transforms as mt

    from medseg.datasets.decathlon import load_dataset
    from medseg.training.transforms import seg_train

    cfg = config_at(base, patch, base.get("model") or {})
    cfg.transforms.num_samples = 1
    chain = seg_train(cfg).transforms
    first_random = next(i for i, t in enumerate(chain) if isinstance(t, mt.Randomizable))
    cached, drawn = mt.Compose(chain[:first_random]), mt.Compose(chain[first_random:])
    drawn.set_random_state(seed=0)
    items = [cached(dict(case)) for case in load_dataset(cfg.data.dir).training[:cases]]
    tic = time.perf_counter()
    for _ in range(repeats):
        for item in items:
            drawn(copy.copy(item))
    return (time.perf_counter() - tic) / (repeats * len(items) * math.prod(patch))

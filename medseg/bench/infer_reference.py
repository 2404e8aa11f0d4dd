"""The reference path of ``medseg bench infer`` and how its labels are compared with ``predict``'s.

``old`` (:func:`predict_reference`) inverts the C softmax probability maps onto the input grid with
MONAI's ``Invertd`` and takes the argmax there; :func:`medseg.inference.predict.predict` must give the
same labels, except at near-ties (:data:`TIE_TOLERANCE`, judged with :func:`top2_margin`).
:func:`compare_labels` counts differing voxels and Dice per class.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

GB = 2**30


@torch.no_grad()
def predict_reference(
    bundle: Any, image: Any, device: str = "cpu", mode: str = "bilinear", keep_probs: bool = False
) -> Any:
    """Segmentation by the reference path: softmax probabilities inverted by ``Invertd``, argmax after.

    Returns (I, J, K) uint8, or with ``keep_probs`` the pair (labels, inverted probabilities (C, I, J, K))
    (they are alive at the argmax anyway, so keeping them does not raise the peak). ``mode`` exists so
    the tests can break the equivalence on purpose.
    """
    from monai.data import MetaTensor
    from monai.inferers import sliding_window_inference
    from monai.transforms import Invertd

    from medseg.training import transforms as tf

    cfg = bundle.config
    model = bundle.model.to(device)
    pre = tf.preprocess(cfg)
    data = pre({"image": image})
    x = data["image"][None].to(device)

    def forward(patch: torch.Tensor) -> torch.Tensor:
        return model(patch.as_tensor() if isinstance(patch, MetaTensor) else patch)

    inf = cfg.infer
    logits = sliding_window_inference(
        x,
        cfg.transforms.patch,
        inf.sw_batch_size,
        forward,
        overlap=inf.overlap,
        mode=inf.mode,
        progress=False,
        sw_device=device,
        device="cpu",
    )
    probs = torch.softmax(logits.float(), 1)[0]
    data["pred"] = MetaTensor(
        probs, meta=data["image"].meta, applied_operations=data["image"].applied_operations
    )
    if mode != "bilinear":  # a deliberately wrong inversion, for the tests that must be able to fail
        for op in data["pred"].applied_operations:
            if op.get("extra_info", {}).get("mode") == "bilinear":
                op["extra_info"]["mode"] = mode
    back = Invertd("pred", transform=pre, orig_keys="image", nearest_interp=False)(data)["pred"]
    labels = back.argmax(0).to(torch.uint8).as_tensor()
    return (labels, back.as_tensor()) if keep_probs else labels


#: Labels of ``predict`` may differ from ``old`` only where old's two most probable classes are
#: closer than this (probability units). Why a tolerance at all: the two paths evaluate the same
#: trilinear formulas in a different order (float64 slabs vs MONAI's affine grid forward; separable
#: lerps vs ``grid_sample`` back), so their float32 probabilities differ by rounding, which the UNet
#: can amplify from its input; a voxel whose top two classes are within that noise can take either
#: label. 1e-4 is about a thousand float32 ulps of a probability near 0.5, far above the rounding
#: and far below any real disagreement (a wrong inversion moves labels with margins up to ~1).
TIE_TOLERANCE = 1e-4


def top2_margin(probs: torch.Tensor, step: int = 8) -> torch.Tensor:
    """``p_(1) - p_(2)``, the gap between the two largest class probabilities per voxel (C, I, J, K) -> (I, J, K)."""
    out = torch.empty(probs.shape[1:], dtype=torch.float32)
    for k0 in range(0, probs.shape[-1], step):
        top = probs[..., k0 : k0 + step].float().topk(2, dim=0).values
        out[..., k0 : k0 + step] = top[0] - top[1]
    return out


def old_peak_bytes(n_voxels: int, classes: int) -> int:
    """Predicted peak of :func:`predict_reference` (fit to its measured 5.5 GB at 512x512x300, 3 classes).

    Per input voxel: the float32 input (4), affine_grid's base and sampling grids (16 + 12), the
    argmax's int64 (8), and about two float32 copies of the C inverted probability maps (8 C).
    """
    return int(0.45 * GB + n_voxels * (40 + 8 * classes))


def compare_labels(
    a: np.ndarray, b: np.ndarray, classes: int, margin: np.ndarray | None = None
) -> dict[str, Any]:
    """Voxels that differ, and Dice of each class of ``b`` against ``a`` (classes present in either).

    With ``margin`` (``a``'s top-two probability gap per voxel), also the largest gap at a differing
    voxel: small means the labels differ only at near-ties.
    """
    conf = np.zeros((classes, classes), dtype=np.int64)
    fa, fb = a.reshape(-1), b.reshape(-1)
    step = 1 << 24
    for s in range(0, fa.size, step):
        conf += np.bincount(
            fa[s : s + step].astype(np.int64) * classes + fb[s : s + step], minlength=classes * classes
        ).reshape(classes, classes)
    diag = np.diag(conf)
    sums = conf.sum(0) + conf.sum(1)
    dice = [float(2 * diag[c] / sums[c]) for c in range(classes) if sums[c] > 0]
    extra: dict[str, Any] = {}
    if margin is not None:
        worst = 0.0
        for s in range(0, fa.size, step):
            diff = fa[s : s + step] != fb[s : s + step]
            if diff.any():
                worst = max(worst, float(margin.reshape(-1)[s : s + step][diff].max()))
        extra["max_margin_differing"] = worst
    return {
        **extra,
        "differing_voxels": int(conf.sum() - diag.sum()),
        "voxels": int(conf.sum()),
        "min_dice": min(dice) if dice else 1.0,
        "classes_present": len(dice),
    }

"""Inference: the one function the CLI, the evaluation and the viewer call.

``predict`` runs a bundle on an image from :func:`medseg.inference.io.load_image`: preprocess (orient
RAS, resample, window), sliding-window inference with Gaussian blending, softmax, then the class
probabilities are mapped back through the preprocessing onto the input's grid and argmax-ed there,
slab by slab, so memory does not grow with the number of classes (:mod:`medseg.inference.segment`,
:mod:`medseg.inference.resample`). The label map has the input's shape and affine. The peak memory
is predicted first (:mod:`medseg.inference.memory`); an input that cannot fit raises DataError.

A NIfTI file above the streaming threshold (``load_image(..., stream_above=N)``, which ``medseg infer``
sets) is not loaded: ``predict`` reads it slab by slab into the model grid and gives the same labels
(:mod:`medseg.inference.io`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from monai.data import MetaTensor

from medseg.bundle.load import Bundle, load_bundle
from medseg.config import with_infer_overrides
from medseg.datasets import checks
from medseg.datasets.nifti import nifti_codes, save_nifti
from medseg.errors import DataError
from medseg.inference.io import NIFTI_SUFFIXES, LazyVolume, load_image, stream_threshold
from medseg.inference.memory import check_fits, estimate
from medseg.inference.segment import segment
from medseg.training import transforms as tf

log = logging.getLogger(__name__)


@dataclass
class Prediction:
    label: MetaTensor | None  # (1, I, J, K) uint8 on the input's grid, segmentation only
    probabilities: dict[str, float] | None  # class name -> probability, classification only


def _check_input(bundle: Bundle, image: MetaTensor) -> None:
    want = bundle.metadata["network_data_format"]["inputs"]["image"]["num_channels"]
    if image.shape[0] != want:
        raise DataError(
            f"{image.meta.get('filename_or_obj', 'input')}: has {image.shape[0]} channels, model {bundle.name} takes {want}"
        )
    if min(image.shape[1:]) < 2:
        raise DataError(
            f"{image.meta.get('filename_or_obj', 'input')}: a 3D volume is needed, got shape {tuple(image.shape[1:])}"
        )


@torch.no_grad()
def predict(
    bundle: Bundle,
    image: MetaTensor | LazyVolume,
    device: str | torch.device | None = None,
    progress: Callable[[float], None] | None = None,
) -> Prediction:
    """Run ``bundle`` on a loaded image, or a streamed one (:func:`medseg.inference.io.load_image` with
    ``stream_above``);
    see the module docstring for the steps."""
    _check_input(bundle, image)
    cfg = bundle.config
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = bundle.model.to(device)
    if cfg.task == "segmentation":
        check_fits(estimate(cfg, image, len(bundle.labels)), str(image.meta.get("filename_or_obj", "input")))
    if cfg.task == "classification":
        if isinstance(image, LazyVolume):
            image = image.load()
        x = tf.preprocess(cfg)({"image": image})["image"][None].to(device)
        probs = torch.softmax(model(x.as_tensor()).float(), 1)[0].cpu()
        if progress:
            progress(1.0)
        return Prediction(None, {bundle.labels[i]: float(p) for i, p in enumerate(probs)})

    label = segment(model, cfg, image, device, progress)[None]
    if cfg.infer.keep_largest:
        label = keep_largest_components(label, [k for k in bundle.labels if k != 0])
    label = MetaTensor(label, affine=image.affine, meta=dict(image.meta))
    if tuple(label.shape[1:]) != tuple(image.shape[1:]):  # pragma: no cover - invert_argmax guarantees this
        raise RuntimeError(
            f"inverted prediction has shape {tuple(label.shape)} but the input has {tuple(image.shape)}"
        )
    if progress:
        progress(1.0)
    return Prediction(label, None)


def keep_largest_components(label: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """``infer.keep_largest``: each class keeps only its largest connected component (26-neighbourhood),
    the rest of it becomes background (MONAI's ``KeepLargestConnectedComponent``, classes independent)."""
    from monai.transforms import KeepLargestConnectedComponent

    kept = KeepLargestConnectedComponent(applied_labels=classes, is_onehot=False, independent=True)(label)
    return torch.as_tensor(kept, dtype=label.dtype)


def label_volumes(label: MetaTensor, labels: dict[int, str]) -> list[dict[str, float | int | str]]:
    """Voxel count and volume in mL of each foreground label (voxel volume from the affine)."""
    voxel_ml = float(abs(np.linalg.det(np.asarray(label.affine)[:3, :3]))) / 1000.0
    counts = torch.bincount(label.flatten().long(), minlength=max(labels) + 1).tolist()
    return [
        {"label": name, "voxels": counts[k], "ml": counts[k] * voxel_ml}
        for k, name in sorted(labels.items())
        if k != 0
    ]


def infer_to_file(
    run: str | Path,
    source: str | Path,
    output: str | Path,
    series_uid: str | None = None,
    resample: bool = False,
    stream_above: int | None = None,
    trust: bool = False,
    infer: list[str] | None = None,
) -> Path:
    """``medseg infer``: a NIfTI label map (segmentation) or a JSON of class probabilities (classification).

    NIfTI inputs of more than ``stream_above`` voxels (default :func:`medseg.inference.io.stream_threshold`)
    take the streaming path. ``trust``: see :func:`medseg.bundle.load.load_bundle`. ``infer``: ``infer.*=value``
    overrides of the bundle's inference settings."""
    bundle, output = load_bundle(run, trust=trust), Path(output)
    bundle.config = with_infer_overrides(bundle.config, infer or [])
    checks.prepare_output_file(output, [source], create=False)  # before the input is read
    if bundle.task == "classification" and output.suffix != ".json":
        raise DataError(
            f"{output}: a classification model writes class probabilities; name the output *.json"
        )
    if bundle.task == "segmentation" and not output.name.endswith(NIFTI_SUFFIXES):
        raise DataError(f"{output}: the output must be a NIfTI file name (.nii or .nii.gz)")
    threshold = stream_threshold(stream_above) if bundle.task == "segmentation" else None
    image = load_image(source, series_uid=series_uid, resample=resample, stream_above=threshold)
    result = predict(bundle, image)
    checks.prepare_output_file(output, [source])
    if bundle.task == "classification":
        tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(
                json.dumps({"input": str(source), "probabilities": result.probabilities}, indent=2) + "\n"
            )
            os.replace(tmp, output)
        finally:
            tmp.unlink(missing_ok=True)
        return output
    assert result.label is not None
    affine = np.asarray(image.affine, dtype=np.float64)
    save_nifti(result.label[0].numpy(), affine, output, nifti_codes(image))  # the input's sform/qform codes
    return output

"""A dataset's fingerprint: the facts ``medseg plan`` chooses a config from.

Read once over every training case (images and labels as training loads them: RAS orientation, the
reader medseg uses for NIfTI files and DICOM folders), then cached as ``medseg_fingerprint.json`` in
the dataset folder, keyed by the content of ``dataset.json`` and the size and modification time of
every file it names, so a changed dataset is read again.

What it holds:

- per case: shape and spacing along the RAS axes (voxel axis ``a`` lies mostly along world axis
  ``argmax_r |A[r, a]|``; its spacing is the norm of the affine's column ``a``);
- the modality of channel 0 from ``dataset.json``;
- intensities over foreground voxels (label > 0 for segmentation; the object of a classification
  image, :class:`medseg.training.transforms.ObjectMask`): up to 10,000 voxels sampled per case with a fixed
  seed (as nnU-Net does), pooled, then the 0.5, 50 and 99.5 percentiles, mean and standard deviation;
- class frequencies: voxel count of each label over all cases, and its share;
- object sizes: connected components (26-connected) of each foreground class, their volumes in mm³
  and bounding-box extents in mm along R, A, S; for classification, the object's bounding box.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from medseg.datasets.decathlon import DATASET_JSON, DatasetInfo, load_dataset

log = logging.getLogger(__name__)

CACHE_NAME = "medseg_fingerprint.json"
VERSION = 1
SAMPLES_PER_CASE = 10_000


def _files_key(info: DatasetInfo) -> str:
    """sha256 over dataset.json's bytes and (path, size, mtime_ns) of every file or folder it names."""
    h = hashlib.sha256((info.root / DATASET_JSON).read_bytes())
    h.update(f"v{VERSION}".encode())
    for item in info.training:
        for key in ("image", "label"):
            value = item.get(key)
            if isinstance(value, str):
                try:
                    st = os.stat(value)
                    h.update(f"{value}:{st.st_size}:{st.st_mtime_ns}".encode())
                except OSError:
                    h.update(f"{value}:missing".encode())
    return h.hexdigest()


def ras_spacing_shape(affine: np.ndarray, shape: tuple[int, ...]) -> tuple[list[float], list[int]]:
    """Spacing (mm) and size of the volume along R, A, S (see the module docstring)."""
    a = np.asarray(affine, dtype=np.float64)[:3, :3]
    spacing_in = np.linalg.norm(a, axis=0)
    ras_axis = np.argmax(np.abs(a), axis=0)
    spacing, size = [0.0] * 3, [0] * 3
    for ax in range(3):
        r = int(ras_axis[ax])
        spacing[r], size[r] = float(spacing_in[ax]), int(shape[ax])
    return spacing, size


def _objects(label: np.ndarray, spacing: list[float], classes: list[int]) -> dict[int, list[dict]]:
    """Connected components of each class: volume (mm³) and bounding-box extent (mm, R/A/S)."""
    from scipy import ndimage

    voxel = float(np.prod(spacing))
    out: dict[int, list[dict]] = {}
    for c in classes:
        comps, n = ndimage.label(label == c, structure=np.ones((3, 3, 3)))
        objs = []
        for k, sl in enumerate(ndimage.find_objects(comps), start=1):
            if sl is None:
                continue
            count = int((comps[sl] == k).sum())
            extent = [(s.stop - s.start) * sp for s, sp in zip(sl, spacing)]
            objs.append({"volume_mm3": count * voxel, "extent_mm": extent})
        out[c] = objs
        del n
    return out


def _image_object(arr: np.ndarray, spacing: list[float]) -> tuple[np.ndarray, list[float] | None]:
    """The voxels of a classification image's object (:class:`medseg.training.transforms.ObjectMask`)
    and its bounding-box extent in mm along R, A, S (None when the mask is empty)."""
    from medseg.training import transforms as tf

    mask = np.asarray(tf.ObjectMask()(arr[None]))[0]
    idx = np.argwhere(mask)
    if not idx.size:
        return arr[mask], None
    return arr[mask], [(hi - lo + 1) * sp for lo, hi, sp in zip(idx.min(0), idx.max(0), spacing)]


def _object_summaries(objects: dict[int, list[dict]]) -> dict[str, dict[str, Any]]:
    """Per class: the summaries of its objects' volumes and of their extents along R, A, S."""
    return {
        str(c): {
            "volume_mm3": _summary([o["volume_mm3"] for o in objs]),
            "extent_mm": [_summary([o["extent_mm"][r] for o in objs]) for r in range(3)],
        }
        for c, objs in objects.items()
    }


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = np.asarray(values, dtype=np.float64)
    return {
        "min": float(v.min()),
        "p5": float(np.percentile(v, 5)),
        "median": float(np.median(v)),
        "p95": float(np.percentile(v, 95)),
        "max": float(v.max()),
        "count": int(v.size),
    }


def _intensity(samples: list[np.ndarray]) -> dict[str, float] | None:
    """Percentiles (0.5, 50, 99.5), mean and standard deviation of the pooled foreground samples."""
    pooled = np.concatenate(samples) if samples else np.zeros(0)
    if not pooled.size:
        return None
    return {
        "p0_5": float(np.percentile(pooled, 0.5)),
        "median": float(np.median(pooled)),
        "p99_5": float(np.percentile(pooled, 99.5)),
        "mean": float(pooled.mean()),
        "std": float(pooled.std()),
        "samples": int(pooled.size),
    }


def compute_fingerprint(info: DatasetInfo, progress: bool = True) -> dict[str, Any]:
    """Read every training case of ``info`` and return its fingerprint (see the module docstring)."""
    import torch
    from monai import transforms as mt
    from tqdm import tqdm

    from medseg.training import transforms as tf

    seg = info.task == "segmentation"
    keys = ["image", "label"] if seg else ["image"]
    chain = mt.Compose([*tf.loader(keys).transforms, mt.Orientationd(keys, axcodes="RAS")])
    rs = np.random.RandomState(1234)
    classes = sorted(k for k in info.labels if k != 0)
    cases, samples = [], []
    counts = np.zeros(max(info.labels) + 1, dtype=np.int64)
    objects: dict[int, list[dict]] = {c: [] for c in classes}
    object_boxes: list[list[float]] = []
    for item in tqdm(info.training, desc="fingerprint", unit="case", leave=False, disable=not progress):
        data = tf.apply(chain, {k: item[k] for k in keys})
        image = data["image"]
        arr = image.as_tensor()[0].numpy() if isinstance(image, torch.Tensor) else np.asarray(image)[0]
        spacing, shape = ras_spacing_shape(np.asarray(image.affine), arr.shape)
        case: dict[str, Any] = {"image": Path(item["image"]).name, "spacing": spacing, "shape": shape}
        if seg:
            label = np.asarray(data["label"])[0].round().astype(np.int64)
            counts += np.bincount(label.ravel(), minlength=counts.size)[: counts.size]
            fg = arr[label > 0]
            for c, objs in _objects(label, spacing, classes).items():
                objects[c] += objs
        else:
            fg, box = _image_object(arr, spacing)
            if box is not None:
                object_boxes.append(box)
                case["object_extent_mm"] = box
            counts[int(item["label"])] += 1
        if fg.size:
            take = rs.choice(fg.size, size=min(SAMPLES_PER_CASE, fg.size), replace=False)
            samples.append(fg[take].astype(np.float64))
        cases.append(case)
    intensity = _intensity(samples)
    spacings = np.asarray([c["spacing"] for c in cases])
    shapes = np.asarray([c["shape"] for c in cases])
    total = max(int(counts.sum()), 1)
    fp: dict[str, Any] = {
        "version": VERSION,
        "dataset": info.name,
        "task": info.task,
        "modality": info.modality.get("0", next(iter(info.modality.values()), "CT"))
        if info.modality
        else "CT",
        "num_cases": len(cases),
        "labels": {str(k): v for k, v in info.labels.items()},
        "median_spacing": [float(v) for v in np.median(spacings, 0)],
        "median_shape": [float(v) for v in np.median(shapes, 0)],
        "spacing_p10": [float(v) for v in np.percentile(spacings, 10, 0)],
        "foreground_intensity": intensity,
        "class_voxels" if seg else "class_cases": {str(k): int(counts[k]) for k in info.labels},
        "class_share": {str(k): float(counts[k] / total) for k in info.labels},
        "cases": cases,
    }
    if seg:
        fp["objects"] = _object_summaries(objects)
    else:
        fp["object_extent_mm"] = [_summary([b[r] for b in object_boxes]) for r in range(3)]
    return fp


def fingerprint(dataset_dir: str | Path, refresh: bool = False, progress: bool = True) -> tuple[dict, bool]:
    """The dataset's fingerprint, from its cache when the dataset is unchanged; (fingerprint, from_cache)."""
    info = load_dataset(dataset_dir)
    key = _files_key(info)
    cache = info.root / CACHE_NAME
    if not refresh and cache.is_file():
        try:
            cached = json.loads(cache.read_text())
            if cached.get("key") == key:
                return cached, True
        except (OSError, ValueError):
            log.warning("%s: unreadable fingerprint cache, computing it again", cache)
    fp = compute_fingerprint(info, progress=progress)
    fp["key"] = key
    tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(fp, indent=1) + "\n")
        os.replace(tmp, cache)
    except OSError as exc:  # a read-only dataset folder: the fingerprint is still printed
        log.warning("%s: fingerprint not cached (%s)", cache, exc)
        tmp.unlink(missing_ok=True)
    return fp, False


def format_fingerprint(fp: dict[str, Any]) -> str:
    """A few lines for people: the facts the plan uses."""
    lines = [
        f"fingerprint of {fp['dataset']} ({fp['task']}, {fp['modality']}, {fp['num_cases']} training cases)",
        "  median spacing (R, A, S) mm: " + " x ".join(f"{v:.3g}" for v in fp["median_spacing"]),
        "  median shape (R, A, S): " + " x ".join(f"{v:.0f}" for v in fp["median_shape"]),
    ]
    it = fp.get("foreground_intensity")
    if it:
        lines.append(
            f"  foreground intensity: p0.5 {it['p0_5']:.4g}, median {it['median']:.4g}, p99.5 {it['p99_5']:.4g}, "
            f"mean {it['mean']:.4g}, std {it['std']:.4g} ({it['samples']} voxels sampled)"
        )
    share = ", ".join(f"{fp['labels'][k]} {v:.3%}" for k, v in fp["class_share"].items())
    lines.append(f"  class share ({'voxels' if fp['task'] == 'segmentation' else 'cases'}): {share}")
    for c, o in (fp.get("objects") or {}).items():
        v = o["volume_mm3"]
        if v:
            ext = " x ".join(f"{e['median']:.3g}" for e in o["extent_mm"])
            lines.append(
                f"  {fp['labels'][c]}: {v['count']} objects, volume median {v['median']:.4g} mm³ "
                f"(p5 {v['p5']:.4g}, max {v['max']:.4g}), median extent {ext} mm"
            )
    if fp.get("object_extent_mm") and fp["object_extent_mm"][0]:
        ext = " x ".join(f"{e['median']:.3g} (max {e['max']:.3g})" for e in fp["object_extent_mm"])
        lines.append(f"  object bounding box mm: {ext}")
    return "\n".join(lines)

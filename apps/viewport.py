"""The interactive viewport: NiiVue (BSD-2, vendored from npm) as a Streamlit custom component.

The JavaScript lives in ``frontend/`` inside the package: ``index.html`` and ``viewport.js`` are
ours, ``niivue.umd.js`` is NiiVue's prebuilt browser bundle, copied from the npm package at setup
(``make vendor``, run by ``make setup``; pinned in the Makefile). Streamlit serves that folder
itself, so the page fetches nothing from a CDN and no image leaves the machine.

The scan goes to the browser as NIfTI-1 bytes in its stored voxel order with its own affine
(NiiVue reorients for display and reports world coordinates through that affine). A NIfTI upload
that NiiVue reads with medseg's geometry (:func:`medseg.apps.upload.viewer_nifti`) travels as the
uploaded file itself, gzip and all, before the server has read its voxels: that is what lets the
scan paint first. Any other scan (DICOM, other headers) is re-encoded once it is read: intensities
that are whole numbers within int16 as int16 (CT), anything else as float32. The label map goes as
uint8 NIfTI; the browser shows it in NiiVue's drawing layer (``frontend/labels.js``), where the
brush, the eraser and undo change only the voxels they touch, and labels blend with the anatomy at
their opacity in every mode. Every view follows the radiological convention (patient's right on
the screen's left, anterior on the left in sagittal views), with letters on all four edges.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import streamlit.components.v1 as components

from medseg.apps import render

FRONTEND = Path(__file__).with_name("frontend")
NIIVUE = FRONTEND / "niivue.umd.js"

_component = components.declare_component("medseg_viewport", path=str(FRONTEND))


def available() -> bool:
    """Whether the NiiVue bundle was vendored (``make vendor``); without it the page uses static panels."""
    return NIIVUE.is_file()


def nifti_bytes(array: np.ndarray, affine: np.ndarray, labels: bool = False) -> bytes:
    """An (I, J, K) array as NIfTI-1 bytes with ``affine`` as sform and qform (code 1, scanner)."""
    data = np.asarray(array)
    if labels:
        data = data.astype(np.uint8)
    else:
        finite = data.size and np.isfinite(data).all()
        lo, hi = (float(data.min()), float(data.max())) if finite else (0.0, 0.0)
        whole = finite and lo >= -32768 and hi <= 32767 and np.array_equal(data, np.round(data))
        data = data.astype(np.int16 if whole else np.float32)
    # The header from nibabel, the voxels written straight after it in NIfTI's x-fastest order:
    # nibabel's own writer checks the data's range first and takes seconds on a 512 x 512 x 300 map.
    affine = np.asarray(affine, dtype=np.float64)
    header = nib.Nifti1Header()
    header.set_data_shape(data.shape)
    header.set_data_dtype(data.dtype)
    header.set_sform(affine, code=1)
    header.set_qform(affine, code=1)
    header.set_xyzt_units("mm")
    header["vox_offset"] = 352
    return header.binaryblock + b"\0" * 4 + np.asarray(data).tobytes(order="F")


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def label_info(labels: dict[int, str]) -> list[dict[str, Any]]:
    """Name and default colour per label value (the static panels' palette)."""
    return [
        {"value": int(k), "name": str(v), "colour": list(render.label_colour(int(k))) if k else [0, 0, 0]}
        for k, v in sorted(labels.items())
    ]


@dataclass(frozen=True)
class ViewportSpec:
    """What the viewport shows: the scan, the model's label map, a second mask, the display settings.

    ``affine`` is the scan's (the one in its NIfTI bytes): the readout gives the file's own voxel
    indices, ``round(inv(affine) @ mm)``, not NiiVue's RAS-reordered ones.
    ``volume_id`` and ``labels_id`` name the bytes (:func:`digest`): the browser reloads a volume
    only when its id changes, so reruns that only move a control do not reload the scan.
    ``volume_name`` ends in ``.nii.gz`` when ``volume`` is gzip-compressed. ``level`` and ``width``
    None leave NiiVue's own robust window (the scan's first paint, before the page has read it).
    ``preview`` > 1 says ``volume`` holds every ``preview``-th voxel of the scan (a large upload's
    first paint; the full scan follows under another ``volume_id``); ``affine`` is then the full
    scan's, so the readout gives the full scan's voxel indices.

    ``opacity`` is the sidebar's: every label's opacity (each has its own slider in the viewport).
    The report carries ``"window": {"seq", "volume", "level", "width"}`` once the user has dragged
    the display window (a new ``seq`` per drag; ``volume`` is the ``volume_id`` it was dragged on).

    ``editable`` shows the brush, eraser and undo on the label map; once the user has drawn, the
    report carries ``"edits": {"base": labels_id, "seq": n, "changed": voxels, "runs": [[start,
    length, value], ...]}`` over the label map's stored i-fastest voxel order
    (:func:`medseg.apps.review.apply_edits`). ``second`` is another label map on the same grid
    (an uploaded mask or a second model's, as its edges), drawn over the first in one colour; it is
    sent only in that mode, so a switch to side by side removes it from the left viewer.
    ``side_by_side`` with ``second_filled`` (that label map itself, uint8 NIfTI) shows two viewers
    instead, left ``first_name``'s labels (``labels``), right ``second_name``'s, on the same scan,
    their crosshairs, slices, zoom, layout and window linked (NiiVue's ``broadcastTo``).
    """

    volume: bytes
    volume_id: str
    affine: np.ndarray
    volume_name: str = "scan.nii"
    preview: int = 1
    labels: bytes | None = None
    labels_id: str = "none"
    labels_meta: list[dict[str, Any]] = field(default_factory=list)  # :func:`label_info`
    level: float | None = None
    width: float | None = None
    opacity: float = 0.4
    height: int = 600
    editable: bool = False
    second: bytes | None = None
    second_id: str = "none"
    second_name: str = ""
    side_by_side: bool = False
    second_filled: bytes | None = None
    first_name: str = ""


def viewport(spec: ViewportSpec, key: str = "viewport") -> dict[str, Any] | None:
    """Draw the viewport ``spec`` describes; returns what the browser reported ({"webgl": bool,
    ...}, with the user's label edits once there are any), None before it has."""
    return _component(
        volume=spec.volume,
        volume_id=spec.volume_id,
        affine=np.asarray(spec.affine, dtype=np.float64).tolist(),
        labels=spec.labels,
        labels_id=spec.labels_id,
        label_info=spec.labels_meta,
        volume_name=spec.volume_name,
        level=None if spec.level is None else float(spec.level),
        width=None if spec.width is None else float(spec.width),
        opacity=float(spec.opacity),
        height=int(spec.height),
        editable=bool(spec.editable),
        second=spec.second,
        second_id=spec.second_id,
        second_name=spec.second_name,
        side_by_side=bool(spec.side_by_side and spec.second_filled is not None),
        second_filled=spec.second_filled,
        first_name=spec.first_name,
        preview=int(spec.preview),
        key=key,
        default=None,
    )

"""Exporting a result: the label map as NIfTI in the scan's original geometry, and as DICOM-SEG
(highdicom) referencing the source slices when the scan came as a DICOM series."""

from __future__ import annotations

import io
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from monai.data import MetaTensor
from pydicom.dataset import Dataset

from medseg import __version__
from medseg.datasets.nifti import save_nifti


def mask_nifti_bytes(label: MetaTensor) -> bytes:
    """The (1, I, J, K) label map as .nii.gz bytes, with the affine of the image it was predicted on.

    Written with ``save_nifti`` (the writer ``medseg infer`` uses) into a private temporary folder.
    """
    with tempfile.TemporaryDirectory(prefix="medseg-export-") as tmp:
        path = save_nifti(
            np.asarray(label[0].cpu().numpy(), dtype=np.uint8),
            np.asarray(label.affine, dtype=np.float64),
            Path(tmp) / "mask.nii.gz",
        )
        return path.read_bytes()


def _codes(name: str):
    """(category, type) codes for a segment: SNOMED CT lesion, organ, or plain tissue."""
    from pydicom.sr.codedict import codes

    low = name.lower()
    if any(w in low for w in ("lesion", "tumor", "tumour", "nodule", "metast")):
        return codes.SCT.MorphologicallyAbnormalStructure, codes.SCT.Lesion
    if "organ" in low:
        return codes.SCT.AnatomicalStructure, codes.SCT.Organ
    return codes.SCT.Tissue, codes.SCT.Tissue


def mask_dicom_seg_bytes(
    label: MetaTensor, sources: Sequence[Dataset], labels: dict[int, str], model: str
) -> bytes:
    """A binary DICOM Segmentation of ``label`` over the series it was predicted on.

    ``sources`` are the series' slice headers in the order of the volume's k axis (the order
    ``medseg.datasets.dicom.read_dicom_series`` stacks them in), so frame k is
    ``label[0, :, :, k].T`` (DICOM rows run along j, columns along i). One segment per foreground
    label; slices without any label are left out.
    """
    import highdicom as hd
    from pydicom.sr.codedict import codes

    mask = np.asarray(label[0].cpu().numpy(), dtype=np.uint8)
    if mask.shape[2] != len(sources):
        raise ValueError(f"the mask has {mask.shape[2]} slices but the series {len(sources)}")
    frames = np.ascontiguousarray(np.transpose(mask, (2, 1, 0)))  # (k, rows=j, columns=i)
    algorithm = hd.AlgorithmIdentificationSequence(
        name=f"medseg {model}"[:64], family=codes.cid7162.ArtificialIntelligence, version=__version__
    )
    descriptions = []
    foreground = sorted(k for k in labels if k != 0)
    for number, k in enumerate(foreground, start=1):
        category, kind = _codes(labels[k])
        descriptions.append(
            hd.seg.SegmentDescription(
                segment_number=number,
                segment_label=labels[k][:64],
                segmented_property_category=category,
                segmented_property_type=kind,
                algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
                algorithm_identification=algorithm,
            )
        )
    # highdicom reads a label map's values as segment numbers: renumber labels onto 1..n
    lut = np.zeros(256, dtype=np.uint8)
    lut[foreground] = np.arange(1, len(foreground) + 1)
    seg = hd.seg.Segmentation(
        source_images=list(sources),
        pixel_array=lut[frames],
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions,
        series_instance_uid=hd.UID(),
        series_number=900,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="medseg",
        manufacturer_model_name="medseg viewer",
        software_versions=__version__,
        device_serial_number="none",
        series_description=f"medseg {model}"[:64],
    )
    buf = io.BytesIO()
    seg.save_as(buf)
    return buf.getvalue()

"""Exporting a result: the label map as NIfTI in the scan's original geometry, and as DICOM-SEG
(highdicom) referencing the source slices when the scan came as a DICOM series."""

from __future__ import annotations

import copy
import gzip
import io
from collections.abc import Sequence
from dataclasses import dataclass

import nibabel as nib
import numpy as np
from monai.data import MetaTensor
from pydicom.dataset import Dataset
from pydicom.uid import UID, generate_uid

from medseg import __version__
from medseg.errors import DataError

# SOP classes a Segmentation may reference when a slice does not say which it is
_IMAGE_STORAGE = {"CT": "1.2.840.10008.5.1.4.1.1.2", "MR": "1.2.840.10008.5.1.4.1.1.4"}
# attributes highdicom copies from the source images into the Segmentation's geometry
_GEOMETRY = ("ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing")


@dataclass
class SegExport:
    """A DICOM-SEG and the UIDs that had to be made up because the series did not carry them."""

    data: bytes
    generated: list[str]


def _valid_uid(value: object) -> bool:
    text = str(value or "").strip()
    return bool(text) and UID(text).is_valid


def _file_meta_uid(ds: Dataset, name: str) -> str:
    """The file meta's copy of a dataset's SOP instance or class UID ("" when it has none): DICOM
    files carry them twice, and anonymisers often blank only the data set's."""
    meta = getattr(ds, "file_meta", None)
    value = meta.get(f"MediaStorage{name}", "") if meta is not None else ""
    return str(value or "").strip()


def _fill_sop_instances(out: list[Dataset]) -> int:
    """Give each slice a valid, unique SOPInstanceUID: its own, else its file meta's, else a new
    one. Returns how many were made up."""
    seen: set[str] = set()
    made = 0
    for ds in out:
        uid = str(ds.get("SOPInstanceUID", "") or "").strip()
        if not _valid_uid(uid) or uid in seen:
            uid = _file_meta_uid(ds, "SOPInstanceUID")
        if not _valid_uid(uid) or uid in seen:
            uid = generate_uid()
            made += 1
        ds.SOPInstanceUID = uid
        seen.add(uid)
    return made


def _fill_sop_classes(out: list[Dataset]) -> bool:
    """Give each slice a valid SOPClassUID: its own, else its file meta's, else the image storage
    class of its Modality (CT or MR). True when one was made up from the Modality."""
    made = False
    for ds in out:
        if _valid_uid(ds.get("SOPClassUID")):
            continue
        meta_uid = _file_meta_uid(ds, "SOPClassUID")
        if _valid_uid(meta_uid):
            ds.SOPClassUID = meta_uid
            continue
        storage = _IMAGE_STORAGE.get(str(ds.get("Modality", "")).upper())
        if storage is None:
            raise DataError(
                "the slices do not say what kind of DICOM image they are (no SOP class, and the "
                "modality is not CT or MR), so a segmentation cannot refer to them"
            )
        ds.SOPClassUID = storage
        made = True
    return made


def fill_missing_uids(sources: Sequence[Dataset]) -> tuple[list[Dataset], list[str]]:
    """Copies of ``sources`` with empty or invalid UIDs replaced, and which were made up.

    Anonymisers often blank the Study, Series, SOP instance and frame of reference UIDs. A
    Segmentation must reference its source images by them, so each missing UID gets a fresh one
    (one Study, Series and frame of reference for the whole series, one SOP instance per slice;
    a SOP instance UID that repeats is replaced too). A blank SOP instance or class UID is taken
    from the file meta (MediaStorageSOPInstanceUID, MediaStorageSOPClassUID) when that holds a
    valid one, and is then not reported as made up; a SOP class UID is otherwise filled from the
    Modality (CT or MR image storage). Raises DataError, in plain words, when the geometry itself
    is missing.

    Each call makes new UIDs: call it once per loaded series (:class:`SegSources`), so that every
    export of that series references the same ones.
    """
    out = [copy.deepcopy(ds) for ds in sources]
    generated: list[str] = []
    for name in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID"):
        values = {str(ds.get(name, "") or "") for ds in out}
        if len(values) != 1 or not _valid_uid(next(iter(values))):
            uid = generate_uid()
            for ds in out:
                setattr(ds, name, uid)
            generated.append(name)
    made = _fill_sop_instances(out)
    if made:
        generated.append(f"SOPInstanceUID ({made} of {len(out)} slices)")
    if _fill_sop_classes(out):
        generated.append("SOPClassUID")
    for ds in out:
        missing = [a for a in _GEOMETRY if not ds.get(a)]
        if missing:
            raise DataError(
                "the slices do not record where they lie in the patient "
                f"({', '.join(missing)} missing), so a segmentation cannot be placed on them"
            )
    return out, generated


@dataclass
class SegSources:
    """A series' slice headers as every DICOM-SEG of it references them: missing UIDs filled in
    once (:func:`fill_missing_uids`), so the model's SEG and a corrected SEG reference one series.

    ``problem`` says, in plain words, why no SEG can reference this series (then ``headers`` is empty).
    """

    headers: list[Dataset]
    generated: list[str]
    problem: str | None = None


def seg_sources(headers: Sequence[Dataset]) -> SegSources:
    """:func:`fill_missing_uids` once for a loaded series; its DataError becomes ``problem``."""
    try:
        filled, generated = fill_missing_uids(headers)
    except DataError as e:
        return SegSources([], [], str(e))
    return SegSources(filled, generated)


def mask_nifti_bytes(label: MetaTensor, codes: tuple[int, int] = (1, 1)) -> bytes:
    """The (1, I, J, K) label map as .nii.gz bytes, with the affine of the image it was predicted on
    and that image's sform and qform codes (:func:`~medseg.datasets.nifti.nifti_codes`): a scan whose sform says
    "aligned to another scan" (code 2) gets a mask that says the same.

    Written as ``save_nifti`` (the writer ``medseg infer`` uses) writes, with these codes; the
    affine is written to both forms, as there.
    """
    sform_code, qform_code = codes
    affine = np.asarray(label.affine, dtype=np.float64)
    img = nib.Nifti1Image(np.asarray(label[0].cpu().numpy(), dtype=np.uint8), affine)
    img.set_sform(affine, code=sform_code)
    img.set_qform(affine, code=qform_code)
    img.header.set_xyzt_units("mm")
    return gzip.compress(img.to_bytes(), compresslevel=1)  # nibabel's own level for .nii.gz


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
    label: MetaTensor,
    sources: Sequence[Dataset],
    labels: dict[int, str],
    model: str,
    corrected: bool = False,
) -> bytes:
    """A binary DICOM Segmentation of ``label`` over the series it was predicted on.

    ``corrected``: the model's mask edited by a person in the viewer; its segments are then
    SEMIAUTOMATIC (algorithm plus manual correction) rather than AUTOMATIC.

    ``sources`` are the series' slice headers in the order of the volume's k axis (the order
    ``medseg.datasets.dicom.reader.read_dicom_series`` stacks them in), so frame k is
    ``label[0, :, :, k].T`` (DICOM rows run along j, columns along i). One segment per foreground
    label; slices without any label are left out.
    """
    import highdicom as hd
    from pydicom.sr.codedict import codes

    mask = np.asarray(label[0].cpu().numpy(), dtype=np.uint8)
    if mask.shape[2] != len(sources):
        raise DataError(
            f"the mask has {mask.shape[2]} slices but the series {len(sources)}; "
            "a segmentation must match the uploaded slices one to one"
        )
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
                algorithm_type=(
                    hd.seg.SegmentAlgorithmTypeValues.SEMIAUTOMATIC
                    if corrected
                    else hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC
                ),
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
        series_description=f"medseg {model}{' corrected' if corrected else ''}"[:64],
    )
    buf = io.BytesIO()
    seg.save_as(buf)
    return buf.getvalue()


def dicom_seg_export(
    label: MetaTensor,
    sources: SegSources,
    labels: dict[int, str],
    model: str,
    corrected: bool = False,
) -> SegExport:
    """:func:`mask_dicom_seg_bytes` over the series as :func:`seg_sources` filled it in, once per
    loaded series; a DataError saying why when no SEG can reference it."""
    if sources.problem is not None:
        raise DataError(sources.problem)
    return SegExport(
        mask_dicom_seg_bytes(label, sources.headers, labels, model, corrected), sources.generated
    )

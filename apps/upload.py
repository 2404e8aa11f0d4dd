"""Uploaded files -> a loaded image, through ``medseg.inference.io.load_image`` (the path ``medseg infer`` reads with).

An upload is one NIfTI file, one zip (of a DICOM series folder, or holding one NIfTI file), or
several DICOM files. The bytes are written to a private temporary folder, read, and the folder is
removed before returning: nothing is kept on disk and nothing leaves the machine. A DICOM upload
that holds several series is listed first so the user can choose one.

Nothing compressed is inflated without a bound (:mod:`medseg.apps.limits`): a ``.nii.gz`` is
counted against its header's size before the reader opens it, the preview inflates no more than
that, a zip's members no more than the sizes it declares, and a deflated DICOM file no more than
the cap on a decompressed upload.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from monai.data import MetaTensor
from pydicom.dataset import Dataset

from medseg.apps import limits
from medseg.apps.limits import max_upload_mb
from medseg.apps.messages import not_a_scan, sniff
from medseg.datasets import checks
from medseg.datasets.dicom.header import is_dicom_bytes, read_header
from medseg.datasets.dicom.scan import SeriesInfo, list_series
from medseg.errors import DataError, MedsegError
from medseg.inference.io import NIFTI_SUFFIXES, load_image

log = logging.getLogger(__name__)

MAX_ZIP_MEMBERS = 20_000


@dataclass(frozen=True)
class UploadedBytes:
    """One uploaded file: its name as the browser gave it and its content."""

    name: str
    data: bytes


@dataclass(frozen=True)
class SeriesChoice:
    """A series the user can choose, without patient identifiers."""

    uid: str
    description: str
    modality: str
    n_files: int

    @property
    def label(self) -> str:
        text = f"{self.description or '(no description)'} · {self.modality or '?'} · {self.n_files} file(s)"
        return f"{text} · …{self.uid[-8:]}"


@dataclass
class LoadResult:
    """Either the loaded image, or the series to choose from before one can be loaded."""

    image: MetaTensor | None
    source: str  # "NIfTI" or "DICOM"
    series: list[SeriesChoice]
    # DICOM: the slice headers in the order of the volume's k axis, for a DICOM-SEG export
    # (None for NIfTI and for series resampled onto a regular grid)
    headers: list[Dataset] | None = None


def _safe_name(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.replace("\\", "/")).name).lstrip(".")
    return base or "file"


def _is_dicom(data: bytes) -> bool:
    """DICOM with or without the 128-byte preamble (the reader's own test)."""
    return is_dicom_bytes(data[:132])


def _is_dicom_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return _is_dicom(f.read(132))


def _check_deflated(named: Sequence[tuple[str, bytes | Path]]) -> None:
    """Refuse a deflated DICOM upload that inflates past the cap, all its files together, before
    pydicom (which inflates a deflated data set whole) reads any of them."""
    budget = limits.decompressed_cap().bytes
    for name, source in named:
        data = source.read_bytes() if isinstance(source, Path) else source
        budget -= limits.check_dicom(name, data, budget)


def _extract_zip(data: bytes, dest: Path, limit: int) -> list[Path]:
    """Extract regular files of a zip under ``dest``, refusing zip bombs and paths that climb out."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise DataError(
            "the zip cannot be opened: its list of contents, kept at the end of a zip, is missing or "
            "damaged, so the file is probably cut short; zip the folder again and upload the complete file"
        ) from None
    with zf:
        members = [m for m in zf.infolist() if not m.is_dir()]
        if len(members) > MAX_ZIP_MEMBERS:
            raise DataError(f"the zip holds {len(members)} files; at most {MAX_ZIP_MEMBERS} are accepted")
        total = sum(m.file_size for m in members)
        if total > limit:
            raise DataError(
                f"the zip unpacks to {total / 2**20:.0f} MB, over the {limit / 2**20:.0f} MB upload limit"
            )
        out = []
        for n, m in enumerate(members):
            parts = [p for p in m.filename.replace("\\", "/").split("/") if p not in ("", ".", "..")]
            if not parts or any(p.startswith(".") for p in parts) or parts[0] == "__MACOSX":
                continue  # hidden files and macOS resource forks
            # a numbered folder per member keeps names unique without trusting the archive's paths
            target = dest / f"{n:05d}" / _safe_name(parts[-1])
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with zf.open(m) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile, OSError) as e:
                raise DataError(
                    f"{m.filename} in the zip cannot be extracted ({e}); the zip may be truncated"
                ) from None
            out.append(target)
    return out


def _meant(name: str) -> str:
    """What a file's name makes it out to be, for a message."""
    low = name.lower()
    if low.endswith(NIFTI_SUFFIXES):
        return "a NIfTI image"
    if low.endswith(".zip"):
        return "a zip of a DICOM series"
    if low.endswith((".dcm", ".dicom")):
        return "a DICOM file"
    return "a NIfTI, zip or DICOM file"


def _nifti_name(name: str, data_head: bytes) -> str:
    """A safe file name for a NIfTI upload whose suffix matches its content (nibabel reads by
    suffix: a gzip stream must end in .nii.gz, plain bytes in .nii)."""
    base = _safe_name(name)
    for suffix in NIFTI_SUFFIXES:
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
            break
    return f"{base or 'scan'}{'.nii.gz' if limits.is_gzip(data_head) else '.nii'}"


def _kinds_in(paths: Sequence[Path]) -> str:
    """What a zip's members are, in words ("PNG image × 3, text file × 1"), for a message."""
    counts: dict[str, int] = {}
    for path in paths:
        with open(path, "rb") as f:
            kind = sniff(f.read(limits.PIECE))
        what = kind.what.removeprefix("an ").removeprefix("a ") if kind is not None else "unknown format"
        counts[what] = counts.get(what, 0) + 1
    return ", ".join(f"{what} × {n}" for what, n in sorted(counts.items(), key=lambda c: -c[1])[:4])


def _stage_zip(upload_zip: UploadedBytes, dest: Path, limit: int) -> tuple[str, Path]:
    """Unpack a zip: ("NIfTI", its one NIfTI file) or ("DICOM", the folder of its DICOM files)."""
    extracted = _extract_zip(upload_zip.data, dest, limit)
    inner = [p for p in extracted if p.name.lower().endswith(NIFTI_SUFFIXES)]
    dicom = [p for p in extracted if _is_dicom_file(p)]
    if len(inner) == 1 and not dicom:
        with open(inner[0], "rb") as f:
            kind = sniff(f.read(limits.PIECE))
        if kind is None or kind.readable != "nifti":
            raise DataError(not_a_scan(f"{upload_zip.name}: {inner[0].name}", kind, "a NIfTI image"))
        return "NIfTI", inner[0]
    if len(inner) > 1:
        raise DataError(f"the zip holds {len(inner)} NIfTI files; upload one at a time")
    if not dicom:
        held = f" (it holds {_kinds_in(extracted)})" if extracted else " (it is empty)"
        raise DataError(
            f"{upload_zip.name} holds no DICOM files and no NIfTI file{held}; zip the folder of a DICOM series"
        )
    _check_deflated([(p.name, p) for p in dicom])
    return "DICOM", dest


@contextmanager
def staged(files: Sequence[UploadedBytes]) -> Iterator[tuple[str, Path]]:
    """Write an upload into a temporary folder; yield ("NIfTI", file) or ("DICOM", folder).

    Each file is taken for what its first bytes say it is (:func:`medseg.apps.messages.sniff`), not
    for its name: a gzip-compressed NIfTI named ``.nii`` is read, a PNG named ``.nii.gz`` is
    reported as a PNG image. The folder is removed on exit. Raises DataError for uploads that are
    neither, saying what they are.
    """
    if not files:
        raise DataError("no file was uploaded")
    limit = max_upload_mb() * 2**20
    total = sum(len(f.data) for f in files)
    if total > limit:
        raise DataError(f"the upload is {total / 2**20:.0f} MB, over the {limit / 2**20:.0f} MB limit")
    kinds = [sniff(memoryview(f.data)[: limits.PIECE]) for f in files]
    tmp = Path(tempfile.mkdtemp(prefix="medseg-upload-"))
    try:
        if len(files) == 1 and (kinds[0] is None or not kinds[0].readable):
            raise DataError(not_a_scan(files[0].name, kinds[0], _meant(files[0].name)))
        single = [
            (f, k)
            for f, k in zip(files, kinds, strict=True)
            if k is not None and k.readable in ("nifti", "zip")
        ]
        if single and len(files) > 1:
            raise DataError(
                "upload one NIfTI file, one zip, or several DICOM files; "
                f"got {len(files)} files including {single[0][0].name} ({single[0][1].what})"
            )
        if single and single[0][1].readable == "nifti":
            path = tmp / _nifti_name(files[0].name, files[0].data[:2])
            path.write_bytes(files[0].data)
            yield "NIfTI", path
            return
        if single:
            yield _stage_zip(files[0], tmp / "zip", limit)
            return
        folder = tmp / "dicom"
        folder.mkdir()
        for n, (f, kind) in enumerate(zip(files, kinds, strict=True)):
            if kind is None or kind.readable != "dicom":
                raise DataError(not_a_scan(f.name, kind, "a DICOM file"))
            (folder / f"{n:05d}-{_safe_name(f.name)}").write_bytes(f.data)
        _check_deflated([(f.name, f.data) for f in files])
        yield "DICOM", folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tidy(message: str, root: Path) -> str:
    """Replace temporary folder names in an error message with 'upload', and staged file names with
    the uploaded ones."""
    message = message.replace(str(root), "upload")
    message = re.sub(r"/tmp/medseg-upload-[^/\s]+", "upload", message)
    return re.sub(r"(?<![\w.])\d{5}-(?=[\w.-])", "", message)  # the numbered prefix staging gives a file


def _check_volume(image: MetaTensor) -> None:
    shape = tuple(int(s) for s in image.shape[1:])
    if min(shape) < 2:
        raise DataError(
            f"the image is 2D (shape {shape}); the viewer and the models need a 3D volume "
            "with at least 2 voxels along each axis"
        )


def read_upload(files: Sequence[UploadedBytes], series_uid: str | None = None) -> LoadResult:
    """Load an upload as a (C, I, J, K) MetaTensor, or list its series when there are several.

    Every failure is a :class:`DataError` with a message for the user.
    """
    with staged(files) as (kind, path):
        try:
            if kind == "DICOM":
                series = list_series(path)
                if not series:
                    raise DataError("the upload holds no DICOM image series")
                choices = [_choice(s) for s in series]
                if len(series) > 1 and series_uid is None:
                    return LoadResult(None, kind, choices)
                chosen = next((s for s in series if s.uid == series_uid), series[0])
                image = load_image(path, series_uid=chosen.uid)
                _check_volume(image)
                headers = None if image.meta.get("resampled") else _headers(chosen, int(image.shape[3]))
            else:
                choices, headers = [], None
                limits.check_nifti_file(path.name, path)  # counted before the reader inflates it
                image = load_image(path)
                _check_volume(image)
        except MedsegError as e:
            raise DataError(_tidy(str(e), path.parent if kind == "NIfTI" else path)) from None
        # the MetaTensor's file name points into the temporary folder, which is about to go
        image.meta["filename_or_obj"] = "upload"
        log.info("loaded %s upload, shape %s", kind, tuple(image.shape))
        return LoadResult(image, kind, choices, headers)


def _headers(series: SeriesInfo, n_slices: int) -> list[Dataset] | None:
    """The series' headers sorted along the slice normal, as the DICOM reader stacks the slices."""
    read = [read_header(p) for p in series.files]
    headers = [h for h in read if h is not None]
    if len(headers) != len(read) or len(headers) != n_slices:  # e.g. one multi-frame file: no DICOM-SEG
        return None
    iop = np.array([float(v) for v in headers[0].ImageOrientationPatient])
    normal = np.cross(iop[:3], iop[3:])
    headers.sort(key=lambda d: float(np.array([float(v) for v in d.ImagePositionPatient]) @ normal))
    return headers if len(headers) == n_slices else None


def _choice(s: SeriesInfo) -> SeriesChoice:
    return SeriesChoice(s.uid, s.description, s.modality, s.n_files)


# NIfTI data types NiiVue shows as stored: uint8, int16, int32, float32, float64, int8, uint16
VIEWER_DTYPES = frozenset({2, 4, 8, 16, 64, 256, 512})
SAME_MM = 1e-3  # sform and qform closer than this (at the volume's corners) are one geometry


@dataclass(frozen=True)
class ViewerNifti:
    """An uploaded NIfTI file that the viewport can show as it is, without reading the voxels here."""

    data: bytes  # the uploaded bytes (.nii or .nii.gz), unchanged
    name: str  # "scan.nii.gz" or "scan.nii": how NiiVue is told to read them
    affine: np.ndarray  # the affine medseg reads from the header (sform, else qform)
    shape: tuple[int, int, int]


def viewer_nifti(files: Sequence[UploadedBytes]) -> ViewerNifti | None:
    """The upload itself as the viewport's volume, when NiiVue will place its voxels exactly where
    medseg does; None otherwise (the page then sends the volume it has read, re-encoded).

    Only the header is read (for .nii.gz, the first 348 decompressed bytes; extensions are not
    read), so this takes milliseconds whatever the file's size: the scan can be painted before it is read here. The
    conditions are those under which the two readers agree: one single-file NIfTI-1 of a 3D image
    in a data type NiiVue keeps as stored, and the same affine. medseg takes the sform when its code
    is set, else the qform (:func:`medseg.datasets.checks.nifti_affine`); NiiVue 0.69 takes the
    qform when its code is above the sform's, else the sform. They differ only when
    0 < sform code < qform code, and then only if the two matrices place the corner voxels more than
    :data:`SAME_MM` apart. A header medseg would refuse is not previewed either: the full read
    reports it.
    """
    if len(files) != 1 or not files[0].name.lower().endswith(NIFTI_SUFFIXES):
        return None
    data = files[0].data
    gz = limits.is_gzip(data)
    try:
        import nibabel as nib

        hdr = nib.Nifti1Header(limits.head(data)[:348], check=False)
        shape = tuple(int(s) for s in hdr.get_data_shape())
        if hdr["magic"].item() != b"n+1" or len(shape) != 3 or min(shape) < 2:
            return None
        if int(hdr["datatype"]) not in VIEWER_DTYPES:
            return None
        sform, scode = hdr.get_sform(coded=True)
        qform, qcode = hdr.get_qform(coded=True)
    except Exception:  # noqa: BLE001 - not previewed; the full read says what is wrong
        return None
    if scode > 0:
        affine = np.asarray(sform, dtype=np.float64)
        if 0 < scode < qcode:
            corners = np.array(
                [
                    [i, j, k, 1]
                    for i in (0, shape[0] - 1)
                    for j in (0, shape[1] - 1)
                    for k in (0, shape[2] - 1)
                ]
            )
            if np.abs(corners @ (np.asarray(qform) - affine).T).max() > SAME_MM:
                return None
    elif qcode > 0:
        affine = np.asarray(qform, dtype=np.float64)
    else:
        return None
    if not np.all(np.isfinite(affine)) or abs(float(np.linalg.det(affine[:3, :3]))) < 1e-12:
        return None
    return ViewerNifti(data, "scan.nii.gz" if gz else "scan.nii", affine, shape)  # type: ignore[arg-type]


def holds_its_header_size(volume: ViewerNifti) -> bool:
    """Whether the upload, sent to the browser as it is, inflates there to no more than its header
    says (+ :data:`medseg.apps.limits.SLACK`): counted here, the bytes not kept, so that a gzip
    bomb reaches no browser either. False too for a volume the read will refuse for its size, and
    for one cut short (fewer bytes than its header describes), which the read refuses: a case that
    will not load is not painted over the one on show."""
    layout = limits.nifti_layout(limits.head(volume.data))
    if not volume.name.endswith(".gz"):  # complete: the read then takes it as the browser does
        return layout is not None and len(volume.data) >= layout.total
    if layout is None:
        return False
    try:
        checks.check_memory(layout.n_voxels, layout.itemsize, volume.name)
        got = limits.inflate(limits.pieces(volume.data), limits.nifti_limit(volume.name, layout))
    except (limits.Exceeded, DataError):
        return False
    return got.status == "complete"


PREVIEW_ABOVE = 16 * 2**20  # scans with more voxels are painted first from a preview
PREVIEW_VOXELS = 4 * 2**20  # at most this many voxels in the preview


def preview_above() -> int:
    """Scans with more voxels than this are painted first from a preview (``MEDSEG_APP_PREVIEW_ABOVE``,
    default 16 M; a browser with a GPU builds a full scan's textures fast enough to raise it)."""
    try:
        return max(int(os.environ.get("MEDSEG_APP_PREVIEW_ABOVE", PREVIEW_ABOVE)), 0)
    except ValueError:
        return PREVIEW_ABOVE


def preview_nifti(
    volume: ViewerNifti, above: int | None = None, max_voxels: int = PREVIEW_VOXELS
) -> tuple[ViewerNifti, int] | None:
    """A reduced-resolution copy of a large upload for the viewport's first paint, and its step.

    Every ``step``-th voxel along each axis (the smallest step that leaves at most ``max_voxels``),
    stored values and scaling unchanged, as uncompressed NIfTI-1 whose affine is the upload's times
    the step: preview voxel (i, j, k) is the upload's voxel (step·i, step·j, step·k), at the same
    world position, with the same value. The browser builds its textures per voxel, so a step of 2
    makes that work 8 times smaller, 3 27 times. None when the scan has at most ``above`` voxels
    and is sent as it is (default: :func:`preview_above`).
    """
    above = preview_above() if above is None else above

    def voxels(step: int) -> int:
        return int(np.prod([-(-s // step) for s in volume.shape]))

    if voxels(1) <= above:
        return None
    step = 2
    while voxels(step) > max_voxels:
        step += 1
    import nibabel as nib

    try:
        # inflated no further than the header's size allows (ISA-L's inflate, counted as it goes),
        # and only when the full read will not refuse the volume's size anyway
        layout = limits.nifti_layout(limits.head(volume.data))
        if layout is None:
            return None
        checks.check_memory(layout.n_voxels, layout.itemsize, volume.name)
        gz = volume.name.endswith(".gz")
        raw = limits.gunzip_nifti(volume.name, volume.data, layout) if gz else volume.data
        img = nib.Nifti1Image.from_bytes(bytes(raw[: layout.offset]))  # the header: no voxels copied
        stored = np.ndarray(  # the stored voxels where they lie in the bytes: only the preview is copied
            img.shape,
            dtype=img.dataobj.dtype,
            buffer=raw,
            offset=int(img.dataobj.offset),  # where nibabel reads them (a vox_offset of 0 means 352)
            order="F",
        )
        data = np.ascontiguousarray(stored[::step, ::step, ::step])
    except Exception:  # noqa: BLE001 - no preview; the full read says what is wrong
        return None
    affine = volume.affine @ np.diag([step, step, step, 1.0])
    # the upload's own header (data type, scaling, units) with the new shape and geometry; written
    # here rather than through nibabel's image writer, which would choose its own scaling
    hdr = img.header.copy()
    hdr.set_data_shape(data.shape)
    hdr.set_sform(affine, code=1)
    hdr.set_qform(affine, code=1)
    hdr["vox_offset"] = 352
    hdr.set_slope_inter(img.dataobj.slope, img.dataobj.inter)  # nibabel keeps them out of a read header
    block = hdr.binaryblock + b"\0" * 4 + data.astype(hdr.get_data_dtype()).tobytes(order="F")
    preview = ViewerNifti(block, "preview.nii", affine, tuple(int(s) for s in data.shape))  # type: ignore[arg-type]
    return preview, step


def read_path(path: str | Path) -> MetaTensor:
    """Load a demo case (a NIfTI file on this machine) the same way as an upload."""
    image = load_image(path)
    _check_volume(image)
    return image


def describe(image: MetaTensor, source: str) -> dict[str, str]:
    """Metadata for the panel: modality, shape, spacing, orientation. No identifiers, no file names."""
    import nibabel as nib

    affine = np.asarray(image.affine, dtype=np.float64)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    modality = str(image.meta.get("modality", "") or "")
    if not modality:
        modality = "not stored in NIfTI" if source == "NIfTI" else "not given"
    info = {
        "source": source,
        "modality": modality,
        "shape (voxels)": " × ".join(str(int(s)) for s in image.shape[1:]),
        "channels": str(int(image.shape[0])),
        "spacing (mm)": " × ".join(f"{s:.3g}" for s in spacing),
        "orientation": "".join(nib.aff2axcodes(affine)),
        "intensity range": f"{float(image.min()):.4g} … {float(image.max()):.4g}",
    }
    if source == "DICOM":
        info["slices"] = str(int(image.shape[3]))
        if image.meta.get("resampled"):
            info["note"] = "uneven slices resampled"
    return info


def safe_stem(name: str) -> str:
    """A name safe in a download's file name: letters, digits, dot, dash and underscore."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "case"


def case_name(names: Sequence[str]) -> str:
    """The case's name for downloads: the uploaded file's name without its suffix.

    Several DICOM files: their common prefix, else ``dicom-series``. Never shown in the page.
    """
    stems = []
    for name in names:
        base = Path(str(name).replace("\\", "/")).name
        for suffix in (".nii.gz", ".nii", ".zip", ".dcm", ".dicom"):
            if base.lower().endswith(suffix):
                base = base[: -len(suffix)]
                break
        stems.append(base)
    if len(stems) == 1:
        return safe_stem(stems[0])
    prefix = os.path.commonprefix(stems).rstrip("._- 0123456789")
    return safe_stem(prefix) if prefix else "dicom-series"

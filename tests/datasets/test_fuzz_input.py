"""Bad input never becomes a wrong result: generated bad NIfTI, DICOM, dataset, bundle and config cases.

Every case runs the real CLI in-process and must give exit status 2, exactly one ``error:`` line that
names the problem, no traceback, and leave every file that existed before byte for byte as it was (and
create none). The cases follow the rows of the table in README "Bad input".
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import yaml
from pydicom.uid import generate_uid

from medseg.cli.main import main
from medseg.datasets.decathlon import load_dataset, write_dataset_json
from medseg.datasets.dicom.write import write_dicom_series
from medseg.datasets.nifti import save_nifti
from medseg.datasets.synthetic import make_cls_dataset, make_seg_dataset

AFFINE = np.array([[-1.5, 0, 0, 40.0], [0, -1.5, 0, 30.0], [0, 0, 2.5, -20.0], [0, 0, 0, 1]])


@dataclass
class Ctx:
    tmp: Path
    seg: Path  # a small valid segmentation dataset (copy: may be changed)
    cls: Path  # a small valid classification dataset (copy)
    request: pytest.FixtureRequest

    @property
    def run(self) -> Path:
        """The tiny trained segmentation run (trained once per test session, only when a case needs it)."""
        return self.request.getfixturevalue("seg_run").run_dir


def _vol(shape: tuple[int, int, int] = (12, 10, 6), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-300, 300, size=shape).astype(np.int16)


def _nifti(path: Path, data: np.ndarray | None = None, affine: np.ndarray = AFFINE, **header: object) -> Path:
    """A NIfTI written byte by byte, so that its header can be broken: sform/qform (matrix, code), pixdim."""
    data = _vol() if data is None else np.asarray(data)
    hdr = nib.Nifti1Header()
    hdr.set_data_dtype(data.dtype)
    hdr.set_data_shape(data.shape)
    hdr.set_qform(header.get("qform", affine), code=int(header.get("qcode", 1)))
    hdr.set_sform(header.get("sform", affine), code=int(header.get("scode", 1)))
    if "pixdim" in header:
        hdr["pixdim"][1:4] = header["pixdim"]
    hdr["vox_offset"] = 352
    raw = hdr.binaryblock + b"\0" * 4 + data.tobytes(order="F")
    path.write_bytes(gzip.compress(raw, compresslevel=1) if path.name.endswith(".gz") else raw)
    return path


def _raw_header_nifti(path: Path, dims: tuple[int, ...], payload: bytes, dtype: type = np.int16) -> Path:
    """A .nii.gz whose header claims ``dims`` voxels but holds ``payload``: header bytes + data, gzipped."""
    hdr = nib.Nifti1Header()
    hdr.set_data_dtype(dtype)
    hdr.set_data_shape(dims)
    hdr.set_sform(AFFINE, code=1)
    hdr.set_qform(AFFINE, code=1)
    hdr["vox_offset"] = 352
    raw = hdr.binaryblock + b"\0" * 4 + payload
    path.write_bytes(gzip.compress(raw, compresslevel=1) if path.name.endswith(".gz") else raw)
    return path


def _series(folder: Path, n: int = 6, seed: int = 0) -> list[Path]:
    return write_dicom_series(_vol((10, 8, n), seed).astype(np.float32), AFFINE, folder)


def _edit(path: Path, fn: Callable[[pydicom.Dataset], None], dest: Path | None = None) -> None:
    ds = pydicom.dcmread(path)
    fn(ds)
    ds.save_as(dest or path, enforce_file_format=True)


def _set(**tags: object) -> Callable[[pydicom.Dataset], None]:
    def fn(ds: pydicom.Dataset) -> None:
        for k, v in tags.items():
            if v is None:
                del ds[k]
            else:
                setattr(ds, k, v)

    return fn


def _no_preamble(path: Path, dest: Path | None = None) -> None:
    """Rewrite a DICOM file the way many exports do: no 128-byte preamble, no file meta group."""
    ds = pydicom.dcmread(path)
    ds.preamble = None
    del ds.file_meta
    pydicom.dcmwrite(dest or path, ds, implicit_vr=True, little_endian=True, enforce_file_format=False)


def _config(ctx: Ctx, data: Path, **over: object) -> Path:
    cfg = {
        "name": "fuzz",
        "task": "segmentation",
        "runs_dir": str(ctx.tmp / "runs"),
        "data": {"dir": str(data), "val_fraction": 0.25},
        "transforms": {"spacing": [2.0, 2.0, 2.0], "patch": [16, 16, 16], "num_samples": 1},
        "model": {"name": "unet", "channels": [4, 8], "strides": [2], "num_res_units": 0},
        "train": {"epochs": 1, "batch_size": 2, "threads": 1},
    }
    cfg.update(over)
    path = ctx.tmp / "fuzz.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(ctx: Ctx, data: Path, **over: object) -> list[object]:
    return ["train", "--no-progress", "--config", _config(ctx, data, **over)]


def _label(ctx: Ctx, i: int = 0) -> Path:
    return Path(load_dataset(ctx.seg).training[i]["label"])


def _image(ctx: Ctx, i: int = 0) -> Path:
    return Path(load_dataset(ctx.seg).training[i]["image"])


def _rewrite(path: Path, data: np.ndarray | None = None, affine: np.ndarray | None = None) -> None:
    img = nib.load(path)
    save_nifti(
        np.asarray(img.dataobj) if data is None else data, img.affine if affine is None else affine, path
    )


def _edit_json(root: Path, fn: Callable[[dict], None]) -> None:
    raw = json.loads((root / "dataset.json").read_text())
    fn(raw)
    write_dataset_json(root, raw)


# ---------------------------------------------------------------------------------------- NIfTI
# Each builder returns (argv, a text the error must contain). "to-dicom" reads with the same
# load_image as infer, the viewer and evaluate, without needing a model.


def _to_dicom(src: Path, ctx: Ctx) -> list[object]:
    return ["data", "to-dicom", src, ctx.tmp / "dicom-out"]


def nii_singular_sform(ctx: Ctx):
    sform = AFFINE.copy()
    sform[:3, 1] = 0
    return _to_dicom(
        _nifti(ctx.tmp / "a.nii.gz", sform=sform, scode=2, qcode=0), ctx
    ), "sform (code 2) is singular"


def nii_nan_sform(ctx: Ctx):
    sform = AFFINE.copy()
    sform[0, 3] = np.nan
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", sform=sform, qcode=0), ctx), "singular or not finite"


def nii_no_geometry(ctx: Ctx):
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", scode=0, qcode=0), ctx), "neither an sform nor a qform"


def nii_zero_pixdim(ctx: Ctx):
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", scode=0, pixdim=[1.5, 0.0, 2.5]), ctx), "pixdim"


def nii_nan_pixdim(ctx: Ctx):
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", pixdim=[np.nan, 1.5, 2.5]), ctx), "pixdim"


def nii_qform_sform_flip(ctx: Ctx):
    q = np.diag([-1.0, 1.0, 1.0, 1.0]) @ AFFINE
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", qform=q), ctx), "disagree on the axis directions"


def nii_gzip_claims_too_much(ctx: Ctx):
    path = _raw_header_nifti(ctx.tmp / "bomb.nii.gz", (2048, 2048, 2048), b"\0" * 2**20)
    return _to_dicom(path, ctx), "more than a"


def nii_more_than_memory(ctx: Ctx):
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", np.zeros((64, 64, 64), np.int16)), ctx), "of memory"


def nii_truncated_uncompressed(ctx: Ctx):
    path = _nifti(ctx.tmp / "a.nii")
    path.write_bytes(path.read_bytes()[:-100])
    return _to_dicom(path, ctx), "truncated"


def nii_truncated_gzip(ctx: Ctx):
    path = _nifti(ctx.tmp / "a.nii.gz", _vol((40, 40, 20)))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return _to_dicom(path, ctx), "a.nii.gz"


def nii_not_nifti(ctx: Ctx):
    path = ctx.tmp / "a.nii.gz"
    path.write_bytes(gzip.compress(b"definitely not a NIfTI header" * 30))
    return _to_dicom(path, ctx), "cannot be read as NIfTI"


def nii_empty_file(ctx: Ctx):
    path = ctx.tmp / "a.nii"
    path.write_bytes(b"")
    return _to_dicom(path, ctx), "a.nii"


def nii_two_d(ctx: Ctx):
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", _vol()[:, :, 0]), ctx), "3D"


def nii_nan_voxel(ctx: Ctx):
    data = _vol().astype(np.float32)
    data[1, 2, 3] = np.nan
    return _to_dicom(_nifti(ctx.tmp / "a.nii.gz", data), ctx), "NaN"


def nii_symlink_loop(ctx: Ctx):
    link = ctx.tmp / "loop.nii.gz"
    os.symlink(link, link)
    return _to_dicom(link, ctx), "loops"


def nii_dangling_link(ctx: Ctx):
    link = ctx.tmp / "gone.nii.gz"
    os.symlink(ctx.tmp / "nothing-here.nii.gz", link)
    return _to_dicom(link, ctx), "does not exist"


def nii_wrong_suffix(ctx: Ctx):
    path = ctx.tmp / "scan.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n....")
    return _to_dicom(path, ctx), "not a NIfTI file"


def nii_negative_dim(ctx: Ctx):
    path = _raw_header_nifti(ctx.tmp / "a.nii", (4, 4, 4), b"\0" * 128)
    raw = bytearray(path.read_bytes())
    raw[42:44] = np.int16(-4).tobytes()  # dim[1]
    path.write_bytes(bytes(raw))
    return _to_dicom(path, ctx), "a.nii"


# -------------------------------------------------------------------------------- outputs, CLI


def out_infer_equals_input(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["infer", "--run", ctx.run, "--input", src, "--output", src], "is the input"


def out_infer_equals_input_other_spelling(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    other = ctx.tmp / "sub" / ".." / "scan.nii.gz"
    (ctx.tmp / "sub").mkdir()
    (ctx.tmp / "sub" / "keep").write_text("x")
    return ["infer", "--run", ctx.run, "--input", src, "--output", other], "is the input"


def out_infer_is_directory(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    (ctx.tmp / "outdir").mkdir()
    (ctx.tmp / "outdir" / "keep.txt").write_text("x")
    return ["infer", "--run", ctx.run, "--input", src, "--output", ctx.tmp / "outdir"], "existing folder"


def out_infer_inside_dicom_input(ctx: Ctx):
    _series(ctx.tmp / "series")
    out = ctx.tmp / "series" / "mask.nii.gz"
    return [
        "infer",
        "--run",
        ctx.run,
        "--input",
        ctx.tmp / "series",
        "--output",
        out,
    ], "inside the input folder"


def out_infer_parent_is_file(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    (ctx.tmp / "afile").write_text("x")
    return [
        "infer",
        "--run",
        ctx.run,
        "--input",
        src,
        "--output",
        ctx.tmp / "afile" / "m.nii.gz",
    ], "is a file"


def out_infer_bad_suffix(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["infer", "--run", ctx.run, "--input", src, "--output", ctx.tmp / "mask.png"], "NIfTI file name"


def out_to_dicom_onto_file(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    (ctx.tmp / "existing").write_text("keep me")
    return ["data", "to-dicom", src, ctx.tmp / "existing"], "existing file"


def out_to_dicom_onto_input(ctx: Ctx):
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["data", "to-dicom", src, src], "is the input"


def out_to_dicom_existing_series(ctx: Ctx):
    _series(ctx.tmp / "series")
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["data", "to-dicom", src, ctx.tmp / "series"], "already holds"


def out_convert_onto_dir(ctx: Ctx):
    _series(ctx.tmp / "series")
    (ctx.tmp / "out").mkdir()
    (ctx.tmp / "out" / "keep").write_text("x")
    return ["data", "convert", ctx.tmp / "series", ctx.tmp / "out"], "existing folder"


def out_convert_bad_suffix(ctx: Ctx):
    _series(ctx.tmp / "series")
    return ["data", "convert", ctx.tmp / "series", ctx.tmp / "out.dcm"], ".nii"


def out_convert_onto_input_file(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    target = ctx.tmp / "series" / "x.nii.gz"
    shutil.copy(files[0], target)  # a slice with a NIfTI name: writing there would destroy it
    return ["data", "convert", ctx.tmp / "series", target], "inside the input folder"


# ---------------------------------------------------------------------------------------- DICOM


def _convert(ctx: Ctx, *extra: object) -> list[object]:
    return ["data", "convert", ctx.tmp / "series", ctx.tmp / "out.nii.gz", *extra]


def dcm_one_slice_without_slope(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    for f in files:
        _edit(f, _set(RescaleSlope="2"))
    _edit(files[2], _set(RescaleSlope=None))
    return _convert(ctx), "has no RescaleSlope"


def dcm_slope_zero(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[1], _set(RescaleSlope="0"))
    return _convert(ctx), "RescaleSlope is"


def dcm_one_slice_without_intercept(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[3], _set(RescaleIntercept=None))
    return _convert(ctx), "has no RescaleIntercept"


def dcm_rows_differ(ctx: Ctx):
    files = _series(ctx.tmp / "series")

    def smaller(ds: pydicom.Dataset) -> None:
        ds.Rows = 4
        ds.PixelData = ds.PixelData[: 4 * ds.Columns * 2]

    _edit(files[2], smaller)
    return _convert(ctx), "Rows differs"


def dcm_orientation_differs(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[2], _set(ImageOrientationPatient=["0", "1", "0", "1", "0", "0"]))
    return _convert(ctx), "ImageOrientationPatient"


def dcm_pixel_spacing_differs(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[4], _set(PixelSpacing=["0.7", "0.7"]))
    return _convert(ctx), "PixelSpacing"


def dcm_frame_of_reference_differs(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[0], _set(FrameOfReferenceUID=generate_uid()))
    return _convert(ctx), "FrameOfReferenceUID differs"


def dcm_signedness_differs(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[1], _set(PixelRepresentation=0))
    return _convert(ctx), "PixelRepresentation differs"


def dcm_monochrome1_slice(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[1], _set(PhotometricInterpretation="MONOCHROME1"))
    return _convert(ctx), "PhotometricInterpretation differs"


def dcm_modality_differs(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[5], _set(Modality="MR"))
    return _convert(ctx), "Modality differs"


def dcm_duplicate_position(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[2], _set(SOPInstanceUID=generate_uid(), InstanceNumber=99), ctx.tmp / "series" / "copy.dcm")
    return _convert(ctx), "share the slice position"


def dcm_same_image_twice(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    shutil.copy(files[2], ctx.tmp / "series" / "copy.dcm")
    return _convert(ctx), "same image"


def dcm_duplicate_instance_number(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[4], _set(InstanceNumber=1))
    return _convert(ctx), "same InstanceNumber"


def dcm_two_echoes_one_uid(ctx: Ctx):
    files = _series(ctx.tmp / "series", n=4)
    uid = pydicom.dcmread(files[0]).SeriesInstanceUID
    more = write_dicom_series(
        _vol((10, 8, 4), 1).astype(np.float32), AFFINE, ctx.tmp / "series" / "b", series_uid=uid
    )
    for f in files:
        _edit(f, _set(EchoTime="10"))
    for f in more:
        _edit(f, _set(EchoTime="80", FrameOfReferenceUID=pydicom.dcmread(files[0]).FrameOfReferenceUID))
    return _convert(ctx), "acquisitions"


def dcm_interleaved_acquisitions(ctx: Ctx):
    files = _series(ctx.tmp / "series", n=4)
    first = pydicom.dcmread(files[0])
    shifted = AFFINE.copy()
    shifted[2, 3] += 1.25  # half a slice: merged, the two would look like one regular 1.25 mm stack
    more = write_dicom_series(
        _vol((10, 8, 4), 1).astype(np.float32),
        shifted,
        ctx.tmp / "series" / "b",
        series_uid=first.SeriesInstanceUID,
    )
    for f in more:
        _edit(f, _set(AcquisitionNumber=2, FrameOfReferenceUID=first.FrameOfReferenceUID))
    for i, f in enumerate(more):
        _edit(f, _set(InstanceNumber=10 + i))
    return _convert(ctx), "interleave or overlap"


def dcm_missing_middle_slice(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    files[3].unlink()
    return _convert(ctx), "missing slice"


def dcm_resample_with_unreadable_file(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    files[3].write_bytes(b"\x00" * 64 + b"a damaged slice that pydicom cannot parse")
    return _convert(ctx, "--resample"), "will not interpolate"


def dcm_uneven_spacing(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[5], lambda ds: setattr(ds, "ImagePositionPatient", [*ds.ImagePositionPatient[:2], "0.3"]))
    return _convert(ctx), "slice"


def dcm_multiframe(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[0], _set(NumberOfFrames=2))
    return _convert(ctx), "multi-frame"


def _enhanced(ctx: Ctx, n: int = 6) -> Path:
    """A Legacy Converted Enhanced CT file (highdicom) alone in ctx.tmp/series, from a written series."""
    from tests.enhanced import to_multiframe

    _series(ctx.tmp / "single", n=n)
    path = to_multiframe(ctx.tmp / "single", ctx.tmp / "series")
    shutil.rmtree(ctx.tmp / "single")
    return path


def _frames(
    fn: Callable[[list[pydicom.Dataset], pydicom.Dataset], None],
) -> Callable[[pydicom.Dataset], None]:
    """An edit of the per-frame functional groups (list of items) and the shared group of a multi-frame file."""
    return lambda ds: fn(list(ds.PerFrameFunctionalGroupsSequence), ds.SharedFunctionalGroupsSequence[0])


def _ipp(item: pydicom.Dataset) -> np.ndarray:
    return np.array([float(v) for v in item.PlanePositionSequence[0].ImagePositionPatient])


def dcm_mf_orientation_differs(ctx: Ctx):
    def turn_one_frame(frames: list[pydicom.Dataset], shared: pydicom.Dataset) -> None:
        orientation = shared.PlaneOrientationSequence
        del shared.PlaneOrientationSequence  # moved per frame, as scanners write a multi-planar file
        for i, item in enumerate(frames):
            item.PlaneOrientationSequence = pydicom.Sequence([pydicom.Dataset()])
            iop = [float(v) for v in orientation[0].ImageOrientationPatient]
            if i == 3:  # this frame turned 90 degrees about the column axis: row direction along z
                iop = [0.0, 0.0, 1.0, *iop[3:]]
            item.PlaneOrientationSequence[0].ImageOrientationPatient = iop

    _edit(_enhanced(ctx), _frames(turn_one_frame))
    return _convert(ctx), "frames of one volume share one orientation"


def dcm_mf_uneven_spacing(ctx: Ctx):
    def shift(frames: list[pydicom.Dataset], shared: pydicom.Dataset) -> None:
        item = frames[2].PlanePositionSequence[0]
        item.ImagePositionPatient = [
            *item.ImagePositionPatient[:2],
            float(item.ImagePositionPatient[2]) + 0.9,
        ]

    _edit(_enhanced(ctx), _frames(shift))
    return _convert(ctx), "uneven slice spacing"


def dcm_mf_two_stacks(ctx: Ctx):
    def two_stacks(frames: list[pydicom.Dataset], shared: pydicom.Dataset) -> None:
        for i, item in enumerate(frames):
            item.FrameContentSequence[0].StackID = "1" if i % 2 else "2"

    _edit(_enhanced(ctx), _frames(two_stacks))
    return _convert(ctx), "holds 2 stacks (StackID"


def dcm_mf_repeated_position(ctx: Ctx):
    def repeat(frames: list[pydicom.Dataset], shared: pydicom.Dataset) -> None:
        frames[4].PlanePositionSequence[0].ImagePositionPatient = list(_ipp(frames[1]))

    _edit(_enhanced(ctx), _frames(repeat))
    return _convert(ctx), "share the slice position"


def dcm_mf_tilted(ctx: Ctx):
    def tilt(frames: list[pydicom.Dataset], shared: pydicom.Dataset) -> None:
        for item in frames:  # a gantry tilt: each frame moves 0.3 mm in-plane per 2.5 mm along z
            ipp = _ipp(item)
            item.PlanePositionSequence[0].ImagePositionPatient = [ipp[0], ipp[1] + 0.12 * ipp[2], ipp[2]]

    _edit(_enhanced(ctx), _frames(tilt))
    return _convert(ctx), "off the slice normal"


def dcm_mf_frame_without_position(ctx: Ctx):
    _edit(_enhanced(ctx), _frames(lambda frames, shared: delattr(frames[3], "PlanePositionSequence")))
    return _convert(ctx), "frame 4 has no PlanePositionSequence"


def dcm_mf_unsupported_sop_class(ctx: Ctx):
    _edit(_enhanced(ctx), _set(SOPClassUID=pydicom.uid.EnhancedXAImageStorage))
    return _convert(ctx), "which medseg does not read"


def dcm_mf_beside_single_frames(ctx: Ctx):
    path = _enhanced(ctx)
    _edit(path, _set(SeriesInstanceUID="1.2.3.4.5"))
    _series(ctx.tmp / "series" / "more")
    for f in (ctx.tmp / "series" / "more").iterdir():
        _edit(f, _set(SeriesInstanceUID="1.2.3.4.5"))
    return _convert(ctx), "of them multi-frame"


def dcm_truncated(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    files[2].write_bytes(files[2].read_bytes()[:200])
    return _convert(ctx), str(files[2].name)


def dcm_no_dicom_files(ctx: Ctx):
    (ctx.tmp / "series").mkdir()
    (ctx.tmp / "series" / "notes.txt").write_text("hello")
    return _convert(ctx), "holds no DICOM files"


def dcm_two_series(ctx: Ctx):
    _series(ctx.tmp / "series" / "a")
    _series(ctx.tmp / "series" / "b", seed=1)
    return _convert(ctx), "--series"


def dcm_unknown_series_uid(ctx: Ctx):
    _series(ctx.tmp / "series")
    return _convert(ctx, "--series", "1.2.3.4"), "no series with UID"


def dcm_folder_symlink_loop(ctx: Ctx):
    os.symlink(ctx.tmp / "series", ctx.tmp / "series")
    return _convert(ctx), "loops"


def dcm_missing_position(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[2], _set(ImagePositionPatient=None))
    return _convert(ctx), "ImagePositionPatient"


def dcm_no_preamble_slope_missing(ctx: Ctx):
    files = _series(ctx.tmp / "series")
    _edit(files[0], _set(RescaleSlope=None))
    _no_preamble(files[0])  # the odd slice is found even without its preamble
    return _convert(ctx), "has no RescaleSlope"


# ------------------------------------------------------------------------------------- datasets


def ds_label_affine_differs(ctx: Ctx):
    label = _label(ctx)
    affine = nib.load(label).affine.copy()
    affine[0, 3] += 5.0
    _rewrite(label, affine=affine)
    return _train(ctx, ctx.seg), "label affine differs"


def ds_label_flipped(ctx: Ctx):
    label = _label(ctx, 1)
    img = nib.load(label)
    flipped = img.affine @ np.diag([-1.0, 1, 1, 1])
    _rewrite(label, affine=flipped)
    return _train(ctx, ctx.seg), "label affine differs"


def ds_fractional_labels(ctx: Ctx):
    label = _label(ctx)
    data = np.asarray(nib.load(label).dataobj).astype(np.float32)
    data[data > 0] = 0.6
    _rewrite(label, data=data)
    return _train(ctx, ctx.seg), "must be integers"


def ds_case_listed_twice(ctx: Ctx):
    _edit_json(ctx.seg, lambda raw: raw["training"].append(dict(raw["training"][0])))
    return _train(ctx, ctx.seg), "listed twice"


def ds_case_twice_through_link(ctx: Ctx):
    image, label = _image(ctx), _label(ctx)
    os.symlink(image, image.with_name("alias.nii.gz"))
    os.symlink(label, label.with_name("alias.nii.gz"))
    _edit_json(
        ctx.seg,
        lambda raw: raw["training"].append(
            {"image": "./imagesTr/alias.nii.gz", "label": "./labelsTr/alias.nii.gz"}
        ),
    )
    return _train(ctx, ctx.seg), "listed twice"


def ds_label_value_too_large(ctx: Ctx):
    label = _label(ctx)
    data = np.asarray(nib.load(label).dataobj).copy()
    data[0, 0, 0] = 7
    _rewrite(label, data=data)
    return _train(ctx, ctx.seg), "label values 7"


def ds_labels_not_consecutive(ctx: Ctx):
    _edit_json(ctx.seg, lambda raw: raw["labels"].update({"5": "extra"}))
    return _train(ctx, ctx.seg), "not 0.."


def ds_label_shape_differs(ctx: Ctx):
    label = _label(ctx)
    _rewrite(label, data=np.asarray(nib.load(label).dataobj)[:, :, :-1])
    return _train(ctx, ctx.seg), "label shape"


def ds_missing_label(ctx: Ctx):
    _label(ctx, 2).unlink()
    return _train(ctx, ctx.seg), "file not found"


def ds_image_without_geometry(ctx: Ctx):
    image = _image(ctx)
    img = nib.load(image)
    _nifti(image, np.asarray(img.dataobj), img.affine, scode=0, qcode=0)
    return _train(ctx, ctx.seg), "neither an sform nor a qform"


def ds_image_bomb_header(ctx: Ctx):
    _raw_header_nifti(_image(ctx), (4096, 4096, 1024), b"\0" * 2**16)
    return _train(ctx, ctx.seg), "more than a"


def ds_cls_label_not_a_class(ctx: Ctx):
    _edit_json(ctx.cls, lambda raw: raw["training"][0].update({"label": 9}))
    over = {"task": "classification", "model": {"name": "resnet", "depth": 10}}
    return _train(ctx, ctx.cls, **over), "class label 9"


def ds_cls_case_twice(ctx: Ctx):
    _edit_json(ctx.cls, lambda raw: raw["training"].append(dict(raw["training"][1])))
    over = {"task": "classification", "model": {"name": "resnet", "depth": 10}}
    return _train(ctx, ctx.cls, **over), "listed twice"


def ds_validate_duplicate(ctx: Ctx):
    _edit_json(ctx.seg, lambda raw: raw["training"].append(dict(raw["training"][0])))
    return ["data", "validate", ctx.seg], "problem(s) found"


def ds_validate_bomb(ctx: Ctx):
    _raw_header_nifti(_image(ctx), (4096, 4096, 1024), b"\0" * 2**16)
    return ["data", "validate", ctx.seg], "problem(s) found"


def ds_validate_label_flipped(ctx: Ctx):
    label = _label(ctx, 1)
    _rewrite(label, affine=nib.load(label).affine @ np.diag([-1.0, 1, 1, 1]))
    return ["data", "validate", ctx.seg], "problem(s) found"


def ev_label_affine_differs(ctx: Ctx):
    label = _label(ctx)
    affine = nib.load(label).affine.copy()
    affine[1, 3] += 3.0
    _rewrite(label, affine=affine)
    return ["evaluate", "--no-progress", "--run", ctx.run, "--data", ctx.seg], "label affine differs"


def ev_fractional_labels(ctx: Ctx):
    label = _label(ctx)
    data = np.asarray(nib.load(label).dataobj).astype(np.float32) * 0.5
    _rewrite(label, data=data)
    return ["evaluate", "--no-progress", "--run", ctx.run, "--data", ctx.seg], "must be integers"


def ev_case_twice(ctx: Ctx):
    _edit_json(ctx.seg, lambda raw: raw["training"].append(dict(raw["training"][0])))
    return ["evaluate", "--no-progress", "--run", ctx.run, "--data", ctx.seg], "listed twice"


def ev_label_value_too_large(ctx: Ctx):
    label = _label(ctx)
    data = np.asarray(nib.load(label).dataobj).copy()
    data[1, 1, 1] = 7
    _rewrite(label, data=data)
    return ["evaluate", "--no-progress", "--run", ctx.run, "--data", ctx.seg], "label values 7"


# ------------------------------------------------------------------------------ bundles, configs


def _bundle_copy(ctx: Ctx) -> Path:
    dest = ctx.tmp / "run"
    shutil.copytree(ctx.run / "bundle", dest / "bundle")
    return dest


def bundle_without_labels(ctx: Ctx):
    run = _bundle_copy(ctx)
    meta = run / "bundle" / "configs" / "metadata.json"
    raw = json.loads(meta.read_text())
    del raw["medseg_labels"]
    meta.write_text(json.dumps(raw))
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["infer", "--run", run, "--input", src, "--output", ctx.tmp / "m.nii.gz"], "medseg_labels"


def bundle_bad_json(ctx: Ctx):
    run = _bundle_copy(ctx)
    (run / "bundle" / "configs" / "metadata.json").write_text("{not json")
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["infer", "--run", run, "--input", src, "--output", ctx.tmp / "m.nii.gz"], "damaged"


def bundle_truncated_weights(ctx: Ctx):
    run = _bundle_copy(ctx)
    weights = run / "bundle" / "models" / "model.pt"
    weights.write_bytes(weights.read_bytes()[:100])
    src = _nifti(ctx.tmp / "scan.nii.gz")
    return ["infer", "--run", run, "--input", src, "--output", ctx.tmp / "m.nii.gz"], "damaged"


def cfg_binary(ctx: Ctx):
    path = ctx.tmp / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    return ["train", "--config", path], "UTF-8"


def cfg_is_folder(ctx: Ctx):
    (ctx.tmp / "c.yaml").mkdir()
    return ["train", "--config", ctx.tmp / "c.yaml"], "is a folder"


def cfg_invalid_yaml(ctx: Ctx):
    path = ctx.tmp / "c.yaml"
    path.write_text("name: [unclosed\n")
    return ["train", "--config", path], "not valid YAML"


def cfg_unknown_key(ctx: Ctx):
    return _train(ctx, ctx.seg, modle={"name": "unet"}), "modle"


def cfg_data_dir_missing(ctx: Ctx):
    return _train(ctx, ctx.tmp / "nowhere"), "nowhere"


def cfg_runs_dir_is_file(ctx: Ctx):
    (ctx.tmp / "runs-file").write_text("x")
    return _train(ctx, ctx.seg, runs_dir=str(ctx.tmp / "runs-file")), "is a file"


def cfg_task_mismatch(ctx: Ctx):
    return _train(ctx, ctx.cls), "classification"


CASES = {
    name: fn
    for name, fn in dict(globals()).items()
    if callable(fn) and name.split("_")[0] in ("nii", "out", "dcm", "ds", "ev", "bundle", "cfg")
}


def test_suite_size() -> None:
    assert len(CASES) >= 60


@pytest.fixture(scope="module")
def base_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fuzz-data")
    seg = make_seg_dataset(root / "seg", n_train=4, n_test=0, seed=5, size=24)
    cls = make_cls_dataset(root / "cls", n_train=6, n_test=0, seed=5, size=16)
    return seg, cls


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink() and not p.exists():
            out[str(p)] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused(
    name: str,
    base_data: tuple[Path, Path],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys,
    monkeypatch,
) -> None:
    monkeypatch.delenv("MEDSEG_MAX_IMAGE_MB", raising=False)
    ctx = Ctx(tmp_path, tmp_path / "seg", tmp_path / "cls", request)
    shutil.copytree(base_data[0], ctx.seg)
    shutil.copytree(base_data[1], ctx.cls)
    argv, expect = CASES[name](ctx)
    if name == "nii_more_than_memory":
        monkeypatch.setenv("MEDSEG_MAX_IMAGE_MB", "1")
    before = _snapshot(tmp_path)
    run_before = _snapshot(ctx.run) if name.startswith("ev_") else None
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert expect in err, err
    assert _snapshot(tmp_path) == before, "a refused command changed or created files"
    assert not (tmp_path / "runs" / "fuzz").exists(), "a failed train left a run folder"
    if run_before is not None:
        assert _snapshot(ctx.run) == run_before

"""What an uploaded file is, by its first bytes (apps/messages.py ``sniff``), and the messages an
upload the viewer cannot read gets (apps/upload.py ``read_upload``): a PNG renamed ``.nii.gz`` is
reported as a PNG image, a file cut short in plain words, and a NIfTI file under the wrong name is
read for what it is.

The scans are real: TotalSegmentator's example CT (``../shared/data/totalseg-examples``), a
picture rendered from one of its slices, and a DICOM series written from it.
"""

from __future__ import annotations

import gzip
import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medseg.apps.messages import problem, sniff
from medseg.apps.upload import UploadedBytes, read_upload
from medseg.datasets.dicom.write import write_dicom_series
from medseg.errors import DataError
from medseg.inference.io import load_image

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
CT = SHARED / "totalseg-examples" / "example_ct_sm.nii.gz"
needs_ct = pytest.mark.skipif(not CT.is_file(), reason=f"{CT} is not on this machine (shared real data)")


def message(name: str, data: bytes) -> str:
    """The page's message for an upload of one file that cannot be read."""
    with pytest.raises(DataError) as err:
        read_upload([UploadedBytes(name, data)])
    return problem(err.value)


def picture(fmt: str) -> bytes:
    """A real picture of the CT's middle axial slice, as a screenshot tool would save it."""
    data = load_image(CT)[0].numpy()
    slice_ = np.clip((data[:, :, data.shape[2] // 2] + 160) / 400 * 255, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(slice_.T).save(buf, format=fmt)
    return buf.getvalue()


@needs_ct
@pytest.mark.parametrize(
    "fmt, what", [("PNG", "a PNG image"), ("JPEG", "a JPEG image"), ("TIFF", "a TIFF image")]
)
def test_a_picture_named_nii_gz_is_reported_as_the_picture_it_is(fmt: str, what: str) -> None:
    data = picture(fmt)
    assert sniff(data).what == what
    text = message("scan.nii.gz", data)
    assert text.startswith(f"scan.nii.gz is {what}, not a NIfTI image"), text
    assert "Export the scan itself as NIfTI or DICOM" in text and "(.nii, .nii.gz)" in text, text
    for jargon in ("gzip", "ImageFileError", "Error", "Traceback"):
        assert jargon not in text, text


@needs_ct
def test_a_nifti_cut_short_is_said_in_plain_words() -> None:
    whole = CT.read_bytes()
    text = message("scan.nii.gz", whole[: len(whole) // 2])
    assert text.startswith("scan.nii.gz is cut short: its compressed data stops after"), text
    assert "its header describes" in text and "upload the complete file" in text, text
    assert "EOFError" not in text and "end-of-stream" not in text, text
    # cut inside the header: too little left to tell what it was
    text = message("scan.nii.gz", whole[:100])
    assert "cut short" in text and "Cannot work out" not in text, text
    # an uncompressed one cut short
    text = message("scan.nii", gzip.decompress(whole)[:5000])
    assert "truncated" in text and "copy or export it again" in text, text


@needs_ct
def test_a_nifti_under_the_wrong_name_is_read_for_what_it_is() -> None:
    want = load_image(CT)
    whole = CT.read_bytes()
    for name, data in (("scan.nii", whole), ("scan", whole), ("scan.nii.gz", gzip.decompress(whole))):
        got = read_upload([UploadedBytes(name, data)]).image
        assert tuple(got.shape) == tuple(want.shape), name
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@needs_ct
def test_dicom_and_other_files_in_a_series_upload(tmp_path: Path) -> None:
    image = load_image(CT)
    folder = tmp_path / "ct"
    write_dicom_series(
        image[0].numpy(), image.affine.numpy(), folder, patient_id="X", series_description="ct"
    )
    files = [UploadedBytes(p.name, p.read_bytes()) for p in sorted(folder.iterdir())]
    assert sniff(files[0].data).what == "a DICOM file"
    with_png = [*files[:3], UploadedBytes("shot.png", picture("PNG")), *files[3:]]
    with pytest.raises(DataError) as err:
        read_upload(with_png)
    assert str(err.value).startswith("shot.png is a PNG image, not a DICOM file"), err.value
    cut = list(files)
    cut[4] = UploadedBytes(files[4].name, files[4].data[: len(files[4].data) // 2])
    with pytest.raises(DataError) as err:
        read_upload(cut)
    text = problem(err.value)
    assert text.startswith(f"{files[4].name} is cut short: it holds"), text
    assert "pixel data" in text and "The number of bytes" not in text and "00004-" not in text, text
    # a zip of pictures says what it holds
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("shots/a.png", picture("PNG"))
        zf.writestr("shots/b.png", picture("PNG"))
        zf.writestr("shots/notes.txt", "window 40/400")
    text = message("study.zip", buf.getvalue())
    assert "holds no DICOM files and no NIfTI file (it holds PNG image × 2, text file × 1)" in text, text


def test_magic_numbers_of_other_formats() -> None:
    kinds = {
        b"NRRD0004\ntype: short\ndimension: 3\n": "an NRRD volume",
        b"ObjectType = Image\nNDims = 3\n": "a MetaImage file (.mha, .mhd)",
        b"<!DOCTYPE html><html><body>Sign in</body></html>": "a web page (HTML)",
        b"\x89HDF\r\n\x1a\n" + bytes(600): "an HDF5 file (.h5, .mnc)",
        b"\x93NUMPY\x01\x00" + bytes(100): "a NumPy array (.npy)",
        b"PK\x03\x04" + bytes(100): "a zip archive",
        b"": "an empty file (0 bytes)",
    }
    for data, what in kinds.items():
        assert sniff(data).what == what, data[:12]
    assert sniff(gzip.compress(b"NRRD0004\n" + bytes(600))).what == "a gzip-compressed NRRD volume"
    assert sniff(bytes(128) + b"DICM" + bytes(400)).readable == "dicom"
    assert sniff(bytes(1000)[:50]).cut_short  # a DICOM file cut inside its zero preamble

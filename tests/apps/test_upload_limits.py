"""The viewer's limits (issue 28, items 5 and 6): no upload is decompressed without a bound, the
"Another model folder" box opens only folders inside the runs folders, and ``medseg app`` binds
127.0.0.1 unless told otherwise.

The gzip bombs are real: 10 GiB of zeros in about 10 MB, behind a valid NIfTI header (claiming a
small, a preview-sized or a 10 GiB image) or a deflated DICOM file meta. They are uploaded through
the page (``streamlit.testing`` AppTest, which runs the page in this process) while this process's
peak resident memory is watched: the high-water mark (``VmHWM``) is reset before each upload
(``/proc/self/clear_refs``) and must stay within 1 GiB of the resident size before it.
"""

from __future__ import annotations

import gc
import gzip
import io
import shutil
import struct
import time
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from pydicom.dataset import FileMetaDataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_file_meta_info

from medseg.apps import launch, limits, review, upload
from medseg.apps.registry import allowed_folder
from medseg.cli.main import main
from medseg.datasets.decathlon import load_dataset
from medseg.datasets.dicom.write import write_dicom_series
from medseg.errors import DataError
from medseg.inference.io import load_image
from tests.apps.test_app import errors, new_app, page_text, run_model, upload_files

BOMB_BYTES = 10 * 2**30  # what each bomb inflates to
BLOCK = 64 * 2**20  # zeros compressed once, with a full flush, and repeated
GIB = 2**30
GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
AFFINE = np.diag([0.8, 0.8, 2.5, 1.0])


# --- building bombs without holding 10 GiB --------------------------------------------------------


def write_zeros(out: Path, n: int, gzip_member: bool = True) -> Path:
    """``n`` zero bytes deflated into ``out``, streamed: one 64 MiB block of zeros is compressed once
    with a full flush (so it refers to nothing before it) and written n / 64 MiB times, then the final
    block; as a gzip member (with the CRC-32 and size of the zeros) or a raw deflate stream."""
    assert n % BLOCK == 0
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(BLOCK)
    block = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    with open(out, "wb") as f:
        if gzip_member:
            f.write(GZIP_HEADER)
        for _ in range(n // BLOCK):
            f.write(block)
            if gzip_member:
                crc = zlib.crc32(zeros, crc)
        f.write(comp.flush())
        if gzip_member:
            f.write(struct.pack("<II", crc, n & 0xFFFFFFFF))
    return out


@pytest.fixture(scope="module")
def zeros(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """10 GiB of zeros as a gzip member and as a raw deflate stream (about 10 MB each)."""
    folder = tmp_path_factory.mktemp("bombs")
    return {
        "gzip": write_zeros(folder / "zeros.gz", BOMB_BYTES).read_bytes(),
        "raw": write_zeros(folder / "zeros.deflate", BOMB_BYTES, gzip_member=False).read_bytes(),
    }


def nifti_header(shape: tuple[int, ...], dtype=np.uint8) -> bytes:
    """A valid single-file NIfTI-1 header (voxels from byte 352) with a geometry medseg accepts."""
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(dtype)
    hdr.set_sform(AFFINE, code=1)
    hdr.set_qform(AFFINE, code=1)
    hdr["vox_offset"] = 352
    return hdr.binaryblock + b"\0" * 4


def nifti_bomb(zeros: dict[str, bytes], shape: tuple[int, ...], dtype=np.uint8) -> bytes:
    """The header as one gzip member, 10 GiB of zeros as the next: one .nii.gz stream to every reader."""
    return gzip.compress(nifti_header(shape, dtype)) + zeros["gzip"]


def dicom_meta(syntax: str = pydicom.uid.DeflatedExplicitVRLittleEndian) -> bytes:
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = pydicom.uid.CTImageStorage
    meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    meta.TransferSyntaxUID = syntax
    fp = DicomBytesIO()
    fp.write(b"\0" * 128 + b"DICM")
    write_file_meta_info(fp, meta)
    return fp.getvalue()


# --- memory ---------------------------------------------------------------------------------------


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@contextmanager
def peak_growth():
    """How far this process's resident memory rose above its size at the start (bytes), and the time."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from now
    idle, start, box = _status("VmRSS"), time.perf_counter(), {}
    yield box
    box["growth"] = _status("VmHWM") - idle
    box["seconds"] = time.perf_counter() - start


def assert_refused(at, words: list[str]) -> str:
    """The upload was refused with ``words`` in its message, and the case read before it stays on
    show (its image drawn, nothing replaced)."""
    assert not at.exception, at.exception
    (message,) = errors(at)
    for w in words:
        assert w in message, message
    assert "Traceback" not in message and "/tmp/medseg-upload" not in message, message
    assert at.image and "Nothing was replaced: the case on show is still scan." in message, message
    return message


# --- the bombs through the page --------------------------------------------------------------------


@pytest.fixture(scope="module")
def seg_case(seg_data: Path) -> Path:
    return Path(load_dataset(seg_data).test[0]["image"])


def test_the_write_zeros_bomb_is_a_valid_stream(tmp_path: Path) -> None:
    small = write_zeros(tmp_path / "z.gz", 2 * BLOCK).read_bytes()
    assert gzip.decompress(gzip.compress(b"head") + small) == b"head" + bytes(2 * BLOCK)
    raw = write_zeros(tmp_path / "z.deflate", BLOCK, gzip_member=False).read_bytes()
    assert zlib.decompress(raw, -15) == bytes(BLOCK)


def test_gzip_bombs_are_refused_in_the_page_without_memory_growth(
    app_runs, seg_case, zeros, monkeypatch, capsys
) -> None:
    """10 GiB of zeros behind a header claiming 512 × 512 × 128 uint8 (large enough for the preview
    path too), 64³ int16 (the read path only) and 2048 × 2048 × 2560 uint8 (= the 10 GiB, over the
    cap), and in a deflated DICOM file: each is refused with a message naming the file and the limit,
    memory stays within 1 GiB of where it was, and the page keeps working."""
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("scan.nii.gz", seg_case.read_bytes())])  # the page warmed up on a good upload
    assert not errors(at) and at.image
    cases = [
        ("preview.nii.gz", nifti_bomb(zeros, (512, 512, 128)), ["33 MiB", "512 × 512 × 128 voxels"]),
        ("small.nii.gz", nifti_bomb(zeros, (64, 64, 64), np.int16), ["1.5 MiB", "64 × 64 × 64 voxels"]),
        ("huge.nii.gz", nifti_bomb(zeros, (2048, 2048, 2560)), ["10.0 GiB", "not decompressed"]),
        ("deflated.dcm", dicom_meta() + zeros["raw"], ["a deflated DICOM file", "inflates to more than"]),
    ]
    report = []
    for name, data, words in cases:
        assert len(data) < 12 * 2**20  # about 10 MB sent
        with peak_growth() as mem:
            upload_files(at, [(name, data)])
        report.append(
            f"{name}: {len(data) / 2**20:.1f} MB sent, peak +{max(mem['growth'], 0) / 2**20:.0f} MiB, {mem['seconds']:.2f} s"
        )
        assert mem["growth"] < GIB, (name, mem, errors(at))
        message = assert_refused(at, [f"{name}:", *words])
        report[-1] += f": {message}"
    with capsys.disabled():
        print("\n" + "\n".join(report))
    upload_files(at, [("scan.nii.gz", seg_case.read_bytes())])  # and still reads a good upload
    assert not errors(at) and at.image


def test_a_mask_bomb_is_refused_in_the_compare_panel(app_runs, seg_case, zeros, monkeypatch, capsys) -> None:
    at = new_app(app_runs, monkeypatch)
    upload_files(at, [("scan.nii.gz", seg_case.read_bytes())])
    run_model(at)
    assert not errors(at), errors(at)
    at.radio(key="compare").set_value("A mask file").run()
    shape = tuple(int(s) for s in nib.load(seg_case).shape)
    report = []
    for name, data, words in [
        ("mask.nii.gz", nifti_bomb(zeros, shape), ["mask.nii.gz", "decompresses to more than", "gzip bomb"]),
        ("other.nii.gz", nifti_bomb(zeros, (512, 512, 128)), ["other.nii.gz does not fit this scan"]),
    ]:
        uploader = next(u for u in at.file_uploader if u.key.startswith("mask_upload_"))
        with peak_growth() as mem:
            uploader.set_value([(name, data, "application/gzip")])
            at.run()
        assert not at.exception, at.exception
        (message,) = errors(at)
        assert all(w in message for w in words), message
        assert mem["growth"] < GIB, (name, mem)
        report.append(f"{name}: peak +{max(mem['growth'], 0) / 2**20:.0f} MiB, {mem['seconds']:.2f} s")
    with capsys.disabled():
        print("\n" + "\n".join(report))
    assert "Dice" not in page_text(at)


# --- the bound, function by function ------------------------------------------------------------------


def small_bomb(shape=(32, 32, 16), extra: int = 8 * 2**20) -> bytes:
    """A header, its voxels, then ``extra`` zero bytes more: an honest header, a dishonest stream."""
    return gzip.compress(nifti_header(shape) + bytes(int(np.prod(shape)) + extra))


def test_the_count_stops_at_the_headers_size_plus_slack() -> None:
    shape = (32, 32, 16)
    layout = limits.nifti_layout(limits.head(small_bomb(shape)))
    assert layout is not None and layout.total == 352 + 32 * 32 * 16
    assert limits.nifti_limit("x.nii.gz", layout) == layout.total + limits.SLACK
    ok = gzip.compress(nifti_header(shape) + bytes(int(np.prod(shape)) + limits.SLACK))  # within the slack
    assert len(limits.gunzip_nifti("ok.nii.gz", ok, layout)) == layout.total + limits.SLACK
    with pytest.raises(limits.Exceeded) as over:
        limits.inflate(limits.pieces(small_bomb(shape)), layout.total + limits.SLACK)
    assert over.value.count <= layout.total + limits.SLACK + limits.STEP  # stopped within one step
    with pytest.raises(
        DataError, match=r"x.nii.gz: decompresses to more than 1.0 MiB.*32 × 32 × 16 voxels of uint8"
    ):
        limits.gunzip_nifti("x.nii.gz", small_bomb(shape), layout)


def test_every_read_path_refuses_a_small_bomb(tmp_path: Path) -> None:
    data = small_bomb()
    with pytest.raises(DataError, match="bomb.nii.gz: decompresses to more than"):
        upload.read_upload([upload.UploadedBytes("bomb.nii.gz", data)])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:  # a .nii.gz inside a zip: the same count
        zf.writestr("case/inner.nii.gz", data)
    with pytest.raises(DataError, match="inner.nii.gz: decompresses to more than"):
        upload.read_upload([upload.UploadedBytes("case.zip", buf.getvalue())])
    with pytest.raises(DataError, match="mask.nii.gz: decompresses to more than"):
        review.read_mask("mask.nii.gz", data, (32, 32, 16), AFFINE)
    big = gzip.compress(nifti_header((256, 256, 320)) + bytes(256 * 256 * 320 + 8 * 2**20))
    direct = upload.viewer_nifti([upload.UploadedBytes("big.nii.gz", big)])
    assert direct is not None and direct.shape == (256, 256, 320)  # the header alone is fine
    assert upload.preview_nifti(direct, above=100) is None  # no preview: its inflate stopped
    assert not upload.holds_its_header_size(direct)  # and the upload itself goes to no browser
    small = upload.viewer_nifti([upload.UploadedBytes("bomb.nii.gz", data)])
    assert small is not None and not upload.holds_its_header_size(small)


def test_a_zip_member_inflates_no_further_than_it_declares(tmp_path: Path) -> None:
    """A zip member that declares 1 KiB and holds 64 MiB of zeros: 1 KiB is extracted (zipfile stops
    at the declared size; the declared sizes are what the upload limit is checked against)."""
    deflated = write_zeros(tmp_path / "z.deflate", BLOCK, gzip_member=False).read_bytes()
    name, crc = b"a.dcm", zlib.crc32(bytes(1024))
    local = struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(deflated), 1024, len(name), 0)
    central = struct.pack(
        "<4s6H3I5H2I",
        b"PK\x01\x02",
        20,
        20,
        0,
        8,
        0,
        0,
        crc,
        len(deflated),
        1024,
        len(name),
        0,
        0,
        0,
        0,
        0,
        0,
    )
    end = struct.pack(
        "<4s4H2IH", b"PK\x05\x06", 0, 0, 1, 1, len(central + name), len(local + name + deflated), 0
    )
    data = local + name + deflated + central + name + end
    (got,) = upload._extract_zip(data, tmp_path / "out", limit=2**20)
    assert got.stat().st_size == 1024


def test_a_header_over_the_cap_is_refused_before_inflating(monkeypatch) -> None:
    monkeypatch.setenv("MEDSEG_APP_MAX_UPLOAD_MB", "4")  # cap: 8 x 4 MB = 32 MiB
    data = gzip.compress(nifti_header((512, 512, 160)))  # claims 40 MiB and holds none of it
    with pytest.raises(
        DataError, match=r"big.nii.gz: its header describes 512 × 512 × 160 voxels of uint8, 40 MiB"
    ) as err:
        upload.read_upload([upload.UploadedBytes("big.nii.gz", data)])
    assert "8 × the 4 MB upload limit" in str(err.value)
    monkeypatch.setenv("MEDSEG_MAX_IMAGE_MB", "16")  # less memory than that: memory is the cap
    assert "the 16 MiB of memory available" in limits.decompressed_cap().reason


def test_a_mask_of_another_shape_is_refused_from_its_header() -> None:
    data = small_bomb((32, 32, 16), extra=64 * 2**20)
    started = time.perf_counter()
    with pytest.raises(DataError, match=r"m.nii.gz does not fit this scan: it has 32 × 32 × 16 voxels"):
        review.read_mask("m.nii.gz", data, (32, 32, 17), AFFINE)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(DataError, match="is not a NIfTI file"):  # no header: not inflated at all
        review.read_mask("junk.nii.gz", gzip.compress(b"junk" * 1000), (32, 32, 16), AFFINE)


def test_honest_files_read_as_before(tmp_path: Path) -> None:
    """Multi-member gzip (bgzip, pigz -i), zero padding after the last member and a 4D mask with one
    volume: read as before. A damaged CRC is refused in plain words."""
    vol = np.random.default_rng(1).integers(-1000, 1000, (40, 30, 20)).astype(np.int16)
    img = nib.Nifti1Image(vol, AFFINE)
    img.header.set_sform(AFFINE, code=1)
    img.header.set_qform(AFFINE, code=1)
    raw = img.to_bytes()
    members = b"".join(gzip.compress(raw[i : i + 7000]) for i in range(0, len(raw), 7000)) + b"\0" * 64
    assert gzip.decompress(members) == raw
    got = upload.read_upload([upload.UploadedBytes("multi.nii.gz", members)])
    np.testing.assert_array_equal(got.image[0].numpy(), vol.astype(np.float32))
    direct = upload.viewer_nifti([upload.UploadedBytes("multi.nii.gz", members)])
    assert upload.holds_its_header_size(direct)  # sent to the browser as it is
    preview, step = upload.preview_nifti(direct, above=100, max_voxels=20 * 15 * 10)
    assert step == 2 and preview.shape == (20, 15, 10)
    np.testing.assert_array_equal(
        np.asanyarray(nib.Nifti1Image.from_bytes(preview.data).dataobj), vol[::2, ::2, ::2]
    )
    label = np.zeros((40, 30, 20, 1), np.uint8)
    label[3, 4, 5] = 2
    mask = gzip.compress(nib.Nifti1Image(label, AFFINE).to_bytes())
    np.testing.assert_array_equal(review.read_mask("m.nii.gz", mask, (40, 30, 20), AFFINE), label[..., 0])

    bad = bytearray(gzip.compress(raw))
    bad[-8] ^= 0xFF  # the CRC-32
    with pytest.raises(
        DataError, match=r"bad.nii.gz is not a readable .nii.gz file \(the compression is damaged\)"
    ):
        upload.read_upload([upload.UploadedBytes("bad.nii.gz", bytes(bad))])
    with pytest.raises(DataError, match="the compression is damaged"):
        review.read_mask("bad.nii.gz", bytes(bad), (40, 30, 20), AFFINE)


def test_deflated_dicom_reads_and_a_deflated_bomb_does_not(seg_case, tmp_path: Path, monkeypatch) -> None:
    image = load_image(seg_case)
    folder = tmp_path / "series"
    write_dicom_series(image[0].numpy(), image.affine.numpy(), folder, series_description="CT")
    plain, deflated = [], []
    for p in sorted(folder.iterdir()):
        plain.append(upload.UploadedBytes(p.name, p.read_bytes()))
        ds = pydicom.dcmread(p)
        ds.file_meta.TransferSyntaxUID = pydicom.uid.DeflatedExplicitVRLittleEndian
        buf = io.BytesIO()
        ds.save_as(buf, enforce_file_format=True)
        deflated.append(upload.UploadedBytes(p.name, buf.getvalue()))
    assert limits.dicom_meta_end(deflated[0].data)[0] == pydicom.uid.DeflatedExplicitVRLittleEndian
    assert limits.check_dicom("one.dcm", deflated[0].data, 2**30) > len(deflated[0].data)
    got, want = upload.read_upload(deflated), upload.read_upload(plain)
    np.testing.assert_array_equal(got.image[0].numpy(), want.image[0].numpy())  # read as before

    monkeypatch.setenv("MEDSEG_MAX_IMAGE_MB", "8")  # 8 MiB of memory: the cap for the whole upload
    big = dicom_meta() + zlib.compress(bytes(16 * 2**20))[2:-4]  # raw deflate, 16 MiB of zeros
    with pytest.raises(DataError, match=r"big.dcm: a deflated DICOM file that inflates to more than 8.0 MiB"):
        upload.read_upload([upload.UploadedBytes("big.dcm", big)])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("series/big.dcm", big)
    with pytest.raises(DataError, match="big.dcm: a deflated DICOM file"):
        upload.read_upload([upload.UploadedBytes("series.zip", buf.getvalue())])
    plain = dicom_meta(pydicom.uid.ExplicitVRLittleEndian) + bytes(64)
    assert limits.check_dicom("plain.dcm", plain, 0) == 0  # other transfer syntaxes: not inflated here


# --- the model folder box ----------------------------------------------------------------------------


@pytest.fixture
def nested_runs(seg_run, tmp_path: Path) -> dict[str, Path]:
    """A runs folder whose only model lies two levels down (so the default listing does not show it),
    a bundle outside it, and a symlink inside it pointing outside."""
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    shutil.copytree(seg_run.run_dir / "bundle", root / "group" / "inner" / "bundle")
    shutil.copytree(seg_run.run_dir / "bundle", outside / "evil" / "bundle")
    (root / "link").symlink_to(outside, target_is_directory=True)
    return {"root": root, "outside": outside}


def test_allowed_folder_resolves_symlinks_and_dotdot(nested_runs) -> None:
    root, outside = nested_runs["root"], nested_runs["outside"]
    assert allowed_folder("group", [root]) == (root / "group").resolve()
    assert allowed_folder(str(root / "group" / "inner"), [root]) == (root / "group" / "inner").resolve()
    assert allowed_folder(str(root / "group" / ".." / "group"), [root]) == (root / "group").resolve()
    for typed in (
        str(outside),
        "link",
        str(root / "link" / "evil"),
        "group/../../elsewhere",
        "/",
        "/etc",
        "..",
        "",
        "a\0b",
    ):
        with pytest.raises(DataError, match="not inside the model folders"):
            allowed_folder(typed, [root])


def test_model_folder_box_opens_only_folders_inside_the_runs_folders(nested_runs, monkeypatch) -> None:
    root, outside = nested_runs["root"], nested_runs["outside"]
    at = new_app(root, monkeypatch, model=None)
    assert any("No trained models" in m for m in errors(at))
    for typed in (str(outside / "evil"), str(root / "link"), str(root / ".." / "elsewhere"), "link/evil"):
        at.text_input(key="extra_folder").set_value(typed).run()
        assert not at.exception
        warned = [str(w.value) for w in at.sidebar.warning]
        assert any("not inside the model folders" in w for w in warned), (typed, warned)
        assert not at.selectbox and any("No trained models" in m for m in errors(at)), typed
    at.text_input(key="extra_folder").set_value("group").run()
    assert not at.exception and not at.sidebar.warning
    choice = at.selectbox(key="model")
    assert choice.options == ["tiny-seg (segmentation)"]
    assert choice.value == str((root / "group" / "inner" / "bundle").resolve())


# --- the address -----------------------------------------------------------------------------------


def test_the_viewer_binds_loopback_unless_told(tmp_path: Path, monkeypatch) -> None:
    cmd = launch.streamlit_command(8501)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.enableXsrfProtection") + 1] == "true"
    assert cmd[cmd.index("--server.enableCORS") + 1] == "true"
    assert cmd[cmd.index("--server.maxUploadSize") + 1] == str(limits.max_upload_mb())
    seen = []
    monkeypatch.setattr(launch, "serve", lambda runs, port, address: seen.append((port, address)))
    assert main(["app", "--runs", str(tmp_path), "--port", "9"]) == 0
    assert main(["app", "--runs", str(tmp_path), "--port", "9", "--address", "0.0.0.0"]) == 0
    assert seen == [(9, "127.0.0.1"), (9, "0.0.0.0")]

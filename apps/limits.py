"""The viewer's limits on an upload: its size as sent, and its size once decompressed.

A gzip stream inflates up to about 1032 times: a 10 MB ``.nii.gz`` can hold 10 GB of zeros behind a
valid header, and a deflated DICOM file the same. Nothing the viewer receives is inflated without
a bound, and the bound is checked while inflating, not after:

- **The header first.** A NIfTI file's first 348 (NIfTI-1) or 540 (NIfTI-2) bytes say how many
  bytes the whole file holds once decompressed: the data offset (``vox_offset``, at least the
  header's own size + 4) plus voxels × bytes per voxel. Only those first bytes are inflated to read
  it.
- **The cap.** A header that asks for more than :func:`decompressed_cap` (:data:`EXPANSION` × the
  upload limit, and never more than :func:`medseg.sysinfo.available_memory`) is refused before a
  voxel is inflated.
- **The count.** The stream is then inflated in steps of :data:`STEP` bytes (``max_length``), every
  member of a multi-member gzip file included, and refused as soon as the count passes the header's
  size + :data:`SLACK`. A file whose header cannot be read is counted against the cap instead (the
  reader then says what is wrong with it). A deflated DICOM data set has no such header: its files
  are counted against the cap, all of an upload's together.

What passes the count is handed to the same readers as before (nibabel, pydicom), which can then
inflate no more than was counted. Every refusal is a :class:`~medseg.errors.DataError` that names
the file and the limit.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medseg import sysinfo
from medseg.datasets import checks
from medseg.errors import DataError

DEFAULT_MAX_MB = 1024
EXPANSION = 8  # a decompressed upload may be at most this many times the upload limit
SLACK = 2**20  # bytes a .nii.gz may hold beyond its header's offset and voxels
STEP = 2**20  # decompressed bytes per inflate call: how far the count can overshoot before it stops
PIECE = 2**16  # compressed bytes fed per call
HEAD = 544  # enough decompressed bytes for a NIfTI-1 (348 + 4) or NIfTI-2 (540 + 4) header
GZIP_MAGIC = b"\x1f\x8b"
DEFLATED_DICOM = "1.2.840.10008.1.2.1.99"  # Deflated Explicit VR Little Endian: the whole data set


def max_upload_mb() -> int:
    """The upload size limit in MB (``MEDSEG_APP_MAX_UPLOAD_MB``, default 1024)."""
    try:
        return int(os.environ.get("MEDSEG_APP_MAX_UPLOAD_MB", DEFAULT_MAX_MB))
    except ValueError:
        return DEFAULT_MAX_MB


def size_text(n: float) -> str:
    """Bytes in words: 10.0 GiB, 33 MiB, 1.5 MiB, 512 KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 10 * 2**20:
        return f"{n / 2**20:.0f} MiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{max(n, 0) / 2**10:.0f} KiB"


@dataclass(frozen=True)
class Cap:
    """The most bytes one upload may decompress to, and why that much."""

    bytes: int
    reason: str


def decompressed_cap() -> Cap:
    """:data:`EXPANSION` × the upload limit, or the memory available if that is less."""
    by_upload = EXPANSION * max_upload_mb() * 2**20
    memory = sysinfo.available_memory()
    if memory < by_upload:
        return Cap(max(memory, 0), f"the {size_text(memory)} of memory available")
    return Cap(
        by_upload,
        f"the viewer's {size_text(by_upload)} limit on a decompressed upload ({EXPANSION} × the "
        f"{max_upload_mb()} MB upload limit)",
    )


# --------------------------------------------------------------------------------------- inflate


def _decompressor(raw: bool) -> Any:
    """ISA-L's inflate (the same bytes as zlib's, several times faster), else zlib's."""
    wbits = -15 if raw else 31
    try:
        from isal import isal_zlib

        return isal_zlib.decompressobj(wbits=wbits)
    except ImportError:  # pragma: no cover - isal is a dependency
        return zlib.decompressobj(wbits)


def _errors() -> tuple[type[BaseException], ...]:
    try:
        from isal import isal_zlib

        return (zlib.error, isal_zlib.error)
    except ImportError:  # pragma: no cover
        return (zlib.error,)


class Exceeded(Exception):
    """Raised by :func:`inflate` as soon as the count passes its limit."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


@dataclass
class Inflated:
    """What :func:`inflate` got: the decompressed size, how the stream ended, the bytes if kept."""

    size: int
    status: str  # "complete", "truncated" (input ended inside a stream), "damaged", or "enough"
    data: bytearray | None = None


def pieces(source: bytes | bytearray | memoryview | Path) -> Iterator[memoryview | bytes]:
    """A buffer or a file's content in :data:`PIECE`-byte pieces (a file is read as it goes)."""
    if isinstance(source, Path):
        with open(source, "rb") as f:
            while piece := f.read(PIECE):
                yield piece
        return
    view = memoryview(source)
    for start in range(0, len(view), PIECE):
        yield view[start : start + PIECE]


def inflate(
    chunks: Iterable[bytes | memoryview],
    limit: int,
    *,
    raw: bool = False,
    keep: bool = False,
    stop_at: int | None = None,
) -> Inflated:
    """Inflate a gzip stream (all its members; zero padding between them skipped, as gzip readers
    do) or, with ``raw``, one raw deflate stream, counting what comes out.

    Raises :class:`Exceeded` as soon as more than ``limit`` bytes have come out (at most
    :data:`STEP` more were made). ``keep`` keeps the bytes; ``stop_at`` stops once that many have
    come out (status "enough"). Bytes after the last stream that do not start another gzip member
    are left alone: no gzip reader inflates them.
    """
    kept = bytearray() if keep else None
    bad = _errors()
    total, started, d = 0, False, None

    def take(out: bytes) -> bool:
        nonlocal total
        total += len(out)
        if total > limit:
            raise Exceeded(total)
        if kept is not None:
            kept.extend(out)
        return stop_at is not None and total >= stop_at

    for piece in chunks:
        data: Any = piece
        while len(data):
            if d is None and started:  # after a stream's end: another member, padding or the rest
                if raw:
                    return Inflated(total, "complete", kept)
                data = bytes(data).lstrip(b"\0")
                if not data:
                    break  # zero padding; the next piece may start another member
                if data[:1] != GZIP_MAGIC[:1]:
                    return Inflated(total, "complete", kept)
            if d is None:
                d, started = _decompressor(raw), True
            try:  # with stop_at, no further than that: an error later in the stream is not reached
                out = d.decompress(data, STEP if stop_at is None else max(min(STEP, stop_at - total), 1))
            except bad:
                return Inflated(total, "damaged", kept)
            if take(out):
                return Inflated(total, "enough", kept)
            if d.eof:
                data, d = d.unused_data, None
            else:
                data = d.unconsumed_tail
    while d is not None and not d.eof:  # the input has ended: what the decompressor still holds
        try:
            out = d.decompress(b"", STEP)
        except bad:
            return Inflated(total, "damaged", kept)
        if not out:
            break
        if take(out):
            return Inflated(total, "enough", kept)
    status = "truncated" if (d is not None and not d.eof) or not started else "complete"
    return Inflated(total, status, kept)


def is_gzip(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[:2]) == GZIP_MAGIC


def head(source: bytes | bytearray | memoryview | Path, n: int = HEAD) -> bytes:
    """The first ``n`` decompressed bytes of a file that may be gzip-compressed (no more are inflated)."""
    start = _start(source) if isinstance(source, Path) else bytes(source[:2])
    if start != GZIP_MAGIC:
        if isinstance(source, Path):
            with open(source, "rb") as f:
                return f.read(n)
        return bytes(source[:n])
    got = inflate(pieces(source), limit=n + STEP, keep=True, stop_at=n)
    return bytes((got.data or b"")[:n])


def _start(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(2)


# ----------------------------------------------------------------------------------------- NIfTI


@dataclass(frozen=True)
class NiftiLayout:
    """What a NIfTI header says the decompressed file holds."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    offset: int  # where the voxels start (vox_offset, at least the header's size + 4)

    @property
    def n_voxels(self) -> int:
        return math.prod(self.shape)

    @property
    def total(self) -> int:
        """The decompressed file's size: header, extensions and voxels."""
        return self.offset + self.n_voxels * self.itemsize

    def describe(self) -> str:
        return f"{' × '.join(map(str, self.shape))} voxels of {self.dtype}"


def nifti_layout(block: bytes) -> NiftiLayout | None:
    """The layout a NIfTI-1 or NIfTI-2 header (the file's first bytes, decompressed) describes;
    None when ``block`` does not start with one that makes sense."""
    import nibabel as nib

    if len(block) < 4:
        return None
    sizes = {struct.unpack("<i", block[:4])[0], struct.unpack(">i", block[:4])[0]}
    kinds = [(nib.Nifti1Header, 348), (nib.Nifti2Header, 540)]
    for klass, size in kinds:
        if size not in sizes or len(block) < size:
            continue
        try:
            hdr = klass(block[:size], check=False)
            shape = tuple(int(s) for s in hdr.get_data_shape())
            dtype = hdr.get_data_dtype()
            vox_offset = float(hdr["vox_offset"])
            if not shape or min(shape) < 0 or not math.isfinite(vox_offset):
                return None
            offset = max(int(vox_offset), size + 4)
        except Exception:  # noqa: BLE001 - a header nibabel cannot make sense of: no layout
            return None
        return NiftiLayout(shape, str(dtype), int(dtype.itemsize), offset)
    return None


def nifti_limit(name: str, layout: NiftiLayout | None) -> int:
    """The most bytes the NIfTI file ``name`` may decompress to: its header's size + :data:`SLACK`,
    or the cap when its header cannot be read. Refused at once when the header asks for more than
    the cap."""
    cap = decompressed_cap()
    if layout is None:
        return cap.bytes
    if layout.total > cap.bytes:
        raise DataError(
            f"{name}: its header describes {layout.describe()}, {size_text(layout.total)} once "
            f"decompressed, over {cap.reason}; it was not decompressed. Crop or downsample the image"
        )
    return layout.total + SLACK


def _too_large(name: str, layout: NiftiLayout | None, limit: int) -> DataError:
    if layout is None:
        return DataError(
            f"{name}: decompresses to more than {size_text(limit)}, over {decompressed_cap().reason}; "
            "refused before it was decompressed whole"
        )
    return DataError(
        f"{name}: decompresses to more than {size_text(limit)}, but its header describes only "
        f"{layout.describe()} ({size_text(layout.total)} with the header); a NIfTI file holds its "
        "header and voxels, nothing more, so it was refused before it was decompressed whole "
        "(this is how a gzip bomb looks). Re-export the image"
    )


def _damaged(name: str) -> DataError:
    return DataError(f"{name} is not a readable .nii.gz file (the compression is damaged)")


def _cut_short(name: str, layout: NiftiLayout | None, size: int) -> DataError:
    described = f" of the {size_text(layout.total)} its header describes" if layout is not None else ""
    return DataError(
        f"{name} is cut short: its compressed data stops after {size_text(size)}{described}, "
        "so the upload or an earlier copy ended early. Copy or export the file again and upload "
        "the complete file"
    )


def gunzip_nifti(name: str, data: bytes | bytearray | memoryview, layout: NiftiLayout) -> bytearray:
    """The decompressed bytes of the ``.nii.gz`` upload ``name`` whose header ``layout`` describes,
    inflated no further than :func:`nifti_limit` allows; a DataError when it holds more, is damaged
    or is cut short. (A file whose header cannot be read is not inflated here at all.)"""
    limit = nifti_limit(name, layout)
    try:
        got = inflate(pieces(data), limit, keep=True)
    except Exceeded:
        raise _too_large(name, layout, limit) from None
    if got.status != "complete":
        raise DataError(
            f"{name} is not a readable .nii.gz file (the compression is damaged or the file is cut short)"
        )
    return got.data or bytearray()


def check_nifti_file(name: str, path: Path) -> NiftiLayout | None:
    """Count what the gzip-compressed NIfTI file at ``path`` decompresses to (the bytes are not
    kept) before any reader opens it; a DataError when its header asks for more than the cap or
    than the reader's memory check allows (:func:`medseg.datasets.checks.check_memory`), when it
    holds more than its header's size allows, or when it is damaged.

    A file cut short (the stream ends before its end marker) is refused in plain words. A file that
    is not gzip-compressed passes: the reader says what is wrong in its own words. Returns the
    header's layout (None when it cannot be read; the reader reports it).
    """
    if _start(path) != GZIP_MAGIC:
        return None
    layout = nifti_layout(head(path))
    limit = nifti_limit(name, layout)
    if layout is not None:  # the reader's own memory check, before the count rather than after it
        checks.check_memory(layout.n_voxels, layout.itemsize, name)
    try:
        got = inflate(pieces(path), limit)
    except Exceeded:
        raise _too_large(name, layout, limit) from None
    if got.status == "damaged":
        raise _damaged(name)
    if got.status == "truncated":
        raise _cut_short(name, layout, got.size)
    return layout


# ----------------------------------------------------------------------------------------- DICOM


def _explicit_long(vr: bytes) -> bool:
    return vr in {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}


def dicom_meta_end(data: bytes | memoryview) -> tuple[str, int]:
    """The transfer syntax UID in a DICOM file's meta group (0002, explicit VR little endian) and
    where the data set after it starts; ("", 0) when there is no meta group."""
    view = memoryview(data)
    pos = 132 if bytes(view[128:132]) == b"DICM" else 0
    syntax = ""
    while pos + 8 <= len(view):
        group, element = struct.unpack("<HH", view[pos : pos + 4])
        if group != 0x0002:
            break
        vr = bytes(view[pos + 4 : pos + 6])
        if _explicit_long(vr):
            if pos + 12 > len(view):
                break
            (length,) = struct.unpack("<I", view[pos + 8 : pos + 12])
            start = pos + 12
        else:
            (length,) = struct.unpack("<H", view[pos + 6 : pos + 8])
            start = pos + 8
        if element == 0x0010:
            syntax = bytes(view[start : start + length]).rstrip(b"\0 ").decode("ascii", "replace")
        pos = start + length
    return syntax, pos


def check_dicom(name: str, data: bytes | memoryview, budget: int) -> int:
    """Count what a deflated DICOM file's data set inflates to (pydicom inflates it whole, unbounded)
    against ``budget`` bytes; returns the count (0 for any other transfer syntax). A DataError when
    it passes the budget."""
    syntax, start = dicom_meta_end(data)
    if syntax != DEFLATED_DICOM:
        return 0
    try:
        got = inflate(pieces(memoryview(data)[start:]), budget, raw=True)
    except Exceeded:
        cap = decompressed_cap()
        raise DataError(
            f"{name}: a deflated DICOM file that inflates to more than {size_text(budget)} (with the "
            f"upload's other files), over {cap.reason}; refused before it was inflated whole"
        ) from None
    return got.size

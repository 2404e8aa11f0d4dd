"""Error messages for a person in a browser, and what an uploaded file is.

medseg's library messages are written for the command line: they name files by their full path and
suggest flags (``--resample``, ``--series``) or commands (``medseg data validate``). In the viewer
the path is a temporary folder the user never saw and there is no command line, so
:func:`for_browser` rewrites a message: known command-line advice becomes what to do in the page,
remaining paths shrink to the file's name, and leftover command mentions are dropped.

A file's name says what its sender meant it to be; its first bytes say what it is. :func:`sniff`
reads those bytes (magic numbers: PNG, JPEG, DICOM's ``DICM`` at byte 128, zip, gzip and what the
gzip stream starts with, NIfTI-1/2 header sizes, NRRD, ...) so that an upload the viewer cannot read
is reported as what it is, with what to do (:func:`not_a_scan`), rather than as the error the
reader for its file name happened to raise.
"""

from __future__ import annotations

import logging
import re
import struct
from dataclasses import dataclass

from medseg.apps import limits
from medseg.datasets.dicom.header import is_dicom_bytes
from medseg.errors import MedsegError

log = logging.getLogger(__name__)

# (pattern, replacement): command-line advice in library messages -> advice for the page
_ADVICE: tuple[tuple[str, str], ...] = (
    (
        r"This reader will not silently average the spacing \(unlike MONAI's PydicomReader\); "
        r"pass resample=True \(CLI --resample\) to interpolate onto a regular grid, or supply the complete series",
        "The viewer does not fill in missing slices; upload the complete series",
    ),
    (
        r"pass resample=True \(CLI --resample\) to interpolate onto a regular grid, or supply the complete series",
        "upload the complete series",
    ),
    (r"; choose one with --series UID \(series_uid=\.\.\.\)", "; choose one in the list"),
    (r",? ?so --resample will not interpolate it", ""),
    (
        r" ?If you made this bundle yourself and trust it, pass --trust-bundle \(load_bundle\(\.\.\., trust=True\)\)\.",
        " The viewer does not open such bundles.",
    ),
    (r"[;,]? ?(?:run|check it with) `medseg [^`]*`", ""),
    (r"[;,]? ?(?:make|convert) (?:one|them first) with `medseg [^`]*`[^;.]*", ""),
    (r"\s*\((?:CLI )?--[a-z-]+[^)]*\)", ""),
    # pydicom's words for a DICOM file cut short inside its pixel data
    (
        r": pixel data cannot be decoded \(The number of bytes of pixel data is less than expected "
        r"\((\d+) vs (\d+) bytes\)[^)]*\); the file may be truncated, or its transfer syntax needs an "
        r"extra decoder \([^)]*\)",
        r" is cut short: it holds \1 of the \2 bytes of pixel data its header describes, so the upload "
        r"or an earlier copy ended early. Copy or export the series again and upload the complete files",
    ),
    # a gzip stream cut short, in the words of Python's gzip module
    (
        r"\(EOFError: Compressed file ended before the end-of-stream marker was reached\)",
        "(the compressed data stops early: the file is cut short; upload the complete file)",
    ),
)
# an absolute path, or one inside the upload's temporary folder ("upload/..."): keep its last part
_PATH = re.compile(r"(?<![\w.])(?:upload)?(?:/[\w.+@%-]+)+/?")


def for_browser(message: str) -> str:
    """``message`` without folder paths and command-line advice (see the module docstring)."""
    text = message
    for pattern, repl in _ADVICE:
        text = re.sub(pattern, repl, text)
    text = _PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "the file", text)
    text = re.sub(r"`?medseg (?:data|infer|train|evaluate|app)[^`;.\n]*`?", "", text)
    text = re.sub(r"\s+([;,.])(?=\s|$)", r"\1", text)  # not before a suffix: ".nii, .nii.gz"
    return re.sub(r"[ \t]{2,}", " ", text).strip()


def problem(e: BaseException) -> str:
    """A message for the page: medseg's own (rewritten for a browser user), or a plain sentence for
    anything unexpected (logged with its traceback for whoever runs the server; never shown)."""
    if isinstance(e, MedsegError):
        return for_browser(str(e))
    log.exception("unexpected error in the viewer")
    detail = for_browser(str(e)).strip("'\" ")
    detail = f" ({detail})" if detail and len(detail) < 200 else ""
    return (
        f"The viewer could not finish this step{detail}. The server's log has the details; "
        "the page keeps working with other inputs."
    )


# ------------------------------------------------------------------------------ what a file is

READS = "a NIfTI file (.nii, .nii.gz), a zip of a DICOM series folder, or the series' DICOM files"
CONVERT = "convert it to NIfTI (3D Slicer, ITK-SNAP or SimpleITK can) and upload the .nii.gz"
PICTURE = (
    "a picture holds no scan's voxels. Export the scan itself as NIfTI or DICOM from the viewer or "
    "PACS it came from"
)
ARCHIVE = "unpack it and upload the NIfTI file inside, or the DICOM folder packed as a .zip"


@dataclass(frozen=True)
class FileKind:
    """What a file's first bytes say it is.

    ``what`` names it for a sentence ("a PNG image"); ``readable`` is how the viewer reads it
    ("nifti", "dicom", "zip"), or "" when it cannot; ``advice`` is what to do instead.
    """

    what: str
    readable: str = ""
    advice: str = ""
    cut_short: bool = False  # a gzip stream that ends inside the image's header


# (magic bytes at offset 0, what it is, advice): formats people upload by mistake
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image", PICTURE),
    (b"\xff\xd8\xff", "a JPEG image", PICTURE),
    (b"GIF87a", "a GIF image", PICTURE),
    (b"GIF89a", "a GIF image", PICTURE),
    (b"II*\x00", "a TIFF image", PICTURE),
    (b"MM\x00*", "a TIFF image", PICTURE),
    (b"%PDF", "a PDF document", PICTURE),
    (b"NRRD", "an NRRD volume", CONVERT),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (.h5, .mnc)", CONVERT),
    (b"\x93NUMPY", "a NumPy array (.npy)", "save it as NIfTI with its affine (nibabel can) and upload that"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", ARCHIVE),
    (b"Rar!\x1a\x07", "a RAR archive", ARCHIVE),
    (b"BZh", "a bzip2-compressed file", ARCHIVE),
    (b"\xfd7zXZ\x00", "an xz-compressed file", ARCHIVE),
    (b"\x28\xb5\x2f\xfd", "a Zstandard-compressed file", ARCHIVE),
)
_ZIP = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")
_DICOMDIR = b"1.2.840.10008.1.3.10"  # the Media Storage Directory SOP class


def _nifti_kind(head: bytes) -> FileKind | None:
    """NIfTI-1 (348-byte header, "n+1" at 344), NIfTI-2 (540, "n+2" at 4), their header-only
    forms, and Analyze 7.5 (348 bytes, no magic), in either byte order."""
    if len(head) < 4:
        return None
    sizes = {struct.unpack("<i", head[:4])[0], struct.unpack(">i", head[:4])[0]}
    if 540 in sizes and head[4:7] in (b"n+2", b"ni2"):
        single = head[4:7] == b"n+2"
    elif 348 in sizes and head[344:347] in (b"n+1", b"ni1"):
        single = head[344:347] == b"n+1"
    elif 348 in sizes and len(head) >= 348:
        return FileKind("an Analyze 7.5 header (.hdr)", advice=CONVERT)
    else:
        return None
    if single:
        return FileKind("a NIfTI image", readable="nifti")
    return FileKind(
        "a NIfTI header without its voxels (the .hdr of a .hdr/.img pair)",
        advice="convert the pair to a single .nii.gz (nibabel or 3D Slicer can) and upload that",
    )


def _looks_like_text(head: bytes) -> bool:
    if not head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return sum(c.isprintable() or c in "\r\n\t" for c in text) >= 0.95 * len(text)


def _text_kind(head: bytes) -> FileKind | None:
    """Text files: MetaImage and NRRD headers, web pages, anything else printable."""
    if not _looks_like_text(head):
        return None
    low = head[:200].lstrip().lower()
    if low.startswith((b"objecttype", b"ndims")):
        return FileKind("a MetaImage file (.mha, .mhd)", advice=CONVERT)
    if low.startswith((b"<!doctype html", b"<html")):
        return FileKind(
            "a web page (HTML)",
            advice="the download may have saved a login or error page; download the scan itself again",
        )
    return FileKind("a text file", advice="upload the scan itself")


def _plain_kind(head: bytes) -> FileKind | None:
    """What an uncompressed file's first bytes (at least 544 of them, if it has them) say it is."""
    if head.startswith(_ZIP):
        return FileKind("a zip archive", readable="zip")
    if is_dicom_bytes(head[:132]):
        if _DICOMDIR in head[:400]:
            return FileKind(
                "a DICOMDIR (the index of a DICOM folder, without images)",
                advice="zip the whole folder that holds it and upload the .zip",
            )
        return FileKind("a DICOM file", readable="dicom")
    found = _nifti_kind(head)
    if found is not None:
        return found
    if len(head) > 262 and head[257:262] == b"ustar":
        return FileKind("a tar archive", advice=ARCHIVE)
    if head[:2] == b"BM" and len(head) > 18 and struct.unpack("<I", head[14:18])[0] in (12, 40, 56, 108, 124):
        return FileKind("a BMP image", advice=PICTURE)
    for magic, what, advice in _MAGIC:
        if head.startswith(magic):
            return FileKind(what, advice=advice)
    return _text_kind(head)


def sniff(data: bytes | bytearray | memoryview) -> FileKind | None:
    """What ``data`` is by its first bytes; None when they match nothing known.

    A gzip stream is looked into: only its first :data:`medseg.apps.limits.HEAD` decompressed bytes
    are inflated (:func:`medseg.apps.limits.head`), whatever the file's size.
    """
    if not len(data):
        return FileKind(
            "an empty file (0 bytes)", advice="the upload or copy stopped early. Upload the file again"
        )
    if len(data) < 132 and not any(bytes(data)):  # e.g. a DICOM file cut inside its zero preamble
        return FileKind(
            f"a file of {len(data)} zero bytes",
            advice="the file is cut short. Copy or export it again and upload the complete file",
            cut_short=True,
        )
    if not limits.is_gzip(data):
        return _plain_kind(bytes(data[: limits.HEAD]))
    inner = limits.head(data)
    if len(inner) < 348:  # no NIfTI, DICOM or tar header fits in fewer bytes
        return FileKind(
            "a gzip-compressed file that ends after a few bytes",
            advice="the file is cut short. Copy or export it again and upload the complete file",
            cut_short=True,
        )
    found = _plain_kind(inner)
    if found is not None and found.readable == "nifti":
        return FileKind("a gzip-compressed NIfTI image", readable="nifti")
    if found is None:
        return FileKind("a gzip-compressed file", advice="upload the scan itself")
    what = found.what.removeprefix("an ").removeprefix("a ")
    return FileKind(f"a gzip-compressed {what}", advice=found.advice or ARCHIVE)


def not_a_scan(name: str, kind: FileKind | None, meant: str) -> str:
    """The message for a file the viewer cannot read: what it is, what was expected, what to do.

    ``meant`` is what its name made it out to be ("a NIfTI file"); ``kind`` what :func:`sniff` found.
    """
    if kind is None:
        return (
            f"{name} is not {meant}: its first bytes match no image format the viewer knows. "
            f"The viewer reads {READS}."
        )
    if kind.cut_short:
        return f"{name} is {kind.what}: {kind.advice}."
    return f"{name} is {kind.what}, not {meant}: {kind.advice}. The viewer reads {READS}."

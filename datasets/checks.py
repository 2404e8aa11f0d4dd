"""The input checks that ``validate``, ``train``, ``evaluate``, ``infer``, ``convert`` and the viewer share.

A check that exists here holds everywhere: ``medseg data validate`` collects the problems these
functions find into its report; every other path raises the first one as a
:class:`~medseg.errors.DataError` before any voxel is trained on, scored or written.

Which NIfTI affine is used (qform or sform)
-------------------------------------------
- The **sform wins** when its code is above 0, as in nibabel and MONAI (``img.affine``).
- The qform is used when it alone is set (sform code 0).
- Whichever is set must be finite and non-singular; a set but broken one is refused, never replaced
  by the other: the file claims a geometry and that claim is wrong.
- When both are set and they map the volume onto different axis directions (a left-right flip or a
  swapped axis), the file is refused: one of them is wrong and the reader cannot know which. Smaller
  differences (a sheared sform that the qform can only approximate) are logged, and the sform is used.
- When neither is set (both codes 0) the file is refused: nibabel would invent a geometry from the
  voxel sizes alone (zero origin, left-right flipped against most scanners' output).
- ``pixdim`` of the three spatial axes must be finite and above 0.

Size limits
-----------
Before any voxel is read, the header's shape and data type give the bytes the volume will take.
A ``.nii`` shorter than that is truncated; a ``.nii.gz`` claiming more than deflate's maximum ratio
(1032:1) times its compressed size is corrupt; and a volume whose reading needs more memory than the
machine has available (``/proc/meminfo`` MemAvailable, the cgroup limit, or ``MEDSEG_MAX_IMAGE_MB``)
is refused, so a gzip bomb is never decompressed.
"""

from __future__ import annotations

import errno
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from medseg import sysinfo
from medseg.errors import DataError

logger = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")
AFFINE_TOLERANCE = 1e-3  # mm, label affine against image affine
QFORM_SFORM_WARN_MM = 1.0
MAX_DEFLATE_RATIO = 1032  # deflate never expands data by more than about 1032:1
# bytes held while one volume is read and prepared: the stored voxels, a float32 copy and one more
# float32 copy made by the first transform that does not work in place
_WORK_COPIES_F32 = 2
_MAX_LISTED = 10


# ----------------------------------------------------------------------------------------- paths


def check_input_path(
    path: str | os.PathLike[str], what: str = "input", name: str | None = None, hint: str | None = None
) -> Path:
    """Return ``path`` if it exists; a dangling or looping symbolic link is named as such."""
    p = Path(path)
    name = name or str(p)
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(
                f"{name}: is a symbolic link that loops back on itself; point the {what} at the real file or folder"
            ) from None
        if os.path.islink(p):
            raise DataError(
                f"{name}: is a symbolic link to {os.readlink(p)!r}, which does not exist; fix the link or give "
                f"the real {what}"
            ) from None
        if exc.errno == errno.EACCES:
            raise DataError(f"{name}: permission denied; make the {what} readable") from None
        if exc.errno == errno.ENOENT:
            raise DataError(f"{name}: file not found; {hint or 'check the path of the ' + what}") from None
        raise DataError(f"{name}: cannot be opened ({exc.strerror}); check the path of the {what}") from None
    return p


def _resolve(p: Path) -> Path:
    """``p.resolve()``, or the absolute path when a link loops (the loop is reported where it is read)."""
    try:
        return p.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(p))


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(child: Path, folder: Path) -> bool:
    try:
        return folder.is_dir() and _resolve(child).is_relative_to(_resolve(folder))
    except OSError:
        return False


def prepare_output_file(
    output: str | os.PathLike[str],
    inputs: Sequence[str | os.PathLike[str]] = (),
    suffixes: tuple[str, ...] | None = None,
    what: str = "output",
    create: bool = True,
) -> Path:
    """Check an output file path against the inputs and create its folder; every task writes this way.

    Refused: an output that is an input (or lies inside an input folder), an existing folder, a
    suffix not in ``suffixes``, and a parent path that is a file. Missing parent folders are created
    (``create=False`` checks only, for a check made before the work starts).
    """
    out = Path(output)
    for src in map(Path, inputs):
        if _same(out, src) or _resolve(out) == _resolve(src):
            raise DataError(
                f"{out}: is the input {src}; writing there would destroy it. Choose another output file"
            )
        if _inside(out, src):
            raise DataError(f"{out}: lies inside the input folder {src}; write the {what} outside the input")
    if out.is_dir():
        raise DataError(
            f"{out}: is an existing folder; give a file name for the {what} (e.g. {out}/mask.nii.gz)"
        )
    if suffixes is not None and not out.name.endswith(suffixes):
        raise DataError(f"{out}: the {what} must be named *{' or *'.join(suffixes)}")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise DataError(f"{parent}: is a file, so the {what} {out} cannot be written there")
        if parent.is_dir():
            break
    if create:
        _make_folder(out.parent, what)
    return out


def prepare_output_dir(
    out_dir: str | os.PathLike[str],
    inputs: Sequence[str | os.PathLike[str]] = (),
    what: str = "output",
    create: bool = True,
) -> Path:
    """Check an output folder path against the inputs and create it (``create=False``: check only)."""
    out = Path(out_dir)
    for src in map(Path, inputs):
        if _same(out, src) or _resolve(out) == _resolve(src):
            raise DataError(f"{out}: is the input {src}; write the {what} to another folder")
    if out.exists() and not out.is_dir():
        raise DataError(
            f"{out}: is an existing file, but a folder is needed for the {what}; choose a folder path"
        )
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise DataError(f"{parent}: is a file, so the {what} folder {out} cannot be created there")
        if parent.is_dir():
            break
    if create:
        _make_folder(out, what)
    return out


def _make_folder(folder: Path, what: str) -> None:
    for parent in [folder, *folder.parents]:
        if parent.exists() and not parent.is_dir():
            raise DataError(f"{parent}: is a file, so the {what} folder {folder} cannot be created there")
        if parent.is_dir():
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{folder}: cannot be created ({exc.strerror}); choose a writable place") from None


# ---------------------------------------------------------------------------------------- memory


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_memory(n_voxels: int, itemsize: int, name: str) -> None:
    """Refuse a volume whose reading would need more memory than the machine has available."""
    need = int(n_voxels) * (int(itemsize) + 4 * _WORK_COPIES_F32)
    avail = sysinfo.available_memory()
    if need > avail:
        raise DataError(
            f"{name}: reading this volume ({n_voxels:,} voxels) needs about {_gib(need)} of memory, but only "
            f"{_gib(avail)} is available; crop or downsample it, or use a machine with more memory "
            "(the limit can be lowered with MEDSEG_MAX_IMAGE_MB)"
        )


# ----------------------------------------------------------------------------------------- NIfTI


def _is_valid_affine(m: np.ndarray | None) -> bool:
    if m is None or m.shape != (4, 4) or not np.all(np.isfinite(m)):
        return False
    zooms = np.linalg.norm(m[:3, :3], axis=0)
    if np.any(zooms <= 1e-6):
        return False
    return abs(float(np.linalg.det(m[:3, :3]))) > 1e-6 * float(np.prod(zooms))


def _corner_distance(a: np.ndarray, b: np.ndarray, shape: Sequence[int]) -> float:
    corners = np.array(
        [[i, j, k, 1.0] for i in (0, shape[0] - 1) for j in (0, shape[1] - 1) for k in (0, shape[2] - 1)]
    )
    return float(np.max(np.linalg.norm((corners @ a.T - corners @ b.T)[:, :3], axis=1)))


def _raw_header(img: Any, path: str | os.PathLike[str] | None) -> Any:
    """The header as stored: nibabel's loader quietly repairs some fields (0 pixdim -> 1, bad codes -> 0)."""
    if path is None:
        return img.header
    from nibabel.openers import ImageOpener

    try:
        with ImageOpener(str(path)) as f:
            return type(img.header).from_fileobj(f, check=False)
    except Exception:  # noqa: BLE001 - the repaired header is still better than none
        return img.header


def nifti_affine(img: Any, name: str, path: str | os.PathLike[str] | None = None) -> np.ndarray:
    """The affine medseg uses for a NIfTI image, following the policy in this module's docstring.

    ``path`` lets the header be read as stored, before nibabel's repairs.
    """
    hdr = _raw_header(img, path)
    shape = tuple(int(s) for s in img.shape[:3]) + (1,) * max(0, 3 - len(img.shape))
    if not hasattr(hdr, "get_sform"):  # not NIfTI (e.g. ANALYZE): nibabel builds the affine from pixdim
        affine = np.asarray(img.affine, dtype=np.float64)
        if not _is_valid_affine(affine):
            raise DataError(f"{name}: the voxel-to-world affine is singular or not finite; fix the header")
        return affine
    pixdim = np.asarray(hdr["pixdim"][1 : 1 + min(3, len(img.shape))], dtype=np.float64)
    if not np.all(np.isfinite(pixdim)) or np.any(pixdim == 0):
        raise DataError(
            f"{name}: the header's voxel size (pixdim) is {pixdim.tolist()}, which holds 0 or a non-finite "
            "value; the geometry is broken, re-export the image with its true voxel size"
        )
    sform, scode = hdr.get_sform(coded=True)
    qform, qcode = hdr.get_qform(coded=True)
    if scode not in (0, 1, 2, 3, 4, 5) or qcode not in (0, 1, 2, 3, 4, 5):
        raise DataError(
            f"{name}: the header's sform/qform codes ({int(scode)}, {int(qcode)}) are not NIfTI codes (0-5); "
            "the header is corrupt, re-export the image"
        )
    if scode <= 0 and qcode > 0 and np.any(pixdim < 0):
        raise DataError(
            f"{name}: the qform's voxel size (pixdim) {pixdim.tolist()} is negative, which readers flip in "
            "different ways; re-export the image with positive voxel sizes"
        )
    if scode > 0 and not _is_valid_affine(sform):
        raise DataError(
            f"{name}: the sform (code {int(scode)}) is singular or not finite ({np.round(sform, 4).tolist()}); "
            "medseg will not guess the geometry. Re-export the image or fix its sform"
        )
    if qcode > 0 and not _is_valid_affine(qform):
        raise DataError(
            f"{name}: the qform (code {int(qcode)}) is singular or not finite; re-export the image or fix "
            "its qform and pixdim"
        )
    if scode <= 0 and qcode <= 0:
        raise DataError(
            f"{name}: the header sets neither an sform nor a qform (both codes 0), so the image has no "
            "position or orientation and any affine would be invented; re-export it with its scanner "
            "geometry (e.g. dcm2niix)"
        )
    if scode > 0 and qcode > 0:
        if nib.aff2axcodes(sform) != nib.aff2axcodes(qform):
            raise DataError(
                f"{name}: the sform ({''.join(nib.aff2axcodes(sform))}) and qform "
                f"({''.join(nib.aff2axcodes(qform))}) disagree on the axis directions; one of them is wrong. "
                "Rewrite the header with the correct one in both (or set the wrong one's code to 0)"
            )
        dist = _corner_distance(sform, qform, shape)
        if dist > QFORM_SFORM_WARN_MM:
            logger.warning("%s: sform and qform differ by up to %.3g mm; the sform is used", name, dist)
        return np.asarray(sform, dtype=np.float64)
    return np.asarray(sform if scode > 0 else qform, dtype=np.float64)


def _check_nifti_size(img: Any, path: Path, name: str, memory: bool = True) -> None:
    hdr = img.header
    shape = tuple(int(s) for s in img.shape)
    if any(s < 0 for s in shape):
        raise DataError(f"{name}: the header gives a negative dimension {shape}; the file is corrupt")
    n_voxels = math.prod(shape) if shape else 0
    itemsize = int(hdr.get_data_dtype().itemsize)
    claimed = n_voxels * itemsize
    size = path.stat().st_size
    offset = int(getattr(img.dataobj, "offset", 0) or 0)
    if path.name.endswith(".gz"):
        if claimed > (size + 1024) * MAX_DEFLATE_RATIO:
            raise DataError(
                f"{name}: the header claims {_gib(claimed)} of voxels {shape}, more than a {_gib(size)} gzip "
                "file can hold; the header is corrupt, re-export the image"
            )
    elif size < offset + claimed:
        raise DataError(
            f"{name}: the file holds {size:,} bytes but its header needs {offset + claimed:,} for {shape} "
            f"voxels; the file is truncated, copy or export it again"
        )
    if memory:
        check_memory(n_voxels, itemsize, name)


def open_nifti(
    path: str | os.PathLike[str], name: str | None = None, memory: bool = True
) -> tuple[Any, np.ndarray]:
    """Open a NIfTI header (no voxels read) and check path, size and geometry.

    Returns the lazy nibabel image and the affine to use. Raises DataError naming ``name`` (or the path).
    ``memory=False`` skips the check that the whole volume fits in memory (for a streamed read, whose
    own peak :func:`medseg.inference.memory.estimate` checks).
    """
    from nibabel.filebasedimages import ImageFileError
    from nibabel.spatialimages import HeaderDataError

    p = check_input_path(
        path, "image", name, "fix the path in dataset.json or add the file" if name else None
    )
    name = name or str(p)
    if p.is_dir():
        raise DataError(f"{name}: is a folder, not a NIfTI file; give the .nii or .nii.gz file")
    try:
        img = nib.load(str(p))
    except (EOFError, OSError, ValueError, ImageFileError, HeaderDataError) as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise DataError(
            f"{name}: cannot be read as NIfTI ({reason}); the file is corrupt or truncated, re-export or re-copy it"
        ) from None
    except Exception as exc:  # noqa: BLE001 - zlib.error and others from damaged headers
        raise DataError(
            f"{name}: cannot be read as NIfTI ({type(exc).__name__}: {exc}); the file is corrupt, re-export it"
        ) from None
    _check_nifti_size(img, p, name, memory)
    return img, nifti_affine(img, name, p)


# ------------------------------------------------------------------------------ labels, geometry


def _list(values: Iterable[Any]) -> str:
    vals = [v.item() if isinstance(v, np.generic) else v for v in values]
    text = ", ".join(str(v) for v in vals[:_MAX_LISTED])
    return text + (f", ... ({len(vals)} in all)" if len(vals) > _MAX_LISTED else "")


def _missing_values(keys: list[int]) -> str:
    """`` (missing: 2, 5, ...)`` for the values absent from 0..max(keys), or "" (bounded work: the
    first few are found by walking, the count is arithmetic)."""
    present = set(keys)
    count = max(keys) + 1 - sum(1 for k in present if k >= 0)
    if count <= 0:
        return ""
    first, v = [], 0
    while len(first) < min(count, _MAX_LISTED):
        if v not in present:
            first.append(v)
        v += 1
    more = f", ... ({count} in all)" if count > len(first) else ""
    return f" (missing: {', '.join(map(str, first))}{more})"


def declared_label_problems(labels: Mapping[int, str], where: str, task: str = "segmentation") -> list[str]:
    """Declared labels must be 0..n-1: the model has one output channel per label, indexed by value.

    The problem names the values missing below the largest, so a sparse ``labels`` (e.g. only the
    structures one scan holds of TotalSegmentator's 117) shows what to add."""
    keys = sorted(labels)
    if keys != list(range(len(keys))):
        what = "label values" if task == "segmentation" else "classes"
        gaps = _missing_values(keys)
        return [
            f"{where}: 'labels' declares {what} {_list(keys)}, which are not 0..{len(keys) - 1}{gaps}; "
            "number them consecutively from 0 (0 = background for segmentation), declaring the values "
            "no case holds too"
        ]
    return []


def label_value_problems(values: np.ndarray, labels: Mapping[int, str], name: str) -> list[str]:
    """Problems with the distinct values of a label volume: not integral, or not declared."""
    values = np.asarray(values)
    problems: list[str] = []
    if not np.issubdtype(values.dtype, np.integer):
        bad = values[~np.isfinite(values) | (values != np.round(values))]
        if bad.size:
            problems.append(
                f"{name}: label values must be integers, found {_list(bad)}; save labels as integers "
                "(they would be truncated, not rounded)"
            )
        values = values[np.isfinite(values) & (values == np.round(values))].astype(np.int64)
    unexpected = [int(v) for v in values if int(v) not in labels]
    if unexpected:
        problems.append(
            f"{name}: label values {_list(unexpected)} are not declared in 'labels' "
            f"({_list(sorted(labels))}); declare them or fix the label volume"
        )
    return problems


def geometry_problems(
    label_shape: Sequence[int],
    label_affine: np.ndarray,
    image_shape: Sequence[int],
    image_affine: np.ndarray,
    name: str,
) -> list[str]:
    """A label volume must share its image's grid: same spatial shape and affine (to 1e-3 mm)."""
    problems = []
    if tuple(label_shape) != tuple(image_shape):
        problems.append(
            f"{name}: label shape {tuple(label_shape)} differs from image spatial shape {tuple(image_shape)}; "
            "resample the label onto its image"
        )
    diff = float(np.max(np.abs(np.asarray(label_affine) - np.asarray(image_affine))))
    if not diff <= AFFINE_TOLERANCE:
        problems.append(
            f"{name}: label affine differs from image affine (max abs difference {diff:.4g} > "
            f"{AFFINE_TOLERANCE:g}); the label is not aligned to its image, copy the image's affine or resample"
        )
    return problems


def class_label_problems(label: Any, labels: Mapping[int, str], name: str) -> list[str]:
    """A classification case's label must be one of the declared classes."""
    if isinstance(label, bool) or not isinstance(label, int | np.integer):
        return [f"{name}: class label {label!r} is not an integer; use a key of 'labels'"]
    if int(label) not in labels:
        return [
            f"{name}: class label {int(label)} is not among the declared classes "
            f"({', '.join(f'{k}={v}' for k, v in sorted(labels.items()))}); fix its 'label' in dataset.json"
        ]
    return []


def _key(path: str) -> str:
    try:
        st = os.stat(path)
        return f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return os.path.normpath(os.path.abspath(path))


def duplicate_problems(
    items: Sequence[Mapping[str, Any]], display: Any = str, split: str = "training"
) -> list[str]:
    """The same image (or label file) listed twice, also under different paths or through links."""
    problems = []
    for key in ("image", "label"):
        seen: dict[str, int] = {}
        for i, item in enumerate(items):
            value = item.get(key)
            if not isinstance(value, str):
                continue
            k = _key(value)
            if k in seen:
                problems.append(
                    f"{display(value)}: the same {key} is listed twice in '{split}' ({split}[{seen[k]}] and "
                    f"{split}[{i}]); a case listed twice is trained twice and may land in validation too. "
                    "Remove the duplicate"
                )
            else:
                seen[k] = i
    return problems


def raise_problems(problems: Sequence[str], hint: str = "") -> None:
    """Raise the first problem as a DataError, saying how many there are in all."""
    if problems:
        more = f" ({len(problems)} problems in all)" if len(problems) > 1 else ""
        raise DataError(f"{problems[0]}{more}{'; ' + hint if hint else ''}")


def check_training_items(
    items: Sequence[Mapping[str, Any]],
    labels: Mapping[int, str],
    task: str,
    where: str,
    hint: str = "",
    cases: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """What ``train`` and ``evaluate`` check before using a labelled set (``validate`` reports the same).

    Declared labels 0..n-1, no duplicate case, and per case (:func:`case_problems`): NIfTI headers
    (size, affine policy), image/label grids equal, label values integral and declared (label voxels
    are read, images are not). ``cases``: the items whose files are checked (default all of
    ``items``); a rank of a multi-rank job checks only the cases it loads.
    """
    problems = declared_label_problems(labels, where, task) + duplicate_problems(items)
    raise_problems(problems + case_problems(items if cases is None else cases, labels, task), hint)


def case_problems(items: Sequence[Mapping[str, Any]], labels: Mapping[int, str], task: str) -> list[str]:
    """The per-case part of :func:`check_training_items`: each case's files, one message per problem."""
    problems: list[str] = []
    for item in items:
        image_path = str(item["image"])
        if task == "classification":
            problems += class_label_problems(item.get("label"), labels, image_path)
            if image_path.endswith(NIFTI_SUFFIXES):
                try:
                    open_nifti(image_path)
                except DataError as exc:
                    problems.append(str(exc))
            continue
        label_path = str(item["label"])
        try:
            if image_path.endswith(NIFTI_SUFFIXES):
                img, image_affine = open_nifti(image_path)
                image_shape = tuple(int(s) for s in img.shape[:3])
            else:  # a DICOM folder: its reader checks the series when it is loaded
                check_input_path(image_path, "image")
                img = None
            label, label_affine = open_nifti(label_path)
            if img is not None:
                label_shape = tuple(int(s) for s in label.shape)
                if len(label_shape) == 4 and label_shape[3] == 1:
                    label_shape = label_shape[:3]
                problems += geometry_problems(
                    label_shape, label_affine, image_shape, image_affine, label_path
                )
            data = np.asanyarray(label.dataobj)
        except DataError as exc:
            problems.append(str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - truncated data surfaces here
            problems.append(
                f"{label_path}: cannot be read as NIfTI ({type(exc).__name__}: {exc}); the file is corrupt or "
                "truncated, re-export or re-copy it"
            )
            continue
        problems += label_value_problems(np.unique(data), labels, label_path)
    return problems

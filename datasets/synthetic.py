"""Deterministic synthetic datasets with real-world geometry, for the demo and the tests.

Segmentation (Medical Segmentation Decathlon layout): blobs from MONAI's ``create_test_image_3d``
drawn on an isotropic 0.8 mm grid inside a body-shaped ellipse, then thinned along z by averaging
``z_factor`` slices (the partial-volume effect of thick CT slices). The result is a CT-like int16
volume in Hounsfield units (air -1000, soft tissue ~20, class 1 ~110, class 2 ~220, Gaussian noise)
with 0.8 x 0.8 x 2.4 mm voxels stored in LPS orientation (the affine flips x and y), as CT converted
from DICOM usually is.

Segmentation, ``modality="mr"``: the same geometry and labels, with MR-like intensities that have no
physical unit. Relative signal: air 0, tissue 1, class 1 (organ) 1.7, class 2 (lesion) 0.55 (darker
than tissue, unlike CT). Each case is multiplied by a smooth bias field ``exp(b(x))`` (``b`` a random
quadratic polynomial of the normalised coordinates, about +-25% over the body, the coil's
non-uniformity), given complex Gaussian noise and stored as its magnitude (Rician noise, so air is not
zero), then scaled by a random per-case factor, log-uniform in [150, 3000] (scanners and protocols
put MR on arbitrary intensity scales). A fixed CT window cannot fit every case; a z-score per image can.

Classification: one object per volume, a ball (class 0) or a randomly rotated cube of the same
volume and intensity (class 1). Mean intensity and object volume do not tell the classes apart; a
3D CNN must look at the shape.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from monai.data import create_test_image_3d
from scipy.ndimage import gaussian_filter
from tqdm import tqdm

from medseg.datasets.decathlon import write_dataset_json
from medseg.datasets.nifti import save_nifti

log = logging.getLogger(__name__)

SEG_LABELS = {"0": "background", "1": "organ", "2": "lesion"}
CLS_LABELS = {"0": "sphere", "1": "cube"}
_HU = {"air": -1000.0, "tissue": 20.0, 1: 110.0, 2: 220.0}
_MR = {"air": 0.0, "tissue": 1.0, 1: 1.7, 2: 0.55}  # relative signal, no unit
MODALITIES = ("ct", "mr")


def _lps_affine(spacing: tuple[float, float, float], shape: tuple[int, int, int]) -> np.ndarray:
    """RAS affine of a volume stored in LPS order (i -> left, j -> posterior), centred near the origin."""
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    affine[:3, 3] = [spacing[0] * shape[0] / 2, spacing[1] * shape[1] / 2, -spacing[2] * shape[2] / 2]
    return affine


@dataclass(frozen=True)
class Scanner:
    """How one hospital's scanner and patients differ from the default synthetic CT.

    Intensities: ``HU' = scale · HU · B(x) + offset + N(0, noise²)``, where B is a smooth
    multiplicative bias field ``1 + bias · b(x)`` with b a low-frequency field scaled to [-1, 1]
    (a coil or beam-hardening shading). Geometry: in-plane voxel size ``spacing`` mm, slices
    ``z_factor`` times thicker, stored in ``orientation`` axis codes (nibabel's, e.g. ``LPS``: the
    voxel array and affine are reoriented together, so the anatomy in world space is unchanged).
    Case mix: a fraction ``small`` of cases holds fewer and smaller structures (3 objects of at most
    size/10 voxels radius instead of 6 of size/6).
    """

    scale: float = 1.0
    offset: float = 0.0
    noise: float = 20.0
    bias: float = 0.0
    spacing: float = 0.8
    z_factor: int = 3
    orientation: str = "LPS"
    small: float = 0.0

    def check(self) -> None:
        from medseg.errors import ConfigError

        if self.scale <= 0 or self.noise < 0 or not 0 <= self.bias < 1 or self.spacing <= 0:
            raise ConfigError(
                f"scanner: scale > 0, noise >= 0, 0 <= bias < 1 and spacing > 0 are required, got {self}"
            )
        if self.z_factor < 1 or not 0.0 <= self.small <= 1.0:
            raise ConfigError(f"scanner: z_factor >= 1 and small in [0, 1] are required, got {self}")
        codes = self.orientation.upper()
        axes = [{"L": 0, "R": 0, "P": 1, "A": 1, "S": 2, "I": 2}.get(c) for c in codes]
        if len(codes) != 3 or None in axes or len(set(axes)) != 3:
            raise ConfigError(
                f"scanner: orientation {self.orientation!r} is not 3 axis codes like LPS or RAS"
            )


# Three hospitals that differ the way real ones do (the preset of `medseg data synth-sites`).
SITE_PRESETS: dict[str, dict[str, Scanner]] = {
    "3-sites": {
        "a": Scanner(),
        "b": Scanner(
            scale=0.75,
            offset=-50.0,
            noise=35.0,
            bias=0.15,
            spacing=0.9,
            z_factor=2,
            orientation="RAS",
            small=0.3,
        ),
        "c": Scanner(
            scale=1.25,
            offset=40.0,
            noise=25.0,
            bias=0.3,
            spacing=0.7,
            z_factor=4,
            orientation="LAS",
            small=0.6,
        ),
    }
}


def _bias_field(rs: np.random.RandomState, shape: tuple[int, ...]) -> np.ndarray:
    """A smooth field in [-1, 1]: heavily blurred noise plus a random linear ramp."""
    field = gaussian_filter(rs.normal(size=shape), sigma=max(shape) / 4)
    ramp = sum(
        rs.uniform(-1, 1) * np.linspace(-1, 1, n).reshape([-1 if i == a else 1 for i in range(3)])
        for a, n in enumerate(shape)
    )
    field = field / (np.abs(field).max() + 1e-9) + ramp
    return field / (np.abs(field).max() + 1e-9)


def _mr_bias_field(rs: np.random.RandomState, shape: tuple[int, ...], strength: float = 0.25) -> np.ndarray:
    """exp(b) with b a random quadratic polynomial of coordinates in [-1, 1], |b| <= about ``strength``."""
    axes = np.meshgrid(*[np.linspace(-1.0, 1.0, n) for n in shape], indexing="ij")
    terms = [np.ones(shape)] + list(axes) + [a * b for i, a in enumerate(axes) for b in axes[i:]]
    coeffs = rs.uniform(-1.0, 1.0, len(terms))
    field = sum(c * t for c, t in zip(coeffs, terms))
    field *= strength / max(float(np.abs(field).max()), 1e-6)
    return np.exp(field)


def _seg_case(
    rs: np.random.RandomState,
    size: int,
    z_factor: int,
    noise: float,
    scanner: Scanner | None = None,
    modality: str = "ct",
) -> tuple[np.ndarray, np.ndarray]:
    """One CT-like (or MR-like) volume and its label map (2 foreground classes, both present)."""
    small = scanner is not None and scanner.small > 0 and rs.uniform() < scanner.small
    while True:
        _, labels = create_test_image_3d(
            size,
            size,
            size,
            num_objs=3 if small else 6,
            rad_max=size // 10 if small else size // 6,
            rad_min=size // 14,
            num_seg_classes=2,
            random_state=rs,
        )
        x, y = np.ogrid[:size, :size]
        c = (size - 1) / 2
        body2d = ((x - c) / (0.48 * size)) ** 2 + ((y - c) / (0.42 * size)) ** 2 <= 1.0
        labels = labels * body2d[:, :, None]
        if {1, 2} <= set(np.unique(labels).tolist()):
            break
    values = _MR if modality == "mr" else _HU
    image = np.full(labels.shape, values["air"], dtype=np.float32)
    image[np.broadcast_to(body2d[:, :, None], labels.shape)] = values["tissue"]
    for cls in (1, 2):
        image[labels == cls] = values[cls]
    image = gaussian_filter(image, sigma=0.8)
    # Thick slices: average groups of z_factor thin slices; the label takes the middle one.
    depth = size // z_factor
    image = image[:, :, : depth * z_factor].reshape(size, size, depth, z_factor).mean(axis=3)
    labels = labels[:, :, z_factor // 2 :: z_factor][:, :, :depth]
    if modality == "mr":
        image = image * _mr_bias_field(rs, image.shape)
        sigma = 0.06  # of the tissue signal; magnitude of complex noise: Rician
        image = np.hypot(image + rs.normal(0.0, sigma, image.shape), rs.normal(0.0, sigma, image.shape))
        scale = float(np.exp(rs.uniform(np.log(150.0), np.log(3000.0))))
        return np.round(image * scale).astype(np.int16), labels.astype(np.uint8)
    if scanner is not None:
        field = 1.0 + scanner.bias * _bias_field(rs, image.shape) if scanner.bias else 1.0
        image = scanner.scale * image * field + scanner.offset
    image += rs.normal(0.0, noise, image.shape)
    return np.clip(np.round(image), -1024, 3071).astype(np.int16), labels.astype(np.uint8)


def _finish(
    out: Path,
    name: str,
    task: str,
    description: str,
    labels: dict,
    training: list,
    test: list,
    modality: str = "CT",
) -> Path:
    """Write ``dataset.json`` for the cases already saved under ``out``."""
    write_dataset_json(
        out,
        {
            "name": name,
            "description": description,
            "task": task,
            "tensorImageSize": "3D",
            "modality": {"0": modality},
            "labels": labels,
            "numTraining": len(training),
            "numTest": len(test),
            "training": training,
            "test": test,
        },
    )
    log.info("wrote %d training and %d test cases to %s", len(training), len(test), out)
    return out


def make_seg_dataset(
    out_dir: str | Path,
    n_train: int = 16,
    n_test: int = 2,
    seed: int = 0,
    size: int = 96,
    z_factor: int = 3,
    noise: float = 20.0,
    scanner: Scanner | None = None,
    modality: str = "ct",
) -> Path:
    """Write a synthetic CT (or, with ``modality="mr"``, MR) segmentation dataset in Decathlon layout.

    ``scanner`` (:class:`Scanner`) changes intensities, noise, bias field, voxel size, orientation
    and case mix; its ``noise`` and ``z_factor`` then replace the arguments of the same name."""
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
    out = Path(out_dir)
    rs = np.random.RandomState(seed)
    if scanner is not None:
        scanner.check()
        z_factor, noise = scanner.z_factor, scanner.noise
    inplane = scanner.spacing if scanner is not None else 0.8
    spacing = (inplane, inplane, inplane * z_factor)
    training, test = [], []
    for i in tqdm(range(n_train + n_test), desc="synth-seg", unit="case", leave=False):
        image, label = _seg_case(rs, size, z_factor, noise, scanner, modality)
        affine = _lps_affine(spacing, image.shape)
        if scanner is not None and scanner.orientation.upper() != "LPS":
            image, label, affine = _reorient(image, label, affine, scanner.orientation.upper())
        name = f"synth_{i:03d}.nii.gz"
        if i < n_train:
            save_nifti(image, affine, out / "imagesTr" / name)
            save_nifti(label, affine, out / "labelsTr" / name)
            training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
        else:
            save_nifti(image, affine, out / "imagesTs" / name)
            test.append(f"./imagesTs/{name}")
    kind = "MR (bias field, Rician noise, arbitrary scale per case)" if modality == "mr" else "CT"
    description = (
        f"medseg synthetic {kind}, seed {seed}: 2 blob classes in a body, "
        f"{inplane:g}x{inplane:g}x{spacing[2]:.1f} mm, {scanner.orientation if scanner else 'LPS'}"
        + (f", scanner {asdict(scanner)}" if scanner is not None else "")
    )
    name = "SynthMR" if modality == "mr" else "SynthCT"
    return _finish(
        out, name, "segmentation", description, SEG_LABELS, training, test, modality=modality.upper()
    )


def _reorient(
    image: np.ndarray, label: np.ndarray, affine: np.ndarray, codes: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Store the same volume in ``codes`` axis order: array and affine change together."""
    import nibabel as nib

    now = nib.orientations.io_orientation(affine)
    want = nib.orientations.axcodes2ornt(tuple(codes))
    tr = nib.orientations.ornt_transform(now, want)
    new_affine = affine @ nib.orientations.inv_ornt_aff(tr, image.shape)
    image = nib.orientations.apply_orientation(image, tr)
    label = nib.orientations.apply_orientation(label, tr)
    return np.ascontiguousarray(image), np.ascontiguousarray(label), new_affine


def make_site_datasets(
    out_dir: str | Path,
    preset: str = "3-sites",
    n_train: int = 12,
    n_test: int = 6,
    seed: int = 0,
    size: int = 96,
) -> dict[str, dict[str, Path]]:
    """Write each site of a preset: ``<out>/<site>`` (labelled training cases) and ``<out>/<site>-test``
    (labelled held-out cases, never trained on). Returns {site: {"train": dir, "test": dir}}."""
    from medseg.errors import ConfigError

    if preset not in SITE_PRESETS:
        raise ConfigError(f"--preset: {preset!r} is not one of {', '.join(SITE_PRESETS)}")
    out = Path(out_dir)
    made: dict[str, dict[str, Path]] = {}
    for i, (site, scanner) in enumerate(SITE_PRESETS[preset].items()):
        made[site] = {
            "train": make_seg_dataset(out / site, n_train, 0, seed * 100 + i, size, scanner=scanner),
        }
        if n_test:
            made[site]["test"] = make_seg_dataset(
                out / f"{site}-test", n_test, 0, seed * 100 + 50 + i, size, scanner=scanner
            )
    return made


def scanner_with(base: Scanner | None, **changes: object) -> Scanner:
    """``base`` (default scanner when None) with the given fields changed (None values ignored)."""
    return replace(base or Scanner(), **{k: v for k, v in changes.items() if v is not None})


def _cls_case(rs: np.random.RandomState, cls: int, size: int, noise: float) -> np.ndarray:
    """A soft-tissue volume holding one ball (cls 0) or one rotated cube of equal volume (cls 1)."""
    radius = rs.uniform(0.22, 0.32) * size
    centre = rs.uniform(0.42, 0.58, size=3) * (size - 1)
    grid = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), axis=-1) - centre
    if cls == 0:
        inside = np.linalg.norm(grid, axis=-1) <= radius
    else:
        q, _ = np.linalg.qr(rs.normal(size=(3, 3)))  # random rotation
        half = radius * (4 * np.pi / 3) ** (1 / 3) / 2
        inside = np.abs(grid @ q).max(axis=-1) <= half
    image = np.where(inside, 120.0, _HU["tissue"]).astype(np.float32)
    image = gaussian_filter(image, sigma=0.7) + rs.normal(0.0, noise, image.shape)
    return np.round(image).astype(np.int16)


def make_cls_dataset(
    out_dir: str | Path,
    n_train: int = 160,
    n_test: int = 2,
    seed: int = 0,
    size: int = 32,
    noise: float = 20.0,
) -> Path:
    """Write a synthetic shape-classification dataset (dataset.json with integer labels)."""
    out = Path(out_dir)
    rs = np.random.RandomState(seed)
    spacing = (1.0, 1.0, 1.0)
    training, test = [], []
    for i in tqdm(range(n_train + n_test), desc="synth-cls", unit="case", leave=False):
        cls = i % 2
        image = _cls_case(rs, cls, size, noise)
        affine = _lps_affine(spacing, image.shape)
        name = f"shape_{i:03d}.nii.gz"
        if i < n_train:
            save_nifti(image, affine, out / "imagesTr" / name)
            training.append({"image": f"./imagesTr/{name}", "label": cls})
        else:
            save_nifti(image, affine, out / "imagesTs" / name)
            test.append(f"./imagesTs/{name}")
    description = f"medseg synthetic shapes, seed {seed}: ball vs rotated cube of equal volume"
    return _finish(out, "SynthShapes", "classification", description, CLS_LABELS, training, test)

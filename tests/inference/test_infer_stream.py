"""The streaming path for big NIfTI inputs (``medseg.inference.io``): same labels, input never loaded.

Forced on small files (``stream_above=0``, a chunk budget of a few slices) so that the model grid is
built from many slabs; compared with the loaded path on the same file with exact equality, on
grids that the model down- and up-samples (anisotropic), stored flipped (LPS) and with permuted axes
(the file's slowest axis is then another model axis, read backwards).
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from medseg.bench.infer_cases import make_bundle, synthetic_ct
from medseg.bundle.load import load_bundle
from medseg.errors import DataError
from medseg.inference import io as inference_io
from medseg.inference import memory
from medseg.inference.io import LazyVolume, SlabReader, load_image
from medseg.inference.predict import infer_to_file, predict
from medseg.inference.segment import model_input


@pytest.fixture(scope="module")
def bundle_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("stream-bundles")
    return {c: make_bundle(root, c, seed=c) for c in (3, 14)}


@pytest.fixture(scope="module")
def bundles(bundle_dirs: dict[int, Path]) -> dict[int, object]:
    return {c: load_bundle(p) for c, p in bundle_dirs.items()}


def _write(path: Path, data: np.ndarray, affine: np.ndarray, slope: float | None = None) -> Path:
    img = nib.Nifti1Image(data, affine)
    img.set_sform(affine, code=1)
    img.set_qform(affine, code=1)
    if slope is not None:
        img.header.set_slope_inter(slope, -7.25)
    nib.save(img, str(path))
    return path


def _ct(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    return synthetic_ct(shape, seed=seed)[0].numpy().astype(np.int16)


GEOMETRIES = {
    # axial CT as stored from DICOM: LPS (x and y flipped), 0.78 mm in-plane: the model grid is coarser
    "lps-fine": (np.diag([-0.78, -0.78, 1.0]), None),
    # an anisotropic grid, 2.25 x 1.8 x 3 mm: the model grid is finer (upsampling)
    "coarse-anisotropic": (np.diag([2.25, 1.8, 3.0]), None),
    # stored (k, i, j) with k flipped: the file's slowest axis is model axis 1 (A-P), read backwards
    "permuted-flipped": (np.array([[0.9, 0, 0], [0, 0, -1.3], [0, 1.1, 0]]), (0, 2, 1)),
}


def _file(tmp_path: Path, geometry: str, seed: int, gz: bool = True, slope: float | None = None) -> Path:
    linear, permute = GEOMETRIES[geometry]
    data = _ct((52, 44, 24), seed)
    if permute is not None:
        data = np.ascontiguousarray(data.transpose(permute))
    affine = np.eye(4)
    affine[:3, :3] = linear
    affine[:3, 3] = [-20.0, 15.0, -30.0]
    return _write(tmp_path / f"{geometry}.nii{'.gz' if gz else ''}", data, affine, slope)


@pytest.mark.parametrize("classes", [3, 14])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_streamed_labels_equal_loaded_labels(
    bundles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, classes: int, geometry: str
) -> None:
    path = _file(tmp_path, geometry, seed=classes)
    bundle = bundles[classes]
    loaded = load_image(path)
    lazy = load_image(path, stream_above=0)
    assert isinstance(lazy, LazyVolume) and not isinstance(loaded, LazyVolume)
    assert tuple(lazy.shape) == tuple(loaded.shape)
    assert np.array_equal(np.asarray(lazy.affine), np.asarray(loaded.affine))
    # a chunk budget of a few input slices: the model grid is built from many slabs
    plane = lazy.spatial[0] * lazy.spatial[1]
    monkeypatch.setattr(inference_io, "STREAM_SLAB_BYTES", 64 * plane)
    x_loaded, aff_loaded = model_input(bundle.config, loaded)
    x_lazy, aff_lazy = model_input(bundle.config, lazy)
    assert np.array_equal(aff_loaded, aff_lazy)
    assert torch.equal(x_loaded, x_lazy)  # the model input, bit for bit
    want = predict(bundle, loaded).label
    got = predict(bundle, lazy).label
    assert torch.equal(got.as_tensor(), want.as_tensor())
    assert np.array_equal(np.asarray(got.affine), np.asarray(want.affine))
    assert len(torch.unique(want)) >= min(classes, 3)  # not trivially one label


def test_streamed_reads_every_slice_once_in_many_slabs(
    bundles, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Chunks visit the file's slices in increasing order, each read at most once, a few at a time."""
    for geometry in GEOMETRIES:
        lazy = load_image(_file(tmp_path, geometry, seed=1), stream_above=0)
        reads: list[tuple[int, int]] = []
        real = LazyVolume.slices

        def spy(self, k0: int, k1: int, reads=reads, real=real):  # noqa: ANN001, ANN202
            reads.append((k0, k1))
            return real(self, k0, k1)

        monkeypatch.setattr(LazyVolume, "slices", spy)
        plane = lazy.spatial[0] * lazy.spatial[1]
        monkeypatch.setattr(inference_io, "STREAM_SLAB_BYTES", 64 * plane)
        model_input(bundles[3].config, lazy)
        monkeypatch.undo()
        k = lazy.spatial[2]
        assert len(reads) > 3, geometry
        assert [r[0] for r in reads] == sorted(r[0] for r in reads), geometry
        covered = [s for k0, k1 in reads for s in range(k0, k1)]
        # each at most once (slices between two model rows' reach may be skipped), in increasing order
        assert covered == sorted(set(covered)), geometry
        assert max(k1 - k0 for k0, k1 in reads) < k // 2, geometry


def test_streamed_scaled_uncompressed_file_equals_loaded(bundles, tmp_path: Path) -> None:
    """A .nii with slope/intercept: the slabs are scaled as nibabel scales the whole array."""
    path = _file(tmp_path, "lps-fine", seed=5, gz=False, slope=0.5)
    cfg = bundles[3].config
    x_loaded, _ = model_input(cfg, load_image(path))
    x_lazy, _ = model_input(cfg, load_image(path, stream_above=0))
    assert torch.equal(x_loaded, x_lazy)


def test_threshold_decides_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, "lps-fine", seed=2)
    n = 52 * 44 * 24
    assert isinstance(load_image(path, stream_above=n - 1), LazyVolume)
    assert not isinstance(load_image(path, stream_above=n), LazyVolume)
    assert not isinstance(load_image(path), LazyVolume)  # the viewer and evaluate load
    monkeypatch.delenv("MEDSEG_STREAM_VOXELS", raising=False)
    assert inference_io.stream_threshold() == inference_io.STREAM_VOXELS
    monkeypatch.setenv("MEDSEG_STREAM_VOXELS", "123")
    assert inference_io.stream_threshold() == 123
    assert inference_io.stream_threshold(7) == 7
    monkeypatch.setenv("MEDSEG_STREAM_VOXELS", "lots")
    with pytest.raises(DataError, match="MEDSEG_STREAM_VOXELS"):
        inference_io.stream_threshold()
    with pytest.raises(DataError, match="stream-above"):
        inference_io.stream_threshold(-1)


def test_infer_writes_the_same_file_streamed(
    bundle_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _file(tmp_path, "coarse-anisotropic", seed=3)
    bundle_dir = bundle_dirs[3]
    reads: list[int] = []
    real = LazyVolume.slices

    def spy(self, k0: int, k1: int):  # noqa: ANN001, ANN202
        reads.append(k1 - k0)
        return real(self, k0, k1)

    monkeypatch.setattr(LazyVolume, "slices", spy)
    a = infer_to_file(bundle_dir, src, tmp_path / "loaded.nii.gz", stream_above=10**12)
    assert reads == []  # below the threshold: loaded
    b = infer_to_file(bundle_dir, src, tmp_path / "streamed.nii.gz", stream_above=0)
    assert sum(reads) > 0  # above it: streamed
    la, lb = nib.load(str(a)), nib.load(str(b))
    assert np.array_equal(np.asarray(la.dataobj), np.asarray(lb.dataobj))
    assert np.array_equal(la.affine, lb.affine)
    assert len(np.unique(np.asarray(lb.dataobj))) >= 2


def test_non_finite_voxel_in_a_streamed_input_is_a_data_error(bundles, tmp_path: Path) -> None:
    data = _ct((40, 36, 20), 4).astype(np.float32)
    data[3, 4, 17] = np.nan
    path = _write(tmp_path / "nan.nii.gz", data, np.diag([1.0, 1.0, 2.0, 1.0]))
    lazy = load_image(path, stream_above=0)
    with pytest.raises(DataError, match="NaN or infinite"):
        predict(bundles[3], lazy)


def test_estimate_of_the_streamed_path_leaves_the_input_out(bundles, tmp_path: Path) -> None:
    """Streamed: no float32 input; the difference to the loaded estimate is the input's 4 bytes per voxel."""
    path = _file(tmp_path, "lps-fine", seed=6)
    cfg = bundles[14].config
    loaded = memory.estimate(cfg, load_image(path), 14)
    lazy = memory.estimate(cfg, load_image(path, stream_above=0), 14)
    n_in = 52 * 44 * 24
    assert loaded.input_bytes == 4 * n_in and lazy.input_bytes == 0
    assert lazy.stream_bytes == loaded.stream_bytes
    # at whole-body size the streamed estimate is what the 8 GB target is checked against
    big = LazyVolume.__new__(LazyVolume)
    big.spatial, big.shape = (512, 512, 1000), (1, 512, 512, 1000)
    big.affine = torch.as_tensor(np.diag([-0.78, -0.78, 1.0, 1.0]))
    big.stored_itemsize = 2
    est = memory.estimate(cfg, big, 14)
    assert est.input_bytes == 0
    assert est.peak_bytes < 8 * 2**30
    assert est.peak_bytes == est.base_bytes + max(est.preprocess_bytes, est.stream_bytes)


def test_slab_reader_refuses_nothing_it_was_asked_in_order(tmp_path: Path) -> None:
    path = _file(tmp_path, "lps-fine", seed=7, gz=False)
    lazy = load_image(path, stream_above=0)
    whole = torch.from_numpy(np.asanyarray(nib.load(str(path)).dataobj).astype(np.float32))[None]
    reader = SlabReader(lazy)
    for k0, k1 in [(0, 3), (2, 6), (2, 9), (8, 24)]:
        assert torch.equal(reader(k0, k1), whole[..., k0:k1])
    assert reader.reads == 24

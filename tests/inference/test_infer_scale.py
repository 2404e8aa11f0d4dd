"""Inference that scales: labels equal to the reference path, memory checked before starting.

The reference path (C probability maps inverted by ``Invertd``, argmax after; the benchmark's
``old`` variant) is ``medseg.bench.infer_reference.predict_reference``; :func:`medseg.inference.predict.predict`
must give the same labels on every voxel, for 3 and 14 classes, for inputs that the model grid down- or up-samples, that are
stored flipped, permuted or oblique. Its parts are checked on their own: the slabbed sliding window
against MONAI's ``sliding_window_inference`` (``torch.equal``), the streamed inversion against the
whole-grid one, the memory estimate against the 10% class-growth bound, and the benchmark's
label target against differences away from near-ties.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.data import MetaTensor

from medseg import sysinfo
from medseg.bench.infer_cases import make_bundle, synthetic_ct
from medseg.bench.infer_reference import compare_labels, predict_reference
from medseg.bundle.load import load_bundle
from medseg.errors import DataError
from medseg.inference import memory
from medseg.inference.io import load_image
from medseg.inference.predict import predict
from medseg.inference.resample import StreamInverter, as_axis_map, invert_argmax, voxel_map
from medseg.inference.sliding import buffer_rows, sliding_window_slabs


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[int, object]:
    root = tmp_path_factory.mktemp("scale-bundles")
    return {c: load_bundle(make_bundle(root, c, seed=c)) for c in (3, 14)}


def _rotation(deg: float) -> np.ndarray:
    t = math.radians(deg)
    return np.array([[math.cos(t), -math.sin(t), 0], [math.sin(t), math.cos(t), 0], [0, 0, 1.0]])


def _with_affine(
    image: MetaTensor, linear: np.ndarray, permute: tuple[int, int, int] | None = None
) -> MetaTensor:
    data = image.as_tensor()
    if permute is not None:
        data = data.permute(0, *(1 + p for p in permute)).contiguous()
    affine = np.eye(4)
    affine[:3, :3] = linear
    affine[:3, 3] = [-20.0, 15.0, -30.0]
    return MetaTensor(data, affine=torch.as_tensor(affine), meta={"filename_or_obj": "synthetic"})


GEOMETRIES = {
    # CT as stored from DICOM: LPS, 0.78 mm in-plane: the model grid is coarser (downsampling).
    "lps-fine": lambda img: img,
    # An anisotropic grid, 2.25 x 1.8 x 3 mm: the model grid is finer (upsampling).
    "coarse-anisotropic": lambda img: _with_affine(img, np.diag([2.25, 1.8, 3.0])),
    # Stored with axes permuted (k, i, j) and one flipped: orientation undoes a permutation.
    "permuted": lambda img: _with_affine(
        img, np.array([[0, 0, -1.1], [0.9, 0, 0], [0, 1.3, 0]]), permute=(1, 2, 0)
    ),
    # Oblique acquisition, rotated 17 degrees in-plane.
    "oblique": lambda img: _with_affine(img, _rotation(17) @ np.diag([0.9, 0.9, 2.0])),
}


@pytest.mark.parametrize("classes", [3, 14])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_labels_equal_reference_path(bundles, classes: int, geometry: str) -> None:
    bundle = bundles[classes]
    image = GEOMETRIES[geometry](synthetic_ct((52, 44, 24), seed=classes))
    old = predict_reference(bundle, image)
    new = predict(bundle, image).label
    assert tuple(new.shape[1:]) == tuple(image.shape[1:])
    assert np.allclose(np.asarray(new.affine), np.asarray(image.affine))
    cmp = compare_labels(old.numpy(), new[0].numpy(), classes)
    assert cmp["classes_present"] >= min(classes, 3)  # the comparison is not trivially all-background
    assert cmp["differing_voxels"] == 0, cmp


def test_labels_equal_reference_path_on_trained_demo_holdout(seg_run, seg_data: Path) -> None:
    """The tiny trained run of conftest on its dataset's cases: Dice 1.0 between the two paths."""
    from medseg.bundle.load import load_bundle as load

    bundle = load(seg_run.run_dir)
    cases = json.loads((seg_data / "dataset.json").read_text())["training"][:3]
    for item in cases:
        image = load_image(seg_data / item["image"])
        old = predict_reference(bundle, image)
        new = predict(bundle, image).label[0]
        cmp = compare_labels(old.numpy(), new.numpy(), len(bundle.labels))
        assert cmp["differing_voxels"] == 0 and cmp["min_dice"] == 1.0, (item["image"], cmp)
        assert cmp["classes_present"] == len(bundle.labels)


def test_comparison_detects_a_wrong_inversion(bundles) -> None:
    """Nearest instead of trilinear in the reference: the equality check must see the difference."""
    bundle = bundles[14]
    image = synthetic_ct((52, 44, 24), seed=1)
    wrong = predict_reference(bundle, image, mode="nearest")
    new = predict(bundle, image).label[0]
    assert compare_labels(wrong.numpy(), new.numpy(), 14)["differing_voxels"] > 0


def _small_net(classes: int) -> torch.nn.Module:
    """Two real 3D convolutions, seeded: outputs vary with position and window contents."""
    torch.manual_seed(classes)
    return torch.nn.Sequential(
        torch.nn.Conv3d(1, 6, 3, padding=1), torch.nn.PReLU(), torch.nn.Conv3d(6, classes, 3, padding=1)
    ).eval()


SW_CASES = {
    # shape, roi, sw_batch_size, overlap, mode
    "gaussian-batch8": ((37, 29, 21), (12, 10, 8), 8, 0.25, "gaussian"),
    "constant-batch1": ((30, 22, 17), (8, 8, 8), 1, 0.5, "constant"),
    "gaussian-batch3-overlap0.6": ((41, 18, 20), (10, 6, 9), 3, 0.6, "gaussian"),
    # smaller than the window along two axes: MONAI pads, then crops back
    "padded": ((26, 7, 5), (8, 10, 6), 2, 0.25, "gaussian"),
    # batches that span several first-axis window starts
    "thin-batch5": ((33, 9, 8), (6, 8, 8), 5, 0.25, "gaussian"),
}


@pytest.mark.parametrize("case", list(SW_CASES))
def test_slabbed_sliding_window_equals_monai_exactly(case: str) -> None:
    """Concatenated slabs == MONAI's sliding_window_inference, bit for bit, with a bounded buffer."""
    from monai.inferers import sliding_window_inference

    shape, roi, batch, overlap, mode = SW_CASES[case]
    net = _small_net(5)
    x = torch.randn(1, 1, *shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = sliding_window_inference(x, roi, batch, net, overlap=overlap, mode=mode)[0]
        starts, blocks = [], []
        for start, block in sliding_window_slabs(x, roi, batch, net, overlap=overlap, mode=mode):
            starts.append(start)
            blocks.append(block.clone())
    got = torch.cat(blocks, 1)
    assert got.shape == ref.shape
    assert torch.equal(got, torch.as_tensor(ref)), (got - ref).abs().max()
    assert starts == [0, *np.cumsum([b.shape[1] for b in blocks])[:-1].tolist()]
    assert len(blocks) > 1  # really handed over in slabs
    assert buffer_rows(shape, roi, overlap, batch) < max(shape[0], roi[0])


def test_slab_buffer_depth_does_not_grow_with_the_volume() -> None:
    """The rolling buffers' depth depends on the window and batch, not on the first axis' length."""
    depths = {buffer_rows((n, 250, 125), (32, 32, 16), 0.25, 8) for n in (100, 250, 800)}
    # one window (32 rows) plus one scan interval (24): batches of 8 straddle two window starts
    assert depths == {32 + 24}


def test_stream_inverter_equals_whole_grid_inversion() -> None:
    """Slabs fed in order (odd sizes, one row, all at once) give invert_argmax's labels on every voxel."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(2 * torch.randn(6, 13, 9, 7, generator=gen), 0)
    maps = {
        "flipped-down": np.diag([-0.45, 0.5, 0.4, 1.0]),
        "up": np.diag([1.7, 1.2, 2.1, 1.0]),
        "permuted": np.array([[0, 0, 0.7, 0], [-0.6, 0, 0, 0], [0, 0.45, 0, 0], [0, 0, 0, 1.0]]),
    }
    offsets = {"flipped-down": [12.3, 0.2, -0.3], "up": [-0.4, 0.1, 0.2], "permuted": [0.3, 8.2, 0.1]}
    for name, m in maps.items():
        m = m.copy()
        m[:3, 3] = offsets[name]
        out_shape = tuple(
            int(abs(probs.shape[1 + int(np.argmax(np.abs(m[:3, a])))] / np.abs(m[:3, a]).max()))
            for a in range(3)
        )
        whole = invert_argmax(probs, m, out_shape)
        for cuts in ([13], [1] * 13, [4, 1, 5, 3], [2, 11]):
            inv = StreamInverter(m, tuple(probs.shape[1:]), out_shape, budget=4096)
            start = 0
            for rows in cuts:
                inv.feed(start, probs[:, start : start + rows])
                start += rows
            assert torch.equal(inv.result(), whole), (name, cuts)
        with pytest.raises(RuntimeError, match="incomplete"):
            inv = StreamInverter(m, tuple(probs.shape[1:]), out_shape)
            inv.feed(0, probs[:, :2])
            inv.result()


def test_slab_size_does_not_change_labels() -> None:
    """(1) is per voxel: one-row slabs, odd slabs and the whole grid at once agree."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(14, 9, 7, 5, generator=gen), 0)
    m = voxel_map(np.diag([1.6, 1.6, 2.4, 1.0]), np.diag([-0.7, 0.8, 1.0, 1.0]) + np.eye(4) * 0)
    m[:3, 3] = [6.0, 0.3, -0.4]
    whole = invert_argmax(probs, m, (20, 15, 12), slab=20)
    for slab in (1, 3, 7):
        assert torch.equal(invert_argmax(probs, m, (20, 15, 12), slab=slab), whole)


def test_separable_and_grid_sample_inversions_agree() -> None:
    """The separable form of (1) against grid_sample (the general path) on the same map."""
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(3 * torch.randn(5, 11, 9, 6, generator=gen), 0)
    m = np.array([[0, 0.55, 0, 0.2], [-0.6, 0, 0, 8.1], [0, 0, 0.45, -0.3], [0, 0, 0, 1]])
    assert as_axis_map(m) is not None
    sep = invert_argmax(probs, m, (15, 19, 14))
    sheared = m.copy()
    sheared[0, 0] = 1e-3  # no longer a scaled permutation: grid_sample path
    assert as_axis_map(sheared) is None
    gs = invert_argmax(probs, sheared, (15, 19, 14))
    ref = invert_argmax(probs, m + 0.0, (15, 19, 14))
    assert torch.equal(sep, ref)
    # The shear moves coordinates by at most 0.015 voxel: a handful of near-tie voxels may change.
    assert (gs != sep).float().mean() < 0.02


def test_memory_check_names_the_numbers(bundles, monkeypatch: pytest.MonkeyPatch) -> None:
    image = synthetic_ct((40, 40, 20))
    monkeypatch.setattr(sysinfo, "available_memory", lambda: 1)
    with pytest.raises(
        DataError, match=r"would need about [0-9.]+ GB at its peak .* only 0.0 GB are available"
    ):
        predict(bundles[3], image)


def test_estimate_grows_with_model_voxels_not_input_voxels(bundles) -> None:
    """Predicted peak for 512x512x300 (only the header is made): what classes add is model-grid only."""
    from medseg.bench.infer_reference import old_peak_bytes

    big = MetaTensor(
        torch.empty(1, 1, 1, 1).expand(1, 512, 512, 300),
        affine=torch.diag(torch.tensor([-0.78, -0.78, 1.0, 1.0])),
    )
    e3 = memory.estimate(bundles[3].config, big, 3)
    e14 = memory.estimate(bundles[14].config, big, 14)
    n_model = math.prod(memory.model_grid_shape(bundles[3].config, big))
    growth = e14.peak_bytes - e3.peak_bytes
    assert 0 < growth < 4 * 11 * n_model / 3  # well under 11 more float32 maps of the model grid
    assert growth < 0.1 * e3.peak_bytes  # the target: < 10% from 3 to 14 classes
    assert growth < 0.1 * (old_peak_bytes(512 * 512 * 300, 14) - old_peak_bytes(512 * 512 * 300, 3))
    assert e3.peak_bytes < 1.5 * 2**30


def test_bench_infer_quick_smoke(tmp_path: Path) -> None:
    """A small version of ``medseg bench infer``: each variant in a child, labels compared to old."""
    from medseg.bench.infer import bench_infer, check_targets, format_table

    result = bench_infer(tmp_path / "bench", quick=True, rounds=1, sizes=[(48, 40, 20)], classes=(3,))
    case = result["cases"][0]
    assert set(case["variants"]) == {"old", "new", "new-stream", "new-fp16"}
    assert case["variants"]["new"]["vs_old"]["differing_voxels"] == 0
    assert case["variants"]["new-stream"]["vs_old"]["differing_voxels"] == 0
    assert case["variants"]["new"]["peak_bytes"] > case["variants"]["new"]["runs"][0]["input_bytes"]
    checks = dict(check_targets(result))
    assert [ok for name, ok in checks.items() if name.startswith("new and new-stream labels equal old")] == [
        True
    ]
    assert "| 48x40x20 | 3 | new |" in format_table(result)


def test_label_target_fails_beyond_near_ties() -> None:
    """The label target accepts differing voxels only at near-ties of old's probabilities."""
    from medseg.bench.infer import check_targets
    from medseg.bench.infer_reference import TIE_TOLERANCE, top2_margin

    a = np.zeros((6, 5, 4), np.uint8)
    probs = torch.zeros(3, 6, 5, 4)
    probs[0], probs[1] = 0.6, 0.4
    probs[:, 2, 3, 1] = torch.tensor([0.5 + TIE_TOLERANCE / 4, 0.5 - TIE_TOLERANCE / 4, 0.0])  # a near-tie
    margin = top2_margin(probs, step=3).numpy()
    assert np.isclose(margin[0, 0, 0], 0.2) and margin[2, 3, 1] < TIE_TOLERANCE

    def label_target(b: np.ndarray) -> bool:
        cmp = compare_labels(a, b, 3, margin)
        result = {"cases": [{"shape": [6, 5, 4], "classes": 3, "variants": {"new": {"vs_old": cmp}}}]}
        return dict((name[:35], ok) for name, ok in check_targets(result))[
            "new and new-stream labels equal old"
        ]

    assert label_target(a.copy())
    tie = a.copy()
    tie[2, 3, 1] = 1
    assert label_target(tie)  # differs only where old was undecided
    clear = tie.copy()
    clear[0, 0, 0] = 1
    assert not label_target(clear)  # differs where old's gap was 0.2

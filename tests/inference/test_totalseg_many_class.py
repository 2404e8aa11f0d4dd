"""Real many-class data end to end: TotalSegmentator's example CT (117 classes) and MR (50 classes).

The scans and their label maps are TotalSegmentator's test references, read from the shared folder
(``../shared/data/totalseg-examples``, never copied into the repository). Each test dataset is a
Decathlon folder in a temporary directory: case ``a`` is a symlink to the shared files, case ``b``
the same scan stored in another voxel order (same world geometry), because medseg refuses a case
listed twice. ``dataset.json`` names every class of TotalSegmentator's class map (``total`` for CT,
``total_mr`` for MR, from ``totalsegmentator/map_to_binary.py``), most of them absent from the scan,
and the CT's keys are written in string order ("0", "1", "10", "100", ...) as ``json.dumps(...,
sort_keys=True)`` writes them, so nothing may rely on the file's key order.

What is checked, always against references computed here (nibabel's reading of the files, the
dataset.json written here), not against medseg's own helpers:

- sparse label numbers: values up to 117 pass validation and the fingerprint; the network has one
  output channel per declared label; a written label value is the declared label number of the
  class (a pointwise stand-in network predicts known classes at known voxels);
- classes named in dataset.json but absent from the case are reported as absent (None), not as a
  Dice of 0 or an HD95 of 0 mm, in training's validation metrics and in ``medseg evaluate``;
- geometry: the label map written by ``medseg infer`` has the input's shape, affine (exactly) and
  sform/qform codes, for the RAS CT and the LPS MR;
- names: evaluate's per-class keys, the bundle's metadata and the viewer's legend give each label
  number its TotalSegmentator name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch

from medseg.bundle.load import load_bundle
from medseg.cli.main import main
from medseg.config import config_from_dict
from medseg.planning.fingerprint import fingerprint
from medseg.training.loop import train

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "totalseg-examples"

pytestmark = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=f"TotalSegmentator example data not found at {SHARED} (the shared data folder beside the repository)",
)

# TotalSegmentator's class maps, totalsegmentator/map_to_binary.py (commit 0e65a44): class_map["total"]
# (CT, labels 1..117) and class_map["total_mr"] (MR, labels 1..50), in label order.
TOTAL = (
    "spleen kidney_right kidney_left gallbladder liver stomach pancreas adrenal_gland_right "
    "adrenal_gland_left lung_upper_lobe_left lung_lower_lobe_left lung_upper_lobe_right "
    "lung_middle_lobe_right lung_lower_lobe_right esophagus trachea thyroid_gland small_bowel duodenum "
    "colon urinary_bladder prostate kidney_cyst_left kidney_cyst_right sacrum vertebrae_S1 vertebrae_L5 "
    "vertebrae_L4 vertebrae_L3 vertebrae_L2 vertebrae_L1 vertebrae_T12 vertebrae_T11 vertebrae_T10 "
    "vertebrae_T9 vertebrae_T8 vertebrae_T7 vertebrae_T6 vertebrae_T5 vertebrae_T4 vertebrae_T3 "
    "vertebrae_T2 vertebrae_T1 vertebrae_C7 vertebrae_C6 vertebrae_C5 vertebrae_C4 vertebrae_C3 "
    "vertebrae_C2 vertebrae_C1 heart aorta pulmonary_vein brachiocephalic_trunk subclavian_artery_right "
    "subclavian_artery_left common_carotid_artery_right common_carotid_artery_left "
    "brachiocephalic_vein_left brachiocephalic_vein_right atrial_appendage_left superior_vena_cava "
    "inferior_vena_cava portal_vein_and_splenic_vein iliac_artery_left iliac_artery_right iliac_vena_left "
    "iliac_vena_right humerus_left humerus_right scapula_left scapula_right clavicula_left clavicula_right "
    "femur_left femur_right hip_left hip_right spinal_cord gluteus_maximus_left gluteus_maximus_right "
    "gluteus_medius_left gluteus_medius_right gluteus_minimus_left gluteus_minimus_right autochthon_left "
    "autochthon_right iliopsoas_left iliopsoas_right brain skull rib_left_1 rib_left_2 rib_left_3 "
    "rib_left_4 rib_left_5 rib_left_6 rib_left_7 rib_left_8 rib_left_9 rib_left_10 rib_left_11 "
    "rib_left_12 rib_right_1 rib_right_2 rib_right_3 rib_right_4 rib_right_5 rib_right_6 rib_right_7 "
    "rib_right_8 rib_right_9 rib_right_10 rib_right_11 rib_right_12 sternum costal_cartilages"
).split()
TOTAL_MR = (
    "spleen kidney_right kidney_left gallbladder liver stomach pancreas adrenal_gland_right "
    "adrenal_gland_left lung_left lung_right esophagus small_bowel duodenum colon urinary_bladder prostate "
    "sacrum vertebrae intervertebral_discs spinal_cord heart aorta inferior_vena_cava "
    "portal_vein_and_splenic_vein iliac_artery_left iliac_artery_right iliac_vena_left iliac_vena_right "
    "humerus_left humerus_right scapula_left scapula_right clavicula_left clavicula_right femur_left "
    "femur_right hip_left hip_right gluteus_maximus_left gluteus_maximus_right gluteus_medius_left "
    "gluteus_medius_right gluteus_minimus_left gluteus_minimus_right autochthon_left autochthon_right "
    "iliopsoas_left iliopsoas_right brain"
).split()

# per modality: image file, label file, modality, class names (label i is names[i - 1]),
# dataset.json written with string-sorted keys, and a voxel reordering for case b
CASES = {
    "ct": ("example_ct_sm", "example_seg", "CT", TOTAL, True, [[0, -1], [1, 1], [2, 1]]),  # RAS -> LAS
    "mr": (
        "example_mr_sm",
        "example_seg_mr",
        "MR",
        TOTAL_MR,
        False,
        [[0, -1], [1, -1], [2, 1]],
    ),  # LPS -> RAS
}
# the stand-in network's classes and intensity bands: (low name, high name, lo, hi): class ``low``
# where lo < value <= hi, ``high`` above hi; both classes are in the scan and overlap their band, and
# each modality's band holds its largest label number (117, 49)
BANDS = {
    "ct": ("liver", "costal_cartilages", 20.5, 90.5),
    "mr": ("iliopsoas_right", "liver", 0.5, 60.5),
}


def _read(path: Path) -> np.ndarray:
    return np.asanyarray(nib.load(path).dataobj)


def _reoriented_copy(src: Path, dst: Path, ornt: list[list[int]]) -> None:
    """The same scan stored in another voxel order (nibabel adjusts the affine: same world geometry)."""
    nib.save(nib.load(src).as_reoriented(np.asarray(ornt)), dst)


def _make_dataset(root: Path, modality_key: str) -> Path:
    image, label, modality, names, sort_keys, ornt = CASES[modality_key]
    d = root / f"totalseg-{modality_key}"
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (d / sub).mkdir(parents=True)
    for sub, stem in (("imagesTr", image), ("labelsTr", label)):
        (d / sub / "a.nii.gz").symlink_to(SHARED / f"{stem}.nii.gz")
        _reoriented_copy(SHARED / f"{stem}.nii.gz", d / sub / "b.nii.gz", ornt)
    labels = {"0": "background", **{str(i): n for i, n in enumerate(names, start=1)}}
    doc = {
        "name": f"totalseg-{modality_key}",
        "modality": {"0": modality},
        "labels": labels,
        "numTraining": 2,
        "training": [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in "ab"],
        "test": [],
    }
    (d / "dataset.json").write_text(json.dumps(doc, indent=1, sort_keys=sort_keys))
    return d


def _declared(dataset: Path) -> dict[int, str]:
    """Label number -> name, straight from the dataset.json written here."""
    return {int(k): v for k, v in json.loads((dataset / "dataset.json").read_text())["labels"].items()}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("totalseg")
    return {m: _make_dataset(root, m) for m in CASES}


def _tiny_config(dataset: Path, runs: Path, name: str) -> dict[str, Any]:
    """A UNet small enough for one epoch in seconds (at 6 mm: the label maps go back through a real
    resampling), intensities unchanged (scheme ct with a clip wider than the data, mean 0, std 1), so
    a pointwise network sees the scan's own values."""
    return {
        "name": name,
        "task": "segmentation",
        "runs_dir": str(runs),
        "data": {"dir": str(dataset), "val_fraction": 0.5, "cache": "memory"},
        "transforms": {
            "spacing": [6.0, 6.0, 6.0],
            "normalize": {"scheme": "ct", "clip": [-10000.0, 10000.0], "mean": 0.0, "std": 1.0},
            "patch": [32, 32, 16],
            "num_samples": 1,
        },
        "model": {"name": "unet", "channels": [8, 16], "strides": [2], "num_res_units": 1},
        "train": {"epochs": 1, "batch_size": 1, "lr": 0.001, "seed": 0, "threads": 2},
        "infer": {"sw_batch_size": 4},
    }


@pytest.fixture(scope="module")
def totalseg_runs(datasets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny finished run (with its bundle) per modality."""
    runs = tmp_path_factory.mktemp("totalseg-runs")
    return {
        m: train(config_from_dict(_tiny_config(d, runs, f"ts-{m}")), progress=False).run_dir
        for m, d in datasets.items()
    }


class BandNetwork(torch.nn.Module):
    """A pointwise stand-in network: class ``high`` where the input is above ``hi``, class ``low`` where
    it is in (``lo``, ``hi``], background elsewhere; ``n`` output channels (logits)."""

    def __init__(self, n: int, low: int, high: int, lo: float, hi: float) -> None:
        super().__init__()
        self.n, self.low, self.high, self.lo, self.hi = n, low, high, lo, hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x[:, 0]
        out = torch.zeros((x.shape[0], self.n, *x.shape[2:]), dtype=x.dtype, device=x.device)
        out[:, 0] = 1.0
        out[:, self.low] = 2.0 * ((v > self.lo) & (v <= self.hi))
        out[:, self.high] = 3.0 * (v > self.hi)
        return out


def _band(modality_key: str, dataset: Path) -> tuple[int, int, float, float]:
    """(low label, high label, lo, hi): label numbers from dataset.json; the thresholds lie between
    integer intensities (the scans are int16), so no voxel sits on one."""
    number = {name: k for k, name in _declared(dataset).items()}
    low_name, high_name, lo, hi = BANDS[modality_key]
    return number[low_name], number[high_name], lo, hi


def _expected_map(image: np.ndarray, band: tuple[int, int, float, float]) -> np.ndarray:
    low, high, lo, hi = band
    out = np.zeros(image.shape, dtype=np.int64)
    out[(image > lo) & (image <= hi)] = low
    out[image > hi] = high
    return out


def _band_bundle(run: Path, band: tuple[int, int, float, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``medseg infer`` and ``medseg evaluate`` load the run's bundle with the band network, at
    the scans' own 3 mm grid (so its label map is exactly a function of each voxel's value)."""
    import medseg.inference.evaluate as evaluate_module
    import medseg.inference.predict as predict_module

    bundle = load_bundle(run)
    bundle.model = BandNetwork(len(bundle.labels), *band)
    settings = bundle.config.to_dict()
    settings["transforms"]["spacing"] = [3.0, 3.0, 3.0]
    bundle.config = config_from_dict(settings)

    def load(*_args: Any, **_kwargs: Any) -> Any:
        return bundle

    monkeypatch.setattr(predict_module, "load_bundle", load)
    monkeypatch.setattr(evaluate_module, "load_bundle", load)


# ------------------------------------------------------------------------------ data, fingerprint


def test_validate_accepts_sparse_real_labels(datasets: dict[str, Path], capsys) -> None:
    for dataset in datasets.values():
        assert main(["data", "validate", str(dataset)]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "2 cases, 0 problems" in out, out


def test_validate_refuses_labels_named_only_where_present(
    datasets: dict[str, Path], tmp_path: Path, capsys
) -> None:
    """A dataset.json naming only the 41 structures this CT holds would need a label-number mapping:
    it is refused, and the message names the label numbers to add."""
    sparse = tmp_path / "sparse"
    (sparse / "imagesTr").mkdir(parents=True)
    (sparse / "labelsTr").mkdir()
    (sparse / "imagesTr" / "a.nii.gz").symlink_to(SHARED / "example_ct_sm.nii.gz")
    (sparse / "labelsTr" / "a.nii.gz").symlink_to(SHARED / "example_seg.nii.gz")
    doc = json.loads((datasets["ct"] / "dataset.json").read_text())
    present = set(np.unique(_read(SHARED / "example_seg.nii.gz")).tolist())
    doc["labels"] = {k: v for k, v in doc["labels"].items() if int(k) in present}
    doc["training"], doc["numTraining"] = doc["training"][:1], 1
    (sparse / "dataset.json").write_text(json.dumps(doc))
    assert main(["data", "validate", str(sparse)]) == 2
    out = capsys.readouterr().out
    first_absent = min(set(range(118)) - present)  # 12 (lung_upper_lobe_right)
    assert "not 0..41" in out and f"missing: {first_absent}," in out, out


def test_fingerprint_counts_every_declared_class(datasets: dict[str, Path]) -> None:
    for m, dataset in datasets.items():
        declared = _declared(dataset)
        fp, _ = fingerprint(dataset, refresh=True, progress=False)
        counts = np.zeros(max(declared) + 1, dtype=np.int64)
        for item in json.loads((dataset / "dataset.json").read_text())["training"]:
            counts += np.bincount(_read(dataset / item["label"]).ravel(), minlength=counts.size)
        assert fp["labels"] == {str(k): v for k, v in declared.items()}
        assert fp["class_voxels"] == {str(k): int(counts[k]) for k in declared}, m
        assert fp["median_spacing"] == pytest.approx([3.0, 3.0, 3.0])


# ------------------------------------------------------------------------------ training, bundle, viewer


def test_validation_metrics_leave_absent_classes_out(totalseg_runs: dict[str, Path], datasets) -> None:
    """Training's validation names every class and reports those absent from the validation case as
    None: an absent class is neither Dice 0 nor a perfect 0 mm HD95, and val_dice is the mean over the
    classes scored, not diluted by the 76 (CT) or 26 (MR) classes the scan does not hold.

    Validation runs on the 6 mm model grid, where a structure of a voxel or two may vanish too, so
    only classes absent from the file must be None; the liver is scored in both scans."""
    for m, run in totalseg_runs.items():
        record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
        present = set(np.unique(_read(SHARED / f"{CASES[m][1]}.nii.gz")).tolist())
        declared = _declared(datasets[m])
        for k, name in declared.items():
            if k == 0:
                continue
            assert f"val_dice_{name}" in record and f"val_hd95_{name}" in record, name
            if k not in present:
                assert record[f"val_dice_{name}"] is None and record[f"val_hd95_{name}"] is None, name
        assert record["val_dice_liver"] is not None
        scored = [
            record[f"val_dice_{n}"] for k, n in declared.items() if k and record[f"val_dice_{n}"] is not None
        ]
        assert len(scored) <= len(present - {0})
        assert record["val_dice"] == pytest.approx(sum(scored) / len(scored))


def test_bundle_and_viewer_name_each_label_number(totalseg_runs: dict[str, Path], datasets) -> None:
    from medseg.apps.registry import read_info
    from medseg.apps.viewport import label_info

    for m, run in totalseg_runs.items():
        declared = _declared(datasets[m])
        meta = json.loads((run / "bundle" / "configs" / "metadata.json").read_text())
        assert {int(k): v for k, v in meta["medseg_labels"].items()} == declared
        channel_def = meta["network_data_format"]["outputs"]["pred"]["channel_def"]
        assert {int(k): v for k, v in channel_def.items()} == declared
        # one output channel per label number 0..max, channel k is label k
        model = load_bundle(run).model
        with torch.no_grad():
            assert model(torch.zeros(1, 1, 16, 16, 16)).shape[1] == max(declared) + 1 == len(declared)
        # the viewer's legend comes from the bundle's metadata
        legend = label_info(read_info(run).labels)
        assert [(e["value"], e["name"]) for e in legend] == sorted(declared.items())


# ------------------------------------------------------------------------------ infer, evaluate


@pytest.mark.parametrize("modality_key", ["ct", "mr"])
def test_infer_keeps_geometry_with_the_trained_model(
    totalseg_runs: dict[str, Path], datasets, modality_key: str, tmp_path: Path
) -> None:
    source = SHARED / f"{CASES[modality_key][0]}.nii.gz"
    out = tmp_path / "mask.nii.gz"
    run = totalseg_runs[modality_key]
    assert main(["infer", "--run", str(run), "--input", str(source), "--output", str(out)]) == 0
    ref, mask = nib.load(source), nib.load(out)
    assert mask.shape == ref.shape
    np.testing.assert_array_equal(mask.affine, ref.affine)
    assert nib.aff2axcodes(mask.affine) == (("R", "A", "S") if modality_key == "ct" else ("L", "P", "S"))
    for code in ("sform_code", "qform_code"):
        assert int(mask.header[code]) == int(ref.header[code]), code
    values = set(np.unique(_read(out)).tolist())
    assert values <= set(_declared(datasets[modality_key]))


@pytest.mark.parametrize("modality_key", ["ct", "mr"])
def test_written_label_values_are_the_declared_numbers(
    totalseg_runs: dict[str, Path], datasets, modality_key: str, tmp_path: Path, monkeypatch
) -> None:
    """With a network whose output is known voxel by voxel, ``medseg infer`` writes exactly the label
    numbers dataset.json gives those classes (117 for costal_cartilages on CT), where they belong."""
    band = _band(modality_key, datasets[modality_key])
    _band_bundle(totalseg_runs[modality_key], band, monkeypatch)
    source = SHARED / f"{CASES[modality_key][0]}.nii.gz"
    out = tmp_path / "mask.nii.gz"
    assert main(["infer", "--run", "unused", "--input", str(source), "--output", str(out)]) == 0
    written, expected = _read(out), _expected_map(_read(source), band)
    assert {int(v) for v in np.unique(written)} == {0, band[0], band[1]}
    np.testing.assert_array_equal(written, expected)
    np.testing.assert_array_equal(nib.load(out).affine, nib.load(source).affine)


def _dice(pred: np.ndarray, truth: np.ndarray) -> float:
    return 2.0 * float((pred & truth).sum()) / float(pred.sum() + truth.sum())


@pytest.mark.parametrize("modality_key", ["ct", "mr"])
def test_evaluate_names_each_class_by_its_number(
    totalseg_runs: dict[str, Path], datasets, modality_key: str, monkeypatch, capsys
) -> None:
    """evaluate's per-class Dice, keyed by TotalSegmentator names, matches Dice computed here from the
    files (each case on its own grid); absent classes are None; the printed table shows whole names."""
    dataset = datasets[modality_key]
    band = _band(modality_key, dataset)
    _band_bundle(totalseg_runs[modality_key], band, monkeypatch)
    assert main(["evaluate", "--run", "unused", "--data", str(dataset), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((totalseg_runs[modality_key] / f"eval-{dataset.name}.json").read_text())
    declared = _declared(dataset)
    items = json.loads((dataset / "dataset.json").read_text())["training"]
    for item, row in zip(items, result["cases"], strict=True):
        truth = _read(dataset / item["label"])
        pred = _expected_map(_read(dataset / item["image"]), band)
        for k, name in declared.items():
            if k == 0:
                continue
            if not (truth == k).any():
                assert row[f"dice_{name}"] is None and row[f"hd95_{name}"] is None, name
            else:
                assert row[f"dice_{name}"] == pytest.approx(_dice(pred == k, truth == k), abs=1e-6), name
        assert row[f"dice_{declared[band[0]]}"] > 0.0 and row[f"dice_{declared[band[1]]}"] > 0.0
    for k, name in declared.items():
        if k:
            assert f"\ndice_{name} " in printed and f"\nhd95_{name} " in printed, name

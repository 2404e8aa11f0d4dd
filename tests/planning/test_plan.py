"""Planning: fingerprint, per-modality normalisation end to end, the plan and its measured memory model,
and classification's object crop."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from monai.data import MetaTensor

from medseg.config import config_from_dict, load_config
from medseg.datasets.synthetic import make_seg_dataset
from medseg.planning.fingerprint import CACHE_NAME, fingerprint
from medseg.training import transforms as tf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mr_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_seg_dataset(
        tmp_path_factory.mktemp("data") / "mr", n_train=8, n_test=1, seed=5, size=48, modality="mr"
    )


def test_fingerprint_facts_and_cache(seg_data: Path, tmp_path: Path) -> None:
    import shutil

    data = tmp_path / "seg"
    shutil.copytree(seg_data, data)
    (data / CACHE_NAME).unlink(missing_ok=True)
    fp, cached = fingerprint(data, progress=False)
    assert not cached and (data / CACHE_NAME).is_file()
    # stored LPS at 0.8 x 0.8 x 2.4 mm, 48 x 48 x 16 voxels; spacing and shape are reported along R, A, S
    assert fp["median_spacing"] == pytest.approx([0.8, 0.8, 2.4])
    assert fp["median_shape"] == [48, 48, 16]
    assert fp["modality"] == "CT" and fp["num_cases"] == 8
    # class voxels counted independently with nibabel
    counts = np.zeros(3, dtype=np.int64)
    fg_values = []
    for item in json.loads((data / "dataset.json").read_text())["training"]:
        lab = np.asarray(nib.load(data / item["label"]).dataobj).astype(int)
        img = np.asarray(nib.load(data / item["image"]).dataobj)
        counts += np.bincount(lab.ravel(), minlength=3)
        fg_values.append(img[lab > 0])
    assert fp["class_voxels"] == {str(k): int(counts[k]) for k in range(3)}
    assert sum(fp["class_share"].values()) == pytest.approx(1.0)
    # foreground HU: every foreground voxel is sampled here (fewer than 10,000 per case)
    allfg = np.concatenate(fg_values).astype(np.float64)
    it = fp["foreground_intensity"]
    assert it["samples"] == allfg.size
    assert it["mean"] == pytest.approx(allfg.mean(), rel=1e-6)
    assert it["p99_5"] == pytest.approx(np.percentile(allfg, 99.5))
    organ = fp["objects"]["1"]["volume_mm3"]
    assert organ["count"] >= 8 and organ["min"] > 0
    # second read comes from the cache; a changed file makes it stale
    again, cached = fingerprint(data, progress=False)
    assert cached and again["class_voxels"] == fp["class_voxels"]
    first = data / json.loads((data / "dataset.json").read_text())["training"][0]["image"]
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    _, cached = fingerprint(data, progress=False)
    assert not cached


def test_target_spacing_follows_nnunet_anisotropy_rule() -> None:
    from medseg.planning.rules import target_spacing

    thick = {
        "median_spacing": [0.7, 0.7, 5.0],
        "median_shape": [512, 512, 40],
        "spacing_p10": [0.6, 0.6, 3.0],
    }
    thick["num_cases"] = 10
    spacing, why = target_spacing(thick)
    assert spacing == [0.7, 0.7, 3.0] and "10th percentile" in why
    # 3x coarser but not a third of the voxels: the median stays
    mild = {**thick, "median_shape": [512, 512, 200]}
    assert target_spacing(mild)[0] == [0.7, 0.7, 5.0]
    # the 10th percentile is never finer than the other axes
    fine = {**thick, "spacing_p10": [0.6, 0.6, 0.5]}
    assert target_spacing(fine)[0][2] == pytest.approx(0.7, abs=1e-4)


def _cfg(**normalize) -> object:
    return config_from_dict({"transforms": {"normalize": normalize}} if normalize else {})


def test_normalisation_schemes_do_their_maths() -> None:
    x = torch.tensor([[[[-1000.0, 0.0, 50.0, 120.0, 400.0, 3000.0]]]])
    ct = tf.intensity_array(_cfg(scheme="ct", clip=[0.0, 400.0], mean=100.0, std=50.0))(x).as_tensor()
    assert torch.allclose(ct, (x.clamp(0.0, 400.0) - 100.0) / 50.0)
    # without transforms.normalize: the fixed window [-200, 300] onto [0, 1]
    window = tf.intensity_array(_cfg())(x).as_tensor()
    assert torch.allclose(window, ((x + 200.0) / 500.0).clamp(0, 1))
    mr = torch.tensor([[[[0.0, 0.0, 10.0, 20.0, 30.0]]]])
    z = tf.intensity_array(_cfg(scheme="zscore"))(mr.clone()).as_tensor()  # MONAI works in place
    nz = mr != 0
    assert torch.all(z[~nz] == 0)
    assert z[nz].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert z[nz].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(Exception, match="transforms.normalize.clip"):
        _cfg(scheme="ct")


def test_mr_zscore_end_to_end_train_infer_bundle(mr_data: Path, tmp_path: Path) -> None:
    """An MR dataset trains with z-scores; the bundle carries the scheme, so inference (CLI, evaluate,
    viewer: one `predict`) and MONAI's own inference.json normalise as training did, and an MR image on
    another intensity scale gives the same labels."""
    from monai.bundle import ConfigParser

    from medseg.bundle.load import load_bundle
    from medseg.inference.io import load_image
    from medseg.inference.predict import predict
    from medseg.inference.segment import model_input
    from medseg.training.loop import train
    from tests.conftest import tiny_seg_config

    d = tiny_seg_config(mr_data, tmp_path / "runs", name="mr", epochs=2).to_dict()
    d["transforms"]["normalize"] = {"scheme": "zscore"}
    result = train(config_from_dict(d), progress=False)
    bundle = load_bundle(result.run_dir)
    assert bundle.config.transforms.normalize.scheme == "zscore"
    meta = json.loads((bundle.path / "configs" / "metadata.json").read_text())
    assert meta["preprocessing"]["intensity"]["scheme"] == "zscore"
    image_path = sorted((mr_data / "imagesTr").glob("*.nii.gz"))[0]
    image = load_image(image_path)
    # predict's model input is exactly training's preprocessing: z-scored over non-zero voxels
    x, _ = model_input(bundle.config, image)
    ref = tf.preprocess(bundle.config)({"image": image})["image"].as_tensor()
    assert torch.allclose(x, ref, atol=1e-5)
    nz = ref != 0
    assert abs(ref[nz].mean().item()) < 1e-4 and ref[nz].std().item() == pytest.approx(1.0, abs=1e-3)
    # MONAI alone (inference.json's preprocessing) normalises the same way
    parser = ConfigParser(json.loads((bundle.path / "configs" / "inference.json").read_text()))
    monai_pre = parser.get_parsed_content("preprocessing")({"image": str(image_path)})["image"]
    assert torch.allclose(monai_pre.as_tensor(), ref, atol=1e-4)
    # arbitrary MR scale: the same image x 7.3 gives the same labels
    scaled = MetaTensor(image.as_tensor() * 7.3, affine=image.affine, meta=dict(image.meta))
    a = predict(bundle, image, device="cpu").label
    b = predict(bundle, scaled, device="cpu").label
    assert torch.equal(a, b)


def test_demo_anchor_is_the_demo_config() -> None:
    from medseg.planning import rules

    demo = load_config(ROOT / "configs" / "demo-seg.yaml")
    assert demo.transforms.patch == rules.DEMO_PATCH and demo.train.batch_size == rules.DEMO_BATCH
    assert demo.transforms.num_samples == rules.DEMO_SAMPLES
    # 13 training cases: `medseg data synth-seg --cases 16` at val_fraction 0.2 (make demo)
    assert demo.train.epochs * math.ceil(13 / demo.train.batch_size) == rules.DEMO_STEPS
    m = rules.DEMO_MODEL
    assert (demo.model.name, demo.model.channels, demo.model.strides, demo.model.num_res_units) == (
        m["name"],
        m["channels"],
        m["strides"],
        m["num_res_units"],
    )


def test_plan_writes_a_trainable_config_and_verify_holds(seg_data: Path, tmp_path: Path) -> None:
    """A memory budget that binds: the plan's YAML loads as a config with each choice commented, its
    patch is the largest that fits, and two measured training steps at it stay within 15% of the
    prediction and within the budget."""
    from medseg.planning.plan_io import format_verify, verify, write_plan
    from medseg.planning.planner import plan
    from medseg.planning.rules import SAFETY, divisor

    # the whole 48x48x16 median image is predicted at about 14-17 MiB here (it drifts with the machine's
    # allocator); 0.012 GiB leaves 11 MiB, so memory binds with room to spare (0.02 GiB did not, in CI)
    budget_gb = 0.012
    p = plan(seg_data, memory_gb=budget_gb, device="cpu", time_s=0, name="planned")
    out = write_plan(p, tmp_path / "planned.yaml")
    text = out.read_text()
    cfg = load_config(out)
    assert cfg.transforms.normalize.scheme == "ct"
    assert cfg.transforms.spacing == pytest.approx([0.8, 0.8, 2.4])
    for fact in (
        "median spacing",
        "foreground 0.5/99.5 percentiles",
        "bytes per batch voxel",
        "bound by memory",
    ):
        assert fact in text, fact
    raw = yaml.safe_load(text)
    assert raw["transforms"]["normalize"]["clip"][0] == pytest.approx(
        p.fingerprint["foreground_intensity"]["p0_5"], abs=1e-3
    )
    budget = budget_gb * 2**30
    assert p.predicted_total <= SAFETY * budget
    # the prediction is for the batch training really draws: batch_size cases x num_samples patches
    step_patches = cfg.train.batch_size * cfg.transforms.num_samples
    assert p.memory.total(p.params, step_patches * math.prod(cfg.transforms.patch)) == pytest.approx(
        p.predicted_total
    )
    # one divisor step more on any axis would not fit
    mm, div = p.memory, divisor("unet", "cpu")
    for a in range(3):
        bigger = list(cfg.transforms.patch)
        bigger[a] += div
        assert mm.total(
            p.params, cfg.train.batch_size * cfg.transforms.num_samples * math.prod(bigger)
        ) > SAFETY * budget or (bigger[a] > math.ceil(p.fingerprint["median_shape"][a] / div) * div)
    v = verify(p)
    assert v["within_budget"], format_verify(v)
    assert abs(v["error"]) <= 0.15, format_verify(v)


def _ball_volume(size: int, centre: tuple[int, int, int], radius: float) -> MetaTensor:
    grid = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), -1)
    inside = np.linalg.norm(grid - np.asarray(centre), axis=-1) <= radius
    rs = np.random.RandomState(0)
    img = np.where(inside, 120.0, 20.0) + rs.normal(0, 20.0, inside.shape)
    return MetaTensor(torch.as_tensor(img[None], dtype=torch.float32), affine=torch.eye(4)), inside


def test_classification_object_crop_holds_an_off_centre_object() -> None:
    """centre: a 24-voxel patch about the centre of a 64-voxel volume misses a ball in a corner; object:
    the ball is cropped and resized whole into the patch. MONAI's inference.json does the same."""
    from monai.bundle import ConfigParser

    from medseg.bundle.export import OBJECT_MASK_EXPR, preprocessing

    image, inside = _ball_volume(64, (12, 50, 14), 8.0)
    base = {
        "task": "classification",
        "model": {"name": "resnet"},
        "transforms": {"spacing": [1.0, 1.0, 1.0], "window": [-100, 200], "patch": [24, 24, 24]},
    }
    centre = config_from_dict(base)
    d = json.loads(json.dumps(base))
    d["transforms"]["roi"] = "object"
    obj = config_from_dict(d)
    bright = (120.0 + 100.0) / 300.0  # the ball's value after the window
    out_centre = tf.preprocess(centre)({"image": image})["image"]
    out_obj = tf.preprocess(obj)({"image": image})["image"]
    assert tuple(out_obj.shape[1:]) == (24, 24, 24) == tuple(out_centre.shape[1:])
    smooth = lambda t: torch.nn.functional.avg_pool3d(t[None].float(), 3, 1, 1)[0]  # noqa: E731
    near = lambda t: (smooth(t.as_tensor()) > (bright + 0.4) / 2).float().mean().item()  # noqa: E731
    assert near(out_centre) < 0.01  # the ball is not in the centre crop
    # the whole ball: its box (17 voxels + 2 of margin each side) resized to 24, so the ball fills about
    # (pi / 6) (17 / 21)^3 = 0.28 of the patch, and none of it touches the patch's border (not cut)
    assert 0.2 < near(out_obj) < 0.4
    mask = smooth(out_obj.as_tensor())[0] > (bright + 0.4) / 2
    assert not (mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any())
    assert not (mask[:, :, 0].any() or mask[:, :, -1].any())
    # MONAI's bundle preprocessing (no medseg import) matches medseg's object crop
    chain = preprocessing(obj)["transforms"][2:]  # after loading: RAS, spacing, intensity, crop, resize, pad
    parser = ConfigParser(
        {
            "imports": ["$import numpy", "$import torch"],
            "medseg_object_mask": OBJECT_MASK_EXPR,
            "pre": {"_target_": "Compose", "transforms": chain},
        }
    )
    monai_out = parser.get_parsed_content("pre")({"image": image})["image"]
    assert torch.allclose(torch.as_tensor(monai_out), out_obj.as_tensor(), atol=1e-5)


def test_dynunet_plan_predicts_its_measured_peak(seg_data: Path) -> None:
    """DynUNet's topology follows the patch (nnU-Net's kernels and strides), so its memory model must be
    measured on the planned patch's own network: at a budget that binds, the predicted peak is within
    15% of two training steps measured at the planned patch in a fresh process, and within budget."""
    from medseg.models import dynunet_plan
    from medseg.planning.plan_io import format_verify, verify
    from medseg.planning.planner import plan

    budget_gb = 0.2
    p = plan(seg_data, memory_gb=budget_gb, device="cpu", net="dynunet", time_s=0, name="dyn")
    cfg = p.config
    patch, spacing = cfg["transforms"]["patch"], cfg["transforms"]["spacing"]
    assert "bound by memory" in p.comments["transforms.patch"]
    # the model was measured on the planned network's kernels and strides, once per topology met
    kernels, strides = dynunet_plan(patch, spacing)
    assert p.memory.topology == f"kernels {kernels}, strides {strides}"
    assert p.probe_runs == 2 * p.topologies
    v = verify(p)
    assert v["within_budget"], format_verify(v)
    assert abs(v["error"]) <= 0.15, format_verify(v)


def test_a_time_budget_without_steps_fills_with_steps(seg_data: Path) -> None:
    """``--time-s`` without ``--steps``: once the patch is fitted, the steps fill TRAIN_SHARE of the
    budget at the predicted step time (more than the default 1000 steps when the budget is long)."""
    from medseg.planning.planner import plan
    from medseg.planning.rules import DEFAULT_STEPS, TRAIN_SHARE

    budget_s = 5000.0
    p = plan(seg_data, memory_gb=0.02, device="cpu", time_s=budget_s, name="timed")
    steps = int(p.comments["train.epochs"].split(" steps")[0])
    assert steps == int(TRAIN_SHARE * budget_s / p.predicted_step_s)
    assert steps > DEFAULT_STEPS["cpu"]
    # the step includes drawing its patches, measured on the dataset's cases (medseg.planning.data_time)
    mm, vox = p.memory, p.config["train"]["batch_size"] * p.config["transforms"]["num_samples"]
    vox *= math.prod(p.config["transforms"]["patch"])
    assert mm.data_k > 0 and p.predicted_step_s == pytest.approx(mm.t0 + (mm.k + mm.data_k) * vox)
    assert "drawing the patches" in p.comments["time"]
    fixed = plan(seg_data, memory_gb=0.02, device="cpu", time_s=budget_s, steps=1000, name="fixed")
    assert int(fixed.comments["train.epochs"].split(" steps")[0]) == 1000


def test_a_long_time_budget_plans_the_thin_dynunet_and_a_short_one_keeps_the_unet(seg_data: Path) -> None:
    """Rule 3: under ``--time-s`` the CPU plan trades its small UNet for the thin DynUNet (filters 16
    doubling, deep supervision) when the budget trains that network for at least THIN_DYNUNET_STEPS
    steps; the step time, memory model and parameters are then the DynUNet's (its topology probed,
    its stacked deep-supervision output trained as ``medseg train`` trains it), and a budget of a quarter of
    those steps keeps the plain UNet."""
    from medseg.models import build_network, network_def
    from medseg.planning.planner import plan
    from medseg.planning.rules import DEFAULT_STEPS, THIN_DYNUNET_STEPS, TRAIN_SHARE

    long = plan(seg_data, memory_gb=1.0, device="cpu", time_s=20_000.0, name="long")
    model = long.config["model"]
    assert model["name"] == "dynunet" and model["deep_supervision"] >= 1, model
    assert model["filters"] == [16 * 2**i for i in range(len(model["filters"]))], model
    assert "thin DynUNet" in long.comments["model"]
    steps = int(long.comments["train.epochs"].split(" steps")[0])
    assert steps == int(TRAIN_SHARE * 20_000.0 / long.predicted_step_s) >= THIN_DYNUNET_STEPS
    nd = network_def(config_from_dict(long.config), len(long.fingerprint["labels"]))
    assert long.memory.topology == f"kernels {nd['kernel_size']}, strides {nd['strides']}"
    assert long.params == sum(p.numel() for p in build_network(nd).parameters())
    # a budget between THIN_DYNUNET_STEPS and the default 1000 steps of it: the thin DynUNet, trained for
    # the steps the budget holds, not the default's (a slower machine overran a 60-minute plan by 1.8x)
    mid_s = (THIN_DYNUNET_STEPS + DEFAULT_STEPS["cpu"]) / 2 * long.predicted_step_s / TRAIN_SHARE
    mid = plan(seg_data, memory_gb=1.0, device="cpu", time_s=mid_s, name="mid")
    assert mid.config["model"]["name"] == "dynunet", mid.comments["model"]
    mid_steps = int(mid.comments["train.epochs"].split(" steps")[0])
    assert mid_steps * mid.predicted_step_s <= TRAIN_SHARE * mid_s, mid.comments["train.epochs"]
    # a quarter of the thin DynUNet's steps (a margin for probe noise): the plain UNet
    short_s = THIN_DYNUNET_STEPS / 4 * long.predicted_step_s / TRAIN_SHARE
    short = plan(seg_data, memory_gb=1.0, device="cpu", time_s=short_s, name="short")
    assert short.config["model"]["name"] == "unet", short.config["model"]
    assert "so the UNet stays" in short.comments["model"]


def test_the_planned_step_is_timed_at_the_planned_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MemoryModels.time_at``: the probes (batch 2, smaller patches) give the slope; the step run at
    the planned patch and batch, as training runs it, puts the time fit through its own time, so the
    prediction there is what was measured there, whatever the probes extrapolated."""
    from medseg.planning import memory_model
    from medseg.planning.rules import DEMO_MODEL

    calls: list[tuple[list[int], int, bool]] = []

    def fake_measure(nd, shape, batch, variant, device, classes, steps=1, wall_clock=False):  # noqa: ANN001, ANN202
        calls.append((list(shape), batch, wall_clock))
        vox = batch * math.prod(shape)
        planned = batch == 5
        return {"params": 1000, "peak_bytes": 100 * vox + 10_000, "static_bytes": 0,
                "step_s": 0.9 if planned else 1e-6 * vox, "step_cpu_s": 3e-6 * vox}  # fmt: skip

    monkeypatch.setattr(memory_model, "run_measure", fake_measure)
    base = config_from_dict({"name": "t", "data": {"dir": "."}, "model": DEMO_MODEL}).to_dict()
    models = memory_model.MemoryModels(base, "unet", "cpu", classes=3, fused=False, cpu_time=False)
    mm, _ = models.get([32, 32, 32], [1.0, 1.0, 1.0])
    assert mm.step_s(5 * 32**3) == pytest.approx(1e-6 * 5 * 32**3, rel=1e-3)  # the probes' extrapolation
    models.time_at(mm, [32, 32, 32], [1.0, 1.0, 1.0], batch=5)
    assert calls[-1] == ([32, 32, 32], 5, True)
    assert mm.step_s(5 * 32**3) == pytest.approx(0.9, rel=1e-9)
    assert mm.k == pytest.approx(1e-6, rel=1e-3)  # the slope stays the probes'


@pytest.mark.parametrize("wall_budget", [True, False])
def test_a_wall_time_budget_times_the_step_as_training_runs_it(
    monkeypatch: pytest.MonkeyPatch, wall_budget: bool
) -> None:
    """The memory probe runs one thread with every large allocation mmap'd, 2-3x slower than training;
    under ``--time-s`` the step time must come from the second, training-like run, the memory from the
    first. A CPU-seconds budget (the demo anchor's) keeps the memory probe's own time."""
    from medseg.planning import memory_model
    from medseg.planning.rules import DEMO_MODEL

    calls: list[bool] = []

    def fake_measure(nd, shape, batch, variant, device, classes, steps=1, wall_clock=False):  # noqa: ANN001, ANN202
        calls.append(wall_clock)
        vox = batch * math.prod(shape)
        return {
            "params": 1000,
            "peak_bytes": 100 * vox + 10_000,
            "static_bytes": 0,
            "step_s": (1e-6 if wall_clock else 4e-6) * vox,
            "step_cpu_s": 3e-6 * vox,
        }

    monkeypatch.setattr(memory_model, "run_measure", fake_measure)
    base = config_from_dict({"name": "t", "data": {"dir": "."}, "model": DEMO_MODEL}).to_dict()
    models = memory_model.MemoryModels(
        base, "unet", "cpu", classes=3, fused=False, cpu_time=not wall_budget, timed=True
    )
    mm, _ = models.get([32, 32, 32], [1.0, 1.0, 1.0])
    assert calls.count(True) == (2 if wall_budget else 0) and calls.count(False) == 2
    vox = 2 * 32**3
    assert mm.step_s(vox) == pytest.approx((1e-6 if wall_budget else 3e-6) * vox, rel=1e-3)
    assert mm.b == pytest.approx(100, rel=1e-6)  # memory from the memory probe either way

"""nnU-Net's recipe parts in medseg: augmentation, poly schedule, test-time mirroring, largest components.

Each is checked against a closed form or an independent library (SciPy's component labelling), not
against a second copy of the rule.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import ndimage

from medseg.config import config_from_dict, with_infer_overrides
from medseg.errors import ConfigError
from medseg.inference.evaluate import evaluate
from medseg.inference.predict import keep_largest_components
from medseg.inference.segment import mirror_averaged
from medseg.training import transforms as tf
from medseg.training.build import build_optimizer, build_scheduler
from medseg.training.data import read_dataset
from tests.conftest import tiny_seg_config


def test_mirroring_averages_a_position_dependent_model_to_its_closed_form() -> None:
    """f(x) = x * r with r_i = i along axis 0 (of n voxels): mirroring axis 0 gives
    (x r + F(F(x) r)) / 2 = x (r + F(r)) / 2 = x (n - 1) / 2, where F flips axis 0."""
    n = 7
    ramp = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1, 1)
    x = torch.rand(2, 3, n, 5, 4)
    out = mirror_averaged(lambda p: p * ramp, [0])(x)
    torch.testing.assert_close(out, x * (n - 1) / 2)
    # flips of the other axes leave this model's output as it is: the 8-flip mean is the same
    torch.testing.assert_close(mirror_averaged(lambda p: p * ramp, [0, 1, 2])(x), x * (n - 1) / 2)
    assert mirror_averaged(torch.sin, []) is torch.sin


def test_keep_largest_matches_scipys_components() -> None:
    rng = np.random.default_rng(0)
    label = np.zeros((20, 20, 20), np.uint8)
    label[2:8, 2:8, 2:8] = 1  # 216 voxels
    label[12:14, 12:14, 12:14] = 1  # 8 voxels, apart
    label[10:18, 2:6, 2:6] = 2
    label[2:4, 15:17, 15:17] = 2
    label[rng.random(label.shape) < 0.002] = 1  # isolated specks
    kept = keep_largest_components(torch.as_tensor(label)[None], [1, 2])[0].numpy()
    for c in (1, 2):
        comps, n = ndimage.label(label == c, structure=np.ones((3, 3, 3)))
        sizes = ndimage.sum(np.ones_like(comps), comps, range(1, n + 1))
        largest = comps == 1 + int(np.argmax(sizes))
        np.testing.assert_array_equal(kept == c, largest)
    assert kept.dtype == np.uint8


def test_poly_schedule_is_nnunets_closed_form(tmp_path: Path) -> None:
    cfg = tiny_seg_config(tmp_path, tmp_path, scheduler="poly", epochs=10)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.lr)
    sched = build_scheduler(cfg, opt)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [cfg.train.lr * (1 - e / 10) ** 0.9 for e in range(10)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)


def test_sgd_takes_the_configured_nesterov_momentum(tmp_path: Path) -> None:
    """A constant gradient g from w_0 = 0 (no weight decay): Nesterov's buffer is b_1 = g, b_2 = (1 + m) g,
    so w_1 = -lr (1 + m) g and w_2 = w_1 - lr (1 + m + m^2) g."""
    cfg = tiny_seg_config(tmp_path, tmp_path)
    cfg.train.optimizer, cfg.train.momentum, cfg.train.lr, cfg.train.weight_decay = "sgd", 0.99, 0.01, 0.0
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    g = torch.tensor([[1.0, -2.0, 0.5]])
    opt = build_optimizer(cfg, model)
    seen = []
    for _ in range(2):
        opt.zero_grad()
        (model.weight * g).sum().backward()
        opt.step()
        seen.append(model.weight.detach().clone())
    m, lr = 0.99, 0.01
    torch.testing.assert_close(seen[0], -lr * (1 + m) * g)
    torch.testing.assert_close(seen[1], -lr * (1 + m) * g - lr * (1 + m + m * m) * g)


def test_nnunet_augmentation_keeps_labels_and_patch(seg_data: Path, tmp_path: Path) -> None:
    cfg = tiny_seg_config(seg_data, tmp_path)
    cfg.transforms.augment_recipe = "nnunet"
    chain = tf.seg_train(cfg)
    chain.set_random_state(seed=1)
    _, train_items, _ = read_dataset(cfg)
    labels_in = set(np.unique(tf.seg_val(cfg)(train_items[0])["label"]))
    changed = 0
    for _ in range(4):
        for sample in chain(train_items[0]):
            assert tuple(sample["image"].shape[1:]) == tuple(cfg.transforms.patch)
            assert tuple(sample["label"].shape[1:]) == tuple(cfg.transforms.patch)
            assert set(np.unique(sample["label"])) <= labels_in  # nearest resampling: no new values
            assert torch.isfinite(sample["image"]).all()
            changed += 1
    assert changed == 4 * cfg.transforms.num_samples


def test_infer_overrides_only_change_inference(tmp_path: Path) -> None:
    cfg = tiny_seg_config(tmp_path, tmp_path)
    assert with_infer_overrides(cfg, ["infer.mirror=[0,1,2]", "infer.keep_largest=true"]).infer.mirror == [
        0,
        1,
        2,
    ]
    with pytest.raises(ConfigError, match="only infer"):
        with_infer_overrides(cfg, ["train.lr=1"])
    with pytest.raises(ConfigError, match="infer.mirror"):
        with_infer_overrides(cfg, ["infer.mirror=[0,3]"])
    with pytest.raises(ConfigError, match="augment_recipe"):
        config_from_dict(
            {**cfg.to_dict(), "transforms": {**cfg.to_dict()["transforms"], "augment_recipe": "heavy"}}
        )


def test_evaluate_with_mirroring_and_largest_components(seg_run, seg_data: Path) -> None:
    plain = evaluate(seg_run.run_dir, seg_data, progress=False)
    both = evaluate(
        seg_run.run_dir, seg_data, progress=False, infer=["infer.mirror=[0,1,2]", "infer.keep_largest=true"]
    )
    assert len(both["cases"]) == len(plain["cases"])
    assert 0.0 <= both["summary"]["dice"] <= 1.0
    assert both["summary"] != plain["summary"]  # the settings reached the model's run


def _dynunet_raw(tmp_path: Path, heads: int, name: str = "dynunet") -> dict:
    import dataclasses

    raw = dataclasses.asdict(tiny_seg_config(tmp_path, tmp_path))
    raw["model"] = {"name": name, "deep_supervision": heads}
    raw["transforms"]["patch"] = [32, 32, 32]
    return raw


def test_deep_supervision_weighs_every_head_of_dynunet(tmp_path: Path) -> None:
    """The training loss is Σ_l 2^-l DiceCE(head_l) over DynUNet's main output (l = 0) and its
    heads; in eval mode the network returns the main output alone, as inference needs."""
    from monai.losses import DiceCELoss

    from medseg.models import build_network, network_def
    from medseg.training.tasks import make_task

    cfg = config_from_dict(_dynunet_raw(tmp_path, heads=2))
    labels = {0: "background", 1: "organ"}
    torch.manual_seed(0)
    net = build_network(network_def(cfg, len(labels))).train()
    x = torch.randn(2, 1, 32, 32, 32)
    y = (torch.rand(2, 1, 32, 32, 32) > 0.7).float()
    got = make_task(cfg, labels).step_loss(net, x, y)
    heads = torch.unbind(net(x), dim=1)
    assert len(heads) == 3 and all(h.shape == (2, 2, 32, 32, 32) for h in heads)
    plain = DiceCELoss(to_onehot_y=True, softmax=True)
    want = sum(w * plain(h, y) for w, h in zip((1.0, 0.5, 0.25), heads))
    torch.testing.assert_close(got, want)
    assert net.eval()(x).shape == (2, 2, 32, 32, 32)


def test_deep_supervision_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    from medseg.models import network_def

    with pytest.raises(ConfigError, match="need model.name dynunet"):
        config_from_dict(_dynunet_raw(tmp_path, heads=1, name="unet"))
    with pytest.raises(ConfigError, match="at most"):
        network_def(config_from_dict(_dynunet_raw(tmp_path, heads=9)), 2)


def _ramp_patch() -> dict:
    """A patch whose image and label rise along every axis: a mirrored axis makes that axis fall."""
    grid = torch.stack(torch.meshgrid(*(torch.arange(8.0),) * 3, indexing="ij")).sum(0)[None]
    return {"image": grid.clone(), "label": grid.clone()}


@pytest.mark.parametrize("recipe", ["light", "nnunet"])
def test_only_the_flip_axes_are_ever_mirrored(recipe: str) -> None:
    from monai.transforms import Compose

    from medseg.training.augment import recipe as make_recipe

    def mirrored(flip_axes: tuple[int, ...]) -> set[int]:
        flips = Compose([t for t in make_recipe(recipe, ["label"], flip_axes=flip_axes)])
        flips.set_random_state(seed=0)
        seen: set[int] = set()
        for _ in range(60):
            label = torch.as_tensor(flips(_ramp_patch())["label"])[0]
            seen |= {a for a in range(3) if (label.diff(dim=a) < 0).float().mean() > 0.5}
        return seen

    assert mirrored((0,)) == {0}
    assert mirrored(()) == set()
    assert mirrored((0, 1, 2)) == {0, 1, 2}


def test_flip_axes_and_shift_are_checked(tmp_path: Path) -> None:
    raw = tiny_seg_config(tmp_path, tmp_path).to_dict()
    for bad in ({"flip_axes": [0, 3]}, {"flip_axes": [1, 1]}, {"shift": -1}):
        with pytest.raises(ConfigError, match=f"transforms.{next(iter(bad))}"):
            config_from_dict({**raw, "transforms": {**raw["transforms"], **bad}})


def _label_centres(cfg, item: dict, draws: int) -> np.ndarray:
    chain = tf.seg_train(cfg)
    chain.set_random_state(seed=0)
    centres = []
    for _ in range(draws):
        for sample in chain(item):
            assert tuple(sample["label"].shape[1:]) == tuple(cfg.transforms.patch)
            centres.append(ndimage.center_of_mass(np.asarray(sample["label"][0]) > 0))
    return np.array(centres)


def test_shift_places_a_small_case_anywhere_within_its_margin(seg_data: Path, tmp_path: Path) -> None:
    """A case smaller than the patch, padded to the patch alone, always sits at the same place in it;
    with ``transforms.shift`` s it moves, by at most s voxels each way along each axis."""
    cfg = tiny_seg_config(seg_data, tmp_path)
    cfg.transforms.augment = False
    cfg.transforms.patch = [64, 64, 64]  # larger than every case at the tiny config's spacing
    _, items, _ = read_dataset(cfg)
    fixed = _label_centres(cfg, items[0], 5)
    np.testing.assert_allclose(fixed, np.broadcast_to(fixed[0], fixed.shape))
    cfg.transforms.shift = 4
    moved = _label_centres(cfg, items[0], 10) - fixed[0]
    assert (np.ptp(moved, axis=0) > 1).all()  # moved along every axis
    assert (np.abs(moved) <= 4 + 1e-6).all()


def test_dynunet_takes_one_width_per_level(tmp_path: Path) -> None:
    from medseg.models import build_network, network_def

    raw = _dynunet_raw(tmp_path, heads=0)
    raw["model"]["filters"] = [8, 16, 24, 32]  # a 32^3 patch at the tiny spacing: 4 levels
    net = build_network(network_def(config_from_dict(raw), 2))
    assert list(net.filters) == [8, 16, 24, 32]
    assert net.input_block.conv1.conv.out_channels == 8  # the full-resolution level's width
    raw["model"]["filters"] = [8, 16]
    with pytest.raises(ConfigError, match="model.filters"):
        network_def(config_from_dict(raw), 2)

from pathlib import Path

import pytest
import yaml

from medseg.config import apply_overrides, config_from_dict, load_config
from medseg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name and cfg.task in ("segmentation", "classification")


def test_unknown_key_is_named_with_allowed_keys(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"train": {"epochs": 2, "learning_rate": 0.1}}))
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "train.learning_rate: unknown key" in str(err.value)
    assert "lr" in str(err.value) and str(p) in str(err.value)


def test_bad_choice_lists_allowed_values() -> None:
    with pytest.raises(
        ConfigError, match=r"model.name: 'vnet' is not allowed; allowed values: unet, segresnet"
    ):
        config_from_dict({"model": {"name": "vnet"}})


def test_network_must_fit_task() -> None:
    with pytest.raises(ConfigError, match="not a classification network"):
        config_from_dict({"task": "classification", "model": {"name": "unet"}})


def test_types_are_checked() -> None:
    with pytest.raises(ConfigError, match="train.epochs: expected an integer"):
        config_from_dict({"train": {"epochs": "many"}})
    with pytest.raises(ConfigError, match="transforms.patch: expected three positive numbers"):
        config_from_dict({"transforms": {"patch": [32, 32]}})
    with pytest.raises(ConfigError, match="model.strides"):
        config_from_dict({"model": {"channels": [8, 16, 32], "strides": [2]}})


def test_dist_bounds_are_checked() -> None:
    assert config_from_dict({"dist": {"min_epoch_rounds": 1}}).dist.min_epoch_rounds == 1
    for key, bad in (("min_epoch_rounds", 0), ("staleness", -1), ("period", 0), ("timeout_s", 0)):
        with pytest.raises(ConfigError, match="min_epoch_rounds >= 1"):
            config_from_dict({"dist": {key: bad}})


def test_an_outer_nesterov_step_is_for_gssp_without_delay_compensation() -> None:
    assert config_from_dict({"dist": {"sync": "gssp", "outer": "nesterov"}}).dist.outer == "nesterov"
    for dist in (
        {"sync": "bsp", "outer": "nesterov"},
        {"sync": "gssp", "outer": "nesterov", "dc_lambda": 0.1},
    ):
        with pytest.raises(ConfigError, match="dist.outer: nesterov is for gssp and ssp"):
            config_from_dict({"dist": dist})


def test_overrides_parse_yaml_values() -> None:
    data = apply_overrides(
        {"train": {"epochs": 3}}, ["train.epochs=7", "transforms.patch=[16,16,16]", "name=x"]
    )
    cfg = config_from_dict(data)
    assert (cfg.train.epochs, cfg.transforms.patch, cfg.name) == (7, [16, 16, 16], "x")
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["train.epochs"])


def test_exponent_numbers_without_a_dot_are_numbers(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) loads ``3e-5`` as a string; a float field takes it as the number it reads as."""
    assert yaml.safe_load("w: 3e-5")["w"] == "3e-5"  # the quirk this guards against
    cfg = config_from_dict(apply_overrides({}, ["train.weight_decay=3e-5", "train.lr=1E-2"]))
    assert (cfg.train.weight_decay, cfg.train.lr) == (3e-5, 1e-2)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  weight_decay: 3e-5\n")
    assert load_config(path).train.weight_decay == 3e-5
    for field, bad in (("lr", "e5"), ("lr", "fast"), ("epochs", "3e5")):
        with pytest.raises(ConfigError, match=f"train.{field}: expected an? (number|integer)"):
            config_from_dict({"train": {field: bad}})


def test_sgd_momentum_is_within_0_and_1() -> None:
    assert config_from_dict({"train": {"optimizer": "sgd", "momentum": 0.99}}).train.momentum == 0.99
    for momentum in (0.0, 1.0):
        with pytest.raises(ConfigError, match=r"train.momentum: expected a number in \(0, 1\)"):
            config_from_dict({"train": {"momentum": momentum}})


def test_network_that_cannot_be_built_is_a_config_error() -> None:
    from medseg.models import build_network

    with pytest.raises(ConfigError, match="cannot be built"):
        build_network(
            {
                "_target_": "monai.networks.nets.UNet",
                "spatial_dims": 3,
                "in_channels": 1,
                "out_channels": 2,
                "channels": [8],
                "strides": [],
            }
        )

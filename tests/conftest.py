"""Shared fixtures (tiny synthetic datasets, one tiny trained run per test session) and the test tiers.

Every test gets exactly one tier marker, set here from what the test uses, so that nobody has to
remember to mark a test:

- ``sites``: the emulated hospital network (tests/testbed/ and the secure site link: namespaces,
  tc, sshd, WireGuard; needs root);
- ``browser``: a real Chromium against a real Streamlit server (files named ``*browser*``);
- ``gpu``: a CUDA device or nvcc (skipped without one);
- ``mp``: several Horovod ranks or launched processes (the test runs ``horovodrun``, ``--np`` or
  another process);
- ``train``: trains or measures a model (uses a trained-run fixture, calls ``train``, ``plan`` or a
  benchmark);
- ``unit``: everything else; ``make test-fast`` runs this tier.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from medseg.config import Config, config_from_dict
from medseg.datasets.synthetic import make_cls_dataset, make_seg_dataset
from medseg.training.loop import train

SITES_FILES = {"test_site_link.py"}  # the secure site link on a real testbed (tests/secure/)
TRAINED_FIXTURES = {"seg_run", "cls_run", "app_runs", "totalseg_runs"}
MP_SIGNS = ('"--np"', "horovodrun", "HOROVODRUN", "MEDSEG_WORKER", "subprocess", "Popen", "sys.executable")
TRAIN_SIGNS = ("train(", '"train"', "train_run(", "getfixturevalue", "plan(", "bench_infer(")


def needs_gpu(item: pytest.Item) -> bool:
    """A skip condition about CUDA or nvcc, or a ``cuda`` device parameter."""
    reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")).lower()
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "cuda" in reasons or "nvcc" in reasons or "cuda" in map(str, params.values())


def tier_of(item: pytest.Item) -> str:
    """The one tier of a collected test (see the module docstring for the rules)."""
    path = Path(str(item.fspath))
    if path.parent.name == "testbed" or path.name in SITES_FILES:
        return "sites"
    if "browser" in path.name:
        return "browser"
    if needs_gpu(item):
        return "gpu"
    try:
        source = inspect.getsource(item.function)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        source = ""
    if any(sign in source for sign in MP_SIGNS):
        return "mp"
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & TRAINED_FIXTURES or any(sign in source for sign in TRAIN_SIGNS):
        return "train"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))


def tiny_seg_config(data_dir: Path, runs_dir: Path, name: str = "tiny-seg", **train_overrides) -> Config:
    """A UNet small enough to train a few epochs on 2 CPU cores in seconds."""
    return config_from_dict(
        {
            "name": name,
            "task": "segmentation",
            "runs_dir": str(runs_dir),
            "data": {"dir": str(data_dir), "val_fraction": 0.25, "cache": "memory"},
            "transforms": {
                "spacing": [1.6, 1.6, 2.4],
                "window": [-150, 250],
                "patch": [16, 16, 16],
                "num_samples": 4,
            },
            "model": {"name": "unet", "channels": [8, 16, 32], "strides": [2, 2], "num_res_units": 1},
            "train": {"epochs": 8, "batch_size": 4, "lr": 0.01, "seed": 0, "threads": 2, **train_overrides},
            "infer": {"sw_batch_size": 8},
        }
    )


@pytest.fixture(scope="session")
def seg_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_seg_dataset(tmp_path_factory.mktemp("data") / "seg", n_train=8, n_test=1, seed=3, size=48)


@pytest.fixture(scope="session")
def cls_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_cls_dataset(tmp_path_factory.mktemp("data") / "cls", n_train=12, n_test=1, seed=3, size=24)


@pytest.fixture(scope="session")
def seg_run(seg_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """A finished tiny segmentation run (with its bundle), shared by the inference and CLI tests."""
    cfg = tiny_seg_config(seg_data, tmp_path_factory.mktemp("runs"))
    return train(cfg, progress=False)


@pytest.fixture(scope="session")
def cls_run(cls_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """A finished tiny classification run (ResNet-10, 2 epochs), for the viewer's model-switch tests."""
    cfg = config_from_dict(
        {
            "name": "tiny-cls",
            "task": "classification",
            "runs_dir": str(tmp_path_factory.mktemp("cls-runs")),
            "data": {"dir": str(cls_data), "val_fraction": 0.25},
            "transforms": {"spacing": [1.0, 1.0, 1.0], "window": [-100, 200], "patch": [24, 24, 24]},
            "model": {"name": "resnet", "depth": 10, "norm": "batch"},
            "train": {"epochs": 2, "batch_size": 4, "seed": 0, "threads": 2},
        }
    )
    return train(cfg, progress=False)


@pytest.fixture(scope="session")
def app_runs(seg_run, cls_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs folder for the viewer holding the tiny segmentation and classification bundles."""
    import shutil

    root = tmp_path_factory.mktemp("app-runs")
    for run in (seg_run, cls_run):
        shutil.copytree(run.run_dir / "bundle", root / run.run_dir.name / "bundle")
        shutil.copy(
            run.run_dir / "config.yaml", root / run.run_dir.name / "config.yaml"
        )  # the local run config
    return root

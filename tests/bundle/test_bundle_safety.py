"""A bundle is data: loading one for inference runs no code from it (issue 28, item 5).

``network_def`` must name one of medseg's networks with literal arguments; a ``$`` expression, an
``@`` reference, another ``_target_`` (``subprocess.Popen``) or a nested one is refused by
``load_bundle``, ``medseg infer`` and ``medseg evaluate`` before the weights are read, and the
command it carries never runs (``<tmp>/pwned`` is not created). The same payloads do run under
``trust=True`` (the positive control: the refusal tests would pass vacuously otherwise). A good
bundle loads and predicts exactly as before; ``trust=True`` keeps MONAI's config parser for a
user's own bundle. Every ``torch.load`` in the product is weights-only, the training cache included.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml

from medseg.bundle.load import UnsafeBundleError, load_bundle
from medseg.config import config_from_dict
from medseg.errors import ConfigError, RunError
from medseg.inference.io import load_image
from medseg.inference.predict import predict
from medseg.models import NETWORKS, allowed_targets, build_network, check_network_def, network_def

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("medseg", "datasets", "distributed", "kernels", "apps", "scripts")


def _payloads(pwned: Path) -> dict[str, Any]:
    """network_def tamperings, each of which creates ``pwned`` if MONAI's config parser sees it."""
    touch = f"$__import__('os').system('touch {pwned}')"
    popen = {"_target_": "subprocess.Popen", "args": ["touch", str(pwned)]}
    return {
        "expression-argument": lambda net: {**net, "dropout": touch},
        "expression-whole": lambda net: touch,
        "popen-target": lambda net: popen,
        "nested-target": lambda net: {**net, "norm": popen},
    }


# the key each payload is refused at
OFFENDING_KEY = {
    "expression-argument": "network_def.dropout",
    "expression-whole": "network_def",
    "popen-target": "network_def._target_",
    "nested-target": "network_def.norm._target_",
}


def _copy_bundle(seg_run, dest: Path) -> Path:
    """A run folder at ``dest`` holding a copy of ``seg_run``'s bundle."""
    shutil.copytree(seg_run.run_dir / "bundle", dest / "bundle")
    return dest


def _tamper(run: Path, change) -> Path:
    path = run / "bundle" / "configs" / "inference.json"
    inference = json.loads(path.read_text())
    inference["network_def"] = change(inference["network_def"])
    path.write_text(json.dumps(inference, indent=2))
    return path


def _settle(pwned: Path) -> bool:
    """Whether ``pwned`` exists, after giving a started child process time to create it."""
    for _ in range(20):
        if pwned.exists():
            return True
        time.sleep(0.05)
    return False


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "medseg", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def _data_dir(seg_run) -> str:
    """The dataset folder the run was trained on (the run's own config.yaml; the bundle has its base name)."""
    return yaml.safe_load((seg_run.run_dir / "config.yaml").read_text())["data"]["dir"]


def _test_image(seg_run) -> Path:
    return sorted((Path(_data_dir(seg_run)) / "imagesTs").glob("*.nii*"))[0]


# --- the check itself (no bundle needed) ---------------------------------------------------------


def _configs() -> list[Any]:
    """One config per network medseg can build (every resnet depth), small sizes."""
    base = {
        "name": "n",
        "task": "segmentation",
        "transforms": {"spacing": [1.0, 1.0, 1.0], "window": [-100, 200], "patch": [32, 32, 32]},
    }
    seg = [
        {"name": "unet", "channels": [4, 8], "strides": [2], "num_res_units": 1},
        {"name": "segresnet", "init_filters": 8, "norm": "group"},
        {"name": "dynunet", "dropout": 0.1},
        {"name": "swinunetr", "feature_size": 12},
    ]
    cls = [{"name": "densenet121", "init_filters": 8}] + [
        {"name": "resnet", "depth": d, "norm": "batch", "width": 0.25} for d in (10, 18, 34, 50)
    ]
    out = [config_from_dict({**base, "model": m}) for m in seg]
    out += [config_from_dict({**base, "task": "classification", "model": m}) for m in cls]
    return out


@pytest.mark.parametrize(
    "cfg", _configs(), ids=lambda c: f"{c.model.name}{c.model.depth if c.model.name == 'resnet' else ''}"
)
def test_every_network_medseg_writes_passes_and_builds_as_monai_would(cfg) -> None:
    """Each network_def medseg exports (also after the JSON round trip of the bundle file) is
    accepted, and medseg's own build equals MONAI's config parser's, parameter for parameter."""
    net = network_def(cfg, out_channels=3)
    stored = json.loads(json.dumps(net))
    assert check_network_def(stored)[0] in NETWORKS
    torch.manual_seed(0)
    ours = build_network(stored).state_dict()
    torch.manual_seed(0)
    theirs = build_network(stored, trust=True).state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_allow_list_is_exactly_medsegs_networks() -> None:
    assert set(NETWORKS) == {
        "UNet",
        "SegResNet",
        "DynUNet",
        "SwinUNETR",
        "DenseNet121",
        "resnet10",
        "resnet18",
        "resnet34",
        "resnet50",
    }
    assert "monai.networks.nets.UNet" in allowed_targets()
    assert "monai.networks.nets.unet.UNet" in allowed_targets()
    for near_miss in (
        "monai.networks.nets.UNetPlusPlus",
        "UNet ",
        "unet",
        "torch.nn.Linear",
        "monai.networks.nets",
    ):
        with pytest.raises(ConfigError, match=r"^network_def\._target_"):
            check_network_def({"_target_": near_miss})


GOOD = {
    "_target_": "monai.networks.nets.UNet",
    "spatial_dims": 3,
    "in_channels": 1,
    "out_channels": 2,
    "channels": [4, 8],
    "strides": [2],
    "norm": ["GROUP", {"num_groups": 2}],
}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"channels": "$[4, 8]"}, r"network_def\.channels"),
        ({"channels": [4, "$8"]}, r"network_def\.channels\[1\]"),
        ({"channels": "@other"}, r"network_def\.channels"),
        ({"channels": "%configs/x.json#y"}, r"network_def\.channels"),
        ({"norm": ["GROUP", {"num_groups": "$2"}]}, r"network_def\.norm\[1\]\.num_groups"),
        ({"norm": {"_target_": "torch.nn.Identity"}}, r"network_def\.norm\._target_"),
        ({"norm": ["GROUP", {"_requires_": "$print()"}]}, r"network_def\.norm\[1\]\._requires_"),
        ({"_requires_": ["$print()"]}, r"network_def\._requires_"),
        ({"_mode_": "callable"}, r"network_def\._mode_"),
        ({"_target_": "$monai.networks.nets.UNet"}, r"network_def\._target_"),
        ({"_target_": "subprocess.Popen"}, r"network_def\._target_"),
        ({"_target_": None}, r"network_def\._target_"),
        ({"pretrained": True}, r"network_def\.pretrained"),
        ({"not_an_argument": 1}, r"network_def\.not_an_argument"),
        ({"channels": [[[[[[[[[[4]]]]]]]]], 8]}, r"network_def\.channels(\[0\]){9}"),
    ],
)
def test_anything_but_literal_arguments_is_refused_at_its_key(change: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: "):
        check_network_def({**GOOD, **change})
    with pytest.raises(ConfigError, match=f"^{key}: "):
        build_network({**GOOD, **change})


def test_literals_are_accepted_and_built() -> None:
    assert check_network_def({**GOOD, "_desc_": "a note", "dropout": 0.0, "bias": True})[0] == "UNet"
    assert sum(p.numel() for p in build_network(GOOD).parameters()) > 0
    with pytest.raises(ConfigError, match="^network_def: expected a mapping"):
        check_network_def(["UNet"])


# --- bundles on disk, the library and the command line -------------------------------------------


@pytest.mark.parametrize("payload", sorted(OFFENDING_KEY))
def test_load_bundle_refuses_code_before_reading_weights(
    seg_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: str
) -> None:
    pwned = tmp_path / "pwned"
    run = _copy_bundle(seg_run, tmp_path / "run")
    inference = _tamper(run, _payloads(pwned)[payload])
    loads: list[Any] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    try:
        load_bundle(run)
        caught: Exception | None = None
    except Exception as exc:  # noqa: BLE001 - checked below, after the file
        caught = exc
    assert not _settle(pwned), "the bundle's command ran"
    assert isinstance(caught, UnsafeBundleError), caught
    assert isinstance(caught, RunError)  # the CLI's exit 2, the viewer's message
    message = str(caught)
    assert message.startswith(f"{inference}: refused, {OFFENDING_KEY[payload]}: ")
    assert "--trust-bundle" in message
    assert loads == []  # no weights read


@pytest.mark.parametrize("payload", sorted(OFFENDING_KEY))
def test_trust_hands_the_payload_to_monai_which_runs_it(seg_run, tmp_path: Path, payload: str) -> None:
    """Positive control: the very payloads the other tests refuse do run under the old path."""
    pwned = tmp_path / "pwned"
    run = _copy_bundle(seg_run, tmp_path / "run")
    _tamper(run, _payloads(pwned)[payload])
    try:
        load_bundle(run, trust=True)
    except RunError:
        pass  # os.system returns 0, Popen is no network: the bundle is "damaged" after the fact
    assert _settle(pwned)


def test_good_bundle_loads_and_predicts_as_before(seg_run, tmp_path: Path) -> None:
    run = _copy_bundle(seg_run, tmp_path / "run")
    image = load_image(_test_image(seg_run))
    safe = load_bundle(run)
    trusted = load_bundle(run, trust=True)
    original = load_bundle(seg_run.run_dir)
    assert type(safe.model) is type(trusted.model)
    for (k, a), (k2, b) in zip(
        safe.model.state_dict().items(), trusted.model.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(a, b)
    label = predict(safe, image).label
    assert torch.equal(label, predict(trusted, image).label)
    assert torch.equal(label, predict(original, image).label)
    assert (safe.labels, safe.config) == (trusted.labels, trusted.config)


def test_trust_keeps_a_users_own_expressions(seg_run, tmp_path: Path) -> None:
    """A bundle of one's own that writes an argument as a MONAI expression: refused by default,
    loaded with trust=True, and the network is the same."""
    run = _copy_bundle(seg_run, tmp_path / "run")
    net = json.loads((run / "bundle" / "configs" / "inference.json").read_text())["network_def"]
    _tamper(run, lambda n: {**n, "channels": "$" + repr(list(net["channels"])), "_requires_": []})
    with pytest.raises(UnsafeBundleError, match=r"network_def\.(channels|_requires_): "):
        load_bundle(run)
    trusted = load_bundle(run, trust=True)
    image = load_image(_test_image(seg_run))
    assert torch.equal(predict(trusted, image).label, predict(load_bundle(seg_run.run_dir), image).label)


@pytest.mark.parametrize("payload", ["expression-argument", "popen-target", "nested-target"])
def test_cli_infer_and_evaluate_refuse_with_exit_2(seg_run, tmp_path: Path, payload: str) -> None:
    pwned = tmp_path / "pwned"
    run = _copy_bundle(seg_run, tmp_path / "run")
    inference = _tamper(run, _payloads(pwned)[payload])
    image = _test_image(seg_run)
    for args in (
        ["infer", "--run", str(run), "--input", str(image), "--output", str(tmp_path / "out.nii.gz")],
        ["evaluate", "--run", str(run), "--data", _data_dir(seg_run), "--no-progress"],
    ):
        proc = _cli(*args)
        assert not _settle(pwned), f"{args[0]}: the bundle's command ran"
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert re.search(
            rf"^error: {re.escape(str(inference))}: refused, {re.escape(OFFENDING_KEY[payload])}: ",
            proc.stderr,
            re.M,
        ), proc.stderr
        assert "--trust-bundle" in proc.stderr
    assert not (tmp_path / "out.nii.gz").exists()
    assert not list(run.glob("eval-*.json"))


def test_cli_trust_bundle_runs_a_good_bundle_the_same(seg_run, tmp_path: Path) -> None:
    run = _copy_bundle(seg_run, tmp_path / "run")
    image = _test_image(seg_run)
    outs = []
    for flag in ([], ["--trust-bundle"]):
        out = tmp_path / f"out{len(outs)}.nii.gz"
        proc = _cli("infer", "--run", str(run), "--input", str(image), "--output", str(out), *flag)
        assert proc.returncode == 0, proc.stderr
        outs.append(np.asarray(nib.load(out).dataobj))
    assert np.array_equal(outs[0], outs[1])
    proc = _cli(
        "evaluate", "--run", str(run), "--data", _data_dir(seg_run), "--no-progress", "--trust-bundle"
    )
    assert proc.returncode == 0, proc.stderr


# --- torch.load ------------------------------------------------------------------------------------


def test_every_torch_load_in_the_product_is_weights_only() -> None:
    """Each ``torch.load(`` call in product code passes ``weights_only=True`` (MONAI's PersistentDataset,
    which calls torch.load itself, is given ``weights_only=True``)."""
    calls, unsafe = 0, []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for m in re.finditer(r"torch\.load\(", text):
                depth, end = 0, m.end() - 1
                for end in range(m.end() - 1, len(text)):
                    depth += {"(": 1, ")": -1}.get(text[end], 0)
                    if depth == 0:
                        break
                calls += 1
                if "weights_only=True" not in text[m.start() : end]:
                    unsafe.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
            if "weights_only=False" in text:
                unsafe.append(f"{path.relative_to(ROOT)}: weights_only=False")
    assert calls >= 5
    assert unsafe == []


def test_training_disk_cache_reads_weights_only(tmp_path: Path) -> None:
    """MONAI's disk cache of medseg's own preprocessing round-trips under weights_only=True: the
    second read is a cache hit (no rewrite, no "corrupt cache" recompute) with the affine kept."""
    import dataclasses
    import warnings

    from medseg.datasets.synthetic import make_seg_dataset
    from medseg.training.data import _chains, _dataset, read_dataset
    from tests.conftest import tiny_seg_config

    data = make_seg_dataset(tmp_path / "seg", n_train=4, n_test=0, seed=1, size=24)
    cfg = tiny_seg_config(data, tmp_path / "runs")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache="disk"))
    _, items, _ = read_dataset(cfg)
    ds = _dataset(cfg, items[:1], _chains(cfg)[1], "val")
    assert ds.weights_only is True
    first = ds._cachecheck(items[0])
    written = {p: p.stat().st_mtime_ns for p in ds.cache_dir.glob("*.pt")}
    assert len(written) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # MONAI warns before deleting an unreadable file
        again = ds._cachecheck(items[0])
    assert {p: p.stat().st_mtime_ns for p in ds.cache_dir.glob("*.pt")} == written
    assert torch.equal(torch.as_tensor(first["image"]), torch.as_tensor(again["image"]))
    assert torch.equal(again["image"].affine, first["image"].affine)

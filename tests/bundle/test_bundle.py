"""Exported bundles run with MONAI alone and give medseg's own results.

`python -m monai.bundle run` runs in a subprocess in which ``import medseg`` fails, on NIfTI cases in
three geometries; its mask files are compared voxel for voxel with ``medseg infer``'s, and its class
probabilities with medseg's. The metadata is checked against the keys MONAI itself defines (its
default metadata, its workflow properties, the tensor keys of the bundle specification), without
network access, and ``monai.bundle ckpt_export`` must give a TorchScript model equal to the network.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from monai.bundle import ConfigParser, ConfigWorkflow
from monai.bundle.properties import InferProperties, MetaProperties
from monai.bundle.utils import DEFAULT_METADATA

from medseg.apps.registry import read_info
from medseg.bundle.export import export_bundle
from medseg.bundle.load import load_bundle
from medseg.checkpoint import load_checkpoint
from medseg.cli.main import main
from medseg.datasets.decathlon import load_dataset
from medseg.inference.io import load_image
from medseg.training.transforms import preprocess
from tests.conftest import tiny_seg_config
from tests.geometry import oblique

ROOT = Path(__file__).resolve().parents[2]
# Mandatory metadata keys of the MONAI bundle specification (docs/source/mb_specification.rst), which the
# schema (meta_schema_*.json, not downloadable here) encodes.
SPEC_KEYS = {
    "version",
    "monai_version",
    "pytorch_version",
    "numpy_version",
    "optional_packages_version",
    "task",
    "description",
    "authors",
    "copyright",
    "network_data_format",
}
# Keys every tensor format specifier must have (MONAI bundle specification, "metadata.json File").
TENSOR_KEYS = {
    "type",
    "format",
    "modality",
    "num_channels",
    "spatial_shape",
    "dtype",
    "value_range",
    "is_patch_data",
    "channel_def",
}
# Runs `python -m monai.bundle` with medseg made unimportable, from a folder outside the repository.
NO_MEDSEG = (
    "import runpy, sys; sys.modules['medseg'] = None; sys.argv[0] = 'monai.bundle'; "
    "runpy.run_module('monai.bundle', run_name='__main__', alter_sys=True)"
)


def monai_bundle(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", NO_MEDSEG, *(str(a) for a in args)], cwd=cwd, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def bundle_run(bundle: Path, cases: Path | list[Path], out: Path) -> None:
    """``monai.bundle run`` on a folder (``dataset_dir``) or on a list of files (``input``)."""
    source = (
        ["--dataset_dir", cases] if isinstance(cases, Path) else ["--input", repr([str(c) for c in cases])]
    )
    monai_bundle(
        "run",
        "--config_file",
        bundle / "configs" / "inference.json",
        "--bundle_root",
        bundle,
        *source,
        "--output_dir",
        out,
        "--device",
        "$torch.device('cpu')",
        cwd=out.parent,
    )


def write_cases(data_dir: Path, folder: Path) -> list[Path]:
    """Three NIfTI cases: a test case as it is, a flipped case on an oblique anisotropic grid, and a case
    with permuted axes (not RAS-ordered) and finer voxels than the model's spacing."""
    info = load_dataset(data_dir)
    folder.mkdir(parents=True)
    first = nib.load(info.test[0]["image"])
    second = np.asarray(nib.load(info.training[0]["image"]).dataobj)
    third = np.asarray(nib.load(info.training[1]["image"]).dataobj)
    turned = oblique(np.diag([0.9, -1.3, 3.1, 1.0]))
    turned[:3, 3] = [12.5, -30.0, 7.0]
    permuted = np.array([[0, 0, -1.1, 20.0], [-0.8, 0, 0, 15.0], [0, 1.7, 0, -40.0], [0, 0, 0, 1.0]])
    images = {
        "a_as_is": nib.Nifti1Image(np.asarray(first.dataobj), first.affine),
        "b_oblique": nib.Nifti1Image(second[:, ::-1].copy(), turned),
        "c_permuted": nib.Nifti1Image(np.transpose(third, (1, 2, 0)).copy(), permuted),
    }
    paths = []
    for name, image in images.items():
        nib.save(image, folder / f"{name}.nii.gz")
        paths.append(folder / f"{name}.nii.gz")
    return paths


@pytest.fixture(scope="module")
def fused_run(seg_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained with ``train.memory=fused`` (in its own process, on the reference kernels, so
    this session's native-kernel state is left alone)."""
    root = tmp_path_factory.mktemp("fused")
    cfg = tiny_seg_config(seg_data, root / "runs", name="tiny-fused", epochs=3, memory="fused")
    config = root / "tiny-fused.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    env = {**os.environ, "MEDSEG_NATIVE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "medseg", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cfg.run_dir


@pytest.mark.parametrize("which", ["seg_run", "fused_run"])
def test_monai_bundle_run_writes_medseg_masks(
    which: str, request: pytest.FixtureRequest, seg_data: Path, tmp_path: Path
) -> None:
    run = request.getfixturevalue(which)
    run_dir = Path(getattr(run, "run_dir", run))
    bundle = run_dir / "bundle"
    cases = write_cases(seg_data, tmp_path / "cases")
    out = tmp_path / "monai"
    bundle_run(bundle, tmp_path / "cases", out)
    foreground = 0
    for case in cases:
        stem = case.name[: -len(".nii.gz")]
        ours = tmp_path / f"medseg-{stem}.nii.gz"
        assert main(["infer", "--run", str(run_dir), "--input", str(case), "--output", str(ours)]) == 0
        theirs = nib.load(out / f"{stem}_seg.nii.gz")
        mine = nib.load(ours)
        a, b = np.asarray(mine.dataobj), np.asarray(theirs.dataobj)
        assert a.shape == b.shape == nib.load(case).shape, stem
        assert b.dtype == np.uint8, stem
        np.testing.assert_allclose(theirs.affine, mine.affine, atol=1e-6, rtol=0, err_msg=stem)
        np.testing.assert_allclose(theirs.affine, nib.load(case).affine, atol=1e-6, rtol=0, err_msg=stem)
        different = int((a != b).sum())
        assert different == 0, (
            f"{stem}: {different} of {a.size} voxels differ between monai.bundle and medseg"
        )
        foreground += int((a > 0).sum())
    assert foreground > 0, "every mask is empty: the comparison would prove nothing"


def test_monai_bundle_run_writes_medseg_probabilities(cls_run, cls_data: Path, tmp_path: Path) -> None:
    bundle = cls_run.run_dir / "bundle"
    cases = write_cases(cls_data, tmp_path / "cases")
    out = tmp_path / "monai"
    bundle_run(bundle, cases, out)
    with open(out / "predictions.csv") as f:
        rows = {Path(r[0]).name: [float(v) for v in r[1:]] for r in csv.reader(f)}
    assert sorted(rows) == sorted(c.name for c in cases)
    names = [v for _, v in sorted(load_bundle(cls_run.run_dir).labels.items())]
    for case in cases:
        ours = tmp_path / f"{case.name}.json"
        assert (
            main(["infer", "--run", str(cls_run.run_dir), "--input", str(case), "--output", str(ours)]) == 0
        )
        probs = json.loads(ours.read_text())["probabilities"]
        np.testing.assert_allclose(rows[case.name], [probs[n] for n in names], atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", ["seg_run", "cls_run"])
def test_bundle_preprocessing_is_medseg_preprocessing(
    which: str, request: pytest.FixtureRequest, seg_data: Path, cls_data: Path, tmp_path: Path
) -> None:
    """The same voxels and affine reach the network (a quick check that names the step that differs)."""
    run = request.getfixturevalue(which)
    data = seg_data if which == "seg_run" else cls_data
    parser = ConfigParser()
    parser.read_config(run.run_dir / "bundle" / "configs" / "inference.json")
    theirs_chain = parser.get_parsed_content("preprocessing")
    ours_chain = preprocess(load_bundle(run.run_dir).config)
    for case in write_cases(data, tmp_path / "cases"):
        theirs = theirs_chain({"image": str(case)})["image"]
        ours = ours_chain({"image": load_image(case)})["image"]
        assert [op["class"] for op in theirs.applied_operations] == [
            op["class"] for op in ours.applied_operations
        ]
        assert theirs.shape == ours.shape and theirs.dtype == ours.dtype, case.name
        np.testing.assert_array_equal(theirs.numpy(), ours.numpy(), err_msg=case.name)
        np.testing.assert_allclose(np.asarray(theirs.affine), np.asarray(ours.affine), atol=1e-6, rtol=0)


@pytest.mark.parametrize("which", ["seg_run", "cls_run"])
def test_bundle_is_monai_only_and_complete(which: str, request: pytest.FixtureRequest) -> None:
    bundle = request.getfixturevalue(which).run_dir / "bundle"
    text = (bundle / "configs" / "inference.json").read_text()
    assert "medseg" not in text.lower()
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    # MONAI's own minimal metadata (what `monai.bundle init_bundle` writes) and required meta properties.
    assert SPEC_KEYS <= set(meta)
    assert set(DEFAULT_METADATA) <= set(meta)
    for name, prop in MetaProperties.items():
        if prop["required"]:
            assert name in meta, name
    # The specification's key and the one MONAI 1.6 renames it to on reading must not disagree.
    assert meta["optional_packages_version"] == meta["required_packages_version"]
    assert {"nibabel", "pytorch-ignite", "fire"} <= set(meta["required_packages_version"])
    assert "medseg" not in meta["required_packages_version"]
    formats = meta["network_data_format"]
    for spec in [*formats["inputs"].values(), *formats["outputs"].values()]:
        assert TENSOR_KEYS <= set(spec)
    cfg = load_bundle(bundle).config
    assert meta["preprocessing"]["spacing_mm"] == list(cfg.transforms.spacing)
    assert meta["preprocessing"]["intensity"]["window"] == list(cfg.transforms.window)
    assert meta["validated_on"]["cases"] and meta["validated_on"]["dataset_dir"] == cfg.data.dir
    assert formats["outputs"]["pred"]["num_channels"] == len(meta["medseg_labels"])
    # Every property an inference workflow must have, as `monai.bundle` itself checks them.
    workflow = ConfigWorkflow(
        config_file=str(bundle / "configs" / "inference.json"),
        workflow_type="infer",
        logging_file=False,
        bundle_root=str(bundle),
    )
    workflow.initialize()
    assert workflow.check_properties() == []
    assert {n for n, p in InferProperties.items() if p["required"]} <= set(json.loads(text))
    readme = (bundle / "docs" / "README.md").read_text()
    for section in ("## Input", "## Output", "## Validation", "## Limits", "## Running with MONAI alone"):
        assert section in readme
    assert "python -m monai.bundle run" in readme and "ckpt_export" in readme


def test_ckpt_export_gives_the_network_as_torchscript(seg_run, tmp_path: Path) -> None:
    bundle = seg_run.run_dir / "bundle"
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["torchscript"]["scriptable"] is True
    ts = tmp_path / "model.ts"
    monai_bundle(
        "ckpt_export",
        "network_def",
        "--filepath",
        ts,
        "--ckpt_file",
        bundle / "models" / "model.pt",
        "--meta_file",
        bundle / "configs" / "metadata.json",
        "--config_file",
        bundle / "configs" / "inference.json",
        "--bundle_root",
        bundle,
        cwd=tmp_path,
    )
    scripted = torch.jit.load(str(ts)).eval()
    model = load_bundle(bundle).model
    x = torch.rand(2, 1, *meta["network_data_format"]["inputs"]["image"]["spatial_shape"])
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), atol=1e-5, rtol=1e-5)


def test_unscriptable_network_is_noted(seg_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("Python builtin <built-in function id> is currently not supported in Torchscript")

    monkeypatch.setattr(torch.jit, "script", refuse)
    cfg = load_bundle(seg_run.run_dir).config
    cfg.runs_dir, cfg.name = str(tmp_path), "unscriptable"
    state = load_checkpoint(seg_run.run_dir / "checkpoints" / "best.pt")
    bundle = export_bundle(cfg, state, metrics={})
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["torchscript"]["scriptable"] is False
    assert "currently not supported" in meta["torchscript"]["problem"]
    assert "cannot be scripted" in (bundle / "docs" / "README.md").read_text()


def test_bundle_with_settings_in_inference_json_still_loads(seg_run, tmp_path: Path) -> None:
    """Bundles without configs/medseg.json (the settings as a ``medseg`` block of inference.json) work in
    medseg and the viewer."""
    old = tmp_path / "old" / "bundle"
    shutil.copytree(seg_run.run_dir / "bundle", old)
    inference = json.loads((old / "configs" / "inference.json").read_text())
    inference["medseg"] = json.loads((old / "configs" / "medseg.json").read_text())
    (old / "configs" / "inference.json").write_text(json.dumps(inference))
    (old / "configs" / "medseg.json").unlink()
    assert load_bundle(old).config == load_bundle(seg_run.run_dir).config
    assert read_info(old).spacing == tuple(load_bundle(old).config.transforms.spacing)

"""Bad input through the CLI: a message naming the problem, exit status 2, no traceback, nothing lost."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

from medseg.cli.main import main
from medseg.datasets.dicom.write import write_dicom_series
from medseg.datasets.nifti import save_nifti

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Run the CLI in-process; returns (exit status, stderr); stdout stays readable as ``run_cli.out``."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    run_cli.out = captured.out
    return code, captured.err


def _volume(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    data = np.random.default_rng(seed).integers(-200, 200, size=(24, 24, 12)).astype(np.int16)
    return data, np.diag([-1.6, -1.6, 2.4, 1.0])


def test_subprocess_error_exits_2_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "medseg", "data", "validate", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "nowhere" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_reports_every_problem(capsys, seg_data: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(seg_data, bad)
    label = sorted((bad / "labelsTr").iterdir())[0]
    img = nib.load(label)
    save_nifti(np.asarray(img.dataobj)[:, :, :-1], img.affine, label)  # label one slice short
    image = sorted((bad / "imagesTr").iterdir())[1]
    raw = image.read_bytes()
    image.write_bytes(raw[: len(raw) // 2])  # truncated gzip
    code, err = run_cli(capsys, "data", "validate", bad)
    out = run_cli.out
    assert code == 2 and "2 problem(s)" in err
    assert label.name in out and "shape" in out
    assert image.name in out


def test_unknown_config_key(capsys, tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "demo-seg.yaml").read_text())
    cfg["model"]["chanels"] = [8, 16]
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, err = run_cli(capsys, "train", "--config", path)
    assert code == 2 and "model.chanels: unknown key" in err and "channels" in err


def test_bad_override_value(capsys) -> None:
    code, err = run_cli(
        capsys, "train", "--config", ROOT / "configs" / "demo-seg.yaml", "train.optimizer=lbfgs"
    )
    assert code == 2 and "train.optimizer: 'lbfgs' is not allowed" in err and "adamw" in err


def test_infer_missing_run(capsys, tmp_path: Path) -> None:
    code, err = run_cli(
        capsys,
        "infer",
        "--run",
        tmp_path / "runs" / "x",
        "--input",
        tmp_path,
        "--output",
        tmp_path / "o.nii.gz",
    )
    assert code == 2 and "no MONAI bundle" in err


@pytest.mark.parametrize(
    "defect", ["truncated", "not-an-image", "nan", "2d", "empty-folder", "mixed-series", "wrong-suffix"]
)
def test_infer_bad_input_keeps_existing_output(capsys, seg_run, tmp_path: Path, defect: str) -> None:
    data, affine = _volume()
    source = tmp_path / "input.nii.gz"
    if defect == "truncated":
        save_nifti(data, affine, source)
        raw = source.read_bytes()
        source.write_bytes(raw[: len(raw) // 2])
        expect = "input.nii.gz"
    elif defect == "not-an-image":
        source.write_bytes(gzip.compress(b"this is not a NIfTI file" * 20))
        expect = "input.nii.gz"
    elif defect == "nan":
        bad = data.astype(np.float32)
        bad[3, 3, 3] = np.nan
        save_nifti(bad, affine, source)
        expect = "NaN"
    elif defect == "2d":
        save_nifti(data[:, :, 0], affine, source)
        expect = "3D"
    elif defect == "empty-folder":
        source = tmp_path / "empty"
        source.mkdir()
        expect = "holds no DICOM files"
    elif defect == "mixed-series":
        source = tmp_path / "mixed"
        write_dicom_series(data, affine, source / "a", series_description="first")
        write_dicom_series(data, affine, source / "b", series_description="second")
        expect = "--series"
    else:
        source = tmp_path / "scan.png"
        source.write_bytes(b"\x89PNG....")
        expect = "not a NIfTI file"
    output = tmp_path / "mask.nii.gz"
    output.write_bytes(b"an earlier result")
    code, err = run_cli(capsys, "infer", "--run", seg_run.run_dir, "--input", source, "--output", output)
    assert code == 2, err
    assert expect in err
    assert output.read_bytes() == b"an earlier result"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_convert_uneven_real_series(capsys, tmp_path: Path) -> None:
    import pydicom

    ct2 = Path(pydicom.__file__).parent / "data" / "test_files" / "dicomdirtests" / "77654033" / "CT2"
    code, err = run_cli(capsys, "data", "convert", ct2, tmp_path / "ct2.nii.gz")
    assert code == 2 and ("uneven" in err or "missing" in err) and "--resample" in err
    assert not (tmp_path / "ct2.nii.gz").exists()
    code, _ = run_cli(capsys, "data", "convert", ct2, tmp_path / "ct2.nii.gz", "--resample")
    assert code == 0 and nib.load(tmp_path / "ct2.nii.gz").shape[2] > 4

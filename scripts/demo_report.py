"""Print the demo's numbers against its targets; exit 1 if one is missed. Run by `make demo`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nibabel as nib
import numpy as np

from medseg.datasets.dicom.reader import read_dicom_series


def main() -> int:
    seg = json.loads(Path("runs/demo-seg/eval-synth-seg-holdout.json").read_text())["summary"]
    cls = json.loads(Path("runs/demo-cls/eval-synth-cls-holdout.json").read_text())["summary"]
    volume, affine, _ = read_dicom_series("data/dicom-demo")
    checks = [
        ("segmentation: held-out mean foreground Dice", seg["dice"], ">=", 0.80),
        ("classification: held-out ROC-AUC", cls["auc"], ">=", 0.90),
    ]
    for name, path in (
        ("infer on DICOM series", "runs/demo-seg/dicom-demo-mask.nii.gz"),
        ("data convert", "runs/demo-seg/dicom-demo.nii.gz"),
    ):
        out = nib.load(path)
        if out.shape != volume.shape:
            checks.append((f"{name}: shape {out.shape} vs series {volume.shape}", 1.0, "<=", 0.0))
        checks.append(
            (
                f"{name}: max |affine - series affine| (mm)",
                float(np.abs(out.affine - affine).max()),
                "<=",
                1e-3,
            )
        )
    print("\nmedseg demo summary")
    ok = True
    for name, value, op, target in checks:
        good = value >= target if op == ">=" else value <= target
        ok &= good
        print(f"  {'PASS' if good else 'MISS'}  {name}: {value:.4g} (target {op} {target:g})")
    print(
        f"  per-class held-out scores: {json.dumps({k: round(v, 4) for k, v in seg.items() if v is not None})}"
    )
    print(
        "  outputs: runs/demo-seg and runs/demo-cls (config.yaml, checkpoints/, metrics.jsonl, learning_curve.png,"
    )
    print(
        "           bundle/, eval-*.json); DICOM series data/dicom-demo -> runs/demo-seg/dicom-demo-mask.nii.gz"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

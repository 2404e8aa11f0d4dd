"""How fast a NIfTI whose header claims more memory than the machine has is refused.

Builds a real gzip bomb: a 16 MB .nii.gz that decompresses to 16 GiB of int16 zeros (the header's
shape 2048 x 2048 x 2048; the zeros are one compressed 64 MiB member repeated, which gzip readers
concatenate), then times (a) the header check alone, in-process, and (b) the whole CLI command
`medseg data to-dicom BOMB OUT`, `medseg infer --input BOMB` and `medseg data validate` on a dataset
holding it, as subprocesses
(Python start-up and imports included). Nothing is decompressed: the refusal comes from the header.

    .venv/bin/python scripts/bench_header_refusal.py
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np

from medseg import sysinfo
from medseg.datasets import checks
from medseg.errors import DataError

SHAPE = (2048, 2048, 2048)  # int16: 16 GiB of voxels
CHUNK = 64 * 2**20


def _member(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


def make_bomb(path: Path) -> None:
    hdr = nib.Nifti1Header()
    hdr.set_data_dtype(np.int16)
    hdr.set_data_shape(SHAPE)
    affine = np.diag([0.5, 0.5, 0.5, 1.0])
    hdr.set_sform(affine, code=1)
    hdr.set_qform(affine, code=1)
    hdr["vox_offset"] = 352
    zeros = _member(bytes(CHUNK))
    total = int(np.prod(SHAPE)) * 2
    with open(path, "wb") as f:
        f.write(_member(hdr.binaryblock + bytes(4)))
        for _ in range(total // CHUNK):
            f.write(zeros)
    # sanity: the first bytes decompress to the header
    with gzip.open(path) as g:
        assert len(g.read(352)) == 352


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        bomb = tmp_path / "bomb.nii.gz"
        make_bomb(bomb)
        size = bomb.stat().st_size
        t0 = time.perf_counter()
        try:
            checks.open_nifti(bomb)
            message = "NOT REFUSED"
        except DataError as exc:
            message = str(exc)
        check_s = time.perf_counter() - t0

        ds = tmp_path / "ds"
        (ds / "imagesTr").mkdir(parents=True)
        (ds / "labelsTr").mkdir()
        (ds / "imagesTr" / "b.nii.gz").symlink_to(bomb)
        (ds / "labelsTr" / "b.nii.gz").symlink_to(bomb)
        (ds / "dataset.json").write_text(
            json.dumps(
                {
                    "labels": {"0": "bg", "1": "fg"},
                    "training": [{"image": "imagesTr/b.nii.gz", "label": "labelsTr/b.nii.gz"}],
                }
            )
        )
        medseg = [sys.executable, "-m", "medseg"]
        timings = {}
        for name, argv in (
            ("to-dicom", [*medseg, "data", "to-dicom", str(bomb), str(tmp_path / "out")]),
            ("validate", [*medseg, "data", "validate", str(ds)]),
            (
                "infer",
                [
                    *medseg,
                    "infer",
                    "--run",
                    str(tmp_path / "run"),
                    "--input",
                    str(bomb),
                    "--output",
                    str(tmp_path / "m.nii.gz"),
                ],
            ),
            (
                "python -c 'import medseg.cli.main' (start-up alone)",
                [sys.executable, "-c", "import medseg.cli.main"],
            ),
        ):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            timings[name] = (time.perf_counter() - t0, proc.returncode, proc.stderr.strip().splitlines()[-1:])
        print(f"bomb: {size / 2**20:.1f} MB on disk, header claims {np.prod(SHAPE) * 2 / 2**30:.0f} GiB")
        print(f"available memory: {sysinfo.available_memory() / 2**30:.1f} GiB")
        print(f"header check in-process: {check_s * 1000:.1f} ms -> {message}")
        for name, (secs, rc, last) in timings.items():
            print(f"CLI {name}: {secs:.2f} s wall, exit {rc}, {last}")


if __name__ == "__main__":
    main()

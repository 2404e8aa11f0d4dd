"""``medseg bench infer``: memory and time of ``medseg.inference.predict.predict`` against the previous path.

Cases: synthetic CT volumes (HU, LPS-stored, 0.78 x 0.78 x 1 mm) of 256x256x128, 512x512x300 and
512x512x1000 voxels, with 3 and 14 classes. The models are demo-sized UNets (configs/demo-seg.yaml's
network), randomly initialised with a fixed seed and exported as bundles by medseg's exporter:
labels, not accuracy, are compared.

Variants, each in its own process (a fresh allocator is the only honest peak):

- ``old``: the previous path (softmax, ``Invertd`` of the C probability maps onto the input grid,
  argmax there), kept here as :func:`predict_reference`, the anchor measured in the same run;
- ``new``: :func:`medseg.inference.predict.predict` as users run it;
- ``new-stream``: the same on the synthetic CT written as an int16 ``.nii.gz`` (gzip level 1), read
  by the streaming path (:mod:`medseg.inference.io`, what ``medseg infer`` does above its threshold)
  inside the measured call: time and peak include reading and decompressing the file;
- ``new-fp16``: the same with float16 sliding-window accumulators, to measure what that would change.

``new-stream`` and ``new-fp16`` run one round per case. Labels are compared with ``old``, or with
``new`` where ``old`` was not run (``new-stream`` must then be identical).

Peak RSS is the child's ``VmHWM`` (whole process: libraries, the loaded float32 input and the
prediction; reset with ``/proc/self/clear_refs`` after the input is made, with
``MALLOC_MMAP_THRESHOLD_=65536``). Time is the ``predict`` call alone. Labels of every variant are
compared with ``old`` (differing voxels, Dice per class). ``old`` is skipped where its predicted peak
would exceed the memory limit (whole-body sizes): there the new path is reported alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medseg.bench.report import publish

log = logging.getLogger(__name__)

SPACING = (0.78, 0.78, 1.0)
FULL_SIZES = [(256, 256, 128), (512, 512, 300), (512, 512, 1000)]
QUICK_SIZES = [(96, 96, 40), (128, 128, 64)]
CLASSES = (3, 14)
#: The case the time target is on: timed ``rounds`` times; the others once (2 shared cores are slow).
TIMED = ((512, 512, 300), 3)
#: Every variant; ``new-stream`` and ``new-fp16`` run one round per case.
VARIANTS = ("old", "new", "new-stream", "new-fp16")
OLD_LIMIT_BYTES = 14 * 2**30  # never start a variant predicted above this (machine: 24 GiB, shared)
GB = 2**30


# ---------------------------------------------------------------------------------------------------
# The previous path, kept as the anchor.


@torch.no_grad()
def predict_reference(
    bundle: Any, image: Any, device: str = "cpu", mode: str = "bilinear", keep_probs: bool = False
) -> Any:
    """The previous ``predict`` for segmentation: probabilities inverted by ``Invertd``, argmax after.

    Returns (I, J, K) uint8, or with ``keep_probs`` the pair (labels, inverted probabilities (C, I, J, K))
    (they are alive at the argmax anyway, so keeping them does not raise the peak). ``mode`` exists so
    the tests can break the equivalence on purpose.
    """
    from monai.data import MetaTensor
    from monai.inferers import sliding_window_inference
    from monai.transforms import Invertd

    from medseg.training import transforms as tf

    cfg = bundle.config
    model = bundle.model.to(device)
    pre = tf.preprocess(cfg)
    data = pre({"image": image})
    x = data["image"][None].to(device)

    def forward(patch: torch.Tensor) -> torch.Tensor:
        return model(patch.as_tensor() if isinstance(patch, MetaTensor) else patch)

    inf = cfg.infer
    logits = sliding_window_inference(
        x,
        cfg.transforms.patch,
        inf.sw_batch_size,
        forward,
        overlap=inf.overlap,
        mode=inf.mode,
        progress=False,
        sw_device=device,
        device="cpu",
    )
    probs = torch.softmax(logits.float(), 1)[0]
    data["pred"] = MetaTensor(
        probs, meta=data["image"].meta, applied_operations=data["image"].applied_operations
    )
    if mode != "bilinear":  # a deliberately wrong inversion, for the tests that must be able to fail
        for op in data["pred"].applied_operations:
            if op.get("extra_info", {}).get("mode") == "bilinear":
                op["extra_info"]["mode"] = mode
    back = Invertd("pred", transform=pre, orig_keys="image", nearest_interp=False)(data)["pred"]
    labels = back.argmax(0).to(torch.uint8).as_tensor()
    return (labels, back.as_tensor()) if keep_probs else labels


#: Labels of the new path may differ from ``old`` only where old's two most probable classes are
#: closer than this (probability units). Why a tolerance at all: the two paths evaluate the same
#: trilinear formulas in a different order (float64 slabs vs MONAI's affine grid forward; separable
#: lerps vs ``grid_sample`` back), so their float32 probabilities differ by rounding, which the UNet
#: can amplify from its input; a voxel whose top two classes are within that noise can take either
#: label. 1e-4 is about a thousand float32 ulps of a probability near 0.5, far above the rounding
#: and far below any real disagreement (a wrong inversion moves labels with margins up to ~1).
TIE_TOLERANCE = 1e-4


def top2_margin(probs: torch.Tensor, step: int = 8) -> torch.Tensor:
    """``p_(1) - p_(2)``, the gap between the two largest class probabilities per voxel (C, I, J, K) -> (I, J, K)."""
    out = torch.empty(probs.shape[1:], dtype=torch.float32)
    for k0 in range(0, probs.shape[-1], step):
        top = probs[..., k0 : k0 + step].float().topk(2, dim=0).values
        out[..., k0 : k0 + step] = top[0] - top[1]
    return out


def old_peak_bytes(n_voxels: int, classes: int) -> int:
    """Predicted peak of :func:`predict_reference` (fit to the issue's 5.5 GB at 512x512x300, 3 classes).

    Per input voxel: the float32 input (4), affine_grid's base and sampling grids (16 + 12), the
    argmax's int64 (8), and about two float32 copies of the C inverted probability maps (8 C).
    """
    return int(0.45 * GB + n_voxels * (40 + 8 * classes))


# ---------------------------------------------------------------------------------------------------
# Inputs and models.


def synthetic_affine(
    shape: tuple[int, int, int], spacing: tuple[float, float, float] = SPACING
) -> np.ndarray:
    """LPS-stored, centred; rounded through float32 as a NIfTI header stores it, so that the loaded
    synthetic CT and its file (:func:`write_synthetic_nifti`) have the very same affine."""
    ni, nj, nk = shape
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    affine[:3, 3] = [spacing[0] * ni / 2, spacing[1] * nj / 2, -spacing[2] * nk / 2]
    return affine.astype(np.float32).astype(np.float64)


def synthetic_ct(shape: tuple[int, int, int], spacing: tuple[float, float, float] = SPACING, seed: int = 0):
    """A CT-like float32 MetaTensor (1, I, J, K): air, a body ellipse of soft tissue, brighter blobs, noise.

    Made slice block by slice block from int16, so that making it never needs more than the input.
    """
    from monai.data import MetaTensor

    ni, nj, nk = shape
    out = torch.empty((1, ni, nj, nk), dtype=torch.float32)
    for k0, k1, block in _synthetic_blocks(shape, spacing, seed):
        out[0, :, :, k0:k1] = torch.from_numpy(block)
    return MetaTensor(
        out,
        affine=torch.as_tensor(synthetic_affine(shape, spacing)),
        meta={"filename_or_obj": f"synthetic-{ni}x{nj}x{nk}"},
    )


def write_synthetic_nifti(
    path: Path, shape: tuple[int, int, int], spacing: tuple[float, float, float] = SPACING, seed: int = 0
) -> Path:
    """:func:`synthetic_ct` as an int16 NIfTI file, written slice block by slice block (gzip level 1 for
    ``.nii.gz``): the voxels equal the loaded synthetic CT's, and writing never holds the whole volume."""
    import gzip

    import nibabel as nib

    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.int16)
    affine = synthetic_affine(shape, spacing)
    hdr.set_sform(affine, code=1)
    hdr.set_qform(affine, code=1)
    hdr.set_xyzt_units("mm")
    hdr.set_data_offset(352)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    opener = gzip.open(tmp, "wb", compresslevel=1) if path.name.endswith(".gz") else open(tmp, "wb")
    with opener as f:
        hdr.write_to(f)  # 348 bytes and the 4-byte extension flag: the voxels start at 352
        for _, _, block in _synthetic_blocks(shape, spacing, seed):
            f.write(block.astype("<i2").tobytes(order="F"))
    os.replace(tmp, path)
    return path


def _synthetic_blocks(shape: tuple[int, int, int], spacing: tuple[float, float, float], seed: int):
    """``(k0, k1, block)``: the synthetic CT's slices ``k0:k1`` as (I, J, k1 - k0) float32 integers."""
    rs = np.random.RandomState(seed)
    ni, nj, nk = shape
    x = (np.arange(ni)[:, None] - (ni - 1) / 2) / (0.45 * ni)
    y = (np.arange(nj)[None, :] - (nj - 1) / 2) / (0.38 * nj)
    body = (x**2 + y**2) <= 1.0
    centres = rs.uniform(0.25, 0.75, size=(12, 3)) * np.array(shape)
    radii = rs.uniform(0.04, 0.12, size=12) * min(ni, nj)
    hu = rs.choice([60.0, 110.0, 220.0], size=12)
    step = max(1, (64 * 2**20) // (4 * ni * nj))
    for k0 in range(0, nk, step):
        k1 = min(nk, k0 + step)
        kk = np.arange(k0, k1)[None, None, :]
        block = np.where(body[:, :, None], 20.0, -1000.0).astype(np.float32) * np.ones(
            (1, 1, k1 - k0), np.float32
        )
        for c, r, v in zip(centres, radii, hu):
            rk = r * spacing[0] / spacing[2]  # radius in slices
            if k1 <= c[2] - rk or k0 >= c[2] + rk:
                continue
            i0, i1 = max(0, int(c[0] - r)), min(ni, int(c[0] + r) + 1)
            j0, j1 = max(0, int(c[1] - r)), min(nj, int(c[1] + r) + 1)
            d2 = (
                ((np.arange(i0, i1)[:, None, None] - c[0]) / r) ** 2
                + ((np.arange(j0, j1)[None, :, None] - c[1]) / r) ** 2
                + ((kk - c[2]) / rk) ** 2
            )
            sub = block[i0:i1, j0:j1]
            sub[d2 <= 1.0] = v
        block += rs.normal(0.0, 20.0, size=block.shape).astype(np.float32)
        yield k0, k1, block.round()


def make_bundle(workdir: Path, classes: int, seed: int = 0, patch: list[int] | None = None) -> Path:
    """A demo-sized UNet with ``classes`` outputs, seeded random weights, exported as a bundle."""
    from medseg.bundle.export import export_bundle
    from medseg.config import config_from_dict
    from medseg.models import build_network, network_def

    cfg = config_from_dict(
        {
            "name": f"bench-infer-{classes}cls",
            "task": "segmentation",
            "runs_dir": str(workdir),
            "data": {"dir": str(workdir / "no-data")},
            "transforms": {"spacing": [1.6, 1.6, 2.4], "window": [-150, 250], "patch": patch or [32, 32, 16]},
            "model": {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1},
            "train": {"seed": seed},
            "infer": {"sw_batch_size": 8},
        }
    )
    torch.manual_seed(seed)
    net = build_network(network_def(cfg, out_channels=classes))
    labels = {str(k): ("background" if k == 0 else f"class{k}") for k in range(classes)}
    quiet = logging.getLogger("medseg.bundle.export")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return export_bundle(cfg, {"model": net.state_dict(), "labels": labels, "epoch": 0}, {})
    finally:
        quiet.setLevel(level)


# ---------------------------------------------------------------------------------------------------
# One variant in its own process.


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    from medseg.bundle.export import load_bundle
    from medseg.inference import memory as predict_memory
    from medseg.inference.predict import load_image, predict

    torch.set_num_threads(args.threads or torch.get_num_threads())
    bundle = load_bundle(args.bundle)
    stream = args.variant == "new-stream"
    if stream:  # the file, read by the streaming path inside the measured call
        image = load_image(args.nifti, stream_above=0)
    else:
        image = synthetic_ct(tuple(args.shape), seed=args.seed)
    est = predict_memory.estimate(bundle.config, image, len(bundle.labels))
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass
    before_kb = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    probs = None
    if args.variant == "old":
        label, probs = predict_reference(bundle, image, device=args.device, keep_probs=True)
    else:
        if args.variant == "new-fp16":
            predict_memory.ACCUMULATE_DTYPE = torch.float16
        label = predict(bundle, image, device=args.device).label[0].as_tensor()
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")  # before anything below allocates
    out = {
        "seconds": round(seconds, 2),
        "peak_bytes": peak_kb * 1024,
        "before_bytes": before_kb * 1024,
        "input_bytes": int(image.numel() * (4 if stream else image.element_size())),
        "predicted_peak_bytes": est.peak_bytes,
        "threads": torch.get_num_threads(),
    }
    if cuda:
        out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated() - gpu0)
    if args.labels_out:
        np.save(args.labels_out, label.numpy())
        if probs is not None:  # old's top-two margins, to judge where labels may differ (TIE_TOLERANCE)
            np.save(args.labels_out.replace(".npy", "-margin.npy"), top2_margin(probs).numpy())
    return out


def _run_child(
    bundle: Path,
    shape: tuple[int, int, int],
    variant: str,
    device: str,
    labels_out: Path | None,
    timeout_s: float,
    nifti: Path | None = None,
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "medseg.bench.infer", "--bundle", str(bundle), "--variant", variant]
    cmd += ["--shape", *map(str, shape), "--device", device]
    if nifti is not None:
        cmd += ["--nifti", str(nifti)]
    if labels_out is not None:
        cmd += ["--labels-out", str(labels_out)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {last[:300]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def compare_labels(
    a: np.ndarray, b: np.ndarray, classes: int, margin: np.ndarray | None = None
) -> dict[str, Any]:
    """Voxels that differ, and Dice of each class of ``b`` against ``a`` (classes present in either).

    With ``margin`` (``a``'s top-two probability gap per voxel), also the largest gap at a differing
    voxel: small means the labels differ only at near-ties.
    """
    conf = np.zeros((classes, classes), dtype=np.int64)
    fa, fb = a.reshape(-1), b.reshape(-1)
    step = 1 << 24
    for s in range(0, fa.size, step):
        conf += np.bincount(
            fa[s : s + step].astype(np.int64) * classes + fb[s : s + step], minlength=classes * classes
        ).reshape(classes, classes)
    diag = np.diag(conf)
    sums = conf.sum(0) + conf.sum(1)
    dice = [float(2 * diag[c] / sums[c]) for c in range(classes) if sums[c] > 0]
    extra: dict[str, Any] = {}
    if margin is not None:
        worst = 0.0
        for s in range(0, fa.size, step):
            diff = fa[s : s + step] != fb[s : s + step]
            if diff.any():
                worst = max(worst, float(margin.reshape(-1)[s : s + step][diff].max()))
        extra["max_margin_differing"] = worst
    return {
        **extra,
        "differing_voxels": int(conf.sum() - diag.sum()),
        "voxels": int(conf.sum()),
        "min_dice": min(dice) if dice else 1.0,
        "classes_present": len(dice),
    }


def bench_infer(
    workdir: Path,
    quick: bool = False,
    device: str = "cpu",
    rounds: int = 2,
    sizes: list[tuple[int, int, int]] | None = None,
    classes: tuple[int, ...] = CLASSES,
    fp16: bool = True,
    old_limit_bytes: int = OLD_LIMIT_BYTES,
    partial: Path | None = None,
    reuse: dict[tuple[tuple[int, ...], int, str], list[dict[str, Any]]] | None = None,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Run every (size, classes, variant) in its own process; see the module docstring.

    ``variants`` limits the variants run (``old`` still only where it fits, ``new-fp16`` only on the
    smallest CT size and in quick runs).

    ``reuse`` (:func:`runs_from_log`) holds runs an interrupted invocation finished, by (shape, classes,
    variant), in round order: they are taken instead of being run again (their label maps must still
    be in ``workdir``), and the result says which.
    """
    reuse = {k: list(v) for k, v in (reuse or {}).items()}
    from medseg.sysinfo import available_memory

    workdir.mkdir(parents=True, exist_ok=True)
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    bundles = {c: make_bundle(workdir, c) for c in classes}
    timeout_s = 600.0 if quick else 3600.0
    result: dict[str, Any] = {
        "quick": quick,
        "device": device,
        "rounds": rounds,
        "spacing": list(SPACING),
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg()[0],
        "cases": [],
    }
    pairs = [(tuple(shape), c) for shape in sizes for c in classes]
    # The targeted case first, then the other CT sizes, so that a run cut short still answers the issue.
    pairs.sort(key=lambda p: (p != TIMED, p[0] != (512, 512, 300), p[0] != (512, 512, 1000), -p[1]))
    result["requested"] = [[list(shape), c] for shape, c in pairs]
    result["old_limit_bytes"] = old_limit_bytes
    for shape, c in pairs:
        n = int(np.prod(shape))
        case_rounds = rounds if quick or (shape, c) == TIMED else 1
        case: dict[str, Any] = {"shape": list(shape), "classes": c, "variants": {}}
        old_peak = old_peak_bytes(n, c)
        limit = min(old_limit_bytes, int(0.8 * available_memory()))
        run = ["old", "new", "new-stream"] if old_peak <= limit else ["new", "new-stream"]
        if old_peak > limit and "old" in variants:
            case["old_skipped"] = (
                f"predicted peak {old_peak / GB:.1f} GB exceeds the {limit / GB:.1f} GB limit"
            )
        if fp16 and (quick or shape == (256, 256, 128)):
            run.append("new-fp16")
        run = [v for v in run if v in variants]
        nifti = None
        if "new-stream" in run:
            nifti = workdir / f"input-{'x'.join(map(str, shape))}.nii.gz"
            if not nifti.exists():
                log.info("bench infer: writing %s", nifti)
                write_synthetic_nifti(nifti, shape)
        labels: dict[str, Path] = {}
        for r in range(case_rounds):
            for v in run:
                path = workdir / f"labels-{'x'.join(map(str, shape))}-{c}-{v}.npy" if r == 0 else None
                if v in ("new-fp16", "new-stream") and r > 0:
                    continue
                log.info("bench infer: %s, %d classes, %s, round %d", shape, c, v, r + 1)
                earlier = reuse.get((tuple(shape), c, v))
                if earlier and (path is None or path.exists()):
                    res = {**earlier.pop(0), "reused": True}
                    result.setdefault("reused", []).append(
                        f"{'x'.join(map(str, shape))} x {c} {v} round {r + 1}"
                    )
                else:
                    res = _run_child(bundles[c], shape, v, device, path, timeout_s, nifti)
                print(f"{'x'.join(map(str, shape)):>13} {c:3d} {v:9s} {json.dumps(res)}", flush=True)
                entry = case["variants"].setdefault(v, {"runs": []})
                entry["runs"].append(res)
                if path is not None and "error" not in res:
                    labels[v] = path
        if "old" in labels:
            ref = np.load(labels["old"], mmap_mode="r")
            margin_path = Path(str(labels["old"]).replace(".npy", "-margin.npy"))
            margin = np.load(margin_path, mmap_mode="r") if margin_path.exists() else None
            for v, p in labels.items():
                if v != "old":
                    case["variants"][v]["vs_old"] = compare_labels(ref, np.load(p, mmap_mode="r"), c, margin)
            del margin
            margin_path.unlink(missing_ok=True)
        elif "new" in labels:
            ref = np.load(labels["new"], mmap_mode="r")
            for v, p in labels.items():
                if v != "new":
                    case["variants"][v]["vs_new"] = compare_labels(ref, np.load(p, mmap_mode="r"), c)
        for p in labels.values():
            p.unlink(missing_ok=True)
        _summarise(case)
        result["cases"].append(case)
        if partial is not None:
            from medseg.bench.report import write_json

            write_json(partial, result)
    return result


def runs_from_log(text: str) -> dict[tuple[tuple[int, ...], int, str], list[dict[str, Any]]]:
    """Finished runs printed by an earlier invocation (``IxJxK classes variant {json}`` lines)."""
    runs: dict[tuple[tuple[int, ...], int, str], list[dict[str, Any]]] = {}
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[3].startswith("{") and "x" in parts[0] and parts[1].isdigit():
            res = json.loads(parts[3])
            if "error" not in res:
                shape = tuple(int(n) for n in parts[0].split("x"))
                runs.setdefault((shape, int(parts[1]), parts[2]), []).append(res)
    return runs


def _summarise(case: dict[str, Any]) -> None:
    for entry in case["variants"].values():
        ok = [r for r in entry["runs"] if "error" not in r]
        if ok:
            entry["peak_bytes"] = max(r["peak_bytes"] for r in ok)
            entry["seconds"] = [r["seconds"] for r in ok]
            entry["predicted_peak_bytes"] = ok[0]["predicted_peak_bytes"]
            if "gpu_peak_bytes" in ok[0]:
                entry["gpu_peak_bytes"] = max(r["gpu_peak_bytes"] for r in ok)
        else:
            entry["error"] = entry["runs"][0].get("error", "failed")
    old, new = case["variants"].get("old", {}), case["variants"].get("new", {})
    if "peak_bytes" in old and "peak_bytes" in new:
        case["peak_ratio"] = new["peak_bytes"] / old["peak_bytes"]
        case["time_ratios"] = [n / o for n, o in zip(new["seconds"], old["seconds"])]


def _find(result: dict[str, Any], shape: tuple[int, ...], classes: int) -> dict[str, Any] | None:
    for case in result["cases"]:
        if tuple(case["shape"]) == tuple(shape) and case["classes"] == classes:
            return case
    return None


def check_targets(result: dict[str, Any]) -> list[tuple[str, bool]]:
    """The issue's targets that this run measured."""
    checks: list[tuple[str, bool]] = []
    c3, c14 = _find(result, (512, 512, 300), 3), _find(result, (512, 512, 300), 14)
    new3 = (c3 or {}).get("variants", {}).get("new", {})
    if "peak_bytes" in new3:
        checks.append(("512x512x300, 3 classes: peak RSS <= 1.5 GB", new3["peak_bytes"] <= 1.5 * GB))
    if c3 and "time_ratios" in c3:
        checks.append(
            ("512x512x300, 3 classes: time <= 0.8x old (every round)", max(c3["time_ratios"]) <= 0.8)
        )
    big = _find(result, (512, 512, 1000), 14)
    for v, what in (("new-stream", "streamed from the file, as `medseg infer` runs it"), ("new", "loaded")):
        if big and "peak_bytes" in big["variants"].get(v, {}):
            checks.append(
                (
                    f"512x512x1000, 14 classes: within 8 GB ({v}: {what})",
                    big["variants"][v]["peak_bytes"] <= 8 * GB,
                )
            )
    new14 = (c14 or {}).get("variants", {}).get("new", {})
    if "peak_bytes" in new3 and "peak_bytes" in new14:
        checks.append(
            (
                "512x512x300: peak grows < 10% from 3 to 14 classes",
                new14["peak_bytes"] < 1.1 * new3["peak_bytes"],
            )
        )
    compared = [
        v["vs_old"]
        for case in result["cases"]
        for name, v in case["variants"].items()
        if name in ("new", "new-stream") and "vs_old" in v
    ]
    if compared:
        ok = all(
            cmp["differing_voxels"] == 0 or cmp.get("max_margin_differing", float("inf")) < TIE_TOLERANCE
            for cmp in compared
        )
        checks.append(
            (
                "new and new-stream labels equal old on every case compared, except at near-ties "
                f"(old's top-two probability gap < {TIE_TOLERANCE:g} at every differing voxel)",
                ok,
            )
        )
    streamed = [
        case["variants"]["new-stream"]["vs_new"]
        for case in result["cases"]
        if "vs_new" in case["variants"].get("new-stream", {})
    ]
    if streamed:
        checks.append(
            (
                "new-stream labels identical to new where old was not run",
                all(cmp["differing_voxels"] == 0 for cmp in streamed),
            )
        )
    return checks


def format_table(result: dict[str, Any]) -> str:
    rows = [
        "| input | classes | variant | peak RSS GB | predicted GB | time s (per round) | peak / old | time / old | labels vs old |",
        "|---|---:|---|---:|---:|---|---:|---|---|",
    ]
    for case in result["cases"]:
        shape = "x".join(map(str, case["shape"]))
        for v, e in case["variants"].items():
            if "error" in e:
                rows.append(f"| {shape} | {case['classes']} | {v} | — | — | — | — | — | {e['error']} |")
                continue
            old = case["variants"].get("old", {})
            pr = f"{e['peak_bytes'] / old['peak_bytes']:.2f}" if "peak_bytes" in old and v != "old" else "—"
            tr = (
                ", ".join(f"{n / o:.2f}" for n, o in zip(e["seconds"], old["seconds"]))
                if "seconds" in old and v != "old"
                else "—"
            )
            cmp = e.get("vs_old") or e.get("vs_new")
            what = "old" if "vs_old" in e else "new"
            if cmp:
                lab = f"{cmp['differing_voxels']} differ vs {what} of {cmp['voxels']} (min Dice {cmp['min_dice']:.7f})"
                if cmp["differing_voxels"] and "max_margin_differing" in cmp:
                    lab += f"; old's top-two gap there <= {cmp['max_margin_differing']:.1e}"
            elif v == "old":
                lab = "anchor"
            else:
                lab = case.get("old_skipped", "—")
            gpu = f" (GPU {e['gpu_peak_bytes'] / GB:.2f})" if "gpu_peak_bytes" in e else ""
            predicted = (
                old_peak_bytes(int(np.prod(case["shape"])), case["classes"])
                if v == "old"
                else e["predicted_peak_bytes"]
            )
            rows.append(
                f"| {shape} | {case['classes']} | {v} | {e['peak_bytes'] / GB:.2f}{gpu} | "
                f"{predicted / GB:.2f} | {', '.join(f'{s:.1f}' for s in e['seconds'])} | "
                f"{pr} | {tr} | {lab} |"
            )
        if "old" not in case["variants"] and case.get("old_skipped"):
            rows.append(f"| {shape} | {case['classes']} | old | not run: {case['old_skipped']} | | | | | |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    names, xs = [], []
    seen: set[str] = set()
    for i, case in enumerate(result["cases"]):
        names.append(f"{'x'.join(map(str, case['shape']))}\n{case['classes']} cls")
        xs.append(i)
        for j, v in enumerate(VARIANTS):
            e = case["variants"].get(v, {})
            if "peak_bytes" in e:
                ax.bar(
                    i + (j - 1.5) * 0.2,
                    e["peak_bytes"] / GB,
                    0.2,
                    color=f"C{j}",
                    label=v if v not in seen else None,
                )
                seen.add(v)
    ax.set_xticks(xs, names, fontsize=7)
    ax.set_ylabel("peak RSS (GB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_note(result: dict[str, Any]) -> str:
    """What this run left out: the memory limit on ``old`` and the requested cases it did not finish."""
    done = {(tuple(c["shape"]), c["classes"]) for c in result["cases"]}
    missing = [
        f"{'x'.join(map(str, shape))} x {c} classes"
        for shape, c in result.get("requested", [])
        if (tuple(shape), c) not in done
    ]
    parts = []
    if "old_limit_bytes" in result:
        parts.append(
            f"`old` was run only where its predicted peak is under {result['old_limit_bytes'] / GB:.1f} GB "
            "(and 80% of the memory available at the time)."
        )
    if missing:
        parts.append("Requested but not finished in this run, not reported: " + ", ".join(missing) + ".")
    if result.get("reused"):
        parts.append(
            "Taken from an interrupted earlier invocation of the same code on the same machine (its "
            "printed results and label maps): " + ", ".join(result["reused"]) + "."
        )
    return " ".join(parts)


def write_report(result: dict[str, Any], json_out: Path, markdown: Path | None, note: str = "") -> None:
    note = " ".join(x for x in (run_note(result), note) if x)
    intro = (
        f"## Inference: `medseg bench infer{' --quick' if result['quick'] else ''}`\n\n"
        f"Synthetic CTs at {result['spacing']} mm (LPS-stored, float32 once loaded), demo-sized UNet (seeded, "
        f"untrained; 3 and 14 classes), on {result['device']} ({result['cpu_count']} cores, load average "
        f"{result['loadavg']:.1f} at the start"
        + (
            ": other jobs shared the CPU, so time ratios are noisy; memory is not"
            if result["loadavg"] > 1.5
            else ""
        )
        + "). Each variant runs in its own process; peak RSS is the child's VmHWM (libraries, the loaded "
        "input and the prediction) with MALLOC_MMAP_THRESHOLD_=65536; time is the `predict` call, one column "
        "per round. `old` is the previous path (C probability maps inverted by `Invertd`, argmax after) "
        "measured in the same run; it is not run where its predicted peak exceeds the memory limit. "
        "`new-stream` is `predict` on the same CT written as an int16 `.nii.gz` and read by the streaming "
        "path (`medseg infer` above its threshold): its time and peak include reading the file. "
        "'predicted' is `medseg.inference.memory.estimate`, the figure `predict` checks before it starts "
        "(for `old`, `old_peak_bytes`, fit to the issue's 5.5 GB)." + (f"\n\n{note}" if note else "")
    )
    publish(result, json_out, markdown, "infer", plot, check_targets(result), intro, format_table(result))


def _main() -> None:
    p = argparse.ArgumentParser(description="one variant of medseg bench infer (internal)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--variant", choices=list(VARIANTS), required=True)
    p.add_argument("--nifti", help="the input as a file (new-stream)")
    p.add_argument("--shape", type=int, nargs=3, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--labels-out")
    print(json.dumps(_child(p.parse_args())))


if __name__ == "__main__":
    _main()

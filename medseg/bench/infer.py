"""``medseg bench infer``: memory and time of ``medseg.inference.predict.predict`` against a reference path.

Cases: synthetic CT volumes (:mod:`medseg.bench.infer_cases`; HU, LPS-stored, 0.78 x 0.78 x 1 mm)
of 256x256x128, 512x512x300 and 512x512x1000 voxels, with 3 and 14 classes. The models are
demo-sized UNets (configs/demo-seg.yaml's network), randomly initialised with a fixed seed and
exported as bundles by medseg's exporter: labels, not accuracy, are compared.

Variants, each in its own process (:mod:`medseg.bench.infer_variant`; a fresh allocator is the only
honest peak):

- ``old``: the reference path (softmax, ``Invertd`` of the C probability maps onto the input grid,
  argmax there), :func:`medseg.bench.infer_reference.predict_reference`, the anchor measured in
  the same run;
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

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from medseg.bench.infer_cases import SPACING, make_bundle, write_synthetic_nifti
from medseg.bench.infer_reference import GB, TIE_TOLERANCE, compare_labels, old_peak_bytes
from medseg.bench.infer_variant import VARIANTS
from medseg.bench.protocol import Benchmark, Target, at_most, figure, run_isolated, table_head, table_row
from medseg.bench.report import write_json
from medseg.sysinfo import available_memory

log = logging.getLogger(__name__)

FULL_SIZES = [(256, 256, 128), (512, 512, 300), (512, 512, 1000)]
QUICK_SIZES = [(96, 96, 40), (128, 128, 64)]
CLASSES = (3, 14)
#: The case the time target is on: timed ``rounds`` times; the others once (2 shared cores are slow).
TIMED = ((512, 512, 300), 3)
OLD_LIMIT_BYTES = 14 * 2**30  # never start a variant predicted above this (machine: 24 GiB, shared)
#: Runs an earlier invocation printed, by (shape, classes, variant), in round order.
Reuse = dict[tuple[tuple[int, ...], int, str], list[dict[str, Any]]]


def _run_child(
    bundle: Path,
    shape: tuple[int, int, int],
    variant: str,
    device: str,
    labels_out: Path | None,
    timeout_s: float,
    nifti: Path | None = None,
) -> dict[str, Any]:
    """One variant measured by :mod:`medseg.bench.infer_variant` in its own process."""
    cmd = [sys.executable, "-m", "medseg.bench.infer_variant", "--bundle", str(bundle), "--variant", variant]
    cmd += ["--shape", *map(str, shape), "--device", device]
    if nifti is not None:
        cmd += ["--nifti", str(nifti)]
    if labels_out is not None:
        cmd += ["--labels-out", str(labels_out)]
    return run_isolated(cmd, timeout_s, error_chars=300)


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
    reuse: Reuse | None = None,
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
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    bundles = {c: make_bundle(workdir, c) for c in classes}
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
    # The targeted case first, then the other CT sizes, so that a run cut short still has the targets' figures.
    pairs.sort(key=lambda p: (p != TIMED, p[0] != (512, 512, 300), p[0] != (512, 512, 1000), -p[1]))
    result["requested"] = [[list(shape), c] for shape, c in pairs]
    result["old_limit_bytes"] = old_limit_bytes
    runner = _Runner(workdir, device, 600.0 if quick else 3600.0, bundles, reuse, result)
    for shape, c in pairs:
        case: dict[str, Any] = {"shape": list(shape), "classes": c, "variants": {}}
        run = _variants_to_run(case, quick, fp16, variants, old_limit_bytes)
        case_rounds = rounds if quick or (shape, c) == TIMED else 1
        labels = runner.run_case(case, run, case_rounds)
        _compare_case(case, labels)
        _summarise(case)
        result["cases"].append(case)
        if partial is not None:
            write_json(partial, result)
    return result


def _variants_to_run(
    case: dict[str, Any], quick: bool, fp16: bool, variants: tuple[str, ...], old_limit_bytes: int
) -> list[str]:
    """The variants of ``case`` to run: ``old`` only where its predicted peak fits (else the case says
    why not), ``new-fp16`` on the smallest CT size and in quick runs, all within ``variants``."""
    shape, c = tuple(case["shape"]), case["classes"]
    old_peak = old_peak_bytes(int(np.prod(shape)), c)
    limit = min(old_limit_bytes, int(0.8 * available_memory()))
    run = ["old", "new", "new-stream"] if old_peak <= limit else ["new", "new-stream"]
    if old_peak > limit and "old" in variants:
        case["old_skipped"] = f"predicted peak {old_peak / GB:.1f} GB exceeds the {limit / GB:.1f} GB limit"
    if fp16 and (quick or shape == (256, 256, 128)):
        run.append("new-fp16")
    return [v for v in run if v in variants]


@dataclass
class _Runner:
    """What every case of one invocation shares: its folder, device, child time limit, bundles (by
    classes), the runs it may reuse, and the result document it records reuse in."""

    workdir: Path
    device: str
    timeout_s: float
    bundles: dict[int, Path]
    reuse: Reuse
    result: dict[str, Any]

    def run_case(self, case: dict[str, Any], run: list[str], rounds: int) -> dict[str, Path]:
        """Run (or reuse) ``run`` for ``rounds`` rounds; the first round's label maps, by variant."""
        shape, c = tuple(case["shape"]), case["classes"]
        name = "x".join(map(str, shape))
        nifti = None
        if "new-stream" in run:
            nifti = self.workdir / f"input-{name}.nii.gz"
            if not nifti.exists():
                log.info("bench infer: writing %s", nifti)
                write_synthetic_nifti(nifti, shape)
        labels: dict[str, Path] = {}
        for r in range(rounds):
            for v in run:
                path = self.workdir / f"labels-{name}-{c}-{v}.npy" if r == 0 else None
                if v in ("new-fp16", "new-stream") and r > 0:
                    continue
                log.info("bench infer: %s, %d classes, %s, round %d", shape, c, v, r + 1)
                earlier = self.reuse.get((shape, c, v))
                if earlier and (path is None or path.exists()):
                    res = {**earlier.pop(0), "reused": True}
                    self.result.setdefault("reused", []).append(f"{name} x {c} {v} round {r + 1}")
                else:
                    res = _run_child(self.bundles[c], shape, v, self.device, path, self.timeout_s, nifti)
                # the line runs_from_log reads back: IxJxK classes variant {json}
                print(f"{name:>13} {c:3d} {v:9s} {json.dumps(res)}", flush=True)
                case["variants"].setdefault(v, {"runs": []})["runs"].append(res)
                if path is not None and "error" not in res:
                    labels[v] = path
        return labels


def _compare_case(case: dict[str, Any], labels: dict[str, Path]) -> None:
    """Each variant's labels against ``old``'s (with old's top-two margins), else against ``new``'s;
    the label maps are deleted afterwards."""
    c = case["classes"]
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


def runs_from_log(text: str) -> Reuse:
    """Finished runs printed by an earlier invocation (``IxJxK classes variant {json}`` lines)."""
    runs: Reuse = {}
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


def check_targets(result: dict[str, Any]) -> list[Target]:
    """The targets this run measured: peak and time at 512x512x300, the whole-body peak, labels."""
    checks: list[Target] = []
    c3, c14 = _find(result, (512, 512, 300), 3), _find(result, (512, 512, 300), 14)
    new3 = (c3 or {}).get("variants", {}).get("new", {})
    if "peak_bytes" in new3:
        checks.append(at_most("512x512x300, 3 classes: peak RSS <= 1.5 GB", new3["peak_bytes"], 1.5 * GB))
    if c3 and "time_ratios" in c3:
        checks.append(
            at_most("512x512x300, 3 classes: time <= 0.8x old (every round)", max(c3["time_ratios"]), 0.8)
        )
    big = _find(result, (512, 512, 1000), 14)
    for v, what in (("new-stream", "streamed from the file, as `medseg infer` runs it"), ("new", "loaded")):
        if big and "peak_bytes" in big["variants"].get(v, {}):
            name = f"512x512x1000, 14 classes: within 8 GB ({v}: {what})"
            checks.append(at_most(name, big["variants"][v]["peak_bytes"], 8 * GB))
    new14 = (c14 or {}).get("variants", {}).get("new", {})
    if "peak_bytes" in new3 and "peak_bytes" in new14:
        checks.append(
            Target(
                "512x512x300: peak grows < 10% from 3 to 14 classes",
                new14["peak_bytes"] < 1.1 * new3["peak_bytes"],
            )
        )
    return checks + _label_targets(result)


def _label_targets(result: dict[str, Any]) -> list[Target]:
    """new and new-stream equal old but at near-ties; new-stream equals new where old was not run."""
    checks: list[Target] = []
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
            Target(
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
            Target(
                "new-stream labels identical to new where old was not run",
                all(cmp["differing_voxels"] == 0 for cmp in streamed),
            )
        )
    return checks


def format_table(result: dict[str, Any]) -> str:
    columns = ["input", "classes", "variant", "peak RSS GB", "predicted GB", "time s (per round)"]
    rows = table_head([*columns, "peak / old", "time / old", "labels vs old"], "lrlrrlrll")
    for case in result["cases"]:
        shape = "x".join(map(str, case["shape"]))
        for v, e in case["variants"].items():
            if "error" in e:
                rows.append(table_row(shape, case["classes"], v, *["—"] * 5, e["error"]))
                continue
            rows.append(table_row(shape, case["classes"], v, *_variant_cells(case, v, e)))
        if "old" not in case["variants"] and case.get("old_skipped"):
            rows.append(
                table_row(shape, case["classes"], "old", f"not run: {case['old_skipped']}", *[""] * 5)
            )
    return "\n".join(rows)


def _variant_cells(case: dict[str, Any], v: str, e: dict[str, Any]) -> list[str]:
    """A variant's cells from peak RSS on: peaks, times, ratios to old, and its labels' comparison."""
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
        lab = (
            f"{cmp['differing_voxels']} differ vs {what} of {cmp['voxels']} (min Dice {cmp['min_dice']:.7f})"
        )
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
    seconds = ", ".join(f"{s:.1f}" for s in e["seconds"])
    return [f"{e['peak_bytes'] / GB:.2f}{gpu}", f"{predicted / GB:.2f}", seconds, pr, tr, lab]


def plot(result: dict[str, Any], path: Path) -> None:
    """Peak RSS of every variant of every case."""
    with figure(path, (9, 3.6), save_dpi=110) as (fig, ax):
        names, xs = [], []
        seen: set[str] = set()
        for i, case in enumerate(result["cases"]):
            names.append(f"{'x'.join(map(str, case['shape']))}\n{case['classes']} cls")
            xs.append(i)
            for j, v in enumerate(VARIANTS):
                e = case["variants"].get(v, {})
                if "peak_bytes" in e:
                    label = v if v not in seen else None
                    ax.bar(i + (j - 1.5) * 0.2, e["peak_bytes"] / GB, 0.2, color=f"C{j}", label=label)
                    seen.add(v)
        ax.set_xticks(xs, names, fontsize=7)
        ax.set_ylabel("peak RSS (GB)")
        ax.legend(fontsize=8)


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


def intro(result: dict[str, Any]) -> str:
    note = run_note(result)
    return (
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


BENCHMARK = Benchmark("infer", intro=intro, targets=check_targets, table=format_table, plot=plot)
write_report = BENCHMARK.write_report

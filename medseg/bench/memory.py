"""``medseg bench memory``: activation memory and step time of UNet, SegResNet and DynUNet variants.

Cases are networks with 3 classes (medseg's defaults; ``--quick`` halves their channels) plus
``unet-14cls``: UNet at the default width with 14 classes (BTCV's labels), where the loss's maps are
a visible share of the peak. ``fused`` means fused norm+activation layers *and* the fused Dice+CE
loss (``train.memory: fused``), into which the network's last convolution is fused where it can be
(``head.py``: UNet and DynUNet, not SegResNet); the other variants train with MONAI's ``DiceCELoss``.

Every (net, variant) pair is measured in its own process by :mod:`medseg.kernels.measure` (a fresh
allocator is the only honest peak). Ratios are against ``baseline`` from the same run. The largest
cubic patch within a memory budget is predicted from the measured peak (activation memory grows
with the number of voxels) and, with ``verify``, confirmed by measuring each variant at that patch.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from medseg.bench.protocol import Benchmark, Target, at_most, figure, run_isolated, table_head, table_row
from medseg.kernels.measure import VARIANTS

log = logging.getLogger(__name__)

TARGET_PEAK = 0.6  # fused peak / baseline peak
TARGET_PEAK_MANY = 0.45  # the same on the many-class case
# case -> (network, classes, width or None for the run's width)
CASES: dict[str, tuple[str, int, float | None]] = {
    "unet": ("unet", 3, None),
    "segresnet": ("segresnet", 3, None),
    "dynunet": ("dynunet", 3, None),
    "unet-14cls": ("unet", 14, 1.0),
}
TARGET_TIME = 1.10  # fused step time / baseline step time


def run_variant(
    case: str, variant: str, patch: int, batch: int, steps: int, device: str, timeout_s: float, width: float
) -> dict[str, Any]:
    """One (case, variant) measured by :mod:`medseg.kernels.measure` in its own process."""
    net, classes, case_width = CASES[case]
    cmd = [sys.executable, "-m", "medseg.kernels.measure", "--net", net, "--variant", variant]
    cmd += ["--patch", str(patch), "--batch", str(batch), "--steps", str(steps), "--device", device]
    cmd += ["--width", str(case_width or width), "--classes", str(classes)]
    return run_isolated(cmd, timeout_s, error_chars=200)


def largest_patch(peak_bytes: float, patch: int, budget_bytes: float, multiple: int = 16) -> int:
    """Largest multiple of ``multiple`` whose predicted peak, ``peak·(p/patch)³``, fits the budget."""
    per_voxel = peak_bytes / patch**3
    side = int(((budget_bytes / per_voxel) ** (1 / 3) + 1e-6) // multiple * multiple)
    return max(side, 0)


def bench_memory(
    quick: bool = False,
    device: str = "cpu",
    nets: tuple[str, ...] = tuple(CASES),
    variants: tuple[str, ...] | None = None,
    batch: int = 2,
    steps: int = 5,
    budget_gb: float | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Measure each variant of each net; see the module docstring. Returns the JSON document."""
    # --quick: 64³ and half the channels, so that three nets x three variants fit in minutes on 2 cores.
    patch, width = (64, 0.5) if quick else (96, 1.0)
    if variants is None:
        # torch.compile of a 3D UNet's forward and backward takes minutes on 2 CPU cores.
        variants = tuple(v for v in VARIANTS if not (quick and v == "compile"))
    # per variant; generous, because a shared 2-core machine can run a quick step 30x slower than idle
    timeout_s = 3600.0
    out: dict[str, Any] = {"nets": {}, "patch": patch, "width": width, "batch": batch, "steps": steps}
    out["cases"] = {
        c: {"net": CASES[c][0], "classes": CASES[c][1], "width": CASES[c][2] or width} for c in nets
    }
    out["device"] = device
    budget_gb = budget_gb or (1.0 if quick else 8.0)
    out["quick"], out["budget_gb"], out["patches"] = quick, budget_gb, {}
    for net in nets:
        out["nets"][net] = {}
        for variant in variants:
            log.info("bench memory: %s %s at %d^3", net, variant, patch)
            r = run_variant(net, variant, patch, batch, steps, device, timeout_s, width)
            out["nets"][net][variant] = r
            print(f"{net:10s} {variant:10s} {json.dumps(r)}", flush=True)
        if "peak_bytes" in out["nets"][net].get("baseline", {}):
            out["patches"][net] = _largest_patches(
                net, out["nets"][net], budget_gb * 2**30, patch, batch, device, timeout_s, width, verify
            )
    return out


def _largest_patches(
    net: str,
    runs: dict[str, Any],
    budget: float,
    patch: int,
    batch: int,
    device: str,
    timeout_s: float,
    width: float,
    verify: bool,
) -> dict[str, Any]:
    """Each measured variant's largest patch within ``budget`` bytes; with ``verify``, measured there."""
    sizes: dict[str, Any] = {"budget_bytes": budget}
    for variant, r in runs.items():
        if "peak_bytes" in r:
            sizes[variant] = {"predicted": largest_patch(r["peak_bytes"], patch, budget)}
            if verify and sizes[variant]["predicted"] > 0:
                p = sizes[variant]["predicted"]
                check = run_variant(net, variant, p, batch, 1, device, timeout_s, width)
                sizes[variant]["measured_peak_bytes"] = check.get("peak_bytes")
                sizes[variant]["fits"] = check.get("peak_bytes", float("inf")) <= budget
    return sizes


def ratios(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """peak, saved and step-time ratios of every variant against the same net's baseline."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for net, variants in result["nets"].items():
        base = variants.get("baseline", {})
        if "peak_bytes" not in base:
            continue
        table[net] = {
            v: {
                "peak": r["peak_bytes"] / base["peak_bytes"],
                "saved": r["saved_bytes"] / base["saved_bytes"],
                "loss_saved": r.get("loss_saved_bytes", 0) / max(base.get("loss_saved_bytes", 0), 1),
                "time": r["step_s"] / base["step_s"],
            }
            for v, r in variants.items()
            if "peak_bytes" in r
        }
    return table


def check_targets(result: dict[str, Any]) -> list[Target]:
    """Peak and time targets per case, and fused against checkpointing on both time and peak."""
    checks = []
    for net, r in ratios(result).items():
        if "fused" not in r:
            continue
        f = r["fused"]
        classes = result.get("cases", {}).get(net, {}).get("classes", 3)
        target = TARGET_PEAK_MANY if classes > 3 else TARGET_PEAK
        checks.append(
            at_most(f"{net}: fused peak {f['peak']:.2f}x baseline (target <= {target})", f["peak"], target)
        )
        checks.append(
            at_most(
                f"{net}: fused step time {f['time']:.2f}x baseline (target <= {TARGET_TIME})",
                f["time"],
                TARGET_TIME,
            )
        )
        if "checkpoint" in r:
            checks.append(_fused_against_checkpoint(net, f, r["checkpoint"]))
    return checks


def _fused_against_checkpoint(net: str, f: dict[str, float], c: dict[str, float]) -> Target:
    """Met when fused is faster than checkpointing at a peak no higher; the name says where it loses."""
    faster, lower = f["time"] < c["time"], f["peak"] <= c["peak"]
    verdict = (
        "fused faster at a peak no higher"
        if faster and lower
        else "fused loses on " + " and ".join(w for w, ok in (("time", faster), ("peak", lower)) if not ok)
    )
    return Target(
        f"{net}: fused {f['time']:.2f}x vs checkpoint {c['time']:.2f}x time, "
        f"peak {f['peak']:.2f}x vs {c['peak']:.2f}x: {verdict}",
        faster and lower,
    )


def format_table(result: dict[str, Any]) -> str:
    mb = 2**20
    columns = ["case", "variant", "net saved MiB", "loss saved MiB", "peak MiB", "peak ratio", "step s"]
    rows = table_head([*columns, "time ratio", "largest patch"], "llrrrrrrr")
    table = ratios(result)
    for net, variants in result["nets"].items():
        for v, r in variants.items():
            if "error" in r:
                rows.append(table_row(net, v, *["—"] * 6, r["error"]))
                continue
            q = table.get(net, {}).get(v, {})
            size = result["patches"].get(net, {}).get(v, {})
            largest = f"{size['predicted']}³" if size else "—"
            if "fits" in size:
                largest += " (measured: fits)" if size["fits"] else " (measured: over budget)"
            rows.append(
                table_row(
                    net,
                    v,
                    f"{r['saved_bytes'] / mb:.0f}",
                    f"{r.get('loss_saved_bytes', 0) / mb:.0f}",
                    f"{r['peak_bytes'] / mb:.0f}",
                    f"{q.get('peak', float('nan')):.2f}",
                    f"{r['step_s']:.2f}",
                    f"{q.get('time', float('nan')):.2f}",
                    largest,
                )
            )
    return "\n".join(rows) + "\n\n" + format_breakdown(result)


def format_breakdown(result: dict[str, Any]) -> str:
    """Where each peak goes: phase peaks, and the peak split into saved maps and the rest."""
    mb = 2**20
    columns = ["case", "variant", "fwd / loss / bwd / opt", "peak in", "saved", "loss transient"]
    rows = [
        "Peak breakdown (MiB). Phase peaks: forward / loss / backward / optimizer, each above the step's "
        "start. The peak is split into maps saved for backward (network + loss), the loss's transient "
        "maps (its phase peak beyond what is saved), parameter gradients (exact), the logits' "
        "gradient (0 where the last convolution is fused with the loss: one slab's at a time), and the remainder: convolution workspace and allocator slack.",
        "",
        *table_head([*columns, "param grads", "logits grad", "workspace + allocator"], "llllrrrrr"),
    ]
    for net, variants in result["nets"].items():
        for v, r in variants.items():
            b, ph = r.get("breakdown"), r.get("phase_peaks")
            if not b or not ph:
                continue
            phases = " / ".join(f"{ph[k] / mb:.0f}" for k in ("forward", "loss", "backward", "optimizer"))
            sizes = ("saved", "loss_transient", "param_grads", "logits_grad", "workspace_and_allocator")
            rows.append(table_row(net, v, phases, b["peak_phase"], *(f"{b[k] / mb:.0f}" for k in sizes)))
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> None:
    """Peak memory and step time of each variant over its net's baseline, with the targets."""
    table = ratios(result)
    with figure(path, (10, 3.6), ncols=2, save_dpi=110) as (fig, axes):
        for ax, key, title in (
            (axes[0], "peak", "peak memory / baseline"),
            (axes[1], "time", "step time / baseline"),
        ):
            nets = list(table)
            variants = [v for v in VARIANTS if any(v in table[n] for n in nets)]
            width = 0.8 / max(len(variants), 1)
            for i, v in enumerate(variants):
                xs = [j + i * width for j, n in enumerate(nets) if v in table[n]]
                ys = [table[n][v][key] for n in nets if v in table[n]]
                ax.bar(xs, ys, width, label=v)
            ax.axhline(TARGET_PEAK if key == "peak" else TARGET_TIME, color="k", ls="--", lw=0.8)
            ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(nets))], nets)
            ax.set_title(title)
        axes[0].legend(fontsize=8)


def intro(result: dict[str, Any]) -> str:
    return (
        f"## Memory: `medseg bench memory{' --quick' if result['quick'] else ''}`\n\n"
        f"Patch {result['patch']}³, channel width {result['width']}x medseg's defaults (unet-14cls: UNet at "
        f"1.0x with 14 classes), batch {result['batch']}, "
        f"DiceCE loss (fused: the fused Dice+CE loss, with the last convolution fused into it for UNet and "
        f"DynUNet, so no full logits or logits gradient exist; others: MONAI's DiceCELoss), AdamW, on "
        f"{result['device']}; each variant in its own process; step time is the median "
        f"of {result['steps']} steps after warm-up. Peak is what one training step needs above the memory in "
        f"use before it (docs/design.md's CPU recipe: VmHWM with MALLOC_MMAP_THRESHOLD_=65536). Ratios are against "
        f"baseline in the same run. Largest patch: the largest multiple of 16 predicted to fit within "
        f"{result['budget_gb']} GiB from the measured peak per voxel."
    )


BENCHMARK = Benchmark("memory", intro=intro, targets=check_targets, table=format_table, plot=plot)
write_report = BENCHMARK.write_report

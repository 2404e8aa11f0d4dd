"""The figures, targets, table and plot of ``medseg bench real-sites`` (:mod:`medseg.bench.real_sites`).

Derived figures, from what the jobs measured:

- **Regime**: from the bsp-hier probe job on the dilated WAN, its waiting on other sites per step
  (mean over ranks) over its compute per step (the slowest rank's, which sets a synchronous
  step's pace). The main scenario must be at least :data:`REGIME_MIN`.
- **bsp-hier on the dilated WAN, estimated**: the no-WAN control's time to Dice from launch plus
  the control's steps up to that epoch times the extra seconds per step the probe measured (its
  rank 0's wall time per step on the WAN less the control's). Its WAN bytes: the probe's measured
  payload per step times those steps.
- **Best peer**: the least time to Dice from launch of bsp-hier (estimated), fedavg and diloco.
- **Best gssp**: the least time to Dice from launch of the gssp variants that ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medseg.bench.protocol import Benchmark, Target, at_least, at_most, figure, table_head, table_row, within
from medseg.bench.real_sites import GPU_STEP_S, GSSP, PEERS
from medseg.bench.real_sites_tune import point_text

REGIME_MIN = 20.0
TIME_LIMIT = 0.5  # best gssp's time to Dice over the best peer's, from launch
BYTES_LIMIT = 1 / 50  # best gssp's WAN bytes over bsp-hier's
LAN_LIMIT = 1.2  # best gssp's time on the dilated WAN over bsp-hier's on the no-WAN control
DICE_BAND = 0.01  # |held-out Dice - bsp-hier's|, two-sided, judged with MIN_SEEDS seeds or more
MIN_SEEDS = 3


def regime(result: dict[str, Any]) -> dict[str, float | None]:
    """bsp-hier's measured time per step spent other than computing (its exact average: in site,
    between the sites' leaders, back in site; mean over ranks) over its compute per step (the
    slowest rank's, which sets a synchronous step's pace), on the dilated WAN."""
    p = result["bsp_hier_probe"]
    steps = max(p["steps"], 1)
    rt = p["rank_time"]
    wan = sum(t["wall_s"] - t["compute_s"] for t in rt) / len(rt) / steps
    compute = max(t["compute_s"] for t in rt) / steps
    return {
        "wan_per_step_s": wan,
        "compute_per_step_s": compute,
        "wall_per_step_s": rt[0]["wall_s"] / steps,
        "ratio": wan / compute if compute else None,
    }


def bsp_hier_on_wan(result: dict[str, Any]) -> dict[str, float | None]:
    """bsp-hier's time to Dice from launch and WAN payload on the dilated WAN, estimated from the
    no-WAN control's runs and the probe's per-step figures (module docstring)."""
    lan, p = result["lan"]["bsp-hier"], result["bsp_hier_probe"]
    probe_step = p["rank_time"][0]["wall_s"] / max(p["steps"], 1)
    payload_step = p["wan_payload_measured"] / max(p["steps"], 1)
    times, payloads = [], []
    for run in lan["runs"]:
        lan_step = run["rank_time"][0]["wall_s"] / max(run["steps"], 1)
        reached = run["time_to_dice_job_s"]
        first = next(
            (
                i
                for i, (_, d) in enumerate(run["curve"])
                if d is not None and d >= result["setting"]["dice_target"]
            ),
            None,
        )
        if reached is None or first is None:
            return {"time_to_dice_job_s": None, "wan_payload": None}
        steps = run["steps"] * (first + 1) / run["epochs"]
        times.append(reached + steps * max(probe_step - lan_step, 0.0))
        payloads.append(steps * payload_step)
    return {"time_to_dice_job_s": sum(times) / len(times), "wan_payload": sum(payloads) / len(payloads)}


def _time(c: dict[str, Any]) -> float | None:
    return c.get("time_to_dice_job_s")


def best(result: dict[str, Any]) -> dict[str, Any]:
    """The best peer and the best gssp variant by time to Dice from launch (None where none reached it)."""
    peers = {n: _time(c) for n, c in result["wan"].items() if n in PEERS}
    peers["bsp-hier (estimated)"] = bsp_hier_on_wan(result)["time_to_dice_job_s"]
    gssp = {n: _time(c) for n, c in result["wan"].items() if n in GSSP}
    pick = lambda d: min(((t, n) for n, t in d.items() if t is not None), default=(None, None))  # noqa: E731
    (tp, np_), (tg, ng) = pick(peers), pick(gssp)
    return {"peer": np_, "peer_s": tp, "gssp": ng, "gssp_s": tg}


def check_targets(result: dict[str, Any]) -> list[Target]:
    r, b = regime(result), best(result)
    checks = [
        at_least(
            f"hippo3: bsp-hier averaging time per step over compute >= {REGIME_MIN:.0f} (got {_x(r['ratio'])})",
            r["ratio"],
            REGIME_MIN,
        )
    ]
    x = b["gssp_s"] / b["peer_s"] if b["gssp_s"] and b["peer_s"] else None
    band = seed_ratios(result, b["gssp"], b["peer"])
    spread = f", seed by seed {min(band):.2f}-{max(band):.2f}x" if len(band) > 1 else ""
    checks.append(
        at_most(
            f"hippo3: best gssp ({b['gssp']}) time to Dice from launch <= {TIME_LIMIT}x the best peer ({b['peer']}) (got {_x(x)}{spread})",
            x,
            TIME_LIMIT,
        )
    )
    est = bsp_hier_on_wan(result)
    g = result["wan"].get(b["gssp"]) if b["gssp"] else None
    xb = g["wan_payload_measured"] / est["wan_payload"] if g and est["wan_payload"] else None
    checks.append(
        at_most(
            f"hippo3: best gssp WAN bytes <= 1/{1 / BYTES_LIMIT:.0f} of bsp-hier's (got {_x(xb)})",
            xb,
            BYTES_LIMIT,
        )
    )
    lan = result["lan"]["bsp-hier"]["time_to_dice_job_s"]
    xl = b["gssp_s"] / lan if b["gssp_s"] and lan else None
    checks.append(
        at_most(
            f"hippo3: best gssp on the dilated WAN <= {LAN_LIMIT}x bsp-hier on the no-WAN control (got {_x(xl)})",
            xl,
            LAN_LIMIT,
        )
    )
    if result["seeds"] >= MIN_SEEDS:
        ref = result["lan"]["bsp-hier"]["held_out_mean"]
        for name, c in result["wan"].items():
            d = None if ref is None or c["held_out_mean"] is None else c["held_out_mean"] - ref
            text = f"hippo3: {name} held-out Dice within +-{DICE_BAND} of bsp-hier ({'not measured' if d is None else f'{d:+.3f}'})"
            checks.append(within(text, d, DICE_BAND))
    return checks


def seed_ratios(result: dict[str, Any], gssp: str | None, peer: str | None) -> list[float]:
    """Seed by seed, ``gssp``'s time to Dice from launch over ``peer``'s (the same seed: the same
    initial weights and draws); empty unless both ran on the WAN and every seed reached the target."""
    wan = result["wan"]
    if gssp not in wan or peer not in wan:
        return []
    pairs = [
        (g.get("time_to_dice_job_s"), p.get("time_to_dice_job_s"))
        for g, p in zip(wan[gssp]["runs"], wan[peer]["runs"])
    ]
    return [g / p for g, p in pairs if g and p] if all(g and p for g, p in pairs) else []


def _x(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.2f}x"


def _s(v: float | None) -> str:
    return "not reached" if v is None else f"{v:.0f}"


def _spread(c: dict[str, Any], key: str, fmt: str) -> str:
    v, sp = c.get(key), c.get(f"{key}_spread")
    if v is None:
        return "not reached" if key.startswith("time") else "-"
    return format(v, fmt) + (
        f" ({format(sp[0], fmt)}-{format(sp[1], fmt)})" if sp and c.get("seeds", 1) > 1 else ""
    )


def format_table(result: dict[str, Any]) -> str:
    b, est, r = best(result), bsp_hier_on_wan(result), regime(result)
    cols = ["config", "where", "time to Dice from launch (s)", "x best peer", "training time to Dice (s)"]
    cols += [
        "Dice after equal epochs (val)",
        "held-out Dice, mean of sites",
        "held-out a / b / c",
        "epochs run",
        "samples trained, all ranks",
        "WAN payload (MB)",
    ]
    lines = table_head(cols, "l" * len(cols))
    rows = [("bsp-hier", "no WAN", result["lan"]["bsp-hier"])] + [
        (n, "dilated WAN", c) for n, c in result["wan"].items()
    ]
    for name, where, c in rows:
        x = _time(c) / b["peer_s"] if _time(c) and b["peer_s"] else None
        per = [sum(run["held_out"][s] or 0 for run in c["runs"]) / len(c["runs"]) for s in ("a", "b", "c")]
        lines.append(
            table_row(
                name,
                where,
                _spread(c, "time_to_dice_job_s", ".0f"),
                _x(x),
                _spread(c, "time_to_dice_s", ".0f"),
                _spread(c, "dice_equal_epochs", ".3f"),
                _spread(c, "held_out_mean", ".3f"),
                " / ".join(f"{v:.3f}" for v in per),
                c["epochs"],
                f"{c['samples_per_s'] * c['job_s']:.0f}",
                "-" if where == "no WAN" else f"{c['wan_payload_measured'] / 1e6:.1f}",
            )
        )
    xe = est["time_to_dice_job_s"] / b["peer_s"] if est["time_to_dice_job_s"] and b["peer_s"] else None
    pay = "-" if est["wan_payload"] is None else f"{est['wan_payload'] / 1e6:.1f}"
    lines.append(
        table_row(
            "bsp-hier (estimated)",
            "dilated WAN",
            _s(est["time_to_dice_job_s"]),
            _x(xe),
            "-",
            "as no WAN",
            "as no WAN",
            "-",
            "-",
            "-",
            pay,
        )
    )
    probe = result["bsp_hier_probe"]
    lines += [
        "",
        f"Regime (bsp-hier probe job on the dilated WAN, {probe['steps']} steps): averaging "
        f"{r['wan_per_step_s']:.2f} s per step against {r['compute_per_step_s']:.3f} s of compute "
        f"({_x(r['ratio'])}); its wall time {r['wall_per_step_s']:.2f} s per step.",
        "",
        "Time per rank, first seed, summed over epochs (compute / waiting in site / waiting on other sites / wall, s):",
        "",
    ]
    for name, where, c in rows:
        parts = "; ".join(
            f"r{i}: {t['compute_s']:.0f}/{t['site_s']:.0f}/{t['wan_wait_s']:.0f}/{t['wall_s']:.0f}"
            for i, t in enumerate(c["runs"][0]["rank_time"])
        )
        lines.append(f"- {name} ({where}): {parts}")
    lines += [
        "",
        "Start-up, first seed (s; launch to ranks up, then each phase on its slowest rank; where "
        "`channel wait` is listed (bsp-hier), the phases from channel address to hostnames ran beside "
        "horovod init and channel wait is what was left of them after it; elsewhere horovod init ran "
        "beside the whole start-up and training, listed when it had ended by the start-up's report):",
        "",
    ]
    for name, where, c in rows:
        lines.append(f"- {name} ({where}): {startup_line(c['runs'][0])}")
    return "\n".join(lines)


def startup_line(run: dict[str, Any]) -> str:
    """One job's start-up: to the ranks' processes, then its phases (:func:`startup_figures`)."""
    up = run.get("ranks_up_s")
    phases = run.get("startup_phases") or {}
    parts = [f"ranks up {up:.1f}" if up is not None else "ranks up not recorded"]
    parts += [f"{k.replace('_', ' ')} {v:.1f}" for k, v in phases.items()]
    clock = run.get("startup_s")
    return ", ".join(parts) + (
        f"; the training clock starts at {clock:.1f}, before profiling" if clock else ""
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """Validation Dice against training time, one line per seed, one colour per config."""
    with figure(path, (7, 4.2), dpi=100) as (fig, ax):
        rows = [("bsp-hier (no WAN)", result["lan"]["bsp-hier"])] + list(result["wan"].items())
        for i, (name, c) in enumerate(rows):
            for j, run in enumerate(c["runs"]):
                pts = [(t, d) for t, d in run["curve"] if d is not None]
                if pts:
                    ax.plot(*zip(*pts), "o-", ms=2, lw=1, color=f"C{i}", label=name if j == 0 else None)
        ax.axhline(result["setting"]["dice_target"], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("training time, validation excluded (s)")
        ax.set_ylabel("validation Dice, mean of sites")
        ax.set_title("hippocampus, 3 sites, dilated WAN")
        ax.legend(fontsize=7)


def _step_costs(s: dict[str, Any]) -> str:
    """The measured step costs the dilation k comes from (real_sites' module docstring)."""
    if "data_step_s" not in s:  # a result written before the data work was measured
        return f"one step takes {s['cpu_step_s']:.3f} s on one idle core here, {s['gpu_step_s']} s on a GPU"
    q = min(s["cpu_per_rank"].values())
    source = (
        "measured on an H200 (scripts/gpu_check.sh)" if s["gpu_step_s"] == GPU_STEP_S else "from --gpu-step-s"
    )
    return (
        f"a step here is {s['data_step_s']:.4f} s of data work and {s['cpu_step_s']:.4f} s of network on one idle "
        f"thread, at {q} core; on a GPU site the same data work and the network's {s['gpu_step_s']:.4f} s "
        + source
    )


def _tuned_text(s: dict[str, Any]) -> str:
    """The tuned points the configs trained with (``--tuned``), or that none were."""
    tuned = s.get("tuned") or {}
    if not tuned:
        return " for every config (not tuned: no `--tuned` file)"
    points = "; ".join(f"{n} {point_text(p)}" for n, p in tuned.items())
    return f" where not tuned; tuned by `medseg bench real-sites-tune`: {points}"


def intro(result: dict[str, Any]) -> str:
    s = result["setting"]
    return (
        "## Between hospitals on real MR: `medseg bench real-sites`\n\n"
        f"Task04_Hippocampus dealt to sites {s['counts']} (each keeps {s['held_out']} cases it never trains or "
        f"selects on; the uint8-stored cases at site c), ranks {s['sites']} at {s['cpu_per_rank']} core per rank. "
        f"Model and patch from `medseg plan` on the pooled training cases: {s['model']}, patch {s['patch']}, "
        f"lr {s['lr']}{_tuned_text(s)}. Nominal links {s['links_nominal']}; {_step_costs(s)}, so the links are dilated by "
        f"k = {s['k']:.1f} "
        f"({s['links_dilated']}). {s['epochs']} equal epochs, then up to {s['max_epochs']} until the mean "
        f"validation Dice reaches {s['dice_target']}. {result['seeds']} seed(s); load average "
        f"{result['load_start'][0]:.2f} at the start, {result['load_end'][0]:.2f} at the end; "
        f"{result['wall_s'] / 60:.0f} min in all. Time from launch is the primary figure."
        + (
            f" With {result['seeds']} seed(s) the held-out Dice band (+-{DICE_BAND} of bsp-hier) is shown, not judged."
            if result["seeds"] < MIN_SEEDS
            else ""
        )
    )


BENCHMARK = Benchmark("real-sites", intro=intro, targets=check_targets, table=format_table, plot=plot)
write_report = BENCHMARK.write_report

"""The real-MR benchmark's table, target checks and plot, from ``docs/bench-real.json``.

Targets (issue 29), each printed PASS or FAIL with its numbers:

1. equal CPU: for each nnU-Net result, medseg's mean held-out Dice with no more training CPU
   (its ``REFERENCE`` variant and evaluation, fixed before the runs) is >= nnU-Net's;
2. time to nnU-Net's level: the least training CPU at which a medseg ``REFERENCE`` run reaches
   nnU-Net's best mean Dice in the file, over nnU-Net's CPU for that result, is <= 0.5;
3. published level: a medseg run of at most 60 CPU minutes of training reaches Dice >= 0.90
   (anterior) and >= 0.89 (posterior) on the held-out cases;
4. the plan's time: on runs of the plan's own epochs, training's measured wall seconds per step are
   within 0.7-1.3x of what ``medseg plan --time-s`` predicted (the budget is filled, not over- or
   under-run).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

#: the medseg result the targets judge: (training variant, evaluation)
REFERENCE = ("planned", "as-trained")
PUBLISHED = {"dice_Anterior": 0.90, "dice_Posterior": 0.89}
MARK = ("<!-- bench:real -->", "<!-- /bench:real -->")


def rows(results: list[dict]) -> list[dict]:
    """One row per (result, evaluation)."""
    out = []
    for r in results:
        for ev, d in r["eval"].items():
            keep = {k: r[k] for k in ("system", "variant", "seed", "train_cpu_s", "commit", "load")}
            keep["budget"], keep["plan_step_s"] = r.get("budget_cpu_min"), r.get("plan_step_s")
            epochs = r.get("epochs") or ("plan's" if r["system"] == "medseg" else "1 x 250 it.")
            out.append({**keep, "epochs": epochs, "eval": ev, **d})
    return out


def table(flat: list[dict]) -> list[str]:
    lines = [
        "| system | variant | epochs | evaluation | seed | training CPU min | Dice anterior | Dice posterior | mean | inference CPU s | commit, load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(flat, key=lambda r: (r["system"], r["train_cpu_s"], r["variant"], r["eval"])):
        lines.append(
            f"| {r['system']} | {r['variant']} | {r['epochs']} | {r['eval']} | {r['seed']} | {r['train_cpu_s'] / 60:.1f} | "
            f"{r['dice_Anterior']:.3f} | {r['dice_Posterior']:.3f} | {r['dice']:.3f} | {r['cpu_s']:.0f} | "
            f"{r['commit']}, {r['load']:.1f} |"
        )
    return lines


def seed_bands(flat: list[dict]) -> list[str]:
    """Runs repeated over seeds of one configuration (system, variant, budget, epochs, evaluation, and
    the plan they trained: ``bench_real.py`` plans once per budget, so its predicted step names the
    plan): the mean of each Dice with its two-sided range over the seeds (min, max), and the commits
    they ran on; configurations with one seed are left out."""
    groups: dict[tuple, list[dict]] = {}
    for r in flat:
        plan = r["plan_step_s"] or r["commit"].split("+")[0]  # older results name no plan: their code
        key = (r["system"], r["variant"], r["budget"], str(r["epochs"]), r["eval"], plan)
        groups.setdefault(key, []).append(r)
    lines = [
        "| system | variant | budget CPU min | epochs | evaluation | commits | seeds | training CPU min | anterior | posterior | mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (system, variant, budget, epochs, ev, _), rs in sorted(groups.items(), key=str):
        if len({r["seed"] for r in rs}) < 2:
            continue
        band = {k: [r[k] for r in rs] for k in ("train_cpu_s", "dice_Anterior", "dice_Posterior", "dice")}
        cells = [f"{sum(v) / len(v):.3f} [{min(v):.3f}, {max(v):.3f}]" for v in list(band.values())[1:]]
        cpu = [c / 60 for c in band["train_cpu_s"]]
        commit = ", ".join(sorted({r["commit"] for r in rs}))
        seeds = ", ".join(str(x) for x in sorted(r["seed"] for r in rs))
        lines.append(
            f"| {system} | {variant} | {budget if budget is None else f'{budget:g}'} | {epochs} | {ev} | {commit} | {seeds} | "
            f"{min(cpu):.1f}-{max(cpu):.1f} | " + " | ".join(cells) + " |"
        )
    return lines if len(lines) > 2 else []


def held_out_band(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A two-sided ``level`` interval for the mean Dice over the held-out population a 40-case sample
    stands for: SciPy's bias-corrected and accelerated bootstrap over the cases (10,000 resamples,
    fixed seed). It bounds the held-out sampling error of one trained model, not the seed-to-seed
    spread (:func:`seed_bands`)."""
    from scipy.stats import bootstrap

    ci = bootstrap((values,), lambda x, axis: x.mean(axis=axis), vectorized=True, n_resamples=10_000,
                   confidence_level=level, method="BCa", rng=0).confidence_interval  # fmt: skip
    return float(ci.low), float(ci.high)


def case_bands(flat: list[dict]) -> list[str]:
    """Rows whose per-case Dice were kept: each label's held-out mean with its 95% bootstrap band."""
    lines = [
        "| system | variant | evaluation | seed | training CPU min | anterior [95% band] | posterior [95% band] |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(flat, key=lambda r: (r["system"], r["train_cpu_s"], r["variant"], r["eval"])):
        if "per_case" not in r:
            continue
        cells = []
        for k in PUBLISHED:
            lo, hi = held_out_band(r["per_case"][k])
            cells.append(f"{r[k]:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(
            f"| {r['system']} | {r['variant']} | {r['eval']} | {r['seed']} | {r['train_cpu_s'] / 60:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines if len(lines) > 2 else []


def checks(flat: list[dict]) -> list[str]:
    ref = [r for r in flat if r["system"] == "medseg" and (r["variant"], r["eval"]) == REFERENCE]
    nn = [r for r in flat if r["system"] == "nnunet"]
    out = []
    for n in nn:
        within = [r for r in ref if r["train_cpu_s"] <= n["train_cpu_s"]]
        best = max((r["dice"] for r in within), default=math.nan)
        ok = best >= n["dice"]
        out.append(
            f"- equal CPU ({n['variant']}, {n['train_cpu_s'] / 60:.0f} CPU min): medseg {best:.3f} vs nnU-Net "
            f"{n['dice']:.3f}: {'PASS' if ok else 'FAIL'}"
        )
    if nn:
        top = max(nn, key=lambda r: r["dice"])
        reached = [r["train_cpu_s"] for r in ref if r["dice"] >= top["dice"]]
        ratio = min(reached) / top["train_cpu_s"] if reached else math.inf
        out.append(
            f"- nnU-Net's best ({top['dice']:.3f}) reached by medseg in {ratio:.2f}x its CPU "
            f"(target <= 0.5): {'PASS' if ratio <= 0.5 else 'FAIL'}"
        )
    hour = [r for r in flat if r["system"] == "medseg" and r["train_cpu_s"] <= 3600]
    met = [r for r in hour if all(r[k] >= v for k, v in PUBLISHED.items())]
    best = max(hour, key=lambda r: r["dice"], default=None)
    if best is not None:
        band = ""
        if "per_case" in best:
            ends = [held_out_band(best["per_case"][k]) for k in PUBLISHED]
            band = " (95% held-out bands " + " / ".join(f"[{lo:.3f}, {hi:.3f}]" for lo, hi in ends) + ")"
        out.append(
            f"- within 60 CPU min, Dice >= 0.90 / 0.89: best {best['dice_Anterior']:.3f} / {best['dice_Posterior']:.3f}{band} "
            f"({best['variant']}, {best['eval']}, {best['train_cpu_s'] / 60:.0f} CPU min): {'PASS' if met else 'FAIL'}"
        )
    return out


def plan_time_check(results: list[dict]) -> list[str]:
    """The plan's step-time prediction against training's measured step, per run on the plan's own
    epochs: within +-30% (``medseg plan --time-s`` fills the budget it was given, no more, no less)."""
    runs = [r for r in results if r["system"] == "medseg" and not r.get("epochs") and r.get("plan_step_s")]
    if not runs:
        return []
    ratios = [r["train_step_s"] / r["plan_step_s"] for r in runs]
    ok = all(0.7 <= x <= 1.3 for x in ratios)
    shown = ", ".join(
        f"{r['variant']} s{r['seed']}: {r['train_step_s']:.3f} / {r['plan_step_s']:.3f} s" for r in runs
    )
    return [
        f"- plan's step time (measured / predicted, runs on the plan's epochs): {shown}; ratio "
        f"{min(ratios):.2f}-{max(ratios):.2f} (target 0.7-1.3): {'PASS' if ok else 'FAIL'}"
    ]


def plot(flat: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in flat:  # each run as trained (nnU-Net: its default prediction); the table has the rest
        if r["eval"] not in ("as-trained", "default"):
            continue
        key = f"{r['system']} {r['variant']}"
        series.setdefault(key, []).append((r["train_cpu_s"] / 60, r["dice"]))
    for key, pts in sorted(series.items()):
        pts.sort()
        planned = key == "medseg planned"
        ax.plot(
            *zip(*pts), marker="o" if key.startswith("medseg") else "s", label=key, lw=2.5 if planned else 1
        )
    ax.axhline(0.895, color="grey", linestyle=":", label="nnU-Net published (mean of 0.90, 0.89)")
    ax.set_xlabel("training CPU minutes (user + system, 2 cores)")
    ax.set_ylabel("mean held-out Dice (40 cases)")
    ax.set_title("Task04_Hippocampus: Dice against CPU time")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(json_path: Path, markdown: Path | None, plot_path: Path | None) -> None:
    results = json.loads(json_path.read_text())["results"]
    flat = rows(results)
    bands = seed_bands(flat)
    bands = ["", "Seeds: mean [min, max] over the seeds of one configuration:", "", *bands] if bands else []
    cases = case_bands(flat)
    if cases:
        cases = [
            "",
            "Held-out cases: mean with its 95% bootstrap band over the 40 cases (runs that kept them):",
            "",
            *cases,
        ]
    text = "\n".join(
        [*table(flat), *bands, *cases, "", "Targets:", "", *checks(flat), *plan_time_check(results)]
    )
    print(text)
    if plot_path is not None:
        plot(flat, plot_path)
    if markdown is not None:
        doc = markdown.read_text()
        start, end = doc.find(MARK[0]), doc.find(MARK[1])
        if start < 0 or end < 0:
            raise SystemExit(f"{markdown}: no {MARK[0]} ... {MARK[1]} block to fill")
        markdown.write_text(doc[: start + len(MARK[0])] + "\n" + text + "\n" + doc[end:])

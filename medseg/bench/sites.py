"""``medseg bench sites``: synchronisation modes between emulated hospitals, every figure measured.

Setting (:mod:`medseg.distributed.testbed.testbed`): 2 sites x 2 ranks, each site a network namespace with its
own sshd, ranks launched by horovodrun over real ssh; site b gets half the CPU of site a per rank
(cgroup quotas 0.5 and 0.25 core per rank, 1.5 of the machine's 2 cores in all, one torch thread per
rank); the link between the sites shaped in both directions. Scenarios: no WAN shaping (the
control), 100 Mbit/s with 10 ms one-way, 20 Mbit/s with 25 ms one-way. Before each scenario the
testbed's probe measures RTT and throughput between the sites; more than 10 % off is an error.

Configs: ``bsp-none`` (plain Horovod), ``bsp-fp16``, ``bsp-fixed4``, ``local-sgd``, ``gssp`` (groups
= sites, by host), ``gssp-fixed4``. Every config trains the same UNet on the same synthetic data
for the same epochs with the same seed; validation (rank 0, its own held-out cases) after every
epoch, with its wall-clock time.

Figures, per scenario and config, all measured (:mod:`medseg.bench.sites_figures` says how): time
to the Dice target (training wall time and from the launch), Dice at equal epochs and at a time
budget, samples per second, WAN bytes measured by the relay against those the algorithm reports,
the measured lead of the fastest group in rounds, in-site step times with and without a round in
flight, and a time breakdown per rank.

Absolute times are not GPU times: the model and patch are sized so that the ratio of (bsp bytes per
step / WAN rate) to step time is that of a real 3D U-Net between hospitals (stated in the output).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from medseg.bench.protocol import Benchmark, Target, at_least, at_most, figure, table_head, table_row, within
from medseg.bench.sites_configs import (
    CONFIGS,
    CPU,
    DICE_TARGET,
    EPOCHS,
    MAX_EPOCHS_FACTOR,
    QUICK_CONFIGS,
    QUICK_DICE_TARGET,
    QUICK_EPOCHS,
    QUICK_SCENARIOS,
    SCENARIOS,
    SECURE_TWIN,
    SITES,
    TRAIN_CASES,
    fill_cache,
    job_config,
)
from medseg.bench.sites_figures import (
    aggregate,
    byte_gaps,
    comm_setting,
    job_figures,
    rank_records,
    ratios,
    set_budget,
)
from medseg.bench.sites_secure import secure_table, secure_targets
from medseg.config import config_from_dict
from medseg.datasets.synthetic import make_seg_dataset
from medseg.errors import ConfigError
from medseg.training.runlog import read_metrics

log = logging.getLogger(__name__)

MIN_SEEDS_FOR_DICE_BAND = 3  # the Dice band is judged on the mean of at least this many seeds
DICE_BAND = 0.01  # two-sided: |mean Dice at equal epochs - the reference's| <= this
# The synchronous reference every other config's Dice is held to: the exact hierarchical average
# when it ran (the fair synchronous baseline on medseg's channel), else plain Horovod.
DICE_REFERENCES = ("bsp-hier", "bsp-none")


def bench_sites(
    workdir: Path,
    quick: bool = False,
    seeds: int | None = None,
    epochs: int | None = None,
    scenarios: list[str] | None = None,
    configs: list[str] | None = None,
    reuse: dict[str, Any] | None = None,
    secure: bool = False,
) -> dict[str, Any]:
    """Run every scenario and config (``quick``: 2 scenarios x 4 configs, 1 seed), or those named.

    ``secure``: also run each secure scenario whose plain twin is run (:data:`SECURE_TWIN`: the
    same WAN with the site link up), right after the twin, so the two are measured side by side.

    ``reuse``: an earlier result of this function with the same seeds, epochs and ``quick``; each
    (scenario, config) it holds is taken from it (marked ``"reused": True``, its own probe kept
    beside it) instead of being run again, so a long seeded run can be completed in parts.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = seeds or (1 if quick else 3)
    epochs = epochs or (QUICK_EPOCHS if quick else EPOCHS)
    target = QUICK_DICE_TARGET if quick else DICE_TARGET
    scenarios = list(
        scenarios or (QUICK_SCENARIOS if quick else tuple(s for s in SCENARIOS if s not in SECURE_TWIN))
    )
    if secure:
        scenarios = _with_secure_twins(scenarios)
    configs = configs or (QUICK_CONFIGS if quick else tuple(CONFIGS))
    unknown = [s for s in scenarios if s not in SCENARIOS] + [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ConfigError(
            f"bench sites: unknown scenario or config {unknown}; scenarios {list(SCENARIOS)}, configs {list(CONFIGS)}"
        )
    if "bsp-none" not in configs:
        raise ConfigError("bench sites: every ratio is against bsp-none; keep it in --configs")
    out: dict[str, Any] = {
        "quick": quick,
        "seeds": seeds,
        "epochs": epochs,
        "dice_target": target,
        "scenarios": {},
    }
    earlier = _reusable(reuse, quick, seeds, epochs)
    data_dir = workdir / "data"
    if any(c not in earlier.get(sc, {}).get("configs", {}) for sc in scenarios for c in configs):
        data_dir = make_seg_dataset(data_dir, n_train=TRAIN_CASES, n_test=0, seed=7, size=48)
        out["cache_fill_s"] = fill_cache(data_dir, seeds)
        log.info("bench sites: data cache filled in %.0f s", out["cache_fill_s"])
    jobs = _Jobs(workdir, data_dir, seeds, epochs, target)
    for scenario in scenarios:
        out["scenarios"][scenario] = jobs.scenario(scenario, configs, earlier.get(scenario, {}))
    out["setting"] = comm_setting(out)
    return out


def _with_secure_twins(scenarios: list[str]) -> list[str]:
    """``scenarios`` with each secure scenario placed right after its plain twin (one is required)."""
    plain = [s for s in scenarios if s not in SECURE_TWIN]
    twins = {twin: sec for sec, twin in SECURE_TWIN.items()}
    if not any(s in twins for s in plain):
        raise ConfigError(
            f"bench sites --secure: the site link is measured against the same WAN in clear; keep one of "
            f"{sorted(twins)} in --scenarios"
        )
    return [x for s in plain for x in ((s, twins[s]) if s in twins else (s,))]


def _reusable(reuse: dict[str, Any] | None, quick: bool, seeds: int, epochs: int) -> dict[str, Any]:
    """The scenarios of an earlier result that this run may take configs from (same settings), else {}."""
    if not reuse:
        return {}
    theirs = (reuse.get("quick"), reuse.get("seeds"), reuse.get("epochs"))
    if theirs != (quick, seeds, epochs):
        raise ConfigError(
            f"bench sites --reuse: that result has quick, seeds, epochs = {theirs}, this run {(quick, seeds, epochs)}; "
            "only a result with the same settings can be completed"
        )
    return reuse.get("scenarios", {})


@dataclass(frozen=True)
class _Jobs:
    """What every job of one invocation shares: its folder, data, seeds, equal epochs and Dice target."""

    workdir: Path
    data_dir: Path
    seeds: int
    epochs: int
    target: float

    def scenario(self, scenario: str, configs: list[str], old: dict[str, Any]) -> dict[str, Any]:
        """Every config in ``scenario``: taken from the earlier result ``old`` where it holds it, else
        measured (each seed a job) in a testbed whose probe is checked first."""
        from medseg.distributed.testbed.testbed import testbed

        wan = SCENARIOS[scenario]
        kept = {c: dict(old["configs"][c], reused=True) for c in configs if c in old.get("configs", {})}
        if len(kept) == len(configs):
            res = {k: v for k, v in old.items() if k != "configs"}
            res["configs"] = {c: kept[c] for c in configs}
            set_budget(res)
            log.info("bench sites: %s taken whole from the earlier result", scenario)
            return res
        secure = scenario in SECURE_TWIN
        with testbed(sites=SITES, wan=wan, cpu=CPU, secure=secure) as tb:
            probe = tb.probe(check=wan != "none")
            res = {
                "wan": wan,
                "secure": secure,
                "rtt_ms": probe.get("rtt_ms"),
                "mbit_s": probe.get("mbit_s"),
                "probe": probe,
                "configs": {},
            }
            if secure:  # what the jobs' own path (the tunnel) carries, beside the WAN's check
                res["probe_tunnel"] = tb.probe(check=False, tunnel=True)
            for name in configs:
                if name in kept:
                    log.info("bench sites: %s %s taken from the earlier result", scenario, name)
                    res["configs"][name] = {**kept[name], "reused_probe": old.get("probe")}
                    continue
                runs = []
                for seed in range(self.seeds):
                    log.info("bench sites: %s %s seed %d", scenario, name, seed)
                    runs.append(self.job(tb, name, self.workdir / "runs" / scenario / f"seed{seed}", seed))
                res["configs"][name] = aggregate(runs)
        set_budget(res)
        return res

    def job(self, tb: Any, name: str, runs_dir: Path, seed: int) -> dict[str, Any]:
        """One training job of config ``name``, launched over the testbed's hosts; its figures."""
        dist = CONFIGS[name]
        cfg = config_from_dict(
            job_config(name, dist, self.data_dir, runs_dir, self.epochs, seed, self.target)
        )
        run = launch_job(tb, cfg, runs_dir / f"{name}.yaml", tb.hosts_arg())
        return job_figures(*run, self.epochs, self.target, dist, tunnel=tb.secure)


def launch_job(
    tb: Any, cfg: Any, path: Path, hosts: str
) -> tuple[list[dict], dict[int, list[dict]], float, float, tuple[dict, dict]]:
    """Train ``cfg`` (written to ``path``) over the testbed's sites, ranks as ``hosts`` says; return
    rank 0's epoch records, every rank's records, the launch time, the job's wall seconds and the
    relay's WAN counters before and after (:func:`~medseg.bench.sites_figures.job_figures`' inputs)."""
    from medseg.distributed.launch.launcher import launch

    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    saved = dict(os.environ)
    os.environ.update(tb.launcher_env())
    before = tb.wan_counters()
    t0 = time.time()
    np = sum(int(h.rpartition(":")[2]) for h in hosts.split(","))
    try:
        launch(cfg, path, [], np, hosts, resume=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    job_s = time.time() - t0
    after = tb.wan_counters()
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    return records, rank_records(cfg.run_dir), t0, job_s, (before, after)


def check_targets(result: dict[str, Any]) -> list[Target]:
    """The targets at 20 Mbit/s (time to Dice, Dice, bytes, staleness, in-site steps) and on the LAN (speed)."""
    checks: list[Target] = []
    w = result["scenarios"].get("wan20")
    if w:
        checks += _wan20_targets(result, w)
    if result["seeds"] >= MIN_SEEDS_FOR_DICE_BAND:
        for scenario, res in result["scenarios"].items():
            checks += dice_band_targets(scenario, res["configs"])
    lan = result["scenarios"].get("lan")
    if lan:
        q = ratios(lan)
        for name in ("gssp", "gssp-fixed4"):
            if name in q and q[name]["speed_x"] is not None:
                x = q[name]["speed_x"]
                checks.append(at_least(f"lan: {name} samples/s >= 0.9x bsp-none (got {x:.2f}x)", x, 0.9))
    return checks + secure_targets(result)


def _wan20_targets(result: dict[str, Any], w: dict[str, Any]) -> list[Target]:
    checks: list[Target] = []
    q, c = ratios(w), w["configs"]
    for name, limit in (("gssp", 0.5), ("gssp-fixed4", 1 / 3)):
        if name in q:
            x = q[name]["time_x"]
            text = (
                f"wan20: {name} time to Dice {result['dice_target']} <= {limit:.2f}x bsp-none (got {_fmt(x)})"
            )
            checks.append(at_most(text, x, limit))
    # the Dice level at which the band is judged: the seeded run's 0.8, the quick run's target
    base, level = c["bsp-none"]["dice_equal_epochs"] or 0, result["dice_target"]
    checks.append(at_least(f"wan20: bsp-none Dice at equal epochs >= {level} (got {base:.3f})", base, level))
    if "bsp-fixed4" in q:
        x = q["bsp-fixed4"]["bytes_x"]
        text = f"wan20: bsp-fixed4 measured WAN bytes per epoch <= 1/7 of bsp-none (got {_fmt(x)})"
        checks.append(at_most(text, x, 1 / 7))
    for name, cc in c.items():
        if cc["max_lead_rounds"] is not None:
            lead, bound = cc["max_lead_rounds"], cc["staleness_bound"]
            checks.append(at_most(f"wan20: {name} measured lead {lead} <= s = {bound}", lead, bound))
    g = c.get("gssp", {})
    if g.get("insite_step_s_idle") and g.get("insite_step_s_with_round_in_flight"):
        x = g["insite_step_s_with_round_in_flight"] / g["insite_step_s_idle"]
        checks.append(
            at_most(f"wan20: gssp in-site step with a round in flight <= 1.15x idle (got {x:.2f}x)", x, 1.15)
        )
    return checks


def dice_band_targets(scenario: str, configs: dict[str, dict[str, Any]]) -> list[Target]:
    """Every config's mean Dice at equal epochs within DICE_BAND of the reference's, both ways.

    Judged on the mean of MIN_SEEDS_FOR_DICE_BAND seeds or more only (the caller's rule): gssp's
    rounds follow measured timings, so one seed's Dice varies from run to run by more than the band;
    the quick run's table shows the one-seed figures without judging them.
    """
    ref = next((r for r in DICE_REFERENCES if r in configs), None)
    if ref is None:
        return []
    base = configs[ref]["dice_equal_epochs"]
    checks = []
    for name, c in configs.items():
        if name == ref:
            continue
        d = None if c["dice_equal_epochs"] is None or base is None else c["dice_equal_epochs"] - base
        got = "not measured" if d is None else f"{d:+.3f}"
        text = f"{scenario}: {name} Dice at equal epochs within +-{DICE_BAND} of {ref} ({got})"
        checks.append(within(text, d, DICE_BAND))
    return checks


def _fmt(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.2f}x"


def _fmt_s(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.0f}"


def _fmt_d(d: float | None) -> str:
    return "-" if d is None else f"{d:.3f}"


def format_table(result: dict[str, Any]) -> str:
    lines = []
    for scenario, res in result["scenarios"].items():
        lines += _scenario_table(scenario, res, result["dice_target"])
        lines += _rank_time_lines(res)
        gaps = byte_gaps(res)
        if gaps:
            lines += [
                "Measured vs reported WAN bytes (TCP payload; headers counted by the relay):",
                "",
                *gaps,
                "",
            ]
    return "\n".join(lines + secure_table(result))


def _scenario_table(scenario: str, res: dict[str, Any], dice_target: float) -> list[str]:
    """A scenario's heading, its table of configs, and where configs were taken from an earlier run."""
    q = ratios(res)
    columns = [f"time to Dice {dice_target} (s)", "x bsp-none", "from launch (s)", "Dice equal epochs"]
    columns += [
        "Dice at budget",
        "samples/s (whole job)",
        "epochs run",
        "WAN payload measured, MB (per epoch)",
    ]
    columns += ["reported (MB)", "measured/reported", "max lead (s)", "in-site step idle / in flight (s)"]
    lines = [
        f"**{scenario}** (WAN {res['wan']}{', over the site link' if res.get('secure') else ''}; probe: RTT {res['rtt_ms']:.1f} ms, {res['mbit_s']:.1f} Mbit/s; budget {res['budget_s']:.0f} s)",
        "",
        *table_head(["config", *columns, "groups, rounds (steps)"], "l" * 14),
    ]
    for name, c in res["configs"].items():
        t = f"{c['time_to_dice_s']:.0f}" if c["time_to_dice_s"] else "not reached"
        lead = "-" if c["max_lead_rounds"] is None else f"{c['max_lead_rounds']} ({c['staleness_bound']})"
        step = (
            f"{c['insite_step_s_idle']:.3f} / {c['insite_step_s_with_round_in_flight']:.3f}"
            if c["insite_step_s_idle"] and c["insite_step_s_with_round_in_flight"]
            else "-"
        )
        mr = c["wan_payload_measured"] / c["wan_bytes_reported"] if c["wan_bytes_reported"] else None
        lines.append(
            table_row(
                f"{name} (earlier run)" if c.get("reused") else name,
                t,
                _fmt(q[name]["time_x"]),
                _fmt_s(c.get("time_to_dice_job_s")),
                f"{c['dice_equal_epochs']:.3f}",
                _fmt_d(c["dice_at_budget"]),
                f"{c['samples_per_s']:.2f}",
                c["epochs"],
                f"{c['wan_payload_measured'] / 1e6:.1f} ({c['wan_payload_per_epoch'] / 1e6:.2f})",
                f"{c['wan_bytes_reported'] / 1e6:.1f}",
                "-" if mr is None else f"{mr:.2f}",
                lead,
                step,
                f"{c['groups']}, {c['periods']}",
            )
        )
    earlier = sorted(
        {
            f"RTT {p['rtt_ms']:.1f} ms, {p['mbit_s']:.1f} Mbit/s"
            for c in res["configs"].values()
            if (p := c.get("reused_probe"))
        }
    )
    if earlier:
        lines += [
            "",
            "Configs marked 'earlier run' come from an earlier invocation (`--reuse`), same settings, "
            f"measured under its own probe ({'; '.join(earlier)}).",
        ]
    return lines


def _rank_time_lines(res: dict[str, Any]) -> list[str]:
    """Each config's time per rank, summed over epochs."""
    lines = [
        "",
        "Time per rank, summed over epochs (compute / waiting in site / waiting on other sites / wall, s):",
        "",
    ]
    for name, c in res["configs"].items():
        parts = "; ".join(
            f"r{i}: {t['compute_s']:.0f}/{t['site_s']:.0f}/{t['wan_wait_s']:.0f}/{t['wall_s']:.0f}"
            for i, t in enumerate(c["rank_time"])
        )
        lines.append(f"- {name}: {parts}")
    lines.append("")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Validation Dice against training wall time, one panel per scenario."""
    scen = list(result["scenarios"])
    with figure(path, (5 * len(scen), 3.8), ncols=len(scen), squeeze=False, dpi=100) as (fig, axes):
        for ax, s in zip(axes[0], scen):
            for name, c in result["scenarios"][s]["configs"].items():
                pts = [(t, d) for t, d in c["curve"] if d is not None]
                if pts:
                    ax.plot(*zip(*pts), "o-", ms=3, label=name)
            ax.axhline(result["dice_target"], color="grey", lw=0.8, ls="--")
            ax.set_title(f"{s} ({result['scenarios'][s]['wan']})")
            ax.set_xlabel("training wall time, validation excluded (s)")
            ax.set_ylabel("validation Dice")
            ax.legend(fontsize=7)


def intro(result: dict[str, Any]) -> str:
    return (
        f"## Between hospitals: `medseg bench sites{' --quick' if result['quick'] else ''}`\n\n"
        f"2 emulated sites x 2 ranks (network namespaces, sshd per site, horovodrun over ssh), site b at half "
        f"the CPU of site a (cgroup quotas 0.5 and 0.25 core per rank), {result['epochs']} equal epochs (then up to "
        f"{MAX_EPOCHS_FACTOR * result['epochs']} until the Dice target), "
        f"{result['seeds']} seed(s), same data and model for every config. Ratios are against bsp-none in the same "
        f"scenario. Time to Dice is training wall time: from rank 0's start of training (speed and WAN profiling "
        f"included) to the first epoch whose held-out validation reaches the target, the validations themselves "
        f"excluded; 'from launch' adds start-up (ssh launch, imports, data caching), the same work for every config. "
        f"Samples/s is over the whole job. {result.get('setting', {}).get('note', '')}"
        + (
            f" With {result['seeds']} seed(s) the Dice at equal epochs is shown, not judged: the two-sided "
            f"{DICE_BAND} band against {' (else '.join(DICE_REFERENCES)}) is checked in every scenario on the mean "
            f"of {MIN_SEEDS_FOR_DICE_BAND} seeds or more (the seeded run)."
            if result["seeds"] < MIN_SEEDS_FOR_DICE_BAND
            else ""
        )
    )


# the quick run and the seeded run keep separate sections (and plots) of the markdown file
BENCHMARK = Benchmark(
    "sites", intro=intro, targets=check_targets, table=format_table, plot=plot, full_tag="sites-full"
)
write_report = BENCHMARK.write_report

"""``medseg bench real-sites-tune``: every config's learning rate and round lever chosen by one rule.

The real-sites table (:mod:`medseg.bench.real_sites`) compares configs that may each want another
step size or round length. A comparison is fair only if every config's settings come from the same
small grid by the same rule, on data the table does not judge. This module runs that grid.

**Grid** (:func:`grid_points`): the learning rate ``lr`` ∈ :data:`LR_GRID` for every config, crossed
with the config's own round lever where it has one (:data:`LEVERS`: FedAvg's local epochs E,
DiLoCo's inner steps H). gssp's rounds are set by the engine from measured speeds (no lever here);
its staleness bound stays 2. The first point of every grid is the planner's values (lr 0.003) and
the levers the table used before tuning.

**Rule.** For config c and grid point g one job trains :data:`TUNE_EPOCHS` epochs with seed
:data:`TUNE_SEED` (no seed of the table), no early stop, on the testbed c is judged on: bsp-hier on
the no-WAN control (exact synchronous SGD, its Dice after a given number of steps does not depend
on the link), every other config on the dilated WAN (its rounds depend on the link). Its score is

    s(c, g) = Σ_site n_site · Dice_val,site / Σ_site n_site      after epoch TUNE_EPOCHS

the case-weighted mean validation Dice (each site's validation cases: a fifth of its training
folder; the held-out cases are never trained, selected or tuned on). With s* = max_g s(c, g), the
winner is the first point in grid order with s(c, g) >= s* - :data:`TIE`: a gain within one seed's
noise does not move a config off the planner's values. A job that fails or ends without a Dice
scores nothing and cannot win.

The winners (JSON ``winners``) are what ``medseg bench real-sites --tuned FILE`` trains with.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

from medseg.bench.protocol import Benchmark, Target, figure, table_head, table_row
from medseg.bench.real_sites import CONFIGS, GPU_STEP_S, SITES, Setting, network, prepare
from medseg.errors import ConfigError, MedsegError

log = logging.getLogger(__name__)

LR_GRID = (0.003, 0.001, 0.01)  # the planner's first
LEVERS: dict[str, dict[str, tuple[int, ...]]] = {
    "fedavg": {"local_epochs": (1, 2)},
    "diloco": {"inner_steps": (500, 20)},  # 500: a round per epoch here; 20: two rounds per epoch
}
TUNE_EPOCHS = 4  # half the table's equal epochs
TUNE_SEED = 100  # the table's seeds are 0, 1, 2, ...
TIE = 0.005  # a mean validation Dice within this of the best counts as a tie
DEFAULT_TUNE_CONFIGS = ("bsp-hier", "fedavg", "gssp", "gssp-fixed4")


def grid_points(name: str) -> list[dict[str, float]]:
    """Config ``name``'s grid: every ``lr`` of :data:`LR_GRID` crossed with its levers' values,
    the planner's and the table's old values first."""
    levers = LEVERS.get(name, {})
    keys = ["lr", *levers]
    return [dict(zip(keys, values)) for values in itertools.product(LR_GRID, *levers.values())]


def choose(scored: list[tuple[dict[str, float], float | None]]) -> dict[str, float] | None:
    """The rule's winner among ``(point, score)`` in grid order: the first point within
    :data:`TIE` of the best score; None when no point scored."""
    scores = [s for _, s in scored if s is not None]
    if not scores:
        return None
    best = max(scores)
    return next(p for p, s in scored if s is not None and s >= best - TIE)


def tuned_points(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The winners of a ``real-sites-tune`` JSON document, checked: known configs, and only ``lr``
    and that config's own levers, as positive numbers (the file is data, never code)."""
    winners = doc.get("winners")
    if not isinstance(winners, dict):
        raise ConfigError(
            "--tuned: the file holds no 'winners' object (write it with medseg bench real-sites-tune)"
        )
    out: dict[str, dict[str, float]] = {}
    for name, point in winners.items():
        if point is None:
            continue
        allowed = {"lr", *LEVERS.get(name, {})}
        if name not in CONFIGS or not isinstance(point, dict) or not set(point) <= allowed:
            raise ConfigError(
                f"--tuned: winner of {name!r} is {point!r}; known configs take keys {sorted(allowed)}"
            )
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in point.values()):
            raise ConfigError(
                f"--tuned: winner of {name!r} has a value that is not a positive number: {point!r}"
            )
        out[name] = dict(point)
    return out


def _score_point(
    tb: Any, setting: Setting, name: str, point: dict[str, float], epochs: int
) -> dict[str, Any]:
    """One tuning job of ``name`` at ``point``: its mean validation Dice after ``epochs`` and wall time."""
    from medseg.bench.real_sites import job_config
    from medseg.bench.sites import launch_job
    from medseg.bench.sites_figures import job_figures
    from medseg.config import config_from_dict

    hosts = {s.name: s.job_ip for s in tb.sites}
    dist = {**CONFIGS[name], **point}
    tag = "-".join(f"{k}{v:g}" for k, v in point.items())
    raw = job_config(setting, f"tune-{name}-{tag}", dist, TUNE_SEED, hosts, fixed_epochs=epochs)
    try:
        run = launch_job(tb, config_from_dict(raw), Path(raw["runs_dir"]) / f"{raw['name']}.yaml", SITES)
        fig = job_figures(*run, epochs, 2.0, dist)
    except (MedsegError, StopIteration) as exc:  # StopIteration: no record of the last epoch
        log.warning("bench real-sites-tune: %s at %s failed: %s", name, point, exc)
        return {"point": point, "dice": None, "error": str(exc) or type(exc).__name__}
    return {"point": point, "dice": fig["dice_equal_epochs"], "job_s": fig["job_s"], "curve": fig["curve"]}


def _tune_configs(
    tb: Any, setting: Setting, names: list[str], epochs: int
) -> dict[str, list[dict[str, Any]]]:
    scores = {}
    for name in names:
        scores[name] = []
        for point in grid_points(name):
            log.info("bench real-sites-tune: %s at %s", name, point)
            scores[name].append(_score_point(tb, setting, name, point, epochs))
    return scores


def tune_real_sites(
    workdir: Path,
    data: Path,
    configs: list[str] | None = None,
    epochs: int = TUNE_EPOCHS,
    gpu_step_s: float = GPU_STEP_S,
) -> dict[str, Any]:
    """Every config's grid, scored by the rule (module docstring), and its winner, in one invocation."""
    from medseg.bench.real_sites import CPU, setting_record
    from medseg.distributed.testbed.testbed import testbed

    names = list(configs or DEFAULT_TUNE_CONFIGS)
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or epochs < 1:
        raise ConfigError(
            f"bench real-sites-tune: configs {unknown} unknown (known {list(CONFIGS)}) or epochs {epochs} < 1"
        )
    out: dict[str, Any] = {"load_start": os.getloadavg(), "started": time.time(), "epochs": epochs}
    out.update(seed=TUNE_SEED, tie=TIE, grid={n: grid_points(n) for n in names})
    setting = prepare(workdir, data, 1, gpu_step_s)
    net = network(setting.k)
    out["setting"] = setting_record(setting, gpu_step_s, net)
    scores: dict[str, list[dict[str, Any]]] = {}
    lan = [n for n in names if n == "bsp-hier"]
    if lan:
        with testbed(sites=SITES, wan="none", cpu=CPU) as tb:
            scores.update(_tune_configs(tb, setting, lan, epochs))
    wan = [n for n in names if n != "bsp-hier"]
    if wan:
        with testbed(sites=SITES, wan=net, cpu=CPU, probe=False) as tb:
            scores.update(_tune_configs(tb, setting, wan, epochs))
    out["scores"] = scores
    out["winners"] = {n: choose([(r["point"], r["dice"]) for r in rs]) for n, rs in scores.items()}
    out["load_end"] = os.getloadavg()
    out["wall_s"] = time.time() - out["started"]
    return out


def check_same_rule(earlier: dict[str, Any], epochs: int) -> None:
    """Raise unless ``earlier`` is a tuning document made by this rule with ``epochs`` per point."""
    rule, ours = ("epochs", "seed", "tie"), [epochs, TUNE_SEED, TIE]
    theirs = [earlier.get(k) for k in rule]
    if theirs != ours or not all(isinstance(earlier.get(k), dict) for k in ("grid", "scores", "winners")):
        raise ConfigError(
            f"--add-to: the earlier file's rule {theirs} is not this run's {ours} (epochs, seed, tie), "
            "or it holds no grid, scores and winners"
        )


def _invocation(doc: dict[str, Any]) -> dict[str, Any]:
    """What one tuning invocation was run on: its configs, dilation, load and wall time."""
    keys = ("started", "load_start", "load_end", "wall_s")
    return {"configs": list(doc["scores"]), "k": doc["setting"]["k"], **{k: doc[k] for k in keys}}


def add_to(earlier: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s configs added to ``earlier``, a tuning document of the same rule (epochs, seed, tie):
    a config's grid is scored on its own, so configs tuned in two invocations are chosen by the same
    rule; ``new`` replaces what ``earlier`` holds for its configs, and ``invocations`` lists both runs
    (each with its own measured dilation k and load)."""
    check_same_rule(earlier, new["epochs"])
    out = dict(new)
    runs = earlier.get("invocations") or [_invocation(earlier)]
    out["invocations"] = [*runs, _invocation(new)]
    for key in ("grid", "scores", "winners"):
        out[key] = {**earlier[key], **new[key]}
    return out


def check_targets(result: dict[str, Any]) -> list[Target]:
    """Every grid point trained to its last epoch, so every winner was chosen from its whole grid."""
    failed = [f"{n} {r['point']}" for n, rs in result["scores"].items() for r in rs if r["dice"] is None]
    return [
        Target(
            f"every grid point scored ({len(failed)} failed{': ' + ', '.join(failed) if failed else ''})",
            not failed,
        )
    ]


def point_text(point: dict[str, float]) -> str:
    """A grid point as text: ``lr 0.003, local_epochs 1``."""
    return ", ".join(f"{k} {v:g}" for k, v in point.items())


def format_table(result: dict[str, Any]) -> str:
    rows = table_head(
        ["config", "grid point", f"val Dice after {result['epochs']} epochs", "job s", "chosen"], "lllrl"
    )
    for name, rs in result["scores"].items():
        for r in rs:
            dice = "failed" if r["dice"] is None else f"{r['dice']:.4f}"
            job = f"{r['job_s']:.0f}" if r.get("job_s") is not None else ""
            rows.append(
                table_row(
                    name,
                    point_text(r["point"]),
                    dice,
                    job,
                    "yes" if r["point"] == result["winners"][name] else "",
                )
            )
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> None:
    """Each config's validation Dice by epoch, one line per grid point (the chosen one solid)."""
    with figure(path, (10, 3.2), ncols=max(1, len(result["scores"])), squeeze=False) as (_, axes):
        for ax, (name, rs) in zip(axes[0], result["scores"].items()):
            for r in rs:
                pts = [(t, d) for t, d in r.get("curve") or [] if d is not None]
                style = "-" if r["point"] == result["winners"][name] else ":"
                ax.plot([t for t, _ in pts], [d for _, d in pts], style, label=point_text(r["point"]))
            ax.set_title(name)
            ax.set_xlabel("training s")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("mean validation Dice")


def intro(result: dict[str, Any]) -> str:
    return (
        "## Tuning the real-sites configs: `medseg bench real-sites-tune`\n\n"
        f"Every config's grid (lr in {list(LR_GRID)}; fedavg's local epochs and diloco's inner steps in "
        f"{ {n: dict(v) for n, v in LEVERS.items()} }), one job per point: seed {result['seed']}, "
        f"{result['epochs']} epochs, no early stop; bsp-hier on the no-WAN control, the others on the links "
        "dilated by k (each invocation's k below). Score: the case-weighted mean validation Dice after the last epoch "
        "(validation: a fifth of each site's training cases; the held-out cases are not used). Chosen: the "
        f"first point in grid order within {result['tie']} of the best. "
        + "; ".join(_invocation_text(r) for r in result.get("invocations") or [_invocation(result)])
        + "."
    )


def _invocation_text(run: dict[str, Any]) -> str:
    day = time.strftime("%Y-%m-%d", time.gmtime(run["started"]))
    return (
        f"{', '.join(run['configs'])}: tuned {day} at k = {run['k']:.1f}, load average "
        f"{run['load_start'][0]:.2f} at the start, {run['load_end'][0]:.2f} at the end, {run['wall_s'] / 60:.0f} min"
    )


BENCHMARK = Benchmark("real-sites-tune", intro=intro, targets=check_targets, table=format_table, plot=plot)
write_report = BENCHMARK.write_report

"""``medseg bench real-sites``: real MR between three unlike hospitals, at a GPU's cost of the link.

Setting, every part measured or stated:

- **Data.** A Decathlon-layout dataset (the Medical Segmentation Decathlon's Task04_Hippocampus)
  dealt by :func:`medseg.datasets.site_split.split_sites` to sites a/b/c with 90/60/50 cases, each
  keeping :data:`HELD_OUT` cases it never trains or selects on; the cases stored as uint8 (another
  scanner's export) all go to site c. Data stays in its site (``sites:``); each site's leader
  validates on its own validation cases (a fifth of its training folder) after every epoch, and
  the epoch's Dice is the case-weighted mean over the sites.
- **Model and patch**: what ``medseg plan`` (its defaults, CPU) chose on the pooled training
  folders (:data:`PLAN`); the same for every config.
- **Sites and links.** a:2, b:1, c:1 ranks at 0.45/0.4/0.3 core per rank (cgroup quotas, one torch
  thread each); each site's own link to the router, nominally a=100 Mbit/s 5 ms, b=20 Mbit/s 25 ms,
  c=10 Mbit/s 40 ms one-way (:data:`LINKS`).
- **Time dilation** (Gupta et al., "DieCast", NSDI 2007). A site here takes T_cpu seconds per
  step; a GPU site would take T_gpu. Running every link at rate/k and delay·k with

      k = T_cpu / T_gpu,   T_cpu = (d + c_cpu) / q,   T_gpu = d + c_gpu

  keeps a GPU site's ratio of communication to compute on this CPU. A step of ``medseg train`` is
  its data work d (the loader's next batch, drawn in the training process: random patches,
  augmentation, collation) followed by the network's step c (forward, Dice-CE, backward, AdamW).
  d and c_cpu are measured here on one idle thread (:func:`measure_data_step`,
  :func:`measure_cpu_step`); q is the slowest site's quota (cores per rank); c_gpu is
  :data:`GPU_STEP_S`, measured on a lent GPU (``--gpu-step-s``; see its comment). The GPU site's
  host is taken to do d as fast as this core (not measured there); c_gpu, bound by launching
  kernels, depends on that host's CPU too. The report prints the ratio
  that results, measured: bsp-hier's waiting on other sites per step over its compute per step.
- **Configs** (:data:`CONFIGS`): the peers bsp-hier, fedavg and diloco, and gssp, gssp-fixed4,
  gssp-topk1 and gssp-fixed4-nesterov (its rounds through DiLoCo's outer step, diloco's outer lr
  and momentum), all on medseg's channel, with the same data, model, optimiser, seeds and epochs
  (:data:`DEFAULT_CONFIGS`). Four more change one lever of gssp-fixed4 each, for ablations
  named with ``--configs``: FedNova's step normalisation, DC-ASGD per site (λ = 1, not tuned),
  the momentum zeroed after each round, and rounds whose speed ratio is rounded before the WAN
  factor scales it (``balance_rounds: false``, the rule before the seventeenth session).
- **bsp-hier on the dilated WAN** is exact synchronous SGD: its Dice after a given number of
  steps does not depend on the link, only its time does. Each of its steps crosses the WAN, so a
  full run there would take hours; it runs in full on the no-WAN control (``hippo3-lan``), and on
  the dilated WAN as a probe job (:data:`PROBE_CASES` cases per site, :data:`PROBE_EPOCHS`
  epochs) that measures its time per step. Its time to Dice on the WAN is then *estimated* as the
  control's time from launch plus the control's steps to Dice times the extra seconds per step the
  probe measured; the report marks it as an estimate.

Figures per config and seed (:mod:`medseg.bench.sites_figures`): time to the Dice target from the
launch (the primary figure) and in training time, validation Dice after the equal epochs, held-out
Dice per site after training (the bundle's checkpoint, selected on validation), WAN bytes counted
by the relay, time per rank.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medseg.config import config_from_dict
from medseg.errors import ConfigError

log = logging.getLogger(__name__)

SITES = "a:2,b:1,c:1"
CPU = {"a": 0.45, "b": 0.4, "c": 0.3}  # cores per rank
COUNTS = {"a": 90, "b": 60, "c": 50}
HELD_OUT = 10  # cases per site never trained or selected on
STORED_AS = ("uint8", "c")  # the uint8-stored cases (another scanner's export) all at site c
LINKS = {"a": "100mbit:5ms", "b": "20mbit:25ms", "c": "10mbit:40ms"}  # nominal, before dilation
# The network's step of the planned model (a 0.14 M-parameter, 3-level MONAI UNet on 2 x 24x40x32
# patches: forward, Dice-CE, backward, AdamW) on a GPU, measured by scripts/gpu_check.sh
# (:func:`measure_plan_step`) on an NVIDIA H200 with torch 2.11 + CUDA 13.0 on 2026-12-04: median
# of 200 synchronised steps 0.0100 s under bfloat16 autocast (what `medseg train` runs on CUDA),
# 0.0092 s in float32. Its arithmetic, about 1 GFLOP, is a fraction of a millisecond there: the
# step is bound by launching its few hundred kernels, so a faster GPU would not shorten it much.
GPU_STEP_S = 0.0100
# What `medseg plan` (defaults, cpu) chose for the pooled training cases of the three sites on an
# idle machine (2026-12-03): z-score, 1 mm, patch 24x40x32 x 2 samples, a 3-level UNet of 0.14 M
# parameters, AdamW at 0.003, 8 epochs. Kept fixed here: the planner sizes the plan by the compute
# it measures at the time, so on a loaded machine it may choose another network, and every
# invocation of the benchmark must train the same one.
PLAN: dict[str, Any] = {
    "task": "segmentation",
    "transforms": {
        "spacing": [1.0, 1.0, 1.0],
        "normalize": {"scheme": "zscore"},
        "patch": [24, 40, 32],
        "num_samples": 2,
    },
    "model": {"name": "unet", "channels": [16, 32, 64], "strides": [2, 2], "num_res_units": 1},
    "train": {"device": "cpu", "epochs": 8, "batch_size": 1, "lr": 0.003, "seed": 0, "val_interval": 1},
    "infer": {"sw_batch_size": 4},
}
CONFIGS: dict[str, dict[str, Any]] = {
    "bsp-hier": {"sync": "bsp-hier"},
    "fedavg": {"sync": "fedavg", "local_epochs": 1},
    "diloco": {"sync": "diloco", "inner_steps": 500, "outer_lr": 0.7, "outer_momentum": 0.9},
    "gssp": {"sync": "gssp", "staleness": 2},
    "gssp-fixed4": {"sync": "gssp", "staleness": 2, "compression": "fixed", "bits": 4},
    "gssp-topk1": {"sync": "gssp", "staleness": 2, "compression": "topk", "topk_fraction": 0.01},
    "gssp-fixed4-nesterov": {
        "sync": "gssp",
        "staleness": 2,
        "compression": "fixed",
        "bits": 4,
        "outer": "nesterov",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
    },
    # one lever each on gssp-fixed4 (issue 27's open choices, measured with --configs)
    "gssp-fixed4-fednova": {
        "sync": "gssp",
        "staleness": 2,
        "compression": "fixed",
        "bits": 4,
        "normalize_steps": True,
    },
    "gssp-fixed4-dc": {"sync": "gssp", "staleness": 2, "compression": "fixed", "bits": 4, "dc_lambda": 1.0},
    "gssp-fixed4-unbalanced": {
        "sync": "gssp",
        "staleness": 2,
        "compression": "fixed",
        "bits": 4,
        "balance_rounds": False,
    },
    "gssp-fixed4-reset": {
        "sync": "gssp",
        "staleness": 2,
        "compression": "fixed",
        "bits": 4,
        "round_momentum": "reset",
    },
}
PEERS = ("bsp-hier", "fedavg", "diloco")
GSSP = tuple(n for n in CONFIGS if n.startswith("gssp"))
# what an invocation without --configs runs; the single-lever variants above are for ablations
DEFAULT_CONFIGS = (
    "bsp-hier",
    "fedavg",
    "diloco",
    "gssp",
    "gssp-fixed4",
    "gssp-topk1",
    "gssp-fixed4-nesterov",
)
DICE_TARGET = 0.85  # mean per-site validation Dice
EPOCHS = 8  # equal epochs for every config (the planner's), then on to the target
MAX_EPOCHS = 16
PROBE_CASES, PROBE_EPOCHS = 4, 1
TIMEOUT_S = 900.0  # a rank silent this long is hung: a dilated round may take minutes


@dataclass(frozen=True)
class Setting:
    """What every job of one invocation shares."""

    workdir: Path
    sites: dict[str, dict[str, str]]  # site -> {"train": dir, "test": dir, "probe": dir}
    plan: dict[str, Any]  # the planned config (model, transforms, optimiser)
    cpu_step_s: float  # measured seconds of the network's step on one idle thread (c_cpu)
    data_step_s: float  # measured seconds of a step's data work on one idle thread (d)
    k: float  # time dilation factor
    seeds: int
    # config -> its tuned point ({"lr": ..., and a round lever}), from ``bench real-sites-tune``
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)


def prepare(workdir: Path, data: Path, seeds: int, gpu_step_s: float) -> Setting:
    """Deal ``data`` to the sites, plan on the pooled training cases, and fix the dilation."""
    from medseg.datasets.decathlon import load_dataset
    from medseg.datasets.site_split import split_sites

    made = split_sites(data, workdir / "sites", COUNTS, HELD_OUT, STORED_AS, seed=0)
    pooled = _pooled_folder(workdir / "sites" / "pooled", [made[s]["train"] for s in COUNTS])
    planned = {
        **json.loads(json.dumps(PLAN)),
        "data": {"dir": str(pooled), "val_fraction": 0.2, "cache": "memory"},
    }
    cpu_step_s = measure_cpu_step(planned, len(load_dataset(pooled).labels))
    data_step_s = measure_data_step(planned)
    sites = {
        s: {
            "train": str(made[s]["train"]),
            "test": str(made[s]["test"]),
            "probe": str(_probe_folder(made[s]["train"], workdir / "sites" / f"{s}-probe")),
        }
        for s in COUNTS
    }
    k = dilation(data_step_s, cpu_step_s, gpu_step_s)
    log.info(
        "bench real-sites: data step %.4f s, network step %.4f s (one thread): k = %.1f",
        data_step_s,
        cpu_step_s,
        k,
    )
    return Setting(workdir, sites, planned, cpu_step_s, data_step_s, k, seeds)


def dilation(data_s: float, cpu_s: float, gpu_s: float) -> float:
    """k = T_cpu / T_gpu with T_cpu = (d + c_cpu) / q and T_gpu = d + c_gpu (module docstring)."""
    return (data_s + cpu_s) / min(CPU.values()) / (data_s + gpu_s)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread inside, its thread count as it was afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _batch_seconds(loader: Any) -> Iterator[float]:
    """Seconds each of ``loader``'s batches took to draw, one epoch."""
    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        if next(batches, None) is None:
            return
        yield time.perf_counter() - t0


def measure_data_step(config: dict[str, Any], steps: int = 60) -> float:
    """Seconds of one training step's data work on one thread: the loader's next batch as ``medseg
    train`` draws it in its own process (``data.num_workers: 0``): MONAI's random patch draw and
    augmentation over the cached cases, and collation. Median of ``steps`` batches."""
    from medseg.training.data import make_train_data, seed_epoch

    cfg = config_from_dict(config)
    data = make_train_data(cfg)
    times: list[float] = []
    with _one_thread():
        for epoch in range(steps):
            seed_epoch(data, cfg.train.seed, epoch)
            drawn = list(itertools.islice(_batch_seconds(data.train_loader), steps - len(times)))
            if not drawn:
                raise ConfigError("measure_data_step: the training loader drew no batch")
            times += drawn
            if len(times) >= steps:
                break
    return statistics.median(times)


def _network_step(config: dict[str, Any], classes: int, device: str, steps: int, amp: bool) -> dict[str, Any]:
    """:func:`medseg.kernels.measure.measure` of ``config``'s network at its patch and batch."""
    import torch

    from medseg.kernels.measure import measure
    from medseg.models import network_def

    cfg = config_from_dict(config)
    batch = cfg.train.batch_size * cfg.transforms.num_samples
    net, shape = network_def(cfg, classes), tuple(cfg.transforms.patch)
    return measure("unet", "baseline", 0, batch, steps, torch.device(device), 1.0, classes, net, shape, amp)


def measure_plan_step(device: str = "cuda", steps: int = 200) -> dict[str, Any]:
    """Seconds of one training step of :data:`PLAN`'s network (forward, Dice-CE, backward, AdamW on
    a step's patches, synchronised), float32 and under bfloat16 autocast (what ``medseg train``
    runs on CUDA), median of ``steps``, in this process. ``scripts/gpu_check.sh`` runs it on a lent
    GPU; its ``amp_s`` is the GPU step that :data:`GPU_STEP_S` records."""
    classes = 3  # background and the two hippocampus labels
    fp32, amp = (_network_step(PLAN, classes, device, steps, amp) for amp in (False, True))
    keep = {k: fp32[k] for k in ("shape", "batch", "params")}
    return {"fp32_s": fp32["step_s"], "amp_s": amp["step_s"], "device": device, **keep, "steps": steps}


def measure_cpu_step(config: dict[str, Any], classes: int, steps: int = 20) -> float:
    """Seconds of the planned network's step (forward, Dice-CE, backward, AdamW) at the planned
    patch and batch on one thread, with glibc's own allocator as ``medseg train`` runs it (the
    memory probe's mmap threshold would add about 70% here), median of ``steps``, in this process."""
    with _one_thread():
        return float(_network_step(config, classes, "cpu", steps, False)["step_s"])


def _pooled_folder(out: Path, folders: list[Path]) -> Path:
    """A dataset.json naming every site's training cases (what ``medseg plan`` reads; no copies)."""
    docs = [json.loads((f / "dataset.json").read_text()) for f in folders]
    pooled = dict(docs[0], name="pooled", training=[c for d in docs for c in d["training"]])
    pooled["numTraining"] = len(pooled["training"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").write_text(json.dumps(pooled, indent=1))
    return out


def _probe_folder(train: Path, out: Path) -> Path:
    """The first :data:`PROBE_CASES` training cases of a site: the bsp-hier probe job's data."""
    doc = json.loads((train / "dataset.json").read_text())
    doc["training"] = doc["training"][:PROBE_CASES]
    doc["numTraining"] = len(doc["training"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").write_text(json.dumps(doc, indent=1))
    return out


def network(k: float) -> Any:
    """Every site's nominal link, dilated by ``k`` (rate / k, delay x k)."""
    from medseg.distributed.testbed.spec import Network, dilate, parse_wan

    return Network(parse_wan("none"), tuple((s, dilate(parse_wan(LINKS[s]), k)) for s in COUNTS))


def job_config(
    setting: Setting,
    name: str,
    dist: dict[str, Any],
    seed: int,
    hosts: dict[str, str],
    probe: bool = False,
    fixed_epochs: int = 0,
) -> dict[str, Any]:
    """The planned config with this config's ``dist``, the sites' own folders and the benchmark's
    epochs (``probe``: the small bsp-hier probe, :data:`PROBE_EPOCHS` epochs, no target;
    ``fixed_epochs``: the table's schedule over :data:`MAX_EPOCHS`, stopped after that many epochs
    without a target, as the tuning jobs train). A ``dist`` key ``lr`` is the optimiser's learning
    rate (a tuned point), not a sync setting."""
    cfg = json.loads(json.dumps(setting.plan))
    cfg["name"] = name
    cfg["runs_dir"] = str(setting.workdir / "runs" / f"seed{seed}")
    cfg["sites"] = {
        s: {"dir": d["probe" if probe else "train"], "host": hosts[s]} for s, d in setting.sites.items()
    }
    cfg["train"].update(
        seed=seed,
        threads=1,
        epochs=PROBE_EPOCHS if probe else MAX_EPOCHS,
        min_epochs=PROBE_EPOCHS if probe else EPOCHS,
        stop_at=0.0 if probe or fixed_epochs else DICE_TARGET,
        until_epoch=fixed_epochs,
    )
    dist = dict(dist)
    if "lr" in dist:
        cfg["train"]["lr"] = dist.pop("lr")
    cfg["dist"] = {"timeout_s": TIMEOUT_S, "profile_steps": 5, **dist}
    return cfg


def held_out_dice(run_dir: Path, setting: Setting) -> dict[str, float | None]:
    """Each site's held-out Dice (mean of its labels, mean over its cases) and their mean, scored
    with the run's bundle (its checkpoint selected on validation)."""
    from medseg.inference.evaluate import evaluate_sites

    res = evaluate_sites(run_dir, [(s, Path(d["test"])) for s, d in setting.sites.items()], progress=False)
    per = {s: r.get("dice") for s, r in res["sites"].items()}
    vals = [v for v in per.values() if v is not None]
    return {**per, "mean": sum(vals) / len(vals) if vals else None}


def run_config(tb: Any, setting: Setting, name: str, seed: int, probe: bool = False) -> dict[str, Any]:
    """One job of config ``name`` (its tuned point where :attr:`Setting.tuned` has one) over the
    testbed; its figures and its held-out Dice."""
    from medseg.bench.sites import launch_job
    from medseg.bench.sites_figures import job_figures

    hosts = {s.name: s.job_ip for s in tb.sites}
    dist = {**CONFIGS[name], **setting.tuned.get(name, {})}
    raw = job_config(setting, f"{name}-probe" if probe else name, dist, seed, hosts, probe)
    cfg = config_from_dict(raw)
    run = launch_job(tb, cfg, Path(raw["runs_dir"]) / f"{raw['name']}.yaml", SITES)
    epochs = PROBE_EPOCHS if probe else EPOCHS
    fig = job_figures(*run, epochs, 2.0 if probe else DICE_TARGET, dist)
    if not probe:
        fig["held_out"] = held_out_dice(cfg.run_dir, setting)
    return fig


def bench_real_sites(
    workdir: Path,
    data: Path,
    seeds: int = 3,
    configs: list[str] | None = None,
    gpu_step_s: float = GPU_STEP_S,
    tuned: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole benchmark in one invocation: the no-WAN control (bsp-hier), then the dilated WAN
    (the bsp-hier probe and every config), ``seeds`` seeds each; ``tuned``: each config's point
    chosen by ``bench real-sites-tune`` (:func:`medseg.bench.real_sites_tune.winners`)."""
    import dataclasses
    import os

    from medseg.distributed.testbed.testbed import testbed

    configs = list(configs or DEFAULT_CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "bsp-hier" not in configs:
        raise ConfigError(
            f"bench real-sites: configs {unknown} unknown or bsp-hier missing (the reference); configs {list(CONFIGS)}"
        )
    if gpu_step_s <= 0:
        raise ConfigError(f"--gpu-step-s must be > 0 (got {gpu_step_s})")
    out: dict[str, Any] = {"seeds": seeds, "load_start": os.getloadavg(), "started": time.time()}
    setting = dataclasses.replace(prepare(workdir, data, seeds, gpu_step_s), tuned=tuned or {})
    net = network(setting.k)
    out["setting"] = setting_record(setting, gpu_step_s, net)
    out["lan"] = {}
    with testbed(sites=SITES, wan="none", cpu=CPU) as tb:
        out["lan"]["bsp-hier"] = _seeds(tb, setting, "bsp-hier")
    out["wan"] = {}
    with testbed(sites=SITES, wan=net, cpu=CPU, probe=False) as tb:
        out["probe"] = tb.probe_pairs(check=True)
        out["bsp_hier_probe"] = run_config(tb, setting, "bsp-hier", 0, probe=True)
        for name in configs:
            if name != "bsp-hier":
                out["wan"][name] = _seeds(tb, setting, name)
    out["load_end"] = os.getloadavg()
    out["wall_s"] = time.time() - out["started"]
    return out


def _seeds(tb: Any, setting: Setting, name: str) -> dict[str, Any]:
    from medseg.bench.sites_figures import aggregate

    runs = []
    for seed in range(setting.seeds):
        log.info("bench real-sites: %s seed %d", name, seed)
        runs.append(run_config(tb, setting, name, seed))
    agg = aggregate(runs)
    held = [r["held_out"]["mean"] for r in runs]
    agg["held_out_mean"] = sum(held) / len(held) if None not in held else None
    agg["held_out_spread"] = [min(held), max(held)] if None not in held else None
    return agg


def setting_record(setting: Setting, gpu_step_s: float, net: Any) -> dict[str, Any]:
    m = setting.plan["model"]
    return {
        "sites": SITES,
        "cpu_per_rank": CPU,
        "counts": COUNTS,
        "held_out": HELD_OUT,
        "links_nominal": LINKS,
        "links_dilated": str(net),
        "cpu_step_s": setting.cpu_step_s,
        "data_step_s": setting.data_step_s,
        "gpu_step_s": gpu_step_s,
        "k": setting.k,
        "model": f"{m['name']} channels {m.get('channels')} strides {m.get('strides')}",
        "patch": setting.plan["transforms"]["patch"],
        "lr": setting.plan["train"]["lr"],
        "epochs": EPOCHS,
        "max_epochs": MAX_EPOCHS,
        "dice_target": DICE_TARGET,
        "configs": {n: CONFIGS[n] for n in CONFIGS},
        "tuned": setting.tuned,
    }

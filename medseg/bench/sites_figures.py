"""The figures of ``medseg bench sites``: from one job's records, over seeds, and against bsp-none.

Per scenario and config, all measured:

- ``time_to_dice_s``: training wall time (:func:`training_curve`: from rank 0's start of training,
  speed and WAN profiling included, validations excluded) to the first validation at or above the
  Dice target; None when never reached. ``time_to_dice_job_s``: the same from the launch (start-up
  and validations included); ``startup_s``: launch to start of training.
- ``dice_equal_epochs``: validation Dice after the last equal epoch (the same for every config).
- ``dice_at_budget``: the last validation Dice at or before the budget (the fastest config's
  whole training wall time in that scenario).
- ``samples_per_s``: training samples of all ranks over the whole job's wall time.
- ``wan_bytes_measured``: IP bytes the relay's TUN devices carried between the sites during the
  job (:meth:`Testbed.wan_counters`), and ``wan_payload_measured``: TCP payload, from the relay's
  look inside the packets, else the same less :data:`HEADER_BYTES` per packet;
  ``wan_bytes_reported``: the cross-host bytes the algorithm believes it sent (its byte model,
  summed over ranks and epochs). They should agree within 5 %; :func:`byte_gaps` says why when
  they do not.
- ``max_lead_rounds``: from the group leaders' timestamped records: at every moment a group starts
  a round, how many more rounds it has completed than the slowest group (submission times), the
  maximum over the job; compared with ``staleness_bound``. Not a value read from the schedule.
- ``insite_step_s_idle`` / ``insite_step_s_with_round_in_flight`` (gssp): median in-site step time
  (forward, backward, in-site averaging) of the leaders' steps with no cross-site round in flight
  and with one in flight.
- ``rank_time``: a time breakdown per rank: compute, waiting inside the site, waiting on other sites.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

HEADER_BYTES = 52  # IPv4 20 + TCP 20 + timestamps option 12
# What the site link adds to every packet it carries: outer IPv4 20 + UDP 8 + WireGuard's data
# header 16 + Poly1305 tag 16 (its padding of the inner packet to 16 bytes, 0-15, is not counted).
TUNNEL_BYTES = 60
# The real setting this stands for: MONAI's 3D UNet (16-256 channels, 4.8 M parameters, 19 MB fp32)
# at about 0.5 s per step on a GPU; a 4-rank ring over 2 sites carries 1.5 x 19 MB per direction.
REAL_PARAMS_MB, REAL_STEP_S = 19.3, 0.5


def training_curve(records: list[dict]) -> list[tuple[float, float | None]]:
    """(training wall time, validation Dice) after each epoch.

    Training wall time runs from ``train_start`` (rank 0, before the speed and WAN profiling,
    which it therefore includes) to the epoch's record, less the validations before and at that
    epoch: validating every epoch is the benchmark's instrument, not part of training, and it
    would add the same seconds to every config. Launch, imports, ssh and data caching (before
    ``train_start``, the same for every config) are reported apart as ``startup_s``.
    """
    out, val = [], 0.0
    for r in records:
        val += r.get("val_s", 0.0)
        out.append((r["time"] - r["train_start"] - val, r.get("val_dice")))
    return out


def rank_records(run_dir: Path) -> dict[int, list[dict]]:
    """Each rank's timestamped records (``ranks/rank-N.jsonl`` of the run), by rank."""
    out = {}
    for path in sorted((run_dir / "ranks").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def max_lead_rounds(records: dict[int, list[dict]]) -> int | None:
    """The largest lead, in completed rounds, of a group over the slowest when it starts a round.

    Uses the leaders' ``submit`` (round completed, stamped before the exchange is issued) and
    ``start`` (the group passed its staleness wait and goes on) records. None without rounds.
    """
    submits = {r: sorted(e["t"] for e in recs if e.get("ev") == "submit") for r, recs in records.items()}
    submits = {r: ts for r, ts in submits.items() if ts}
    if len(submits) < 2:
        return None
    lead = 0
    for r, recs in records.items():
        for e in recs:
            if e.get("ev") != "start" or r not in submits:
                continue
            done = {h: sum(1 for t in ts if t <= e["t"]) for h, ts in submits.items()}
            lead = max(lead, done[r] - min(done.values()))
    return lead


def insite_step_times(records: dict[int, list[dict]]) -> tuple[float | None, float | None, int, int]:
    """Median in-site step time (compute + in-site averaging) without and with a round in flight.

    Only the group leaders know whether a round is in flight, so only their steps count.
    """
    idle, busy = [], []
    for recs in records.values():
        if not any(e.get("ev") == "submit" for e in recs):
            continue
        for e in recs:
            if "step" in e and "compute_s" in e:
                (busy if e.get("inflight") else idle).append(e["compute_s"] + e["site_s"])
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return med(idle), med(busy), len(idle), len(busy)


def job_figures(
    records: list[dict],
    ranks: dict[int, list[dict]],
    launched: float,
    job_s: float,
    counters: tuple[dict[str, Any], dict[str, Any]],
    epochs: int,
    target: float,
    dist: dict[str, Any],
    tunnel: bool = False,
) -> dict[str, Any]:
    """One job's figures (see the module docstring) from rank 0's epoch records, every rank's
    records, its launch time and wall time, and the relay's WAN counters before and after it
    (``tunnel``: the job ran over the site link, so the relay sees only WireGuard's UDP)."""
    samples = sum(r["dist_samples_per_s"] * r["dist_epoch_s"] for r in records)
    curve = training_curve(records)
    reached = [t for t, d in curve if d is not None and d >= target]
    reached_job = [r["time"] - launched for r in records if (r.get("val_dice") or 0) >= target]
    idle, busy, n_idle, n_busy = insite_step_times(ranks)
    breakdown = [
        {
            k: round(sum(r["dist_rank_time"][i][k] for r in records), 2)
            for k in ("compute_s", "site_s", "wan_wait_s", "wall_s")
        }
        for i in range(len(records[0]["dist_rank_time"]))
    ]
    return {
        "time_to_dice_s": reached[0] if reached else None,
        "time_to_dice_job_s": reached_job[0] if reached_job else None,
        "startup_s": records[0]["train_start"] - launched,
        "val_s": sum(r.get("val_s", 0.0) for r in records),
        "dice_equal_epochs": next(r.get("val_dice") for r in records if r["epoch"] == epochs),
        "samples_per_s": samples / job_s,
        "job_s": job_s,
        **wan_figures(*counters, len(records), tunnel=tunnel),
        # the algorithm's own byte model (set-up transfers included)
        "wan_bytes_reported": sum(r.get("dist_wan_bytes", 0) for r in records),
        "max_lead_rounds": max_lead_rounds(ranks),
        "staleness_bound": dist.get("staleness", 2) if dist["sync"] == "gssp" else 0,
        "insite_step_s_idle": idle,
        "insite_step_s_with_round_in_flight": busy,
        "insite_steps_counted": [n_idle, n_busy],
        "rank_time": breakdown,
        "groups": records[-1].get("dist_groups"),
        "periods": records[-1].get("dist_periods"),
        "epochs": len(records),
        "steps": sum(1 for e in ranks.get(0, []) if "step" in e),
        "curve": curve,
        **startup_figures(ranks, launched),
    }


def startup_figures(ranks: dict[int, list[dict]], launched: float) -> dict[str, Any]:
    """Where a job's start-up went: seconds from the launch until the last rank's process was up
    (imports and the launcher's ssh included), and each start-up phase's seconds on the slowest
    rank for that phase (the ranks' ``startup`` records; a phase ends for all ranks together, so
    the slowest rank's figure is the job's)."""
    started = [e["t"] for evs in ranks.values() for e in evs if e.get("ev") == "started"]
    phases: dict[str, float] = {}
    for evs in ranks.values():
        for e in evs:
            if e.get("ev") == "startup":
                for k, v in e.items():
                    if isinstance(v, (int, float)) and k not in ("rank", "t", "seq", "pid"):
                        phases[k] = max(phases.get(k, 0.0), float(v))
    return {
        "ranks_up_s": max(started) - launched if started else None,
        "startup_phases": phases or None,
    }


def wan_figures(
    before: dict[str, Any], after: dict[str, Any], epochs_run: int, tunnel: bool = False
) -> dict[str, Any]:
    """One job's WAN traffic from the relay's counters (:meth:`Testbed.wan_counters`) before and after it.

    TCP payload: exact from the relay's look inside the packets; else (no relay) the IP bytes less
    :data:`HEADER_BYTES` per packet; over the site link, where the relay sees only encrypted UDP,
    the IP bytes less :data:`TUNNEL_BYTES` + :data:`HEADER_BYTES` per packet, an estimate
    (``wan_payload_estimated``) a little above the truth by WireGuard's padding.
    """
    wan_bytes = after["bytes"] - before["bytes"]
    wan_packets = after["packets"] - before["packets"]
    tcp = {k: v - before.get("tcp", {}).get(k, 0) for k, v in after.get("tcp", {}).items()}
    if tunnel:
        payload, tcp = wan_bytes - (TUNNEL_BYTES + HEADER_BYTES) * wan_packets, {}
    else:
        payload = tcp["payload"] if tcp else wan_bytes - HEADER_BYTES * wan_packets
    return {
        "wan_payload_estimated": tunnel or not tcp,
        "wan_bytes_measured": wan_bytes,
        "wan_payload_measured": payload,
        "wan_packets": wan_packets,
        "wan_payload_per_epoch": payload / epochs_run,
        # of the payload, bytes TCP sent again (a burst dropped by the tbf queue); None without a relay
        "wan_retrans_measured": tcp.get("retrans_payload") if tcp else None,
        "wan_tcp": tcp or None,
    }


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def aggregate(runs: list[dict]) -> dict[str, Any]:
    """Mean over seeds (spread as min..max) of the numeric figures; the first seed's curve and details."""
    agg = dict(runs[0])
    for key in (
        "time_to_dice_s",
        "time_to_dice_job_s",
        "startup_s",
        "dice_equal_epochs",
        "samples_per_s",
        "job_s",
        "wan_bytes_measured",
        "wan_payload_measured",
        "wan_payload_per_epoch",
        "wan_retrans_measured",
        "wan_bytes_reported",
        "insite_step_s_idle",
        "insite_step_s_with_round_in_flight",
    ):
        vals = [r[key] for r in runs]
        agg[key] = None if any(v is None for v in vals) and key.startswith("time_to_dice") else _mean(vals)
        nums = [v for v in vals if v is not None]
        agg[f"{key}_spread"] = [min(nums), max(nums)] if nums else None
    leads = [r["max_lead_rounds"] for r in runs if r["max_lead_rounds"] is not None]
    agg["max_lead_rounds"] = max(leads) if leads else None
    agg["seeds"] = len(runs)
    agg["runs"] = runs
    return agg


def set_budget(res: dict[str, Any]) -> None:
    """The scenario's budget (the fastest config's whole training time) and each config's Dice at it."""
    budget = min(c["curve"][-1][0] for c in res["configs"].values())
    res["budget_s"] = budget
    for c in res["configs"].values():
        seen = [d for t, d in c["curve"] if t <= budget and d is not None]
        c["dice_at_budget"] = seen[-1] if seen else None


def comm_setting(out: dict[str, Any]) -> dict[str, Any]:
    """The comm/compute ratio this run has, against a real 3D U-Net between hospitals at 20 Mbit/s."""
    s = out["scenarios"].get("wan20")
    if not s or "bsp-none" not in s["configs"]:
        return {}
    c = s["configs"]["bsp-none"]
    steps = max(c["steps"], 1)
    per_step_bytes = c["wan_bytes_reported"] / 2 / steps  # per direction
    rate = 20e6 / 8
    compute = max(rt["compute_s"] for rt in c["rank_time"]) / steps  # the slowest rank sets bsp's pace
    ours = (per_step_bytes / rate) / compute if compute else None
    real = (1.5 * REAL_PARAMS_MB * 1e6 / rate) / REAL_STEP_S
    return {
        "comm_to_compute_ours": ours,
        "comm_to_compute_real_unet": real,
        "note": (
            f"bsp-none at 20 Mbit/s: ours {ours:.1f}x WAN time per step over compute per step; MONAI's 4.8M-parameter "
            f"3D UNet at {REAL_STEP_S} s/step on a GPU would be {real:.0f}x. Times here are CPU times, not GPU times."
            if ours
            else ""
        ),
    }


def ratios(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each config of a scenario against bsp-none: time to Dice, speed, bytes per epoch, Dice; and
    how far its measured WAN payload is from the bytes it reported."""
    base = res["configs"].get("bsp-none", {})
    out = {}
    for name, c in res["configs"].items():
        t, b = c.get("time_to_dice_s"), base.get("time_to_dice_s")
        out[name] = {
            "time_x": (t / b) if t and b else None,
            "speed_x": c["samples_per_s"] / base["samples_per_s"] if base else None,
            "bytes_x": (c["wan_payload_per_epoch"] / base["wan_payload_per_epoch"])
            if base.get("wan_payload_per_epoch")
            else None,
            "dice_delta": (c["dice_equal_epochs"] or 0) - (base.get("dice_equal_epochs") or 0),
            "bytes_agree": (
                abs(c["wan_payload_measured"] - c["wan_bytes_reported"]) / c["wan_bytes_reported"]
            )
            if c["wan_bytes_reported"] and res["wan"] != "none"
            else None,
        }
    return out


#: What crosses the WAN outside the algorithms' byte models (``wan_bytes_reported``), for the report.
UNMODELLED = (
    "Horovod, once initialised, keeps exchanging coordination messages between all ranks even with no "
    "op pending (its background loop syncs its response cache every cycle, CacheCoordinator::sync; "
    "measured idle between the sites: 88-93 kB per 20 s), and negotiates every Horovod op through "
    "rank 0 (tensor names, sizes): bsp-none and bsp-fp16 run their gradient allreduce on Horovod, "
    "bsp-fixed4 between sites and the others run on medseg's channel and only idle on Horovod; "
    "medseg's channel sends control messages (a barrier, a metrics gather and the stop decision per "
    "epoch, about 5 kB; group set-up through rank 0's TCP store, about 20-40 kB per job); "
    "Gloo frames every message with a small header of its own"
)


def byte_gaps(res: dict[str, Any]) -> list[str]:
    """One line per config: measured TCP payload against the reported bytes, and what makes the gap.

    Retransmitted payload is measured by the relay (a segment whose sequence range was sent before);
    the rest of the gap is what :data:`UNMODELLED` lists, given as a rate over the job's wall time
    and per step (most of it runs whether or not a step is under way).
    """
    if res["wan"] == "none":
        return []
    out = []
    for name, c in res["configs"].items():
        rep, meas = c["wan_bytes_reported"], c["wan_payload_measured"]
        if not rep:
            continue
        retrans = c.get("wan_retrans_measured")
        rest = meas - rep - (retrans or 0)
        job_s = max(c.get("job_s") or 1.0, 1.0)
        steps = max(c.get("steps") or 1, 1)
        agree = abs(meas - rep) / rep
        why = (
            f"{'within' if agree <= 0.05 else 'NOT within'} 5 %; "
            + (f"TCP retransmissions {retrans / 1e6:.2f} MB, " if retrans is not None else "")
            + f"the rest {rest / 1e6:+.2f} MB ({rest / job_s / 1e3:+.1f} kB per second of the job, "
            f"{rest / steps / 1e3:+.1f} kB per step)"
        )
        how = (
            " (estimated: IP bytes less the tunnel's and TCP's headers)"
            if c.get("wan_payload_estimated")
            else ""
        )
        out.append(
            f"- {name}: measured{how} {meas / 1e6:.2f} MB, reported {rep / 1e6:.2f} MB ({(meas - rep) / rep:+.1%}): {why}"
        )
    if out:
        out.append(f"- not in the byte models: {UNMODELLED}.")
    return out

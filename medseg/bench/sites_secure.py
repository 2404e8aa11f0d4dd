"""The site link's cost in ``medseg bench sites --secure``: each config over the tunnel against the
same config in clear, on the same emulated WAN, measured in the same invocation.

For a secure scenario S and its plain twin P (:data:`~medseg.bench.sites_configs.SECURE_TWIN`) and
each config run in both:

- time x = T_S / T_P, with T the time to the Dice target from the launch (the primary figure: ssh,
  Horovod's rendezvous and Gloo's set-up all ride the tunnel too), and the same ratio of training
  time beside it. Judged: time x <= :data:`~medseg.bench.sites_configs.SECURE_TIME_LIMIT`.
- WAN overhead = B_S / B_P - 1, with B the IP bytes per epoch that crossed the WAN (measured by the
  relay: for S the encrypted UDP, headers included; for P the clear TCP, headers included). Shown.
- speed x = samples/s over S's job / over P's. Shown.
"""

from __future__ import annotations

from typing import Any

from medseg.bench.protocol import Target, at_most, table_head, table_row
from medseg.bench.sites_configs import SECURE_TIME_LIMIT, SECURE_TWIN


def secure_pairs(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(secure scenario, config, its figures over the tunnel, in clear) for every config run in both."""
    out = []
    for sec, twin in SECURE_TWIN.items():
        s, p = result["scenarios"].get(sec), result["scenarios"].get(twin)
        if s and p:
            out += [(sec, n, c, p["configs"][n]) for n, c in s["configs"].items() if n in p["configs"]]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _per_epoch_bytes(c: dict[str, Any]) -> float:
    return c["wan_bytes_measured"] / max(c["epochs"], 1)


def link_cost(secure: dict[str, Any], plain: dict[str, Any]) -> dict[str, float | None]:
    """One config's figures over the site link against in clear (see the module docstring)."""
    return {
        "time_x": _ratio(secure.get("time_to_dice_job_s"), plain.get("time_to_dice_job_s")),
        "train_time_x": _ratio(secure.get("time_to_dice_s"), plain.get("time_to_dice_s")),
        "wan_overhead": _ratio(_per_epoch_bytes(secure), _per_epoch_bytes(plain)) - 1
        if _per_epoch_bytes(plain)
        else None,
        "speed_x": _ratio(secure["samples_per_s"], plain["samples_per_s"]),
    }


def secure_targets(result: dict[str, Any]) -> list[Target]:
    """Time to Dice from the launch over the site link at most SECURE_TIME_LIMIT x in clear, per config."""
    checks = []
    for sec, name, s, p in secure_pairs(result):
        x = link_cost(s, p)["time_x"]
        got = "not reached" if x is None else f"{x:.2f}x"
        text = f"{sec}: {name} time to Dice from launch <= {SECURE_TIME_LIMIT:.2f}x in clear (got {got})"
        checks.append(at_most(text, x, SECURE_TIME_LIMIT))
    return checks


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _fmt_t(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.0f}"


def secure_table(result: dict[str, Any]) -> list[str]:
    """The side-by-side table of :func:`secure_pairs`, or nothing when no secure scenario ran."""
    pairs = secure_pairs(result)
    if not pairs:
        return []
    columns = [
        "scenario",
        "config",
        "time to Dice from launch, clear / link (s)",
        "x clear",
        "training time to Dice, clear / link (s)",
        "x clear",
        "samples/s x clear",
        "WAN IP bytes per epoch, clear / link (MB)",
        "overhead",
    ]
    lines = [
        "**The site link against the same run in clear** (WireGuard tunnel between the sites; every "
        "job socket, ssh included, on it; the WAN bytes are IP packets counted by the relay, "
        "encrypted UDP for the link):",
        "",
        *table_head(columns, "l" * len(columns)),
    ]
    for sec, name, s, p in pairs:
        cost = link_cost(s, p)
        lines.append(
            table_row(
                sec,
                name,
                f"{_fmt_t(p.get('time_to_dice_job_s'))} / {_fmt_t(s.get('time_to_dice_job_s'))}",
                _fmt_x(cost["time_x"]),
                f"{_fmt_t(p.get('time_to_dice_s'))} / {_fmt_t(s.get('time_to_dice_s'))}",
                _fmt_x(cost["train_time_x"]),
                _fmt_x(cost["speed_x"]),
                f"{_per_epoch_bytes(p) / 1e6:.2f} / {_per_epoch_bytes(s) / 1e6:.2f}",
                "-" if cost["wan_overhead"] is None else f"{cost['wan_overhead']:+.1%}",
            )
        )
    return [*lines, ""]

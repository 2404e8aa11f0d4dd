"""``medseg bench sites --secure``: the site link is judged against the same run in clear, and
the WAN figures of a tunnelled job are labelled as estimates."""

from __future__ import annotations

import pytest

from medseg.bench import sites
from medseg.bench.sites_figures import HEADER_BYTES, TUNNEL_BYTES, wan_figures
from medseg.bench.sites_secure import link_cost, secure_table, secure_targets
from medseg.errors import ConfigError


def _config(launch_s: float | None, train_s: float | None, wan_bytes: float, epochs: int = 4) -> dict:
    return {
        "time_to_dice_job_s": launch_s,
        "time_to_dice_s": train_s,
        "wan_bytes_measured": wan_bytes,
        "epochs": epochs,
        "samples_per_s": 10.0,
    }


def _result(secure_launch_s: float | None, plain_launch_s: float = 100.0) -> dict:
    plain = {"configs": {"bsp-none": _config(plain_launch_s, 80.0, 4e6), "gssp": _config(50.0, 30.0, 1e6)}}
    secure = {"configs": {"bsp-none": _config(secure_launch_s, 82.0, 4.3e6)}}
    return {"scenarios": {"wan20": plain, "wan20-secure": secure, "lan": {"configs": {}}}}


@pytest.mark.parametrize(("secure_s", "met"), [(104.0, True), (105.0, True), (106.0, False), (None, False)])
def test_time_over_the_link_is_judged_against_the_same_config_in_clear(
    secure_s: float | None, met: bool
) -> None:
    targets = secure_targets(_result(secure_s))
    assert len(targets) == 1  # gssp ran only in clear: no pair, nothing judged
    assert targets[0].met is met, targets[0].name
    assert "wan20-secure: bsp-none" in targets[0].name


def test_link_cost_figures() -> None:
    r = _result(103.0)
    cost = link_cost(
        r["scenarios"]["wan20-secure"]["configs"]["bsp-none"], r["scenarios"]["wan20"]["configs"]["bsp-none"]
    )
    assert cost["time_x"] == pytest.approx(1.03)
    assert cost["train_time_x"] == pytest.approx(82 / 80)
    assert cost["wan_overhead"] == pytest.approx(0.075)
    table = "\n".join(secure_table(r))
    assert "| wan20-secure | bsp-none | 100 / 103 | 1.03x |" in table
    assert "+7.5%" in table
    assert secure_table({"scenarios": {"wan20": r["scenarios"]["wan20"]}}) == []


def test_secure_scenario_runs_right_after_its_twin_and_needs_it() -> None:
    assert sites._with_secure_twins(["wan20", "lan"]) == ["wan20", "wan20-secure", "lan"]
    assert sites._with_secure_twins(["lan", "wan20"]) == ["lan", "wan20", "wan20-secure"]
    with pytest.raises(ConfigError, match="in clear"):
        sites._with_secure_twins(["lan"])


def test_tunnelled_payload_is_an_estimate_net_of_both_headers() -> None:
    before = {"bytes": 0, "packets": 0, "tcp": {"payload": 0, "other": 0}}
    after = {"bytes": 10_000_000, "packets": 8_000, "tcp": {"payload": 0, "other": 10_000_000}}
    tunnelled = wan_figures(before, after, 2, tunnel=True)
    assert tunnelled["wan_payload_measured"] == 10_000_000 - 8_000 * (TUNNEL_BYTES + HEADER_BYTES)
    assert tunnelled["wan_payload_estimated"] is True
    after_clear = {"bytes": 10_000_000, "packets": 8_000, "tcp": {"payload": 9_500_000, "other": 0}}
    clear = wan_figures(before, after_clear, 2)
    assert clear["wan_payload_measured"] == 9_500_000
    assert clear["wan_payload_estimated"] is False

"""``medseg bench sites`` target rules: the site link judged against the same run in clear (the WAN
figures of a tunnelled job labelled as estimates), and the two-sided Dice band in every scenario."""

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


def _dice(**configs: float | None) -> dict:
    return {name: {"dice_equal_epochs": d} for name, d in configs.items()}


def test_the_dice_band_is_two_sided_against_the_hierarchical_reference() -> None:
    targets = {
        t.name.split(" Dice")[0]: t.met
        for t in sites.dice_band_targets(
            "wan20",
            _dice(
                **{
                    "bsp-hier": 0.800,
                    "bsp-none": 0.830,
                    "gssp": 0.815,
                    "diloco": 0.791,
                    "fedavg": None,
                }
            ),
        )
    }
    assert targets == {
        "wan20: bsp-none": False,
        "wan20: gssp": False,
        "wan20: diloco": True,
        "wan20: fedavg": False,
    }
    # a config 0.015 below the reference fails, as one 0.015 above does
    below = sites.dice_band_targets("lan", _dice(**{"bsp-none": 0.800, "gssp": 0.785}))
    assert [t.met for t in below] == [False] and "of bsp-none (-0.015)" in below[0].name
    assert [t.met for t in sites.dice_band_targets("lan", _dice(**{"bsp-none": 0.8, "gssp": 0.809}))] == [
        True
    ]


def test_the_band_is_judged_in_every_scenario_only_with_enough_seeds() -> None:
    def result(seeds: int) -> dict:
        cfg = {"dice_equal_epochs": 0.7, "samples_per_s": 1.0, "time_to_dice_s": 1.0, "max_lead_rounds": None}
        scen = {"configs": {"bsp-none": dict(cfg), "gssp": dict(cfg, dice_equal_epochs=0.6)}}
        return {"seeds": seeds, "dice_target": 0.5, "scenarios": {"wan100": scen}}

    assert any("wan100: gssp Dice" in t.name and not t.met for t in sites.check_targets(result(3)))
    assert not any("Dice at equal epochs within" in t.name for t in sites.check_targets(result(1)))

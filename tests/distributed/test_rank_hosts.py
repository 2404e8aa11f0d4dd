"""Every rank's host from medseg's launcher instead of a WAN all-gather: the placement is Horovod's
own (checked against ``get_host_assignments``, the function horovodrun places ranks with), and a
rank refuses a list that does not fit the job or names another host for it."""

from __future__ import annotations

import pytest

from medseg.distributed.launch import rank_hosts
from medseg.errors import RunError

hosts_util = pytest.importorskip(
    "horovod.runner.common.util.hosts", reason="Horovod is built by `make setup`"
)


@pytest.mark.parametrize(
    ("hosts_arg", "np_"),
    [
        ("a:2,b:1,c:1", 4),
        ("a:2,b:1,c:1", 3),
        ("localhost:4", 4),
        ("198.18.0.2:1,198.18.0.3:3", 2),
        ("x:1,y:2,z:2", 5),
    ],
)
def test_placement_is_horovods_own(hosts_arg: str, np_: int) -> None:
    slots = hosts_util.get_host_assignments(hosts_util.parse_hosts(hosts_arg), np_, np_)
    horovod = [s.hostname for s in sorted(slots, key=lambda s: s.rank)]
    assert rank_hosts.placement(hosts_arg, np_) == horovod


def test_placement_refuses_too_few_slots_and_bad_entries() -> None:
    with pytest.raises(ValueError, match="2 slots for 3 ranks"):
        rank_hosts.placement("a:1,b:1", 3)
    with pytest.raises(ValueError, match="not host:slots"):
        rank_hosts.placement("a:1,b", 2)


def test_a_rank_reads_the_launchers_list_and_checks_its_own_entry(monkeypatch) -> None:
    monkeypatch.delenv(rank_hosts.RANK_HOSTS_ENV, raising=False)
    assert rank_hosts.from_env(0, 2, "a") is None  # not started by medseg's launcher: the ranks gather
    monkeypatch.setenv(rank_hosts.RANK_HOSTS_ENV, "a,a,b")
    assert rank_hosts.from_env(2, 3, "b") == ["a", "a", "b"]
    with pytest.raises(RunError, match="rank 2 runs on 'c', but the launcher placed it on 'b'"):
        rank_hosts.from_env(2, 3, "c")
    with pytest.raises(RunError, match="names 3 ranks' hosts for a job of 4 ranks"):
        rank_hosts.from_env(0, 4, "a")

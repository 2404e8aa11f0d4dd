"""Every rank's host as the launcher placed it, so that the ranks need not gather their host names.

``horovodrun -H`` places ranks in the order of its host list, slot by slot (Horovod's
``get_host_assignments``): with ``-H a:2,b:1,c:1`` ranks 0 and 1 run on ``a``, rank 2 on ``b`` and
rank 3 on ``c``, and each rank's ``HOROVOD_HOSTNAME`` is its entry's host. medseg's launcher writes
that placement to :data:`RANK_HOSTS_ENV` (:func:`placement`); a rank reads it (:func:`from_env`)
instead of all-gathering every rank's host over the channel, which across sites is a WAN
collective of its own (5.3 s on the dilated links of the real-sites benchmark, docs/benchmarks.md).

Trust. The list comes from the launcher, as the job secret does, never from a peer. Each rank
checks its own entry against the host horovodrun started it on; since every rank does, the whole
list is checked without a message. A list that does not fit this job stops the rank with
:class:`~medseg.errors.RunError` (the launcher then stops the others), so no two ranks can act on
different placements. Without the variable (a job not started by medseg's launcher) the ranks
gather their hosts as before.
"""

from __future__ import annotations

import os

from medseg.errors import RunError

RANK_HOSTS_ENV = "MEDSEG_RANK_HOSTS"


def slot_owners(slots: list[int], np_: int) -> list[int]:
    """Index of the ``-H`` entry each of ``np_`` ranks runs on: the entries in order, slot by slot."""
    out: list[int] = []
    for i, k in enumerate(slots):
        out += [i] * min(k, np_ - len(out))
    return out


def placement(hosts_arg: str, np_: int) -> list[str]:
    """Rank r's host for ``horovodrun -np np_ -H hosts_arg`` (``host:slots,...``), in rank order."""
    entries = [entry.rpartition(":") for entry in hosts_arg.split(",")]
    for host, sep, slots in entries:
        if not host or not slots.isdigit():
            raise ValueError(f"rank placement: {host + sep + slots!r} is not host:slots")
    owners = slot_owners([int(slots) for _, _, slots in entries], np_)
    if len(owners) < np_:
        raise ValueError(f"rank placement: {hosts_arg!r} has {len(owners)} slots for {np_} ranks")
    return [entries[i][0] for i in owners]


def from_env(rank: int, size: int, own_host: str) -> list[str] | None:
    """Every rank's host from the launcher, checked at this rank's own entry; ``None`` without it."""
    raw = os.environ.get(RANK_HOSTS_ENV)
    if not raw:
        return None
    hosts = raw.split(",")
    if len(hosts) != size:
        raise RunError(f"{RANK_HOSTS_ENV} names {len(hosts)} ranks' hosts for a job of {size} ranks")
    if hosts[rank] != own_host:
        raise RunError(
            f"rank {rank} runs on {own_host!r}, but the launcher placed it on {hosts[rank]!r} "
            f"({RANK_HOSTS_ENV}); horovodrun and medseg's launcher disagree on where ranks run"
        )
    return hosts

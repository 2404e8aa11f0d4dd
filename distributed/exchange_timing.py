"""How long one cross-site round exchange takes, timed by the group leaders on the real link."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from medseg.config import DistConfig
from medseg.distributed.comm.checks import refuse_update

MAX_EXCHANGE_S = 3600.0  # a timed round exchange longer than this is no measurement


def time_round_exchange(
    channel: Any, n_groups: int, dist: DistConfig, model: torch.nn.Module
) -> tuple[float, int]:
    """Seconds one cross-group round exchange takes, as rank 0 timed it, and the bytes this rank sent.

    The leaders run exactly the collective a round runs, on the leaders' group, with the round's
    payload: an allgather of the float32 parameter delta, or (``compression: fixed`` or ``topk``)
    of its encoded bytes. It is timed once, cold: a round comes seconds after the last one, so its
    TCP connections restart from the initial window as this one does. Rank 0's figure then goes to
    the other leaders (leaders' group) and on to their members (their own group), so it never uses
    the channel's world, which profiling may be using at the same time. Every rank calls this
    after :meth:`~medseg.distributed.comm.channel.Channel.set_groups`.
    """
    from medseg.distributed.comm.round_codecs import round_codec

    seconds = torch.zeros(1, dtype=torch.float64)
    sent = 0
    if channel.leaders_pg is not None:
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        codec = round_codec(dist.compression, sizes, dist.bits, dist.topk_fraction, dist.topk_bits)
        mine = torch.zeros(sum(sizes)) if codec is None else torch.zeros(codec.nbytes, dtype=torch.uint8)
        tic = time.perf_counter()
        channel.leaders_pg.allgather([torch.empty_like(mine) for _ in range(n_groups)], mine)
        seconds[0] = time.perf_counter() - tic
        sent = (n_groups - 1) * mine.numel() * mine.element_size()  # a ring allgather
        channel.leaders_pg.broadcast_(seconds, 0)
    channel.group_broadcast(seconds)
    value = float(seconds[0])
    if not math.isfinite(value) or not 0.0 <= value <= MAX_EXCHANGE_S:
        raise refuse_update(channel.describe(0), "seconds", f"{value} is no exchange time")
    return value, sent

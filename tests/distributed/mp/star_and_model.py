"""Multi-rank checks of the channel's small allgather and of the initial model's agreement; run by
tests/distributed/test_collectives.py as

    PATH=.venv/bin:$PATH horovodrun -np 3 -H localhost:3 --gloo python tests/distributed/mp/star_and_model.py

1. ``Group.allgather`` equals Gloo's own ring allgather (the independent reference, called on the
   same process group) for tensors below, at and above :data:`STAR_MAX_BYTES` and of several
   dtypes, and takes the star exactly for the blocking ones up to that size;
2. ``one_initial_model``: models built from one seed agree without a broadcast; models built from
   each rank's own seed end equal to the model rank 0's seed builds, which every rank rebuilds
   itself (the reference), and the broadcast is reported;
3. ``barrier`` and ``barrier_with`` carry rank 0's value to every rank.

Rank 0 prints one PASS or FAIL line per check; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import sys

import agreed_checks
import horovod.torch as hvd
import torch
from agreed_checks import check

from medseg.distributed.comm import channel as channel_module
from medseg.distributed.comm.channel import STAR_MAX_BYTES, Channel
from medseg.distributed.sync.common import flat, one_initial_model


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3), torch.nn.InstanceNorm3d(4), torch.nn.Conv3d(4, 2, 1))


def check_allgather(channel: Channel) -> None:
    group, n, rank = channel.world, channel.size, channel.rank
    stars = []
    real_star = group._star_allgather

    def counted(outs, tensor, kind):
        stars.append(tensor.numel() * tensor.element_size())
        real_star(outs, tensor, kind)

    group._star_allgather = counted
    cases = [
        (torch.int64, 1),
        (torch.uint8, 2056),
        (torch.float32, STAR_MAX_BYTES // 4),
        (torch.float32, STAR_MAX_BYTES // 4 + 1),
    ]
    same = True
    for dtype, numel in cases:
        g = torch.Generator().manual_seed(1000 + rank)
        mine = (torch.rand(numel, generator=g) * 200).to(dtype)
        outs = [torch.empty(numel, dtype=dtype) for _ in range(n)]
        group.allgather(outs, mine)
        ref = [torch.empty(numel, dtype=dtype) for _ in range(n)]
        group.pg.allgather([ref], [mine]).wait()
        same = same and all(torch.equal(a, b) for a, b in zip(outs, ref))
    group._star_allgather = real_star
    expected = [8, 2056, STAR_MAX_BYTES]
    check(channel, "allgather equals Gloo's ring allgather", same)
    check(channel, "the star carries exactly the small ones", stars == expected, f"{stars} vs {expected}")


def check_initial_model(channel: Channel) -> None:
    m = model(0)
    broadcast = one_initial_model(channel, m)
    check(
        channel,
        "one seed: no broadcast, one model",
        not broadcast
        and torch.equal(flat(list(m.state_dict().values())), flat(list(model(0).state_dict().values()))),
    )
    m = model(100 + channel.rank)
    broadcast = one_initial_model(channel, m)
    want = flat(list(model(100).state_dict().values()))
    got = flat(list(m.state_dict().values()))
    check(channel, "own seeds: rank 0's model broadcast", broadcast and torch.equal(got, want))


def main() -> int:
    hvd.init()
    torch.set_num_threads(1)
    channel = Channel(hvd, 60)
    check_allgather(channel)
    check_initial_model(channel)
    channel.barrier()
    got = channel.barrier_with(7 if channel.rank == 0 else channel.rank, 0)
    check(channel, "barrier_with carries rank 0's value", got == 7, str(got))
    assert channel_module.STAR_MAX_BYTES == STAR_MAX_BYTES
    channel.close()
    return 1 if agreed_checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""horovodrun script: GSSP with one group and staleness 0 gives plain Horovod's parameters.

Run: horovodrun -np N -H localhost:N --gloo python tests/distributed/mp/gssp_equals_bsp.py
"""

import os
import sys

import horovod.torch as hvd
import torch

from medseg.distributed.comm.channel import Channel
from medseg.distributed.sync.common import flat
from medseg.distributed.sync.gssp import GroupStale


def model_and_data(seed: int) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.InstanceNorm3d(4),
        torch.nn.PReLU(),
        torch.nn.Conv3d(4, 2, 1),
    )
    g = torch.Generator().manual_seed(seed)  # a different batch stream per rank
    data = [
        (torch.randn(2, 1, 8, 8, 8, generator=g), torch.randint(0, 2, (2, 8, 8, 8), generator=g))
        for _ in range(6)
    ]
    return model, data


def train(kind: str) -> torch.Tensor:
    model, data = model_and_data(100 + hvd.rank())
    # SGD, not Adam: Adam scales the rounding noise of near-zero gradients (a conv bias before an
    # instance norm) up to full steps, and Horovod and torch.distributed sum 4 ranks in different orders.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "horovod":  # plain Horovod, as a user would write it
        wrapped = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:  # the full GSSP machinery: rounds submitted, polled and applied, end-of-epoch average
        channel = Channel(hvd, 60)
        channel.set_groups([list(range(hvd.size()))])
        wrapped = GroupStale(opt, model, channel, 1, 0, 0.0, "none", 4, exchange=True)
    for x, y in data:
        wrapped.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        wrapped.step()
    if kind != "horovod":
        wrapped.end_epoch()
        assert wrapped.rounds == len(data) and max(wrapped.stats.staleness) == 0
    return flat(list(model.parameters()))


def main() -> int:
    # Horovod fuses whichever gradients are ready in a cycle, so fusion boundaries (and with them
    # the ring's summation order, hence the last bits) vary from run to run. Without fusion every
    # tensor is reduced on its own, and two runs of the same maths agree to the bit.
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    hvd.init(process_sets="dynamic")
    a, b = train("horovod"), train("gssp")
    rel = ((a - b).norm() / a.norm()).item()
    same = hvd.allgather(torch.tensor([rel], dtype=torch.float64), name="rel").tolist()  # no pickle
    if hvd.rank() == 0:
        print(f"gssp(1 group, s=0) vs bsp: relative parameter difference {max(same):.3e}")
    return 0 if max(same) <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())

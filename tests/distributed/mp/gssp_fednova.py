"""horovodrun script (2 ranks): gssp's fixed point when sites take unequal local steps per round.

Two sites, one rank each, each with its own quadratic F_h(w) = ½||w − m_h||² (different minima: the
sites' data differ) and plain SGD of step η. Site 0 takes 3 steps per round, site 1 one, so a round
carries c = (3/4, 1/4) of the samples, and the sample-weighted optimum is w* = Σ_h c_h m_h. The
engine runs synchronous rounds (s = 0) until it has converged; with ``normalize_steps`` (FedNova)
its fixed point must be w* within 1e-3. Without it, the fixed point weights m_h by
c_h (1 − (1 − η)^τ_h), about (0.9, 0.1) here, 0.15 |m_0 − m_1| away from w* (the run prints both).

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/distributed/mp/gssp_fednova.py [--plain]
Prints ``PASS``/``FAIL`` and the distance; exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import torch

from medseg.distributed.comm import wire
from medseg.distributed.comm.channel import Channel
from medseg.distributed.sync.gssp import GroupStale

MINIMA = [torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([-1.0, 0.0, 2.5, -1.0])]
PERIODS = [3, 1]
LR = 5e-4
ROUNDS = 12_000  # contraction about 1 − 2.5 η per round: the start's distance shrinks ~3e6-fold


def main() -> int:
    plain = "--plain" in sys.argv
    wire.register_tree("test")
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    hvd.init()
    assert hvd.size() == 2, "run with -np 2"
    rank = hvd.rank()
    channel = Channel(hvd, 60)
    channel.set_groups([[0], [1]])
    w = torch.nn.Parameter(torch.zeros(4))
    model = torch.nn.Module()
    model.w = w
    engine = GroupStale(
        torch.optim.SGD([w], lr=LR),
        model,
        channel,
        PERIODS[rank],
        0,
        0.0,
        "none",
        4,
        weights=PERIODS,
        steps=PERIODS,
        normalize_steps=not plain,
    )
    for _ in range(ROUNDS * PERIODS[rank]):
        engine.zero_grad()
        (0.5 * (w - MINIMA[rank]).pow(2).sum()).backward()
        engine.step()
    engine.end_epoch()
    c = [p / sum(PERIODS) for p in PERIODS]
    optimum = c[0] * MINIMA[0] + c[1] * MINIMA[1]
    dist = float((w.detach() - optimum).abs().max())
    ok = dist <= 1e-3
    if rank == 0:
        name = "plain mean" if plain else "normalised (FedNova)"
        print(
            f"{'PASS' if ok else 'FAIL'} gssp {name}: fixed point {w.detach().tolist()}, "
            f"sample-weighted optimum {optimum.tolist()}, max |difference| {dist:.2e}",
            flush=True,
        )
    channel.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

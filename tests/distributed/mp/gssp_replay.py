"""horovodrun script (2 ranks): what GSSP/SSP and local SGD compute, checked by a single-process replay.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/distributed/mp/gssp_replay.py

1. GSSP with two groups ([[0], [1]], so also ``ssp``), staleness bound s = 1, rounds of 1 and 2
   steps, rank 1 slowed by sleeps so that rounds really arrive late; with plain float32 rounds,
   4-bit codes and top-k rounds (a tenth of each layer, error feedback). Every engine logs the rounds it submitted and applied (with
   the staleness it used). Rank 0 then replays both groups in one process: the same batches, the
   same optimizer, the rounds applied in the logged order with the logged staleness (each group
   moving to the rounds' sample-weighted mean change, weights 2/3 and 1/3), and the epoch's end:
   parameters set to a_0 + Σ_r S(r), the sum of the rounds' mean changes (with codes, what the
   rounds carried; the residual stays behind), BatchNorm buffers averaged with the weights. The
   replay must land on the engines' parameters and BatchNorm buffers (also with 4-bit codes and
   DiLoCo's outer Nesterov step on the rounds' mean changes, replayed with ``torch.optim.SGD``)
   within 1e-6, some round must have been stale (τ > 0), and no τ may exceed s.
2. Exact consensus, checked against a rule-free reference: staleness bound s = 2, rounds of 3 and
   1 steps, the slow rank slowed far enough that rounds are *forced* (τ = 2). Each engine's own
   submitted changes Δ_g(r) are recorded as they are sent; after the epoch-end average every
   rank's parameters must equal a_0 + Σ_r Σ_g c_g Δ_g(r), computed in one process from those
   changes alone (no schedule, no τ), within 1e-6.
3. Local SGD (period 2) against its replay: independent steps, averages every 2 steps.
4. After each epoch-end average, both ranks hold identical parameters and buffers.
Prints ``PASS <name>`` or ``FAIL <name>: why`` per check; exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys
import time

import horovod.torch as hvd
import torch

from medseg.distributed.comm import wire
from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.round_codecs import round_codec
from medseg.distributed.sync.common import flat, float_buffers
from medseg.distributed.sync.gssp import GroupStale
from medseg.distributed.sync.local_sgd import LocalSGD
from medseg.distributed.sync.outer import OuterNesterov

ROUNDS = 6
PERIODS = [2, 1]  # the fast group 0 runs 2 steps per round, the slow group 1 one step
STEPS = [ROUNDS * p for p in PERIODS]
BOUND = 1
TOPK = 0.1  # topk rounds: a tenth of each layer's entries
WEIGHTS = [p / sum(PERIODS) for p in PERIODS]  # one rank per group: a group's share of a round's samples
LR = 0.05
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov step, in the "fixed+nesterov" run


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1),
        torch.nn.BatchNorm3d(4),
        torch.nn.PReLU(),
        torch.nn.Conv3d(4, 2, 1),
    )


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(2, 1, 6, 6, 6, generator=g), torch.randint(0, 2, (2, 6, 6, 6), generator=g))
        for _ in range(n)
    ]


def state_of(model: torch.nn.Module) -> torch.Tensor:
    return flat([p for p in model.parameters()] + float_buffers(model))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> None:
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


class GroupReplay:
    """One group's model, stepped through its own event log; blocked when a round is not yet known."""

    def __init__(self, g: int, events: list[tuple], n_steps: int, compression: str, outer: bool) -> None:
        self.g, self.events, self.i, self.steps = g, events, 0, 0
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        self.params = list(self.model.parameters())
        self.data = batches(g, n_steps)
        self.anchor = flat(self.params).clone()
        self.consensus = self.anchor.clone()  # a_0 + Σ of the rounds' mean changes applied
        # the outer step, independently: torch's Nesterov SGD on a copy of the consensus
        self.shadow = torch.nn.Parameter(self.consensus.clone())
        self.outer = (
            torch.optim.SGD([self.shadow], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
            if outer
            else None
        )
        self.own: dict[int, torch.Tensor] = {}
        self.sizes = [p.numel() for p in self.params]
        self.coded = round_codec(compression, self.sizes, 4, TOPK)

    def next_event(self) -> tuple | None:
        return self.events[self.i] if self.i < len(self.events) else None

    def advance(self, everyone: list[GroupReplay]) -> bool:
        """Run events until blocked; return whether anything happened."""
        moved = False
        while (ev := self.next_event()) is not None:
            if ev[0] == "submit":
                _, k, steps = ev
                while self.steps < steps:
                    train_step(self.model, self.opt, self.data[self.steps])
                    self.opt.step()
                    self.steps += 1
                w = flat(self.params)
                own = w - self.anchor
                if self.coded is not None:  # what the round carried (its residual waits for the next)
                    _, own = self.coded.encode(own)
                self.own[k] = own
                self.anchor = w.clone()
            elif ev[0] == "apply":
                _, _, r, _tau = ev  # applied in full whatever its staleness
                if any(r not in other.own for other in everyone):
                    return moved
                # every group moves to the sample-weighted mean change of the round
                mean = sum(c * other.own[r] for c, other in zip(WEIGHTS, everyone))
                if self.outer is not None:  # the pseudo-gradient is −mean
                    with torch.no_grad():
                        self.shadow.copy_(self.consensus)
                    self.shadow.grad = -mean
                    self.outer.step()
                    mean = self.shadow.detach() - self.consensus
                self.consensus += mean
                update = mean - self.own[r]
                with torch.no_grad():
                    w = flat(self.params) + update
                    offset = 0
                    for p in self.params:
                        p.copy_(w[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
                self.anchor += update
            elif ev[0] == "average":
                return moved
            self.i += 1
            moved = True
        return moved


def average_all(models: list[torch.nn.Module], weights: list[float] | None = None) -> None:
    """The epoch-end average: the groups' weighted mean (``weights``, one rank per group), else equal."""
    tensors = [list(m.parameters()) + float_buffers(m) for m in models]
    weights = weights or [1 / len(models)] * len(models)
    mean = sum(c * flat(t) for c, t in zip(weights, tensors))
    for ts in tensors:
        offset = 0
        with torch.no_grad():
            for t in ts:
                t.copy_(mean[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def replay_gssp(logs: list[list[tuple]], compression: str, outer: bool) -> torch.Tensor:
    groups = [GroupReplay(g, logs[g], STEPS[g], compression, outer) for g in range(len(logs))]
    for _ in range(10_000):  # bounded: each pass moves some group forward or the logs are inconsistent
        if all(g.next_event() is not None and g.next_event()[0] == "average" for g in groups):
            break
        if not any(g.advance(groups) for g in groups):
            raise AssertionError("replay is stuck: the logs are not a causal schedule")
    buffers = [float_buffers(g.model) for g in groups]
    mean = sum(c * flat(b) for c, b in zip(WEIGHTS, buffers))
    return torch.cat([groups[0].consensus, mean])


def run_gssp(channel: Channel, compression: str, outer: bool) -> tuple[torch.Tensor, list[tuple]]:
    rank = hvd.rank()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = GroupStale(
        opt,
        model,
        channel,
        PERIODS[rank],
        BOUND,
        0.0,
        compression,
        4,
        weights=PERIODS,
        topk_fraction=TOPK,
        outer=OuterNesterov(OUTER_LR, OUTER_MOMENTUM) if outer else None,
    )
    for i, batch in enumerate(batches(rank, STEPS[rank])):
        train_step(model, engine, batch)
        if rank == 1:
            time.sleep(0.05 * (1 + i % 3))  # the slow site: its rounds reach the other group late
        engine.step()
    engine.end_epoch()
    return state_of(model), engine.events


CONSENSUS_PERIODS, CONSENSUS_BOUND, CONSENSUS_ROUNDS = [3, 1], 2, 8


def run_gssp_consensus(channel: Channel) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple]]:
    """gssp with forced rounds; returns the parameters after the epoch average, every change this
    group submitted (as the other group receives it), and the engine's events."""
    rank = hvd.rank()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    period = CONSENSUS_PERIODS[rank]
    engine = GroupStale(
        opt, model, channel, period, CONSENSUS_BOUND, 0.0, "none", 4, weights=CONSENSUS_PERIODS
    )
    sent: list[torch.Tensor] = []
    submit = engine._submit

    def recording_submit() -> None:
        submit()
        sent.append(engine.pending[-1].own.clone())

    engine._submit = recording_submit
    for batch in batches(rank, CONSENSUS_ROUNDS * period):
        train_step(model, engine, batch)
        if rank == 1:
            time.sleep(0.25)  # a round of the slow site takes longer than two of the fast one's
        engine.step()
    engine.end_epoch()
    return flat(list(model.parameters())), sent, engine.events


def consensus_of(sent: list[list[torch.Tensor]]) -> torch.Tensor:
    """a_0 + Σ_r Σ_g c_g Δ_g(r): the model every group must hold after the epoch, from the changes alone."""
    total = sum(CONSENSUS_PERIODS)
    w = flat(list(make_model().parameters())).double()
    for g, changes in enumerate(sent):
        for delta in changes:
            w += CONSENSUS_PERIODS[g] / total * delta.double()
    return w.float()


def run_local_sgd(channel: Channel) -> torch.Tensor:
    rank = hvd.rank()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = LocalSGD(opt, model, channel, period=2)
    for batch in batches(rank, 7):
        train_step(model, engine, batch)
        engine.step()
    engine.end_epoch()
    return state_of(model)


def replay_local_sgd(n: int) -> torch.Tensor:
    models = [make_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    data = [batches(r, 7) for r in range(n)]
    for step in range(7):
        for m, o, d in zip(models, opts, data):
            train_step(m, o, d[step])
            o.step()
        if (step + 1) % 2 == 0:
            average_all(models)
    average_all(models)
    return state_of(models[0])


def main() -> int:
    wire.register_tree("test")  # this harness's own results: tensors, event tuples, counts (no pickle)
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    hvd.init()
    assert hvd.size() == 2, "run with -np 2"
    channel = Channel(hvd, 60)
    channel.set_groups([[0], [1]])
    failures = 0

    def check(name: str, ok: bool, why: str) -> None:
        nonlocal failures
        if hvd.rank() == 0:
            print(f"PASS {name}" if ok else f"FAIL {name}: {why}", flush=True)
        failures += 0 if ok else 1

    for compression, outer in (("none", False), ("fixed", False), ("topk", False), ("fixed", True)):
        mine, events = run_gssp(channel, compression, outer)
        name = compression + ("+nesterov" if outer else "")
        states = channel.gather_tree(mine, "test")
        logs = channel.gather_tree(events, "test")
        check(
            f"gssp-{name} identical parameters and buffers on every rank at the epoch end",
            bool(torch.equal(states[0], states[1])),
            f"max difference {(states[0] - states[1]).abs().max().item():.3e}",
        )
        taus = [ev[3] for log in logs for ev in log if ev[0] == "apply"]
        check(f"gssp-{name} some round applied stale", max(taus, default=0) > 0, f"staleness seen {taus}")
        check(f"gssp-{name} staleness within s={BOUND}", max(taus, default=0) <= BOUND, f"{taus}")
        if hvd.rank() == 0:
            expected = replay_gssp(logs, compression, outer)
            diff = (expected - states[0]).abs().max().item()
            check(
                f"gssp-{name} equals its single-process replay",
                diff <= 1e-6,
                f"max |difference| {diff:.3e}",
            )
            print(f"gssp-{name}: replay max |difference| {diff:.3e}, staleness applied {taus}")

    params, sent, events = run_gssp_consensus(channel)
    states, all_sent = channel.gather_tree(params, "test"), channel.gather_tree(sent, "test")
    logs = channel.gather_tree(events, "test")
    if hvd.rank() == 0:
        taus = [ev[3] for log in logs for ev in log if ev[0] == "apply"]
        check(
            "gssp consensus: some round was forced (τ = 2)",
            max(taus, default=0) >= 2,
            f"staleness seen {taus}",
        )
        expected = consensus_of(all_sent)
        diff = max((s - expected).abs().max().item() for s in states)
        check(
            "gssp consensus: every rank holds a_0 + Σ_r Σ_g c_g Δ_g(r)",
            diff <= 1e-6,
            f"max |difference| {diff:.3e}",
        )
        print(f"gssp consensus: max |difference| {diff:.3e}, staleness applied {taus}")

    mine = run_local_sgd(channel)
    states = channel.gather_tree(mine, "test")
    check("local-sgd identical on every rank", bool(torch.equal(states[0], states[1])), "ranks differ")
    if hvd.rank() == 0:
        diff = (replay_local_sgd(2) - states[0]).abs().max().item()
        check("local-sgd equals its replay", diff <= 1e-6, f"max |difference| {diff:.3e}")
    failures = channel.broadcast_tree(failures, "test")
    channel.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

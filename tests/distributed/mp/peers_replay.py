"""horovodrun script (3 ranks): the peers bsp-hier, fedavg and diloco against independent references.

Run: MEDSEG_JOB_SECRET=... horovodrun -np 3 -H localhost:3 --gloo python tests/distributed/mp/peers_replay.py

Two emulated sites on one machine: site a = ranks 0 and 1 (one sample per rank and step), site b =
rank 2 (three samples per step), so a site's samples, its ranks and a uniform weight all differ.
The model has a float buffer (a running mean of its features, the linear update of BatchNorm's
running_mean) and a GroupNorm (per sample, so site a's two ranks with one sample each compute, on
average, what one model computes on their two samples together).

1. ``bsp-hier`` (BulkSynchronous with hier=True, sites from the hosts a, a, b) lands on plain
   Horovod's parameters and buffers (``hvd.DistributedOptimizer`` and ``hvd.allreduce`` average)
   within 1e-5; its WAN bytes are (S-1)·4n per step on a leader and 0 on rank 1; the audit logged
   its gradients (and epoch-end buffers) as crossing sites.
2. ``diloco`` (H = 3, AdamW inside, 2 epochs of 4 steps, so rounds of 3 and 1 steps) equals a
   one-process replay in plain torch: one model per site on the site's batches together, the
   pseudo-gradients' sample-weighted mean as the gradient of ``torch.optim.SGD(nesterov=True)``.
3. ``fedavg`` (E = 1, SGD inside; site a takes 2 steps per epoch, site b 4) equals a one-process
   replay: each site's epoch, then the state_dicts' sample-weighted mean.
4. A site whose part is 10^4 times too large, or whose sample count is inflated 1000 times, is
   refused on every rank, which names that site's rank (UpdateRefused, raised before the round's
   result is assigned).
Rank 0 prints ``PASS <name>`` or ``FAIL <name>: why``; the exit status is 1 on any failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import horovod.torch as hvd
import torch

from medseg.distributed.comm import audit, wire
from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.checks import UpdateRefused
from medseg.distributed.sync.bsp import BulkSynchronous
from medseg.distributed.sync.peers import DiLoCo, FedAvg

SITES = [[0, 1], [2]]
HOSTS = ["a", "a", "b"]
BATCH = [1, 1, 3]  # samples per step of each rank
H, EPOCHS, DILOCO_STEPS = 3, 2, 4
FEDAVG_STEPS = [2, 2, 4]  # steps per epoch of each rank (site a 2, site b 4)
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.01, 0.7, 0.9
TOL = 1e-5


class Tally(torch.nn.Module):
    """Identity with a running mean of each channel (BatchNorm's running_mean update, momentum 0.1)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * x.mean(dim=(0, 2, 3, 4)))
        return x


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1, bias=False),
        torch.nn.GroupNorm(2, 4),
        Tally(4),
        torch.nn.PReLU(),
        torch.nn.Conv3d(4, 2, 1),
    )


def batches(rank: int, n: int, tag: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * tag + rank)
    b = BATCH[rank]
    return [
        (torch.randn(b, 1, 6, 6, 6, generator=g), torch.randint(0, 2, (b, 6, 6, 6), generator=g))
        for _ in range(n)
    ]


def site_batch(site: list[int], step: int, n: int, tag: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The site's batches of one step together (its ranks' samples, concatenated)."""
    parts = [batches(r, n, tag)[step] for r in site]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def backward(model: torch.nn.Module, opt, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad()
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y).backward()


def state_of(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])


def weighted_state(models: list[torch.nn.Module], weights: list[float]) -> dict[str, torch.Tensor]:
    """The weighted mean of the models' floating state_dict entries, tensor by tensor."""
    states = [m.state_dict() for m in models]
    return {
        k: sum(w * s[k] for w, s in zip(weights, states))
        for k, v in states[0].items()
        if v.is_floating_point()
    }


# -- the engines ------------------------------------------------------------------------------------
def run_bsp(hier: bool, channel: Channel) -> tuple[torch.Tensor, float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if hier:
        engine = BulkSynchronous(opt, model, "none", 4, HOSTS, channel, hier=True)
    else:  # plain Horovod, as a user writes it
        engine = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for batch in batches(hvd.rank(), 4, 1):
        backward(model, engine, batch)
        engine.step()
    if hier:
        engine.end_epoch()
        return state_of(model), float(engine.stats.wan_bytes)
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    mean = hvd.allreduce(torch.cat([b.reshape(-1) for b in buffers]), op=hvd.Average, name="buffers")
    torch.nn.utils.vector_to_parameters(mean, buffers)
    return state_of(model), 0.0


def run_peer(kind: str, channel: Channel, tamper: str = "") -> torch.Tensor:
    rank = hvd.rank()
    model = make_model()
    if kind == "diloco":
        opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
        engine = DiLoCo(opt, model, channel, SITES, H, OUTER_LR, OUTER_MOMENTUM)
        steps = [DILOCO_STEPS] * 3
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine = FedAvg(opt, model, channel, SITES, local_epochs=1)
        steps = FEDAVG_STEPS
    if tamper == "part" and rank == 2:
        engine.part = lambda state, part=engine.part: part(state) * 1e4  # type: ignore[method-assign]
    for epoch in range(EPOCHS):
        for batch in batches(rank, steps[rank] * EPOCHS, 2 if kind == "diloco" else 3)[
            epoch * steps[rank] : (epoch + 1) * steps[rank]
        ]:
            backward(model, engine, batch)
            engine.step()
        if tamper == "samples" and rank == 2:
            engine.samples *= 1000
        engine.end_epoch()
    return state_of(model)


# -- the single-process references -----------------------------------------------------------------
def replay_diloco() -> torch.Tensor:
    """DiLoCo as the paper's Algorithm 1 reads, one model per site, torch's Nesterov SGD outside."""
    glob = make_model()
    outer = torch.optim.SGD(glob.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    sites = [make_model() for _ in SITES]
    inner = [torch.optim.AdamW(m.parameters(), lr=INNER_LR, weight_decay=0.01) for m in sites]
    n_total = DILOCO_STEPS * EPOCHS
    in_round = 0
    for step in range(n_total):
        for site, m, o in zip(SITES, sites, inner):
            backward(m, o, site_batch(site, step, n_total, 2))
            o.step()
        in_round += 1
        if in_round == H or (step + 1) % DILOCO_STEPS == 0:
            samples = [in_round * sum(BATCH[r] for r in site) for site in SITES]
            weights = [n / sum(samples) for n in samples]
            for name, p in glob.named_parameters():
                p.grad = sum(
                    w * (p.detach() - dict(m.named_parameters())[name].detach())
                    for w, m in zip(weights, sites)
                )
            outer.step()
            buffers = weighted_state(sites, weights)
            with torch.no_grad():
                for name, b in glob.named_buffers():
                    b.copy_(buffers[name])
            for m in sites:
                m.load_state_dict(glob.state_dict())
            in_round = 0
    return state_of(glob)


def replay_fedavg() -> torch.Tensor:
    """FedAvg's Algorithm 1 with E = 1: each client's epoch, then the n_k-weighted state average."""
    sites = [make_model() for _ in SITES]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in sites]
    for epoch in range(EPOCHS):
        samples = []
        for site, m, o in zip(SITES, sites, opts):
            steps = FEDAVG_STEPS[site[0]]
            for step in range(epoch * steps, (epoch + 1) * steps):
                backward(m, o, site_batch(site, step, steps * EPOCHS, 3))
                o.step()
            samples.append(steps * sum(BATCH[r] for r in site))
        mean = weighted_state(sites, [n / sum(samples) for n in samples])
        for m in sites:
            m.load_state_dict(mean, strict=False)
    return state_of(sites[0])


def main() -> int:
    wire.register_tree("test")  # this harness's own results: tensors and counts (no pickle)
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    hvd.init()
    assert hvd.size() == 3, "run with -np 3"
    log_ = audit.start(hvd.rank())
    log_.open(Path(tempfile.mkdtemp()) / "audit.jsonl", HOSTS)
    channel = Channel(hvd, 60)
    failures = 0

    def check(name: str, ok: bool, why: str) -> None:
        nonlocal failures
        oks = channel.gather_tree(bool(ok), "test")
        if hvd.rank() == 0:
            print(f"PASS {name}" if all(oks) else f"FAIL {name}: {why} (ranks {oks})", flush=True)
        failures += 0 if all(oks) else 1

    plain, _ = run_bsp(False, channel)
    hier, wan = run_bsp(True, channel)
    diff = (plain - hier).abs().max().item()
    check("bsp-hier equals plain Horovod bsp", diff <= TOL, f"max |difference| {diff:.3e}")
    n_params = sum(p.numel() for p in make_model().parameters())
    expected = 0.0 if hvd.rank() == 1 else 4 * (4 * n_params) + 4 * 4  # 4 steps, then the 4 buffer values
    check("bsp-hier WAN bytes = (S-1)·4n per leader", wan == expected, f"{wan} != {expected}")
    crossed = dict(log_.totals)
    check(
        "bsp-hier audit: gradients cross from leaders only",
        (crossed.get("gradients", 0) > 0) == (hvd.rank() != 1),
        str(crossed),
    )

    for kind, replay, audited in (
        ("diloco", replay_diloco, "model-change"),
        ("fedavg", replay_fedavg, "parameters"),
    ):
        before = dict(log_.totals)
        mine = run_peer(kind, channel)
        states = channel.gather_tree(mine, "test")
        same = max((s - states[0]).abs().max().item() for s in states)
        check(f"{kind}: every rank holds the same model", same == 0.0, f"max difference {same:.3e}")
        grew = log_.totals.get(audited, 0) - before.get(audited, 0)
        check(
            f"{kind}: audit logged its parts as {audited}", (grew > 0) == (hvd.rank() != 1), f"{grew} bytes"
        )
        if hvd.rank() == 0:
            diff = (replay() - states[0]).abs().max().item()
            print(f"{kind}: max |engine - replay| {diff:.3e}", flush=True)
        else:
            diff = 0.0
        check(f"{kind} equals its single-process replay", diff <= TOL, f"max |difference| {diff:.3e}")

    for tamper in ("part", "samples"):
        try:
            run_peer("diloco", channel, tamper)
            refused = ""
        except UpdateRefused as exc:
            refused = exc.source
        check(
            f"diloco refuses site b's tampered {tamper}, on every rank",
            refused == "rank 2",
            refused or "accepted",
        )

    failures = channel.broadcast_tree(failures, "test")
    channel.close()
    audit.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

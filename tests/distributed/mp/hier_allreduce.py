"""Multi-rank checks of HierarchicalCompressedAllreduce; run by tests/distributed/test_collectives.py as

    PATH=.venv/bin:$PATH horovodrun -np N -H localhost:N --gloo python tests/distributed/mp/hier_allreduce.py SITES D

``SITES`` names the ranks of each emulated site, e.g. ``0,1/2,3`` (2 sites x 2 ranks) or ``0,1/2``
(unequal sites), and ``D`` the WAN reduction the run must reach (check 4). All ranks run on one
machine; the sites are groups of ranks, and "WAN" bytes are the bytes a rank sends to ranks of
other sites.

Every rank builds the inputs of every rank (seeded by rank and step), so each rank knows the exact
average over all ranks by itself. Checks, over several calls at 4 bits with the default clip:

1. the results are bit-identical on every rank;
2. small tensors (float32 all the way) equal the exact average within float32 rounding;
3. error feedback: the running sum of the results minus the running sum of the exact averages
   equals ``-(mean_{r in C_j} e1_r + e2)`` shard by shard (the residuals gathered from every rank),
   and after 24 calls its root-mean-square is at most half of what the same codes without
   feedback leave (their errors add up; feedback keeps one residual per stage);
4. bytes: this rank's LAN and WAN bytes equal the formula worked out here from the shapes alone;
   on the benchmark's UNet (137k parameters, 1375 of them in tensors under 1024 elements) the WAN
   bytes of all ranks together are at most 1/D of what float32 ring allreduce over all ranks sends
   across sites (a ring whose sites are contiguous crosses on S edges): about 1 byte per element
   against 12 at 2 x 2 ranks (D = 11), against 10.7 at 2 + 1 ranks (D = 9).
Rank 0 prints one PASS or FAIL line per check; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import math
import sys

import agreed_checks
import horovod.torch as hvd
import torch
from agreed_checks import check  # this folder is on sys.path

# the same layers, gradients and byte helpers as the flat scheme's test
from compressed_allreduce import LARGE, SHAPES, SMALL, chunk_sizes, enc_bytes, inputs

from medseg.distributed.comm.channel import Channel
from medseg.distributed.comm.compression import DEFAULT_CLIP, decode, encode
from medseg.distributed.comm.site_allreduce import HierarchicalCompressedAllreduce

BITS, STEPS = 4, 24


def ring(numel: int, n: int) -> float:
    return 2 * (n - 1) / n * 4 * numel if n > 1 else 0.0


def expected(sites: list[list[int]], rank: int) -> tuple[float, float]:
    """(LAN, WAN) bytes of ``rank`` in one call, from the shapes alone."""
    n_sites, k = len(sites), max(len(s) for s in sites)
    site = next(s for s in sites if rank in s)
    m, local = len(site), site.index(rank)
    large = [math.prod(s) for s in LARGE.values()]
    small = sum(math.prod(s) for s in SMALL.values())
    lan = ring(sum(large) + small, m)
    per_local = [0] * m
    wan = 0.0
    for j in range(k):
        owner = j % m
        per_local[owner] += sum(chunk_sizes(n, k)[j] for n in large) + chunk_sizes(small, k)[j]
        if owner != local:
            continue
        column = sorted(s[j % len(s)] for s in sites)
        me = column.index(rank)
        blocks = [
            sum(enc_bytes(chunk_sizes(chunk_sizes(n, k)[j], n_sites)[c], BITS) for n in large)
            for c in range(n_sites)
        ]
        wan += sum(b for c, b in enumerate(blocks) if c != me)  # alltoall: to every other member
        wan += (n_sites - 1) * max(blocks)  # allgather ring, blocks padded to the largest
        wan += ring(chunk_sizes(small, k)[j], n_sites)  # this shard of the small tensors, float32
    lan += (m - 1) * 4 * max(per_local)  # site allgather ring, padded
    return lan, wan


def main() -> int:
    sites = [[int(r) for r in part.split(",")] for part in sys.argv[1].split("/")]
    reduction = float(sys.argv[2])
    hvd.init()
    torch.set_num_threads(1)
    channel = Channel(hvd, 60)
    rank, n = channel.rank, channel.size
    assert sorted(r for s in sites for r in s) == list(range(n)), (sites, n)

    op = HierarchicalCompressedAllreduce(BITS, sites, rank, channel.make_group, name="hier")
    sum_out = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    sum_exact = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    sum_plain = {k: torch.zeros(s, dtype=torch.float64) for k, s in LARGE.items()}
    same_diff = small_err = 0.0
    for step in range(STEPS):
        everyone = [inputs(r, step) for r in range(n)]
        out = op(everyone[rank])
        for k in SHAPES:
            exact = torch.stack([x[k].double() for x in everyone]).mean(0)
            sum_out[k] += out[k].double()
            sum_exact[k] += exact
            if k in SMALL:
                small_err = max(small_err, float((out[k].double() - exact).abs().max()))
            assert out[k].shape == everyone[rank][k].shape and out[k].dtype == everyone[rank][k].dtype
        for k in LARGE:  # the exact average coded once per step without feedback: errors that add up
            v = torch.stack([x[k] for x in everyone]).mean(0).reshape(-1)
            coded = decode(encode(v, BITS, DEFAULT_CLIP[BITS]), BITS, v.numel()).view(LARGE[k])
            sum_plain[k] += coded.double() - v.view(LARGE[k]).double()
        results = channel.gather_tree({k: out[k] for k in LARGE}, "test")
        for other in results:
            same_diff = max(same_diff, max(float((other[k] - out[k]).abs().max()) for k in LARGE))
    check(channel, "identical on all ranks", same_diff == 0.0, f"max diff {same_diff:.1e}")
    check(channel, "small tensors exact (float32)", small_err <= 1e-5, f"max err {small_err:.1e}")

    # error feedback, shard by shard: sum(out) - sum(exact) = -(mean_{r in C_j} e1_r + e2_j)
    states = channel.gather_tree(op.state_dict(), "test")
    k_shards, n_sites = op.n_shards, op.n_sites
    worst = track = 0.0
    for k, shape in LARGE.items():
        numel = math.prod(shape)
        lhs = (sum_out[k] - sum_exact[k]).reshape(-1)
        rhs = torch.zeros(numel, dtype=torch.float64)
        offset = 0
        for j, size in enumerate(chunk_sizes(numel, k_shards)):
            column = sorted(s[j % len(s)] for s in sites)
            e1 = torch.stack([states[r][f"col{j}"]["stage1"][k].double() for r in column]).mean(0)
            e2 = torch.cat([states[r][f"col{j}"]["stage2"][k].double() for r in column])
            rhs[offset : offset + size] = -(e1 + e2)
            offset += size
        scale = 1 + float(sum_exact[k].abs().max())
        worst = max(worst, float((lhs - rhs).abs().max()) / scale)
        track = max(track, float(lhs.pow(2).mean().sqrt()) / float(sum_plain[k].pow(2).mean().sqrt()))
    check(channel, "error-feedback invariant", worst <= 1e-5, f"max rel diff {worst:.1e}")
    check(
        channel,
        "running sum tracks the exact average",
        track <= 0.5,
        f"rms(sum(out)-sum(exact)) / same without feedback {track:.3f} (worst layer)",
    )

    lan, wan = expected(sites, rank)
    got = (op.last_lan_bytes, op.last_wan_bytes)
    check(channel, "LAN and WAN bytes = formula", got == (lan, wan), f"got {got}, formula {(lan, wan)}")

    # The benchmark's UNet (bench sites): WAN bytes of one call against float32 ring allreduce.
    from monai.networks.nets import UNet

    from medseg.bench.sites_configs import MODEL

    torch.manual_seed(rank)
    unet = UNet(3, 1, 3, MODEL["channels"], MODEL["strides"], num_res_units=MODEL["num_res_units"])
    grads = {name: torch.randn(p.shape) for name, p in unet.named_parameters()}
    model_op = HierarchicalCompressedAllreduce(
        BITS, sites, rank, channel.make_group, min_numel=1024, name="unet"
    )
    model_op(grads)
    total_wan = sum(channel.gather_tree(model_op.last_wan_bytes, "test"))
    numel = sum(t.numel() for t in grads.values())
    fp32_wan = n_sites * ring(numel, n)  # contiguous sites: S edges of the ring cross
    check(
        channel,
        f"UNet: WAN bytes <= 1/{reduction:g} of float32 ring allreduce",
        total_wan <= fp32_wan / reduction,
        f"{total_wan:.0f} B over all ranks, fp32 ring {fp32_wan:.0f} B across sites ({total_wan / fp32_wan:.4f}x)",
    )
    channel.close()
    hvd.shutdown()
    return 1 if agreed_checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())

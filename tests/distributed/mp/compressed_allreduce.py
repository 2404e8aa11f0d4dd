"""Multi-rank checks of CompressedAllreduce; run by tests/distributed/test_collectives.py as

    PATH=.venv/bin:$PATH horovodrun -np N -H localhost:N --gloo python tests/distributed/mp/compressed_allreduce.py

Every rank builds the inputs of every rank (seeded by rank and step), so each rank can work out the
exact averages, the error bounds and a single-process simulation of the whole scheme by itself.
Rank 0 prints one PASS or FAIL line per check; the exit status is 1 when any check failed on any rank.
"""

from __future__ import annotations

import math
import os
import sys
import time

import horovod.torch as hvd
import torch

from medseg.distributed.comm.collectives import CompressedAllreduce
from medseg.distributed.comm.compression import DEFAULT_CLIP, ErrorFeedback
from medseg.errors import ConfigError

# numel of each large layer is not divisible by 2, 3 or 4; the small ones stay under min_numel = 4096.
LARGE = {"conv1.weight": (5003,), "conv2.weight": (7, 11, 13, 9), "fc.weight": (8191,), "head": (3, 4099)}
SMALL = {"conv1.bias": (10,), "norm.weight": (3, 3, 3, 3), "emb": (4095,)}
SHAPES = {**LARGE, **SMALL}
BITS = (2, 4, 8)

failures = 0
checks_run = 0


def check(name: str, ok: bool, detail: str = "") -> None:
    """Agree on ``ok`` over all ranks (so every rank stays in step) and report it from rank 0."""
    global failures, checks_run
    checks_run += 1
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    bad = hvd.allreduce(flag, op=hvd.Sum, name=f"check.{checks_run}")
    if not ok:
        print(f"rank {hvd.rank()}: {name}: {detail}", file=sys.stderr, flush=True)
    if int(bad) > 0:
        failures += 1
    if hvd.rank() == 0:
        print(f"{'PASS' if int(bad) == 0 else 'FAIL'} {name} (N={hvd.size()}) {detail}", flush=True)


def inputs(rank: int, step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Deterministic gradients of ``rank`` at ``step``; heavier tails on odd ranks."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = {}
    for k, shape in SHAPES.items():
        x = torch.randn(shape, generator=g) * scale * (1 + rank)
        if rank % 2:
            x = x * torch.rand(shape, generator=g).add(0.05).reciprocal().sqrt()
        out[k] = x + 0.1 * step
    return out


def chunk_sizes(numel: int, n: int) -> list[int]:
    q, r = divmod(numel, n)
    return [q + (1 if j < r else 0) for j in range(n)]


def enc_bytes(numel: int, bits: int) -> int:
    return 4 + math.ceil(numel * bits / 8)


def expected_bytes(bits: int, n: int, i: int) -> float:
    """The byte accounting of the module docstring, worked out here from the shapes alone."""
    if n == 1:
        return 0.0
    blocks = [0] * n
    for shape in LARGE.values():
        for j, c in enumerate(chunk_sizes(math.prod(shape), n)):
            blocks[j] += enc_bytes(c, bits)
    alltoall = sum(blocks) - blocks[i]
    allgather = sum(blocks) - blocks[(i + 1) % n]  # ring: all blocks but the successor's
    small = sum(math.prod(s) for s in SMALL.values())
    return alltoall + allgather + 2 * (n - 1) / n * 4 * small


def exact_average(x: dict[str, torch.Tensor], ps, tag: str) -> dict[str, torch.Tensor]:
    return {
        k: hvd.allreduce(t, op=hvd.Average, name=f"exact.{tag}.{k}", process_set=ps) for k, t in x.items()
    }


def first_call_bound(bits: int, members: list[int], key: str) -> torch.Tensor:
    """Per-element bound of |result - exact| for a first call (zero residuals) without clipping.

    Stage 1: rank r's chunk j is off by at most s1_rj / (2m), s1_rj = max|chunk j of x_r|, so the
    average a_j is off by b1_j = mean_r s1_rj / (2m). Stage 2 codes a_j with s2_j = max|a_j| <=
    max|exact_j| + b1_j, off by at most s2_j / (2m). Bound: b1_j + (max|exact_j| + b1_j) / (2m).
    """
    m = 2 ** (bits - 1) - 1
    n = len(members)
    xs = [inputs(r, 0)[key].reshape(-1).double() for r in members]
    exact = torch.stack(xs).mean(0)
    sizes = chunk_sizes(exact.numel(), n)
    parts = []
    for j, c in enumerate(sizes):
        chunks = [x.split(sizes)[j] for x in xs]
        b1 = sum(float(ch.abs().max()) for ch in chunks) / n / (2 * m)
        b = b1 + (float(exact.split(sizes)[j].abs().max()) + b1) / (2 * m)
        parts.append(torch.full((c,), b * (1 + 1e-5) + 1e-6, dtype=torch.float64))
    return torch.cat(parts).view(SHAPES[key])


def check_bound(bits: int, ps, members: list[int], tag: str) -> None:
    """One call with clip=None against hvd.allreduce(Average): within the two-stage bound."""
    me = members.index(hvd.rank())
    op = CompressedAllreduce(bits, process_set=ps, clip=None, name=f"bound.{tag}.{bits}")
    x = inputs(hvd.rank(), 0)
    out = op(x)
    exact = exact_average(x, ps, f"bound.{tag}.{bits}")
    worst = 0.0
    ok = all(out[k].shape == x[k].shape and out[k].dtype == x[k].dtype for k in x)
    for k in LARGE:
        err = (out[k].double() - exact[k].double()).abs()
        ratio = float((err / first_call_bound(bits, members, k)).max())
        worst = max(worst, ratio)
    small_err = max(float((out[k] - exact[k]).abs().max()) for k in SMALL)
    ok = ok and worst <= 1.0 and small_err <= 1e-5
    check(f"bound bits={bits} {tag}", ok, f"max err/bound {worst:.3f}, small-tensor err {small_err:.1e}")

    want = expected_bytes(bits, len(members), me)
    got = op.last_bytes_sent
    check(f"bytes bits={bits} {tag}", abs(got - want) < 1e-6, f"{got:.1f} sent, formula {want:.1f}")

    # N-independent ceiling: twice the payload of the whole model at `bits` plus 10 header bytes per chunk.
    large_numel = sum(math.prod(s) for s in LARGE.values())
    small_numel = sum(math.prod(s) for s in SMALL.values())
    n = len(members)
    ceiling = 2 * large_numel * bits / 8 + 10 * n * len(LARGE) + 8 * small_numel
    fp32 = CompressedAllreduce.ring_allreduce_bytes(large_numel + small_numel, 4, n)
    check(
        f"bytes ceiling bits={bits} {tag}",
        got <= ceiling,
        f"{got:.0f} <= {ceiling:.0f}; fp32 ring allreduce {fp32:.0f} ({got / fp32:.3f} of it)",
    )


def simulate(bits: int, n: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """The whole scheme in one process: N stage-1 and N stage-2 error-feedback states."""
    clip = DEFAULT_CLIP[bits]
    ef1 = [ErrorFeedback(bits, clip) for _ in range(n)]
    ef2 = [ErrorFeedback(bits, clip) for _ in range(n)]
    results = []
    for step in range(steps):
        xs = [inputs(r, step) for r in range(n)]
        out = {}
        for k, shape in LARGE.items():
            sizes = chunk_sizes(math.prod(shape), n)
            dec = [ef1[r].compress_chunks(k, xs[r][k], sizes)[1].split(sizes) for r in range(n)]
            chunks = []
            for j in range(n):
                acc = torch.zeros(sizes[j])
                for r in range(n):
                    acc += dec[r][j]
                chunks.append(ef2[j].compress(k, acc / n)[1])
            out[k] = torch.cat(chunks).view(shape)
        results.append(out)
    return results


def check_default_clip_steps(bits: int, steps: int = 3) -> None:
    """Default clip, several calls: matches the simulation, identical on all ranks, and the
    running sums obey sum(out) - sum(exact) = -(mean_r e1_r + e2)."""
    n = hvd.size()
    op = CompressedAllreduce(bits, name=f"steps.{bits}")
    sim = simulate(bits, n, steps)
    sum_out = {k: torch.zeros(s, dtype=torch.float64) for k, s in LARGE.items()}
    sum_exact = {k: torch.zeros(s, dtype=torch.float64) for k, s in LARGE.items()}
    sim_diff = same_diff = 0.0
    for step in range(steps):
        x = inputs(hvd.rank(), step)
        out = op(x)
        exact = exact_average(x, hvd.global_process_set, f"steps.{bits}.{step}")
        for k in LARGE:
            sim_diff = max(sim_diff, float((out[k] - sim[step][k]).abs().max()))
            root = hvd.broadcast(out[k], root_rank=0, name=f"same.{bits}.{step}.{k}")
            same_diff = max(same_diff, float((out[k] - root).abs().max()))
            sum_out[k] += out[k].double()
            sum_exact[k] += exact[k].double()
    check(f"matches simulation bits={bits}", sim_diff <= 1e-6, f"max diff {sim_diff:.1e}")
    check(f"identical on all ranks bits={bits}", same_diff == 0.0, f"max diff {same_diff:.1e}")

    worst = 0.0
    for k in LARGE:
        e1 = hvd.allreduce(op.stage1.residual(k), op=hvd.Average, name=f"e1.{bits}.{k}")
        e2 = hvd.allgather(op.stage2.residual(k), name=f"e2.{bits}.{k}").view(LARGE[k])
        lhs = sum_out[k] - sum_exact[k]
        rhs = -(e1.double() + e2.double())
        worst = max(worst, float((lhs - rhs).abs().max() / (1 + sum_exact[k].abs().max())))
    check(f"error-feedback invariant bits={bits}", worst <= 1e-5, f"max rel diff {worst:.1e}")


def check_large_model_ratio(bits: int = 4) -> None:
    """Bytes per worker against plain fp32 ring allreduce on a ~1M-element model."""
    n = hvd.size()
    shapes = [
        (64, 32, 3, 3, 3),
        (64, 64, 3, 3, 3),
        (128, 64, 3, 3, 3),
        (64, 128, 3, 3, 3),
        (128, 64, 3, 3, 3),
    ]
    shapes += [(128, 64, 3, 3, 3), (2, 64, 1, 1, 1)]
    g = torch.Generator().manual_seed(hvd.rank())
    x = {f"layer{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    op = CompressedAllreduce(bits, name=f"model.{bits}")
    op(x)  # warm up
    t0 = time.perf_counter()
    op(x)
    seconds = time.perf_counter() - t0
    numel = sum(t.numel() for t in x.values())
    fp32 = CompressedAllreduce.ring_allreduce_bytes(numel, 4, n)
    fp16 = CompressedAllreduce.ring_allreduce_bytes(numel, 2, n)
    ratio = op.last_bytes_sent / fp32
    check(
        f"1M-model bytes bits={bits}",
        ratio <= bits / 32 * 1.02,
        f"numel {numel}: {op.last_bytes_sent:.0f} B/worker, fp32 ring {fp32:.0f} (ratio {ratio:.4f}), "
        f"fp16 ring {fp16:.0f} (ratio {op.last_bytes_sent / fp16:.4f}); one call {seconds * 1e3:.0f} ms",
    )


def main() -> int:
    n = int(os.environ["HOROVOD_SIZE"])  # set by horovodrun; process sets must be known at init
    singletons = [hvd.ProcessSet([r]) for r in range(n)]
    pairs = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])] if n == 4 else []
    hvd.init(process_sets=[*singletons, *pairs])
    assert hvd.size() == n, (hvd.size(), n)
    rank = hvd.rank()
    torch.set_num_threads(1)

    for bits in BITS:
        check_bound(bits, hvd.global_process_set, list(range(n)), "global")
    for bits in BITS:
        check_default_clip_steps(bits)
    check_large_model_ratio(4)

    # A set of one worker: inputs back unchanged, nothing sent.
    op = CompressedAllreduce(4, process_set=singletons[rank], name="single")
    x = inputs(rank, 0)
    out = op(x)
    check("single-worker set passes through", all(out[k] is x[k] for k in x) and op.last_bytes_sent == 0.0)

    # A set this worker is not in: a ConfigError before any communication.
    other = CompressedAllreduce(4, process_set=singletons[(rank + 1) % n], name="other")
    try:
        other(x)
        raised = ""
    except ConfigError as exc:
        raised = str(exc)
    check("non-member raises ConfigError", "not in process set" in raised, raised)

    if pairs:
        pair = pairs[rank // 2]
        for bits in BITS:
            check_bound(bits, pair, pair.ranks, f"pair{rank // 2}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

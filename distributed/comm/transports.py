"""The collectives :class:`~medseg.distributed.comm.collectives.CompressedAllreduce` runs on: a
channel group's (:class:`TorchTransport`) or a Horovod process set's (:class:`HorovodTransport`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from medseg.distributed.comm.channel import Group


class TorchTransport:
    """The three collectives :class:`~medseg.distributed.comm.collectives.CompressedAllreduce` needs, on a
    channel :class:`Group`. Its allgather pads every block to the largest (Gloo's allgather takes
    equal blocks), so a member sends ``(n - 1) * max(block)`` bytes in the ring."""

    pads_allgather = True

    def __init__(self, group: Group) -> None:
        self.group = group

    def describe(self, j: int) -> str:
        return self.group.describe(j)

    def size(self) -> int:
        return self.group.size

    def index(self) -> int:
        return self.group.index

    def allreduce_mean(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        out = flat.clone()
        self.group.allreduce_(out, kind="gradients")
        return out / self.group.size

    def alltoall(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str):
        recv = torch.empty(sum(recv_splits), dtype=send.dtype)
        self.group.alltoall(recv, send, recv_splits, send_splits)
        return recv

    def allgather(self, mine: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        """Concatenate every member's block (``sizes[j]`` bytes from member ``j``): padded to the largest."""
        top = max(sizes)
        padded = torch.zeros(top, dtype=mine.dtype)
        padded[: mine.numel()] = mine
        outs = [torch.empty(top, dtype=mine.dtype) for _ in sizes]
        self.group.allgather(outs, padded, kind="gradients")
        return torch.cat([o[:s] for o, s in zip(outs, sizes)])


class HorovodTransport:
    """The same three collectives on a Horovod process set (bsp's compressed allreduce)."""

    def __init__(self, hvd: Any, process_set: Any) -> None:
        self.hvd, self.ps = hvd, process_set

    def describe(self, j: int) -> str:
        ranks = getattr(self.ps, "ranks", None)
        return f"rank {ranks[j]}" if ranks else f"rank {j}"

    def size(self) -> int:
        return int(self.ps.size())

    def index(self) -> int:
        return int(self.ps.rank())

    def allreduce_mean(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce(flat, op=self.hvd.Average, name=name, process_set=self.ps)

    def alltoall(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], name: str):
        splits = torch.tensor(send_splits, dtype=torch.int32)
        recv, got = self.hvd.alltoall(send, splits=splits, name=name, process_set=self.ps)
        return recv

    def allgather(self, mine: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        return self.hvd.allgather(mine, name=name, process_set=self.ps)

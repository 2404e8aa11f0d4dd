"""The multi-rank harnesses' verdicts: each check agreed over all ranks and reported once, by rank 0.

Shared by the scripts of this folder (it is on their ``sys.path``). Results travel as the ``test``
tree message (tensors plus JSON, no pickle); :data:`failures` counts the checks that failed on any
rank, for the script's exit status.
"""

from __future__ import annotations

import sys

from medseg.distributed.comm import wire
from medseg.distributed.comm.channel import Channel

wire.register_tree("test")
failures = 0


def check(channel: Channel, name: str, ok: bool, detail: str = "") -> None:
    """Agree on ``ok`` over all ranks and report it from rank 0."""
    global failures
    everyone = channel.gather_tree(bool(ok), "test")
    if not ok:
        print(f"rank {channel.rank}: {name}: {detail}", file=sys.stderr, flush=True)
    if not all(everyone):
        failures += 1
    if channel.rank == 0:
        print(f"{'PASS' if all(everyone) else 'FAIL'} {name} (N={channel.size}) {detail}", flush=True)

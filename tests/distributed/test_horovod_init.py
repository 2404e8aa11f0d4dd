"""Which ranks wait for ``hvd.init()``: the syncs that call Horovod while they train wait before
training; the others go on once medseg's channel is up and wait only when the job ends. No Horovod
is needed: a stand-in whose init the test releases plays a rendezvous across slow links."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from medseg.distributed import channel_startup
from medseg.distributed.background import InBackground
from medseg.errors import RunError


class _SlowInit:
    """A Horovod whose init waits until the test releases it (a rendezvous across slow links)."""

    def __init__(self) -> None:
        self.release, self.ended = threading.Event(), False

    def init(self) -> None:
        self.release.wait(30)  # bounded: a start-up that waited for it fails below, not hangs
        self.ended = True

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("sync", ["gssp", "fedavg", "bsp-hier", "bsp"])
def test_only_the_syncs_that_call_horovod_wait_for_its_init(sync, monkeypatch) -> None:
    built = (SimpleNamespace(rank=1, size=2), ["a", "b"], {"channel_world": 1.0})
    monkeypatch.setattr(channel_startup, "start_beside_horovod", lambda *a: InBackground(lambda: built))
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # as MONAI's import of ignite leaves it
    hvd, startup = _SlowInit(), {}
    if sync in channel_startup.HOROVOD_SYNCS:
        hvd.release.set()
    started, pending = channel_startup.start_rank(hvd, sync, 30.0, b"k", startup)
    assert started == built and os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] == "0"
    if sync in ("bsp", "bsp-hier"):  # their collectives need Horovod: it has ended before training
        assert pending.pending is None and hvd.ended and {"horovod_init", "channel_wait"} <= set(startup)
        return
    assert pending.pending is not None and not hvd.ended  # training goes on while the init runs
    assert not pending.ended(0.05)
    hvd.release.set()
    assert pending.ended(30) and hvd.ended and "horovod_init" in startup
    # the channel's place and Horovod's must agree once the init has ended
    late = channel_startup.HorovodInit(hvd, InBackground(lambda: None), 0, 2)
    with pytest.raises(RunError, match="say rank 0 of 2, Horovod says 1 of 2"):
        late.ended(30)


@pytest.mark.parametrize("init", ["fails", "never ends", "ends"])
def test_close_shuts_horovod_down_only_after_an_init_that_ended(init, monkeypatch) -> None:
    from medseg.distributed import session as session_mod

    calls: list[str] = []
    s = session_mod.HorovodSession.__new__(session_mod.HorovodSession)
    s.beats = SimpleNamespace(set_phase=calls.append, close=lambda: calls.append("beats closed"))
    s.channel = SimpleNamespace(close=lambda: calls.append("channel closed"))
    s.hvd = SimpleNamespace(shutdown=lambda: calls.append("shutdown"), rank=lambda: 0, size=lambda: 2)
    s.dist, s.rank = SimpleNamespace(timeout_s=0.2), 0
    release = threading.Event()

    def run() -> None:
        if init == "fails":
            raise RuntimeError("Gloo: timed out connecting to a peer")
        if init == "never ends":
            release.wait(30)

    s._horovod = channel_startup.HorovodInit(s.hvd, InBackground(run), 0, 2)
    monkeypatch.setattr(session_mod.audit, "stop", lambda: calls.append("audit stopped"))
    s.close()  # a run that trained on the channel alone stands whatever its Horovod did
    release.set()
    assert calls[:3] == ["done", "beats closed", "channel closed"] and calls[-1] == "audit stopped"
    assert ("shutdown" in calls) == (init == "ends")

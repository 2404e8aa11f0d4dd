"""Heartbeats over the network, from every rank to the launcher.

Servers in different hospitals share no file system, so ranks do not write their progress to files
the launcher reads: each rank opens one TCP connection to the launcher's :class:`BeatServer`
(address in ``MEDSEG_BEAT_ADDR``, ``host:port``) and sends JSON lines:

- a *liveness* beat every ``BEAT_INTERVAL_S`` from a helper process that watches the rank
  (:mod:`medseg.distributed.launch.beat_sidecar`: a rank blocked inside Horovod can hold the GIL, so a
  thread of the rank cannot be relied on to beat), and one from a background thread naming the
  phase the rank is in (``start``, ``read``, ``load``, ``profile``, ``train``, ``validate``, ``wait``,
  ``save``), so a 10-minute data load or validation pass is visibly alive;
- a *progress* record after every training step (epoch, step, time, bytes, staleness, timings) and
  an *event* record at each GSSP round (submitted, started), which the launcher appends to
  ``<run>/ranks/rank-R.jsonl`` for benchmarks and post-mortems.

The launcher's watchdog (:func:`Watchdog.verdict`) stops the job and names a rank when

1. the rank has sent nothing for ``timeout_s`` (a dead, frozen or cut-off process: its beat thread
   stopped too), or never reported within the start-up grace period; or
2. every rank is alive (heard from within ``SILENT_AFTER_S``) and either training or waiting for the others (phases ``train`` and
   ``wait``), but none has completed a step or changed phase for ``timeout_s`` (a collective that
   will never complete); the rank whose last progress is the oldest is named, as the others are
   waiting for it.

A rank that is loading, profiling, validating or saving is never "hung" by rule 2: those phases
can take long, and while one rank is in them the others legitimately wait. They are bounded all
the same (3. a rank in one such phase for ``long_phase_s`` = max(1800 s, 10 x ``timeout_s``) is
named), so a deadlock there ends the job instead of holding the machines forever.

Authenticated lines. Every line carries an HMAC-SHA256 made with the job secret
(:mod:`medseg.distributed.comm.auth`; the format is in :mod:`.beat_sidecar`), a sender id and a
sequence number. :class:`BeatServer` drops, and logs (at most once every few seconds, with a count),
every line that is longer than ``MAX_LINE`` bytes, lacks a valid MAC, is not a JSON object with an
integer ``rank``, or repeats a sequence number its sender already used: a forged or replayed
``done`` phase or ``error`` changes nothing. It listens on the one address the job's ranks use to
reach the launcher (loopback for a one-host job), not on every interface.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medseg.distributed.comm import audit, auth
from medseg.distributed.launch.beat_sidecar import MAX_LINE, Sender, opened_line

log = logging.getLogger(__name__)
BEAT_ADDR_ENV = "MEDSEG_BEAT_ADDR"
BEAT_INTERVAL_S = 2.0
START_GRACE_S = 180.0
SILENT_AFTER_S = 3 * BEAT_INTERVAL_S  # a live rank's beat thread is never quiet this long
MAX_MESSAGE = 16 * 1024  # characters of an error message a rank reports (the line limit is MAX_LINE)
MAX_SENDERS = 64  # sender ids remembered per rank (a rank, its helper, their reconnects)
DROP_LOG_S = 5.0  # dropped lines are logged at most this often (with how many since)


@dataclass
class RankState:
    host: str = ""
    node: str = ""
    phase: str = "start"
    first_seen: float = 0.0
    last_seen: float = 0.0
    phase_since: float = 0.0
    last_step: float = 0.0  # time of the last completed step (0: none yet)
    error: str = ""  # a MedsegError the rank reported before it stopped (its message is for the user)
    refused_rank: int | None = None  # the rank whose update this rank refused (comm.checks.UpdateRefused)


class LineSplitter:
    """Cuts a byte stream into lines (without their newline) of at most ``limit`` bytes, newline
    included. An over-long line comes out once as None and the rest of it is skipped, without ever
    buffering more than ``limit`` bytes of it."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit, self.buf, self.skipping = limit, b"", False

    def feed(self, chunk: bytes) -> list[bytes | None]:
        out: list[bytes | None] = []
        *lines, rest = (self.buf + chunk).split(b"\n")
        for line in lines:
            if self.skipping:
                self.skipping = False  # the end of a line already reported as too long
            elif len(line) + 1 > self.limit:
                out.append(None)
            else:
                out.append(line)
        if len(rest) + 1 > self.limit:
            if not self.skipping:
                out.append(None)
            rest, self.skipping = b"", True
        self.buf = rest
        return out


@dataclass
class BeatServer:
    """Accepts the ranks' connections and keeps each rank's state; appends records to ``ranks_dir``.

    ``bind`` is the address the ranks reach the launcher on; ``secret`` the job secret their lines
    are signed with (a fresh one when not given: pass ``server.secret`` to the ranks).
    """

    ranks_dir: Path
    bind: str = "127.0.0.1"
    secret: bytes = field(default_factory=auth.new_secret, repr=False)
    states: dict[int, RankState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[int, Any] = {}
        self._seen: dict[int, dict[str, int]] = {}  # rank -> sender id -> last sequence number
        self.dropped = 0
        self._drop_note: tuple[float, int] = (0.0, 0)  # (time of the last log line, drops since)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.bind, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="medseg-beats", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        lines = LineSplitter()
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                for line in lines.feed(chunk):
                    if line is None:
                        self._drop(f"a line of more than {MAX_LINE} bytes")
                    else:
                        self._record(line)

    def _drop(self, why: str) -> None:
        """Count a refused line; log it, at most once every ``DROP_LOG_S`` (with the count since)."""
        now = time.time()
        with self._lock:
            self.dropped += 1
            last, since = self._drop_note
            since += 1
            if now - last < DROP_LOG_S:
                self._drop_note = (last, since)
                return
            self._drop_note = (now, 0)
        log.warning("heartbeat endpoint: dropped %s (%d line(s) dropped since the last note)", why, since)

    def _record(self, line: bytes) -> None:
        body = opened_line(self.secret, line)
        if body is None:
            self._drop("a line without a valid job-secret MAC (forged, or from another job)")
            return
        try:
            rec = json.loads(body)
            rank = int(rec["rank"])
            sid, seq = str(rec["sid"])[:32], int(rec["seq"])
        except (ValueError, KeyError, TypeError, AttributeError):
            self._drop("a signed line that is not a heartbeat record")
            return
        if not isinstance(rec, dict) or not 0 <= rank < 1 << 20:
            self._drop("a signed line that is not a heartbeat record")
            return
        now = time.time()
        with self._lock:
            senders = self._seen.setdefault(rank, {})
            if seq <= senders.get(sid, 0) or (sid not in senders and len(senders) >= MAX_SENDERS):
                replayed = True
            else:
                replayed = False
                senders[sid] = seq
        if replayed:
            self._drop(f"a replayed or surplus line of rank {rank}")
            return
        with self._lock:
            st = self.states.get(rank)
            if st is None:
                st = self.states[rank] = RankState(first_seen=now, phase_since=now)
            st.last_seen = now
            st.host = rec.get("host", st.host)
            st.node = rec.get("node", st.node)
            phase = rec.get("phase")
            if phase and phase != st.phase:
                st.phase, st.phase_since = phase, now
            if "step" in rec:
                st.last_step = now
            if rec.get("ev") == "error":
                st.error = str(rec.get("message", ""))
                refused = rec.get("refused_rank")
                st.refused_rank = (
                    refused if isinstance(refused, int) and not isinstance(refused, bool) else None
                )
            if rec.get("ev") != "alive":
                f = self._files.get(rank)
                if f is None:
                    f = self._files[rank] = open(self.ranks_dir / f"rank-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
                f.write(body.decode(errors="replace") + "\n")

    def snapshot(self) -> dict[int, RankState]:
        with self._lock:
            return {r: RankState(**vars(s)) for r, s in self.states.items()}

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def describe(rank: int, st: RankState | None) -> str:
    """``rank 2 (host 198.18.2.1, site-b)``: the rank and where it runs, as the ranks reported it."""
    if st is None or not st.host:
        return f"rank {rank}"
    where = st.host if st.node in ("", st.host) else f"{st.host}, {st.node}"
    return f"rank {rank} (host {where})"


@dataclass
class Watchdog:
    """Decides from the beat server's states whether the job has lost a rank; see the module docstring."""

    np_: int
    timeout_s: float
    started: float = field(default_factory=time.time)
    culprit: int | None = None  # the rank the last verdict named

    @property
    def long_phase_s(self) -> float:
        return max(1800.0, 10 * self.timeout_s)

    def verdict(self, states: dict[int, RankState], now: float | None = None) -> str | None:
        """What is wrong (None: nothing); the rank it names is left in :attr:`culprit`."""
        found = self._verdict(states, now)
        if found is not None:
            self.culprit = found[0]
            return found[1]
        return None

    def _verdict(self, states: dict[int, RankState], now: float | None) -> tuple[int, str] | None:
        now = time.time() if now is None else now
        grace = max(self.timeout_s, START_GRACE_S)
        for r in range(self.np_):
            st = states.get(r)
            if st is not None and st.phase == "done":
                continue  # finished its part (e.g. while rank 0 still validates and exports)
            if st is None:
                if now - self.started > grace:
                    return r, f"{describe(r, None)} never reported (for {now - self.started:.0f} s)"
                continue
            # a rank still starting (Horovod's rendezvous, the channel's, loading its cases) may be
            # slow to beat on a loaded host: it gets the start-up grace, not the timeout
            limit = grace if st.phase == "start" else self.timeout_s
            if now - st.last_seen > limit:
                return r, (
                    f"{describe(r, st)} stopped responding (nothing heard for {now - st.last_seen:.0f} s, "
                    f"last in phase {st.phase!r})"
                )
        for r, st in states.items():
            if st.phase not in ("train", "wait", "start") and now - st.phase_since > self.long_phase_s:
                return r, (
                    f"{describe(r, st)} has been in phase {st.phase!r} for {now - st.phase_since:.0f} s "
                    f"(limit {self.long_phase_s:.0f} s)"
                )
        alive = all(now - s.last_seen <= SILENT_AFTER_S for s in states.values())
        if alive and len(states) == self.np_ and all(s.phase in ("train", "wait") for s in states.values()):
            # (a rank that is done is neither: the others are then finishing too, not stuck). A rank
            # that has gone quiet is left to rule 1: the rank waiting for it may have finished the
            # last step a moment earlier and would otherwise be named in its place.
            progress = {r: max(s.last_step, s.phase_since) for r, s in states.items()}
            if now - max(progress.values()) > self.timeout_s:
                culprit = min(progress, key=lambda r: progress[r])
                return culprit, (
                    f"{describe(culprit, states[culprit])} stopped making progress (no rank completed a step for "
                    f"{now - max(progress.values()):.0f} s; it is the one the others wait for)"
                )
        return None


class BeatClient:
    """A rank's side: one connection to the launcher, a liveness thread, ``send`` for records.

    Lines are signed with the job secret (``secret``, default ``MEDSEG_JOB_SECRET``; required when
    there is a launcher to report to).
    """

    def __init__(self, rank: int, addr: str | None = None, secret: bytes | None = None) -> None:
        self.rank = rank
        self.host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        self.node = socket.gethostname()
        self.phase = "start"
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        addr = addr if addr is not None else os.environ.get(BEAT_ADDR_ENV)
        self.addr = None
        self.sidecar_beat = b""  # what the helper process sends, for the audit of what leaves a site
        if addr:
            host, _, port = addr.rpartition(":")
            self.addr = (host, int(port))
            self._secret = secret if secret is not None else auth.job_secret()
            assert self._secret is not None
            self._sender = Sender(self._secret)
            self._connect()
            self._thread = threading.Thread(target=self._beat, name="medseg-beat", daemon=True)
            self._thread.start()
            self._sidecar = self._start_sidecar()

    def _connect(self, budget_s: float = 30.0) -> None:
        deadline = time.time() + budget_s
        while self._sock is None and time.time() < deadline and not self._stop.is_set():  # bounded
            try:
                sock = socket.create_connection(self.addr, timeout=10.0)
            except OSError:
                time.sleep(0.5)
                continue
            # unacknowledged beats for this long (a cut link) make the next send fail, so a rank cut
            # off from its launcher stops instead of waiting out TCP's ~15-minute retransmissions
            user_timeout_ms = int(float(os.environ.get("MEDSEG_BEAT_TIMEOUT_S", "60")) * 1000)
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
            self._sock = sock
        if self._sock is None:
            log.warning("rank %d: cannot reach the launcher's heartbeat endpoint %s", self.rank, self.addr)

    def _start_sidecar(self) -> subprocess.Popen | None:
        """The helper process that beats for this rank while it is not stopped (see its module)."""
        from medseg.distributed.launch import beat_sidecar

        assert self.addr is not None
        user_timeout_ms = int(float(os.environ.get("MEDSEG_BEAT_TIMEOUT_S", "60")) * 1000)
        args = [self.addr[0], self.addr[1], self.rank, os.getpid(), self.host, self.node, BEAT_INTERVAL_S]
        self.sidecar_beat = Sender(self._secret).line(
            beat_sidecar.beat_record(self.rank, self.host, self.node)
        )
        try:
            return subprocess.Popen(
                [sys.executable, "-I", "-S", beat_sidecar.__file__, *map(str, args), str(user_timeout_ms)],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env={
                    **os.environ,
                    **auth.secret_env(self._secret),
                },  # never in argv, which /proc shows to all
            )
        except OSError as exc:  # the thread's beats remain
            log.warning("rank %d: no heartbeat helper process (%s)", self.rank, exc)
            return None

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL_S):
            self.send({"ev": "alive"})

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.send({"ev": "alive"})

    def _lost(self) -> None:
        """The launcher is gone (stopped the job, died, or this site is cut off): stop this rank.

        Ranks started over ssh are not ended when the launcher kills its ssh clients (no terminal,
        no hang-up signal), so without this they would train on alone and write checkpoints into a
        job that no longer exists.
        """
        if self.phase == "done" or self._stop.is_set():
            return
        log.error("rank %d: lost the launcher at %s:%d; stopping this rank", self.rank, *self.addr)
        os._exit(3)

    def send(self, record: dict[str, Any]) -> None:
        if self.addr is None:
            return
        rec = {"rank": self.rank, "host": self.host, "node": self.node, "phase": self.phase, **record}
        rec.setdefault("t", round(time.time(), 3))
        if isinstance(rec.get("message"), str) and len(rec["message"]) > MAX_MESSAGE:
            rec["message"] = rec["message"][:MAX_MESSAGE] + " [...]"
        with (
            self._lock
        ):  # numbered and sent under one lock: the server refuses a sequence number out of order
            data = self._sender.line(rec)
            if len(data) > MAX_LINE:
                log.warning(
                    "rank %d: a heartbeat record of %d bytes is over the limit; not sent",
                    self.rank,
                    len(data),
                )
                return
            log_ = audit.current()  # a report leaves the site too: it goes in its audit log
            if log_ is not None:
                log_.sent_report(data)
            for _ in range(2):
                if self._sock is None:
                    self._connect(budget_s=5.0)
                    if self._sock is None:
                        self._lost()
                        return
                try:
                    self._sock.sendall(data)
                    return
                except OSError:
                    self._sock.close()
                    self._sock = None

    def close(self) -> None:
        self._stop.set()
        sidecar = getattr(self, "_sidecar", None)
        if sidecar is not None and sidecar.poll() is None:
            sidecar.terminate()
            try:
                sidecar.wait(timeout=5)
            except subprocess.TimeoutExpired:
                sidecar.kill()
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

"""What leaves a site: a log of every message a rank sends to another site or to the launcher.

Each rank of a site-local job (``sites:`` in the config) appends one JSON line per message to
``<run>/audit/<site>-rank<R>.jsonl`` on its own disk:

``{"t": unix time, "rank": R, "site": "a", "to": ["b", "c"], "op": "allreduce", "kind":
"model-change", "bytes": 548864, "dtype": "float32", "canary": false}``

The hook sits at the send boundary of medseg's Gloo channel (:class:`medseg.distributed.comm.channel.Group`
calls :func:`sent` with the very buffer it hands to Gloo), and at the heartbeat client (records to the
launcher, ``to: ["launcher"]``). A collective is logged when its group holds a rank of another
site; what this rank contributes is ``bytes`` (the buffer's size: in a ring allreduce about twice
that travels in pieces, the same data). ``kind`` names what the tensor is, from a closed list
(:data:`KINDS`): model parameters, model changes, gradients, optimizer and compression state,
metric scalars, dataset header facts, control values (barriers, sizes, round counts) and launcher
reports. Images and labels are not a kind: no code path sends them.

Horovod's buffers (bsp's gradient allreduce and epoch-end buffer average) are not handed to this
hook: they are logged by their ring bytes (:meth:`Audit.sent_modelled`), and the canary is searched
in the tensors themselves before Horovod reads them (:meth:`Audit.inspect`: the gradient of every
parameter as autograd produces it, the buffer vector before its allreduce). Not seen: Horovod's
negotiation messages (tensor names only), the TCP store's rendezvous keys (addresses and ports) and
the channel's store address that rank 0 puts on horovodrun's rendezvous server (one address and port).

Canary check (tests): with ``MEDSEG_AUDIT_CANARY=v1,v2,...`` (a run of voxel values planted in one
site's images, see ``tests/distributed/test_sitedata.py``) every outgoing buffer is searched for that run as
int16 and int32 (file bytes), float32 and float64 (a loaded volume), and, within 1e-4, as float32
after the intensity window (``MEDSEG_AUDIT_WINDOW=lo,hi``; a preprocessed volume); a hit sets
``canary: true``. :func:`canary_in_text` searches text that leaves a site the same way (the rank
output the launcher forwards): the run of numbers as printed, raw or windowed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CANARY_ENV = "MEDSEG_AUDIT_CANARY"
WINDOW_ENV = "MEDSEG_AUDIT_WINDOW"
KINDS = (
    "parameters",  # model weights (start-up broadcast, epoch-end average)
    "model-change",  # a gssp round's Δ (or its fixed-bit codes)
    "gradients",  # bsp's per-step allreduce
    "optimizer-state",  # residuals, moments, local norm state, for rank 0's checkpoint
    "metrics",  # epoch numbers (loss, timings, bytes) and per-site validation scores
    "dataset-header",  # task, labels, modalities, channels, case counts
    "control",  # barriers, sizes, round counts, groups, resume state
    "report",  # heartbeats and step records to the launcher
)

_current: Audit | None = None


def current() -> Audit | None:
    return _current


class Audit:
    """One rank's audit log; messages are buffered until the site map is known (:meth:`open`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.site: str | None = None
        self.rank_sites: list[str] | None = None
        self._file: Any = None
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.totals: dict[str, int] = {}
        self.canary_hits = 0
        self._canary = _Canary.from_env()
        self._inspected_hit = False  # a canary in a buffer that the next sent_modelled reports

    @property
    def searching(self) -> bool:
        """Whether a canary is set (tests): then Horovod's buffers are worth :meth:`inspect`-ing."""
        return self._canary is not None

    def inspect(self, payload: Any) -> None:
        """Search a buffer that Horovod will send (the hook does not see it); the next
        :meth:`sent_modelled` call reports the result. Returns None, so it can be a tensor hook."""
        if self._canary is not None and self._canary.found_in(_as_bytes(payload)[0]):
            self._inspected_hit = True

    def open(self, path: Path, rank_sites: list[str]) -> None:
        """Start writing to ``path`` now that every rank's site is known; write what was buffered."""
        self.rank_sites = list(rank_sites)
        self.site = self.rank_sites[self.rank]
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        with self._lock:
            pending, self._pending = self._pending, []
            for rec in pending:
                rec["site"] = self.site
                self._write(rec)

    def others(self, ranks: Sequence[int]) -> list[str] | None:
        """Sites other than this rank's among ``ranks`` (None while the sites are not known yet)."""
        if self.rank_sites is None:
            return None
        return sorted({self.rank_sites[r] for r in ranks if r < len(self.rank_sites)} - {self.site})

    def sent(self, ranks: Sequence[int], op: str, kind: str, payload: Any) -> None:
        """Log ``payload`` (a tensor or bytes) handed to a collective over global ``ranks``."""
        to = self.others(ranks)
        if to == []:
            return  # stays inside the site
        self._log(to if to is not None else ["?"], op, kind, payload)

    def sent_report(self, data: bytes) -> None:
        self._log(["launcher"], "report", "report", data)

    def sent_modelled(self, ranks: Sequence[int], op: str, kind: str, nbytes: int, dtype: str) -> None:
        """Log a message whose buffer this hook does not see (Horovod's), by its size; its canary
        flag is what :meth:`inspect` found in the buffers since the last such message."""
        hit, self._inspected_hit = self._inspected_hit, False
        to = self.others(ranks)
        if to == []:
            return
        self._record(to if to is not None else ["?"], op, kind, int(nbytes), dtype, hit)

    def _log(self, to: list[str], op: str, kind: str, payload: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"audit: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
        raw, dtype = _as_bytes(payload)
        hit = self._canary.found_in(raw) if self._canary is not None else False
        self._record(to, op, kind, len(raw), dtype, hit)

    def _record(self, to: list[str], op: str, kind: str, nbytes: int, dtype: str, hit: bool) -> None:
        rec = {
            "t": round(time.time(), 4),
            "rank": self.rank,
            "site": self.site,
            "to": to,
            "op": op,
            "kind": kind,
            "bytes": nbytes,
            "dtype": dtype,
            "canary": hit,
        }
        with self._lock:
            self.totals[kind] = self.totals.get(kind, 0) + nbytes
            self.canary_hits += int(hit)
            if self._file is None:
                self._pending.append(rec)
            else:
                self._write(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        self._file.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def start(rank: int) -> Audit:
    """Make this process's audit (every message from now on is logged)."""
    global _current
    _current = Audit(rank)
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
    _current = None


def sent(ranks: Sequence[int], op: str, kind: str, payload: Any) -> None:
    """The channel's hook: log ``payload`` when an audit is running (no-op otherwise)."""
    if _current is not None:
        _current.sent(ranks, op, kind, payload)


NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def canary_in_text(text: str, values: Sequence[float], window: tuple[float, float] | None = None) -> bool:
    """Whether ``values`` (or, with ``window``, their windowed form) occur in ``text`` as a run of
    consecutive printed numbers, whatever separates them (``17, -93, 201``, ``[17.0 -93.0 201.0]``);
    a number printed to fewer decimals matches within its own rounding (windowed values, all in
    [0, 1], only when printed to 2 decimals or more)."""
    found = [(float(m), _decimals(m)) for m in NUMBER.findall(text)]
    raw = np.asarray(values, dtype=np.float64)
    targets = [(raw, 0)]
    if window is not None:
        lo, hi = window
        targets.append((np.clip((raw - lo) / (hi - lo), 0.0, 1.0), 2))
    for want, least in targets:
        k = len(want)
        for start in range(len(found) - k + 1):
            run = found[start : start + k]
            if all(d >= least and abs(x - w) <= max(0.5 * 10.0**-d, 1e-4) for (x, d), w in zip(run, want)):
                return True
    return False


def _decimals(number: str) -> int:
    mantissa = number.lower().split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def _as_bytes(payload: Any) -> tuple[bytes, str]:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload), "bytes"
    import torch

    if isinstance(payload, torch.Tensor):
        t = payload.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy().tobytes(), str(payload.dtype).replace("torch.", "")
    if isinstance(payload, (list, tuple)):
        parts = [_as_bytes(p) for p in payload]
        return b"".join(p for p, _ in parts), parts[0][1] if parts else "none"
    raise TypeError(f"audit: cannot read a {type(payload).__name__} as bytes")


class _Canary:
    """A run of voxel values to look for in outgoing bytes (see the module docstring)."""

    def __init__(self, values: list[float], window: tuple[float, float] | None) -> None:
        v = np.asarray(values, dtype=np.float64)
        self.exact = [v.astype(dt).tobytes() for dt in ("<i2", "<i4", "<f4", "<f8")]
        self.windowed = None
        if window is not None:
            lo, hi = window
            self.windowed = np.clip((v - lo) / (hi - lo), 0.0, 1.0).astype(np.float32)

    @classmethod
    def from_env(cls) -> _Canary | None:
        spec = os.environ.get(CANARY_ENV, "")
        if not spec:
            return None
        window = os.environ.get(WINDOW_ENV, "")
        win = tuple(float(x) for x in window.split(",")) if window else None
        return cls([float(x) for x in spec.split(",")], win)  # type: ignore[arg-type]

    def found_in(self, raw: bytes) -> bool:
        if any(p in raw for p in self.exact):
            return True
        if self.windowed is None or len(raw) < 4 * len(self.windowed):
            return False
        k = len(self.windowed)
        for shift in range(4):  # a float32 run may start at any byte offset of a pickled buffer
            n = (len(raw) - shift) // 4
            if n < k:
                continue
            x = np.frombuffer(raw, dtype="<f4", count=n, offset=shift)
            with np.errstate(invalid="ignore", over="ignore"):  # arbitrary bytes read as floats: NaN, inf
                starts = np.flatnonzero(np.abs(x[: n - k + 1] - self.windowed[0]) < 1e-4)
                for s in starts:
                    if np.all(np.abs(x[s : s + k] - self.windowed) < 1e-4):
                        return True
        return False


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Totals of a run's audit logs: bytes per site and kind, messages, canary hits, kinds seen."""
    out: dict[str, Any] = {"sites": {}, "messages": 0, "canary_hits": 0, "kinds": []}
    kinds: set[str] = set()
    for path in sorted(Path(run_dir, "audit").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            site = out["sites"].setdefault(rec["site"], {})
            site[rec["kind"]] = site.get(rec["kind"], 0) + int(rec["bytes"])
            kinds.add(rec["kind"])
            out["messages"] += 1
            if rec["canary"]:
                out["canary_hits"] += 1
                out["canary_bytes"] = out.get("canary_bytes", 0) + int(rec["bytes"])
    out["kinds"] = sorted(kinds)
    return out

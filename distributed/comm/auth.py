"""The job secret: what tells a job's own messages from anyone else's.

The launcher (:func:`medseg.distributed.launch.launcher.launch`) makes a new random secret for every
attempt of a job (``secrets.token_bytes(32)``) and hands it to the ranks in their launch environment,
``MEDSEG_JOB_SECRET`` (64 hex digits; horovodrun passes it on, through ssh to other hosts). It is
never logged, never written into the run folder, and dies with the job. With it:

- every heartbeat line a rank or its helper process sends the launcher carries an HMAC-SHA256 of
  its content (:mod:`medseg.distributed.launch.beat_sidecar` has the line format); the launcher
  drops and logs a line without a valid one;
- every value medseg's channel writes into its TCP store (the store Gloo rendezvouses through: each
  rank's address and port) is stored with an HMAC-SHA256 over key and value, and checked on every read
  (:class:`MacStore`): a value planted by anyone without the secret is refused with a clear error
  before Gloo connects anywhere;
- the channel's store address, which rank 0 announces through horovodrun's rendezvous server (or
  a Horovod broadcast), travels with a MAC too, bound to the launch.

What it does not do: it authenticates *a member of the job*, not which
rank: every rank holds the same secret, so a compromised site can still pose as another rank (its
updates are checked by :mod:`medseg.distributed.comm.checks`). It does not encrypt anything (the
site tunnel does), does not stop anyone who can reach the store's port from deleting keys or
flooding it (a denial of service, not a forgery), and does not cover Gloo's data connections, which
are only as private as the network (the site tunnel) they run on. The store's atomic counters
(``add``) cannot carry a MAC; medseg's channel does not use them.

Where the secret can be read: Horovod's Gloo launcher starts every rank as ``env NAME=value ...
python ...`` and sends that line through ``ssh`` to other hosts, so while a job runs the secret is
on a process command line on the launcher's host and on every member host, readable there by any
local user through ``ps`` unless ``/proc`` is mounted with ``hidepid=2`` (Horovod does the same with
every other variable of the job). Run jobs on hosts without untrusted local accounts, or mount
``/proc`` with ``hidepid``; a new secret is made for every attempt, so a leaked one is worth one job.

A user who starts ranks with their own ``horovodrun`` line sets ``MEDSEG_JOB_SECRET`` themselves (the
same value on every rank); without one the channel refuses to start.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from medseg.errors import RunError

SECRET_ENV = "MEDSEG_JOB_SECRET"
SECRET_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256


def new_secret() -> bytes:
    """A fresh job secret (32 random bytes)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_env(secret: bytes) -> dict[str, str]:
    """The launch environment entry that hands ``secret`` to the ranks."""
    return {SECRET_ENV: secret.hex()}


def job_secret(required: bool = True) -> bytes | None:
    """This rank's job secret from ``MEDSEG_JOB_SECRET``; RunError when missing (``required``) or malformed."""
    raw = os.environ.get(SECRET_ENV, "")
    if not raw:
        if not required:
            return None
        raise RunError(
            f"{SECRET_ENV} is not set: ranks authenticate each other and the launcher with a job secret. "
            "Start the job with `medseg train --np N` (the launcher makes one), or export the same "
            f"64 hex digits on every rank, e.g. {SECRET_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
        )
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise RunError(f"{SECRET_ENV}: expected at least 32 hex digits (16 bytes); got something else")
    return secret


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (so no two splits of the same bytes collide)."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def sign(secret: bytes, domain: bytes, data: bytes) -> bytes:
    """``MAC || data``, the MAC over ``domain`` (what the bytes are for) and ``data``."""
    return mac(secret, domain, data) + data


def verify(secret: bytes, domain: bytes, signed: bytes) -> bytes | None:
    """The data of ``signed`` when its MAC is valid for ``domain``, else None."""
    if len(signed) < MAC_BYTES:
        return None
    tag, data = signed[:MAC_BYTES], signed[MAC_BYTES:]
    return data if hmac.compare_digest(tag, mac(secret, domain, data)) else None


class ForgedValue(RunError):
    """A store value without a valid MAC."""


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class MacStore(dist.Store):
    """A ``torch.distributed`` store whose values carry an HMAC-SHA256 over (key, value).

    Wraps the job's ``TCPStore``. :meth:`set` stores ``MAC(secret, key, value) || value``; :meth:`get`
    returns ``value`` only when the MAC checks out for that key, and raises :class:`ForgedValue`
    otherwise, so a value written by someone without the job secret, or copied from another key,
    is never handed to Gloo. ProcessGroupGloo built on it (through a ``PrefixStore``) rendezvouses
    with ``set``/``get``/``wait`` only, so every address it reads is authenticated. ``add`` and
    ``compare_set`` pass through unauthenticated (atomic counters cannot carry a MAC; medseg does not
    use them).

    Reads cost one round trip where the key is there. Gloo reads each peer's address as ``wait``
    then ``get``, and a ``TCPStore.get`` is itself a wait and a read: three round trips to the
    store's host per key, which across slow links is most of a group's connect time (measured on
    the dilated testbed: 2.6 s per key from the farthest site, 4 keys for a 4-rank group). So
    :meth:`wait` reads each key with :meth:`peek` (one ``compare_set`` that cannot change the
    store) and keeps the raw value for the :meth:`get` that follows; only a key not yet written
    is waited for, then peeked. A kept value is handed out once, by the next ``get`` of that key
    (any write through this store drops it): ``wait`` then ``get`` reads the value as it was when
    the wait found it, which for Gloo's addresses (each written once) is the only value there is.
    """

    DOMAIN = b"medseg-store"

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        self.inner, self._secret = inner, secret
        self._read: dict[str, bytes] = {}  # raw values read by wait(), for the get() that follows
        # compare_set's expected value for a peek: no stored value (MAC || data) can equal it
        self._absent = b"\x00medseg-absent\x00" + secrets.token_bytes(16)

    def peek(self, key: str) -> bytes | None:
        """The raw (MAC'd) value of ``key``, None when it is not there; one round trip, the store
        unchanged (``compare_set`` of an absent key with a non-empty expected value writes nothing
        and answers the expected value; of a present key, answers its value, which cannot equal
        ``_absent``)."""
        raw = bytes(self.inner.compare_set(key, self._absent, self._absent))
        return None if raw == self._absent else raw

    def _tag(self, key: str, value: bytes) -> bytes:
        return mac(self._secret, self.DOMAIN, key.encode(), value)

    def set(self, key: str, value: Any) -> None:
        data = _as_bytes(value)
        self._read.pop(key, None)
        self.inner.set(key, self._tag(key, data) + data)

    def get(self, key: str) -> bytes:
        read = self._read.pop(key, None)
        raw = read if read is not None else bytes(self.inner.get(key))
        tag, data = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(tag, self._tag(key, data)):
            raise ForgedValue(
                f"channel store: the value of key {key!r} fails the job-secret check (written by someone "
                "outside this job, or altered on the way); it was refused. Is the store's port reachable "
                "from outside the site link?"
            )
        return data

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        self._read.pop(key, None)
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._read.pop(key, None)
        return bytes(self.inner.compare_set(key, expected, desired))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key is there, reading each as it is found; DistStoreError once
        ``timeout`` (else the store's own) has passed without one."""
        limit = timeout if timeout is not None else getattr(self.inner, "timeout", None)
        deadline = time.monotonic() + limit.total_seconds() if isinstance(limit, datetime.timedelta) else None
        for key in keys:
            raw = self.peek(key)
            while raw is None:  # the store's wait can return before the key is there (seen on the
                # dilated testbed, on the store's host), so the loop ends on the key or the deadline
                left = None if deadline is None else deadline - time.monotonic()
                if left is None:
                    self.inner.wait([key])
                elif left > 0:
                    self.inner.wait([key], datetime.timedelta(seconds=left))
                else:
                    raise dist.DistStoreError(f"channel store: key {key!r} was not written within {limit}")
                raw = self.peek(key)
            self._read[key] = raw

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.inner.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        self._read.pop(key, None)
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

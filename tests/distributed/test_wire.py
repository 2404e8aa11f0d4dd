"""What crosses a rank boundary: declared schemas, JSON and raw tensors, no pickle; and the job secret
on the channel's store. No Horovod: the wire module on its own, and two Gloo ranks in one process."""

from __future__ import annotations

import datetime
import json
import secrets
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from medseg.distributed.comm import auth, wire
from medseg.distributed.comm.channel import INLINE_JSON_BYTES, Group, gather_tree_to_root
from medseg.distributed.epoch_numbers import rank_numbers
from medseg.distributed.sync.common import StepStats
from medseg.errors import RunError

FACTS = {
    "task": "Task01",
    "labels": {"0": "background", "1": "tumour"},
    "modality": {"0": "CT"},
    "channels": 1,
    "train_cases": 12,
    "val_cases": 3,
    "stopping": {"stop_at": 0.85, "min_epochs": 0, "val_interval": 1},
}


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


def test_no_pickle_in_the_engine() -> None:
    """No module of the engine imports pickle or calls an object broadcast (pickle underneath)."""
    root = Path(__file__).resolve().parents[2] / "distributed"
    for path in root.rglob("*.py"):
        if "testbed" in path.parts:
            continue
        text = path.read_text()
        for word in (
            "import pickle",
            "pickle.loads",
            "broadcast_object(",
            "allgather_object(",
            "cloudpickle",
        ):
            assert word not in text, f"{path}: {word}"


# one rank's epoch numbers as the session makes them (the ``numbers`` part of an ``epoch-end`` message)
NUMBERS = rank_numbers(StepStats(steps=4), 8, 0, 2.0, 0.0, 1.0)


def test_declared_values_round_trip() -> None:
    assert wire.decode_json(wire.encode_json(FACTS), "dataset-header", "rank 1") == FACTS
    end = {"numbers": NUMBERS, "site": ["a", {"val_dice": 0.8, "val_cases": 3, "val_hd95": None}]}
    assert wire.decode_json(_json(end), "epoch-end", "r") == end
    assert wire.decode_json(_json({"numbers": NUMBERS, "site": None}), "epoch-end", "r")["site"] is None
    assert wire.decode_json(b"12.5", "speed", "r") == 12.5


@pytest.mark.parametrize(
    ("kind", "data", "why"),
    [
        ("dataset-header", _json({**FACTS, "exec": "os.system('id')"}), "undeclared key"),
        ("dataset-header", _json({k: v for k, v in FACTS.items() if k != "task"}), "missing key"),
        ("dataset-header", _json({**FACTS, "train_cases": "12"}), "expected an integer"),
        ("dataset-header", _json({**FACTS, "train_cases": -1}), "outside"),
        ("dataset-header", _json({**FACTS, "channels": True}), "matches none"),
        ("speed", b"NaN", "not allowed"),
        ("speed", b"Infinity", "not allowed"),
        ("speed", b"1e999", "not finite"),  # JSON has no overflow error: this parses to inf
        ("speed", b"0", "out of range"),
        ("speed", b"-3.5", "out of range"),
        ("epoch-end", _json({"numbers": NUMBERS, "site": ["a", {"val_dice": "0.9"}]}), "matches none"),
        (
            "epoch-end",
            _json({"numbers": {**NUMBERS, "wall_s": -1.0}, "site": None}),
            "numbers.wall_s: -1.0 is out of range",
        ),
        ("epoch-end", _json({"numbers": NUMBERS}), "missing key"),
        ("epoch-end", b'{"numbers": {}, "site": ["a", {"val_dice": 0.5, "val_dice": 0.9}]}', "duplicate key"),
        ("hostname", _json("h" * 300), "at most 255"),
        ("groups", _json([[0, 1], [2, "3"]]), "expected an integer"),
        ("groups", b"[" * 40 + b"]" * 40, "nested deeper"),
        ("epoch-end", b"\x80\x81 not utf-8", "not valid JSON"),
        ("epoch-end", b"{not json", "not valid JSON"),
        ("channel-address", _json({"host": "h", "port": 70000}), "outside"),
    ],
)
def test_malformed_json_is_refused_naming_the_sender(kind: str, data: bytes, why: str) -> None:
    with pytest.raises(RunError, match=rf"rank 3 \(site b\) sent a malformed '{kind}' message.*{why}"):
        wire.decode_json(data, kind, "rank 3 (site b)")


def test_an_oversize_json_message_is_refused_before_parsing() -> None:
    big = _json("x" * (wire.MAX_JSON_BYTES + 1))
    with pytest.raises(
        RunError, match=r"rank 1 sent a malformed 'hostname' message.*at most 1048576 allowed"
    ):
        wire.decode_json(big, "hostname", "rank 1")


def _checkpoint() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.BatchNorm3d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 1, 4, 4, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 2,
        "best_metric": float("-inf"),
        "best_epoch": None,
        "labels": {"0": "background"},
        "dist": {"epoch": 2, "ranks": 2},
    }


def _decode(header: bytes, payload: torch.Tensor, kind: str = "shared-state") -> object:
    return wire.decode_tree(header, payload, kind, "rank 0 (site a)")


def test_resume_state_travels_as_tensors_plus_json() -> None:
    """Integer keys (an optimizer's state), tuples (Adam's betas), -inf, every tensor bit-exact."""
    state = _checkpoint()
    header, payload = wire.pack_tree(state)
    assert payload.dtype == torch.uint8
    out = _decode(header, payload)
    assert list(out["optimizer"]["state"]) == list(state["optimizer"]["state"])
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert out["best_metric"] == float("-inf") and out["epoch"] == 2 and out["best_epoch"] is None
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v) and out["model"][k].dtype == v.dtype
    torch.optim.Adam(
        torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.BatchNorm3d(2)).parameters()
    ).load_state_dict(out["optimizer"])


def _tampered(change) -> tuple[bytes, torch.Tensor]:
    header, payload = wire.pack_tree(_checkpoint())
    doc = json.loads(header)
    payload = change(doc, payload)
    return json.dumps(doc).encode(), payload


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d, p: d["tensors"][0].update(dtype="object") or p, "dtype 'object' is not one of"),
        (lambda d, p: d["tensors"][0].update(dtype="complex64") or p, "dtype 'complex64'"),
        (lambda d, p: d["tensors"][0].update(shape=[2, 1, 3, 3, 4]) or p, "shorter|bytes"),  # wrong shape
        (lambda d, p: d["tensors"][0].update(dtype="float64") or p, "shorter|bytes"),  # wrong dtype
        (lambda d, p: d["tensors"][0].update(shape=[1 << 40, 1 << 30]) or p, "outside|more than"),
        (lambda d, p: p[:-4], "shorter|bytes"),  # a short payload
        (lambda d, p: torch.cat([p, p[:8]]), "the manifest declares"),  # a longer one
        (lambda d, p: d["tree"]["d"].append(["exec", "os.system"]) or p, "undeclared checkpoint key"),
        (lambda d, p: d.update(tree={"d": [["model", {"t": 999}]]}) or p, "out of range"),
        (lambda d, p: d.update(tree={"d": [["model", {"x": 1}]]}) or p, "unknown node tag"),
        (lambda d, p: d.update(tree={"d": [["model", {"t": 0, "l": []}]]}) or p, "one key"),
        (lambda d, p: d.update(tree={"__reduce__": ["os.system", ["id"]]}) or p, "unknown node tag"),
        (lambda d, p: d.update(tree={"d": [["epoch", 2]]}) or p, "not referenced"),
        (lambda d, p: d.update(extra=1) or p, "undeclared key"),
    ],
)
def test_malformed_state_is_refused_naming_the_sender(change, why: str) -> None:
    header, payload = _tampered(change)
    with pytest.raises(
        RunError, match=rf"rank 0 \(site a\) sent a malformed 'shared-state' message.*({why})"
    ):
        _decode(header, payload)


def test_bool_tensors_hold_only_0_and_1_and_site_local_is_checked() -> None:
    header, payload = wire.pack_tree(("a", {"bn.weight": torch.ones(2)}))
    assert _decode(header, payload, "site-local")[0] == "a"
    header, payload = wire.pack_tree(("a", {"bn.weight": torch.ones(2, dtype=torch.int64)}))
    with pytest.raises(RunError, match="floating-point"):
        _decode(header, payload, "site-local")
    wire.register_tree("test-bool")
    header, payload = wire.pack_tree(torch.tensor([True, False]))
    payload = payload.clone()
    payload[0] = 7
    with pytest.raises(RunError, match="other than 0 and 1"):
        _decode(header, payload, "test-bool")


def test_what_cannot_travel_is_refused_at_the_sender() -> None:
    class Evil:
        def __reduce__(self):  # what a pickle would run on the receiver
            return (print, ("pwned",))

    with pytest.raises(RunError, match="not a wire type"):
        wire.pack_tree({"x": Evil()})
    with pytest.raises(RunError, match="cannot send"):
        wire.encode_json({"x": Evil()})
    with pytest.raises(RunError, match="complex"):
        wire.pack_tree(torch.zeros(2, dtype=torch.complex64))


# -- the store's values carry MACs; two Gloo ranks in one process ---------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stores(secret: bytes, n: int = 2) -> tuple[list[dist.Store], list[dist.TCPStore]]:
    port, t = _free_port(), datetime.timedelta(seconds=20)
    tcp = [
        dist.TCPStore("127.0.0.1", port, n, is_master=r == 0, timeout=t, wait_for_workers=False)
        for r in range(n)
    ]
    return [auth.MacStore(s, secret) for s in tcp], tcp


def test_a_forged_store_value_is_refused() -> None:
    secret = secrets.token_bytes(32)
    (store, _), (raw, _) = _stores(secret)
    store.set("world//0/1", b"198.18.1.1:5000")
    assert store.get("world//0/1") == b"198.18.1.1:5000"
    raw.set("world//0/0", b"\x00" * 32 + b"203.0.113.66:6666")  # someone without the secret
    with pytest.raises(auth.ForgedValue, match="'world//0/0' fails the job-secret check"):
        store.get("world//0/0")
    raw.set("moved", raw.get("world//0/1"))  # a genuine value copied to another key
    with pytest.raises(RunError, match="job-secret check"):
        store.get("moved")
    other = auth.MacStore(raw, secrets.token_bytes(32))  # another job's secret
    with pytest.raises(RunError, match="job-secret check"):
        other.get("world//0/1")


class _Counted:
    """A store that counts the requests a MacStore sends it (each one a round trip to the store's host)."""

    def __init__(self, inner: dist.Store) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append(name)
            return getattr(self.inner, name)(*args)

        return call


def test_a_read_after_wait_is_one_round_trip_and_changes_nothing() -> None:
    """Gloo reads each address as wait, then get: for a key that is there, one request in all
    (TCPStore's own wait then get would be three); for one that is not, the store is left without
    it, and the wait ends when a peer writes it."""
    secret = secrets.token_bytes(32)
    (writer, _), (raw, raw_b) = _stores(secret)
    reader = auth.MacStore(_Counted(raw_b), secret)
    t = datetime.timedelta(seconds=10)
    writer.set("world//0/0", b"198.18.1.1:5000")
    stored = bytes(raw.get("world//0/0"))
    reader.wait(["world//0/0"], t)
    assert reader.get("world//0/0") == b"198.18.1.1:5000"
    assert reader.inner.calls == ["compare_set"]
    assert bytes(raw.get("world//0/0")) == stored  # the peek wrote nothing
    assert reader.peek("world//0/1") is None and not raw.check(["world//0/1"])
    threading.Timer(0.3, lambda: writer.set("world//0/1", b"198.18.2.1:5001")).start()
    reader.inner.calls.clear()
    reader.wait(["world//0/1"], t)
    assert reader.get("world//0/1") == b"198.18.2.1:5001" and "get" not in reader.inner.calls
    writer.set("world//0/1", b"198.18.2.1:6000")  # a value read by wait is handed out once
    assert reader.get("world//0/1") == b"198.18.2.1:6000"
    raw.set("world//0/2", b"\x00" * 32 + b"203.0.113.66:6666")  # forged, read through wait
    reader.wait(["world//0/2"], t)
    with pytest.raises(auth.ForgedValue, match="'world//0/2' fails the job-secret check"):
        reader.get("world//0/2")
    with pytest.raises(dist.DistStoreError):  # a key never written: the wait's timeout ends it
        reader.wait(["never"], datetime.timedelta(seconds=0.5))


class _WakesEarly(_Counted):
    """A store whose wait returns at once, key or not (as TCPStore's did on its own host)."""

    def wait(self, keys, timeout=None) -> None:
        self.calls.append("wait")


def test_a_wait_that_returns_early_still_ends_at_the_deadline() -> None:
    secret = secrets.token_bytes(32)
    (_, _), (_, raw_b) = _stores(secret)
    reader = auth.MacStore(_WakesEarly(raw_b), secret)
    with pytest.raises(dist.DistStoreError, match="'never' was not written within"):
        reader.wait(["never"], datetime.timedelta(seconds=0.3))
    assert reader.inner.calls.count("wait") >= 1


def test_gloo_reads_each_address_in_one_request() -> None:
    """Two ranks build a ProcessGroupGloo through a PrefixStore over MacStore: every address Gloo
    reads comes from the value its wait found (no TCPStore.get, which waits again before it reads)."""
    secret = secrets.token_bytes(32)
    _, tcp = _stores(secret)
    counted = [_Counted(t) for t in tcp]
    stores = [auth.MacStore(c, secret) for c in counted]
    t = datetime.timedelta(seconds=20)
    made = _run_ranks([lambda r=r: Group(stores[r], "world/", [0, 1], r, t) for r in range(2)])
    assert all(isinstance(g, Group) for g in made), made
    for c in counted:
        assert "get" not in c.calls and "compare_set" in c.calls, c.calls
    got = _run_ranks([lambda g=g: g.gather_json(FACTS, "dataset-header") for g in made])
    assert got == [[FACTS, FACTS], [FACTS, FACTS]]


def _run_ranks(fns) -> list:
    """Run ``fns[r]()`` for every rank in its own thread; return results (exceptions as values)."""
    out: list = [None] * len(fns)

    def run(r: int) -> None:
        try:
            out[r] = fns[r]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _groups(secret: bytes) -> list[Group]:
    stores, _ = _stores(secret)
    names = ["rank 0 (site a)", "rank 1 (site b)"]
    t = datetime.timedelta(seconds=20)
    made = _run_ranks([lambda r=r: Group(stores[r], "world/", [0, 1], r, t, names) for r in range(2)])
    assert all(isinstance(g, Group) for g in made), made
    return made


def test_a_group_over_the_mac_store_exchanges_declared_messages() -> None:
    a, b = _groups(secrets.token_bytes(32))
    got = _run_ranks(
        [lambda: a.gather_json(FACTS, "dataset-header"), lambda: b.gather_json(FACTS, "dataset-header")]
    )
    assert got == [[FACTS, FACTS], [FACTS, FACTS]]
    state = _checkpoint()
    got = _run_ranks(
        [
            lambda: a.broadcast_tree(state, 0, "shared-state"),
            lambda: b.broadcast_tree(None, 0, "shared-state"),
        ]
    )
    assert torch.equal(got[1]["model"]["0.weight"], state["model"]["0.weight"])
    local = ("a", {"bn.weight": torch.ones(2)})
    got = _run_ranks(
        [
            lambda: gather_tree_to_root(a, local, "site-local"),
            lambda: gather_tree_to_root(b, ("b", None), "site-local"),
        ]
    )
    assert got[1] == (None, [8, 0]) and got[0][0][1] == ("b", None)


def _slot(size: int, data: bytes = b"") -> torch.Tensor:
    """A gather slot by hand: an announced size, then bytes (independent of ``inline_slot``)."""
    raw = size.to_bytes(8, sys.byteorder) + data
    slot = torch.zeros(8 + INLINE_JSON_BYTES, dtype=torch.uint8)
    slot[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return slot


def test_a_peer_that_sends_garbage_or_too_much_is_named_and_refused() -> None:
    """Rank 1 speaks the protocol by hand: a malformed object (inline, then in a second trip), then
    an oversize announcement."""
    a, b = _groups(secrets.token_bytes(32))

    def evil(data: bytes) -> None:
        inline = len(data) <= INLINE_JSON_BYTES
        outs = [torch.empty(8 + INLINE_JSON_BYTES, dtype=torch.uint8) for _ in range(2)]
        b.allgather(outs, _slot(len(data), data if inline else b""))
        if not inline:
            b.allgather(
                [torch.empty(len(data), dtype=torch.uint8) for _ in range(2)],
                torch.tensor(list(data), dtype=torch.uint8),
            )

    honest = lambda: a.gather_json(FACTS, "dataset-header")  # noqa: E731
    for pickle_like in (b"\x80\x04\x95cos\nsystem\n", b"\x80\x04\x95" + b"x" * 3000):  # inline, second trip
        got = _run_ranks([honest, lambda p=pickle_like: evil(p)])
        assert isinstance(got[0], RunError), got[0]
        assert "rank 1 (site b) sent a malformed 'dataset-header'" in str(got[0]), got[0]
    got = _run_ranks([honest, lambda: evil(_json({**FACTS, "labels": ["not", "a", "map"]}))])
    assert isinstance(got[0], RunError) and "rank 1 (site b)" in str(got[0]), got[0]

    def oversize() -> None:
        outs = [torch.empty(8 + INLINE_JSON_BYTES, dtype=torch.uint8) for _ in range(2)]
        b.allgather(outs, _slot(1 << 40))  # then nothing: it never sends 1 TB

    got = _run_ranks([honest, oversize])
    assert isinstance(got[0], RunError) and "announced 1099511627776 bytes, the limit is 1048576" in str(
        got[0]
    )


def test_json_messages_small_and_large_arrive_whole() -> None:
    """Below the inline size a message takes one collective, above it a second; both arrive whole,
    from an all-to-all gather and from a broadcast."""
    a, b = _groups(secrets.token_bytes(32))
    big = {**FACTS, "labels": {str(i): f"structure {i:04d}" for i in range(200)}}  # over 2 KiB
    assert len(_json(big)) > INLINE_JSON_BYTES >= len(_json(FACTS))
    for pair in ((FACTS, FACTS), (FACTS, big)):
        got = _run_ranks(
            [
                lambda v=pair[0]: a.gather_json(v, "dataset-header"),
                lambda v=pair[1]: b.gather_json(v, "dataset-header"),
            ]
        )
        assert got == [list(pair), list(pair)], got
    for value in (FACTS, big):
        got = _run_ranks(
            [
                lambda v=value: a.broadcast_json(v, 1, "dataset-header"),
                lambda v=value: b.broadcast_json(v, 1, "dataset-header"),
            ]
        )
        assert got == [value, value], got
    got = _run_ranks([lambda: a.barrier_with(7, 1), lambda: b.barrier_with(3, 1)])
    assert got == [3, 3], got  # rank 1's value on both; rank 0's 7 is ignored


def test_a_rank_without_the_job_secret_cannot_join() -> None:
    """Rank 1 rendezvouses through the raw store (it has no secret): rank 0 refuses its address."""
    stores, raw = _stores(secrets.token_bytes(32))
    t = datetime.timedelta(seconds=5)
    got = _run_ranks(
        [
            lambda: Group(stores[0], "world/", [0, 1], 0, t),
            lambda: dist.ProcessGroupGloo(dist.PrefixStore("world/", raw[1]), 1, 2, t),
        ]
    )
    assert isinstance(got[0], RunError) and "job-secret check" in str(got[0]), got[0]


def test_the_job_secret_comes_from_the_launch_environment(monkeypatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.job_secret(required=False) is None
    with pytest.raises(RunError, match="MEDSEG_JOB_SECRET is not set"):
        auth.job_secret()
    monkeypatch.setenv(auth.SECRET_ENV, "zz")
    with pytest.raises(RunError, match="expected at least 32 hex digits"):
        auth.job_secret()
    s = auth.new_secret()
    monkeypatch.setenv(auth.SECRET_ENV, s.hex())
    assert auth.job_secret() == s and len(s) == 32
    assert auth.verify(s, b"d", auth.sign(s, b"d", b"data")) == b"data"
    assert auth.verify(s, b"other", auth.sign(s, b"d", b"data")) is None


def test_a_one_rank_channel_listens_on_its_own_address_only(monkeypatch) -> None:
    """The store takes over a socket bound to the announced address (not every interface), and the
    address travels MAC'd: a rank with another job's secret refuses it."""
    import psutil

    from medseg.distributed.comm.channel import Channel

    class _Hvd:
        def __init__(self) -> None:
            self.sent: torch.Tensor | None = None

        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 1

        def broadcast(self, t: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
            self.sent = t.clone()
            return t.clone()

    secret = secrets.token_bytes(32)
    hvd = _Hvd()
    channel = Channel(hvd, 60, secret)
    assert channel.gather_json("h1", "hostname") == ["h1"]
    port = channel.store.inner.port
    listening = [
        c for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    ]
    assert listening and all(c.laddr.ip not in ("0.0.0.0", "::") for c in listening), listening

    from medseg.distributed.comm.store_address import share_address

    class _Replay(_Hvd):
        def broadcast(self, t: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
            return hvd.sent.clone()

    assert share_address(_Replay(), secret, None)[1] == port
    with pytest.raises(RunError, match="without a valid job-secret MAC"):
        share_address(_Replay(), secrets.token_bytes(32), None)

"""What may cross a rank boundary, in what form: declared schemas, JSON for small values, raw
tensors for arrays. Nothing received is ever unpickled.

Every message medseg exchanges between ranks (other than the fixed-size tensors of the collectives
themselves: gradients, rounds, averages, whose dtype and size the receiver allocates) has a *kind*
declared in :data:`SCHEMAS` (JSON values) or :data:`TREES` (state with tensors). A receiver decodes
a message only as the kind it expects and refuses anything else with a
:class:`~medseg.errors.RunError` that names the sending rank (and its site, once known).

JSON message
    UTF-8 JSON text of at most ``limit`` bytes (:data:`MAX_JSON_BYTES`, 1 MiB, unless the kind says
    less). Only objects with string keys, arrays, strings, integers, finite floats, booleans and
    null; ``NaN``/``Infinity`` tokens, duplicate keys and nesting deeper than :data:`MAX_DEPTH` are
    refused. The decoded value must then match the kind's schema (:class:`Spec`): types, ranges,
    lengths, and for records exactly the declared keys.

Tensor block
    A manifest, one ``{"dtype": name, "shape": [d0, d1, ...]}`` per tensor (dtype from
    :data:`DTYPES`, at most :data:`MAX_NDIM` dimensions), and one uint8 buffer holding the tensors'
    bytes back to back in manifest order (C order, native byte order: every rank of a job runs on
    the same architecture). The buffer's length must equal what the manifest declares; a ``bool``
    tensor's bytes must be 0 or 1.

Tree message (state that holds tensors: the chief's resume state, a site's normalisation tensors)
    A JSON header ``{"tree": node, "tensors": manifest}`` and the manifest's tensor block. A node is
    a JSON scalar (string, integer, finite float, boolean, null) or an object with exactly one key:
    ``{"t": i}`` the i-th tensor, ``{"l": [node, ...]}`` a list, ``{"u": [node, ...]}`` a tuple,
    ``{"d": [[key, node], ...]}`` a dict whose keys are strings or integers (an optimizer's state is
    keyed by parameter number), ``{"f": "nan" | "inf" | "-inf"}`` a non-finite float. Each tree kind
    declares its header and payload limits and a check of the decoded object (:class:`TreeKind`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from medseg.errors import RunError

MAX_JSON_BYTES = 1 << 20  # 1 MiB: the largest small value (dataset facts, metrics, epoch numbers)
MAX_DEPTH = 32  # nesting of a JSON value or a tree
MAX_NDIM = 16
MAX_TENSORS = 1 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class Malformed(ValueError):
    """A received value does not match its schema (``where`` is the path inside the value)."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where or 'the value'}: {why}")


def refuse(sender: str, kind: str, why: str) -> RunError:
    """The error every rank raises for a malformed message: it names the sender and the kind."""
    return RunError(
        f"{sender} sent a malformed {kind!r} message ({why}); it was refused and nothing of it was used. "
        "The job stops: check that every site runs the same medseg version, and that site for tampering"
    )


# -- schemas of JSON values ---------------------------------------------------------------------
class Spec:
    """A declared JSON shape; :meth:`check` raises :class:`Malformed` on the first mismatch."""

    def check(self, value: Any, where: str = "") -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Str(Spec):
    max_len: int = 1024

    def check(self, value: Any, where: str = "") -> None:
        if not isinstance(value, str):
            raise Malformed(where, f"expected a string, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise Malformed(where, f"string of {len(value)} characters, at most {self.max_len} allowed")


@dataclass(frozen=True)
class Int(Spec):
    lo: int = 0
    hi: int = 1 << 62

    def check(self, value: Any, where: str = "") -> None:
        if not _is_int(value):
            raise Malformed(where, f"expected an integer, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            raise Malformed(where, f"{value} is outside [{self.lo}, {self.hi}]")


@dataclass(frozen=True)
class Num(Spec):
    """A finite number in ``[lo, hi]`` (``positive``: > 0)."""

    lo: float = -math.inf
    hi: float = math.inf
    positive: bool = False

    def check(self, value: Any, where: str = "") -> None:
        if not _is_num(value):
            raise Malformed(where, f"expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise Malformed(where, f"{value} is not finite")
        if not self.lo <= value <= self.hi or (self.positive and value <= 0):
            raise Malformed(where, f"{value} is out of range")


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, value: Any, where: str = "") -> None:
        if not isinstance(value, bool):
            raise Malformed(where, f"expected true or false, got {type(value).__name__}")


@dataclass(frozen=True)
class Null(Spec):
    def check(self, value: Any, where: str = "") -> None:
        if value is not None:
            raise Malformed(where, f"expected null, got {type(value).__name__}")


class Either(Spec):
    def __init__(self, *options: Spec) -> None:
        self.options = options

    def check(self, value: Any, where: str = "") -> None:
        errors = []
        for option in self.options:
            try:
                option.check(value, where)
                return
            except Malformed as exc:
                errors.append(str(exc))
        raise Malformed(where, "matches none of the allowed forms: " + "; ".join(errors))


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    max_len: int = 1 << 16
    min_len: int = 0

    def check(self, value: Any, where: str = "") -> None:
        if not isinstance(value, list):
            raise Malformed(where, f"expected a list, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            raise Malformed(where, f"list of {len(value)} items, allowed {self.min_len}..{self.max_len}")
        for i, v in enumerate(value):
            self.item.check(v, f"{where}[{i}]")


class Fixed(Spec):
    """A list of exactly ``len(items)`` values (a tuple on the sending side)."""

    def __init__(self, *items: Spec) -> None:
        self.items = items

    def check(self, value: Any, where: str = "") -> None:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise Malformed(where, f"expected a list of {len(self.items)} items")
        for i, (spec, v) in enumerate(zip(self.items, value)):
            spec.check(v, f"{where}[{i}]")


@dataclass(frozen=True)
class MapOf(Spec):
    """An object of any string keys (at most ``key_len`` characters) mapping to ``value``."""

    value: Spec
    max_len: int = 4096
    key_len: int = 256

    def check(self, value: Any, where: str = "") -> None:
        if not isinstance(value, dict):
            raise Malformed(where, f"expected an object, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise Malformed(where, f"object of {len(value)} keys, at most {self.max_len} allowed")
        for k, v in value.items():
            Str(self.key_len).check(k, f"{where} key")
            self.value.check(v, f"{where}.{k}")


class Record(Spec):
    """An object with exactly the declared keys (those in ``optional`` may be missing)."""

    def __init__(self, fields: dict[str, Spec], optional: Sequence[str] = ()) -> None:
        self.fields, self.optional = fields, set(optional)

    def check(self, value: Any, where: str = "") -> None:
        if not isinstance(value, dict):
            raise Malformed(where, f"expected an object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(self.fields))
        if unknown:
            raise Malformed(where, f"undeclared key(s) {unknown[:5]}")
        missing = sorted(set(self.fields) - set(value) - self.optional)
        if missing:
            raise Malformed(where, f"missing key(s) {missing}")
        for k, v in value.items():
            self.fields[k].check(v, f"{where}.{k}" if where else k)


NAME = Str(255)
COUNT = Int(0, 1 << 50)
SECONDS = Num(0.0, 1e9)
SCORE = Either(Num(), Null())

# a site leader's validation scores (None on ranks that do not validate, or when none was due)
SITE_METRICS = Either(Null(), Fixed(NAME, MapOf(SCORE, max_len=4096, key_len=256)))
# medseg.distributed.epoch_numbers.rank_numbers
RANK_NUMBERS = Record(
    {
        "samples": COUNT,
        "steps": COUNT,
        "bytes": COUNT,
        "wan_bytes": COUNT,
        "site_s": SECONDS,
        "wan_wait_s": SECONDS,
        "max_staleness": COUNT,
        "wall_s": SECONDS,
        "slept_s": SECONDS,
        "compute_s": SECONDS,
        "peak_rss_mb": Num(0.0, 1e12),
    }
)

SCHEMAS: dict[str, Spec] = {
    # a rank's host as horovodrun started it (HOROVOD_HOSTNAME)
    "hostname": NAME,
    # medseg.distributed.site_data.dataset_facts: header facts, no voxel, no file name
    "dataset-header": Record(
        {
            "task": Either(Str(256), Null()),
            "labels": MapOf(Str(256), max_len=1024, key_len=12),
            "modality": MapOf(Str(256), max_len=64, key_len=12),
            "channels": Either(Int(1, 1 << 16), Null()),
            "train_cases": COUNT,
            "val_cases": COUNT,
            # what each rank decides early stopping by (the session), which must agree
            "stopping": Record({"stop_at": Num(), "min_epochs": COUNT, "val_interval": Int(1, 1 << 30)}),
        }
    ),
    # a rank's measured samples per second (a positive finite number)
    "speed": Num(positive=True),
    # rank 0's groups: lists of ranks
    "groups": ListOf(ListOf(Int(0, 1 << 20), max_len=1 << 20, min_len=1), max_len=1 << 20, min_len=1),
    # seconds of a timed exchange
    "seconds": SECONDS,
    # a rank's epoch numbers and, when validation was due at sites, its site's scores (see session)
    "epoch-end": Record({"numbers": RANK_NUMBERS, "site": SITE_METRICS}),
    # where rank 0's channel store listens (sent once over Horovod, with a MAC)
    "channel-address": Record({"host": NAME, "port": Int(1, 65535)}),
}


def _no_constant(token: str) -> Any:
    raise Malformed("", f"{token} is not allowed (only finite numbers)")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise Malformed("", f"duplicate key {k[:40]!r}")
        out[k] = v
    return out


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, without recursion; :class:`Malformed` past ``limit``."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        if d > limit:
            raise Malformed("", f"nested deeper than {limit}")
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            stack += [(x, d + 1) for x in v]
    return deepest


def encode_json(value: Any) -> bytes:
    """``value`` as compact JSON bytes (tuples become lists, dict keys strings; non-finite floats are
    written as such and refused by every receiver, the sender included, so that all ranks agree)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        raise RunError(f"medseg cannot send {type(value).__name__} values between ranks: {exc}") from None


def parse_json(data: bytes, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse JSON bytes with the rules of a JSON message (size, constants, duplicate keys, depth)."""
    if len(data) > limit:
        raise Malformed("", f"{len(data)} bytes, at most {limit} allowed")
    try:
        text = bytes(data).decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_pairs)
    except Malformed:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Malformed("", f"not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    _depth(value, MAX_DEPTH)
    return value


def decode_json(data: bytes, kind: str, sender: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON message of ``kind`` from ``sender``, checked against :data:`SCHEMAS`; RunError if not."""
    spec = SCHEMAS[kind]
    try:
        value = parse_json(data, limit)
        spec.check(value)
    except Malformed as exc:
        raise refuse(sender, kind, str(exc)) from None
    return value


def check_value(value: Any, kind: str, sender: str) -> Any:
    """Check an already decoded value against ``kind``'s schema (for values that did not travel as JSON)."""
    try:
        SCHEMAS[kind].check(value)
    except Malformed as exc:
        raise refuse(sender, kind, str(exc)) from None
    return value


# -- tensor blocks --------------------------------------------------------------------------------
def manifest_of(tensors: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    out = []
    for t in tensors:
        if t.dtype not in _NAMES:
            raise RunError(
                f"medseg cannot send a {t.dtype} tensor between ranks (allowed: {', '.join(DTYPES)})"
            )
        out.append({"dtype": _NAMES[t.dtype], "shape": list(t.shape)})
    return out


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back (C order) as one uint8 tensor."""
    parts = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_manifest(manifest: Any, max_bytes: int) -> int:
    """Validate a manifest; return the payload bytes it declares (at most ``max_bytes``)."""
    if not isinstance(manifest, list) or len(manifest) > MAX_TENSORS:
        raise Malformed("tensors", f"expected a list of at most {MAX_TENSORS} tensor entries")
    total = 0
    for i, entry in enumerate(manifest):
        where = f"tensors[{i}]"
        Record({"dtype": Str(16), "shape": ListOf(Int(0, 1 << 40), max_len=MAX_NDIM)}).check(entry, where)
        if entry["dtype"] not in DTYPES:
            raise Malformed(where, f"dtype {entry['dtype']!r} is not one of {', '.join(DTYPES)}")
        total += math.prod(entry["shape"]) * _element_size(DTYPES[entry["dtype"]])
        if total > max_bytes:
            raise Malformed(where, f"the tensors declare more than {max_bytes} bytes")
    return total


def tensors_from_bytes(manifest: list[dict[str, Any]], payload: torch.Tensor) -> list[torch.Tensor]:
    """Rebuild the manifest's tensors from ``payload`` (a checked manifest; lengths must match)."""
    flat = payload.reshape(-1)
    if flat.dtype != torch.uint8:
        raise Malformed("payload", f"expected uint8 bytes, got {flat.dtype}")
    out, offset = [], 0
    for i, entry in enumerate(manifest):
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        n = math.prod(shape) * _element_size(dtype)
        if offset + n > flat.numel():
            raise Malformed(f"tensors[{i}]", "the payload is shorter than the manifest declares")
        raw = flat[offset : offset + n].clone()  # own, aligned storage for the dtype view
        if dtype == torch.bool and raw.numel() and int(raw.max()) > 1:
            raise Malformed(f"tensors[{i}]", "a bool tensor holds bytes other than 0 and 1")
        out.append(raw.view(dtype).reshape(shape) if n else torch.zeros(shape, dtype=dtype))
        offset += n
    if offset != flat.numel():
        raise Malformed("payload", f"{flat.numel()} bytes, the manifest declares {offset}")
    return out


# -- trees: state with tensors ----------------------------------------------------------------------
@dataclass(frozen=True)
class TreeKind:
    """A tree message kind: header and payload limits, and a check of the decoded object."""

    max_header: int
    max_payload: int
    check: Callable[[Any], None]


def pack_tree(obj: Any) -> tuple[bytes, torch.Tensor]:
    """``obj`` as a tree message: (JSON header bytes, uint8 payload)."""
    tensors: list[torch.Tensor] = []

    def node(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise RunError(f"medseg cannot send a value nested deeper than {MAX_DEPTH} between ranks")
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return {"t": len(tensors) - 1}
        if v is None or isinstance(v, (bool, str)) or _is_int(v):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return {"f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                if not (isinstance(k, str) or _is_int(k)):
                    raise RunError(f"medseg cannot send a dict keyed by {type(k).__name__} between ranks")
                items.append([k, node(x, depth + 1)])
            return {"d": items}
        if isinstance(v, (list, tuple)):
            return {"l" if isinstance(v, list) else "u": [node(x, depth + 1) for x in v]}
        raise RunError(f"medseg cannot send {type(v).__name__} values between ranks (not a wire type)")

    tree = node(obj, 1)
    header = json.dumps({"tree": tree, "tensors": manifest_of(tensors)}, separators=(",", ":")).encode()
    return header, tensor_bytes(tensors)


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _build(n: Any, tensors: list[torch.Tensor], used: set[int], depth: int, where: str) -> Any:
    if depth > MAX_DEPTH:
        raise Malformed(where, f"nested deeper than {MAX_DEPTH}")
    if n is None or isinstance(n, (bool, str)) or _is_int(n):
        return n
    if isinstance(n, float):
        if not math.isfinite(n):
            raise Malformed(where, "a bare non-finite number")
        return n
    if not isinstance(n, dict) or len(n) != 1:
        raise Malformed(where, "a node must be a scalar or an object with one key")
    tag, body = next(iter(n.items()))
    if tag == "t":
        if not _is_int(body) or not 0 <= body < len(tensors) or body in used:
            raise Malformed(where, f"tensor reference {body!r} is out of range or used twice")
        used.add(body)
        return tensors[body]
    if tag == "f":
        if body not in _FLOATS:
            raise Malformed(where, f"unknown float {body!r}")
        return _FLOATS[body]
    if tag in ("l", "u"):
        if not isinstance(body, list):
            raise Malformed(where, "a list node must hold a list")
        items = [_build(x, tensors, used, depth + 1, f"{where}[{i}]") for i, x in enumerate(body)]
        return items if tag == "l" else tuple(items)
    if tag == "d":
        if not isinstance(body, list):
            raise Malformed(where, "a dict node must hold a list of [key, node] pairs")
        out: dict[Any, Any] = {}
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise Malformed(where, "a dict entry must be [key, node]")
            k = pair[0]
            if not (isinstance(k, str) or _is_int(k)) or k in out:
                raise Malformed(where, f"dict key {str(k)[:40]!r} is not a string or integer, or repeats")
            out[k] = _build(pair[1], tensors, used, depth + 1, f"{where}.{k}")
        return out
    raise Malformed(where, f"unknown node tag {str(tag)[:20]!r}")


def tree_header(data: bytes, kind: TreeKind) -> tuple[Any, list[dict[str, Any]], int]:
    """Parse and check a tree header: (tree node, manifest, payload bytes it declares)."""
    header = parse_json(data, kind.max_header)
    Record({"tree": _AnyJson(), "tensors": _AnyJson()}).check(header)
    total = check_manifest(header["tensors"], kind.max_payload)
    return header["tree"], header["tensors"], total


def unpack_tree(tree: Any, manifest: list[dict[str, Any]], payload: torch.Tensor, kind: TreeKind) -> Any:
    """The object of a checked header and its payload; the kind's own check runs on the result."""
    tensors = tensors_from_bytes(manifest, payload)
    used: set[int] = set()
    obj = _build(tree, tensors, used, 1, "")
    if len(used) != len(tensors):
        raise Malformed("tensors", f"{len(tensors) - len(used)} tensor(s) are not referenced")
    kind.check(obj)
    return obj


def decode_tree(header: bytes, payload: torch.Tensor, kind_name: str, sender: str) -> Any:
    """A whole tree message of ``kind_name`` from ``sender``; RunError naming the sender if malformed."""
    kind = TREES[kind_name]
    try:
        tree, manifest, _ = tree_header(header, kind)
        return unpack_tree(tree, manifest, payload, kind)
    except Malformed as exc:
        raise refuse(sender, kind_name, str(exc)) from None


class _AnyJson(Spec):
    def check(self, value: Any, where: str = "") -> None:
        """Anything :func:`parse_json` produced (its own rules already applied)."""


# -- the declared tree kinds --------------------------------------------------------------------
RESUME_KEYS = frozenset(
    {
        "model",
        "optimizer",
        "scheduler",
        "epoch",
        "best_metric",
        "best_epoch",
        "rng",
        "config",
        "labels",
        "dist",
        "site_local",
    }
)  # medseg.training.checkpoints.checkpoint_payload: a new key there must be declared here too


def _check_shared_state(obj: Any) -> None:
    """The chief's resume state (a checkpoint), or a flag it shares (early stopping), or nothing."""
    if obj is None or isinstance(obj, bool):
        return
    if not isinstance(obj, dict):
        raise Malformed("", f"expected a checkpoint, a flag or null, got {type(obj).__name__}")
    unknown = sorted(str(k) for k in set(obj) - RESUME_KEYS)
    if unknown:
        raise Malformed("", f"undeclared checkpoint key(s) {unknown[:5]}")
    model = obj.get("model")
    if model is not None and not (
        isinstance(model, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())
    ):
        raise Malformed("model", "expected parameter names mapping to tensors")
    if "epoch" in obj and not _is_int(obj["epoch"]):
        raise Malformed("epoch", "expected an integer")


def _check_site_local(obj: Any) -> None:
    """``(site, {name: float tensor})`` or ``(site, None)``: a site's own normalisation tensors."""
    if not isinstance(obj, tuple) or len(obj) != 2 or not isinstance(obj[0], str) or len(obj[0]) > 255:
        raise Malformed("", "expected (site name, tensors)")
    local = obj[1]
    if local is None:
        return
    if not isinstance(local, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point() for k, v in local.items()
    ):
        raise Malformed("[1]", "expected names mapping to floating-point tensors")


def _any_tree(obj: Any) -> None:
    """Tests only: any tree (declared by :func:`register_tree`)."""


TREES: dict[str, TreeKind] = {
    "shared-state": TreeKind(max_header=64 << 20, max_payload=1 << 38, check=_check_shared_state),
    "site-local": TreeKind(max_header=MAX_JSON_BYTES, max_payload=256 << 20, check=_check_site_local),
}


def register_tree(name: str, check: Callable[[Any], None] = _any_tree, max_payload: int = 1 << 32) -> None:
    """Declare a tree kind (test harnesses exchange their own results this way)."""
    TREES[name] = TreeKind(max_header=16 << 20, max_payload=max_payload, check=check)

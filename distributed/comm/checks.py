"""Checks on what other sites send, before anything of it is applied.

A compromised or faulty site holds the job secret and a tunnel address, so it is an authenticated
peer; what it sends must still be checked by whoever receives it. Every received cross-site round
(gssp/ssp), every site's part of an epoch-end, local-sgd, fedavg or diloco model average, every compressed chunk's
scales and every site's reported speed and metrics pass through here first. A failing site is named
(in the log and in the :class:`~medseg.errors.RunError` that stops the job with exit status 2), and
the update is never applied: the receiver raises before touching its parameters.

The norm rule (:class:`UpdateGuard`). A received update ``u_h`` from site ``h`` (a round's model
change, a site's change since the last common model, a vector of chunk scales) is accepted iff

1. it has the expected shape and dtype,
2. every element is finite, and
3. ``||u_h|| <= K * max(median(N_h), ||u_own||, floor)``

with ``K = 100`` (:data:`K_NORM`), ``N_h`` the norms of site ``h``'s last ``M = 8``
(:data:`HISTORY`) accepted updates of the same kind (left out while there are none),
``u_own`` this site's own update of the same exchange (the same quantity, computed here, so an
honest peer of similar data and speed is within a small factor of it) and ``floor`` a small
absolute or model-relative floor so that an all-zero own update does not refuse everything.
Honest sites differ by their data and their round length (a few times, not a hundred); a
site that sends 1000x its usual change, or 1000x what everyone else sends, is refused on the first
such update. Own updates are checked for finiteness too: a non-finite own update means this site's
training diverged (its loss was NaN or Inf), and it is named as the culprit before it sends anything.

Reported numbers: a speed must be a finite number > 0 and within :data:`MAX_SPEED_RATIO` of the
receiving rank's own measured speed (speeds become round lengths and averaging weights); a site's ``val_cases`` (the weight
of its validation scores in the pooled metric that picks the best checkpoint) must be a positive
integer whenever the site reports a score.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from medseg.errors import RunError

log = logging.getLogger(__name__)

K_NORM = 100.0  # K: how many times its usual (or our own) norm an update may be
HISTORY = 8  # M: accepted norms remembered per site
MAX_SPEED_RATIO = 1000.0  # a speed this many times faster or slower than the receiver's own is refused


class UpdateRefused(RunError):
    """An update from a site failed a check; ``source`` names the site (or rank), and ``rank`` is
    the global rank that sent it when ``source`` names one (``rank 2 (site b)``), else None. The
    launcher leaves that rank's site out at a restart (``--max-restarts``) and never lets it rejoin."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(message)
        self.source = source
        found = re.match(r"rank (\d+)\b", source)
        self.rank = int(found.group(1)) if found else None


def refuse_update(source: str, what: str, why: str) -> UpdateRefused:
    msg = (
        f"{source}: its {what} was refused ({why}); nothing of it was applied and no checkpoint was "
        "written after it. The job stops (with --max-restarts it goes on without that site): check that "
        "site (diverged training, damaged data, or tampering)"
    )
    log.error("%s", msg)
    return UpdateRefused(source, msg)


def check_tensor(
    t: Any, source: str, what: str, shape: Sequence[int] | None, dtype: torch.dtype | None
) -> None:
    """Rules 1 and 2: a tensor of ``shape`` and ``dtype`` (None: any) whose elements are all finite."""
    if not isinstance(t, torch.Tensor):
        raise refuse_update(source, what, f"not a tensor but {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise refuse_update(source, what, f"shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise refuse_update(source, what, f"dtype {t.dtype}, expected {dtype}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise refuse_update(source, what, f"{bad} of its {t.numel()} values are NaN or Inf")


class UpdateGuard:
    """The norm rule of the module docstring for one kind of update (``what``), per source.

    :meth:`check` looks at every source's update of one exchange, refuses the first failing one,
    and only when all pass records their norms (so a refused exchange leaves the history as it was).

    Args:
        what: what the updates are, for messages ("cross-site round", "epoch-end average").
        k: K of the rule.
        history: M of the rule.
        floor: the absolute floor of the rule.
    """

    def __init__(self, what: str, k: float = K_NORM, history: int = HISTORY, floor: float = 1e-12) -> None:
        self.what, self.k, self.floor = what, float(k), float(floor)
        self.history = history
        self.norms: dict[str, collections.deque[float]] = {}

    def bound(self, source: str, own_norm: float | None, floor: float | None = None) -> float:
        """``K * max(median(N_source), own_norm, floor)``."""
        past = self.norms.get(source)
        ref = [statistics.median(past)] if past else []
        if own_norm is not None and math.isfinite(own_norm):
            ref.append(own_norm)
        return self.k * max([*ref, self.floor if floor is None else max(floor, self.floor)])

    def check(
        self,
        updates: Sequence[torch.Tensor],
        sources: Sequence[str],
        own: int | None = None,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = torch.float32,
        floor: float | None = None,
    ) -> list[float]:
        """Check every update (``updates[own]`` is this site's, the reference); return their norms.

        Raises :class:`UpdateRefused` naming the first failing source (this site's own first: a
        non-finite own update is this site's failure, not a peer's).
        """
        order = ([own] if own is not None else []) + [i for i in range(len(updates)) if i != own]
        for i in order:
            check_tensor(updates[i], sources[i], self.what, shape, dtype)
        norms = [float(torch.linalg.vector_norm(u.detach().double())) for u in updates]
        own_norm = norms[own] if own is not None else None
        for i, (src, n) in enumerate(zip(sources, norms)):
            if i == own:
                continue
            limit = self.bound(src, own_norm, floor)
            if not n <= limit:
                ref = self.norms.get(src)
                raise refuse_update(
                    src,
                    self.what,
                    f"norm {n:.4g} exceeds {limit:.4g} = {self.k:g} x max(median of its last "
                    f"{len(ref) if ref else 0} accepted norms "
                    f"{statistics.median(ref) if ref else float('nan'):.4g}, this site's own "
                    f"{own_norm if own_norm is not None else float('nan'):.4g}, floor)",
                )
        for src, n in zip(sources, norms):
            self.norms.setdefault(src, collections.deque(maxlen=self.history)).append(n)
        return norms


def check_speeds(speeds: Sequence[Any], sources: Sequence[str], own: int) -> list[float]:
    """Every rank's measured samples/s: finite, > 0, and within :data:`MAX_SPEED_RATIO` of this rank's
    own measured speed (``speeds[own]``, the one figure this rank knows to be honest)."""
    out = []
    for v, src in zip(speeds, sources):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        if not ok:
            raise refuse_update(src, "measured speed", f"{v!r} samples/s is not a finite number > 0")
        out.append(float(v))
    mine = out[own]
    for v, src in zip(out, sources):
        if not mine / MAX_SPEED_RATIO <= v <= mine * MAX_SPEED_RATIO:
            raise refuse_update(
                src,
                "measured speed",
                f"{v:.4g} samples/s is more than {MAX_SPEED_RATIO:g}x from this rank's own {mine:.4g}",
            )
    return out


def check_site_metrics(site: str, metrics: dict[str, Any]) -> None:
    """A site's validation scores: finite numbers or None (schema), and ``val_cases`` a positive
    integer whenever it reports a score (it weighs the site in the pooled metric)."""
    n = metrics.get("val_cases")
    scored = any(isinstance(v, float) for k, v in metrics.items() if k != "val_cases")
    if n is None and not scored:
        return
    if not (isinstance(n, int) and not isinstance(n, bool)) or n < (1 if scored else 0):
        raise refuse_update(
            f"site {site}",
            "validation scores",
            f"val_cases {n!r} must be a positive integer (it weighs the site's scores)",
        )
    for k, v in metrics.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise refuse_update(f"site {site}", "validation scores", f"{k} = {v} is not finite")


def check_site_entries(
    entries: Sequence[Any], rank_sites: Sequence[str], describe: Callable[[int], str], what: str
) -> None:
    """Each rank's ``(site, ...)`` entry (or None) names the rank's own site: a rank speaks for its
    own site only."""
    for r, entry in enumerate(entries):
        if entry is not None and entry[0] != rank_sites[r]:
            raise refuse_update(describe(r), what, f"they claim to be site {entry[0]!r}'s")


def check_local_norm(
    states: Sequence[Any], reference: dict[str, torch.Tensor], describe: Callable[[int], str]
) -> None:
    """Every site's own normalisation tensors (``(site, {name: tensor})``): the names, shapes and
    dtypes of ``reference`` (this rank's own), finite values."""
    for r, (_, local) in enumerate(states):
        if local is None:
            continue
        if set(local) != set(reference):
            raise refuse_update(describe(r), "normalisation tensors", "their names differ from this model's")
        for name, t in local.items():
            ref = reference[name]
            check_tensor(t, describe(r), f"normalisation tensor {name}", tuple(ref.shape), ref.dtype)


def check_trained(named: Sequence[tuple[str, torch.Tensor]], who: str = "this rank") -> None:
    """After an epoch's steps: every parameter and float buffer finite, else the training diverged.

    Raised before the epoch's checkpoint is written, so ``last.pt`` keeps the last good epoch.
    """
    floats = [(name, t) for name, t in named if t.is_floating_point()]
    if not floats or bool(torch.stack([torch.isfinite(t).all() for _, t in floats]).all()):
        return
    for name, t in floats:
        if not bool(torch.isfinite(t).all()):
            raise RunError(
                f"training diverged on {who}: {name} holds NaN or Inf after this epoch's steps (the training "
                "loss was not finite). The epoch's checkpoint was not written, checkpoints/last.pt keeps the "
                "last good epoch; lower train.lr or check the data, then --resume"
            )


def check_gradients(params: Sequence[torch.Tensor], who: str) -> None:
    """Before an optimizer step: every gradient finite, else the loss was NaN/Inf (nothing is stepped)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        raise RunError(
            f"training diverged on {who}: a gradient holds NaN or Inf (the training loss was not finite); "
            "the step was not taken and no checkpoint was written after it. Lower train.lr or check "
            "the data, then --resume from checkpoints/last.pt"
        )

"""Score a trained bundle on labelled cases, in each case's original geometry.

Every case goes through :func:`medseg.inference.predict.predict`, the path users run, and is compared with its
label on the label's own grid: Dice and 95th-percentile Hausdorff distance (mm, with the voxel
spacing taken from the affine) per foreground class for segmentation; ROC-AUC and accuracy for
classification.

What each file holds: ``<run>/eval-<dataset>.json`` is this machine's own record: the run and dataset
folders' full paths, the summary, and one row per case named by its image file (``case``), so that a
poor case can be found. ``<run>/eval-sites.json`` holds per site only the summary, the case count and
the dataset folder. Both are written beside the bundle, never into ``bundle/``: a bundle carries no
case names (:mod:`medseg.bundle.export`); share an ``eval-*.json`` only after reading it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.metrics import DiceMetric
from monai.networks.utils import one_hot
from tqdm import tqdm

from medseg.bundle.load import Bundle, load_bundle, site_names, use_site
from medseg.config import load_config, with_infer_overrides
from medseg.datasets import checks
from medseg.datasets.decathlon import load_dataset, split_train_val
from medseg.errors import DataError, MedsegError
from medseg.inference.io import load_image
from medseg.inference.predict import predict
from medseg.training.tasks import classification_metrics, hausdorff95


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _training_data_dir(bundle: Bundle) -> str:
    """The run's dataset folder: from the run folder's own ``config.yaml`` (full path, this machine's),
    else the bundle's ``data.dir`` (a base name unless the run set ``data.share_paths``)."""
    local = bundle.path.parent / "config.yaml"
    if local.is_file():
        try:
            return load_config(local).data.dir
        except MedsegError:
            pass
    return bundle.config.data.dir


def _cases(bundle: Bundle, data_dir: str | Path | None) -> tuple[str, list[dict[str, Any]]]:
    """The labelled cases to score: all of ``data_dir``, or the run's own validation split."""
    cfg = bundle.config
    if data_dir is not None:
        info = load_dataset(data_dir)
        source, items = f"{info.root} (all {len(info.training)} labelled cases)", info.training
    else:
        folder = _training_data_dir(bundle)
        try:
            info = load_dataset(folder)
        except DataError as exc:
            raise DataError(
                f"{exc}; a bundle names its training data by folder name only ({folder!r}) unless the run "
                "set data.share_paths: pass --data DIR with the dataset's folder"
            ) from None
        _, items = split_train_val(info.training, cfg.data.val_fraction, cfg.train.seed)
        source = f"{info.root} (validation split, {len(items)} cases)"
    if info.task != cfg.task:
        raise DataError(
            f"{info.json_path}: holds a {info.task} dataset but model {bundle.name} does {cfg.task}"
        )
    if not items:
        raise DataError(f"{info.json_path}: no labelled cases to evaluate on")
    # the checks of `medseg data validate`, against the labels the model was trained with
    checks.check_training_items(
        items, bundle.labels, cfg.task, str(info.json_path), f"run `medseg data validate {info.root}`"
    )
    return source, items


def _seg_case(bundle: Bundle, item: dict[str, Any]) -> dict[str, Any]:
    image = load_image(item["image"])
    truth = load_image(item["label"])
    if truth.shape[1:] != image.shape[1:]:
        raise DataError(
            f"{item['label']}: shape {tuple(truth.shape[1:])} differs from its image {tuple(image.shape[1:])}"
        )
    pred = predict(bundle, image).label
    n = len(bundle.labels)
    p, t = one_hot(pred[None].long(), n), one_hot(truth[None].round().long(), n)
    spacing = np.linalg.norm(np.asarray(image.affine)[:3, :3], axis=0).tolist()
    dice = DiceMetric(include_background=False, ignore_empty=True)(p, t)[0].tolist()
    hd = hausdorff95(p, t, spacing)[0].tolist()
    row: dict[str, Any] = {"case": Path(item["image"]).name}
    for k, d, h in zip([k for k in sorted(bundle.labels) if k != 0], dice, hd):
        row[f"dice_{bundle.labels[k]}"] = d if math.isfinite(d) else None
        row[f"hd95_{bundle.labels[k]}"] = h if math.isfinite(h) else None
    row["dice"] = _mean([row[f"dice_{bundle.labels[k]}"] for k in bundle.labels if k != 0])
    return row


def evaluate(
    run: str | Path,
    data_dir: str | Path | None = None,
    progress: bool = True,
    site: str | None = None,
    trust: bool = False,
    infer: list[str] | None = None,
) -> dict[str, Any]:
    """Score the run's bundle; write ``<run>/eval-<dataset>.json`` and return the same mapping.

    ``site``: for a bundle trained with ``dist.local_norm``, score with that site's own
    normalisation tensors (the site's model); otherwise ignored. ``trust``: see
    :func:`medseg.bundle.load.load_bundle`. ``infer``: ``infer.*=value`` overrides of the bundle's
    inference settings (test-time mirroring, connected components, windows)."""
    bundle = load_bundle(run, trust=trust)
    bundle.config = with_infer_overrides(bundle.config, infer or [])
    if site is not None and site in site_names(bundle):
        use_site(bundle, site)
    source, items = _cases(bundle, data_dir)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any]
    if bundle.task == "segmentation":
        for item in tqdm(items, desc="evaluate", unit="case", disable=not progress, leave=False):
            rows.append(_seg_case(bundle, item))
        keys = [k for k in rows[0] if k != "case"]
        summary = {k: _mean([r[k] for r in rows]) for k in keys}
    else:
        names = [bundle.labels[k] for k in sorted(bundle.labels)]
        probs = []
        for item in tqdm(items, desc="evaluate", unit="case", disable=not progress, leave=False):
            p = predict(bundle, load_image(item["image"])).probabilities
            probs.append([p[n] for n in names])
            rows.append(
                {
                    "case": Path(item["image"]).name,
                    "label": names[int(item["label"])],
                    **{f"p_{n}": v for n, v in p.items()},
                }
            )
        metrics = classification_metrics(
            torch.tensor(probs), torch.tensor([int(i["label"]) for i in items]), len(names)
        )
        summary = {"auc": metrics["val_auc"], "accuracy": metrics["val_accuracy"]}
    result = {
        "run": str(bundle.path.parent),
        "data": source,
        "task": bundle.task,
        "summary": summary,
        "cases": rows,
    }
    run_dir = bundle.path.parent
    name = Path(data_dir).name if data_dir is not None else "val"
    out = run_dir / f"eval-{name}.json"
    _write_json(out, result)
    result["path"] = str(out)
    return result


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON under a temporary name beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


#: a table wider than this many characters is printed one line per metric instead of one per case
TABLE_WIDTH = 200


def _cell(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))


def _table(corner: str, rows: list[tuple[str, list[Any]]], columns: list[str], fit: bool = True) -> str:
    """Fixed-width text: ``corner`` and ``columns`` as the header, then one line per (name, values).

    Every column is as wide as its whole name (at least 12), so no name is cut: metric names carry the
    class names, and cutting them made, e.g., ``dice_iliac_artery_left`` and ``hd95_iliac_artery_left``
    the same header. When one line per row would be wider than :data:`TABLE_WIDTH` (many classes),
    the table is transposed (``fit``): one line per column name, one column per row name.
    """
    first = max(len(corner), *(len(name) for name, _ in rows))
    widths = [max(12, len(c)) for c in columns]
    if fit and first + sum(w + 1 for w in widths) > TABLE_WIDTH:
        flipped = [(c, [values[i] for _, values in rows]) for i, c in enumerate(columns)]
        return _table("metric", flipped, [name for name, _ in rows], fit=False)
    lines = [corner.ljust(first) + "".join(" " + c.rjust(w) for c, w in zip(columns, widths))]
    lines += [
        name.ljust(first) + "".join(" " + _cell(v).rjust(w) for v, w in zip(values, widths))
        for name, values in rows
    ]
    return "\n".join(lines)


def format_result(result: dict[str, Any]) -> str:
    """A fixed-width table of per-case rows and the mean row (transposed for many classes, see :func:`_table`)."""
    rows = result["cases"]
    keys = [k for k in rows[0] if k != "case"]
    summary = result["summary"]
    table = [(r["case"], [r[k] for k in keys]) for r in rows] + [("mean", [summary.get(k) for k in keys])]
    lines = [_table("case", table, keys)]
    if result["task"] == "classification":
        lines.append(f"AUC {summary['auc']:.4f}  accuracy {summary['accuracy']:.4f}")
    return "\n".join(lines)


def parse_data_args(values: list[str]) -> list[tuple[str, Path]]:
    """``--data`` values, ``DIR`` or ``NAME=DIR``, as (name, folder); the name defaults to the folder's."""
    out = []
    for v in values:
        name, sep, folder = v.partition("=")
        out.append((name, Path(folder)) if sep and name else (Path(v).name, Path(v)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise DataError(f"--data: two datasets share a name ({', '.join(names)}); write NAME=DIR for each")
    return out


def evaluate_sites(
    run: str | Path,
    datasets: list[tuple[str, Path]],
    progress: bool = True,
    trust: bool = False,
    infer: list[str] | None = None,
) -> dict[str, Any]:
    """Score the bundle on several sites' datasets: one summary row per site and a pooled row.

    A site whose name the bundle holds own normalisation state for (``dist.local_norm``) is scored
    with it. Pooled: each metric's mean over all sites' cases together (cases, not sites, weigh
    equally); for classification, the case-weighted mean of the sites' AUC and accuracy. Writes
    ``<run>/eval-sites.json``.
    """
    per_site: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    task = None
    for name, folder in datasets:
        result = evaluate(run, folder, progress=progress, site=name, trust=trust, infer=infer)
        task = result["task"]
        per_site[name] = {**result["summary"], "cases": len(result["cases"]), "data": result["data"]}
        rows += result["cases"]
    keys = [k for k in next(iter(per_site.values())) if k not in ("cases", "data")]
    if task == "segmentation":
        pooled = {k: _mean([r.get(k) for r in rows]) for k in keys}
    else:
        n = sum(s["cases"] for s in per_site.values())
        pooled = {k: sum((s[k] or 0.0) * s["cases"] for s in per_site.values()) / n for k in keys}
    out = {"run": str(run), "task": task, "sites": per_site, "pooled": {**pooled, "cases": len(rows)}}
    bundle_dir = load_bundle(run, trust=trust).path.parent
    path = bundle_dir / "eval-sites.json"
    _write_json(path, out)
    out["path"] = str(path)
    return out


def format_sites(result: dict[str, Any]) -> str:
    """Sites against metrics: one row per site, then the pooled row."""
    keys = ["cases"] + [k for k in result["pooled"] if k != "cases"]
    named = list(result["sites"].items()) + [("pooled", result["pooled"])]
    return _table("site", [(name, [m.get(k) for k in keys]) for name, m in named], keys)

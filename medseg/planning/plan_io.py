"""A plan on disk and on the screen: its YAML with each choice's reason above it, and ``--verify``.

``--verify`` trains two steps (a warm-up and the measured one) of the planned network at the planned
patch and batch, in a fresh process, and reports the measured peak against the prediction and the
budget.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

from medseg.config import config_from_dict, load_config
from medseg.errors import MedsegError
from medseg.planning.memory_model import run_measure
from medseg.planning.planner import Plan


def to_yaml(p: Plan) -> str:
    """The config as YAML, each planned choice preceded by a comment naming its facts."""
    c = p.comments
    out = [
        f"# Planned by `medseg plan` for {p.fingerprint['dataset']} ({p.fingerprint['num_cases']} training cases, "
        f"{p.fingerprint['modality']}) on {p.device}" + (" with fused kernels" if p.fused else "") + ".",
        "# Fingerprint: medseg_fingerprint.json in the dataset folder. Each choice's reason is above it.",
    ]
    for key in ("memory model", "time"):
        if key in c:
            out += _wrap(f"{key}: {c[key]}", "")
    for note in p.notes:
        out += _wrap(note, "")
    cfg = p.config
    for section in ("name", "task"):
        out.append(f"{section}: {_scalar(cfg[section])}")
    for section in ("data", "transforms", "model", "train", "infer"):
        if section not in cfg:
            continue
        if section in c:
            out += _wrap(c[section], "")
        out.append(f"{section}:")
        for key, value in cfg[section].items():
            why = c.get(f"{section}.{key}")
            if why:
                out += _wrap(why, "  ")
            if isinstance(value, dict):
                out.append(f"  {key}:")
                out += [f"    {k}: {_scalar(v)}" for k, v in value.items()]
            else:
                out.append(f"  {key}: {_scalar(value)}")
    return "\n".join(out) + "\n"


def _scalar(value: Any) -> str:
    """A scalar or a flat list in YAML flow form (JSON is YAML)."""
    return json.dumps(value)


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width - len(indent) - 2)]


def write_plan(p: Plan, out: str | Path) -> Path:
    """Write the YAML (temporary name, then rename) after checking that it loads as a config."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(to_yaml(p))
        load_config(tmp)  # the plan must be a config `medseg train` accepts as it is
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def verify(p: Plan) -> dict[str, Any]:
    """Two training steps at the planned patch and batch in a fresh process: measured vs predicted peak."""
    from medseg.models import network_def

    if p.memory is None:
        raise MedsegError("--verify: this plan has no measured memory model (classification)")
    cfg = config_from_dict(p.config)
    classes = len(p.fingerprint["labels"])
    nd = network_def(cfg, out_channels=classes)
    batch = cfg.train.batch_size * max(cfg.transforms.num_samples, 1)  # patches per training step
    r = run_measure(nd, list(cfg.transforms.patch), batch, p.memory.variant, p.device, classes, 1)
    measured_total = r["peak_bytes"] + r["static_bytes"]
    result = {
        "net": cfg.model.name,
        "variant": p.memory.variant,
        "patch": list(cfg.transforms.patch),
        "batch": batch,
        "predicted_step_peak_bytes": p.predicted_step_peak,
        "measured_step_peak_bytes": r["peak_bytes"],
        "predicted_total_bytes": p.predicted_total,
        "measured_total_bytes": measured_total,
        "budget_bytes": p.budget_bytes,
        "error": (p.predicted_total - measured_total) / measured_total,
        "step_error": (p.predicted_step_peak - r["peak_bytes"]) / r["peak_bytes"],
        "within_budget": measured_total <= p.budget_bytes,
        "measured_step_s": r["step_s"],
        "predicted_step_s": p.predicted_step_s,
    }
    p.verify = result
    return result


def format_verify(v: dict[str, Any]) -> str:
    """One line: measured against predicted peak, and against the budget."""
    mb = 2**20
    return (
        f"verify: {v['net']} ({v['variant']}) patch {'x'.join(map(str, v['patch']))} batch {v['batch']}: "
        f"measured peak {v['measured_total_bytes'] / mb:.0f} MiB (step {v['measured_step_peak_bytes'] / mb:.0f} MiB "
        f"+ weights, AdamW state, batch), predicted {v['predicted_total_bytes'] / mb:.0f} MiB "
        f"({v['error']:+.1%}; step alone {v['step_error']:+.1%}), budget {v['budget_bytes'] / mb:.0f} MiB: "
        f"{'within' if v['within_budget'] else 'OVER'} budget"
    )

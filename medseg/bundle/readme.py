"""The bundle's ``docs/README.md``: inputs, outputs, intended use, validation data, limits, how to run."""

from __future__ import annotations

from typing import Any

from medseg import __version__
from medseg.bundle.metadata import CLS_FILENAME, SEG_POSTFIX, dataset_label, intensity_text, modality_of
from medseg.config import Config

LIMITS = """\
- Trained on `{dataset}`; other scanners, protocols, fields of view
  or anatomies are untested.
- `configs/inference.json` reads NIfTI with nibabel. DICOM series are read by medseg (`medseg infer`),
  which checks slice positions; convert them first (`medseg data convert`) to use MONAI alone.
- Intended for research use only; not a medical device."""

MONAI_RUN = """\
From this folder; needs `monai`, `torch`, `nibabel`, `pytorch-ignite` and `fire` (see `configs/metadata.json`).

```bash
python -m monai.bundle run --config_file configs/inference.json --bundle_root . \\
    --dataset_dir /path/to/niftis --output_dir /path/to/out
# or one file / a list of files:
python -m monai.bundle run --config_file configs/inference.json --bundle_root . \\
    --input /path/to/scan.nii.gz --output_dir /path/to/out
```

`--device "\\$torch.device('cpu')"` forces the CPU; `--num_workers 4` loads cases in parallel."""

WITH_MEDSEG = """\
`medseg infer --run <run folder> --input scan.nii.gz --output mask.nii.gz`, `medseg evaluate`, or
the viewer (`medseg app`); medseg reads `configs/medseg.json` and gives the same result."""


def readme(
    cfg: Config,
    labels: dict[int, str],
    metrics: dict[str, Any],
    epoch: int,
    validation: dict[str, Any],
    torchscript_problem: str | None,
) -> str:
    """The README's Markdown, one section per concern."""
    names = ", ".join(f"{k} = {v}" for k, v in labels.items())
    sections = [
        f"# {cfg.name}",
        f"{cfg.task.capitalize()} model ({cfg.model.name}) trained with medseg {__version__} on "
        f"`{dataset_label(validation)}`.\n"
        "Research and development only; not for clinical decisions.",
        "## Input",
        _input(cfg, validation),
        "## Output",
        _output(cfg, names),
        f"Labels: {names}.",
        "## Validation",
        f"Weights of epoch {epoch}, chosen on {_cases_line(cfg, validation)}.",
        _metrics_list(metrics),
        "## Limits",
        LIMITS.format(dataset=dataset_label(validation)),
        "## Running with MONAI alone (no medseg)",
        MONAI_RUN,
        "## TorchScript",
        _torchscript(cfg, torchscript_problem),
        "## With medseg",
        WITH_MEDSEG,
    ]
    return "\n\n".join(sections) + "\n"


def _input(cfg: Config, validation: dict[str, Any]) -> str:
    """The input format, the preprocessing in words and what the network sees."""
    t = cfg.transforms
    if cfg.task == "segmentation":
        shaping = ""
        sees = (
            f"sliding window {list(t.patch)}, overlap {cfg.infer.overlap}, {cfg.infer.mode} blending, "
            f"{cfg.infer.sw_batch_size} windows per batch"
        )
    else:
        shaping = (
            f", the object's bounding box resized to fit {list(t.patch)} voxels"
            if t.roi == "object"
            else f", pad or crop to {list(t.patch)} voxels"
        )
        sees = f"the whole volume, padded or cropped to {list(t.patch)} voxels"
    return (
        f"One 3D volume per case, one channel (modality {modality_of(validation)}), as NIfTI (`.nii`, `.nii.gz`).\n"
        f"Preprocessing: orient to RAS, resample to {list(t.spacing)} mm (bilinear), intensities\n"
        f"{intensity_text(cfg)}{shaping}.\n"
        f"No foreground cropping at inference. The network sees {sees}."
    )


def _output(cfg: Config, names: str) -> str:
    """The files inference.json writes."""
    if cfg.task == "segmentation":
        return (
            f"`<output_dir>/<input name>_{SEG_POSTFIX}.nii.gz`: a uint8 label map ({names}) with the input's "
            "shape and affine. The class probabilities are computed on the resampled grid, mapped back onto "
            "the input grid (bilinear, `Invertd`) and then arg-maxed."
        )
    return (
        f"`<output_dir>/{CLS_FILENAME}`: one row per input, the file name followed by the softmax "
        f"probability of each class in label order ({names}); no header."
    )


def _cases_line(cfg: Config, validation: dict[str, Any]) -> str:
    """The validation cases the weights were chosen on (file names only with ``data.share_paths``),
    or the split when they are unknown."""
    cases = validation.get("cases")
    folder = validation.get("dataset_dir", "")
    if not cases:
        return f"the validation split of `{folder}` (fraction {cfg.data.val_fraction})"
    line = (
        f"{len(cases)} held-out cases of `{dataset_label(validation)}` "
        f"(folder `{folder}`, fraction {cfg.data.val_fraction}, split seed {cfg.train.seed})"
    )
    if not cfg.data.share_paths:
        return line + "; their file names are not part of the bundle (`data.share_paths: false`)"
    return line + ": " + ", ".join(cases)


def _metrics_list(metrics: dict[str, Any]) -> str:
    shown = "\n".join(
        f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in metrics.items()
    )
    return shown or "- no validation metrics"


def _torchscript(cfg: Config, problem: str | None) -> str:
    """How to export the network to TorchScript, or why it cannot be."""
    if problem is None:
        return (
            "The network scripts with `torch.jit.script`, so MONAI can export it to TorchScript:\n\n"
            "```bash\npython -m monai.bundle ckpt_export network_def --filepath models/model.ts \\\n"
            "    --ckpt_file models/model.pt --meta_file configs/metadata.json "
            "--config_file configs/inference.json --bundle_root .\n```"
        )
    return (
        f"**TorchScript: this network ({cfg.model.name}) cannot be scripted** "
        f"(`torch.jit.script` fails with `{problem}`), so `monai.bundle ckpt_export` "
        "does not work for it; use `models/model.pt` with `network_def`."
    )

"""The models the viewer offers: every MONAI bundle under the runs folders and under a folder the
user names inside them.

Listing reads only each bundle's ``configs/metadata.json`` and ``configs/medseg.json``; the
network itself is built by ``medseg.bundle.load.load_bundle`` when a model is chosen (the app caches
that with ``st.cache_resource``). The runs folders are the server's (``medseg app --runs``,
``MEDSEG_APP_RUNS``); a folder typed into the page is taken only when it lies inside one of them
once symlinks and ``..`` are resolved (:func:`allowed_folder`), so a browser cannot make the
server read, or load a model from, any other folder.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medseg.bundle.load import find_bundle, read_network_def, read_settings
from medseg.errors import ConfigError, DataError, RunError

log = logging.getLogger(__name__)

NIFTI_GLOBS = ("*.nii.gz", "*.nii")


@dataclass(frozen=True)
class ModelInfo:
    """What the model list shows about one bundle."""

    bundle: Path
    name: str
    task: str  # "segmentation" or "classification"
    network: str
    labels: dict[int, str]
    spacing: tuple[float, ...]
    patch: tuple[int, ...]
    window: tuple[float, ...]
    metrics: dict[str, Any] = field(default_factory=dict)
    data_dir: str = ""
    mtime: float = 0.0  # of models/model.pt: a retrained bundle is a new cache entry
    # where the weights were selected (metadata.json "validated_on"): dataset name, its modality,
    # training and validation case counts, best epoch; and evaluations written beside the bundle
    modality: str = ""
    dataset_name: str = ""
    n_train: int | None = None
    n_val: int | None = None
    best_epoch: int | None = None
    evaluations: tuple[dict[str, Any], ...] = ()
    intensity: str = ""  # how the model normalises intensities (transforms.normalize), in words
    channels: int = 1  # input channels (metadata.json network_data_format.inputs.image.num_channels)

    @property
    def title(self) -> str:
        return f"{self.name} ({self.task})"


def _local_data_dir(root: Path, cfg: dict) -> str:
    """The training data's folder: from the run's own config.yaml beside the bundle (on the machine
    that trained it), else the bundle's settings, which name only the folder's base name."""
    import yaml

    local = root.parent / "config.yaml"
    if local.is_file():
        try:
            return str((yaml.safe_load(local.read_text()) or {}).get("data", {}).get("dir", ""))
        except (OSError, yaml.YAMLError, AttributeError):
            pass
    return str(cfg.get("data", {}).get("dir", ""))


def read_info(path: str | Path) -> ModelInfo:
    """Describe the bundle at ``path`` (a run folder or a bundle folder) from its JSON files."""
    root = find_bundle(path)
    read_network_def(root)  # an unsafe bundle is listed as a problem, never offered
    try:
        meta = json.loads((root / "configs" / "metadata.json").read_text())
        cfg = read_settings(root)
        mtime = (root / "models" / "model.pt").stat().st_mtime
        val = dict(meta.get("validated_on") or {})
        modality = val.get("modality") or {}
        if isinstance(modality, dict):
            modality = modality.get("0", next(iter(modality.values()), ""))
        return ModelInfo(
            bundle=root.resolve(),
            name=str(meta.get("name", root.parent.name)),
            task=str(cfg["task"]),
            network=str(cfg["model"]["name"]),
            labels={int(k): str(v) for k, v in meta["medseg_labels"].items()},
            spacing=tuple(float(v) for v in cfg["transforms"]["spacing"]),
            patch=tuple(int(v) for v in cfg["transforms"]["patch"]),
            window=tuple(float(v) for v in cfg["transforms"]["window"]),
            metrics=dict(meta.get("medseg_metrics") or {}),
            data_dir=_local_data_dir(root, cfg),
            mtime=mtime,
            modality=str(modality or ""),
            dataset_name=str(val.get("dataset_name", "")),
            n_train=val.get("num_training_cases"),
            n_val=len(val["cases"]) if isinstance(val.get("cases"), list) else None,
            best_epoch=val.get("best_epoch"),
            evaluations=tuple(_evaluations(root.parent)),
            intensity=_intensity(cfg),
            channels=_input_channels(meta),
        )
    except (OSError, KeyError, TypeError, ValueError, ConfigError) as e:
        raise RunError(f"{root}: bundle metadata is incomplete ({type(e).__name__}: {e})") from None


def _input_channels(meta: dict[str, Any]) -> int:
    """The input channels the network takes, as its metadata says (1 when it does not)."""
    image = ((meta.get("network_data_format") or {}).get("inputs") or {}).get("image") or {}
    try:
        return int(image.get("num_channels", 1))
    except (TypeError, ValueError):
        return 1


# the words datasets and DICOM headers use for a modality -> one code per kind of scanner
_MODALITY_CODES = {
    "CT": "CT",
    "MR": "MR",
    "MRI": "MR",
    "PT": "PT",
    "PET": "PT",
    "US": "US",
    **{w: "MR" for w in ("T1", "T1W", "T1GD", "T1C", "T2", "T2W", "FLAIR", "ADC", "DWI", "PD", "SWI")},
}
NOT_CT = "not CT"  # a NIfTI image whose intensities are not Hounsfield units (modality not stored)


def modality_code(text: str) -> str:
    """One code per kind of scanner ("MRI", "T2" -> "MR"; "CT"; "PET" -> "PT"), "" when unknown."""
    word = str(text or "").strip().upper().replace("-", "").replace(" ", "")
    return _MODALITY_CODES.get(word, word)


def modality_fit(model: str, image: str) -> int:
    """2 when the model's and the image's modality agree, 0 when they differ, 1 when either is unknown.

    ``image`` may be :data:`NOT_CT` (a NIfTI file, which stores no modality, whose intensities are
    not Hounsfield units): that differs from CT and may be anything else.
    """
    want, given = modality_code(model), image if image == NOT_CT else modality_code(image)
    if not want or not given:
        return 1
    if given == NOT_CT:
        return 0 if want == "CT" else 1
    return 2 if want == given else 0


def fit(info: ModelInfo, channels: int, modality: str) -> tuple[int, int, int]:
    """How well ``info``'s model fits an image, compared in this order: whether it takes the image's
    channel count, whether its training modality matches (:func:`modality_fit`), whether it
    segments (what the viewer draws and corrects) rather than classifies."""
    return (
        int(info.channels == channels),
        modality_fit(info.modality, modality),
        int(info.task == "segmentation"),
    )


def best_model(models: list[ModelInfo], channels: int, modality: str, current: ModelInfo) -> ModelInfo:
    """The model that fits an image best (:func:`fit`); ``current`` when none fits better."""
    return max(models, key=lambda m: (fit(m, channels, modality), m.bundle == current.bundle))


def fit_reason(info: ModelInfo, channels: int, modality: str) -> str:
    """Why ``info``'s model was chosen for an image, in words ("it segments CT images with 1
    channel, like this one")."""
    verb = "segments" if info.task == "segmentation" else "classifies"
    what = f"{modality_code(info.modality)} images" if modality_code(info.modality) else "images"
    channel_text = f"{info.channels} channel{'s' if info.channels != 1 else ''}"
    alike = modality_fit(info.modality, modality) > 0 and info.channels == channels
    return f"it {verb} {what} with {channel_text}, {'like this one' if alike else 'the closest match here'}"


def dataset_facts(root: str | Path) -> dict[str, str]:
    """Name and description from a dataset folder's ``dataset.json`` ({} when it is not on this machine)."""
    try:
        data = json.loads((Path(root) / "dataset.json").read_text())
        return {"name": str(data.get("name", "")), "description": str(data.get("description", ""))}
    except (OSError, ValueError, AttributeError):
        return {}


def is_synthetic(*texts: str) -> bool:
    """Whether a dataset's name or description calls it synthetic (medseg's own say "synthetic"/"Synth")."""
    return any("synth" in t.lower() for t in texts if t)


def _evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """``medseg evaluate`` results beside the bundle (``eval-<dataset>.json``): where, how many, what."""
    found = []
    for p in sorted(run_dir.glob("eval-*.json")):
        try:
            data = json.loads(p.read_text())
            root = str(data.get("data", "")).split(" (")[0]
            facts = dataset_facts(root) if root else {}
            found.append(
                {
                    "dataset": facts.get("name") or p.stem[5:],
                    "folder": Path(root).name if root else p.stem[5:],
                    "split": "validation split" if p.stem == "eval-val" else "all labelled cases",
                    "synthetic": is_synthetic(p.stem, root, *facts.values()),
                    "cases": len(data.get("cases") or []),
                    "summary": dict(data.get("summary") or {}),
                }
            )
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("%s: not read (%s)", p, e)
    return found


def _intensity(cfg: dict[str, Any]) -> str:
    from medseg.bundle.metadata import intensity_text
    from medseg.config import config_from_dict

    return intensity_text(config_from_dict(cfg))


def list_models(folders: list[str | Path]) -> tuple[list[ModelInfo], list[str]]:
    """Bundles found in ``folders`` (each a bundle, a run folder, or a folder of run folders).

    Returns the models sorted by name and a list of problems (unreadable bundles, missing folders)
    to show beside the list.
    """
    models: dict[Path, ModelInfo] = {}
    problems: list[str] = []
    for folder in folders:
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            problems.append(f"{folder}: no such folder")
            continue
        candidates = [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]
        for cand in candidates:
            if not (
                (cand / "configs" / "metadata.json").is_file()
                or (cand / "bundle" / "configs" / "metadata.json").is_file()
            ):
                continue
            try:
                info = read_info(cand)
            except RunError as e:
                problems.append(str(e))
                continue
            models.setdefault(info.bundle, info)
    return sorted(models.values(), key=lambda m: (m.name, str(m.bundle))), problems


def demo_cases(info: ModelInfo, extra: list[str | Path] = (), limit: int = 20) -> list[Path]:
    """NIfTI cases to try a model on: the test images (then training images) of its dataset.

    The dataset folder recorded in the bundle may be relative to the folder the run was started
    from; it is looked up relative to the working directory and to the runs folder's parent.
    """
    roots = [Path(info.data_dir)] if info.data_dir else []
    if info.data_dir and not Path(info.data_dir).is_absolute():
        roots.append(info.bundle.parent.parent.parent / info.data_dir)
    roots += [Path(p) for p in extra]
    found: list[Path] = []
    for root in roots:
        for sub in ("imagesTs", "imagesTr", "."):
            d = root / sub
            if not d.is_dir():
                continue
            for pattern in NIFTI_GLOBS:
                for p in sorted(d.glob(pattern)):
                    if p.resolve() not in {f.resolve() for f in found}:
                        found.append(p)
            if found:
                break
        if len(found) >= limit:
            break
    return found[:limit]


def default_folders() -> list[Path]:
    """``MEDSEG_APP_RUNS`` (os.pathsep-separated), else ``runs`` in the working directory."""
    env = os.environ.get("MEDSEG_APP_RUNS", "")
    return [Path(p) for p in env.split(os.pathsep) if p] or [Path("runs")]


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _resolved(path: Path) -> Path | None:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the system refuses
        return None


def allowed_folder(typed: str, roots: list[Path]) -> Path:
    """The folder a user typed into the page, resolved (symlinks and ``..``), when it lies inside one
    of the runs folders ``roots`` (resolved too); a DataError otherwise.

    A relative name is looked for in each runs folder, then in the working directory. Whether an
    outside folder exists is not looked at: the answer is the same for every outside path.
    """
    text = typed.strip()
    resolved = [r for r in (_resolved(r) for r in roots) if r is not None]
    given = Path(text).expanduser() if text and "\0" not in text else None
    if given is None:
        candidates = []
    elif given.is_absolute():
        candidates = [given]
    else:
        candidates = [*(r / given for r in resolved), Path.cwd() / given]
    inside = [
        c
        for c in (_resolved(c) for c in candidates)
        if c is not None and any(_inside(c, r) for r in resolved)
    ]
    if not inside:
        where = ", ".join(str(r) for r in resolved)
        raise DataError(
            f"The folder typed into 'Another model folder' is not inside the model folders this "
            f"viewer was started with ({where}); only folders inside them can be opened"
        )
    return next((c for c in inside if c.is_dir()), inside[0])

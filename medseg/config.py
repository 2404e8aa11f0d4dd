"""Experiment configuration: a typed schema, YAML loading, `key=value` overrides, strict checking.

A config is a tree of dataclasses. Every key a YAML file or an override names must exist in the
schema; a wrong key or value raises :class:`ConfigError` naming the dotted key and what it allows.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from medseg.errors import ConfigError

_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")

Task = Literal["segmentation", "classification"]
SEG_NETS = ("unet", "segresnet", "dynunet", "swinunetr")
CLS_NETS = ("densenet121", "resnet")


@dataclass
class DataConfig:
    dir: str = "data/synth-seg"
    val_fraction: float = 0.2
    cache: Literal["none", "memory", "disk"] = "memory"
    cache_dir: str = ""  # for cache=disk; default <run>/cache
    num_workers: int = 0
    # What an exported bundle (the model that leaves this machine) may say about the data. false: the
    # dataset's name, case counts and folder base names only; true: also the validation cases' file
    # names and the full paths of data.dir, data.cache_dir, sites.*.dir and runs_dir (medseg.bundle).
    share_paths: bool = False


@dataclass
class NormalizeConfig:
    """How image intensities become network input (:func:`medseg.training.transforms.intensity`).

    - ``window``: ``transforms.window`` [a, b] mapped linearly onto [0, 1] and clipped (the default,
      what every config before planning did);
    - ``ct``: clipped to [clip[0], clip[1]] (the dataset's foreground 0.5 and 99.5 percentiles), then
      ``(x - mean) / std`` with the dataset's foreground mean and standard deviation (nnU-Net's CT
      scheme; all four numbers come from the fingerprint, ``medseg plan`` writes them);
    - ``zscore``: per image, ``(x - mean) / std`` over the image's non-zero voxels, zeros left at 0
      (MR and every modality without a physical unit).
    """

    scheme: Literal["window", "ct", "zscore"] = "window"
    clip: list[float] = field(default_factory=list)  # ct: [low, high] foreground percentiles
    mean: float = 0.0  # ct: foreground mean (after nothing; in the image's own unit)
    std: float = 1.0  # ct: foreground standard deviation


@dataclass
class TransformConfig:
    spacing: list[float] = field(default_factory=lambda: [1.5, 1.5, 2.5])  # mm, target voxel size
    window: list[float] = field(default_factory=lambda: [-200.0, 300.0])  # intensity a_min, a_max -> [0, 1]
    patch: list[int] = field(default_factory=lambda: [64, 64, 32])  # training patch / sliding window roi
    num_samples: int = 2  # patches drawn per volume per epoch
    pos: float = 1.0  # foreground-centred : background-centred patch ratio
    neg: float = 1.0
    crop_foreground: bool = True
    augment: bool = True
    # which random transforms augment a training patch (medseg.training.augment): light = flips and
    # intensity scale/shift; nnunet = nnU-Net's default recipe in MONAI transforms (rotation, scaling,
    # noise, blur, brightness, contrast, low resolution, gamma, mirroring)
    augment_recipe: Literal["light", "nnunet"] = "light"
    flip_axes: list[int] = field(default_factory=lambda: [0, 1, 2])  # axes (RAS) a recipe may mirror
    # voxels of extra padding on each side before the patch is cropped, so that a patch centred on a
    # foreground voxel holds the object anywhere within +-shift of where a tight crop would put it
    # (nnU-Net's random placement); 0: the case is padded to the patch only
    shift: int = 0
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    # classification: what the network sees. centre: the volume padded or cropped about its centre to
    # ``patch``; object: the bounding box of the image's object (Otsu threshold of a smoothed copy),
    # resized to fit ``patch`` whole (aspect kept), then padded.
    roi: Literal["centre", "object"] = "centre"


@dataclass
class ModelConfig:
    name: Literal["unet", "segresnet", "dynunet", "swinunetr", "densenet121", "resnet"] = "unet"
    channels: list[int] = field(default_factory=lambda: [16, 32, 64, 128])  # unet
    strides: list[int] = field(default_factory=lambda: [2, 2, 2])  # unet
    num_res_units: int = 2  # unet
    init_filters: int = 16  # segresnet, densenet121 (init_features)
    feature_size: int = 24  # swinunetr
    depth: Literal[10, 18, 34, 50] = 18  # resnet
    width: float = 1.0  # resnet channel multiplier (widen_factor)
    norm: Literal["instance", "batch", "group"] = "instance"
    dropout: float = 0.0
    # dynunet: extra decoder heads trained with deep supervision (nnU-Net's; 0 = off); each head's
    # Dice-CE counts 1/2, 1/4, ... of the main output's (MONAI's DeepSupervisionLoss, weight_mode exp)
    deep_supervision: int = 0
    # dynunet: features per level, one per level of its plan; [] = MONAI's (nnU-Net's) 32, 64, 128, 256, 320...
    filters: list[int] = field(default_factory=list)


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 2
    lr: float = 1e-3
    weight_decay: float = 1e-5
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    momentum: float = 0.9  # sgd: its Nesterov momentum (nnU-Net's: 0.99, with lr 0.01, weight_decay 3e-5)
    scheduler: Literal["cosine", "poly", "none"] = "cosine"  # poly: lr (1 - epoch / epochs)^0.9
    val_interval: int = 1
    stop_at: float = 0.0  # stop once the key validation metric reaches this (0 = train every epoch)
    min_epochs: int = 0  # ... but not before this epoch
    # stop after this epoch as an interruption would (checkpoint, no bundle; --resume goes on), the
    # schedule still planned over ``epochs``: a run's first epochs alone (0 = train to ``epochs``)
    until_epoch: int = 0
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    amp: bool = True  # mixed precision, used on CUDA only
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    memory: Literal["none", "fused"] = (
        "none"  # fused: medseg.kernels.optimize_memory (same maths, fewer maps)
    )


@dataclass
class DistConfig:
    """How workers synchronise (see medseg.distributed); used when training runs on several ranks.

    ``sync``: ``bsp`` (plain Horovod), ``bsp-hier`` (exact float32 average every step on medseg's
    channel: in-site sum, sites' sums between their leaders, in-site broadcast), ``gssp``/``ssp``,
    ``local-sgd``, and the model-averaging peers ``fedavg`` (McMahan et al. 2017) and ``diloco``
    (Douillard et al. 2023), whose rounds run between sites (one site per ``sites:`` entry or host).
    """

    sync: Literal["none", "bsp", "bsp-hier", "gssp", "ssp", "local-sgd", "fedavg", "diloco"] = "none"
    groups: list[list[int]] = field(default_factory=list)  # explicit groups of ranks; [] = by group_by
    # gssp without groups: one group per host (site), or k-means on measured speed
    group_by: Literal["host", "speed"] = "host"
    periods: list[int] = field(default_factory=list)  # steps per round of each group; [] = from speeds
    # gssp/ssp with measured periods: lengthen every group's round by one factor so that a round's
    # compute covers the measured cross-group exchange (the WAN), see HorovodSession._wan_factor
    hide_wan: bool = True
    # ... rounding each group's speed ratio after that factor (rounds of about equal compute time
    # everywhere); false rounds the ratio first and multiplies (the fastest site may straggle)
    balance_rounds: bool = True
    # ... but never so long that an epoch holds fewer rounds than this: each round boundary is where
    # the sites' models meet, and fewer meetings per epoch cost held-out Dice (docs/design.md);
    # not applied with site-local data (sites:)
    min_epoch_rounds: int = 6
    num_groups: int = 0  # with automatic groups: 0 = chosen by Calinski-Harabasz
    staleness: int = 2  # gssp/ssp: rounds a group may run ahead of the slowest
    dc_lambda: float = 0.0  # gssp/ssp: DC-ASGD delay compensation strength (0 = off)
    period: int = 4  # local-sgd: steps between model averages
    # diloco: H, inner steps of each site per round (a round also ends at every epoch's end), then
    # an outer Nesterov step on the sample-weighted mean pseudo-gradient; the paper's H = 500,
    # outer lr 0.7, momentum 0.9 (medseg.distributed.sync.peers.DiLoCo)
    inner_steps: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # gssp/ssp: what each round's mean change goes through, ``average`` (applied as it is) or
    # ``nesterov`` (DiLoCo's outer step, with outer_lr and outer_momentum above)
    outer: Literal["average", "nesterov"] = "average"
    # fedavg: E, local epochs per round, then the sample-weighted model average; local_steps > 0
    # makes a round that many steps instead (a fraction of an epoch; it also ends at each epoch's end)
    local_epochs: int = 1
    local_steps: int = 0
    compression: Literal["none", "fp16", "fixed", "topk"] = "none"
    bits: Literal[2, 4, 8] = 4  # compression: fixed
    # compression: topk (gssp/ssp rounds): share of each layer's entries sent, with error feedback;
    # topk_bits codes the kept values (0: float32) (medseg.distributed.comm.round_codecs)
    topk_fraction: float = 0.01
    # gssp/ssp: count each site's round change per local step (FedNova), so that a site taking more
    # steps per round does not pull the model toward its own data (medseg.distributed.sync.gssp)
    normalize_steps: bool = False
    # gssp/ssp: the optimizer's momentum after a round moves a site's model: kept, or zeroed
    # (second moments stay; medseg.distributed.sync.gssp)
    round_momentum: Literal["keep", "reset"] = "keep"
    topk_bits: Literal[0, 2, 4, 8] = 0
    timeout_s: float = 120.0  # a rank silent this long is declared hung and the job is stopped
    profile_steps: int = 8  # timed blocks (>= 0.4 s each) per rank, median: speeds for groups and rounds
    # FedBN: normalisation layers' parameters and running statistics stay in each site (gssp, ssp,
    # local-sgd); they are averaged inside a site only and never sent to another site
    local_norm: bool = False

    def check(self, epochs: int) -> None:
        """The rules of the site-round modes (bsp-hier, fedavg, diloco) and their options."""
        if self.inner_steps < 1 or self.local_epochs < 1 or self.local_steps < 0:
            raise ConfigError("dist: inner_steps >= 1, local_epochs >= 1 and local_steps >= 0 are required")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"dist: outer_lr must be > 0 and outer_momentum in [0, 1), got {self.outer_lr}, {self.outer_momentum}"
            )
        if self.outer == "nesterov" and (self.sync not in ("gssp", "ssp") or self.dc_lambda):
            raise ConfigError(
                "dist.outer: nesterov is for gssp and ssp, without dc_lambda (diloco has its own)"
            )
        peers = ("bsp-hier", "fedavg", "diloco")
        if self.sync in peers and self.compression != "none":
            raise ConfigError(
                f"dist.compression: {self.sync} sends float32 (its exact baseline role); use compression: none "
                "(fixed-bit codes between sites: sync bsp with compression fixed, or gssp)"
            )
        if self.sync in peers and (self.groups or self.periods):
            raise ConfigError(
                f"dist.groups/periods: {self.sync} forms one group per site (or host); leave them empty"
            )
        if self.sync == "bsp-hier" and self.local_norm:
            raise ConfigError(
                "dist.local_norm: bsp-hier averages every gradient; use fedavg, diloco, gssp or local-sgd"
            )
        if self.sync == "fedavg" and self.local_steps and self.local_epochs != 1:
            raise ConfigError("dist: fedavg takes local_epochs or local_steps, not both")
        if self.sync == "fedavg" and not self.local_steps and epochs % self.local_epochs:
            raise ConfigError(
                f"dist.local_epochs: train.epochs ({epochs}) must be a multiple of it ({self.local_epochs}), "
                "so that the last epoch ends a round and the checkpoint holds the averaged model"
            )


@dataclass
class SiteConfig:
    """One hospital's own dataset (see ``Config.sites``); ``host`` is the ``--hosts`` entry its ranks
    run on when that is not the site's name (e.g. an address)."""

    dir: str = ""
    host: str = ""


@dataclass
class InferConfig:
    sw_batch_size: int = 4
    overlap: float = 0.25
    mode: Literal["gaussian", "constant"] = "gaussian"
    # test-time mirroring: the mean of the logits over every flip of these spatial axes (0, 1, 2 of
    # RAS); [] = none, [0, 1, 2] = nnU-Net's 8 flips
    mirror: list[int] = field(default_factory=list)
    keep_largest: bool = False  # per foreground class, keep only its largest connected component


@dataclass
class Config:
    name: str = "run"
    task: Task = "segmentation"
    runs_dir: str = "runs"
    data: DataConfig = field(default_factory=DataConfig)
    transforms: TransformConfig = field(default_factory=TransformConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    # Site-local datasets: {name: {dir, host}}. With sites, a rank reads only its own site's ``dir``
    # (``data.dir`` is not read by training) and ``--hosts`` names the sites (medseg.distributed.site_data).
    sites: dict[str, SiteConfig] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in the annotated type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}"
            )
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, item_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(k, key_tp, key): _coerce(v, item_tp, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{key}: union types are not supported in the schema")  # pragma: no cover
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value):
            return float(value)  # YAML 1.1 reads 3e-5 (no dot) as a string; YAML 1.2 and users read a number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, key)
    raise ConfigError(f"{key}: unsupported schema type {tp!r}")  # pragma: no cover


def _from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    where = prefix or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key; allowed keys here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _check_model(cfg: Config) -> None:
    """The network's name against the task, and the options each network takes."""
    m, t = cfg.model, cfg.transforms
    nets = SEG_NETS if cfg.task == "segmentation" else CLS_NETS
    if m.name not in nets:
        raise ConfigError(f"model.name: {m.name!r} is not a {cfg.task} network; allowed: {', '.join(nets)}")
    if m.name == "unet" and len(m.strides) != len(m.channels) - 1:
        raise ConfigError(
            f"model.strides: needs len(model.channels) - 1 = {len(m.channels) - 1} entries, got {m.strides}"
        )
    if m.deep_supervision and (m.name != "dynunet" or cfg.train.memory == "fused" or m.deep_supervision < 0):
        raise ConfigError(
            f"model.deep_supervision: {m.deep_supervision} heads need model.name dynunet and train.memory "
            f"none (got {m.name}, {cfg.train.memory})"
        )
    if m.name == "swinunetr" and any(p % 32 for p in t.patch):
        raise ConfigError(f"transforms.patch: swinunetr needs every side divisible by 32, got {t.patch}")


def _check(cfg: Config) -> None:
    """Cross-field rules the types alone cannot express."""
    t = cfg.transforms
    for key, vals in (("transforms.spacing", t.spacing), ("transforms.patch", t.patch)):
        if len(vals) != 3 or any(v <= 0 for v in vals):
            raise ConfigError(f"{key}: expected three positive numbers, got {vals}")
    if len(t.window) != 2 or t.window[0] >= t.window[1]:
        raise ConfigError(f"transforms.window: expected [low, high] with low < high, got {t.window}")
    if len(set(t.flip_axes)) != len(t.flip_axes) or not set(t.flip_axes) <= {0, 1, 2}:
        raise ConfigError(
            f"transforms.flip_axes: expected distinct spatial axes among 0, 1, 2, got {t.flip_axes}"
        )
    if t.shift < 0:
        raise ConfigError(f"transforms.shift: expected voxels >= 0, got {t.shift}")
    n = t.normalize
    if n.scheme == "ct":
        if len(n.clip) != 2 or n.clip[0] >= n.clip[1]:
            raise ConfigError(
                f"transforms.normalize.clip: scheme ct needs [low, high] with low < high, got {n.clip}; "
                "`medseg plan` writes the dataset's foreground percentiles here"
            )
        if not n.std > 0:
            raise ConfigError(f"transforms.normalize.std: must be positive, got {n.std}")
    _check_model(cfg)
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: expected a number in [0, 1), got {cfg.data.val_fraction}")
    if len(set(cfg.infer.mirror)) != len(cfg.infer.mirror) or not set(cfg.infer.mirror) <= {0, 1, 2}:
        raise ConfigError(
            f"infer.mirror: expected distinct spatial axes among 0, 1, 2, got {cfg.infer.mirror}"
        )
    if not 0.0 <= cfg.infer.overlap < 1.0:
        raise ConfigError(f"infer.overlap: expected a number in [0, 1), got {cfg.infer.overlap}")
    for key in ("epochs", "batch_size", "val_interval"):
        if getattr(cfg.train, key) < 1:
            raise ConfigError(f"train.{key}: must be at least 1")
    if cfg.train.lr <= 0:
        raise ConfigError("train.lr: must be positive")
    if not 0.0 < cfg.train.momentum < 1.0:  # torch's Nesterov SGD refuses 0; 1 or more never decays
        raise ConfigError(f"train.momentum: expected a number in (0, 1), got {cfg.train.momentum}")
    if not 0 <= cfg.train.until_epoch <= cfg.train.epochs:
        raise ConfigError(f"train.until_epoch: expected 0 (off) to train.epochs ({cfg.train.epochs})")
    d = cfg.dist
    if (
        d.staleness < 0
        or d.period < 1
        or d.timeout_s <= 0
        or d.profile_steps < 1
        or d.num_groups < 0
        or d.min_epoch_rounds < 1
    ):
        raise ConfigError(
            "dist: staleness >= 0, period >= 1, timeout_s > 0, profile_steps >= 1, num_groups >= 0 and "
            "min_epoch_rounds >= 1 are required"
        )
    d.check(cfg.train.epochs)
    if d.compression == "topk" and d.sync not in ("gssp", "ssp"):
        raise ConfigError(
            f"dist.compression: topk sparsifies gssp/ssp's cross-site rounds, not {d.sync}'s; use none or fixed"
        )
    if d.normalize_steps and d.sync not in ("gssp", "ssp"):
        raise ConfigError(f"dist.normalize_steps: normalises gssp/ssp's rounds, not {d.sync}'s")
    if d.round_momentum != "keep" and d.sync not in ("gssp", "ssp"):
        raise ConfigError(f"dist.round_momentum: acts on gssp/ssp's rounds, not {d.sync}'s")
    if not 0 < d.topk_fraction <= 1:
        raise ConfigError(f"dist.topk_fraction must be in (0, 1], got {d.topk_fraction}")
    if d.compression == "fp16" and d.sync != "bsp":
        raise ConfigError(
            f"dist.compression: fp16 is Horovod's own compressor and works with sync: bsp only, not {d.sync}"
        )
    for site, sc in cfg.sites.items():
        if not site or not all(c.isalnum() or c in "-_." for c in site):
            raise ConfigError(f"sites: {site!r} is not a usable site name (letters, digits, - _ .)")
        if not sc.dir:
            raise ConfigError(f"sites.{site}.dir: each site needs the folder of its own dataset")
    if d.local_norm and d.sync == "bsp":
        raise ConfigError(
            "dist.local_norm: bsp is plain Horovod and averages every parameter each step; "
            "use gssp, ssp or local-sgd to keep normalisation layers local"
        )
    if not cfg.name or "/" in cfg.name or cfg.name.startswith("."):
        raise ConfigError(f"name: {cfg.name!r} is not a usable run folder name")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to a raw config mapping; values are parsed as YAML scalars/lists."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.epochs=5")
        dotted, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        node = data
        parts = dotted.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = _from_dict(Config, data)
    _check(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply overrides, check every key and value."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{path}: is a folder; give the config's YAML file (the shipped ones are in configs/)"
        )
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; the shipped ones are in configs/")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read as a UTF-8 YAML file ({exc}); fix or replace it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return config_from_dict(apply_overrides(data, overrides or []))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def with_infer_overrides(cfg: Config, overrides: list[str]) -> Config:
    """``cfg`` with ``infer.*`` overrides applied (``medseg infer`` / ``evaluate``: how a trained model is
    run, e.g. ``infer.mirror=[0,1,2]``); any other key is refused, since the model was trained with it."""
    for item in overrides:
        if not item.split("=", 1)[0].strip().startswith("infer."):
            raise ConfigError(f"override {item!r}: only infer.* settings can change after training")
    return config_from_dict(apply_overrides(cfg.to_dict(), overrides)) if overrides else cfg


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (temporary name, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)


def diff_configs(a: Config, b: Config, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs."""
    da, db = a.to_dict(), b.to_dict()

    def walk(x: Any, y: Any, key: str) -> list[str]:
        if isinstance(x, dict) and isinstance(y, dict):
            return [d for k in x for d in walk(x[k], y.get(k), f"{key}.{k}" if key else k)]
        return [] if x == y else [key]

    return walk(da, db, prefix)

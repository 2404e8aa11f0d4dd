"""Network choice by config, expressed as a MONAI bundle ``network_def``.

The same ``{"_target_": ..., **args}`` mapping builds the model for training and is written into the
bundle's inference config, so a bundle rebuilds exactly the network it was trained with.

A ``network_def`` is data, not code: :func:`build_network` builds only the MONAI networks
:func:`network_def` can write (:data:`NETWORKS`), called with literal arguments (numbers, booleans,
null, strings that do not start with ``$``, ``@`` or ``%``, and lists and mappings of those), by
medseg's own code. MONAI's ``ConfigParser``, which evaluates ``$`` expressions and instantiates any
``_target_``, is used only with ``trust=True``, for a bundle its user made and trusts.
"""

from __future__ import annotations

import inspect
from typing import Any

import monai.networks.nets as monai_nets
import torch

from medseg.config import Config
from medseg.errors import ConfigError

_NORM = {"instance": "INSTANCE", "batch": "BATCH", "group": ("GROUP", {"num_groups": 8})}


def dynunet_plan(
    patch: list[int], spacing: list[float], max_levels: int = 5
) -> tuple[list[list[int]], list[list[int]]]:
    """Kernel sizes and strides per level for DynUNet, by the nnU-Net rule.

    At each level an axis is downsampled (stride 2) while its spacing is within 2x of the finest
    axis and its size stays >= 8; an axis more than 2x coarser gets kernel 1 in-plane-only
    convolutions until the others catch up. The patch must divide by the product of strides.
    """
    sizes, spacings = [float(p) for p in patch], list(spacing)
    kernels, strides = [], [[1, 1, 1]]
    for _ in range(max_levels):
        ratio = [s / min(spacings) for s in spacings]
        stride = [2 if r <= 2 and size >= 8 else 1 for r, size in zip(ratio, sizes)]
        if all(s == 1 for s in stride):
            break
        if any(size % s for size, s in zip(sizes, stride)):
            raise ConfigError(
                f"transforms.patch: {patch} cannot be halved evenly for dynunet; use multiples of 16"
            )
        kernels.append([3 if r <= 2 else 1 for r in ratio])
        strides.append(stride)
        sizes = [size / s for size, s in zip(sizes, stride)]
        spacings = [sp * s for sp, s in zip(spacings, stride)]
    kernels.append([3, 3, 3])
    return kernels, strides


def _deep_supervision(heads: int, levels: int) -> dict[str, Any]:
    """DynUNet's deep-supervision arguments for ``heads`` extra heads (none when 0); a head per
    decoder level at most, the lowest excepted (MONAI's rule: heads < levels - 1)."""
    if heads <= 0:
        return {}
    if heads >= levels - 1:
        raise ConfigError(
            f"model.deep_supervision: {heads} heads, but this patch gives dynunet {levels} levels, "
            f"so at most {levels - 2}"
        )
    return {"deep_supervision": True, "deep_supr_num": heads}


def _filters(filters: list[int], levels: int) -> dict[str, Any]:
    """DynUNet's ``filters`` argument: one width per level of its plan (none given: MONAI's default)."""
    if not filters:
        return {}
    if len(filters) != levels or any(f < 1 for f in filters):
        raise ConfigError(
            f"model.filters: this patch gives dynunet {levels} levels, so {levels} positive widths, got {filters}"
        )
    return {"filters": list(filters)}


def network_def(cfg: Config, out_channels: int, in_channels: int = 1) -> dict[str, Any]:
    """The MONAI bundle ``network_def`` for ``cfg.model``."""
    m = cfg.model
    norm = _NORM[m.norm]
    if m.name == "unet":
        return {
            "_target_": "monai.networks.nets.UNet",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "channels": list(m.channels),
            "strides": list(m.strides),
            "num_res_units": m.num_res_units,
            "norm": norm,
            "dropout": m.dropout,
        }
    if m.name == "segresnet":
        return {
            "_target_": "monai.networks.nets.SegResNet",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "init_filters": m.init_filters,
            "norm": norm,
            "dropout_prob": m.dropout or None,
        }
    if m.name == "dynunet":
        kernels, strides = dynunet_plan(cfg.transforms.patch, cfg.transforms.spacing)
        return {
            "_target_": "monai.networks.nets.DynUNet",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "kernel_size": kernels,
            "strides": strides,
            "upsample_kernel_size": strides[1:],
            "norm_name": norm,
            "dropout": m.dropout or None,
            **_deep_supervision(m.deep_supervision, len(strides)),
            **_filters(m.filters, len(strides)),
        }
    if m.name == "swinunetr":
        return {
            "_target_": "monai.networks.nets.SwinUNETR",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "feature_size": m.feature_size,
            "norm_name": m.norm if m.norm != "group" else "instance",
            "drop_rate": m.dropout,
        }
    if m.name == "densenet121":
        return {
            "_target_": "monai.networks.nets.DenseNet121",
            "spatial_dims": 3,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "init_features": m.init_filters,
            "dropout_prob": m.dropout,
        }
    if m.name == "resnet":
        return {
            "_target_": f"monai.networks.nets.resnet{m.depth}",
            "spatial_dims": 3,
            "n_input_channels": in_channels,
            "num_classes": out_channels,
            "widen_factor": m.width,
            "conv1_t_size": 3,  # a 7^3 stem costs more than the rest of a small 3D ResNet
            "norm": norm,
        }
    raise ConfigError(f"model.name: unknown network {m.name!r}")  # pragma: no cover - schema forbids it


# The MONAI networks network_def() writes: class or function name in monai.networks.nets -> the
# module of monai.networks.nets that defines it. Nothing else is built without trust=True.
NETWORKS: dict[str, str] = {
    "UNet": "unet",
    "SegResNet": "segresnet",
    "DynUNet": "dynunet",
    "SwinUNETR": "swin_unetr",
    "DenseNet121": "densenet",
    "resnet10": "resnet",
    "resnet18": "resnet",
    "resnet34": "resnet",
    "resnet50": "resnet",
}
# Arguments refused although the constructor takes them: they read a file or download weights
# (pretrained, progress), take a class rather than a value (norm_layer), are set by the resnetN
# function itself (block, layers, block_inplanes), or switch to an optional third-party package's
# operator medseg never uses (use_hyena, hyena_*).
_REFUSED_ARGS = frozenset(
    {"pretrained", "progress", "norm_layer", "block", "layers", "block_inplanes", "use_hyena"}
)
_REFUSED_PREFIXES = ("hyena_",)
# Leading characters of a string MONAI's ConfigParser would not take as a plain string.
_EXPRESSION_MARKS = ("$", "@", "%")
_MAX_DEPTH = 8  # nesting of lists and mappings in one argument (MONAI's networks take 2 at most)


def allowed_targets() -> list[str]:
    """Every ``_target_`` spelling :func:`build_network` accepts without trust: ``monai.networks.nets.X``
    (what medseg writes), ``monai.networks.nets.<module>.X`` and the bare ``X`` MONAI also resolves."""
    out = []
    for name, module in NETWORKS.items():
        out += [f"monai.networks.nets.{name}", f"monai.networks.nets.{module}.{name}", name]
    return out


def _target_name(target: Any) -> str | None:
    """The :data:`NETWORKS` name ``target`` spells, or None when it is not one of them."""
    if not isinstance(target, str):
        return None
    for name, module in NETWORKS.items():
        if target in (name, f"monai.networks.nets.{name}", f"monai.networks.nets.{module}.{name}"):
            return name
    return None


def _argument_names(name: str) -> set[str]:
    """The keyword arguments network ``name`` may be given: its constructor's own (for the
    ``resnetN`` and ``DenseNet121`` helpers, the class they pass ``**kwargs`` to) less the refused."""
    names: set[str] = set()
    builders = [getattr(monai_nets, name)]
    if name.startswith("resnet"):
        builders.append(monai_nets.ResNet)
    elif name == "DenseNet121":
        builders.append(monai_nets.DenseNet)
    for builder in builders:
        for p in inspect.signature(builder).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(p.name)
    return {n for n in names if n not in _REFUSED_ARGS and not n.startswith(_REFUSED_PREFIXES)}


def _literal_problem(value: Any, where: str, depth: int = 0) -> tuple[str, str] | None:
    """``(key, why)`` for the first part of ``value`` that is not a literal, else None."""
    if depth > _MAX_DEPTH:
        return where, f"nested more than {_MAX_DEPTH} levels deep"
    if isinstance(value, str) and value.lstrip().startswith(_EXPRESSION_MARKS):
        return where, f"{value[:60]!r} is a MONAI expression or reference, not a literal value"
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _literal_problem(item, f"{where}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}"
            if not isinstance(key, str):
                return inner, "mapping keys must be strings"
            if key.startswith("_") and key.endswith("_"):
                return (
                    inner,
                    f"{key} inside an argument asks MONAI to build or resolve something; only literal values are taken",
                )
            found = _literal_problem(item, inner, depth + 1)
            if found:
                return found
        return None
    return where, f"a {type(value).__name__} is not a literal value"


def check_network_def(definition: Any, where: str = "network_def") -> tuple[str, dict[str, Any]]:
    """The network name and arguments of a ``network_def`` that :func:`build_network` may build
    without trust, or a :class:`ConfigError` that starts with the offending key (``where.<key>``)."""
    if not isinstance(definition, dict):
        raise ConfigError(
            f"{where}: expected a mapping with _target_ and literal arguments, got a {type(definition).__name__}"
        )
    target = definition.get("_target_")
    name = _target_name(target)
    if name is None:
        raise ConfigError(
            f"{where}._target_: {str(target)[:120]!r} is not one of the networks medseg builds "
            f"({', '.join(f'monai.networks.nets.{n}' for n in NETWORKS)})"
        )
    allowed = _argument_names(name)
    args: dict[str, Any] = {}
    for key, value in definition.items():
        if key == "_target_":
            continue
        if key == "_desc_":  # MONAI's description field: text for people, ignored
            continue
        if not isinstance(key, str) or key not in allowed:
            why = (
                "MONAI's config parser would act on it"
                if isinstance(key, str) and key.startswith("_") and key.endswith("_")
                else f"not an argument {name} is built with here (allowed: {', '.join(sorted(allowed))})"
            )
            raise ConfigError(f"{where}.{key}: {why}")
        found = _literal_problem(value, f"{where}.{key}")
        if found:
            raise ConfigError(f"{found[0]}: {found[1]}")
        args[key] = value
    return name, args


def build_network(definition: dict[str, Any], trust: bool = False) -> torch.nn.Module:
    """Build a ``network_def`` mapping.

    By default only the networks of :data:`NETWORKS` with literal arguments
    (:func:`check_network_def`), by medseg's own call of the MONAI class: no expression is evaluated
    and nothing else is imported or instantiated. ``trust=True`` hands the mapping to MONAI's
    ``ConfigParser`` instead (any ``_target_``, ``$`` expressions): for definitions its user wrote."""
    if trust:
        return _build_trusted(definition)
    name, args = check_network_def(definition)
    try:
        return getattr(monai_nets, name)(**args)
    except Exception as exc:  # noqa: BLE001 - the network's own complaint about its arguments
        raise _not_built(definition, exc) from None


def _build_trusted(definition: dict[str, Any]) -> torch.nn.Module:
    """MONAI's bundle config parser on ``{"network_def": definition}`` (evaluates expressions)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser({"network_def": definition})
    try:
        return parser.get_parsed_content("network_def", instantiate=True)
    except RuntimeError as exc:  # MONAI wraps the network's own complaint
        raise _not_built(definition, exc.__cause__ or exc) from None


def _not_built(definition: dict[str, Any], cause: BaseException) -> ConfigError:
    shown = {k: v for k, v in definition.items() if k != "_target_"}
    return ConfigError(
        f"model: {definition.get('_target_')} cannot be built with {shown} ({type(cause).__name__}: {cause}); "
        "check model.name, model.norm and the sizes"
    )

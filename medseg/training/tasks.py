"""What differs between segmentation and classification: loss, targets, validation metrics.

Validation during training runs on the model's own grid (resampled volumes). Final numbers for a
trained model come from :mod:`medseg.inference.evaluate`, which scores predictions in each case's original
geometry through the same inference path users run.

Metrics use MONAI's functional forms (``compute_dice``, ``compute_hausdorff_distance``,
``compute_roc_auc``) and reduce per class here: MONAI's cumulative metric objects all-gather their
buffers whenever a distributed backend is up (torch.distributed, or Horovod through ignite), and in a
multi-rank job rank 0 validates alone.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from monai.inferers import sliding_window_inference
from monai.losses import DeepSupervisionLoss, DiceCELoss
from monai.metrics import compute_dice, compute_hausdorff_distance, compute_roc_auc
from monai.networks.utils import one_hot

from medseg.config import Config

log = logging.getLogger(__name__)


def improves(record: dict[str, Any], best: dict[str, Any] | None, key: str, tie: str | None) -> bool:
    """Whether an epoch's validation ``record`` beats ``best`` (the best epoch's record so far).

    Ordered by ``(record[key], record[tie])``: a higher key metric wins, and an equal one is decided by
    the tie-break metric (a missing value ranks lowest). ROC-AUC saturates at 1.0 as soon as the
    classes are separated at *some* threshold, while accuracy at the model's own decision (argmax)
    may still be 0.5: picking the earliest AUC = 1.0 epoch exported such a model in the demo
    (held-out AUC 1.000, accuracy 0.525).
    """
    value = record.get(key)
    if value is None:
        return False
    if best is None or best.get(key) is None:
        return True
    if value != best[key]:
        return value > best[key]
    if tie is None:
        return False
    mine, theirs = record.get(tie), best.get(tie)
    return mine is not None and (theirs is None or mine > theirs)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(float(x)) else None


def class_means(per_case: torch.Tensor) -> list[float]:
    """Mean over cases (rows) of each class (column), non-finite values left out; NaN for a class
    with no finite value.

    A NaN is a class absent from a case's truth (Dice with ``ignore_empty``) or from its truth or
    prediction (Hausdorff distance). MONAI's ``do_metric_reduction(..., "mean_batch")`` gives 0.0 for a
    class that is NaN in every case, which read as Dice 0 and a perfect 0 mm HD95 for classes that
    are only named in ``dataset.json`` (most of TotalSegmentator's 117 in any one scan).
    """
    x = per_case.float()
    return torch.nanmean(torch.where(torch.isfinite(x), x, torch.nan), dim=0).cpu().tolist()


def hausdorff95(pred: torch.Tensor, truth: torch.Tensor, spacing: Any) -> torch.Tensor:
    """Per-case, per-class 95th-percentile Hausdorff distance (B, C - 1), background left out: MONAI's
    ``compute_hausdorff_distance(pred, truth, include_background=False, percentile=95, spacing=...)``
    on one-hot (B, C, ...) maps, computed only for the classes some case holds in both maps.

    Any other class is NaN (MONAI's value when either map is empty), but MONAI spends as long on it
    as on a real one (about 0.1 s a class on a 122 x 101 x 30 CT): a TotalSegmentator CT declares 117
    classes and holds about 40.
    """
    both = (pred.flatten(2).any(2) & truth.flatten(2).any(2)).any(0)
    both[0] = False
    out = torch.full((pred.shape[0], pred.shape[1] - 1), float("nan"), device=pred.device)
    idx = torch.nonzero(both).flatten()
    if idx.numel():
        hd = compute_hausdorff_distance(
            pred[:, idx], truth[:, idx], include_background=True, percentile=95, spacing=spacing
        )
        out[:, idx - 1] = hd.to(out.dtype)
    return out


def _mean_of_finite(values: list[float]) -> float | None:
    """The mean of the finite values (classes scored), None when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


class SegmentationTask:
    """Voxel-wise classes; DiceCE loss (fused with train.memory=fused); Dice and 95th-percentile Hausdorff distance per class."""

    key_metric = "val_dice"
    tie_metric: str | None = None  # Dice does not saturate early

    def __init__(self, cfg: Config, labels: dict[int, str]) -> None:
        self.cfg, self.labels = cfg, labels
        self.num_classes = len(labels)
        # train.memory=fused: the same loss without its full-resolution softmax/one-hot/log-softmax maps.
        if cfg.train.memory == "fused":
            from medseg.kernels.loss import FusedDiceCELoss

            self.loss: torch.nn.Module = FusedDiceCELoss()
            log.info(
                "train.memory=fused: fused Dice+CE loss (no softmax/one-hot maps kept; with the "
                "network's last convolution where it fuses, no logits either)"
            )
        else:
            self.loss = DiceCELoss(to_onehot_y=True, softmax=True)
        if cfg.model.deep_supervision:
            # DynUNet stacks the main output and its heads' (upsampled to full size) on dim 1
            self.loss = DeepSupervisionLoss(self.loss, weight_mode="exp")

    def targets(self, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        return batch["label"].to(device)

    def step_loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one batch. With train.memory=fused and a fused head
        (medseg.kernels.head), the model returns a placeholder and the loss makes the logits slab by slab."""
        if self.cfg.train.memory != "fused":
            out = model(inputs)
            if self.cfg.model.deep_supervision and model.training:
                return self.loss(list(torch.unbind(out, dim=1)), targets)
            return self.loss(out, targets)
        from medseg.kernels.head import deferred_head

        with deferred_head(model):
            out = model(inputs)
        return self.loss(out, targets)

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, loader: Any, device: torch.device) -> dict[str, Any]:
        t, inf = self.cfg.transforms, self.cfg.infer
        dices, hds = [], []
        for batch in loader:
            image = batch["image"].to(device)
            logits = sliding_window_inference(
                image, t.patch, inf.sw_batch_size, model, overlap=inf.overlap, mode=inf.mode
            )
            pred = one_hot(logits.argmax(1, keepdim=True), self.num_classes)
            truth = one_hot(batch["label"].to(device).long(), self.num_classes)
            dices.append(compute_dice(pred, truth, include_background=False, ignore_empty=True))
            hds.append(hausdorff95(pred, truth, t.spacing))
        per_dice, per_hd = class_means(torch.cat(dices)), class_means(torch.cat(hds))
        names = [self.labels[k] for k in sorted(self.labels) if k != 0]
        out: dict[str, Any] = {"val_dice": _mean_of_finite(per_dice)}
        for name, d, h in zip(names, per_dice, per_hd):
            out[f"val_dice_{name}"] = _finite(d)
            out[f"val_hd95_{name}"] = _finite(h)
        return out


class ClassificationTask:
    """One class per volume; cross-entropy loss; ROC-AUC (one-vs-rest mean) and accuracy."""

    key_metric = "val_auc"
    tie_metric: str | None = "val_accuracy"  # AUC = 1.0 says nothing about the decision threshold

    def __init__(self, cfg: Config, labels: dict[int, str]) -> None:
        self.cfg, self.labels = cfg, labels
        self.num_classes = len(labels)
        self.loss = torch.nn.CrossEntropyLoss()

    def targets(self, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        return torch.as_tensor(batch["label"]).long().to(device)

    def step_loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(model(inputs), targets)

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, loader: Any, device: torch.device) -> dict[str, Any]:
        probs, ys = [], []
        for batch in loader:
            probs.append(torch.softmax(model(batch["image"].to(device)).float(), 1).cpu())
            ys.append(torch.as_tensor(batch["label"]).long())
        return classification_metrics(torch.cat(probs), torch.cat(ys), self.num_classes)


def classification_metrics(probs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, Any]:
    """ROC-AUC (MONAI's compute_roc_auc, macro over classes) and accuracy from class probabilities."""
    auc = compute_roc_auc(probs, one_hot(labels[:, None], num_classes, dim=1), average="macro")
    accuracy = (probs.argmax(1) == labels).float().mean().item()
    return {"val_auc": _finite(auc), "val_accuracy": accuracy}


def make_task(cfg: Config, labels: dict[int, str]) -> SegmentationTask | ClassificationTask:
    return SegmentationTask(cfg, labels) if cfg.task == "segmentation" else ClassificationTask(cfg, labels)

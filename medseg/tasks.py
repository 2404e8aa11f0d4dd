"""What differs between segmentation and classification: loss, targets, validation metrics.

Validation during training runs on the model's own grid (resampled volumes). Final numbers for a
trained model come from :mod:`medseg.evaluate`, which scores predictions in each case's original
geometry through the same inference path users run.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric, HausdorffDistanceMetric, ROCAUCMetric
from monai.networks.utils import one_hot

from medseg.config import Config

log = logging.getLogger(__name__)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(float(x)) else None


class SegmentationTask:
    """Voxel-wise classes; DiceCE loss (fused with train.memory=fused); Dice and 95th-percentile Hausdorff distance per class."""

    key_metric = "val_dice"

    def __init__(self, cfg: Config, labels: dict[int, str]) -> None:
        self.cfg, self.labels = cfg, labels
        self.num_classes = len(labels)
        # train.memory=fused: the same loss without its full-resolution softmax/one-hot/log-softmax maps.
        if cfg.train.memory == "fused":
            from medseg.kernels.loss import FusedDiceCELoss

            self.loss: torch.nn.Module = FusedDiceCELoss()
            log.info("train.memory=fused: fused Dice+CE loss (no softmax/one-hot maps kept)")
        else:
            self.loss = DiceCELoss(to_onehot_y=True, softmax=True)

    def targets(self, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        return batch["label"].to(device)

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, loader: Any, device: torch.device) -> dict[str, Any]:
        t, inf = self.cfg.transforms, self.cfg.infer
        dice = DiceMetric(include_background=False, reduction="mean_batch", ignore_empty=True)
        hd95 = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="mean_batch")
        for batch in loader:
            image = batch["image"].to(device)
            logits = sliding_window_inference(
                image, t.patch, inf.sw_batch_size, model, overlap=inf.overlap, mode=inf.mode
            )
            pred = one_hot(logits.argmax(1, keepdim=True), self.num_classes)
            truth = one_hot(batch["label"].to(device).long(), self.num_classes)
            dice(pred, truth)
            hd95(pred, truth, spacing=t.spacing)
        per_dice, per_hd = dice.aggregate().cpu().tolist(), hd95.aggregate().cpu().tolist()
        names = [self.labels[k] for k in sorted(self.labels) if k != 0]
        out: dict[str, Any] = {"val_dice": _finite(sum(per_dice) / len(per_dice))}
        for name, d, h in zip(names, per_dice, per_hd):
            out[f"val_dice_{name}"] = _finite(d)
            out[f"val_hd95_{name}"] = _finite(h)
        return out


class ClassificationTask:
    """One class per volume; cross-entropy loss; ROC-AUC (one-vs-rest mean) and accuracy."""

    key_metric = "val_auc"

    def __init__(self, cfg: Config, labels: dict[int, str]) -> None:
        self.cfg, self.labels = cfg, labels
        self.num_classes = len(labels)
        self.loss = torch.nn.CrossEntropyLoss()

    def targets(self, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        return torch.as_tensor(batch["label"]).long().to(device)

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, loader: Any, device: torch.device) -> dict[str, Any]:
        probs, ys = [], []
        for batch in loader:
            probs.append(torch.softmax(model(batch["image"].to(device)).float(), 1).cpu())
            ys.append(torch.as_tensor(batch["label"]).long())
        return classification_metrics(torch.cat(probs), torch.cat(ys), self.num_classes)


def classification_metrics(probs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, Any]:
    """ROC-AUC (MONAI's ROCAUCMetric, macro over classes) and accuracy from class probabilities."""
    auc = ROCAUCMetric(average="macro")
    auc(probs, one_hot(labels[:, None], num_classes, dim=1))
    accuracy = (probs.argmax(1) == labels).float().mean().item()
    return {"val_auc": _finite(auc.aggregate()), "val_accuracy": accuracy}


def make_task(cfg: Config, labels: dict[int, str]) -> SegmentationTask | ClassificationTask:
    return SegmentationTask(cfg, labels) if cfg.task == "segmentation" else ClassificationTask(cfg, labels)

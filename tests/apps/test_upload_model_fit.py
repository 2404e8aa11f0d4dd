"""Which model the page starts on for an upload (apps/registry.py ``best_model``, with the image's
modality from apps/trust.py ``image_modality``), on real scans: TotalSegmentator's example CT and
MR and a Task04_Hippocampus MR from ``../shared/data``.

The models are described by the metadata the registry reads from a bundle (``ModelInfo``): a CT
and an MR segmentation model, a CT classifier and a two-channel model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from medseg.apps import trust
from medseg.apps.registry import NOT_CT, ModelInfo, best_model, fit_reason, modality_code
from medseg.inference.io import load_image

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
CT = SHARED / "totalseg-examples" / "example_ct_sm.nii.gz"
TS_MR = SHARED / "totalseg-examples" / "example_mr_sm.nii.gz"
HIPPO = SHARED / "Task04_Hippocampus" / "imagesTr" / "hippocampus_001.nii.gz"
pytestmark = pytest.mark.skipif(
    not all(p.is_file() for p in (CT, TS_MR, HIPPO)),
    reason="the shared real data (../shared/data) is not on this machine",
)

BASE = ModelInfo(
    bundle=Path("/runs/ct-organs/bundle"),
    name="ct-organs",
    task="segmentation",
    network="unet",
    labels={0: "background", 1: "organ"},
    spacing=(1.5, 1.5, 2.0),
    patch=(96, 96, 96),
    window=(-150.0, 250.0),
    modality="CT",
)
# sorted by name, as the sidebar lists them: the classifier comes first
MODELS = [
    replace(BASE, bundle=Path("/runs/a-ct-classifier/bundle"), name="a-ct-classifier", task="classification"),
    replace(
        BASE, bundle=Path("/runs/b-two-channel/bundle"), name="b-two-channel", modality="MRI", channels=2
    ),
    BASE,
    replace(
        BASE, bundle=Path("/runs/hippocampus/bundle"), name="hippocampus", modality="MRI", window=(0.0, 1.0)
    ),
]


def facts(path: Path) -> tuple[int, str]:
    image = load_image(path)
    return int(image.shape[0]), trust.image_modality(
        image[0].numpy(), str(image.meta.get("modality", "") or "")
    )


def test_a_ct_upload_starts_on_the_ct_segmentation_model() -> None:
    channels, modality = facts(CT)
    assert (channels, modality) == (1, "CT")  # Hounsfield units: air at -1024
    assert best_model(MODELS, channels, modality, current=MODELS[0]).name == "ct-organs"
    assert fit_reason(BASE, channels, modality) == "it segments CT images with 1 channel, like this one"


@pytest.mark.parametrize("path", [TS_MR, HIPPO], ids=["totalseg-mr", "hippocampus"])
def test_an_mr_upload_starts_on_an_mr_segmentation_model(path: Path) -> None:
    channels, modality = facts(path)
    assert (channels, modality) == (1, NOT_CT)  # a NIfTI file stores no modality; not Hounsfield units
    assert best_model(MODELS, channels, modality, current=MODELS[0]).name == "hippocampus"


def test_the_current_model_stays_when_none_fits_better() -> None:
    channels, modality = facts(CT)
    twin = replace(BASE, bundle=Path("/runs/ct-organs-2/bundle"), name="ct-organs-2")
    assert best_model([*MODELS, twin], channels, modality, current=twin) is twin
    # DICOM's Modality and a dataset's word for it are one code
    assert modality_code("MRI") == modality_code("MR") == modality_code("t2") == "MR"

"""The Model part of the page head: trust warnings for this input, the run button and its result."""

from __future__ import annotations

import streamlit as st

from medseg.apps import render, trust, viewport
from medseg.apps.cache import all_models, cached_bundle, cached_facts
from medseg.apps.export import mask_nifti_bytes
from medseg.apps.inference import Result, run_model
from medseg.apps.messages import problem
from medseg.apps.panels.export import dicom_seg, download_names
from medseg.apps.registry import ModelInfo, best_model, fit_reason
from medseg.apps.state import (
    MODEL_CHOICE,
    PAGE_MODEL,
    RESULT,
    RUN_REQUESTED,
    TRUST,
    CaseResult,
    LoadedCase,
    ModelChoice,
    TrustNotes,
    set_position,
)
from medseg.apps.timings import mark
from medseg.bundle.load import Bundle
from medseg.datasets.nifti import nifti_codes

MODEL_KEY = "model"  # the sidebar picker's widget key (``panels.sidebar``)


def remember_page_model(info: ModelInfo) -> None:
    """Note the picker's model on every run, and who chose it: the page at first; the user once it
    differs from the last run's without the page having set it (:func:`apply_model_choice`)."""
    seen = PAGE_MODEL.get()
    if seen is None:
        PAGE_MODEL.set(("page", str(info.bundle)))
    elif seen[1] != str(info.bundle):
        PAGE_MODEL.set(("user", str(info.bundle)))


def choose_model(info: ModelInfo, loaded: LoadedCase) -> bool:
    """Choose the model that fits a new upload best (:func:`medseg.apps.registry.best_model`: its
    input channels, then its training modality, then segmentation before classification), when
    that is not ``info``, the one picked now, and the user has not picked ``info`` themselves.
    True when it was chosen: the page must run again for the picker to show it
    (:func:`apply_model_choice`)."""
    if (PAGE_MODEL.get() or ("page", ""))[0] == "user":
        return False  # the user's own pick stays
    models, _ = all_models()
    if not models:
        return False
    channels = int(loaded.image.shape[0])
    modality = trust.image_modality(loaded.image[0].numpy(), str(loaded.image.meta.get("modality", "") or ""))
    best = best_model(models, channels, modality, info)
    if best.bundle == info.bundle:
        return False
    note = f"Model chosen for this upload: {best.name}, because {fit_reason(best, channels, modality)}."
    MODEL_CHOICE.set(ModelChoice(loaded.key, str(best.bundle), note))
    return True


def apply_model_choice() -> None:
    """Set the sidebar picker to the model chosen for a new upload; called before it is drawn
    (Streamlit refuses a widget's value set after the widget)."""
    chosen = MODEL_CHOICE.get()
    if chosen is not None and chosen.bundle:
        st.session_state[MODEL_KEY] = chosen.bundle
        PAGE_MODEL.set(("page", chosen.bundle))
        MODEL_CHOICE.set(ModelChoice(chosen.case, "", chosen.note))  # applied once; the note stays


def model_choice_note(loaded: LoadedCase) -> None:
    """Why the page chose the model it did for this upload (until the user uploads another)."""
    chosen = MODEL_CHOICE.get()
    if chosen is not None and chosen.case == loaded.key:
        st.caption(f"{chosen.note} Another can be picked in the sidebar.")


def trust_section(info: ModelInfo, loaded: LoadedCase) -> list[str]:
    """Warnings where this input lies outside what the model was trained on (kept per image and model)."""
    key = (loaded.key, str(info.bundle), info.mtime)
    kept = TRUST.get()
    if not kept or kept.key != key:
        facts = cached_facts(info)
        image = loaded.image
        warnings = trust.input_warnings(
            info,
            facts,
            image[0].numpy(),
            image.affine.numpy(),
            str(image.meta.get("modality", "") or ""),
            same_dataset=loaded.key[0] == "demo",
        )
        kept = TrustNotes(key=key, warnings=warnings, note=trust.facts_note(facts))
        TRUST.set(kept)
    for w in kept.warnings:
        st.warning(w, icon="⚠️")
    if kept.warnings and kept.note:
        st.caption(kept.note)
    return kept.warnings


def _predict(info: ModelInfo, loaded: LoadedCase, key: tuple, bar) -> tuple[Bundle, CaseResult]:
    """Run the model on the loaded case: its bundle, and the result with the label map in the forms
    the page draws and offers (None for a classifier)."""
    mark("model start")
    bundle = cached_bundle(str(info.bundle), info.mtime)
    result = run_model(bundle, loaded.image, progress=lambda f, t: bar.progress(f, text=t))
    mark("model done")
    label = result.prediction.label
    labels_nifti = (
        viewport.nifti_bytes(label[0].numpy(), label.affine.numpy(), True) if label is not None else None
    )
    stored = CaseResult(
        key=key,
        result=result,
        labels_view=render.labels_to_view(label[0].numpy(), loaded.view) if label is not None else None,
        mask=mask_nifti_bytes(label, nifti_codes(loaded.image)) if label is not None else None,
        names=download_names(loaded.case, info.name),
        labels_nifti=labels_nifti,
        labels_id=viewport.digest(labels_nifti) if labels_nifti is not None else "none",
    )
    mark("result forms made")
    return bundle, stored


def model_section(info: ModelInfo, loaded: LoadedCase) -> Result | None:
    """The run button, the progress bar, and the result kept for this image and model.

    A click is kept in the session (:data:`~medseg.apps.state.RUN_REQUESTED`) until the result is
    stored, not only in the button's one-run value: another rerun (the viewport reporting WebGL or
    an edit, any widget) stops a script run at its next Streamlit call, the progress bar's
    included, and the next run would see the button unpressed. With the request kept, that run
    starts the model again.
    """
    key = (loaded.key, str(info.bundle), info.mtime)
    model_choice_note(loaded)
    stored = RESULT.get()
    if stored and stored.key == key:
        RUN_REQUESTED.clear()
        return stored.result
    verb = "segmentation" if info.task == "segmentation" else "classification"
    if RUN_REQUESTED.get() != key:
        st.button(
            f"Run {verb} with {info.name}", type="primary", key="run", on_click=RUN_REQUESTED.set, args=(key,)
        )
        return None
    bar = st.progress(0.0, text="Loading the model…")
    try:
        bundle, stored = _predict(info, loaded, key, bar)
    except Exception as e:  # noqa: BLE001 - a bad input or model is a message, not a crash
        RUN_REQUESTED.clear()
        bar.empty()
        st.error(problem(e))
        return None
    if stored.mask is not None and loaded.source == "DICOM":
        bar.progress(1.0, text="Writing the DICOM-SEG export")
        stored.dicom_seg, stored.dicom_seg_problem, stored.dicom_seg_note = dicom_seg(
            stored.result, loaded, bundle, info
        )
    bar.empty()
    RESULT.set(stored)
    RUN_REQUESTED.clear()
    if stored.labels_view is not None:
        centre = render.label_centre(stored.labels_view)
        if centre is not None:  # start the panels on the segmented region
            set_position(centre)
    st.rerun()
    return None  # pragma: no cover - st.rerun does not return

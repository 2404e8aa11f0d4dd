"""The right column's image metadata and the model's answer: volumes per label or class probabilities."""

from __future__ import annotations

import html

import pandas as pd
import streamlit as st

from medseg.apps import render
from medseg.apps.panels.export import download_buttons
from medseg.apps.registry import ModelInfo
from medseg.apps.state import CaseResult, LoadedCase


def metadata_panel(loaded: LoadedCase) -> None:
    with st.expander("Image metadata (no patient identifiers are shown)", expanded=False):
        st.table(
            pd.DataFrame([{"field": k, "value": v} for k, v in loaded.info.items()]),
            hide_index=True,
        )


def results_panel(info: ModelInfo, stored: CaseResult, warnings: list[str]) -> None:
    """How long the model took, a reminder of the trust warnings, its answer and the downloads."""
    result = stored.result
    st.caption(f"{result.model} answered in {result.seconds:.1f} s")
    if warnings:
        st.warning(
            f"This input lies outside what {result.model} was trained on ({len(warnings)} warning(s) "
            "above): do not rely on this result."
        )
    if result.task == "classification":
        probs = result.prediction.probabilities or {}
        best = max(probs, key=probs.get)
        st.success(f"Most likely: **{best}** (p = {probs[best]:.3f})")
        st.table(
            pd.DataFrame([{"class": k, "probability": f"{v:.4f}"} for k, v in probs.items()]),
            hide_index=True,
        )
        return
    legend = " ".join(
        f'<span style="color:{render.colour_hex(k)}">&#9632;</span> {html.escape(name)}'
        for k, name in sorted(info.labels.items())
        if k != 0
    )
    st.markdown(legend, unsafe_allow_html=True)
    st.table(
        pd.DataFrame(
            [
                {"label": v["label"], "voxels": int(v["voxels"]), "volume (mL)": f"{float(v['ml']):.2f}"}
                for v in result.volumes
            ]
        ),
        hide_index=True,
    )
    download_buttons(stored)

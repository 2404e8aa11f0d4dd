"""The medseg viewer page: ``medseg app`` (or ``streamlit run apps/app.py``) serves it on localhost.

Streamlit reruns this script on every interaction. What is slow happens once and is kept: bundles
in ``st.cache_resource``, the model list in ``st.cache_data`` (briefly, so new runs appear), the
loaded image, its RAS view and the model's result in the session's state
(:mod:`medseg.apps.state`). A slider move therefore only cuts and draws three slices.

This script holds the page's layout; each part is drawn by a module of :mod:`medseg.apps.panels`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import streamlit as st

from medseg.apps import upload
from medseg.apps.panels import viewer
from medseg.apps.panels.compare import compare_panel, current_second
from medseg.apps.panels.corrections import corrections_panel
from medseg.apps.panels.input import input_section
from medseg.apps.panels.model import apply_model_choice, model_section, remember_page_model, trust_section
from medseg.apps.panels.results import metadata_panel, results_panel
from medseg.apps.panels.sidebar import sidebar_models
from medseg.apps.state import RESULT
from medseg.apps.timings import mark

# No CSS transitions on the page. Each progress update (one per sliding-window batch) and each
# rerun's stale fade would otherwise animate for a while; in a browser without a GPU (software
# WebGL) every animated frame composites the whole page, the viewport's large canvas included, and
# took about a core from the model running beside it: inference in the page went from 19.2 s to
# 13.7 s on a 512 x 512 x 300 CT with transitions off (scripts/bench_viewer.py --edit-only).
NO_TRANSITIONS = "<style>*, *::before, *::after { transition: none !important; }</style>"


def main() -> None:
    st.set_page_config(page_title="medseg viewer", layout="wide")
    st.html(NO_TRANSITIONS)
    apply_model_choice()  # a model chosen for a new upload, before the picker is drawn
    info = sidebar_models()
    if info is None:
        return
    remember_page_model(info)
    # the page's two parts exist before anything is read, so the viewport can be drawn into the left
    # column while the upload is still being read (into ``head``, above it)
    head = st.container()
    top = st.columns([2, 1])
    early: dict[str, Any] = {}

    def paint_early(volume: upload.ViewerNifti, vid: str, affine: np.ndarray, step: int) -> bool:
        if not viewer.interactive_wanted():
            return False
        with top[0]:
            early["report"] = viewer.first_paint(volume, vid, affine, step)
        return True

    with head:
        loaded = input_section(info, early=paint_early)
    if loaded is None:
        return
    with head:
        warnings = trust_section(info, loaded)
        result = model_section(info, loaded)
    stored = RESULT.get() if result is not None else None
    second = current_second(loaded) if stored is not None else None
    with top[0]:  # drawn first: the viewport's report (the user's edits) feeds the panels beside it
        reported = viewer.viewer(loaded, stored, info, second, early or None)
    with top[1]:
        metadata_panel(loaded)
        if stored is not None:
            results_panel(info, stored, warnings)
            if stored.result.task == "segmentation" and stored.result.prediction.label is not None:
                corrections_panel(info, loaded, stored, reported)
                compare_panel(info, loaded, stored, second)
    st.caption("Research use only; not for clinical decisions.")
    mark("script end")


main()

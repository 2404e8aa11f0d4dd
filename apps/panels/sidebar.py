"""The sidebar's model picker and model card: task, labels, training input, validation metrics."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from medseg.apps import trust
from medseg.apps.cache import all_models, cached_facts
from medseg.apps.registry import ModelInfo


def _model_card(info: ModelInfo) -> None:
    labels = ", ".join(f"{k}: {v}" for k, v in sorted(info.labels.items()))
    st.sidebar.markdown(
        f"**Task** {info.task} ({info.network})  \n**Labels** {labels}  \n"
        f"**Trained on** {info.modality or 'images'}, resampled to "
        f"{' × '.join(f'{s:g}' for s in info.spacing)} mm  \n"
        f"**Patch** {' × '.join(str(p) for p in info.patch)}  \n"
        f"**Model input** {info.intensity or f'window {info.window[0]:g} … {info.window[1]:g}'} "
        "(fixed by training; the display window below does not change it)"
    )
    facts = cached_facts(info)
    if info.metrics:
        st.sidebar.caption("Validation metrics")
        st.sidebar.table(
            pd.DataFrame(
                [
                    {"metric": k, "value": f"{v:.4g}" if isinstance(v, float) else str(v)}
                    for k, v in info.metrics.items()
                ]
            ),
            hide_index=True,
        )
        st.sidebar.caption(trust.metrics_source(info, facts))
    for line in trust.evaluation_lines(info):
        st.sidebar.caption(f"Evaluated on {line}")


def sidebar_models() -> ModelInfo | None:
    """The model chosen in the sidebar (its card drawn below the picker), or None when there is none."""
    st.sidebar.title("medseg viewer")
    st.sidebar.text_input(
        "Another model folder",
        key="extra_folder",
        help="A bundle folder, a run folder, or a folder of runs inside the model folders the viewer "
        "was started with (medseg app --runs); its name alone is looked for in them.",
    )
    models, problems = all_models()
    for p in problems:
        st.sidebar.warning(p)
    if not models:
        st.sidebar.error(
            "No trained models were found in the model folders. Type the folder of a trained model "
            "(or of several) into 'Another model folder' above."
        )
        return None
    by_path = {str(m.bundle): m for m in models}
    chosen = st.sidebar.selectbox("Model", list(by_path), format_func=lambda p: by_path[p].title, key="model")
    info = by_path[chosen]
    _model_card(info)
    return info

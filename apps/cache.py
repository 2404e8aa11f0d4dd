"""What the page keeps across reruns and sessions of this server: bundles, the model list, training facts.

Bundles live in ``st.cache_resource`` (one network per bundle file version); the model list in
``st.cache_data`` briefly, so new runs appear; a model's training-set facts for a minute at most.
"""

from __future__ import annotations

import streamlit as st

from medseg.apps import trust
from medseg.apps.registry import ModelInfo, allowed_folder, default_folders, list_models
from medseg.bundle.load import Bundle, load_bundle
from medseg.errors import MedsegError


@st.cache_resource(show_spinner="Loading the model…", max_entries=4)
def cached_bundle(path: str, mtime: float) -> Bundle:
    """One network per bundle file version, shared by every session of this server."""
    del mtime  # part of the cache key only
    return load_bundle(path)


@st.cache_data(ttl=20, show_spinner=False)
def cached_models(folders: tuple[str, ...]) -> tuple[list[ModelInfo], list[str]]:
    return list_models(list(folders))


@st.cache_data(ttl=60, show_spinner=False)
def _facts(bundle: str, mtime: float, _info: ModelInfo) -> trust.TrainingFacts:
    del bundle, mtime  # the cache key only
    return trust.training_facts(_info)


def cached_facts(info: ModelInfo) -> trust.TrainingFacts:
    """The training-set facts of a model, read once a minute at most (headers of its training images)."""
    return _facts(str(info.bundle), info.mtime, info)


def all_models() -> tuple[list[ModelInfo], list[str]]:
    """The models in the runs folders and in the one typed into 'Another model folder' (only when it
    lies inside them: :func:`~medseg.apps.registry.allowed_folder`), and the problems to show."""
    extra = str(st.session_state.get("extra_folder", "") or "").strip()
    roots = default_folders()
    folders, refused = [str(p) for p in roots], []
    if extra:
        try:
            folders.append(str(allowed_folder(extra, roots)))
        except MedsegError as e:
            refused.append(str(e))
    models, problems = cached_models(tuple(folders))
    return models, refused + problems

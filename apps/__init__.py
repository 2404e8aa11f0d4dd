"""medseg.apps: the Streamlit viewer for trained bundles."""

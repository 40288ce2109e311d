"""Shared pytest fixtures."""

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model's Hugging Face folder (imported from its GGUF on first use, then cached)."""
    from folio.model.registry import resolve_model

    return resolve_model("smollm2-135m-instruct")

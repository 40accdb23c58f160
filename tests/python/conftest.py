"""Shared fixtures: one load of the default model (SmolLM2-135M-Instruct, models/ of the checkout
or $CERTKV_MODEL) for the whole session."""

import pytest

import certkv


@pytest.fixture(scope="session")
def model() -> certkv.Model:
    return certkv.Model()


PROMPT = "Write one sentence about the sea."

"""Model states in DJL's words: what `GET /models` lists (the pool's enum name) and what
`GET /ping` and `GET /models/<name>` say (Healthy / Unhealthy for a ready model)."""

from __future__ import annotations

import pytest

from lmserve.container.model_status import health_status, listed_status
from lmserve.rolling_batch.ipc.protocol import EngineState


@pytest.mark.parametrize(
    ("state", "listed", "health"),
    [
        (EngineState.LOADING, "PENDING", "PENDING"),
        (EngineState.READY, "READY", "Healthy"),
        (EngineState.FAILED, "FAILED", "FAILED"),
    ],
)
def test_engine_states_read_as_djl_spells_them(state, listed, health):
    assert listed_status(state) == listed
    assert health_status(state) == health
    assert listed_status(str(state)) == listed  # as the state file's JSON holds it


def test_a_ready_engine_that_stopped_answering_is_unhealthy():
    assert health_status(EngineState.READY, answering=False) == "Unhealthy"
    assert health_status(EngineState.FAILED, answering=False) == "FAILED"

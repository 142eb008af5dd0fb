"""A model's state in the words DJL Serving uses, so clients and dashboards written against DJL
read lmserve's answers unchanged.

DJL (WorkerPoolConfig.Status, ModelManager.workerStatus, DescribeWorkflowResponse):
- `GET /models` lists the pool's status as the enum's name: PENDING, READY or FAILED;
- `GET /ping` and `GET /models/<name>` say "Healthy" for a ready model whose workers are all
  up, "Unhealthy" for a ready one missing workers, else the enum's name (PENDING, FAILED).
lmserve has one engine instead of workers: it is "Unhealthy" when ready but not answering.
"""

from __future__ import annotations

from lmserve.rolling_batch.ipc.protocol import EngineState

PENDING = "PENDING"
READY = "READY"
FAILED = "FAILED"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

_LISTED = {EngineState.LOADING: PENDING, EngineState.READY: READY, EngineState.FAILED: FAILED}


def listed_status(state: str) -> str:
    """The status `GET /models` shows."""
    return _LISTED[state]


def health_status(state: str, answering: bool = True) -> str:
    """The status `GET /ping` and `GET /models/<name>` show; `answering`: whether a ready
    engine answered the front end recently."""
    if state == EngineState.READY:
        return HEALTHY if answering else UNHEALTHY
    return _LISTED[state]

"""The staleness core: versioned buffers and the Reserve / Occupy / Consume protocol.

Standard library only, so anyone can embed it. The rules and names follow
``shared/spec/staleness-protocol.md`` exactly; see :class:`StalenessManager`.
"""

from .manager import StalenessManager
from .types import (
    Batch,
    BufferState,
    CompleteResult,
    Event,
    NotReadyError,
    StaleVersionError,
    Stats,
    Status,
)

__all__ = [
    "StalenessManager",
    "BufferState",
    "StaleVersionError",
    "NotReadyError",
    "Status",
    "CompleteResult",
    "Batch",
    "Event",
    "Stats",
]

"""The staleness core: versioned buffers and the Reserve / Occupy / Consume protocol.

Standard library only, so anyone can embed it. The rules and names follow
``shared/spec/staleness-protocol.md`` exactly; see :class:`StalenessManager`. The value types
(:class:`BufferState`, :class:`Status`, :class:`CompleteResult`, :class:`Batch`, :class:`Event`,
:class:`EventKind`, :class:`SnapshotEntry`, :class:`Stats`, the errors) are those of :mod:`.types`,
listed once there.
"""

from . import types
from .manager import StalenessManager
from .types import *  # noqa: F403  (types.__all__)

__all__ = ["StalenessManager"]
__all__ += types.__all__

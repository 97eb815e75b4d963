"""The serving side: rollout instances (one engine each: weight sync, partial rollout, migration hand-back), the
pool that routes trajectories over them, the routers and the sync / migration strategies, and the session a
trajectory generates through. It drives engines and knows nothing of the protocol client (``tests/test_layers.py``).
"""

from psrl.rollout.serving import instance, pool, router, session, sync
from psrl.rollout.serving.instance import *  # noqa: F403 -- the room's API is its modules' __all__, listed once there
from psrl.rollout.serving.pool import *  # noqa: F403
from psrl.rollout.serving.router import *  # noqa: F403
from psrl.rollout.serving.session import *  # noqa: F403
from psrl.rollout.serving.sync import *  # noqa: F403

__all__ = [*instance.__all__, *pool.__all__, *router.__all__, *session.__all__, *sync.__all__]

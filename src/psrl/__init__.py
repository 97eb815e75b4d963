"""psrl: asynchronous RL post-training of language models with provable staleness control.

Layers (dependencies point one way, top to bottom):

* :mod:`psrl.staleness` -- the pure Reserve / Occupy / Consume core (standard library only).
* :mod:`psrl.algo`, :mod:`psrl.models`, :mod:`psrl.tasks`, :mod:`psrl.train` -- the RL substrate.
* :mod:`psrl.rollout` -- agent manager, rollout instances, router, sync strategies (asyncio).
* :mod:`psrl.runtime` -- how the pieces are run (local asyncio).
* :mod:`psrl.sim`, :mod:`psrl.viz`, :mod:`psrl.cli` -- tools on top.
"""

__version__ = "0.1.0"

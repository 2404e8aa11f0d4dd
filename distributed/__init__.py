"""medseg.distributed: the training loop's view of the synchronisation backend.

The loop opens a session (:func:`open_session`) and asks it for a wrapped optimizer, a sampler for
its share of each epoch, and the epoch's numbers; it never knows which mode is active. One process
trains with :class:`LocalSession`; ranks started by ``medseg train --np N`` (horovodrun) use
:class:`HorovodSession` with bsp, gssp, ssp or local-sgd, or a peer between sites (bsp-hier, fedavg,
diloco), and optional compression (see
:mod:`medseg.distributed.sync.common`).
"""

from medseg.distributed.local_session import LocalSession, epoch_seed
from medseg.distributed.session import open_session

__all__ = ["LocalSession", "epoch_seed", "open_session"]

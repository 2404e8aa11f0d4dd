"""medseg.distributed: the training loop's view of the synchronisation backend.

The training loop never knows which synchronisation mode is active: it asks this package for a
wrapped optimizer. Today one process trains alone; the Horovod backend (GSSP, compressed allreduce)
plugs in behind the same call.
"""

from medseg.distributed.optimizer import wrap_optimizer

__all__ = ["wrap_optimizer"]

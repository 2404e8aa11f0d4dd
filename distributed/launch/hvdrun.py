"""Horovod's own launcher (``horovodrun``), less its per-launch build check: ``python hvdrun.py ARGS``.

Run as a file (:func:`medseg.distributed.launch.launcher.horovodrun_command`), not with ``-m``, so that the
``medseg.distributed`` package (which imports PyTorch and MONAI) is not imported first.

``horovodrun --gloo`` first asks whether Horovod was built with Gloo (``horovod.common.util.gloo_built``).
It answers by forking a child per framework extension that imports it (``horovod.tensorflow``, then
``horovod.torch`` with all of PyTorch), on every launch, before any rank starts: seconds of the
time between the launch and the ranks' first line. A job of ``medseg bench sites`` pays it per run.

Here the question goes to each rank instead, where the answer costs nothing: the rank has already
imported ``horovod.torch``, and :class:`medseg.distributed.session.HorovodSession` refuses to start
(exit 2, naming ``make setup``) when its Horovod lacks Gloo. Everything else is Horovod's
``run_commandline`` as ``horovodrun`` runs it: arguments, ssh launch, rendezvous, exit status
(except ``--check-build``, which through this file always lists Gloo).
"""

from __future__ import annotations

import os
import sys

# Run as a file, Python put this file's folder first on the path, where its neighbours (session,
# sync, compression, ...) would stand in for top-level modules of the same names: take it off.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)


def main() -> int:
    from horovod.runner import launch

    # Answered by the ranks (HorovodSession.__init__); horovodrun's own answer forks an importer per
    # framework on every launch. Horovod's launch module calls the name it imported, so that name is
    # the one replaced.
    launch.gloo_built = lambda verbose=False: True
    launch.run_commandline()
    return 0


if __name__ == "__main__":
    sys.argv[0] = "horovodrun"  # its usage and error messages name the tool users know
    sys.exit(main())

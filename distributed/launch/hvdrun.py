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
(except ``--check-build``, which through this file always lists Gloo), with two changes to its HTTP
rendezvous server (the key-value store through which Gloo's ranks find each other) and one to its
ssh command:

- ssh checks host keys (``StrictHostKeyChecking=yes``; Horovod turns it off), so the launcher starts
  ranks only on hosts whose keys are already in ``known_hosts`` (README, "Security"), and a host
  that answers with another key is refused instead of being given the job's secret;

- it listens only on the address the ranks are told to reach it on (``HOROVOD_GLOO_RENDEZVOUS_ADDR``:
  the launcher's address on the job's interface, the tunnel's in a secure job, loopback for one
  host), not on every interface of the launcher's machine;
- a PUT whose ``Content-Length`` is missing, malformed or over :data:`MAX_RENDEZVOUS_PUT` is
  answered 413 before its body is read (Horovod reads whatever length a client claims).

Who may write to it is still anyone who reaches that address: on a secure job, the sites' tunnel
peers only (docs/design.md, "The site link").
"""

from __future__ import annotations

import os
import sys

# Run as a file, Python put this file's folder first on the path, where its neighbours (session,
# sync, compression, ...) would stand in for top-level modules of the same names: take it off.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)


MAX_RENDEZVOUS_PUT = 64 * 1024  # bytes of one rendezvous value (Gloo's are addresses: tens of bytes)


def main() -> int:
    from horovod.runner import launch

    # Answered by the ranks (HorovodSession.__init__); horovodrun's own answer forks an importer per
    # framework on every launch. Horovod's launch module calls the name it imported, so that name is
    # the one replaced.
    launch.gloo_built = lambda verbose=False: True
    _check_host_keys()
    _confine_rendezvous()
    launch.run_commandline()
    return 0


def _check_host_keys() -> None:
    """Horovod's ssh command with host-key checking on (its ``get_ssh_command`` reads this prefix
    when it is called)."""
    from horovod.runner.util import remote

    remote.SSH_COMMAND_PREFIX = (
        "ssh -o PasswordAuthentication=no -o BatchMode=yes -o StrictHostKeyChecking=yes"
    )


def _confine_rendezvous() -> None:
    """Bind Horovod's rendezvous server to the ranks' address and bound what a PUT may send (module
    docstring). Horovod's modules call the names they imported, so those names are replaced."""
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server

    original_launch = gloo_run.launch_gloo

    def launch_gloo(command, exec_command, settings, nics, env, server_ip):  # noqa: ANN001, ANN202
        http_server.find_port = lambda factory: _bind_on(server_ip, factory)
        return original_launch(command, exec_command, settings, nics, env, server_ip)

    gloo_run.launch_gloo = launch_gloo
    original_put = http_server.KVStoreHandler.do_PUT

    def do_put(handler) -> None:  # noqa: ANN001
        try:
            length = int(handler.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_RENDEZVOUS_PUT:
            handler.close_connection = True
            handler.send_status_code(413)
            return
        original_put(handler)

    http_server.KVStoreHandler.do_PUT = do_put


def _bind_on(host: str, factory):  # noqa: ANN001, ANN202
    """Horovod's ``find_port`` on one address: the server on ``host`` at a port the kernel picks."""
    server = factory((host, 0))
    return server, server.server_address[1]


if __name__ == "__main__":
    sys.argv[0] = "horovodrun"  # its usage and error messages name the tool users know
    sys.exit(main())

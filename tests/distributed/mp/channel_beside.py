"""One rank of a two-process channel built with no Horovod at all (only horovodrun's environment and
its rendezvous server): prints this rank's view as JSON."""

import json
import os
import sys

from medseg.distributed import channel_startup
from medseg.distributed.comm import auth

opening = channel_startup.start_beside_horovod(60, auth.job_secret())
if opening is None:
    sys.exit("no rendezvous server in the environment")
channel, hosts, phases = channel_startup.joined(opening, int(os.environ["HOROVOD_RANK"]), 2)
total = channel.gather_json(channel.rank + 1, "speed")
print(
    json.dumps({"rank": channel.rank, "hosts": hosts, "gathered": total, "phases": sorted(phases)}),
    flush=True,
)
channel.barrier()  # neither rank leaves while the other still reads from it
# Leave without tearing down Gloo's threads from the interpreter's exit (they may abort the process).
os._exit(0)

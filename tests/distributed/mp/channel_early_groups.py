"""One rank of a three-process channel whose sync groups connect beside its world group (no Horovod:
horovodrun's environment, its rendezvous server and medseg's ``MEDSEG_RANK_HOSTS``); argv[1] is
``same`` (set the groups named at launch) or ``other`` (set others). Prints this rank's view as JSON."""

import json
import os
import sys

import torch

from medseg.distributed import channel_startup
from medseg.distributed.comm import auth
from medseg.distributed.sync.groups import groups_by_host

opening = channel_startup.start_beside_horovod(60, auth.job_secret(), groups_by_host)
if opening is None:
    sys.exit("no rendezvous server in the environment")
channel, hosts, phases = channel_startup.joined(opening, int(os.environ["HOROVOD_RANK"]), 3)
groups = groups_by_host(hosts) if sys.argv[1] == "same" else [[0], [1, 2]]
channel.set_groups(groups)
sums = {}
for name, group in (("group", channel.group_pg), ("leaders", channel.leaders_pg)):
    if group is not None:
        t = torch.tensor([float(channel.rank + 1)])
        group.allreduce_(t)
        sums[name] = [group.name, float(t[0])]
print(json.dumps({"rank": channel.rank, "groups": channel.groups, "sums": sums}), flush=True)
channel.barrier()  # no rank leaves while another still reads from it
os._exit(0)

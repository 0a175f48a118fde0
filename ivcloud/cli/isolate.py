"""`ivcloud isolate`: the command line of :mod:`ivcloud.isolate`."""

from __future__ import annotations

import json

from ..isolate import POLICIES, plan, plan_json, read_topology, render_text
from . import int_at_least


def register(sub) -> None:
    p = sub.add_parser(
        "isolate", help="plan CPU isolation and vCPU pinning from the host "
                        "topology (hwloc)",
        description="Read the host topology with hwloc and propose which "
                    "cores to isolate (isolcpus=, nohz_full=, rcu_nocbs=), "
                    "which to keep for the host, and a pinning map for the "
                    "VMs, with <cputune> snippets and `ivcloud libvirt "
                    "domain-xml` arguments.")
    p.add_argument("--topology", metavar="FILE",
                   help="hwloc XML (`hwloc-ls --of xml`) instead of this "
                        "host")
    p.add_argument("--reserve-host", type=int_at_least(1), default=None,
                   metavar="N", help="cores kept for the host, spread over "
                                     "the NUMA nodes (default: one per "
                                     "node)")
    p.add_argument("--vms", type=int_at_least(0), default=0,
                   help="VMs to place (default 0: isolation only)")
    p.add_argument("--vcpus", type=int_at_least(1), default=1,
                   help="vCPUs per VM (default 1)")
    p.add_argument("--smt", choices=POLICIES, default="isolate",
                   help="SMT siblings: isolate = one vCPU per core, "
                        "siblings idle (default); core = each vCPU owns a "
                        "whole core; pack = a VM's vCPUs on sibling threads")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_isolate)


def _cmd_isolate(args) -> int:
    topology, current = read_topology(args.topology)
    result = plan(topology, args.reserve_host, args.vms, args.vcpus,
                  args.smt)
    if args.json:
        print(json.dumps(plan_json(result, current), indent=2))
    else:
        print(render_text(result, current), end="")
    return 0

"""`ivcloud server start|stop|status`: the command line of
:mod:`ivcloud.server`."""

from __future__ import annotations

import argparse
import json

from ..server import (DEFAULT_NAME, MAX_FAST_CHANNELS,
                      MAX_PEERS, MAX_QUEUE_SLOTS, format_size, parse_size,
                      paths_for, start, status, stop)
from . import (CliError, action, add_run_dir, checked, number,
               sub_actions)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=DEFAULT_NAME,
                   help=f"server name (default {DEFAULT_NAME})")
    add_run_dir(p, "directory for the socket, pid and state files")


def _ranged_int(lo: int, hi: int, power_of_two: bool = False):
    """argparse type of an integer option with a closed range."""
    return number(int, "invalid int value: '{}'", lambda value:
                  f"must be {lo}..{hi}, not {value}"
                  if not lo <= value <= hi else
                  f"must be a power of two, not {value}"
                  if power_of_two and value & (value - 1) else None)


def register(sub) -> None:
    p = sub.add_parser("server", help="manage ivshmem-server daemons",
                       description="Start, stop and inspect ivshmem-server "
                                   "daemons (one per name).")
    actions = sub_actions(p)

    s = action(actions, "start", _cmd_start, _common,
               help="start a server daemon")
    s.add_argument("--size", type=checked(parse_size), default=64 << 20,
                   help="region size, a power of two (default 64M)")
    s.add_argument("--vectors", type=_ranged_int(1, 64), default=1,
                   help="interrupt vectors per peer (default 1)")
    s.add_argument("--max-peers", type=_ranged_int(2, MAX_PEERS), default=None,
                   help=f"registry slots in the region, 2..{MAX_PEERS} "
                        f"(default 8); the region grows linearly with them")
    s.add_argument("--queue-slots", type=_ranged_int(2, MAX_QUEUE_SLOTS, True),
                   default=None,
                   help="cells of each peer's receive queue, shared by its "
                        "senders: a power of two (default 64)")
    s.add_argument("--fast-channels", type=_ranged_int(0, MAX_FAST_CHANNELS),
                   default=None,
                   help="fast per-pair channels per receiver, for its "
                        "busiest senders (default 8; 0: none)")
    s.add_argument("--group", default=None,
                   help="share socket and region with this group (0660)")
    s.add_argument("--host-file", action="store_true",
                   help="single-user mode: the region is the file "
                        "/dev/shm/ivcloud-NAME (unsealed: whoever can open "
                        "it can truncate it), so processes may also attach "
                        "by path; default: a sealed memfd handed out over "
                        "the socket only")
    s.add_argument("--verbose", action="store_true",
                   help="log joins and leaves to syslog")

    action(actions, "stop", _cmd_stop, _common, help="stop a server daemon")

    u = action(actions, "status", _cmd_status, _common,
               help="show whether a server runs and its peers")
    u.add_argument("--json", action="store_true", help="print JSON")


def _cmd_start(args) -> int:
    paths = paths_for(args.name, args.run_dir)
    pid = start(paths, args.size, args.vectors, args.max_peers, args.group,
                args.verbose, host_file=args.host_file,
                queue_slots=args.queue_slots,
                fast_channels=args.fast_channels)
    region = paths.region if args.host_file else "sealed memfd"
    print(f"server '{paths.name}' started (pid {pid}): socket {paths.socket}, "
          f"region {region} ({format_size(args.size)})")
    return 0


def _cmd_stop(args) -> int:
    print(stop(paths_for(args.name, args.run_dir)))
    return 0


def _cmd_status(args) -> int:
    paths = paths_for(args.name, args.run_dir)
    info = status(paths)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    if not info["running"]:
        stale = info.get("stale_files")
        raise CliError(f"server '{paths.name}' is not running"
                       + (f" (stale files: {', '.join(stale)})"
                          if stale else ""))
    if not args.json:
        peers = info.get("peers") or []
        size = info.get("size")
        print(f"server '{paths.name}': running (pid {info['pid']})")
        print(f"  socket  {info['socket']}")
        print(f"  region  {info['region']}"
              + (f" ({format_size(size)})" if size else ""))
        if info.get("vectors"):
            print(f"  vectors {info['vectors']}")
        print(f"  peers   {len(peers)}")
        for peer in peers:
            fields = " ".join(f"{k}={v}" for k, v in peer.items())
            print(f"    {fields}")
    return 0

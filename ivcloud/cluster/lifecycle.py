"""`up`, `down` and `status`: building a cluster step by step, recording
every step in state.json before the next starts, and taking it all
apart again from the record plus a sweep for holders by their marker,
also as the rollback of a failed `up` (docs/cluster.md, "Commands").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .. import server as server_mod
from ..mpis.regions import mpi_geometry
from ..errors import ClusterError, ClusterFailure, IvcloudError
from .. import process, procfs
from . import holder, kinds, network, regions
from .launch import PRIVATE_DIRS, agent_script_text, under
from .slurm.daemons import Slurm
from .slurm.daemons import status as slurm_status
from .state import StateDir, load, save
from .topology import (CORE_BRIDGE, HEAD_ADDRESS, HEAD_HOSTNAME, ClusterTopology,
                       hosts_file_text, topology_from_dict)

MIB = 1 << 20
REQUIRED_TOOLS = ("unshare", "nsenter", "taskset", "ip", "bash", "sleep",
                  "mount", "hostname")


# ---------------------------------------------------------------- checks

def preflight(topo: ClusterTopology) -> None:
    """What `up` needs from the machine; refusals before anything exists."""
    if os.geteuid() != 0:
        raise ClusterError("cluster up needs root (namespaces, mounts, bridges)")
    tools = list(REQUIRED_TOOLS) + (["tc"] if topo.uplink_rate_bps else [])
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise ClusterFailure(f"missing tools: {', '.join(missing)} "
                              f"(install util-linux, iproute2)")
    server_mod.server_binary()     # refuses a missing build


def region_geometry(topo: ClusterTopology):
    """(max_peers, size, geometry) of each server's region: a peer per
    vCPU of its instances (at least 8), `ivcloud mpirun`'s geometry (so
    jobs see the same BTL as on the host), 32 MiB to spare."""
    max_peers = max(8, topo.instances_per_server * topo.vcpus)
    geometry = mpi_geometry(max_peers)
    need = server_mod._min_size(max_peers, **geometry) + 32 * MIB
    size = 64 * MIB
    while size < need:
        size <<= 1
    return max_peers, size, geometry


def _host_namespaces() -> Dict[str, set]:
    """The namespaces `down` must never sweep: ours and init's."""
    out: Dict[str, set] = {}
    for kind in holder.NS_KINDS:
        out[kind] = {i for i in (holder.ns_inode(os.getpid(), kind),
                                 holder.ns_inode(1, kind)) if i}
    return out


# ---------------------------------------------------------------- up

def initial_state(topo: ClusterTopology, sd: StateDir,
                  kind: kinds.InstanceKind,
                  scheduler: Optional[Slurm] = None) -> Dict:
    max_peers, size, geometry = region_geometry(topo)
    servers = {}
    for srv in topo.server_list():
        paths = server_mod.paths_for(srv.name, str(sd.servers))
        # a job's socket is longer still: refuse now, not at the first job
        regions.job_server_paths(sd.servers, srv.name, srv.index,
                              regions.new_job_id())
        servers[str(srv.index)] = {
            "index": srv.index, "name": srv.name, "socket": str(paths.socket),
            "region": str(paths.region), "bridge": srv.bridge,
            "uplink": [srv.uplink, srv.uplink_peer], "max_peers": max_peers,
            "size": size, "geometry": geometry, "pid": None}
    instances = {
        inst.hostname: {"hostname": inst.hostname, "server": inst.server,
                        "index": inst.index, "address": inst.address,
                        "cpus": list(inst.cpus), "port": inst.bridge_port}
        for inst in topo.instance_list()}
    return {"name": topo.name, "phase": "building",
            "builder": {"pid": os.getpid(),
                        "start": procfs.start_time(os.getpid())},
            "created": time.time(), "topology": topo.to_dict(),
            "dir": str(sd.dir), "agent": str(sd.agent),
            "hosts": str(sd.hosts), "servers_dir": str(sd.servers),
            "head": {"hostname": HEAD_HOSTNAME, "address": HEAD_ADDRESS},
            "holders": {}, "namespaces": {}, "links": [],
            "servers": servers, "instances": instances, **kind.record(),
            **(scheduler.record(sd) if scheduler else {})}


class Build:
    """A cluster being brought up: its topology, state directory and
    state, and how each step is recorded (`up` and the instance kinds'
    start, kinds.py, work through it)."""

    def __init__(self, topo: ClusterTopology, sd: StateDir, state: Dict,
                 log):
        self.topo, self.sd, self.state, self.log = topo, sd, state, log
        self.fabric: Optional[int] = None   # its holder's pid, once up
        # run-dir paths every instance sees besides its server's (slurm/)
        self.keep_visible: List[Path] = []

    def save(self) -> None:
        save(self.sd, self.state)

    def step(self, what: str) -> None:
        """What `up` does now (named by its failure message)."""
        self.state["step"] = what
        self.save()

    def visible_in(self, srv) -> List[Path]:
        """What the instances of server `srv` see of the run dir: their
        own server's socket directory, the agent (orted checks that
        plm_rsh_agent, passed on from mpirun, exists), and keep_visible."""
        return [self.sd.servers / srv.name, self.sd.agent,
                *self.keep_visible]

    def start_holder(self, role: str, **kw) -> int:
        """Start holder `role` (holder.spawn's keywords), recorded before
        it is waited for; its pid."""
        proc = holder.spawn(self.state["name"], role, **kw)
        # recorded before anything else: the pid cannot be recycled
        # while `proc` (our unreaped child) exists, and a later `down`
        # needs it
        self.state["holders"][role] = {"role": role, "pid": proc.pid,
                                       "start": procfs.start_time(proc.pid)}
        self.save()
        try:
            holder.wait_ready(proc, role)
        except holder.HolderError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            raise
        # Only the namespaces it unshared are recorded (the fabric keeps
        # the host's mount namespace); each must be new, or `down` would
        # sweep the host's processes.
        flags = kw.get("unshare_flags", ())
        ns = {kind: ino for kind, ino in holder.namespaces_of(proc.pid).items()
              if holder.UNSHARE_FLAG[kind] in flags}
        host = _host_namespaces()
        if not ns or any(ino is None or ino in host[kind]
                         for kind, ino in ns.items()):
            raise holder.HolderError(f"holder {role} did not get its own "
                                     f"namespaces")
        self.state["namespaces"][role] = ns
        self.save()
        return proc.pid


def up(topo: ClusterTopology, sd: StateDir, log=print,
       kind: Optional[kinds.InstanceKind] = None,
       scheduler: Optional[Slurm] = None) -> Dict:
    """kind: the instances' (kinds.choose; None: namespaces); scheduler:
    the batch scheduler to run on them (None: none, jobs start through
    `cluster mpirun`)."""
    kind = kind or kinds.NamespaceInstances()
    preflight(topo)
    if scheduler is not None:
        scheduler.preflight(topo, sd, kind)
    private = under(sd.run_dir, PRIVATE_DIRS)
    if private:
        raise ClusterError(f"run dir {sd.run_dir} is under {private}, "
                           f"which instances have privately (their server "
                           f"sockets would be invisible); use another run "
                           f"directory", setting="run_dir")
    # refuses too long socket paths
    state = initial_state(topo, sd, kind, scheduler)
    sd.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(sd.dir, 0o755)
    except FileExistsError:
        raise ClusterError(f"cluster '{topo.name}' is already up (or a failed "
                           f"one was left: take cluster '{topo.name}' down "
                           f"first)")
    log(f"cluster '{topo.name}': {topo.describe()}")
    try:
        save(sd, state)
        with process.interrupts():
            _build(Build(topo, sd, state, log), kind, scheduler)
        state["phase"] = "up"
        save(sd, state)
        return state
    except BaseException as e:
        step = state.get("step", "start")
        try:
            teardown(sd, state)
            rolled = "rolled back"
        except IvcloudError as t:
            rolled = f"rollback incomplete: {t}"
        if isinstance(e, KeyboardInterrupt):   # Ctrl-C, SIGTERM, SIGHUP
            raise ClusterFailure(f"up interrupted at {step}; {rolled}")
        why = " ".join(str(e).split()) or type(e).__name__
        err = (type(e) if isinstance(e, IvcloudError) else ClusterFailure)
        raise err(f"up failed at {step}: {why}; {rolled}")


def _build(b: Build, kind: kinds.InstanceKind,
           scheduler: Optional[Slurm]) -> None:
    topo, sd, state = b.topo, b.sd, b.state
    b.step("files")
    sd.hosts.write_text(hosts_file_text(topo))
    sd.agent.write_text(agent_script_text(sd.dir))
    sd.agent.chmod(0o755)
    sd.servers.mkdir(mode=0o755)
    if scheduler is not None:
        scheduler.write_files(b)

    b.step("fabric")
    b.fabric = b.start_holder("fabric", unshare_flags=["--net"])
    state["links"] += network.create_core(b.fabric)
    b.save()

    for srv in topo.server_list():
        rec = state["servers"][str(srv.index)]
        b.step(f"server s{srv.index}")
        paths = server_mod.paths_for(srv.name, str(sd.servers))
        rec["pid"] = server_mod.start(
            paths, rec["size"], max_peers=rec["max_peers"],
            leave_notices=kind.standing_leave_notices,
            **rec.get("geometry", {}))
        b.save()
        state["links"] += network.create_server_switch(
            b.fabric, srv, topo.uplink_rate_bps)
        b.save()

    kind.start(b)

    b.step("head")
    head = b.start_holder(HEAD_HOSTNAME, unshare_flags=holder.INSTANCE_NS,
                          hostname=HEAD_HOSTNAME, hosts_file=sd.hosts)
    network.attach(b.fabric, head, CORE_BRIDGE, network.HEAD_PORT,
                   HEAD_ADDRESS)
    state["links"].append(network.HEAD_PORT)
    b.save()

    if scheduler is not None:
        scheduler.start(b)
    state.pop("step", None)


# ---------------------------------------------------------------- down

def _holders_of(state: Optional[Dict], name: str) -> List[holder.Holder]:
    """Recorded holders plus any found by marker, alive or not."""
    found: Dict[int, holder.Holder] = {}
    for rec in (state or {}).get("holders", {}).values():
        if rec.get("start") is not None:
            h = holder.Holder.from_dict(rec)
            found[h.pid] = h
    for h in holder.find_by_marker(name):
        found.setdefault(h.pid, h)
    return list(found.values())


def _namespaces(state: Optional[Dict], all_holders: List[holder.Holder],
                roles) -> Tuple[Dict[str, set], Dict[str, set]]:
    """net and mnt namespaces of the holders with these roles, minus the
    host's own, as (certain, recorded_only): certain ones belong to a
    holder alive now; recorded_only ones to a holder that is gone, so
    their inode numbers may have been reused by the kernel since."""
    host = _host_namespaces()
    certain: Dict[str, set] = {"net": set(), "mnt": set()}
    recorded: Dict[str, set] = {"net": set(), "mnt": set()}
    alive = {h.role: h for h in all_holders if h.alive()}
    recs = dict((state or {}).get("namespaces", {}))
    for role, h in alive.items():
        recs.setdefault(role, holder.namespaces_of(h.pid))
    for role, ns in recs.items():
        if role not in roles:
            continue
        now = holder.namespaces_of(alive[role].pid) if role in alive else {}
        for kind in certain:
            ino = ns.get(kind)
            if not ino or ino in host[kind]:
                continue
            (certain if now.get(kind) == ino else recorded)[kind].add(ino)
    return certain, recorded


def _server_names(state: Optional[Dict], sd: StateDir) -> List[str]:
    names = [s["name"] for s in (state or {}).get("servers", {}).values()]
    if sd.servers.is_dir():
        names += [p.name for p in sd.servers.iterdir() if p.is_dir()]
    return sorted(set(names))


def _kill_all(listing, grace_s: float, rounds: int = 5):
    """Kill what listing(first) finds until it finds nothing new. One
    listing is not enough: a process killed while it forks (an orphaned
    mpirun's launch agent, a rank's helper) leaves a child nobody
    listed. Only the first round may trust namespaces by their holders
    (first=True): the first round kills those holders, and the kernel
    may hand a freed namespace's inode number to somebody else's, so
    later rounds take only processes that carry the cluster's marker.
    Returns the pids that survived SIGKILL."""
    survivors: set = set()
    for r in range(rounds):
        pids = set(listing(r == 0)) - survivors
        if not pids:
            break
        survivors |= set(procfs.kill_pids(sorted(pids), grace_s))
    return sorted(survivors)


def _merged(a: Dict, b: Dict) -> Dict:
    return {k: set(a.get(k, ())) | set(b.get(k, ())) for k in set(a) | set(b)}


def _kill_inside(name: str, holders: List[holder.Holder], certain: Dict,
                 recorded: Dict, grace_s: float):
    """_kill_all of `holders` and every process in their namespaces
    (_namespaces' certain and recorded ones)."""
    return _kill_all(
        lambda first: (set(holder.processes_in(certain))
                       | set(holder.processes_in(recorded, cluster=name))
                       | {h.pid for h in holders if h.alive()}) if first else
        set(holder.processes_in(_merged(certain, recorded), cluster=name)),
        grace_s)


def teardown(sd: StateDir, state: Optional[Dict], grace_s: float = 3.0
             ) -> None:
    """Remove everything of the cluster. Raises ClusterFailure (after
    doing all it can) if anything is left."""
    name = sd.name
    problems: List[str] = []
    all_holders = _holders_of(state, name)
    fabric = [h for h in all_holders if h.role == "fabric"]

    # 0. what the instances' kind stops first (guests, which run in the
    # fabric's network namespace: QMP quit, then SIGKILL)
    problems += kinds.of_state(state).stop(sd, state)
    others = [h for h in all_holders if h.role != "fabric"]

    # 1. instances and head: every process inside them, then the holders
    roles = {h.role for h in others} | set((state or {}).get("namespaces",
                                                             {}))
    roles.discard("fabric")
    certain, recorded = _namespaces(state, all_holders, roles)
    left = _kill_inside(name, others, certain, recorded, grace_s)
    if left:
        problems.append(f"pids {left} survived SIGKILL")

    # 2. ivshmem-servers (their sockets, pid files and regions). A server
    # whose directory does not exist was never started by us: a region
    # of that name belongs to someone else and stays.
    started = [p for p in (server_mod.paths_for(n, str(sd.servers))
                           for n in _server_names(state, sd))
               if p.dir.is_dir()]
    problems += regions.stop_all(regions.left_behind(sd.servers) + started)

    # 3. the fabric: links first (ports before bridges), then its holder
    links = list((state or {}).get("links", []))
    for h in fabric:
        if h.alive():
            ports = [n for n in links if not n.startswith("br-")
                     and n != CORE_BRIDGE]
            bridges = [n for n in links if n not in ports]
            network.delete_links(h.pid, ports + bridges)
    fab_certain, fab_recorded = _namespaces(state, all_holders, {"fabric"})
    left = _kill_inside(name, fabric, fab_certain, fab_recorded, grace_s)
    if left:
        problems.append(f"fabric pids {left} survived SIGKILL")

    # 4. check, then the files; the holders are gone now, so every
    # namespace counts as recorded only
    every = _merged(_merged(certain, recorded),
                    _merged(fab_certain, fab_recorded))

    def remaining():
        return set(holder.processes_in(every, cluster=name)
                   + [h.pid for h in holder.find_by_marker(name)])
    _kill_all(lambda first: remaining(), grace_s)   # slipped in meanwhile
    still = remaining()
    if still:
        problems.append(f"processes {sorted(set(still))} still in the "
                        f"cluster's namespaces")
    for paths in started:
        if server_mod.running_pid(paths) is not None:
            problems.append(f"server {paths.name} still runs")
        if os.path.lexists(paths.region):
            problems.append(f"region {paths.region} still exists")
    if problems:
        if state is not None and sd.dir.is_dir():
            state["phase"] = "down-incomplete"
            save(sd, state)
        raise ClusterFailure("down incomplete: " + "; ".join(problems))
    shutil.rmtree(sd.dir, ignore_errors=True)
    if sd.dir.exists():
        raise ClusterFailure(f"cannot remove {sd.dir}")


def down(sd: StateDir) -> None:
    if os.geteuid() != 0:
        raise ClusterError("cluster down needs root")
    state = load(sd) if sd.dir.is_dir() else None
    if state is None and not sd.dir.is_dir() and \
            not holder.find_by_marker(sd.name):
        raise ClusterError(f"cluster '{sd.name}' is not up (no {sd.dir})")
    if state is not None:
        b = state.get("builder") or {}
        if (b.get("pid") not in (None, os.getpid())
                and state.get("phase") == "building"
                and b.get("start") is not None
                and procfs.start_time(b["pid"]) == b["start"]):
            raise ClusterError(f"cluster '{sd.name}' is being built by pid "
                           f"{b['pid']} (wait for it, or kill it first)")
    teardown(sd, state)


# ---------------------------------------------------------------- status

def _recorded(sd: StateDir) -> Dict:
    """The state of a cluster, or ClusterError when there is none."""
    state = load(sd) if sd.dir.is_dir() else None
    if state is None:
        raise ClusterError(f"cluster '{sd.name}' is not up (no {sd.state})")
    return state


def status(sd: StateDir) -> Dict:
    state = _recorded(sd)
    topo = topology_from_dict(state["topology"])
    servers = []
    for srv in state["servers"].values():
        paths = server_mod.paths_for(srv["name"], state["servers_dir"])
        st = server_mod.status(paths)
        servers.append({
            "index": srv["index"], "name": srv["name"],
            "running": st["running"], "pid": st["pid"],
            "socket": srv["socket"], "region": srv["region"],
            "size": srv["size"], "max_peers": srv["max_peers"],
            "bridge": srv["bridge"],
            "peers": st.get("peers", []),
            "instances": [i["hostname"] for i in state["instances"].values()
                          if i["server"] == srv["index"]]})
    kind = kinds.of_state(state)
    instances = [{"hostname": inst["hostname"], "server": inst["server"],
                  "address": inst["address"], "planned_cpus": inst["cpus"],
                  **kind.instance_info(state, inst["hostname"])}
                 for inst in state["instances"].values()]
    head = {**state["head"], **holder.holder_info(state, HEAD_HOSTNAME)}
    fabric = holder.holder_info(state, "fabric")
    slurm = slurm_status(state)
    healthy = (state.get("phase") == "up" and fabric["alive"]
               and head["alive"] and all(i["alive"] for i in instances)
               and all(s["running"] for s in servers)
               and (slurm is None or slurm["healthy"]))
    return {"name": state["name"], "phase": state.get("phase"),
            "kind": kind.name, "kind_title": kind.title,
            "healthy": healthy, "state_dir": str(sd.dir),
            "servers_count": topo.servers,
            "instances_per_server": topo.instances_per_server,
            "vcpus": topo.vcpus, "uplink_rate_bps": topo.uplink_rate_bps,
            "oversubscribe": topo.oversubscribe,
            "fabric": fabric, "head": head,
            "servers": servers, "instances": instances,
            "scheduler": state.get("scheduler", "none"),
            **({"slurm": slurm} if slurm else {})}


def load_up(sd: StateDir) -> Dict:
    """The state of a cluster that is up (for mpirun / exec)."""
    state = _recorded(sd)
    if state.get("phase") != "up":
        raise ClusterError(f"cluster '{sd.name}' is {state.get('phase')}, not "
                           f"up (take it down and bring it up again)")
    return state


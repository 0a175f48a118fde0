"""One region per Nova project on a host (`ivcloud libvirt watch`,
ivcloud/libvirt/projects.py, docs/operators.md section 4).

- the project and flavor read from Nova's metadata, the host policy file
  and its refusals, the systemd unit's options;
- on the real libvirtd (test_libvirt.py's fixture: started here if none
  runs): TCG domains carrying Nova's metadata for two projects start
  while the watcher runs with directly run servers. Each project's
  instances share one server (one region), the other project's never
  do, a domain of another flavor or without a project is left alone,
  and the last instance of a project gone stops its server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivcloud import server as server_mod
from ivcloud.errors import LibvirtFailure
from ivcloud.libvirt.domain import Domain
from ivcloud.libvirt.nova import nova_flavor, nova_project
from ivcloud.libvirt.projects import (HostPolicy, RegionPolicy,
                                      SystemdServers)
from test_libvirt import (_ivshmem_functions, _wait, cleanup_domains,  # noqa: F401
                          libvirtd)

METADATA = """
<metadata>
  <nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1">
    <nova:name>{name}</nova:name>
    <nova:flavor name="{flavor}">
      <nova:memory>64</nova:memory><nova:vcpus>1</nova:vcpus>
    </nova:flavor>
    <nova:owner>
      <nova:user uuid="9a1f0c3e8d7b4a6f9e2d1c0b3a4f5e6d">alice</nova:user>
      <nova:project uuid="{project}">tenant</nova:project>
    </nova:owner>
  </nova:instance>
</metadata>
"""
NO_OWNER = """
<metadata>
  <nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.0">
    <nova:flavor name="{flavor}"/>
  </nova:instance>
</metadata>
"""
PROJECT_A = "0b3e5c0a3d2f4b6c8e1a2b3c4d5e6f70"
PROJECT_B = "7f6e5d4c3b2a19080f1e2d3c4b5a6978"


def nova_domain(name: str, flavor: str, project=None) -> str:
    meta = (METADATA.format(name=name, flavor=flavor, project=project)
            if project else NO_OWNER.format(flavor=flavor))
    return Domain(name, 64 << 20, 1).xml().replace("<memory", meta +
                                                   "<memory", 1)


# ---------------------------------------------------------------- pure

def test_project_and_flavor_from_metadata():
    xml = nova_domain("d", "hpc", PROJECT_A)
    assert nova_project(xml) == PROJECT_A and nova_flavor(xml) == "hpc"
    assert nova_project(nova_domain("d", "hpc")) is None
    assert nova_project(Domain("d", 64 << 20, 1).xml()) is None
    assert nova_project("<domain") is None


def test_policy_file(tmp_path):
    f = tmp_path / "regions.conf"
    f.write_text("[DEFAULT]\nsize = 32M\nmax-peers = 4\ngroup =\n\n"
                 f"[project {PROJECT_A}]\nsize = 1G\nmax-clients = 12\n")
    policy = HostPolicy.load(str(f))
    assert policy.region(PROJECT_B) == RegionPolicy(32 << 20, 1, 4, None,
                                                    None)
    a = policy.region(PROJECT_A)
    assert (a.size, a.max_peers, a.max_clients, a.group) == (1 << 30, 4, 12,
                                                             None)
    assert a.server_options() == ["--size", str(1 << 30), "--vectors", "1",
                                  "--max-peers", "4", "--max-clients", "12",
                                  "--no-leave-notices"]
    # the unit's environment file (packaging/host/ivshmem-server@.service)
    assert SystemdServers.conf_text(RegionPolicy(64 << 20, 2, 8, None,
                                                 "kvm", True)) == (
        'IVSHMEM_SERVER_OPTS="--size 67108864 --vectors 2 --max-peers 8 '
        '--group kvm"\n')
    f.write_text("[DEFAULT]\nleave-notices = yes\n")
    assert HostPolicy.load(str(f)).default.leave_notices
    for text, why in (("[DEFAULT]\nsize = big\n", "bad size"),
                      ("[DEFAULT]\nleave-notices = maybe\n", "yes or no"),
                      ("[DEFAULT]\nwhatever = 1\n", "unknown key"),
                      ("[tenant x]\n", r"is not \[project ID\]"),
                      ("[project a/b]\n", "not usable"),
                      ("[DEFAULT\n", "policy")):
        f.write_text(text)
        with pytest.raises(LibvirtFailure, match=why):
            HostPolicy.load(str(f))


# ---------------------------------------------------------------- libvirtd

@pytest.fixture
def watch_env(unique):
    """A run directory QEMU (libvirt-qemu) can traverse, and a policy
    file; the servers still running there are stopped afterwards."""
    run_dir = Path(f"/tmp/ivcloud-nova-{unique}")
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    try:
        import grp
        grp.getgrnam("libvirt-qemu")
        group = "libvirt-qemu"
    except KeyError:
        group = ""
    policy = run_dir / "regions.conf"
    policy.write_text(f"[DEFAULT]\nsize = 16M\nvectors = 1\nmax-peers = 4\n"
                      f"group = {group}\n")
    yield run_dir, policy
    for d in run_dir.iterdir():
        if d.is_dir():
            paths = server_mod.paths_for(d.name, str(run_dir))
            if server_mod.running_pid(paths) or server_mod.leftovers(paths):
                server_mod.stop(paths)
    shutil.rmtree(run_dir, ignore_errors=True)


def _server_of(dom) -> str:
    import xml.etree.ElementTree as ET
    root = ET.fromstring(dom.XMLDesc(0))
    paths = [s.get("path") for s in root.iter("server")]
    assert len(paths) == 1, paths
    return paths[0]


def _peers(sock: str):
    state = Path(sock).parent / "state.json"
    return json.loads(state.read_text())["peers"]


def test_each_project_gets_its_own_region(libvirtd, cleanup_domains,  # noqa: F811
                                          watch_env, unique):
    names, _ = cleanup_domains
    run_dir, policy = watch_env
    flavor = f"ivcloud.{unique}"
    watcher = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "libvirt", "watch", "--flavor",
         flavor, "--domain-glob", f"ivcloud-{unique}-*", "--service",
         "direct", "--run-dir", str(run_dir), "--policy", str(policy),
         "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)  # let it register for events
        doms = {}
        for suffix, fl, project in (("a1", flavor, PROJECT_A),
                                    ("b1", flavor, PROJECT_B),
                                    ("a2", flavor, PROJECT_A),
                                    ("other", "m1.small", PROJECT_A),
                                    ("orphan", flavor, None)):
            name = f"ivcloud-{unique}-{suffix}"
            names.append(name)
            doms[suffix] = libvirtd.createXML(nova_domain(name, fl, project),
                                              0)  # transient, as Nova's are
        for suffix in ("a1", "a2", "b1"):
            _wait(lambda: _ivshmem_functions(doms[suffix]) == 1, 60,
                  f"the device in {suffix}")
        sock_a, sock_b = _server_of(doms["a1"]), _server_of(doms["b1"])
        # one region per project: A's instances share one, B has its own
        assert _server_of(doms["a2"]) == sock_a != sock_b
        assert Path(sock_a).parent.name == f"nova-{PROJECT_A}"
        assert Path(sock_b).parent.name == f"nova-{PROJECT_B}"
        _wait(lambda: len(_peers(sock_a)) == 2 and len(_peers(sock_b)) == 1,
              15, "both QEMUs of A and the one of B to join their servers")
        # another flavor, or no project in the metadata: left alone
        assert _ivshmem_functions(doms["other"]) == 0
        assert _ivshmem_functions(doms["orphan"]) == 0

        # B's only instance goes: B's server stops, A's is untouched
        doms["b1"].destroy()
        _wait(lambda: not Path(sock_b).exists(), 15, "B's server to stop")
        assert server_mod.running_pid(server_mod.paths_for(
            f"nova-{PROJECT_A}", str(run_dir)))
        doms["a1"].destroy()
        _wait(lambda: len(_peers(sock_a)) == 1, 15, "a1 to leave A's server")
        time.sleep(1)  # the watcher has seen a1 stop; a2 still runs
        assert Path(sock_a).exists()
        # an instance of another flavor does not keep A's server alive
        doms["a2"].destroy()
        _wait(lambda: not Path(sock_a).exists(), 15, "A's server to stop")
    finally:
        watcher.terminate()
        out, err = watcher.communicate(timeout=30)
    lines = out.splitlines()
    print(out, err)
    assert sorted(ln for ln in lines if ln.startswith("attached")) == sorted(
        f"attached shmem 'ivcloud' of project {p} to 'ivcloud-{unique}-{s}'"
        for s, p in (("a1", PROJECT_A), ("a2", PROJECT_A),
                     ("b1", PROJECT_B)))
    assert (f"domain 'ivcloud-{unique}-orphan': no Nova project in its "
            f"metadata: not attached") in lines
    for p in (PROJECT_A, PROJECT_B):
        assert (f"project {p}: no instance left on this host: its server "
                f"stopped") in lines
    assert not [d for d in run_dir.iterdir() if d.is_dir()]

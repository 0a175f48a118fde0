"""`ivcloud libvirt migrate` (ivcloud/libvirt/migrate.py,
docs/operators.md section 5) between two real libvirtds on this machine.

Each "host" is a libvirtd of the test's own in a mount namespace of its
own: private /etc/libvirt (its own host_uuid, which is what libvirt
compares to refuse a migration to the same host), /run/libvirt (its
sockets), /var/lib/libvirt, /var/cache/libvirt and /var/log/libvirt, no
cgroups (the two daemons' machine cgroups would have the same names) and
no remembered file owners (they would relabel the same files).
Both QEMUs see the same /tmp, as hosts with shared storage do. The
system libvirtd is not used: other test runs may start and stop it.

On a booted TCG guest that carries Nova's metadata for a project and two
ivshmem-doorbell devices on that project's (quiet) server of the source
host: bad input, a migration whose stream cannot flow (rolled back: the
guest runs on the source with its devices), a migration whose
destination device cannot attach (moved back), one interrupted by
SIGTERM while libvirt migrates (cancelled, rolled back), the migration that works
with the destination's `libvirt watch` attaching the arriving domain to
the project's server there, the way back with an explicit server
socket, and last two devices on a server with leave notices, whose
unplug kills QEMU: the error says so instead of "rolled back". Nothing
is left: domains, servers, the libvirtds and their mount namespaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from ivcloud.libvirt.attach import shmem_names
from ivcloud.libvirt.domain import Domain, Shmem
from ivcloud.libvirt.projects import DirectServers, RegionPolicy
from test_libvirt import (_guest_image, _ivshmem_functions,
                          _let_qemu_user_see_kvm, _peers, _wait,
                          assert_one_line_error, ivcloud)
from test_nova_projects import METADATA, PROJECT_A, PROJECT_B, nova_domain

PRIVATE = ("/etc/libvirt", "/run/libvirt", "/var/lib/libvirt",
           "/var/cache/libvirt", "/var/log/libvirt")
# both QEMUs on this machine: the stream over loopback
STREAM = "tcp://127.0.0.1"


@contextlib.contextmanager
def _private_libvirtd(tag: str) -> Iterator[Tuple[str, object]]:
    """(URI, connection) of a libvirtd of our own, a host of its own to
    libvirt; stopped at the end with every domain it still has."""
    import libvirt
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    base = Path(tempfile.mkdtemp(prefix=f"ivcloud-lv{tag}-", dir="/tmp"))
    base.chmod(0o755)
    binds = []
    for target in PRIVATE:
        d = base / target.strip("/").replace("/", "-")
        d.mkdir(mode=0o755)
        binds.append(f"mount --bind {d} {target}")
    etc = base / "etc-libvirt"
    (etc / "libvirtd.conf").write_text(f'host_uuid = "{uuid.uuid4()}"\n')
    # no owner remembering (xattrs on the files it relabels): the two
    # daemons relabel the same kernel, initrd and console files in /tmp,
    # which real hosts would each have of their own, and one daemon's
    # record makes the other refuse ("Setting different DAC user or
    # group on ... which is already in use")
    (etc / "qemu.conf").write_text('cgroup_controllers = [ ]\n'
                                   'stdio_handler = "file"\n'
                                   'remember_owner = 0\n')
    log = open(base / "libvirtd.log", "w")
    proc = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         " && ".join(binds) + f" && exec libvirtd -p {base}/libvirtd.pid"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    uri = f"qemu+unix:///system?socket={base}/run-libvirt/libvirt-sock"

    def try_open():
        if proc.poll() is not None:
            pytest.fail(f"libvirtd {tag} exited: "
                        f"{(base / 'libvirtd.log').read_text()[-500:]}")
        try:
            return libvirt.open(uri)
        except libvirt.libvirtError:
            return None
    conn = None
    try:
        conn = _wait(try_open, 30, f"libvirtd {tag}")
        yield uri, conn
    finally:
        if conn is not None:
            _remove_domains(conn)
            conn.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        for qemu_log in sorted((base / "var-log-libvirt").rglob("*.log")):
            # shown when a test fails: what QEMU said last
            print(f"--- {tag}: {qemu_log.name}")
            print("\n".join(qemu_log.read_text(errors="replace")
                             .splitlines()[-15:]))
        # its mount namespace went with its last process: the private
        # directories are plain directories again
        assert not [ln for ln in Path("/proc/self/mountinfo").read_text()
                    .splitlines() if str(base) in ln]
        shutil.rmtree(base)


def _remove_domains(conn) -> None:
    import libvirt
    for dom in conn.listAllDomains():
        try:
            persistent = dom.isPersistent()
            if dom.isActive():
                dom.destroy()   # waits for QEMU to exit
            if persistent:
                dom.undefine()
        except libvirt.libvirtError:
            pass   # a transient one whose QEMU ended meanwhile


@pytest.fixture(scope="module")
def two_hosts():
    """Two libvirtds of our own, both on this machine: ((URI, conn) of
    the source, (URI, conn) of the destination). Ours, so that no other
    user of the system libvirtd starts or stops it under the tests."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or \
            shutil.which("libvirtd") is None:
        pytest.skip("two libvirtds need root, unshare and libvirtd")
    restore_kvm = _let_qemu_user_see_kvm()
    try:
        with _private_libvirtd("src") as src, \
                _private_libvirtd("dst") as dst:
            yield src, dst
    finally:
        if restore_kvm:
            restore_kvm()


@pytest.fixture
def hosts(two_hosts):
    """two_hosts, every domain on them removed after the test."""
    yield two_hosts
    for _, conn in two_hosts:
        _remove_domains(conn)


@pytest.fixture
def run_dirs(unique):
    """Server directories of the two hosts, group libvirt-qemu; every
    server in them stopped afterwards."""
    top = Path(f"/tmp/ivcloud-lvm-{unique}")
    dirs = [top / "src", top / "dst"]
    for d in (top, *dirs):
        d.mkdir(mode=0o755)
        d.chmod(0o755)
    yield dirs
    for d in dirs:
        servers = DirectServers(str(d))
        for project in servers.running():
            servers.stop(project)
    shutil.rmtree(top, ignore_errors=True)


def test_bad_input_is_one_line(hosts, unique):
    (source, _), (dest, _) = hosts
    proc = ivcloud("libvirt", "migrate", f"nonexistent-{unique}", dest,
                   "--connect", source)
    assert "no domain" in assert_one_line_error(proc, "libvirt")
    proc = ivcloud("libvirt", "migrate", "any", "qemu+unix:///system?"
                   "socket=/nonexistent/libvirt-sock", "--connect", source)
    assert "cannot connect" in assert_one_line_error(proc, "libvirt")
    proc = ivcloud("libvirt", "migrate", "any", "bogus:///x", "--connect",
                   source)
    assert "cannot connect" in assert_one_line_error(proc, "libvirt")
    proc = ivcloud("libvirt", "migrate", "any", dest, "--connect", source,
                   "--server", "rel.sock")
    assert "absolute" in assert_one_line_error(proc, "libvirt")


def test_a_guest_that_keeps_its_device_stays(hosts, run_dirs, unique):
    """Without a guest OS nothing acknowledges the ACPI eject: the detach
    times out, the migration fails at that step, and the domain runs on
    the source with its device (the request stays pending in QEMU)."""
    (source, conn), (dest, dconn) = hosts
    sock = DirectServers(str(run_dirs[0])).start(
        PROJECT_A, RegionPolicy(size=16 << 20, max_peers=4,
                                group="libvirt-qemu"))
    name = f"ivcloud-{unique}"
    dom = conn.createXML(Domain(name, 64 << 20, 1, shmems=[
        Shmem("ivcloud", None, server=str(sock))]).xml(), 0)
    proc = ivcloud("libvirt", "migrate", name, dest, "--connect", source,
                   "--migrate-uri", STREAM, "--timeout", "2")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert "failed at step 'detach'" in last and "did not release" in last
    assert "rolled back, it runs on" in last
    assert dom.isActive() and _shmem_servers(dom) == [str(sock)]
    assert dconn.listAllDomains() == []


def _watch(dest: str, glob: str, run_dir: Path) -> subprocess.Popen:
    """The destination's `libvirt watch`, its servers run directly in
    `run_dir`, group libvirt-qemu."""
    policy = run_dir / "regions.conf"
    policy.write_text("[DEFAULT]\nsize = 16M\nmax-peers = 4\n"
                      "group = libvirt-qemu\n")
    return subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "libvirt", "watch", "--connect",
         dest, "--domain-glob", glob, "--service", "direct", "--run-dir",
         run_dir, "--policy", policy, "--timeout", "400"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def test_watcher_takes_domains_migrated_in(hosts, run_dirs, unique):
    """The destination's watcher treats a Nova instance that arrives by
    migration as a new instance of its project: it starts the project's
    server there and attaches the instance once it runs there, or once
    the migration leaves it paused there (never while libvirt receives
    it: QEMU's devices are the stream's then), and stops the server with
    the project's last instance. No guest OS needed: attaching needs no
    guest."""
    import libvirt
    (_, conn), (dest, dconn) = hosts
    dst_run = run_dirs[1]
    watcher = _watch(dest, f"ivcloud-{unique}-*", dst_run)
    try:
        for mode in ("live", "paused"):
            name = f"ivcloud-{unique}-{mode}"
            dom = conn.createXML(nova_domain(name, "hpc", PROJECT_A), 0)
            flags = libvirt.VIR_MIGRATE_LIVE
            if mode == "paused":
                flags |= libvirt.VIR_MIGRATE_PAUSED
            ddom = dom.migrate3(dconn, {libvirt.VIR_MIGRATE_PARAM_URI:
                                        STREAM}, flags)
            _wait(lambda: "ivcloud" in shmem_names(ddom), 30,
                  f"the watcher to attach the {mode} arrival")
            assert ddom.state()[0] == (libvirt.VIR_DOMAIN_RUNNING
                                       if mode == "live" else
                                       libvirt.VIR_DOMAIN_PAUSED)
            assert _ivshmem_functions(ddom) == 1
            assert _shmem_servers(ddom) == [
                str(dst_run / f"nova-{PROJECT_A}" / "ivshmem.sock")]
        assert DirectServers(str(dst_run)).running() == {PROJECT_A}
        for dom in dconn.listAllDomains():
            dom.destroy()
        _wait(lambda: not DirectServers(str(dst_run)).running(), 30,
              "the watcher to stop the project's server")
    finally:
        watcher.terminate()
        out, err = watcher.communicate(timeout=30)
    lines = out.splitlines()
    assert [ln.split(" to ")[-1] for ln in lines[:2]] == [
        f"'ivcloud-{unique}-live'", f"'ivcloud-{unique}-paused'"], out
    assert lines[2:] == [f"project {PROJECT_A}: no instance left on this "
                         f"host: its server stopped"], out


def _shmem_servers(dom) -> List[str]:
    root = ET.fromstring(dom.XMLDesc(0))
    return [s.find("server").get("path") for s in root.iter("shmem")]


def _phases(stderr: str) -> List[str]:
    # (a line on unguarded descriptors of the source's QEMU is no phase)
    return [ln.split(": ", 1)[1].split(" (")[0]
            for ln in stderr.splitlines() if ln.startswith("migrate ")
            and "not all guarded" not in ln]


def test_migrate_between_two_libvirtds(hosts, run_dirs, unique):
    import libvirt
    (source, conn), (dest, dconn) = hosts
    image = _guest_image()
    if image is None:
        pytest.skip("no guest image (build/guest, make guest): detaching "
                    "needs a guest OS that acknowledges the ACPI eject")
    name = f"ivcloud-{unique}"
    src_run, dst_run = run_dirs
    group = "libvirt-qemu"
    region = RegionPolicy(size=16 << 20, max_peers=4, group=group)
    src_sock = DirectServers(str(src_run)).start(PROJECT_A, region)
    src_state = src_sock.parent / "state.json"
    dst_state = dst_run / f"nova-{PROJECT_A}" / "state.json"
    kernel, initrd = (shutil.copy(f, src_run.parent) for f in image)
    console = src_run.parent / "console.log"
    xml = Domain(name, 256 << 20, 1, kernel=kernel, initrd=initrd,
                 cmdline="console=ttyS0 panic=-1", console_log=str(console),
                 shmems=[Shmem("ivcloud", None, server=str(src_sock)),
                         Shmem("extra", None, server=str(src_sock))]).xml()
    xml = xml.replace("<memory", METADATA.format(
        name=name, flavor="hpc", project=PROJECT_A) + "<memory", 1)
    dom = conn.defineXML(xml)
    dom.create()
    _wait(lambda: console.exists() and "ivcloud-guest: ready" in
          console.read_text(errors="replace"), 180, "the guest to boot")
    # two devices on one server: the one detached second has seen the
    # first leave, which only a quiet server makes safe to unplug
    assert len(_peers(src_state)) == 2
    both = [str(src_sock)] * 2

    def migrate(*args, timeout=400):
        return ivcloud("libvirt", "migrate", name, *args, "--connect",
                       source, "--migrate-uri", STREAM, timeout=timeout)

    # the same host: refused before anything is touched
    proc = migrate(source)
    assert "same libvirt host UUID" in assert_one_line_error(proc,
                                                             "libvirt")

    # the stream cannot flow (an address of no host here): rolled back
    proc = ivcloud("libvirt", "migrate", name, dest, "--connect", source,
                   "--migrate-uri", "tcp://192.0.2.1", timeout=400)
    assert proc.returncode == 1, proc.stderr
    assert "failed at step 'migrate'" in proc.stderr.splitlines()[-1]
    assert "rolled back: the source's devices attached again" in proc.stderr
    assert dom.isActive() and _shmem_servers(dom) == both
    _wait(lambda: len(_peers(src_state)) == 2, 15, "the source's peers")
    assert dconn.listAllDomains() == []

    # the destination's device cannot attach: moved back
    proc = migrate(dest, "--server", str(dst_run / "none.sock"))
    assert proc.returncode == 1, proc.stderr
    assert "failed at step 'attach'" in proc.stderr.splitlines()[-1]
    assert "rolled back: the domain migrated back" in proc.stderr
    dom = conn.lookupByName(name)
    assert dom.isActive() and dom.isPersistent()
    assert _shmem_servers(dom) == both
    # the definition came back whole, its devices included
    inactive = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    assert inactive.count("<shmem") == 2 and PROJECT_A in inactive
    _wait(lambda: len(_peers(src_state)) == 2, 15, "the source's peers")
    assert dconn.listAllDomains() == []

    # interrupted once the migration began: libvirt's job is cancelled
    # (or, had it ended first, the domain moves back)
    cli = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "libvirt", "migrate", name, dest,
         "--connect", source, "--migrate-uri", STREAM],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in cli.stderr:
            if line.startswith(f"migrate {name}: migrate ("):
                cli.send_signal(signal.SIGTERM)
                break
        rest = cli.stderr.read()
        cli.wait(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 128 + signal.SIGTERM, rest
    assert "rolled back:" in rest and rest.endswith("ivcloud: interrupted\n")
    dom = conn.lookupByName(name)
    assert dom.isActive() and _shmem_servers(dom) == both
    _wait(lambda: len(_peers(src_state)) == 2, 15, "the source's peers")
    assert dconn.listAllDomains() == []

    # the destination's watcher attaches the arriving domain to its
    # project's server there, as it would a new instance
    watcher = _watch(dest, name, dst_run)
    try:
        proc = migrate(dest, "--timeout", "120")
    finally:
        watcher.terminate()
        w_out, w_err = watcher.communicate(timeout=30)
    assert proc.returncode == 0, (proc.stderr, w_out, w_err)
    print(proc.stderr)
    assert _phases(proc.stderr) == ["detach", "migrate", "migrated",
                                    "attach", "attached shmem 'ivcloud' by "
                                    "the destination's watcher"]
    dst_sock = dst_run / f"nova-{PROJECT_A}" / "ivshmem.sock"
    assert proc.stdout.strip().endswith(f"shmem 'ivcloud' on {dst_sock}")
    assert f"attached shmem 'ivcloud' of project {PROJECT_A}" in w_out
    with pytest.raises(libvirt.libvirtError):
        conn.lookupByName(name)          # undefined at the source
    ddom = dconn.lookupByName(name)
    assert ddom.isActive() and ddom.isPersistent()
    assert _shmem_servers(ddom) == [str(dst_sock)]
    assert _ivshmem_functions(ddom) == 1
    # the definition there holds no device of the source's server
    assert "<shmem" not in ddom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    _wait(lambda: len(_peers(dst_state)) == 1, 15, "the destination peer")
    _wait(lambda: _peers(src_state) == [], 15, "the source's peer to go")

    # and back, on an explicit server socket of the source host
    proc = ivcloud("libvirt", "migrate", name, source, "--connect",
                   dest, "--server", str(src_sock), "--migrate-uri", STREAM,
                   timeout=400)
    assert proc.returncode == 0, proc.stderr
    dom = conn.lookupByName(name)
    assert dom.isActive() and _shmem_servers(dom) == [str(src_sock)]
    assert dconn.listAllDomains() == []
    _wait(lambda: len(_peers(src_state)) == 1, 15, "the source's peer")
    _wait(lambda: _peers(dst_state) == [], 15, "the destination's peer")

    # a server that tells its clients of leaves: QEMU aborts at the
    # unplug of the second device (docs/operators.md, "Quiet servers"),
    # and the error says the rollback could not bring the guest back
    loud = DirectServers(str(src_run)).start(
        PROJECT_B, RegionPolicy(size=16 << 20, max_peers=4, group=group,
                                leave_notices=True))
    for device in ("loud1", "loud2"):
        proc = ivcloud("libvirt", "attach-shmem", "--domain", name,
                       "--name", device, "--server", loud, "--connect",
                       source)
        assert proc.returncode == 0, proc.stderr
    proc = migrate(dest)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert "failed at step 'detach'" in last and "shmem 'loud2'" in last
    # (libvirt may see QEMU's end before or during the re-attach)
    assert "rolling back failed" in last and ("no longer runs" in last or
                                              "not running" in last)
    _wait(lambda: not dom.isActive(), 15, "libvirt to see QEMU gone")
    assert dconn.listAllDomains() == []

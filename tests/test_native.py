"""The ctypes binding against the real libivshm: messages and windows
between two real processes, error mapping, hostile/garbage regions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ivcloud import native
from ivcloud.native import (ANY, Channel, Geometry, IvshmError, MagicError,
                            MessageTruncated, NotFound, PeerDead, Timeout,
                            WouldBlock, format_region)

REGION = 8 << 20  # enough for max_peers=4 and small windows
JOB = 4242


@pytest.fixture
def region(shm_path):
    format_region(shm_path, REGION, max_peers=4)
    return shm_path


def spawn_peer(region, body: str, rank: int = 1) -> subprocess.Popen:
    """A second process attached as (JOB, rank), running `body` with `ch`
    (its Channel) and `peer` (slot of rank 0) defined."""
    code = textwrap.dedent(f"""
        import sys, time
        from ivcloud.native import *
        ch = Channel.attach_path({str(region)!r}, job_id={JOB}, rank={rank},
                                 name="child")
        deadline = time.monotonic() + 10
        while (peer := ch.find({JOB}, 0)) is None:
            assert time.monotonic() < deadline, "rank 0 never showed up"
            time.sleep(0.001)
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 20) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("peer process hung")
    assert proc.returncode == 0, f"peer failed:\n{err}"
    return out


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.002)


# ---------------------------------------------------------------- messages

def test_roundtrip_between_processes(region):
    with Channel.attach_path(region, job_id=JOB, rank=0, name="parent") as ch:
        child = spawn_peer(region, """
            for i in range(50):
                src, tag, data = ch.recv(peer, timeout_ms=10000)
                assert src == peer
                ch.send(peer, data[::-1], tag=tag + 1)
            # one large message streams through the ring in fragments
            src, tag, data = ch.recv(timeout_ms=10000, maxlen=1 << 20)
            ch.send(peer, bytes([len(data) % 251]) + data[:16], tag=tag)
            ch.close()
        """)
        try:
            wait_for(lambda: ch.find(JOB, 1) is not None)
            slot = ch.find(JOB, 1)
            info = {p.slot: p for p in ch.peers()}
            assert info[slot].pid == child.pid
            assert info[slot].name == "child"
            assert info[ch.self_slot].rank == 0
            for i in range(50):
                payload = f"message {i}".encode() * (i + 1)
                ch.send(slot, payload, tag=i)
                src, tag, data = ch.recv(slot, timeout_ms=10000)
                assert (src, tag, data) == (slot, i + 1, payload[::-1])
            big = os.urandom(300_000)
            ch.send(slot, memoryview(big), tag=99)
            src, tag, data = ch.recv(ANY, timeout_ms=10000)
            assert tag == 99 and data == bytes([len(big) % 251]) + big[:16]
        finally:
            finish(child)
        st = ch.stats()
        assert st.sends == 51 and st.recvs == 51
        assert st.bytes_sent >= 300_000


def test_two_channels_in_one_process(region):
    with Channel.attach_path(region, job_id=1, rank=0) as a, \
            Channel.attach_path(region, job_id=1, rank=1) as b:
        assert a.self_slot != b.self_slot
        assert a.find(1, 1) == b.self_slot and b.find(1, 0) == a.self_slot
        assert a.find(1, 7) is None
        a.send(b.self_slot, bytearray(b"ping"), tag=3)
        assert b.recv(timeout_ms=1000) == (a.self_slot, 3, b"ping")
        # recv_into: full length returned, truncation visible
        buf = bytearray(4)
        a.send(b.self_slot, b"0123456789")
        assert b.recv_into(buf, timeout_ms=1000) == (a.self_slot, 0, 10)
        assert buf == b"0123"
        assert a.try_send(b.self_slot, b"x")
        assert b.recv(timeout_ms=1000)[2] == b"x"


def test_truncated_message_raises_with_data(region):
    with Channel.attach_path(region, job_id=1, rank=0) as a, \
            Channel.attach_path(region, job_id=1, rank=1) as b:
        a.send(b.self_slot, b"y" * 100, tag=5)
        with pytest.raises(MessageTruncated) as ei:
            b.recv(maxlen=10, timeout_ms=1000)
        assert ei.value.length == 100 and ei.value.data == b"y" * 10
        assert ei.value.tag == 5 and ei.value.src == a.self_slot
        # the rest was consumed: nothing left
        with pytest.raises(WouldBlock):
            b.recv(timeout_ms=0)


def test_recv_from_dead_peer_raises_peerdead(region):
    with Channel.attach_path(region, job_id=JOB, rank=0) as ch:
        child = spawn_peer(region, """
            print("attached", flush=True)
            time.sleep(60)
        """)
        try:
            assert child.stdout.readline().strip() == "attached"
            slot = ch.find(JOB, 1)
            assert slot is not None
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            t0 = time.monotonic()
            with pytest.raises(PeerDead):
                ch.recv(slot, timeout_ms=10000)
            assert time.monotonic() - t0 < 9, "death noticed only by timeout"
            ch.reap()
            assert ch.find(JOB, 1) is None
        finally:
            if child.poll() is None:
                child.kill()
            child.communicate()


# ---------------------------------------------------------------- windows

def test_window_ops_single_process(region):
    with Channel.attach_path(region, job_id=2, rank=0) as ch:
        with ch.window("ops", 2, 4096) as w:
            assert w.seg_size >= 4096 and w.nseg == 2
            w.put(1, 64, b"hello window")
            w.flush(1)
            w.flush()
            assert w.get(1, 64, 12) == b"hello window"
            assert bytes(w.view(1)[64:69]) == b"hello"
            assert w.fetch_add(0, 0, 5) == 0
            assert w.fetch_add(0, 0, -2) == 5
            assert w.cas(0, 0, 3, 40) == 3          # swapped
            assert w.cas(0, 0, 3, 50) == 40         # not swapped
            assert int.from_bytes(w.get(0, 0, 8), "little") == 40
            with w.locked(0):
                pass
            w.lock(1, exclusive=False)
            w.unlock(1)
        assert w.closed
        with pytest.raises(ValueError):
            w.get(0, 0, 1)


def test_window_between_processes(region):
    with Channel.attach_path(region, job_id=JOB, rank=0) as ch:
        child = spawn_peer(region, """
            w = ch.window("shared", 2, 8192)
            w.barrier(10000)                      # both opened
            w.put(0, 128, b"from rank 1")
            w.flush(0)
            w.fetch_add(0, 0, 1)
            for _ in range(100):
                with w.locked(0):
                    v = int.from_bytes(w.get(0, 8, 8), "little")
                    w.put(0, 8, (v + 1).to_bytes(8, "little"))
            w.barrier(10000)                      # counters done
            w.close()
            ch.close()
        """)
        try:
            wait_for(lambda: ch.find(JOB, 1) is not None)
            w = ch.window("shared", 2, 8192)
            w.barrier(10000)
            for _ in range(100):
                with w.locked(0):
                    v = int.from_bytes(w.get(0, 8, 8), "little")
                    w.put(0, 8, (v + 1).to_bytes(8, "little"))
            w.barrier(10000)
            assert w.get(0, 128, 11) == b"from rank 1"
            assert w.fetch_add(0, 0, 0) == 1
            # the lock made the read-modify-writes exclusive
            assert int.from_bytes(w.get(0, 8, 8), "little") == 200
            w.close()
        finally:
            finish(child)


# ---------------------------------------------------------------- errors

def test_errors_map_to_exceptions(region):
    with Channel.attach_path(region, job_id=3, rank=0) as ch:
        with pytest.raises(WouldBlock) as ei:
            ch.recv(timeout_ms=0)
        assert ei.value.errno == 11 and isinstance(ei.value, BlockingIOError)
        t0 = time.monotonic()
        with pytest.raises(Timeout) as ei:
            ch.recv(timeout_ms=50)
        assert isinstance(ei.value, TimeoutError)
        assert 0.04 < time.monotonic() - t0 < 5
        with pytest.raises(IvshmError) as ei:
            ch.send(63, b"x")                     # beyond max_peers
        assert ei.value.code < 0 and ei.value.message
        with pytest.raises(IvshmError):
            ch.send(ch.self_slot + 1, b"x")       # nobody there
        with pytest.raises(IvshmError) as ei:
            ch.server_peers()                     # not through a server
        assert ei.value.errno == 95
        with ch.window("err", 2, 4096) as w:
            with pytest.raises(IvshmError):
                w.put(0, w.seg_size - 4, b"12345678")  # crosses the end
            with pytest.raises(IvshmError):
                w.get(2, 0, 1)                    # no such segment
            with pytest.raises(IvshmError):
                w.fetch_add(0, 3, 1)              # unaligned atomic
            with pytest.raises(Timeout):
                w.barrier(50)                     # the other member is absent
    with pytest.raises(ValueError):
        ch.recv(timeout_ms=0)                     # closed channel


def test_attach_wrong_magic_is_a_clear_error(shm_path):
    shm_path.write_bytes(b"\x5a" * REGION)
    with pytest.raises(MagicError) as ei:
        Channel.attach_path(shm_path)
    assert ei.value.code == native.EMAGIC
    assert "not an ivshm region" in str(ei.value)
    assert str(shm_path) in str(ei.value)


def test_attach_missing_file_and_bad_geometry(shm_path):
    with pytest.raises(NotFound) as ei:
        Channel.attach_path(shm_path)
    assert ei.value.errno == 2
    with pytest.raises(IvshmError):
        format_region(shm_path, REGION, max_peers=1000)  # needs more room
    with pytest.raises(IvshmError):
        format_region(shm_path, REGION, max_peers=1025)  # beyond the limit
    with pytest.raises(IvshmError):
        format_region(shm_path, REGION, queue_slots=48)  # not a power of 2
    assert not shm_path.exists()


def test_region_size_is_linear_in_peers():
    sizes = {p: native.min_region_size(max_peers=p) for p in (64, 512, 1024)}
    per_peer = (sizes[1024] - sizes[512]) / 512
    # the same bytes per peer between 64 and 512 as between 512 and 1024,
    # up to page rounding
    assert abs((sizes[512] - sizes[64]) / 448 - per_peer) < 64
    g = Geometry(max_peers=1024)
    assert native.min_region_size(max_peers=1024) == native.min_region_size(
        **g.__dict__)
    # fewer fast channels, smaller queues: fewer bytes per peer
    small = native.min_region_size(max_peers=512, queue_slots=16,
                                   fast_channels=native.FAST_NONE)
    assert small < sizes[512] / 4


def test_geometry_round_trip(shm_path):
    format_region(shm_path, native.min_region_size(
        max_peers=300, queue_slots=32, fast_channels=2) + (1 << 20),
        max_peers=300, queue_slots=32, fast_channels=2)
    with Channel.attach_path(shm_path) as ch:
        assert ch.max_peers == 300
        g = ch.geometry
        assert (g.max_peers, g.queue_slots, g.fast_channels) == (300, 32, 2)
        assert (g.ring_slots, g.slot_size, g.max_windows) == (64, 4096, 32)


def test_format_flag_formats_a_blank_file(shm_path):
    size = native.min_region_size() + (1 << 20)
    with open(shm_path, "wb") as f:
        f.truncate(size)
    with Channel.attach_path(shm_path, format=True, name="first") as ch:
        assert [p.name for p in ch.peers()] == ["first"]
        assert ch.max_peers == 8


def test_channel_close_is_idempotent(region):
    ch = Channel.attach_path(region)
    w = ch.window("w", 2, 4096)
    ch.close()
    ch.close()
    assert ch.closed and w.closed
    assert "closed" in repr(ch)
    # the slot is free again for a new attachment
    with Channel.attach_path(region, job_id=9, rank=0) as again:
        assert [p.job_id for p in again.peers()] == [9]


# ---------------------------------------------------------------- drain

def test_drain_request_answered_by_the_entry_owner(region):
    """The host's side of a drain (docs/migration.md) through the region
    file, the rank's side in another process: asked, answered, the
    answer read back; a new holder of the slot inherits no request."""
    with Channel.attach_path(region, job_id=JOB, rank=0, name="host") as ch:
        child = spawn_peer(region, """
            deadline = time.monotonic() + 10
            while (req := ch.drain_requested()) == 0:
                assert time.monotonic() < deadline, "no request came"
                time.sleep(0.001)
            assert req == 5
            ch.drain_ack(req, -110)
            assert ch.drain_requested() == 0
            ch.send(peer, b"acked")
            ch.recv(peer, timeout_ms=10000)
            ch.close()
        """)
        try:
            wait_for(lambda: ch.find(JOB, 1) is not None)
            slot = ch.find(JOB, 1)
            gen = ch.peer(slot).generation
            assert native.drain_state(region, slot, gen, 5) is None
            with pytest.raises(NotFound):
                native.request_drain(region, 5, slot=slot,
                                     generation=gen + 1)
            assert native.request_drain(region, 5, slot=slot,
                                        generation=gen) == 1
            ch.recv(slot, timeout_ms=10000)
            assert native.drain_state(region, slot, gen, 5) == -110
            ch.send(slot, b"bye")
        finally:
            finish(child)
        # it acknowledged, then left: the answer stays readable
        assert native.drain_state(region, slot, gen, 5) == -110
        # claims go to the least claimed slots: fill them until ours
        others = []
        try:
            for rank in range(2, 5):
                others.append(Channel.attach_path(region, job_id=JOB,
                                                  rank=rank))
                if others[-1].self_slot == slot:
                    break
            assert others[-1].self_slot == slot
            assert others[-1].drain_requested() == 0
            with pytest.raises(NotFound):
                native.drain_state(region, slot, gen, 5)
        finally:
            for o in others:
                o.close()
        with pytest.raises(ValueError):
            native.request_drain(region, 6)
        # no live entry of that server id: nobody is asked
        assert native.request_drain(region, 6, doorbell_id=77) == 0

"""Many senders per receiver (a stress test through the Python
binding): SENDERS real processes attach one region and stream messages
of 1 byte to several slots' worth (so long ones are cut into fragments)
to one receiver, half with blocking sends, half with try_send and
retries, while one more sender streams without end and is killed with
SIGKILL mid-message. The receiver takes everything with IVSHM_ANY and
checks each sender's order and every byte; the killed sender costs it
nothing but that sender's messages (no hang: every receive has a
deadline). The queue is kept small, so senders contend for it and wait
for room."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from typing import Dict

from ivcloud.native import (ANY, Channel, PeerDead, Timeout, format_region,
                            min_region_size)

SENDERS = 32
MESSAGES = 120                 # per sender
SLOT_SIZE = 256                # payload 224 B: the long messages span slots
RING_SLOTS = 8
QUEUE_SLOTS = 16               # shared by every sender of the receiver
FAST_CHANNELS = 2              # fewer than the senders: most stay queued
MAX_PEERS = SENDERS + 4
JOB = 7
DEADLINE_S = 120

SENDER = r'''
import os, struct, sys, time
from ivcloud.native import Channel
region, rank, count, mode, done = (sys.argv[1], int(sys.argv[2]),
                                   int(sys.argv[3]), sys.argv[4], sys.argv[5])
ch = Channel.attach_path(region, job_id=%(job)d, rank=rank, name=f"sender{rank}")
deadline = time.monotonic() + %(deadline)d
dst = None
while dst is None:
    dst = ch.find(%(job)d, 0)
    if time.monotonic() > deadline:
        sys.exit("receiver never showed up")
    time.sleep(0.01)

def message(seq):
    n = 1 + (rank * 7919 + seq * 104729) %% 700   # 1 .. 700 bytes
    body = bytes((rank * 31 + seq * 17 + i) & 0xff for i in range(n))
    return struct.pack("<II", rank, seq) + body

seq = 0
while count < 0 or seq < count:
    data = message(seq)
    if mode == "block":
        ch.send(dst, data, tag=rank)
    else:
        while not ch.try_send(dst, data, tag=rank):
            if time.monotonic() > deadline:
                sys.exit(f"sender {rank}: no room until the deadline")
            time.sleep(0.0005)
    seq += 1
# leaving drops what the receiver has not taken yet: stay until it has
while not os.path.exists(done) and time.monotonic() < deadline:
    time.sleep(0.01)
ch.close()
''' % {"job": JOB, "deadline": DEADLINE_S}


def expected(rank: int, seq: int) -> bytes:
    n = 1 + (rank * 7919 + seq * 104729) % 700
    body = bytes((rank * 31 + seq * 17 + i) & 0xff for i in range(n))
    return struct.pack("<II", rank, seq) + body


def _geometry() -> Dict[str, int]:
    return dict(max_peers=MAX_PEERS, ring_slots=RING_SLOTS,
                slot_size=SLOT_SIZE, queue_slots=QUEUE_SLOTS,
                fast_channels=FAST_CHANNELS)


def test_many_senders_one_receiver(shm_path, tmp_path):
    g = _geometry()
    format_region(shm_path, min_region_size(**g) + (4 << 20), **g)
    rx = Channel.attach_path(shm_path, job_id=JOB, rank=0, name="receiver")
    done_flag = tmp_path / "done"
    procs = []
    try:
        for r in range(1, SENDERS + 1):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", SENDER, str(shm_path), str(r),
                 str(MESSAGES), "block" if r % 2 else "try", str(done_flag)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))
        victim_rank = SENDERS + 1
        victim = subprocess.Popen(
            [sys.executable, "-c", SENDER, str(shm_path), str(victim_rank),
             "-1", "try", str(done_flag)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)

        next_seq = {r: 0 for r in range(1, victim_rank + 1)}
        slots: Dict[int, int] = {}
        done = 0
        killed = False
        dead_ends = 0
        deadline = time.monotonic() + DEADLINE_S
        while done < SENDERS * MESSAGES:
            assert time.monotonic() < deadline, (
                f"received {done} of {SENDERS * MESSAGES} by the deadline; "
                f"short: { {r: n for r, n in next_seq.items() if n < MESSAGES} }"
                f", senders alive: {[p.args[3] for p in procs if p.poll() is None]}"
                f", dead ends: {dead_ends}")
            if not killed and next_seq[victim_rank] >= 50:
                os.kill(victim.pid, signal.SIGKILL)  # mid-stream
                killed = True
            try:
                src, tag, data = rx.recv(ANY, timeout_ms=2000, maxlen=4096)
            except Timeout:
                continue
            except PeerDead:
                assert killed  # the victim's half-sent message ends so
                dead_ends += 1
                continue
            rank, seq = struct.unpack_from("<II", data)
            assert tag == rank and 1 <= rank <= victim_rank, (tag, rank)
            # one slot per sender, and its messages in the order sent
            assert slots.setdefault(rank, src) == src, (rank, src)
            assert seq == next_seq[rank], (rank, seq, next_seq[rank])
            assert data == expected(rank, seq), (rank, seq)
            next_seq[rank] += 1
            if rank != victim_rank:
                done += 1
        assert killed, "the victim never got going"
        done_flag.touch()
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
        assert all(next_seq[r] == MESSAGES for r in range(1, SENDERS + 1))
        # nothing else arrives: the dead sender's cells were skipped or
        # drained, and a receive ends by its deadline
        rx.reap()
        t0 = time.monotonic()
        while True:
            try:
                _, _, data = rx.recv(ANY, timeout_ms=300, maxlen=4096)
            except Timeout:
                break
            except PeerDead:
                continue
            rank, seq = struct.unpack_from("<II", data)
            assert rank == victim_rank and seq == next_seq[rank], (rank, seq)
            assert data == expected(rank, seq)
            next_seq[rank] += 1
            assert time.monotonic() - t0 < 30
    finally:
        for p in procs + ([victim] if "victim" in locals() else []):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        rx.close()

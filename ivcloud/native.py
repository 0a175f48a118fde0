"""ctypes binding over libivshm (native/include/ivshm.h).

Nothing here is global but the loaded library itself (cached per path):
every attachment is a :class:`Channel` object, every window a
:class:`Window`, and both are context managers that release the native
handle exactly once.

Errors from the C API (negative return codes) raise :class:`IvshmError`
or one of its subclasses, carrying the code and ivshm_strerror()'s text.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import functools
import os
import weakref
from ctypes import (POINTER, Structure, byref, c_char, c_char_p, c_int,
                    c_int32, c_int64, c_size_t, c_ssize_t, c_uint, c_uint32,
                    c_uint64, c_void_p)
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

from .errors import RegionError

__all__ = [
    "ANY", "LOCK_SHARED", "LOCK_EXCLUSIVE", "FAST_NONE",
    "IvshmError", "MagicError", "VersionError", "SizeError", "CorruptError",
    "PeerDead", "RegionFull", "Timeout", "WouldBlock", "NotFound",
    "MessageTruncated",
    "Geometry", "PeerInfo", "Stats", "Channel", "Window",
    "format_region", "min_region_size", "strerror", "native_dir", "library",
    "request_drain", "drain_state",
]

ANY = -1
LOCK_SHARED = 0
LOCK_EXCLUSIVE = 1
_ALL_SEGMENTS = 0xFFFFFFFF

# Error codes beyond errno (ivshm.h)
EMAGIC = -10001
EVERSION = -10002
ESIZE = -10003
ECORRUPT = -10004
EPEERDEAD = -10005
EFULL = -10006

Buffer = Union[bytes, bytearray, memoryview]


# ---------------------------------------------------------------- errors

class IvshmError(RegionError):
    """A libivshm call failed. `code` is the negative return value."""

    def __init__(self, code: int, message: str, call: str = ""):
        self.code = code
        self.message = message
        self.call = call
        super().__init__(f"{call}: {message}" if call else message)

    @property
    def errno(self) -> Optional[int]:
        """The positive errno for -errno codes, None for IVSHM_E* codes."""
        return -self.code if -4096 < self.code < 0 else None


class MagicError(IvshmError):
    """Not an ivshm region (bad magic, never formatted)."""


class VersionError(IvshmError):
    """Region layout version not supported."""


class SizeError(IvshmError):
    """Region size or geometry inconsistent."""


class CorruptError(IvshmError):
    """Shared state failed validation."""


class PeerDead(IvshmError):
    """The peer left or died."""


class RegionFull(IvshmError):
    """Registry, window table or heap is full."""


class Timeout(IvshmError, TimeoutError):
    """A bounded wait expired (-ETIMEDOUT)."""


class WouldBlock(IvshmError, BlockingIOError):
    """A non-blocking call could not complete now (-EAGAIN)."""


class NotFound(IvshmError, LookupError):
    """No such peer / slot (-ENOENT)."""


class MessageTruncated(IvshmError):
    """recv(): the message was longer than `maxlen`; the rest was consumed.

    The received part is in `data`, the full length in `length`."""

    def __init__(self, src: int, tag: int, data: bytes, length: int):
        super().__init__(-_errno.EMSGSIZE,
                         f"message of {length} bytes truncated to {len(data)}",
                         "ivshm_recv")
        self.src, self.tag, self.data, self.length = src, tag, data, length


_ERROR_CLASSES = {
    EMAGIC: MagicError,
    EVERSION: VersionError,
    ESIZE: SizeError,
    ECORRUPT: CorruptError,
    EPEERDEAD: PeerDead,
    EFULL: RegionFull,
    -_errno.ETIMEDOUT: Timeout,
    -_errno.EAGAIN: WouldBlock,
    -_errno.ENOENT: NotFound,
}


# ---------------------------------------------------------------- structs

class _Geometry(Structure):
    _fields_ = [("max_peers", c_uint32), ("ring_slots", c_uint32),
                ("slot_size", c_uint32), ("max_windows", c_uint32),
                ("queue_slots", c_uint32), ("fast_channels", c_uint32)]


class _Config(Structure):
    _fields_ = [("job_id", c_uint64), ("rank", c_uint32), ("name", c_char_p),
                ("spin_ns", c_int64), ("flags", c_uint),
                ("uio_dev", c_char_p), ("bar0_path", c_char_p),
                ("doorbell_id", c_int32)]


class _PeerInfo(Structure):
    _fields_ = [("slot", c_int), ("generation", c_uint32),
                ("job_id", c_uint64),
                ("rank", c_uint32), ("doorbell_id", c_int32), ("pid", c_int32),
                ("name", c_char * 32)]


class _Stats(Structure):
    _fields_ = [(n, c_uint64) for n in
                ("sends", "recvs", "bytes_sent", "bytes_recv", "sleeps",
                 "rings", "dropped")]


_F_FORMAT = 0x1
_F_UNSEALED = 0x2


#: Geometry.fast_channels for a region without fast channels (every
#: message goes through the receivers' shared queues).
FAST_NONE = 0xFFFFFFFF


@dataclass(frozen=True)
class Geometry:
    """Shape of a region; zero fields take the library defaults.

    Every peer owns a receive area: a shared queue of `queue_slots` cells
    and `fast_channels` rings of `ring_slots` slots (docs/region-layout.md),
    so the region grows linearly with `max_peers` (up to 1024)."""
    max_peers: int = 0
    ring_slots: int = 0
    slot_size: int = 0
    max_windows: int = 0
    queue_slots: int = 0
    fast_channels: int = 0

    def _c(self) -> _Geometry:
        return _Geometry(self.max_peers, self.ring_slots, self.slot_size,
                         self.max_windows, self.queue_slots,
                         self.fast_channels)


@dataclass(frozen=True)
class PeerInfo:
    slot: int
    generation: int
    job_id: int
    rank: int
    doorbell_id: int
    pid: int
    name: str


@dataclass(frozen=True)
class Stats:
    sends: int
    recvs: int
    bytes_sent: int
    bytes_recv: int
    sleeps: int
    rings: int
    dropped: int


# ---------------------------------------------------------------- loading

def native_dir() -> Path:
    """Where the native build lives: $IVCLOUD_NATIVE_DIR, else
    <repo>/build/native."""
    env = os.environ.get("IVCLOUD_NATIVE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "build" / "native"


def native_file(name: str, error: Callable[[str], Exception],
                program: bool = False) -> Path:
    """File `name` of the native build (with `program`: one this process
    may run); error(message) when it was not built."""
    path = native_dir() / name
    if not (os.access(path, os.X_OK) if program else path.is_file()):
        raise error(f"{path} not found (run `make build` or set "
                    f"IVCLOUD_NATIVE_DIR)")
    return path


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    sig = {
        "ivshm_strerror": (c_char_p, [c_int]),
        "ivshm_min_region_size": (c_uint64, [POINTER(_Geometry)]),
        "ivshm_format_file": (c_int, [c_char_p, c_uint64, POINTER(_Geometry),
                                      c_uint]),
        "ivshm_attach_path": (c_int, [c_char_p, POINTER(_Config),
                                      POINTER(c_void_p)]),
        "ivshm_attach_server": (c_int, [c_char_p, POINTER(_Config),
                                        POINTER(c_void_p)]),
        "ivshm_detach": (None, [c_void_p]),
        "ivshm_self": (c_int, [c_void_p]),
        "ivshm_max_peers": (c_int, [c_void_p]),
        "ivshm_get_geometry": (None, [c_void_p, POINTER(_Geometry)]),
        "ivshm_peer": (c_int, [c_void_p, c_int, POINTER(_PeerInfo)]),
        "ivshm_find": (c_int, [c_void_p, c_uint64, c_uint32]),
        "ivshm_reap": (c_int, [c_void_p]),
        "ivshm_server_peers": (c_int, [c_void_p, POINTER(c_int32),
                                       POINTER(c_int), c_int]),
        "ivshm_event_fd": (c_int, [c_void_p]),
        "ivshm_send": (c_int, [c_void_p, c_int, c_uint32, c_void_p, c_size_t]),
        "ivshm_try_send": (c_int, [c_void_p, c_int, c_uint32, c_void_p,
                                   c_size_t]),
        "ivshm_recv": (c_ssize_t, [c_void_p, c_int, POINTER(c_int),
                                   POINTER(c_uint32), c_void_p, c_size_t,
                                   c_int]),
        "ivshm_win_open": (c_int, [c_void_p, c_char_p, c_uint32, c_uint64,
                                   POINTER(c_void_p)]),
        "ivshm_win_close": (None, [c_void_p]),
        "ivshm_win_ptr": (c_void_p, [c_void_p, c_uint32]),
        "ivshm_win_seg_size": (c_uint64, [c_void_p]),
        "ivshm_win_put": (c_int, [c_void_p, c_uint32, c_uint64, c_void_p,
                                  c_size_t]),
        "ivshm_win_get": (c_int, [c_void_p, c_uint32, c_uint64, c_void_p,
                                  c_size_t]),
        "ivshm_win_fetch_add": (c_int, [c_void_p, c_uint32, c_uint64, c_int64,
                                        POINTER(c_int64)]),
        "ivshm_win_cas": (c_int, [c_void_p, c_uint32, c_uint64, c_uint64,
                                  c_uint64, POINTER(c_uint64)]),
        "ivshm_win_lock": (c_int, [c_void_p, c_uint32, c_int]),
        "ivshm_win_unlock": (c_int, [c_void_p, c_uint32]),
        "ivshm_win_flush": (c_int, [c_void_p, c_uint32]),
        "ivshm_win_barrier": (c_int, [c_void_p, c_int]),
        "ivshm_get_stats": (None, [c_void_p, POINTER(_Stats)]),
        "ivshm_set_spin": (None, [c_void_p, c_int64]),
        "ivshm_drain_requested": (c_uint32, [c_void_p]),
        "ivshm_drain_ack": (None, [c_void_p, c_uint32, c_int32]),
        "ivshm_admin_open": (c_int, [c_int, POINTER(c_void_p)]),
        "ivshm_admin_close": (None, [c_void_p]),
        "ivshm_admin_drain": (c_int, [c_void_p, c_int32, c_uint32]),
        "ivshm_admin_drain_slot": (c_int, [c_void_p, c_int, c_uint32,
                                           c_uint32]),
        "ivshm_admin_drain_state": (c_int, [c_void_p, c_int, c_uint32,
                                            c_uint32, POINTER(c_int32)]),
        "ivshm_admin_peer_id": (c_int, [c_void_p, c_int, POINTER(c_int32),
                                        POINTER(c_uint32)]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


@functools.lru_cache(maxsize=None)
def _load(path: str) -> ctypes.CDLL:
    return _declare(ctypes.CDLL(path))


def library(path: Optional[Union[str, Path]] = None) -> ctypes.CDLL:
    """The loaded libivshm (from `path`, or libivshm.so in native_dir())."""
    p = Path(path) if path else native_dir() / "libivshm.so"
    if not p.exists():
        raise FileNotFoundError(
            f"libivshm not found at {p} (run `make build`, or set "
            f"IVCLOUD_NATIVE_DIR to the native build directory)")
    return _load(str(p.resolve()))


def strerror(code: int) -> str:
    return library().ivshm_strerror(code).decode(errors="replace")


def _check(lib: ctypes.CDLL, rc: int, call: str) -> int:
    if rc < 0:
        msg = lib.ivshm_strerror(int(rc)).decode(errors="replace")
        raise _ERROR_CLASSES.get(int(rc), IvshmError)(int(rc), msg, call)
    return rc


def _in_buffer(data: Buffer) -> Tuple[object, int]:
    """(pointer argument, length) for bytes-like input, without a copy
    where ctypes allows one."""
    if isinstance(data, bytes):
        return data, len(data)
    mv = memoryview(data)
    if not mv.contiguous:
        data = mv.tobytes()
        return data, len(data)
    n = mv.nbytes
    if mv.readonly:
        b = mv.tobytes()
        return b, n
    return (c_char * n).from_buffer(mv.cast("B")) if n else None, n


# ---------------------------------------------------------------- regions

def min_region_size(max_peers: int = 0, ring_slots: int = 0,
                    slot_size: int = 0, max_windows: int = 0,
                    queue_slots: int = 0, fast_channels: int = 0) -> int:
    """Smallest region for this geometry (zero: defaults): linear in
    max_peers, see docs/region-layout.md for the bytes per peer."""
    g = Geometry(max_peers, ring_slots, slot_size, max_windows, queue_slots,
                 fast_channels)._c()
    n = library().ivshm_min_region_size(byref(g))
    if n == 0:
        raise IvshmError(-_errno.EINVAL, "invalid geometry",
                         "ivshm_min_region_size")
    return int(n)


def format_region(path: Union[str, Path], size: int, max_peers: int = 0,
                  ring_slots: int = 0, slot_size: int = 0,
                  max_windows: int = 0, mode: int = 0o600,
                  queue_slots: int = 0, fast_channels: int = 0) -> None:
    """Create (or truncate) the file `path` of `size` bytes and format it."""
    lib = library()
    g = Geometry(max_peers, ring_slots, slot_size, max_windows, queue_slots,
                 fast_channels)._c()
    _check(lib, lib.ivshm_format_file(os.fsencode(path), size, byref(g), mode),
           f"ivshm_format_file({path})")


# ---------------------------------------------------------------- drain

@contextlib.contextmanager
def _admin(region: Union[str, Path]):
    """An ivshm_admin handle on the region file `region` (a host file, or
    /proc/PID/fd/N of the server's memfd), closed after: (handle,
    library)."""
    lib = library()
    try:
        fd = os.open(os.fspath(region), os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:   # the server gone meanwhile
        raise RegionError(f"{region}: {e.strerror}") from None
    h = c_void_p()
    try:
        _check(lib, lib.ivshm_admin_open(fd, byref(h)),
               f"ivshm_admin_open({region})")
    finally:
        os.close(fd)
    try:
        yield h, lib
    finally:
        lib.ivshm_admin_close(h)


def _admin_call(region: Union[str, Path], name: str, *args) -> Tuple[int, object]:
    """One ivshm_admin_* call on `region`: (its result, the library)."""
    with _admin(region) as (h, lib):
        return getattr(lib, name)(h, *args), lib


def request_drain(region: Union[str, Path], request: int, *,
                  doorbell_id: Optional[int] = None,
                  slot: Optional[int] = None, generation: int = 0) -> int:
    """Ask the ranks of the region to let go of it (docs/migration.md):
    every live entry of server id `doorbell_id` (a guest's IVPosition), or
    the entry `slot` at `generation`. `request` is a new non-zero number.
    Returns how many entries were asked."""
    if (doorbell_id is None) == (slot is None):
        raise ValueError("name either a doorbell id or a slot")
    if doorbell_id is not None:
        rc, lib = _admin_call(region, "ivshm_admin_drain", doorbell_id,
                              request)
        return _check(lib, rc, "ivshm_admin_drain")
    rc, lib = _admin_call(region, "ivshm_admin_drain_slot", slot,
                          generation, request)
    _check(lib, rc, "ivshm_admin_drain_slot")
    return 1


def drain_guest(region: Union[str, Path], doorbell_id: int,
                request: int) -> List[Tuple[int, int]]:
    """Ask every live entry of server id `doorbell_id` (the ranks of one
    guest) to let go of the region, like request_drain; the (slot,
    generation) of each, for drain_state."""
    asked = []
    with _admin(region) as (h, lib):
        db, gen = c_int32(0), c_uint32(0)
        for slot in range(1024):   # ivshm.h's bound on peers
            rc = lib.ivshm_admin_peer_id(h, slot, byref(db), byref(gen))
            if rc == -_errno.EINVAL:
                break   # past the region's max_peers
            if rc == 0 and db.value == doorbell_id and \
                    lib.ivshm_admin_drain_slot(h, slot, gen.value,
                                               request) == 0:
                asked.append((slot, gen.value))
    return asked


def drain_state(region: Union[str, Path], slot: int, generation: int,
                request: int) -> Optional[int]:
    """The answer of the entry `slot` at `generation` to `request`: None
    while it has not answered, else its status (0, or a negative errno).
    NotFound once it left without answering or its slot changed hands."""
    status = c_int32(0)
    rc, lib = _admin_call(region, "ivshm_admin_drain_state", slot, generation,
                          request, byref(status))
    if _check(lib, rc, "ivshm_admin_drain_state") == 0:
        return None
    return status.value


# ---------------------------------------------------------------- channel

def _release(fn, handle: c_void_p, owner_pid: int) -> None:
    # A forked child shares the mapping but not the registry slot: only
    # the process that attached may leave (or drop a window reference).
    if os.getpid() == owner_pid:
        fn(handle)


class Channel:
    """One attachment to a region: registry slot, rings, doorbell.

    Like the C handle, a Channel is used by one thread at a time."""

    def __init__(self, lib: ctypes.CDLL, handle: c_void_p, where: str):
        self._lib = lib
        self._h = handle
        self._where = where
        self._windows: "weakref.WeakSet[Window]" = weakref.WeakSet()
        self._rbuf = None  # reused receive buffer, grown on demand
        # Detach even if the user forgets: the finalizer holds no
        # reference to self, only to the raw handle.
        self._finalizer = weakref.finalize(self, _release, lib.ivshm_detach,
                                           handle, os.getpid())

    @staticmethod
    def _config(job_id: int, rank: int, name: Optional[str], spin_ns: int,
                flags: int) -> _Config:
        if name is not None and len(name.encode()) > 31:
            raise ValueError("name is limited to 31 bytes")
        return _Config(job_id=job_id, rank=rank,
                       name=name.encode() if name is not None else None,
                       spin_ns=spin_ns, flags=flags, uio_dev=None,
                       bar0_path=None, doorbell_id=-1)

    @classmethod
    def attach_path(cls, path: Union[str, Path], job_id: int = 0,
                    rank: int = 0, name: Optional[str] = None,
                    spin_ns: int = 0, format: bool = False,
                    uio_dev: Optional[str] = None,
                    bar0_path: Optional[str] = None,
                    doorbell_id: int = -1) -> "Channel":
        """Attach to a region file (host shm file, or resource2 in a guest).
        `format=True` formats the file first if it is blank (all zero)."""
        lib = library()
        cfg = cls._config(job_id, rank, name, spin_ns,
                          _F_FORMAT if format else 0)
        if uio_dev and bar0_path:
            cfg.uio_dev = os.fsencode(uio_dev)
            cfg.bar0_path = os.fsencode(bar0_path)
            cfg.doorbell_id = doorbell_id
        h = c_void_p()
        _check(lib, lib.ivshm_attach_path(os.fsencode(path), byref(cfg),
                                          byref(h)),
               f"ivshm_attach_path({path})")
        return cls(lib, h, str(path))

    @classmethod
    def attach_server(cls, socket: Union[str, Path], job_id: int = 0,
                      rank: int = 0, name: Optional[str] = None,
                      spin_ns: int = 0, unsealed: bool = False) -> "Channel":
        """Attach through an ivshmem-server socket. The server's region
        must be a sealed memfd unless `unsealed` (a server in host-file
        mode, single-user): otherwise PermissionError-like IvshmError
        (-EPERM)."""
        lib = library()
        cfg = cls._config(job_id, rank, name, spin_ns,
                          _F_UNSEALED if unsealed else 0)
        h = c_void_p()
        _check(lib, lib.ivshm_attach_server(os.fsencode(socket), byref(cfg),
                                            byref(h)),
               f"ivshm_attach_server({socket})")
        return cls(lib, h, str(socket))

    # -- lifetime

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Close our windows, leave the registry, unmap. Idempotent."""
        if self.closed:
            return
        for w in list(self._windows):
            w.close()
        self._finalizer()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"slot {self.self_slot}"
        return f"<ivshm.Channel {self._where} {state}>"

    def _handle(self) -> c_void_p:
        if self.closed:
            raise ValueError("channel is closed")
        return self._h

    def _call(self, name: str, *args) -> int:
        return _check(self._lib, getattr(self._lib, name)(self._handle(),
                                                          *args), name)

    # -- registry

    @property
    def self_slot(self) -> int:
        return self._lib.ivshm_self(self._handle())

    @property
    def max_peers(self) -> int:
        return self._lib.ivshm_max_peers(self._handle())

    @property
    def geometry(self) -> Geometry:
        """The geometry the region was formatted with (fast_channels is
        FAST_NONE for a region without fast channels)."""
        g = _Geometry()
        self._lib.ivshm_get_geometry(self._handle(), byref(g))
        return Geometry(g.max_peers, g.ring_slots, g.slot_size, g.max_windows,
                        g.queue_slots, g.fast_channels)

    def peer(self, slot: int) -> Optional[PeerInfo]:
        """The live peer in `slot`, or None."""
        info = _PeerInfo()
        rc = self._lib.ivshm_peer(self._handle(), slot, byref(info))
        if rc == -_errno.ENOENT:
            return None
        _check(self._lib, rc, "ivshm_peer")
        return PeerInfo(info.slot, info.generation, info.job_id, info.rank,
                        info.doorbell_id, info.pid,
                        info.name.decode(errors="replace"))

    def peers(self) -> List[PeerInfo]:
        """Every live peer in the registry, ourselves included."""
        out = []
        for slot in range(self.max_peers):
            p = self.peer(slot)
            if p is not None:
                out.append(p)
        return out

    def find(self, job_id: int, rank: int) -> Optional[int]:
        """Slot of the live peer (job_id, rank), or None."""
        rc = self._lib.ivshm_find(self._handle(), job_id, rank)
        if rc == -_errno.ENOENT:
            return None
        return _check(self._lib, rc, "ivshm_find")

    def reap(self) -> int:
        """Check every registered peer's liveness; returns how many died."""
        return self._call("ivshm_reap")

    def drain_requested(self) -> int:
        """The host's drain request to us not yet answered, else 0."""
        return int(self._lib.ivshm_drain_requested(self._handle()))

    def drain_ack(self, request: int, status: int = 0) -> None:
        """Answer drain `request` with `status` (0 or a negative errno)."""
        self._lib.ivshm_drain_ack(self._handle(), request, status)

    def server_peers(self, n: int = 256) -> List[Tuple[int, int]]:
        """(doorbell id, vectors) of the server's connected peers; raises
        IvshmError(-ENOTSUP) when not attached through a server."""
        ids = (c_int32 * n)()
        vec = (c_int * n)()
        count = self._call("ivshm_server_peers", ids, vec, n)
        return [(ids[i], vec[i]) for i in range(min(count, n))]

    def event_fd(self) -> int:
        return self._lib.ivshm_event_fd(self._handle())

    # -- messages

    def send(self, slot: int, data: Buffer, tag: int = 0) -> None:
        """Send `data` to the peer in `slot`; blocks while the ring is full."""
        ptr, n = _in_buffer(data)
        self._call("ivshm_send", slot, tag, ptr, n)

    def try_send(self, slot: int, data: Buffer, tag: int = 0) -> bool:
        """Send without waiting; False if the message does not fit now."""
        ptr, n = _in_buffer(data)
        rc = self._lib.ivshm_try_send(self._handle(), slot, tag, ptr, n)
        if rc == -_errno.EAGAIN:
            return False
        _check(self._lib, rc, "ivshm_try_send")
        return True

    def recv(self, source: int = ANY, timeout_ms: int = -1,
             maxlen: int = 1 << 20) -> Tuple[int, int, bytes]:
        """Receive one message: (source slot, tag, payload).

        timeout_ms -1 waits forever (peer death still ends it), 0 polls
        (WouldBlock). Longer than `maxlen` raises MessageTruncated, which
        carries the part received."""
        if self._rbuf is None or len(self._rbuf) < maxlen:
            self._rbuf = ctypes.create_string_buffer(max(maxlen, 64))
        src, tag = c_int(-1), c_uint32(0)
        n = self._lib.ivshm_recv(self._handle(), source, byref(src),
                                 byref(tag), self._rbuf, maxlen, timeout_ms)
        _check(self._lib, n, "ivshm_recv")
        data = ctypes.string_at(self._rbuf, min(n, maxlen))
        if n > maxlen:
            raise MessageTruncated(src.value, tag.value, data, n)
        return src.value, tag.value, data

    def recv_into(self, buf: Union[bytearray, memoryview], source: int = ANY,
                  timeout_ms: int = -1) -> Tuple[int, int, int]:
        """Receive into a writable buffer: (source, tag, full length); a
        length > len(buf) means the message was truncated."""
        ptr, cap = _in_buffer(buf)
        if isinstance(ptr, bytes):
            raise TypeError("recv_into needs a writable contiguous buffer")
        src, tag = c_int(-1), c_uint32(0)
        n = self._lib.ivshm_recv(self._handle(), source, byref(src),
                                 byref(tag), ptr, cap, timeout_ms)
        _check(self._lib, n, "ivshm_recv")
        return src.value, tag.value, n

    # -- tuning and statistics

    def stats(self) -> Stats:
        s = _Stats()
        self._lib.ivshm_get_stats(self._handle(), byref(s))
        return Stats(*(getattr(s, f) for f, _ in _Stats._fields_))

    def set_spin(self, spin_ns: int) -> None:
        """Spin budget before blocking (ns); < 0 never blocks."""
        self._lib.ivshm_set_spin(self._handle(), spin_ns)

    # -- windows

    def window(self, name: str, nseg: int, seg_size: int) -> "Window":
        """Create or open this job's window `name`: `nseg` segments of
        `seg_size` bytes. All members call it with the same arguments."""
        if len(name.encode()) > 31:
            raise ValueError("window name is limited to 31 bytes")
        w = c_void_p()
        self._call("ivshm_win_open", name.encode(), nseg, seg_size, byref(w))
        win = Window(self, w, name, nseg)
        self._windows.add(win)
        return win


# ---------------------------------------------------------------- window

class Window:
    """A one-sided window: `nseg` segments, one per member."""

    def __init__(self, channel: Channel, handle: c_void_p, name: str,
                 nseg: int):
        self._channel = channel  # keeps the mapping alive while we are
        self._lib = channel._lib
        self._w = handle
        self.name = name
        self.nseg = nseg
        self._finalizer = weakref.finalize(self, _release,
                                           self._lib.ivshm_win_close, handle,
                                           os.getpid())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ivshm.Window {self.name!r} nseg={self.nseg}>"

    def _handle(self) -> c_void_p:
        if self.closed or self._channel.closed:
            raise ValueError("window is closed")
        return self._w

    def _call(self, name: str, *args) -> int:
        return _check(self._lib, getattr(self._lib, name)(self._handle(),
                                                          *args), name)

    @property
    def seg_size(self) -> int:
        return int(self._lib.ivshm_win_seg_size(self._handle()))

    def view(self, seg: int) -> memoryview:
        """Direct, writable view of segment `seg`. It points into the
        mapping: do not use it after the window or channel is closed."""
        p = self._lib.ivshm_win_ptr(self._handle(), seg)
        if not p:
            raise IvshmError(-_errno.EINVAL, f"no segment {seg}",
                             "ivshm_win_ptr")
        return memoryview((c_char * self.seg_size).from_address(p)).cast("B")

    def put(self, seg: int, offset: int, data: Buffer) -> None:
        ptr, n = _in_buffer(data)
        self._call("ivshm_win_put", seg, offset, ptr, n)

    def get(self, seg: int, offset: int, length: int) -> bytes:
        buf = ctypes.create_string_buffer(max(length, 1))
        self._call("ivshm_win_get", seg, offset, buf, length)
        return ctypes.string_at(buf, length)

    def fetch_add(self, seg: int, offset: int, add: int) -> int:
        """Atomic 64-bit add at an 8-byte aligned offset; returns the old
        value (signed)."""
        old = c_int64()
        self._call("ivshm_win_fetch_add", seg, offset, add, byref(old))
        return old.value

    def cas(self, seg: int, offset: int, expected: int, desired: int) -> int:
        """Atomic 64-bit compare-and-swap; returns the old value (the swap
        happened iff it equals `expected`)."""
        old = c_uint64()
        self._call("ivshm_win_cas", seg, offset, expected, desired, byref(old))
        return old.value

    def lock(self, seg: int, exclusive: bool = True) -> None:
        self._call("ivshm_win_lock", seg,
                   LOCK_EXCLUSIVE if exclusive else LOCK_SHARED)

    def unlock(self, seg: int) -> None:
        self._call("ivshm_win_unlock", seg)

    def locked(self, seg: int, exclusive: bool = True) -> "_LockEpoch":
        """`with win.locked(seg):` a passive-target epoch on `seg`."""
        return _LockEpoch(self, seg, exclusive)

    def flush(self, seg: Optional[int] = None) -> None:
        """Complete our puts to `seg` (all segments if None)."""
        self._call("ivshm_win_flush", _ALL_SEGMENTS if seg is None else seg)

    def barrier(self, timeout_ms: int = -1) -> None:
        self._call("ivshm_win_barrier", timeout_ms)


class _LockEpoch:
    def __init__(self, win: Window, seg: int, exclusive: bool):
        self._win, self._seg, self._exclusive = win, seg, exclusive

    def __enter__(self) -> Window:
        self._win.lock(self._seg, self._exclusive)
        return self._win

    def __exit__(self, *exc) -> None:
        self._win.unlock(self._seg)

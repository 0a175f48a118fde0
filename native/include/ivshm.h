/*
 * libivshm: a message and RMA channel over one shared-memory region
 * (QEMU's ivshmem device, or a host shm file).
 *
 * One attachment (`ivshm`) = the mapped region + our slot in its peer
 * registry + a doorbell to wake sleeping peers.  Every function returns
 * 0 (or a non-negative count) on success and a negative error code on
 * failure: either -errno or one of the IVSHM_E* codes below.
 * ivshm_strerror() turns both into text.
 *
 * Threading: one `ivshm` handle is used by one thread at a time.
 * The region itself is untrusted: every value read from it is validated
 * before it is used as an index, length or offset.
 *
 * Bounds (docs/security.md, "libivshm"; tested by test_hostile_harness).
 * Whatever peers write into the region, a call's cost is set by what
 * its caller chose: the message it sends, its deadline, the geometry.
 *  - Work. A unit is one trip of a loop whose number of trips peers'
 *    writes decide: a cell dropped or moved aside, a fragment of a
 *    message received, a source polled, a claim retried, a waiter
 *    woken. With B = 2 * min(queue_slots + ring_slots, 2048) + max_peers
 *    + 128, a call does at most 2B units between two looks at the clock
 *    (and stops looking at the region once B is spent, until it has
 *    looked); a call that never waits (timeout 0, ivshm_try_send,
 *    ivshm_send_reserve/commit, ivshm_send_small, ivshm_recv_peek,
 *    ivshm_recv_release, ivshm_recv_idle) at most 3B in all. The bytes
 *    it copies are the messages' own (at most one slot per unit).
 *    Registry calls: ivshm_reap O(max_peers) entries and liveness probes
 *    (a few system calls each) plus the server notices pending (at most
 *    4096) in one pass over the registry; ivshm_find and
 *    ivshm_detach's release of our window holds O(max_peers) and
 *    O(max_windows + our windows' segments). A peer that leaves costs
 *    the others O(1) each (its registry entry marked): what it held in
 *    the window tables is broken by whoever waits for it.
 *  - Deadlines. Every wait ends by the caller's deadline -- both phases
 *    of a window lock under one deadline, every retry of a receive --
 *    plus one bounded step: the rest of one budget of work, a round of
 *    at most 32 liveness probes, a system call. timeout_ms = 0 never
 *    blocks. A call without a deadline (-1, ivshm_send) waits as long as
 *    its peer lives.
 *  - Lifetimes. What a call hands out stays the caller's until its
 *    release, whatever peers or the registry do meanwhile: a peeked
 *    message until ivshm_recv_release (or the next peek of that sender,
 *    or detach), a reservation until ivshm_send_commit (or the send that
 *    ends it). Payload in the region stays mapped; its bytes are the
 *    peers' to change, as always.
 */
#ifndef IVSHM_H
#define IVSHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define IVSHM_API_VERSION 1

/* Error codes beyond errno (all negative). */
enum {
    IVSHM_EMAGIC = -10001,   /* region does not start with our magic       */
    IVSHM_EVERSION = -10002, /* layout version we do not speak              */
    IVSHM_ESIZE = -10003,    /* region size or geometry inconsistent        */
    IVSHM_ECORRUPT = -10004, /* shared state failed validation (hostile?)   */
    IVSHM_EPEERDEAD = -10005,/* the peer left or died                       */
    IVSHM_EFULL = -10006,    /* registry / window table / heap is full      */
};

const char *ivshm_strerror(int err);

/* Shape of a region, fixed when it is formatted. Zero fields take defaults.
   Every peer owns one receive area: a queue of queue_slots cells that
   every other peer appends to, and fast_channels single-producer rings
   of ring_slots slots that its busiest senders take over on demand
   (docs/region-layout.md). The region grows linearly with max_peers. */
typedef struct ivshm_geometry {
    uint32_t max_peers;   /* registry slots, 2..1024 (default 8)             */
    uint32_t ring_slots;  /* slots per fast channel, power of two (64)       */
    uint32_t slot_size;   /* bytes per slot / cell incl. 32 B header, %64
                             (4096)                                          */
    uint32_t max_windows; /* window directory entries (32)                   */
    uint32_t queue_slots; /* cells of each peer's shared receive queue,
                             power of two, 2..65536 (64)                     */
    uint32_t fast_channels; /* fast channels per receiver, 1..64 (8), at
                               most max_peers - 1 are laid out;
                               IVSHM_FAST_NONE: none, every message goes
                               through the queues                            */
} ivshm_geometry;

#define IVSHM_FAST_NONE 0xffffffffu

/* Smallest region size that holds `g` (receive areas + registry + window
   tables + a 1 MiB heap): linear in max_peers. */
uint64_t ivshm_min_region_size(const ivshm_geometry *g);

/* Format a blank, mapped region of `size` bytes in place. */
int ivshm_format(void *base, uint64_t size, const ivshm_geometry *g);

/* Create a file of `size` bytes with `mode` at `path` and format it. The
   file appears there only once formatted (built unnamed with O_TMPFILE,
   then linked in), and nothing is replaced or followed: an existing name
   gives -EEXIST, a symlink -EEXIST or -ELOOP. One exception keeps the
   "reserve the name with O_CREAT|O_EXCL, then format" pattern working:
   an existing regular, empty, singly linked file owned by the caller's
   euid is formatted in place. On failure only a file this call created
   is removed. */
int ivshm_format_file(const char *path, uint64_t size, const ivshm_geometry *g,
                      unsigned mode);

/* How an attachment identifies itself and waits. */
typedef struct ivshm_config {
    uint64_t job_id;      /* peers of one job find each other by (job, rank) */
    uint32_t rank;
    const char *name;     /* optional, up to 31 chars                        */
    int64_t spin_ns;      /* spin budget before blocking: 0 = default
                             (IVSHM_SPIN_NS env or 20 us), <0 = never block  */
    unsigned flags;       /* IVSHM_F_*                                       */
    /* Guest doorbell (inside a VM with uio_pci_generic bound to ivshmem):
       both set selects the UIO backend for ivshm_attach_path().            */
    const char *uio_dev;  /* e.g. /dev/uio0                                  */
    const char *bar0_path;/* e.g. /sys/bus/pci/devices/0000:00:04.0/resource0*/
    int32_t doorbell_id;  /* with UIO: our IVPosition; -1 = read from BAR0.
                             Given, a process that finds the device held
                             by another of its guest (vfio: EBUSY) attaches
                             without a doorbell of its own: it polls, and
                             its rings are dropped (docs/vm.md)          */
} ivshm_config;

#define IVSHM_F_FORMAT 0x1u  /* attach_path: format the region if blank */
/* attach_server: also accept a region whose size is not sealed (a server
   in host-file mode, single-user). Without it such a region is refused
   with -EPERM: anyone who can open its file could truncate it under us. */
#define IVSHM_F_UNSEALED 0x2u

typedef struct ivshm ivshm;

/* Attach to a region file (host shm file, or resource2 inside a guest).
   Host peers on one kernel wake each other with futexes in the region. */
int ivshm_attach_path(const char *path, const ivshm_config *cfg, ivshm **out);

/* Attach through an ivshmem-server socket: the region fd and the eventfd
   doorbells arrive over SCM_RIGHTS (QEMU's ivshmem-doorbell protocol).
   The region must be sealed against shrinking and growing (the server's
   memfd) unless cfg->flags has IVSHM_F_UNSEALED. */
int ivshm_attach_server(const char *socket_path, const ivshm_config *cfg,
                        ivshm **out);

/* Leave the registry and unmap. NULL is ignored. */
void ivshm_detach(ivshm *h);

/* ---- peer registry (locality detection) ---- */

typedef struct ivshm_peer_info {
    int slot;
    uint32_t generation;  /* bumps every time the slot is (re)claimed */
    uint64_t job_id;
    uint32_t rank;
    int32_t doorbell_id;  /* ivshmem-server peer id / IVPosition, -1 none */
    int32_t pid;
    char name[32];
} ivshm_peer_info;

/* The geometry this region was formatted with (for sizing messages:
   one ring holds ring_slots * (slot_size - 32) payload bytes, a queue
   queue_slots * (slot_size - 32)). fast_channels is IVSHM_FAST_NONE for a
   region without fast channels. */
void ivshm_get_geometry(const ivshm *h, ivshm_geometry *out);

int ivshm_self(const ivshm *h);            /* our registry slot */
int ivshm_max_peers(const ivshm *h);
/* 0 and fill *out if `slot` holds a live peer; -ENOENT if free or dead. */
int ivshm_peer(ivshm *h, int slot, ivshm_peer_info *out);
/* As ivshm_peer, and also for the peer that held `slot` last if it left
   or died and nobody has claimed the slot since: 1 and *out filled then.
   What such a peer published before it went is still delivered
   (ivshm_recv); this says whose it is. -ENOENT if the slot was never
   held or is being claimed. */
int ivshm_peer_last(ivshm *h, int slot, ivshm_peer_info *out);
/* 1 if the incarnation `generation` of `slot` left by ivshm_detach and
   nobody has claimed the slot since; 0 if it is still registered, died
   (found dead, or gone without detaching) or was replaced; -EINVAL for
   a bad slot. A peer's own word, like everything in the registry: it
   tells a clean leave from a crash, it proves nothing. */
int ivshm_peer_left(ivshm *h, int slot, uint32_t generation);
/* The generation of `slot`'s peer if it is registered (ACTIVE), else
   -ENOENT (-EINVAL for a bad slot): the cheap half of ivshm_peer, for a
   hot path that only checks who holds a slot. */
int64_t ivshm_peer_generation(ivshm *h, int slot);
/* A drain the host asked of us (docs/migration.md): the request number
   in our registry entry if we have not acknowledged it yet, else 0. One
   load of each word of our own entry, for a progress loop to call now
   and then. */
uint32_t ivshm_drain_requested(const ivshm *h);
/* We finished drain request `req` with `status` (0 or a negative errno):
   written into our entry, the status first, for the host to read before
   we leave. */
void ivshm_drain_ack(ivshm *h, uint32_t req, int32_t status);
/* Slot of the live peer (job, rank), or -ENOENT. */
int ivshm_find(ivshm *h, uint64_t job_id, uint32_t rank);
/* 1 if `slot`'s peer registered from our kernel and pid namespace (its
   pid names a process we can look at), 0 if not, -EINVAL for a bad slot.
   What the peer wrote is only compared, so a liar only misleads itself
   about whether its pid is ours. */
int ivshm_peer_local(ivshm *h, int slot);
/* Check liveness of every registered peer (leave notices, pids); mark the
   dead ones and reclaim their slots. Returns how many were found dead.
   O(max_peers) entries and probes, plus the pending notices (Bounds). */
int ivshm_reap(ivshm *h);
/* Doorbell ids the ivshmem-server reports connected (VMs included), -1
   terminated list of at most n entries; returns the count, or -ENOTSUP
   when not attached through a server. vectors[i] = eventfds received. */
int ivshm_server_peers(ivshm *h, int32_t *ids, int *vectors, int n);
/* A pollable fd that becomes readable when this peer may have been woken
   (doorbell or server notice), or -1. For event loops such as Open MPI's. */
int ivshm_event_fd(ivshm *h);

/* ---- messages: per-receiver shared queues, fast SPSC channels for busy
   pairs taken on demand, large messages pipelined; per-pair order holds
   across the switch (docs/region-layout.md) ---- */

#define IVSHM_ANY (-1)

/* Send `len` bytes to the peer in `slot`: through its shared queue, or
   on our fast channel to it once we have one. Messages longer than one
   slot go in fragments; longer than the queue or ring, they stream.
   Blocks (spin, then doorbell) while there is no room, as long as the
   consumer lives: a consumer that never receives, or a co-tenant that
   keeps rewriting a ring's tail or the queue, holds it (use
   ivshm_send_timeout for a bounded wait).
   -IVSHM_EPEERDEAD if the peer goes away; -IVSHM_ECORRUPT if the tail
   the consumer publishes fails validation (out of range, or moved
   backwards), or if the queue was tampered with in the middle of a
   streamed message. A tail ahead of us over slots a co-tenant forged
   "full" (which the consumer then took) is followed, not an error; one
   ahead of us without them is -IVSHM_ECORRUPT until the same value has
   stood 200 ms, then followed (the consumer puts back a tail it does not
   hold), so a send after that goes through again. */
int ivshm_send(ivshm *h, int slot, uint32_t tag, const void *buf, size_t len);
/* ivshm_send waiting at most timeout_ms for room (-1: as ivshm_send; 0:
   as ivshm_try_send): -ETIMEDOUT when the time is up. A message that fits
   in the ring or queue it goes through (ceil(len / (slot_size - 32)) <=
   ring_slots, resp. queue_slots) is all or nothing: nothing is published before there is
   room for all of it, so a timeout leaves no trace. A larger one streams,
   and a timeout midway cuts it: the receiver gets -IVSHM_ECORRUPT for
   it, and the messages after it intact. */
int ivshm_send_timeout(ivshm *h, int slot, uint32_t tag, const void *buf,
                       size_t len, int timeout_ms);
/* Like ivshm_send but never waits: -EAGAIN unless the whole message fits
   now; -EMSGSIZE if it needs more slots than the path to the peer has
   (its fast ring, or its queue before the switch; use send). */
int ivshm_try_send(ivshm *h, int slot, uint32_t tag, const void *buf,
                   size_t len);
/* Receive one message from `from` (a slot or IVSHM_ANY). Returns its full
   length; at most `cap` bytes are stored, so a return > cap means it was
   truncated (the rest is consumed). timeout_ms: -1 forever, 0 poll
   (-EAGAIN), > 0 at most that long (-ETIMEDOUT). *src and *tag may be
   NULL. Messages a peer published before it left are still delivered
   (also one a co-tenant hid, and one queued behind a cell another
   producer is still writing: the receive waits for that producer, up
   to the timeout); after them: -IVSHM_EPEERDEAD. A slot that
   fails validation is consumed and reported as -IVSHM_ECORRUPT, with
   *src naming the peer that wrote it; so are, as one -IVSHM_ECORRUPT,
   messages a co-tenant made their sender write over before we read
   them (a ring tail written forward; counted in stats.dropped).
   The timeout holds in the middle of a multi-slot message too: when the
   next fragment is late (or a sender streams fragments without end, or
   a co-tenant makes a departed sender's ring look endless; a poll takes
   at most a budget's worth of fragments, see Bounds) the call returns
   -EAGAIN / -ETIMEDOUT and keeps the part received so far
   inside the handle; the next receive that reaches this sender (from it
   or IVSHM_ANY) continues the message and returns it whole. The bytes
   stored are min(length, cap of every call that took part), so a caller
   that always passes the same cap sees no difference; if an earlier call
   had a smaller cap than the one that completes a longer message, the
   bytes beyond it are gone and that call returns -EMSGSIZE (the message
   is consumed). A message in progress is dropped if its sender dies
   (-IVSHM_EPEERDEAD), breaks it off (-IVSHM_ECORRUPT), or memory to keep
   it runs out (-ENOMEM once it has been drained). ivshm_recv_peek
   reports it as -EMSGSIZE. */
ssize_t ivshm_recv(ivshm *h, int from, int *src, uint32_t *tag, void *buf,
                   size_t cap, int timeout_ms);

/* Zero-copy receive of a single-slot message (payload <= slot_size - 32):
   like ivshm_recv with timeout 0, but the message stays in the ring and
   *data points at its payload, in shared memory, until
   ivshm_recv_release(h, *src). Returns its length; -EAGAIN if there is
   none; -EMSGSIZE if the next message spans several slots (it is left
   whole: take it with ivshm_recv); other errors as ivshm_recv. The header
   is validated like ivshm_recv's, but the payload bytes are shared: a
   co-tenant may change them while you read, so treat them as untrusted
   input (copy what you must check before relying on it). Peeking again
   without releasing returns the same message. *data stays readable
   until ivshm_recv_release(h, *src), the next peek that returns a
   message of *src, or detach, whatever happens meanwhile: a new
   incarnation of the sender, a send to it, a copying receive of the
   same message (a message taken aside into local memory is kept for
   the caller until then). */
ssize_t ivshm_recv_peek(ivshm *h, int from, int *src, uint32_t *tag,
                        const void **data);
/* Consume the message last peeked from `src`: 0, or -EINVAL if we hold
   no peek there (never peeked, already released, or consumed by a
   copying ivshm_recv since). Decided on our own state, so a co-tenant
   cannot make a message stick. *data is no longer ours afterwards. */
int ivshm_recv_release(ivshm *h, int src);
/* 0 if an IVSHM_ANY receive or peek now may find something, 1 if the
   head of every fast ring and of the queue is empty: a few loads, for a
   caller that polls densely (a progress engine) and peeks only after a
   0. Every 64th call answers 0 regardless: what only the full peek sees
   (a sender's new incarnation, whose ring restarts elsewhere; a tail a
   co-tenant rewound) is then found at most 63 calls late. */
int ivshm_recv_idle(ivshm *h);
/* The fast path of a progress loop (docs/fast-path.md): hand up to `max`
   whole single-slot messages that wait at the heads of our fast channels
   to `fn` where they lie, each sender's in its order, and consume each
   when fn returns. `data` is shared memory, untrusted as with
   ivshm_recv_peek, and ours only until fn returns; `generation` is the
   sender's incarnation that wrote it. fn may send on `h` but must not
   receive on it. Returns how many fn took; 0 when it took none but a
   message may wait elsewhere (the queue, a backlog, a longer or unusual
   message, another sender's turn: take it with ivshm_recv_peek or
   ivshm_recv); -EAGAIN when nothing waits at all, which is answered no
   more than 63 times in a row (as ivshm_recv_idle: the full peek's
   checks still run); -EINVAL for bad arguments. Never waits. */
typedef void (*ivshm_recv_fn)(void *arg, int src, uint32_t generation,
                              uint32_t tag, const void *data, size_t len);
int ivshm_recv_each(ivshm *h, ivshm_recv_fn fn, void *arg, int max);

/* Zero-copy send of one single-slot message: a pointer to the payload of
   the next free slot of the fast ring to `slot`, to be filled with up to
   `len` bytes, or NULL with *err = -EAGAIN (no room), -EMSGSIZE (len >
   slot payload), -IVSHM_EPEERDEAD, -EINVAL. Towards a peer we still reach
   through its shared queue the pointer is a buffer of ours, copied into
   the queue by the commit. Nothing is visible to the peer before
   ivshm_send_commit; a reservation that is never committed costs
   nothing. A copying send to `slot` meanwhile takes that same slot and
   ends the reservation (a later commit is -EINVAL). The pointer stays
   writable until then, also if `slot` gets a new incarnation meanwhile
   (the commit is then -EINVAL or -IVSHM_EPEERDEAD). */
void *ivshm_send_reserve(ivshm *h, int slot, size_t len, int *err);
/* Publish the reserved slot as a message of `len` bytes (len <= the
   slot payload) with `tag`, waking the peer like ivshm_send. -EINVAL
   without an open reservation. Through a shared queue only: -EAGAIN if
   other senders took the room since the reservation; the reservation
   stays open (commit again, or abandon it). */
int ivshm_send_commit(ivshm *h, int slot, uint32_t tag, size_t len);

/* One single-slot message made of two parts, `a` (alen bytes) then `b`
   (blen bytes; either part may be empty), sent without waiting: the hot
   path of small sends, a protocol header and its payload copied straight
   into the ring slot in one call (what ivshm_send_reserve + copy +
   ivshm_send_commit do in two, each checking the peer). Returns 0,
   -EAGAIN (no room now), -EMSGSIZE (alen + blen > the slot payload:
   use ivshm_try_send), or an error of ivshm_try_send. Ends an open
   reservation to `slot`, as any send does, so `a` and `b` must not
   point into a reservation's buffer. */
int ivshm_send_small(ivshm *h, int slot, uint32_t tag, const void *a,
                     size_t alen, const void *b, size_t blen);

/* Whom a receiver hears. IVSHM_LISTEN_ALL (the default): every peer.
   IVSHM_LISTEN_LISTED: only the senders listed with ivshm_listen, in
   the generation listed; cells of any other sender that reach our
   shared queue are dropped as met (counted in stats.dropped), so a
   co-tenant writing to us costs neither memory nor the order of the
   senders we hear, and a receive from it finds nothing. Its last request
   for a fast channel is remembered (a slot's worth), so a sender that
   opened one before we listened is heard on it once we do.
   IVSHM_LISTEN_OTHERS_QUEUED: the listed senders on every path; the
   others through our queue only, for a transport that must see a
   stranger's first message to decide whether to trust it (the BTL
   admits its own job's ranks so): their requests for a fast channel
   are refused, so their rings are never read, and their cells are
   never moved to a backlog (a receive from a listed sender waits
   behind one until a receive from any sender takes it). A sender
   listed later gets the channel it asked for meanwhile (ivshm_listen):
   its messages stay in order. 0, or -EINVAL. */
#define IVSHM_LISTEN_ALL 0
#define IVSHM_LISTEN_LISTED 1
#define IVSHM_LISTEN_OTHERS_QUEUED 2
int ivshm_listen_only(ivshm *h, int mode);
/* Hear the peer in `slot` in its incarnation `generation` (as
   ivshm_peer_info reports it), or stop hearing it (generation 0). */
int ivshm_listen(ivshm *h, int slot, uint32_t generation);

/* Wait (spin, then block on the doorbell) until some peer has a message
   for us, without taking it: 0, or -ETIMEDOUT. For progress engines that
   poll with ivshm_recv(..., 0) and must not burn an idle core. */
int ivshm_wait_message(ivshm *h, int timeout_ms);

/* ---- one-sided windows ---- */

typedef struct ivshm_window ivshm_window;

/* Create or open the window `name` of this job: `nseg` segments (one per
   member) of `seg_size` bytes, zeroed when created. All members call it
   with the same arguments. */
int ivshm_win_open(ivshm *h, const char *name, uint32_t nseg,
                   uint64_t seg_size, ivshm_window **out);
/* Drop our reference; the last member frees the memory. */
void ivshm_win_close(ivshm_window *w);
/* Direct pointer to a segment (loads/stores by the caller). */
void *ivshm_win_ptr(ivshm_window *w, uint32_t seg);
uint64_t ivshm_win_seg_size(const ivshm_window *w);

int ivshm_win_put(ivshm_window *w, uint32_t seg, uint64_t off, const void *buf,
                  size_t len);
int ivshm_win_get(ivshm_window *w, uint32_t seg, uint64_t off, void *buf,
                  size_t len);
/* 64-bit atomics at 8-byte aligned offsets. */
int ivshm_win_fetch_add(ivshm_window *w, uint32_t seg, uint64_t off,
                        int64_t add, int64_t *old);
int ivshm_win_cas(ivshm_window *w, uint32_t seg, uint64_t off,
                  uint64_t expected, uint64_t desired, uint64_t *old);
/* Passive-target epochs on one segment; a dead holder's lock is broken
   (within ~1 ms). A live holder is waited for at most
   IVSHM_LOCK_TIMEOUT_MS (environment at attach; default 30000), then
   -ETIMEDOUT: one bound for the whole call, an exclusive lock's wait
   for the writer word and for the readers to drain together. */
#define IVSHM_LOCK_SHARED 0
#define IVSHM_LOCK_EXCLUSIVE 1
int ivshm_win_lock(ivshm_window *w, uint32_t seg, int kind);
int ivshm_win_unlock(ivshm_window *w, uint32_t seg);
/* Complete our puts to `seg` (all segments if seg == UINT32_MAX). */
int ivshm_win_flush(ivshm_window *w, uint32_t seg);
/* Barrier among the nseg members of the window: 0, -ETIMEDOUT, or
   -IVSHM_EPEERDEAD once a member left or died without closing (found
   by its registry entry at once, by a probe of its pid within a few
   20 ms slices). */
int ivshm_win_barrier(ivshm_window *w, int timeout_ms);

/* ---- waiting ---- */

typedef struct ivshm_stats {
    uint64_t sends, recvs, bytes_sent, bytes_recv;
    uint64_t sleeps;   /* times we blocked on the doorbell   */
    uint64_t rings;    /* doorbells we rang                  */
    uint64_t dropped;  /* stale, unheard or overwritten msgs */
} ivshm_stats;
void ivshm_get_stats(const ivshm *h, ivshm_stats *out);
/* Change the spin budget at run time (ns; <0 never block). */
void ivshm_set_spin(ivshm *h, int64_t spin_ns);

#ifdef __cplusplus
}
#endif
#endif

/*
 * The libfabric provider `ivshm` (docs/provider.md): internal objects and
 * the wire protocol shared by both sides of every exchange.
 *
 * One endpoint = one libivshm attachment (a registry slot) + optionally a
 * core provider endpoint (tcp;ofi_rxm by default) for the peers that are
 * not in our region. Every peer the application inserts into the AV is
 * resolved once: same region, slot live at the generation and random name
 * its address names -> the region; anything else -> the core provider.
 *
 * Built against the oldest headers we support (Debian 12's libfabric
 * 1.17). Newer cores hand us structures that grew at their ends (we read
 * only the prefix we know) and read ours past that prefix: everything we
 * return to the core is allocated with zeroed room (fiv_getinfo.c).
 */
#ifndef FIV_H
#define FIV_H

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <rdma/providers/fi_log.h>
#include <rdma/providers/fi_prov.h>

#include "fiv_mac.h"
#include "ivshm.h"

#define FIV_PROV_NAME "ivshm"
#define FIV_PROV_VERSION FI_VERSION(1, 0)
#define FIV_FABRIC_NAME "ivshm"
#define FIV_DOMAIN_NAME "ivshm"

/* What the provider offers (fiv_getinfo.c trims it to what was asked). */
#define FIV_CAPS                                                              \
    (FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC | FI_SEND | FI_RECV | FI_READ |  \
     FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_DIRECTED_RECV |         \
     FI_MULTI_RECV | FI_SOURCE | FI_RMA_EVENT | FI_LOCAL_COMM |               \
     FI_REMOTE_COMM | FI_TRIGGER)
/* Of these, what applies to the transmit side and to the receive side
   (fi_getinfo(3): tx_attr and rx_attr carry only their own). */
#define FIV_TX_CAPS                                                           \
    (FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC | FI_SEND | FI_READ | FI_WRITE |  \
     FI_TRIGGER)
#define FIV_RX_CAPS                                                           \
    (FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC | FI_RECV | FI_REMOTE_READ |     \
     FI_REMOTE_WRITE | FI_DIRECTED_RECV | FI_MULTI_RECV | FI_SOURCE |         \
     FI_RMA_EVENT)
/* A datagram endpoint (FI_EP_DGRAM) is the same endpoint serving a subset:
   messages only, each at most FIV_DGRAM_MAX_MSG (docs/provider.md,
   "Datagram endpoints"). What it delivers is reliable and ordered, which a
   datagram's contract allows but does not promise. */
#define FIV_DGRAM_CAPS                                                        \
    (FI_MSG | FI_SEND | FI_RECV | FI_DIRECTED_RECV | FI_MULTI_RECV |          \
     FI_SOURCE | FI_LOCAL_COMM | FI_REMOTE_COMM)
#define FIV_DGRAM_MAX_MSG ((size_t)64 << 10)
#define FIV_TX_OP_FLAGS                                                       \
    (FI_COMPLETION | FI_INJECT | FI_INJECT_COMPLETE | FI_TRANSMIT_COMPLETE |  \
     FI_DELIVERY_COMPLETE | FI_REMOTE_CQ_DATA)
/* Internal to our calls: the inject calls (fi_inject & co.) write no
   completion. FI_INJECT in a *msg call's flags only lets the caller reuse
   its buffer at once: that operation still completes (fi_msg(3)). A bit
   libfabric leaves to providers, cleared from what an application passes. */
#define FIV_NO_EVENT (1ULL << 62)
#define FIV_RX_OP_FLAGS (FI_COMPLETION | FI_MULTI_RECV)
/* Triggered operations (fi_trigger(3), fiv_trigger.c): FI_TRIGGER is a
   flag of one *msg call, or of an alias endpoint's (fi_ep_alias), never
   of an endpoint's own op_flags, so that the calls without flags (every
   MPI's sends) never look for it. At most this many wait per endpoint
   (its tx_attr->size): one more is -FI_EAGAIN. */
#define FIV_TRIGGER_MAX 1024
/* Every operation to a peer travels one ordered path and its target
   handles them in arrival order (fiv_rma.c: a read larger than
   FIV_READ_COPY is answered from the registered bytes as the answer
   leaves, see docs/provider.md "Limits"). */
#define FIV_MSG_ORDER                                                         \
    (0x1ffull | FI_ORDER_DATA | FI_ORDER_RMA_RAR | FI_ORDER_RMA_RAW |         \
     FI_ORDER_RMA_WAR | FI_ORDER_RMA_WAW | FI_ORDER_ATOMIC_RAR |              \
     FI_ORDER_ATOMIC_RAW | FI_ORDER_ATOMIC_WAR | FI_ORDER_ATOMIC_WAW)
#define FIV_READ_COPY (64u << 10)
#define FIV_MR_MODES                                                          \
    (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY)
#define FIV_MAX_MSG ((size_t)1 << 30)  /* one message, any path          */
#define FIV_INJECT 256                 /* fi_inject / FI_INJECT bytes     */
#define FIV_IOV_LIMIT 4
#define FIV_RMA_IOV_LIMIT 1
#define FIV_CQ_DATA_SIZE 8
#define FIV_ATOMIC_MAX 256             /* operand bytes of one atomic     */
#define FIV_MIN_SLOT 128               /* libivshm's smallest slot (bytes) */
/* Caps per peer, defaults (docs/provider.md, "Caps per peer") */
#define FIV_PEER_ANSWER_BYTES ((size_t)64 << 20)
#define FIV_PEER_QUEUE ((size_t)1 << 16)
#define FIV_PEER_UNEXP_BYTES FIV_MAX_MSG
#define FIV_CQ_SIZE 65536     /* a CQ opened with size 0                 */

/* ---- wire protocol ----
   Over the region the libivshm message tag carries the operation (low 8
   bits) and flags; over the core provider a 4-byte word in front of the
   payload carries the same. A message longer than one slot (or core
   buffer) is its first fragment (header + leading bytes) followed by raw
   continuation fragments: both paths keep each pair's order, so a
   receiver appends continuations to that sender's message in progress. */
enum fiv_op {
    FIV_OP_MSG = 1,        /* fiv_msg_hdr + payload (first or only part)  */
    FIV_OP_MORE = 2,       /* continuation of the sender's current message */
    FIV_OP_WRITE = 3,      /* fiv_rma_hdr + data                          */
    FIV_OP_READ = 4,       /* fiv_rma_hdr: send the bytes back            */
    FIV_OP_READ_RESP = 5,  /* fiv_resp_hdr + data                         */
    FIV_OP_ATOMIC = 6,     /* fiv_rma_hdr + operand (+ compare)           */
    FIV_OP_ACK = 7,        /* fiv_resp_hdr (+ fetched data for atomics)   */
    FIV_OP_INTRO = 8,      /* fiv_intro: the sender's first message to us */
    FIV_OP_PROBE = 9,      /* fiv_probe: how many messages each way?      */
    FIV_OP_PROBE_ACK = 10, /* fiv_probe: the answer                       */
    FIV_OP_SWITCH = 11,    /* fiv_switch: the sender's last region message
                              to us; the core path from here on          */
    FIV_OP_OFFER = 12,     /* core, fiv_offer: where the sender is in its
                              region now                                 */
    FIV_OP_BACK = 13,      /* fiv_switch; core: the sender's last core
                              message to us; region: its first region one
                              after ours                                 */
};
#define FIV_OP_MASK 0xffu
#define FIV_F_TAGGED 0x100u   /* MSG: a tagged message                   */
#define FIV_F_DATA 0x200u     /* MSG/WRITE: remote CQ data present        */
#define FIV_F_FETCH 0x400u    /* ATOMIC: send the old value back          */
#define FIV_F_COMPARE 0x800u  /* ATOMIC: compare operand follows          */
#define FIV_F_ACK 0x1000u     /* WRITE: acknowledge once applied          */
/* Over the region the tag's upper 16 bits check the message's start
   (fiv_wire_tag): random bytes a co-tenant wrote over a message are
   found there, not taken for a header. Not a MAC: a deliberate forgery
   in a genuine rank's ring passes, as any raw write would. */
#define FIV_WIRE_OP 0xffffu
#define FIV_WIRE_CHECKED 24   /* bytes of the message the check covers   */

static inline uint32_t fiv_wire_mix(uint32_t op, size_t n, uint64_t w0,
                                    uint64_t w1, uint64_t w2)
{
    uint64_t h = (op & FIV_WIRE_OP) ^ ((uint64_t)n << 16);
    h = (h ^ w0) * 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 31) ^ w1) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 29) ^ w2) * 0x94d049bb133111ebull;
    h ^= h >> 32;
    return (op & FIV_WIRE_OP) | ((uint32_t)h & ~FIV_WIRE_OP);
}

static inline uint32_t fiv_wire_tag(uint32_t op, const void *start, size_t n)
{
    /* a message's first part (its header alone is 24 bytes): three
       loads into registers, where a header just built is already, not
       a zeroed array on the stack filled by a copy */
    if (n >= FIV_WIRE_CHECKED) {
        uint64_t w0, w1, w2;
        memcpy(&w0, start, 8);
        memcpy(&w1, (const uint8_t *)start + 8, 8);
        memcpy(&w2, (const uint8_t *)start + 16, 8);
        return fiv_wire_mix(op, n, w0, w1, w2);
    }
    uint64_t w[3] = {0, 0, 0};
    memcpy(w, start, n);
    return fiv_wire_mix(op, n, w[0], w[1], w[2]);
}

struct fiv_msg_hdr {     /* 24 bytes: with libivshm's 32 B slot header and
                            an 8 B payload, one 64 B line */
    uint64_t tag;
    uint64_t len;        /* total payload bytes of the message            */
    uint64_t data;       /* remote CQ data (FIV_F_DATA)                   */
};

struct fiv_rma_hdr {
    uint64_t addr, key;
    uint64_t len;        /* bytes (WRITE, READ) or operand bytes (ATOMIC) */
    uint64_t id;         /* initiator's request id, echoed in the answer  */
    uint64_t data;       /* remote CQ data (WRITE with FIV_F_DATA)        */
    uint32_t op, datatype; /* ATOMIC                                      */
};

struct fiv_resp_hdr {
    uint64_t id;
    int32_t status;      /* 0 or a negative FI_E* code                    */
    uint32_t pad;
    uint64_t len;        /* bytes following (READ_RESP, fetching ACK)     */
};

/* The endpoint name (fi_getname): who we are in which region, and where
   the core provider reaches us. Always FIV_ADDR_LEN (64) bytes, the size
   MPICH reserves for a name, so that names pack into arrays. The key is
   the endpoint's secret: it travels only in names, i.e. through the
   MPI's own out-of-band exchange, never through the region, and a peer
   proves with it that it holds our name (fiv_intro.c). */
#define FIV_ADDR_MAGIC 0x7669u  /* "iv" */
#define FIV_ADDR_VERSION 2
#define FIV_CORE_ADDR_MAX 28    /* a sockaddr_in6                         */
struct fiv_addr {
    uint16_t magic;
    uint8_t version;
    uint8_t core_len;    /* bytes of core address, 0 = none               */
    int16_t slot;        /* region slot, -1 = not attached                */
    uint16_t pad;
    uint32_t generation;
    uint32_t nonce[2];   /* our registry name's random part: the region   */
    uint8_t key[FIV_KEY_LEN];
    uint8_t core[FIV_CORE_ADDR_MAX];
};

/* Message counts of one pair (fiv_probe.c): a probe asks, its answer
   tells. `tx`: what the writer sent to the reader, `rx`: what it received
   from the reader, probes and answers not counted; an answer echoes the
   probe's `tx`. */
#define FIV_PROBE_BUSY 1u    /* answer: messages for the prober still queued */
#define FIV_PROBE_BROKEN 2u  /* probe: its writer found our path broken      */
struct fiv_probe {
    uint64_t tx, rx;
    uint64_t echo;
    uint64_t flags;
};

/* The last region message of one direction of a pair (fiv_drain.c,
   docs/migration.md): how many region messages its writer sent to the
   reader, this one included, and the core sequence number of the
   writer's next message to the reader. */
struct fiv_switch {
    uint64_t region_sent;
    uint32_t core_seq;
    uint32_t flags;      /* 0                                             */
};

/* Over the core after a rank took a region again (fiv_drain.c): its
   slot, generation and registry nonce there; HEARD: the sender found us
   in its region too. */
#define FIV_OFFER_HEARD 1u
struct fiv_offer {
    int16_t slot;
    uint16_t flags;
    uint32_t generation;
    uint32_t nonce[2];
};

/* A sender's first region message to us (fiv_intro.c): who it is, and a
   MAC of that under our key, which only a holder of our name has. */
struct fiv_intro {
    int16_t slot;
    uint16_t pad;
    uint32_t generation;
    uint32_t nonce[2];
    uint64_t mac;
};

#define FIV_ADDR_LEN sizeof(struct fiv_addr)
_Static_assert(sizeof(struct fiv_addr) == 64, "names are 64 bytes");

/* ---- configuration (fi_param_define'd: FI_IVSHM_*) ---- */
struct fiv_config {
    char *region;        /* region file / BAR resource2                   */
    char *socket;        /* ivshmem-server socket                         */
    char *uio_dev, *bar0;
    int position;        /* guest's IVPosition (-1)                       */
    char *device_env;    /* a guest's file of the device's paths, read at
                            start without a region and at each rejoin
                            (FIV_GUEST_ENV unless FI_IVSHM_DEVICE_ENV)     */
    char *core;          /* core provider name(s), "none" = no delegation */
    int report;          /* FI_IVSHM_REPORT: one counter line at exit     */
    int spin_us;         /* spin before blocking in sread/cntr wait       */
    /* What one peer may make us hold (docs/provider.md, "Caps per
       peer"): past a cap its path fails as a broken network would. */
    size_t peer_answer_bytes; /* answers we copied, not yet sent         */
    size_t peer_queue;        /* messages queued for it (sends, answers) */
    size_t peer_unexp_bytes;  /* its messages no receive has taken yet   */
    int drain_ms;        /* FI_IVSHM_DRAIN_MS: a drain's deadline         */
    uint32_t test_slow;  /* FIV_TEST_SLOW_REGION=N, tests only: the region
                            is polled in every Nth progress call, the core
                            in the others (fiv_drain_test: core messages
                            arrive while region ones wait)                 */
    uint64_t test_lose;  /* FIV_TEST_LOSE=N, tests only: the Nth region
                            message to each peer is counted, not sent      */
};
extern struct fiv_config fiv_cfg;
extern struct fi_provider fiv_prov;

/* ---- objects ----

   Lifetimes (docs/provider.md, "Lifetimes"). A remote request is checked
   when each of its fragments is handled, never only at its first one:
   no raw pointer into the application's memory (a window, a receive
   buffer) or into one of our records (fiv_mr, fiv_rx, fiv_unexp)
   survives a return to the application unless the record is pinned.
   - A registration is named by its key: a WRITE's continuations and a
     large READ's answer fragments look the key up again, with bounds
     and access, for every fragment (fiv_asm.key/addr, fiv_op_req.mr_*),
     so fi_close(mr) ends them (the write is refused, the answer's path
     to that peer fails).
   - A receive that a sender's message fills is pinned by that assembly
     (fiv_rx.pending); what takes the receive from the application
     (fi_cancel) or ends the sender (fi_av_remove, a failure, closing the
     endpoint) first cuts the assemblies off: what still arrives is
     discarded (ASM_DISCARD) and our affected operation completes with
     an error.
   - An unexpected message still arriving is the assembly's; FI_DISCARD
     of it cuts the assembly off the same way before freeing it.
   - A triggered operation (fiv_trig) points at its endpoint and sits on
     its counter's list: the counter does not close while it waits
     (-FI_EBUSY), closing the endpoint takes its own off every list
     (fiv_trigger_drop), and an endpoint does not close under an open
     alias (fiv_ep.aliases). */

struct fiv_fabric {
    struct fid_fabric fab;
    uint32_t api_version;
};

struct fiv_mr;

struct fiv_domain {
    struct fid_domain dom;
    struct fiv_fabric *fab;
    uint32_t api_version;
    int mr_mode;          /* the FI_MR_* bits we answered with            */
    bool locking;         /* all but FI_THREAD_DOMAIN: one mutex          */
    pthread_mutex_t lock;
    bool auto_progress;
    pthread_t progress_thread;
    volatile bool stop;
    struct fiv_mr **mrs;  /* registered regions, by key order (sorted)    */
    size_t nmrs, capmrs;
    uint64_t next_key;
    struct fiv_ep **eps;  /* open endpoints, for auto progress            */
    size_t neps, capeps;
    struct fiv_cntr **cntrs; /* open counters: a triggered operation names
                                one, found here, never read through the
                                application's pointer                   */
    size_t ncntrs, capcntrs;
    int refs;             /* open children (fiv_domain_ref)               */
};

struct fiv_mr {
    struct fid_mr mr;
    struct fiv_domain *dom;
    uint8_t *base;        /* first byte of the region                     */
    size_t len;
    uint64_t access;
    uint64_t offset;      /* without FI_MR_VIRT_ADDR: address of base     */
    struct fiv_cntr *rma_cntr; /* FI_RMA_EVENT: counts remote accesses   */
};

/* One completion, kept in the widest form until read. */
/* A field added here must also be written by fiv_msg.c's finish_rx,
   which fills a claimed entry field by field on the receive fast path. */
struct fiv_cqe {
    void *context;
    uint64_t flags;
    size_t len;
    void *buf;
    uint64_t data;
    uint64_t tag;
    fi_addr_t src;
    bool core;            /* a core peer's remote write (fiv_cq.core_writes) */
    /* an error entry's (fiv_cq.errs): not read in the ring, so a
       completion written there in place may leave them unwritten */
    int err;              /* positive FI_E* code, 0 = success             */
    size_t olen;
};

struct fiv_cq {
    struct fid_cq cq;
    struct fiv_domain *dom;
    enum fi_cq_format format;
    struct fiv_cqe *ring; /* grows: completions are never refused         */
    size_t cap, head, count;
    /* `size`: the application's (FIV_CQ_SIZE when 0). A remote write
       with CQ data, the one entry a peer adds without a receive of
       ours, waits unread in its writer's ring while `count` is at
       `size` (fiv_cq_full; fiv_progress.c), so no cap is shared between
       region peers. `core_writes`: such entries a core peer's write
       added; the core path's messages cannot wait where they lie, so
       they are refused past max(size, FIV_CQ_SIZE) (fiv_rma.c), counted
       apart from the region's so that a region co-tenant's writes never
       fill a core peer's share. */
    size_t core_writes, size;
    struct fiv_cqe *errs;
    size_t errcap, errhead, errcount;
    struct fiv_ep **eps;  /* endpoints that report here: progress them    */
    size_t neps;
    int refs;
    bool signaled;        /* fi_cq_signal: a blocking read returns        */
};

/* A triggered operation waiting for its counter (fiv_trigger.c): on the
   counter's list, by threshold, until the counter reaches it; then on
   its endpoint's ready list until that endpoint's next progress starts
   it (counters are counted in layers below the sends). */
struct fiv_trig {
    struct fiv_trig *next;
    struct fiv_ep *ep;
    uint64_t threshold;
    struct fiv_op_req *req; /* built whole when posted                   */
};

struct fiv_cntr {
    struct fid_cntr cntr;
    struct fiv_domain *dom;
    uint64_t val, err;    /* updated under the domain's lock (or the
                             application's serialization)                 */
    /* the lowest threshold on `trig`, UINT64_MAX with none: whether a
       count starts anything (fiv_cntr_reached) */
    uint64_t trig_at;
    struct fiv_trig *trig; /* waiting on this counter, lowest first        */
    struct fiv_ep **eps;
    size_t neps;
    int refs;
};

struct fiv_av_entry {
    struct fiv_addr addr;
    bool used;
    uint32_t inserts;     /* a name inserted again gets this entry back
                             (fiv_av.c); fi_av_remove undoes one insert */
};

struct fiv_av {
    struct fid_av av;
    struct fiv_domain *dom;
    enum fi_av_type type;
    struct fiv_av_entry *entries;
    size_t count, cap;
    struct fiv_ep **eps;
    size_t neps;
    int refs;
};

struct fiv_eq {
    struct fid_eq eq;
    struct fiv_fabric *fab;
};

/* A receive the application posted. */
struct fiv_rx {
    struct fiv_rx *next;
    void *context;
    struct iovec iov[FIV_IOV_LIMIT];
    size_t iov_count;
    size_t total;         /* sum of iov lengths                            */
    fi_addr_t src;        /* FI_ADDR_UNSPEC = any                          */
    uint64_t tag, ignore;
    uint64_t flags;       /* FI_COMPLETION, FI_MULTI_RECV, FI_TAGGED...    */
    size_t multi_used;    /* FI_MULTI_RECV: bytes handed out               */
    int pending;          /* FI_MULTI_RECV: messages still being filled,
                             each pins it (fiv_rx_cut ends that)           */
    bool retired;         /* FI_MULTI_RECV: no more messages go in         */
};

/* A message that arrived before its receive (copied out of the region). */
struct fiv_unexp {
    struct fiv_unexp *next;
    fi_addr_t src;
    uint64_t tag, data;
    uint32_t flags;       /* FIV_F_*                                      */
    size_t len, got;      /* total, received so far                       */
    uint8_t *buf;
    size_t charged;       /* counted in its sender's unexp_bytes          */
    void *claim;          /* FI_CLAIM: the context that claimed it        */
    bool claimed;
    struct fiv_rx *waiting; /* a receive matched while still arriving      */
};

/* What a sender's next continuation fragments belong to. */
enum fiv_asm_kind { ASM_NONE, ASM_RECV, ASM_UNEXP, ASM_WRITE, ASM_READ_RESP,
                    ASM_DISCARD };
struct fiv_asm {
    enum fiv_asm_kind kind;
    size_t total, got;
    struct fiv_rx *rx;        /* ASM_RECV: pinned (rx->pending if multi)  */
    struct fiv_unexp *ux;     /* ASM_UNEXP: freed only through the cut    */
    size_t rx_off;            /* ASM_RECV: where in rx's buffers          */
    uint8_t *dst;             /* ASM_RECV, multi-receive: rx's slice      */
    uint64_t tag, data;
    uint32_t flags;
    size_t olen;              /* full length (truncation)                 */
    struct fiv_op_req *req;   /* ASM_READ_RESP: ours, off the wait list   */
    int32_t status;           /* ASM_READ_RESP: the answer's, from its
                                 first fragment: the read ends with it,
                                 and a refusal's bytes are not stored    */
    uint64_t key, addr;       /* ASM_WRITE: looked up again per fragment  */
    bool refused;             /* ASM_WRITE: a fragment found no MR        */
    uint64_t write_id;        /* ASM_WRITE with FIV_F_ACK                 */
};

/* An operation the initiator waits on (RMA/atomic answer), or a send
   still going out. */
enum fiv_req_kind { REQ_SEND, REQ_WRITE, REQ_READ, REQ_ATOMIC, REQ_REPLY };
struct fiv_op_req {
    struct fiv_op_req *next;      /* per-peer send queue / wait list      */
    enum fiv_req_kind kind;
    uint64_t id;
    fi_addr_t peer;
    void *context;
    uint64_t flags;               /* completion flags to report (FI_SEND..)*/
    bool complete_ev;             /* write a CQ entry                      */
    /* what goes out: header (op word + header bytes), then the payload
       from iov (the application's, or `own` for injected/answer data) */
    uint32_t op;
    uint8_t hdr[48];
    size_t hlen;
    struct iovec iov[FIV_IOV_LIMIT];
    size_t iov_count;
    size_t total, sent;           /* payload bytes                         */
    uint8_t *own;                 /* our copy (inject, answers)            */
    /* REQ_REPLY of a large READ: the payload is the registration's bytes,
       looked up by key as each fragment leaves (iov unused) */
    bool from_mr;
    uint64_t mr_key, mr_addr;
    size_t charged;               /* REQ_REPLY: in the peer's answer_bytes */
    bool started;                 /* first fragment is out                 */
    /* where an answer lands (READ: iov; ATOMIC fetch: result)             */
    struct iovec res[FIV_IOV_LIMIT];
    size_t res_count;
    size_t res_got;
    bool awaits_answer;
    int status;
};

/* Per-AV-entry state of one endpoint. */
enum fiv_path { PATH_UNRESOLVED, PATH_SELF, PATH_REGION, PATH_CORE,
                PATH_NONE };
struct fiv_peer {
    enum fiv_path path;
    int slot;
    uint32_t generation;
    uint8_t key[FIV_KEY_LEN];          /* from its name: what we MAC with   */
    bool introduced;                   /* region: our INTRO went out        */
    uint64_t nonce;                    /* its registry name's random part   */
    fi_addr_t core_addr;
    struct fiv_op_req *txq, *txq_tail; /* sends waiting for room           */
    struct fiv_asm as;                 /* what its continuations fill       */
    bool dead;
    bool leaving;                      /* its slot seen free: failed at the
                                          next look (fiv_probe_tick)       */
    bool violated;                     /* broke our protocol (fiv_deliver) */
    const char *over;                  /* with violated: the cap it passed  */
    /* what it makes us hold, against fiv_cfg.peer_* */
    size_t answer_bytes, queued, unexp_bytes;
    bool awaited;                      /* a receive waits on it (transient) */
    /* core path: our order of its messages, whatever order the core
       completes them in (fiv_delegate.c) */
    uint32_t core_tx_seq, core_rx_seq;
    struct fiv_held *held;             /* arrived ahead of their turn       */
    /* a region pair moving to the core (fiv_drain.c, docs/migration.md) */
    bool sw_core;                      /* its core address is in our core AV */
    bool sw_want;                      /* our SWITCH is to go out           */
    bool sw_sent;                      /* it went: nothing more on the region */
    bool sw_rx;                        /* its SWITCH came: its core messages
                                          are delivered, its region ones are
                                          a violation                      */
    bool sw_pause;                     /* from sw_want until the pair moved:
                                          new sends queue (only a message
                                          partly out goes on)              */
    uint64_t sw_end_ns;                /* the switch's deadline: ours, the
                                          drain's; an answer's, its own    */
    /* a core pair moving back to a region (fiv_drain.c) */
    bool of_new, bk_new;               /* an OFFER / a core BACK to handle */
    struct fiv_offer of;               /* its last OFFER, copied           */
    struct fiv_switch bk;              /* its core BACK, copied            */
    uint32_t bk_seq;                   /* the BACK's core sequence number  */
    bool bk_end;                       /* its core BACK came: no more core */
    bool rg_ok;                        /* its OFFER checked: it is in our
                                          region at rg_slot, rg_gen        */
    int rg_slot;
    uint32_t rg_gen;
    bool rg_told;                      /* our OFFER(HEARD) went            */
    bool rg_heard;                     /* it found us in its region        */
    bool bk_want, bk_sent;             /* our core BACK: to go, gone       */
    bool bk_rx;                        /* its core BACK handled: we hear it
                                          on the region                    */
    bool bk_mark;                      /* our region BACK is still to go   */
    bool of_due;                       /* our OFFER is still to go         */
    uint64_t bk_end_ns;                /* the back switch's deadline       */
};

/* Does the core path deliver `p`'s messages (fiv_delegate.c)? Whose
   source it names (attributed to the peer), and whose turn has come. */
static inline bool fiv_core_hears(const struct fiv_peer *p)
{
    return p->path == PATH_CORE || p->sw_core;
}
static inline bool fiv_core_delivers(const struct fiv_peer *p)
{
    return (p->path == PATH_CORE || p->sw_rx) && !p->bk_end;
}

/* Per region slot: the message counts of our pair with its holder, each
   of the generation it counts for (fiv_probe.c). */
struct fiv_pair {
    uint32_t tx_gen, rx_gen;
    uint64_t tx, rx;
    uint64_t rx_seen;          /* rx at the last look                       */
    uint64_t heard_ns;         /* when rx last moved                        */
    uint64_t probed_ns;        /* when we last asked                        */
    uint64_t probe_gap_ns;     /* how long until we ask again               */
};

/* What counts toward a pair's counts: everything but probes and their
   answers. */
static inline bool fiv_pair_counts(uint32_t op)
{
    op &= FIV_OP_MASK;
    return op != FIV_OP_PROBE && op != FIV_OP_PROBE_ACK;
}

/* Peers we hear without an AV entry (introduced, fiv_intro.c) have the
   ids FIV_HIDDEN + slot; the application sees FI_ADDR_NOTAVAIL for them. */
#define FIV_HIDDEN ((fi_addr_t)1 << 48)

/* The core provider an endpoint delegates to (fiv_delegate.c opens it,
   fiv_send.c sends through it). */
/* One core message stays below ofi_rxm's eager size (16 KiB): a larger
   one goes by rendezvous and may complete after the eager messages that
   follow it, and our fragments must complete in order. */
#define CORE_BUF 8192
#define CORE_RX 64
#define CORE_TX 64
/* In front of every message: the operation word and the sender's
   sequence number for us. A core may complete messages out of order
   (ofi_rxm's rendezvous of larger ones), and our fragments need each
   pair's order: the receiver restores it. */
#define CORE_WORD 8
struct core_buf {
    struct fi_context2 ctx;  /* first: the completion names the buffer */
    uint8_t *mem;
    struct fid_mr *mr;
    void *desc;
    bool rx, busy;
    struct core_buf *next_free;
};

struct fiv_core {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_ep *ep;
    struct fid_av *av;
    struct fid_cq *cq;
    struct core_buf bufs[CORE_RX + CORE_TX];
    struct core_buf *free_tx;
    uint8_t name[FIV_CORE_ADDR_MAX];
    size_t namelen;
    fi_addr_t *owner;        /* core fi_addr -> our AV index              */
    size_t nowner;
    uint64_t dropped;
};


struct fiv_ep {
    struct fid_ep ep;
    struct fiv_domain *dom;
    struct fiv_av *av;
    struct fiv_cq *tx_cq, *rx_cq;
    uint64_t tx_cq_flags, rx_cq_flags;   /* FI_SELECTIVE_COMPLETION bits    */
    struct fiv_cntr *cntr_send, *cntr_recv, *cntr_read, *cntr_write,
        *cntr_rread, *cntr_rwrite;
    uint64_t caps, tx_op_flags, rx_op_flags;
    size_t min_multi_recv;
    size_t max_msg;                      /* FIV_MAX_MSG, or a datagram's   */
    bool dgram;                          /* FI_EP_DGRAM: FIV_DGRAM_CAPS    */
    bool enabled;
    /* the region */
    ivshm *h;
    int self_slot;
    uint32_t self_gen;
    uint64_t nonce;
    size_t frag;                         /* payload bytes of one slot      */
    int max_peers;
    uint8_t key[FIV_KEY_LEN];            /* our name's secret              */
    fi_addr_t *by_slot;                  /* slot -> peer id, or NOTAVAIL   */
    uint32_t *gen_by_slot;
    struct fiv_peer *hidden;             /* by slot: introduced, no AV entry */
    struct fiv_pair *pairs;              /* by slot                        */
    uint64_t unheard;                    /* messages of no admitted sender */
    uint64_t last_check_ns;
    /* the core provider (fiv_delegate.c) */
    struct fiv_core *core;
    /* peers, indexed by AV index */
    struct fiv_peer *peers;
    size_t npeers;
    struct fiv_peer self_peer_dummy;
    /* receives */
    struct fiv_rx *rx_cache;             /* freed receives, for reuse       */
    size_t rx_cached;
    struct fiv_rx *trecv, *trecv_tail;   /* posted tagged                   */
    struct fiv_rx *recv, *recv_tail;     /* posted untagged                 */
    struct fiv_unexp *tunexp, *tunexp_tail;
    struct fiv_unexp *unexp, *unexp_tail;
    /* sends in flight with a pending queue, answers awaited */
    struct fiv_op_req *waiting;          /* RMA/atomics awaiting an answer  */
    uint64_t next_id;
    int txq_peers;                       /* peers with queued sends, and one
                                            more while `trig_ready` holds
                                            any: progress looks at one
                                            count for both (fiv_trigger.c) */
    /* triggered operations (fiv_trigger.c): how many of ours wait on
       counters or to start, and those whose counter reached their
       threshold, in that order, for our next progress to start */
    size_t trig_count;
    struct fiv_trig *trig_ready, *trig_ready_tail;
    int aliases;                         /* open alias endpoints (fiv_alias.c):
                                            the endpoint does not close
                                            under them                     */
    /* the one report line */
    uint64_t sent, received, delegated;
    /* a drain the host asked for (fiv_drain.c): the request served
       (0: none), its deadline and status, pairs still switching */
    uint32_t drain_req;
    uint64_t drain_end_ns;
    int32_t drain_status;
    uint32_t drain_turn;
    int switching;
    uint64_t reattach_ns;                /* after a drain: look again then */
    uint64_t drained, switched, rejoined; /* for the report line           */
#define FIV_PHASES 8
    /* sent / delegated at each drain and rejoin: the report's phases */
    uint64_t phase_sent[FIV_PHASES], phase_deleg[FIV_PHASES];
    int nphase;
    bool reported;
    uint32_t idle_calls;
    uint32_t core_turn, slow_turn;
    bool core_rx;                        /* delivering a core message      */
    bool writes_wait;                    /* a remote write waits for room in
                                            the CQ where it lies: the general
                                            path only (fiv_progress.c)      */
};


/* The pair of `slot`'s holder at `gen` as a sender counts it (its counts
   start again with a new holder). */
static inline struct fiv_pair *fiv_tx_pair(struct fiv_ep *ep, int slot,
                                           uint32_t gen)
{
    struct fiv_pair *pr = &ep->pairs[slot];
    if (pr->tx_gen != gen) {
        pr->tx_gen = gen;
        pr->tx = 0;
    }
    return pr;
}

/* FIV_TEST_LOSE: this message is counted as sent, and dropped. */
static inline bool fiv_lost_on_purpose(const struct fiv_pair *pr, uint32_t op)
{
    return fiv_cfg.test_lose && fiv_pair_counts(op) &&
           pr->tx + 1 == fiv_cfg.test_lose;
}

/* ---- the "not supported" entries (the core exports none) ---- */
static inline int fiv_no_bind(struct fid *fid, struct fid *bfid, uint64_t f)
{ (void)fid; (void)bfid; (void)f; return -FI_ENOSYS; }
static inline int fiv_no_control(struct fid *fid, int cmd, void *arg)
{ (void)fid; (void)cmd; (void)arg; return -FI_ENOSYS; }
static inline int fiv_no_ops_open(struct fid *fid, const char *name,
                                  uint64_t flags, void **ops, void *context)
{ (void)fid; (void)name; (void)flags; (void)ops; (void)context;
  return -FI_ENOSYS; }
static inline int fiv_no_passive_ep(struct fid_fabric *f, struct fi_info *i,
                                    struct fid_pep **pep, void *c)
{ (void)f; (void)i; (void)pep; (void)c; return -FI_ENOSYS; }
static inline int fiv_no_wait_open(struct fid_fabric *f,
                                   struct fi_wait_attr *a, struct fid_wait **w)
{ (void)f; (void)a; (void)w; return -FI_ENOSYS; }
static inline int fiv_no_trywait(struct fid_fabric *f, struct fid **fids,
                                 int count)
{ (void)f; (void)fids; (void)count; return 0; }

/* ---- locking ---- */
static inline void fiv_lock(struct fiv_domain *d)
{
    if (d->locking)
        pthread_mutex_lock(&d->lock);
}
static inline void fiv_unlock(struct fiv_domain *d)
{
    if (d->locking)
        pthread_mutex_unlock(&d->lock);
}
/* A child of the domain (endpoint, CQ, counter, AV) opened (+1) or
   closed (-1): the domain does not close while one is open, nor while
   a registration is (fi_domain(3): -FI_EBUSY). */
static inline void fiv_domain_ref(struct fiv_domain *d, int delta)
{
    fiv_lock(d);
    d->refs += delta;
    fiv_unlock(d);
}

/* ---- counters: counted as completions are written (fiv_complete.c,
   whose header has the success count: it may start triggered
   operations), read by the counter object (fiv_cntr.c) ---- */
static inline void fiv_cntr_inc_err(struct fiv_cntr *c)
{
    if (c)
        __atomic_add_fetch(&c->err, 1, __ATOMIC_RELEASE);
}

/* ---- functions by file, from the bottom layer up (docs/ARCHITECTURE.md):
   a file calls only its own and those of files listed before it ---- */
/* fiv_util.c */
uint64_t fiv_now_ns(void);
/* The deadline of a wait of timeout_ms (< 0: none), in fiv_now_ns time. */
uint64_t fiv_deadline(int timeout_ms);
/* Text for an error code (CQ and EQ strerror), in buf if given. */
const char *fiv_strerror(int prov_errno, char *buf, size_t len);
/* fiv_report.c */
void fiv_report(struct fiv_ep *ep);
void fiv_register_ep(struct fiv_ep *ep);
void fiv_unregister_ep(struct fiv_ep *ep);
void fiv_cleanup(void);
/* fiv_complete.c: completions into the endpoint's CQs and counters */
/* fiv_cntr_inc, fiv_cntr_reached: fiv_complete.h */
int fiv_cq_push(struct fiv_cq *cq, const struct fiv_cqe *e);
/* fiv_cq_grow, fiv_cq_claim, fiv_complete_sent: fiv_complete.h */
/* No room for a remote write's entry: the write waits in its ring. */
static inline bool fiv_cq_full(const struct fiv_cq *cq)
{
    return cq && cq->count >= cq->size;
}
int fiv_cq_push_err(struct fiv_cq *cq, const struct fiv_cqe *e);
void fiv_complete_tx(struct fiv_ep *ep, void *context, uint64_t flags,
                     bool want, int err);
void fiv_complete_rx(struct fiv_ep *ep, const struct fiv_cqe *e, bool want);
/* fiv_tables.c */
struct fiv_peer *fiv_peer(struct fiv_ep *ep, fi_addr_t a);
/* Every peer of ours: AV entries, then hidden ones (id in *id). */
struct fiv_peer *fiv_peer_next(struct fiv_ep *ep, fi_addr_t *id);
const struct fiv_addr *fiv_av_addr(struct fiv_av *av, fi_addr_t a);
void fiv_av_add_ep(struct fiv_av *av, struct fiv_ep *ep);
void fiv_av_del_ep(struct fiv_av *av, struct fiv_ep *ep);
void fiv_domain_add_ep(struct fiv_domain *d, struct fiv_ep *ep);
void fiv_domain_del_ep(struct fiv_domain *d, struct fiv_ep *ep);
/* The domain's open counters, under its lock (false: no memory). */
bool fiv_domain_add_cntr(struct fiv_domain *d, struct fiv_cntr *c);
void fiv_domain_del_cntr(struct fiv_domain *d, struct fiv_cntr *c);
/* The open counter of d that `f` names, or NULL: found by comparing
   pointers, `f` never read. */
struct fiv_cntr *fiv_domain_cntr(struct fiv_domain *d, const struct fid_cntr *f);
/* fiv_mr.c */
int fiv_mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access,
               uint64_t offset, uint64_t requested_key, uint64_t flags,
               struct fid_mr **mr, void *context);
int fiv_mr_regv(struct fid *fid, const struct iovec *iov, size_t count,
                uint64_t access, uint64_t offset, uint64_t requested_key,
                uint64_t flags, struct fid_mr **mr, void *context);
int fiv_mr_regattr(struct fid *fid, const struct fi_mr_attr *attr,
                   uint64_t flags, struct fid_mr **mr);
/* Whether bytes [addr, addr+len) lie in a region registered under `key`
   with `access` (never beyond what was registered): then *at is the
   first of them, which a 0-byte access of an empty registration (NULL,
   0 bytes) finds NULL and must not touch. */
bool fiv_mr_target(struct fiv_domain *d, uint64_t key, uint64_t addr,
                   size_t len, uint64_t access, uint8_t **at,
                   struct fiv_mr **mr);
/* fiv_send.c: one message out on a peer's path */
/* One region message to `slot` (its holder at `gen`), with the wire
   check in its tag and counted for the pair (probes excepted): 0,
   -EAGAIN, or a libivshm error. */
int fiv_region_send(struct fiv_ep *ep, int slot, uint32_t gen, uint32_t op,
                    const void *hdr, size_t hlen, const void *buf, size_t len);
size_t fiv_core_frag(struct fiv_ep *ep);
ssize_t fiv_core_send(struct fiv_ep *ep, struct fiv_peer *p, uint32_t op,
                      const void *hdr, size_t hlen, const void *buf,
                      size_t len);
/* fiv_intro.c: introductions, peers without an AV entry */
void fiv_new_key(uint8_t key[FIV_KEY_LEN]);
/* The MAC of an introduction under `key`. */
uint64_t fiv_intro_mac(const uint8_t key[FIV_KEY_LEN],
                       const struct fiv_intro *in);
int fiv_introduce(struct fiv_ep *ep, struct fiv_peer *p);
/* The AV entry `index` names the hidden peer of its slot: it becomes that
   peer, with what was under way. */
bool fiv_intro_adopt(struct fiv_ep *ep, size_t index, const struct fiv_addr *a);
/* fiv_tx.c: sending to one peer, either path, with a queue */
int fiv_tx_start(struct fiv_ep *ep, struct fiv_op_req *r);
/* fiv_tx_err, fiv_tx_small: fiv_tx.h */
int fiv_tx_drain(struct fiv_ep *ep, struct fiv_peer *p);
/* The request at the front of p's queue, taken off it. */
struct fiv_op_req *fiv_tx_dequeue(struct fiv_ep *ep, struct fiv_peer *p);
void fiv_tx_done(struct fiv_ep *ep, struct fiv_op_req *r, int err);
struct fiv_op_req *fiv_req_new(void);
int fiv_req_payload(struct fiv_op_req *r, const struct iovec *iov,
                    size_t count, bool copy);
void fiv_req_free(struct fiv_op_req *r);
void fiv_tx_fail_peer(struct fiv_ep *ep, struct fiv_peer *peer, int err);
/* Copy `len` bytes into iov at byte offset `off`, never past its end. */
size_t fiv_iov_write(const struct iovec *iov, size_t n, size_t off,
                     const void *src, size_t len);
size_t fiv_iov_read(const struct iovec *iov, size_t n, size_t off, void *dst,
                    size_t len);
/* fiv_trigger.c: triggered operations (fi_trigger(3)), under the
   domain's serialization */
/* r, built whole, to start once the counter its context names
   (struct fi_triggered_context, read once) reaches the threshold there:
   at once if it has; 0, or an error with r freed. */
int fiv_trigger_post(struct fiv_ep *ep, struct fiv_op_req *r);
/* Start what ep's counters made ready (progress). */
void fiv_trigger_start(struct fiv_ep *ep);
/* End every triggered operation of ep that has not started: each
   completes with `err` (closing the endpoint: FI_ECANCELED). */
void fiv_trigger_drop(struct fiv_ep *ep, int err);
/* fi_cancel of a triggered operation not started: 0 (it completes with
   FI_ECANCELED), or -FI_ENOENT. */
int fiv_trigger_cancel(struct fiv_ep *ep, void *context);
/* fiv_rma.c: RMA and atomics, both sides */
extern struct fi_ops_rma fiv_rma_ops;
extern struct fi_ops_atomic fiv_atomic_ops;
extern struct fi_ops_rma fiv_no_rma_ops;       /* a datagram endpoint's */
extern struct fi_ops_atomic fiv_no_atomic_ops; /* a datagram endpoint's */
void fiv_rma_target(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                    uint32_t op, const uint8_t *p, size_t n);
void fiv_rma_answer(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                    uint32_t op, const uint8_t *p, size_t n);
void fiv_rma_fail_peer(struct fiv_ep *ep, fi_addr_t a, int err);
int fiv_query_atomic(struct fid_domain *domain, enum fi_datatype datatype,
                     enum fi_op op, struct fi_atomic_attr *attr,
                     uint64_t flags);
/* fiv_msg.c: MSG and TAGGED, posting and matching */
/* A whole message for the receive at the head of its list, delivered
   without fiv_deliver's cases: 1 taken, 0 not that case (nothing read,
   nothing changed), -1 taken and the sender broke our protocol, -2 it
   failed its wire check. */
int fiv_msg_expected(struct fiv_ep *ep, int src, uint32_t g, uint32_t tag,
                     const uint8_t *data, size_t n);
void fiv_deliver(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                 uint32_t op, const uint8_t *p, size_t n);
void fiv_peer_failed(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     int err);
/* Fail posted receives that wait on `a`: those directed at it, and with
   `wildcard` those of any source too. */
void fiv_fail_receives(struct fiv_ep *ep, fi_addr_t a, bool wildcard, int err);
/* Mark the peers posted receives are directed at (fiv_peer.awaited);
   true if one takes any source. */
bool fiv_mark_awaited(struct fiv_ep *ep);
void fiv_rx_free_all(struct fiv_ep *ep);
/* Cut off every assembly that fills `rx` (fi_cancel): what still arrives
   of those messages is discarded. */
void fiv_rx_cut(struct fiv_ep *ep, struct fiv_rx *rx);
/* The message `peer` is in the middle of fails with `err` (fi_av_remove);
   with err 0 (closing the endpoint) its records are only released. */
void fiv_asm_fail(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                  int err);
void fiv_rx_put(struct fiv_ep *ep, struct fiv_rx *rx);
/* The receive entries of the msg and tagged tables (fiv_msg_ops.c) */
ssize_t fiv_msg_recv(struct fid_ep *e, void *buf, size_t len, void *desc,
                     fi_addr_t src, void *context);
ssize_t fiv_msg_recvv(struct fid_ep *e, const struct iovec *iov, void **desc,
                      size_t count, fi_addr_t src, void *context);
ssize_t fiv_msg_recvmsg(struct fid_ep *e, const struct fi_msg *msg,
                        uint64_t flags);
ssize_t fiv_tagged_recv(struct fid_ep *e, void *buf, size_t len, void *desc,
                        fi_addr_t src, uint64_t tag, uint64_t ignore,
                        void *context);
ssize_t fiv_tagged_recvv(struct fid_ep *e, const struct iovec *iov,
                         void **desc, size_t count, fi_addr_t src,
                         uint64_t tag, uint64_t ignore, void *context);
ssize_t fiv_tagged_recvmsg(struct fid_ep *e, const struct fi_msg_tagged *msg,
                           uint64_t flags);
/* fiv_probe.c: message counts, probes, broken paths */
#define FIV_PROBE_NS 1000000000ull /* silence before we ask            */
#define FIV_PROBE_MAX_NS 8000000000ull /* between unanswered asks, at most */
void fiv_pair_received(struct fiv_ep *ep, int slot, int64_t gen, uint32_t op);
void fiv_probe_receive(struct fiv_ep *ep, int slot, int64_t gen,
                       fi_addr_t a, struct fiv_peer *heard, uint32_t op,
                       const uint8_t *p, size_t n);
void fiv_probe_tick(struct fiv_ep *ep, uint64_t now);
/* The path to a live peer is corrupt (a message lost, garbled, or one it
   never sent): like a failed network, everything that waits on it fails,
   receives of any source included, and nothing more goes either way. */
void fiv_path_broken(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     const char *why);
/* A send to `peer` failed with `err`: a peer gone (FI_EHOSTUNREACH) fails
   what waits on it, any other error breaks the path. */
void fiv_send_failed(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     int err);
/* fiv_delegate.c: the core provider */
int fiv_core_open(struct fiv_ep *ep);
void fiv_core_close(struct fiv_ep *ep);
size_t fiv_core_name(struct fiv_ep *ep, uint8_t *out, size_t cap);
/* Insert a peer's core address for our AV entry `index`. */
int fiv_core_insert(struct fiv_ep *ep, const uint8_t *addr, size_t index,
                    fi_addr_t *out);
void fiv_core_forget(struct fiv_ep *ep, fi_addr_t core_addr);
void fiv_core_release_peer(struct fiv_peer *p);
int fiv_core_progress(struct fiv_ep *ep);
bool fiv_core_active(const struct fiv_ep *ep);
/* Messages handed to the core provider that it has not completed. */
bool fiv_core_sending(const struct fiv_ep *ep);
/* An OFFER or BACK of `peer` over the core, in its order: copied for
   fiv_drain.c's next tick. */
void fiv_core_control(struct fiv_ep *ep, struct fiv_peer *peer, uint32_t op,
                      uint32_t seq, const uint8_t *p, size_t n);
/* Core messages of `peer` held until its turn, delivered now that it
   has come (fiv_core_delivers). */
void fiv_core_release_held(struct fiv_ep *ep, fi_addr_t a,
                           struct fiv_peer *peer);
/* fiv_drain.c: a pair moved from the region to the core and back
   (docs/migration.md); the region attached */
#define FIV_JOB_TAG (UINT64_C(0x46495653) << 32) /* "FIVS" */
/* Attach to the configured region (at open, and again after a drain):
   0, or an error (said on stderr unless `quiet`). */
int fiv_region_attach(struct fiv_ep *ep, bool quiet);
/* a guest's device paths and IVPosition, from what ivshm-bind wrote
   (fiv_util.c): at init, and again after a move (`force`); the file is
   fiv_cfg.device_env, this one by default (a Slurm job's device has a
   file of its own: docs/migration.md) */
#define FIV_GUEST_ENV "/run/ivshm/ivshm.env"
bool fiv_guest_defaults(bool force);
/* Does our region's `slot` hold, at `gen`, the endpoint of `nonce`
   (unless `live`, also its last holder, gone since, while nobody claimed
   it)? One copy of the registry entry answers it all. */
bool fiv_region_holds(struct fiv_ep *ep, int slot, uint32_t gen,
                      uint64_t nonce, bool live);
/* A region BACK from `slot`: the peer's first region message after the
   core. */
void fiv_back_receive(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                      int slot, int64_t gen, const uint8_t *p, size_t n);
/* Every 64th progress call, and every call while pairs switch: a
   request of the host's, our SWITCHes out, the deadline. */
void fiv_drain_tick(struct fiv_ep *ep);
/* A SWITCH from `slot` (its holder at `gen`, < 0: it left since),
   the peer we hear there. */
void fiv_switch_receive(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                        int slot, int64_t gen, const uint8_t *p, size_t n);
/* fiv_progress.c */
void fiv_progress(struct fiv_ep *ep);
void fiv_progress_eps(struct fiv_ep **eps, size_t n);
/* A message to ourselves, off our own queue, to our receive side. */
void fiv_loopback(struct fiv_ep *ep, struct fiv_op_req *r, fi_addr_t self);
/* An INTRO from `slot` (fiv_intro.c): its sender becomes a hidden peer. */
void fiv_intro_receive(struct fiv_ep *ep, int slot, int64_t gen,
                       const uint8_t *p, size_t n);
/* fiv_msg_ops.c: MSG and TAGGED as the application calls them */
extern struct fi_ops_msg fiv_msg_ops;
extern struct fi_ops_tagged fiv_tagged_ops;
extern struct fi_ops_tagged fiv_no_tagged_ops; /* a datagram endpoint's */
/* fiv_alias.c: alias endpoints (fi_ep_alias) */
int fiv_alias_open(struct fiv_ep *ep, const struct fi_alias *alias);
/* fiv_cq.c */
int fiv_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
                struct fid_cq **cq, void *context);
void fiv_cq_add_ep(struct fiv_cq *cq, struct fiv_ep *ep);
void fiv_cq_del_ep(struct fiv_cq *cq, struct fiv_ep *ep);
/* fiv_cntr.c */
int fiv_cntr_open(struct fid_domain *domain, struct fi_cntr_attr *attr,
                  struct fid_cntr **cntr, void *context);
void fiv_cntr_add_ep(struct fiv_cntr *c, struct fiv_ep *ep);
void fiv_cntr_del_ep(struct fiv_cntr *c, struct fiv_ep *ep);
/* fiv_eq.c */
int fiv_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr,
                struct fid_eq **eq, void *context);
/* fiv_getinfo.c */
int fiv_getinfo(uint32_t version, const char *node, const char *service,
                uint64_t flags, const struct fi_info *hints,
                struct fi_info **info);
/* fiv_ep.c */
int fiv_ep_open(struct fid_domain *domain, struct fi_info *info,
                struct fid_ep **ep, void *context);
void fiv_ep_resolve(struct fiv_ep *ep, size_t index);
void fiv_ep_forget(struct fiv_ep *ep, size_t index);
/* fiv_av.c */
int fiv_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
                struct fid_av **av, void *context);
/* fiv_domain.c */
int fiv_domain_open(struct fid_fabric *fabric, struct fi_info *info,
                    struct fid_domain **dom, void *context);
/* fiv_init.c */
int fiv_fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
                    void *context);

static inline size_t fiv_iov_total(const struct iovec *iov, size_t n)
{
    size_t t = 0;
    for (size_t i = 0; i < n; i++)
        t += iov[i].iov_len;
    return t;
}

/* A copy of a message's payload: MPI's small messages (8 and 4 bytes)
   at a constant size, a load and a store where a call to memcpy costs
   some twenty instructions. An empty copy is skipped: a receive of no
   buffer (NULL, 0 bytes, as MPI posts for a zero count) reaches here. */
static inline void fiv_copy_small(void *dst, const void *src, size_t n)
{
    if (n == 8)
        memcpy(dst, src, 8);
    else if (n == 4)
        memcpy(dst, src, 4);
    else if (n)
        memcpy(dst, src, n);
}

#define FIV_WARN(...) FI_WARN(&fiv_prov, FI_LOG_CORE, __VA_ARGS__)
#define FIV_INFO(...) FI_INFO(&fiv_prov, FI_LOG_CORE, __VA_ARGS__)

#endif

/*
 * Progress (called from opal_progress once the BML has registered us):
 *   1. deliver what arrived for us (our receive queue and fast channels,
 *      any sender; only trusted senders reach the PML) to the PML's
 *      active-message callbacks (at most IVSHMEM_RECV_BATCH per call),
 *   2. retry fragments waiting for ring space,
 *   3. make the owed completion callbacks,
 *   4. when idle: every ~100 ms reap dead peers (a peer gone without its
 *      goodbye is a fatal error for the job, never a hang), and after
 *      spin_us of idleness block on the doorbell for one bounded slice
 *      (senders ring a sleeping receiver themselves).
 * Every step is bounded: progress never blocks longer than block_us.
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_* */
#include "btl_ivshmem.h"
#include "btl_ivshmem_frag.h"

#include "opal/runtime/opal_progress.h"
#include "opal/sys/atomic.h"
#include "opal/util/output.h"
#include "opal/util/proc.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

/* Clock reads are spaced out: one every this many idle polls. */
#define IDLE_POLLS_PER_TICK 64
/* ...and one every this many busy calls, for housekeeping. */
#define BUSY_CALLS_PER_TICK 1024
/* A tick that comes later than this after the previous one means the
   caller does other work between polls (see idle_tick). */
#define IDLE_TICK_GAP_NS 100000ull

#define VERBOSE(lvl, ...)                                                     \
    opal_output_verbose((lvl), opal_btl_base_framework.framework_output,      \
                        __VA_ARGS__)

void mca_btl_ivshmem_trust(int slot, uint32_t gen)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!c->trusted[slot])
        c->active[c->nactive++] = slot;
    c->trusted[slot] = (uint64_t)gen + 1;
    /* heard on every path now: a fast channel it asked for meanwhile is
       read from here on, after what it queued (ivshm.h) */
    (void)ivshm_listen(c->h, slot, gen);
    if (c->stashed[slot])
        c->stash_ready = true; /* what it sent before is delivered first */
}

void mca_btl_ivshmem_distrust(int slot)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!c->trusted[slot])
        return;
    c->trusted[slot] = 0;
    (void)ivshm_listen(c->h, slot, 0);
    for (int i = 0; i < c->nactive; i++)
        if (c->active[i] == slot) {
            c->active[i] = c->active[--c->nactive];
            break;
        }
}

/*
 * ob1 adds a peer on another node lazily, when it first sends to it, so
 * a rank of our job may write to us before ob1 ever adds it here. Such a
 * rank is admitted like add_procs would, when its first message arrives:
 * the registry entry only says which rank to look up (our jobid, a vpid
 * below the job size), the modex of that rank must name this very slot
 * and generation; also after the rank left, if nobody claimed its slot
 * since (its messages are still delivered, ivshm_peer_last). Spawned
 * and connected jobs are not admitted here: ob1
 * adds them through add_procs when the communicator is built; what they
 * send before that is stashed (bounded). Each failed (slot, generation)
 * is looked up once.
 */
enum ivshmem_untrusted mca_btl_ivshmem_admit_sender(int s, uint32_t gen)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!c->h || c->finalizing || s == c->self_slot ||
        c->rejected[s] == (uint64_t)gen + 1)
        return IVSHMEM_IGNORE;
    ivshm_peer_info info;
    OPAL_THREAD_LOCK(&c->lock);
    /* a rank that left since its message still has it delivered */
    int rc = ivshm_peer_last(c->h, s, &info);
    OPAL_THREAD_UNLOCK(&c->lock);
    if (rc < 0 || info.generation != gen)
        return IVSHMEM_IGNORE; /* replaced since the message */
    if (info.job_id != c->job_id)
        return info.job_id >> 32 == IVSHMEM_JOB_TAG ? IVSHMEM_STASH
                                                    : IVSHMEM_IGNORE;
    if (0 == c->job_size || info.rank == c->vpid || info.rank >= c->job_size)
        return IVSHMEM_IGNORE;
    mca_btl_ivshmem_endpoint_t *ep = c->by_slot[s];
    if (ep && ep->generation == gen)
        return IVSHMEM_IGNORE; /* ours already, distrusted on purpose */
    opal_process_name_t name = OPAL_PROC_MY_NAME;
    name.vpid = info.rank;
    uint32_t found = 0;
    if (mca_btl_ivshmem_locate_name(name, &found, rc == 1) == s &&
        found == gen) {
        OPAL_THREAD_LOCK(&c->lock);
        mca_btl_ivshmem_trust(s, gen);
        OPAL_THREAD_UNLOCK(&c->lock);
        VERBOSE(10, "btl_ivshmem: admitted rank %u of our job in slot %d",
                info.rank, s);
        return IVSHMEM_ADMITTED;
    }
    c->rejected[s] = (uint64_t)gen + 1;
    c->counters.rejected++;
    VERBOSE(10, "btl_ivshmem: slot %d claims rank %u of our job but does "
                "not match its modex: ignored", s, info.rank);
    return IVSHMEM_IGNORE;
}

/* Who wrote a message we just took, as far as the registry tells after
   the fact. */
enum sender_state {
    SENDER_CURRENT,   /* live at the generation we trust: deliver          */
    SENDER_DEPARTED,  /* left or died at the generation we trust: deliver */
    SENDER_REPLACED,  /* the slot holds another incarnation: drop all      */
    SENDER_UNTRUSTED, /* not (yet) trusted: admit, stash or ignore         */
};

/* The generation of the incarnation whose messages libivshm hands out
   from `slot`: the live one, or the one that left or died if nobody has
   claimed the slot since (*gone), else -1. Generations only grow, and
   libivshm hands out only messages of the generation the registry held
   when it took them: a message taken before this call is of that
   incarnation if the generation is the one we trust. An eager MPI_Send
   completes before the receiver reads it, so a sender may finalize and
   leave first; what it published is still delivered (docs/btl.md,
   "Failures"). With `lock`. */
static int64_t sender_generation(int slot, bool *gone)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int64_t gen = ivshm_peer_generation(c->h, slot);
    *gone = false;
    if (OPAL_LIKELY(gen >= 0))
        return gen;
    ivshm_peer_info info;
    if (ivshm_peer_last(c->h, slot, &info) != 1)
        return -1;
    *gone = true;
    return info.generation;
}

/* A control message of a trusted sender. BYE is the last message a
   finalizing rank sends us: we stop delivering its messages. */
static void handle_control(int src, uint32_t tag)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    mca_btl_ivshmem_endpoint_t *ep = c->by_slot[src];
    if (tag != IVSHMEM_TAG_BYE) {
        c->counters.dropped++;
        return;
    }
    if (ep)
        ep->said_bye = true;
    OPAL_THREAD_LOCK(&c->lock);
    mca_btl_ivshmem_distrust(src);
    OPAL_THREAD_UNLOCK(&c->lock);
}

/* The PML's callback for a message's tag, or NULL when the message is
   not the PML's: a control message (tag above 0xff, handle_control), a
   tag nobody registered, or one arriving while we finalize. */
static inline const mca_btl_active_message_callback_t *
pml_callback(uint32_t tag)
{
    if (OPAL_UNLIKELY(tag > 0xff))
        return NULL;
    const mca_btl_active_message_callback_t *reg =
        mca_btl_base_active_message_trigger + tag;
    if (OPAL_UNLIKELY(NULL == reg->cbfunc ||
                      mca_btl_ivshmem_component.finalizing))
        return NULL;
    return reg;
}

/* Hand one message to the PML through `reg`. Called without `lock`: the
   callback may send. The descriptor is the component's (rx_des) and the
   data lies in the region (or rxbuf, or a stash entry), valid only during
   the callback (the BTL contract). `len` was checked against where the
   data lies by the caller. The call comes last, so that a caller with
   nothing left to do jumps to it. */
static inline void upcall(const mca_btl_active_message_callback_t *reg,
                          uint32_t tag, const void *data, size_t len)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    c->counters.recv_msgs++;
    c->counters.recv_bytes += len;
    c->rx_seg.seg_addr.pval = (void *)data;
    c->rx_seg.seg_len = len;
    reg->cbfunc(&mca_btl_ivshmem.super, (mca_btl_base_tag_t)tag, &c->rx_des,
                reg->cbdata);
}

/* One received message of a trusted, current sender: to the PML, or to
   handle_control. */
static inline int deliver(int src, uint32_t tag, const void *data, size_t len)
{
    const mca_btl_active_message_callback_t *reg = pml_callback(tag);
    if (OPAL_UNLIKELY(NULL == reg)) {
        if (tag > 0xff)
            handle_control(src, tag);
        else
            mca_btl_ivshmem_component.counters.dropped++;
        return 0;
    }
    upcall(reg, tag, data, len);
    return 1;
}

/* One received message: in place in the region (in_ring) until
   release_message, or reassembled in rxbuf. */
typedef struct ivshmem_rx_msg {
    int src;
    uint32_t tag;
    bool in_ring;
    enum sender_state sender;
    int64_t gen; /* sender_generation after the take */
    const void *data;
} ivshmem_rx_msg_t;

/* Next message from any sender: its length, -EAGAIN, or an error (with
   m->src set to the sender it concerns). With `lock`. libivshm looks at
   our receive queue and our few active fast channels (not at every
   slot) and validates the header. A message that fits one slot is not
   copied: the payload is shared memory a co-tenant could still scribble
   on, but ob1 only reads it once per use, so that corrupts that message
   alone, just as a scribble before a copy would. */
static inline ssize_t take_message(ivshmem_rx_msg_t *m)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    ssize_t n = ivshm_recv_peek(c->h, IVSHM_ANY, &m->src, &m->tag, &m->data);
    m->in_ring = n >= 0;
    if (OPAL_UNLIKELY(n == -EMSGSIZE) && m->src >= 0) {
        /* spans several slots (a user-set max_send_size): copy it out */
        n = ivshm_recv(c->h, m->src, NULL, &m->tag, c->rxbuf, c->rxcap, 0);
        m->data = c->rxbuf;
    }
    return n;
}

/* Does the length fit where the message lies? libivshm already bounds
   both; checked again because ob1 trusts seg_len. */
static inline bool length_ok(const ivshmem_rx_msg_t *m, ssize_t n)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    size_t cap = m->in_ring ? c->geom.slot_size - IVSHMEM_SLOT_HDR : c->rxcap;
    return (size_t)n <= cap;
}

/* Give a taken in-place message's cell back to the queue (or channel). */
static inline void release_message(const ivshmem_rx_msg_t *m)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (OPAL_LIKELY(m->in_ring)) {
        OPAL_THREAD_LOCK(&c->lock);
        /* -EINVAL if scribbled meanwhile: the next peek reports it */
        (void)ivshm_recv_release(c->h, m->src);
        OPAL_THREAD_UNLOCK(&c->lock);
    }
}

/* A receive from trusted `src` failed validation or was cut by the
   sender's death: data of a job peer is lost, so that peer is treated as
   failed (now for corruption; at the next liveness check for a death).
   Unless the slot changed hands meanwhile: then the new occupant wrote
   it, and it only loses our trust. */
static void receive_error(const ivshmem_rx_msg_t *m, ssize_t err)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    c->counters.dropped++;
    mca_btl_ivshmem_endpoint_t *ep = c->by_slot[m->src];
    if (m->sender == SENDER_REPLACED) {
        OPAL_THREAD_LOCK(&c->lock);
        mca_btl_ivshmem_distrust(m->src);
        OPAL_THREAD_UNLOCK(&c->lock);
        return;
    }
    if (err == IVSHM_EPEERDEAD || m->sender == SENDER_DEPARTED) {
        c->last_reap_ns = 0; /* look at liveness on the next idle tick */
        return;
    }
    if (ep && !ep->deleted)
        mca_btl_ivshmem_peer_failed(ep, IVSHM_ECORRUPT);
}

/* What to do with a taken message of a trusted sender, by what became
   of it. Without `lock`. */
static inline int dispatch(const ivshmem_rx_msg_t *m, size_t len)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    /* a departed rank's too: its sends completed before it left */
    if (OPAL_LIKELY(m->sender == SENDER_CURRENT ||
                    m->sender == SENDER_DEPARTED))
        return deliver(m->src, m->tag, m->data, len);
    /* a reclaimed slot's is not from our job */
    c->counters.dropped++;
    if (m->sender == SENDER_REPLACED) {
        OPAL_THREAD_LOCK(&c->lock);
        mca_btl_ivshmem_distrust(m->src);
        OPAL_THREAD_UNLOCK(&c->lock);
    }
    return 0;
}

/* ---- the stash: messages of a connected job ob1 has not added yet ---- */

typedef struct ivshmem_stashed {
    struct ivshmem_stashed *next;
    int slot;
    uint32_t gen;
    uint32_t tag;
    size_t len;
    unsigned char data[];
} ivshmem_stashed_t;

/* Keep a copy of `m` (generation `gen`) in arrival order. `force`: a
   trusted sender whose earlier messages are still stashed (its order
   must hold, so no limit applies; the stash is delivered next). */
static void stash_put(const ivshmem_rx_msg_t *m, size_t len, uint32_t gen,
                      bool force)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!force && (c->stashed[m->src] >= IVSHMEM_STASH_PER_SLOT ||
                   c->stash_msgs >= IVSHMEM_STASH_MAX_MSGS ||
                   len > IVSHMEM_STASH_MAX_BYTES - c->stash_bytes)) {
        c->counters.ignored++;
        return;
    }
    ivshmem_stashed_t *e = malloc(sizeof *e + len);
    if (!e) {
        c->counters.ignored++;
        return;
    }
    e->next = NULL;
    e->slot = m->src;
    e->gen = gen;
    e->tag = m->tag;
    e->len = len;
    memcpy(e->data, m->data, len);
    if (c->stash_tail)
        c->stash_tail->next = e;
    else
        c->stash_head = e;
    c->stash_tail = e;
    c->stashed[m->src]++;
    c->stash_msgs++;
    c->stash_bytes += len;
}

/* Deliver the stashed messages of senders trusted since (in order), drop
   those of slots that changed hands, keep the rest. */
static int stash_deliver(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int delivered = 0;
    c->stash_ready = false;
    ivshmem_stashed_t **p = &c->stash_head, *prev = NULL;
    while (*p) {
        ivshmem_stashed_t *e = *p;
        bool gone;
        OPAL_THREAD_LOCK(&c->lock);
        int64_t now = sender_generation(e->slot, &gone);
        OPAL_THREAD_UNLOCK(&c->lock);
        bool trusted = c->trusted[e->slot] == (uint64_t)e->gen + 1;
        if (trusted || now != (int64_t)e->gen) {
            *p = e->next; /* unlinked before the upcall, which may send */
            if (c->stash_tail == e)
                c->stash_tail = prev;
            c->stashed[e->slot]--;
            c->stash_msgs--;
            c->stash_bytes -= e->len;
            if (trusted && now == (int64_t)e->gen)
                delivered += deliver(e->slot, e->tag, e->data, e->len);
            else
                c->counters.ignored++;
            free(e);
            continue;
        }
        prev = e;
        p = &e->next;
    }
    return delivered;
}

void mca_btl_ivshmem_stash_clear(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    while (c->stash_head) {
        ivshmem_stashed_t *e = c->stash_head;
        c->stash_head = e->next;
        free(e);
    }
    c->stash_tail = NULL;
    c->stash_msgs = c->stash_bytes = 0;
    c->stash_ready = false;
}

/* A message of a sender we do not trust: never handed to ob1 unless the
   sender is admitted now (a rank of our job, modex checked). Without
   `lock`; releases the message. */
static int untrusted_message(ivshmem_rx_msg_t *m, ssize_t n)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int delivered = 0;
    if (n < 0 || !length_ok(m, n) || m->gen < 0) {
        c->counters.ignored++;
    } else {
        switch (mca_btl_ivshmem_admit_sender(m->src, (uint32_t)m->gen)) {
        case IVSHMEM_ADMITTED:
            m->sender = SENDER_CURRENT;
            delivered = dispatch(m, (size_t)n);
            break;
        case IVSHMEM_STASH:
            stash_put(m, (size_t)n, (uint32_t)m->gen, false);
            break;
        default:
            c->counters.ignored++;
            break;
        }
    }
    if (n >= 0)
        release_message(m);
    return delivered;
}

/*
 * Hot path of the receiver: take the next message of any sender (one
 * queue and at most fast_channels channels looked at, whatever the
 * number of peers), check that its sender is trusted and the slot still
 * holds the trusted generation, make the upcall on the message where it
 * lies, release it. Invariants: ob1 only ever sees messages of trusted
 * senders at their trusted generation (others are admitted, stashed or
 * ignored first); every taken message is released after its upcall (or
 * drop), so the queue cell goes back; rxbuf holds ring_capacity bytes,
 * the most any honest fragment has, so one is never truncated; a
 * sender's messages reach ob1 in the order it sent them (the stash of a
 * just-trusted sender goes first).
 */
static int poll_region(uint32_t budget)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int delivered = 0;
    if (OPAL_UNLIKELY(c->stash_ready))
        delivered += stash_deliver();
    for (uint32_t i = 0; i < budget; i++) {
        ivshmem_rx_msg_t m = {.src = -1};
        OPAL_THREAD_LOCK(&c->lock);
        /* After the first message: is a second one there? In a stream
           usually, and taking it now saves a progress call; the idle
           look answers "no" in a few loads where a full empty peek
           checks every sender. But when the peer answers what we just
           delivered (a ping-pong, or both ranks sending at once as in
           MPI_Sendrecv), the answer is "no", and in an exchange that
           look reads the very slot the peer is writing at that moment:
           a cache-line transfer away from the writer, about a fifth of
           an 8 B exchange (docs/btl.md, "Message path"). So we look
           only while it pays: after a "no", the next IVSHMEM_LOOK_PAUSE
           calls that deliver a message return without looking; a "yes"
           keeps a stream batching. */
        if (i == 1) {
            if (c->looks_paused) {
                c->looks_paused--;
                OPAL_THREAD_UNLOCK(&c->lock);
                break;
            }
            if (ivshm_recv_idle(c->h)) {
                c->looks_paused = IVSHMEM_LOOK_PAUSE;
                OPAL_THREAD_UNLOCK(&c->lock);
                break;
            }
        }
        ssize_t n = take_message(&m);
        uint64_t t = 0;
        if (OPAL_LIKELY(n != -EAGAIN) && m.src >= 0 &&
            m.src < (int)c->geom.max_peers) {
            bool gone;
            m.gen = sender_generation(m.src, &gone);
            t = c->trusted[m.src];
            m.sender = !t ? SENDER_UNTRUSTED
                       : m.gen < 0 || (uint64_t)m.gen + 1 != t ? SENDER_REPLACED
                       : gone ? SENDER_DEPARTED
                              : SENDER_CURRENT;
        }
        OPAL_THREAD_UNLOCK(&c->lock);
        if (OPAL_LIKELY(n == -EAGAIN))
            break;
        if (OPAL_UNLIKELY(m.src < 0 || m.src >= (int)c->geom.max_peers))
            break; /* an error about no sender in particular */
        if (OPAL_UNLIKELY(m.sender == SENDER_UNTRUSTED)) {
            delivered += untrusted_message(&m, n);
            continue;
        }
        if (OPAL_UNLIKELY(n < 0 || !length_ok(&m, n))) {
            receive_error(&m, n < 0 ? n : IVSHM_ECORRUPT);
            if (n >= 0)
                release_message(&m);
            continue;
        }
        if (OPAL_UNLIKELY(c->stashed[m.src]) && m.sender != SENDER_REPLACED) {
            /* behind its stashed messages: keep the order */
            stash_put(&m, (size_t)n, (uint32_t)(t - 1), true);
            c->stash_ready = true;
        } else {
            delivered += dispatch(&m, (size_t)n);
        }
        release_message(&m);
    }
    return delivered;
}

int mca_btl_ivshmem_drain(uint32_t budget)
{
    return poll_region(budget);
}

/* A message of the fast path that is not a PML message of a trusted
   sender at its trusted generation with nothing stashed: what
   poll_region does with it, the message staying where it lies (libivshm
   consumes it). Out of line, so that take_in_place's usual case needs
   no frame. */
static __attribute__((noinline)) void take_unusual(int src, uint32_t gen,
                                                   uint32_t tag,
                                                   const void *data, size_t len)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    ivshmem_rx_msg_t m = {.src = src, .tag = tag, .in_ring = false,
                          .gen = gen, .data = data};
    const uint64_t t = c->trusted[src];
    if (!t) {
        m.sender = SENDER_UNTRUSTED;
        c->fast_delivered += untrusted_message(&m, (ssize_t)len);
    } else if (t != (uint64_t)gen + 1) {
        m.sender = SENDER_REPLACED;
        c->fast_delivered += dispatch(&m, len);
    } else if (c->stashed[src]) { /* behind its stashed messages */
        stash_put(&m, len, gen, true);
        c->stash_ready = true;
    } else { /* a control message, or a drop */
        c->fast_delivered += deliver(src, tag, data, len);
    }
}

/* The fast path's upcall (ivshm_recv_each): one whole message of `src`
   in its incarnation `gen`, where it lies in the region; libivshm
   consumes it when we return. The same rule as poll_region: ob1 sees
   only trusted senders at their trusted generation, after whatever of
   theirs waits in the stash. Without `lock` (single-threaded only). */
static void take_in_place(void *arg, int src, uint32_t gen, uint32_t tag,
                          const void *data, size_t len)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    (void)arg;
    /* ob1's callback may call opal_progress: that must not take this
       message again before libivshm has consumed it (cleared by the
       progress call when ivshm_recv_each returns) */
    c->in_progress = 1;
    const mca_btl_active_message_callback_t *reg = pml_callback(tag);
    if (OPAL_LIKELY(reg && c->trusted[src] == (uint64_t)gen + 1 &&
                    0 == c->stashed[src])) {
        c->fast_delivered++;
        upcall(reg, tag, data, len); /* last: a jump, no frame of ours */
        return;
    }
    take_unusual(src, gen, tag, data, len);
}

/* A queued fragment left the FIFO: sent (rc 0) or failed. With `lock`. */
static void pending_sent(mca_btl_ivshmem_endpoint_t *ep,
                         mca_btl_ivshmem_frag_t *f, int rc)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    const mca_btl_base_segment_t *seg = f->base.des_segments;
    (void)ivshmem_queue_pop(&ep->pending);
    c->num_pending--;
    if (rc == 0) {
        c->counters.sent_msgs++;
        c->counters.sent_bytes += seg->seg_len;
        ep->refused_since_ns = 0; /* the tail checks out again */
    } else {
        f->status = OPAL_ERR_UNREACH;
        ep->send_error = rc; /* reported by the caller, unlocked */
    }
    if (f->base.des_flags & MCA_BTL_DES_SEND_ALWAYS_CALLBACK)
        ivshmem_queue_push(&c->complete, f);
    else if (f->base.des_flags & MCA_BTL_DES_FLAGS_BTL_OWNERSHIP)
        ivshmem_frag_return(f);
}

bool mca_btl_ivshmem_send_refused(mca_btl_ivshmem_endpoint_t *ep, int rc)
{
    if (rc != IVSHM_ECORRUPT)
        return false;
    mca_btl_ivshmem_component.counters.refused++;
    uint64_t now = mca_btl_ivshmem_now_ns();
    if (0 == ep->refused_since_ns)
        ep->refused_since_ns = now;
    return now - ep->refused_since_ns < IVSHMEM_REFUSED_NS;
}

int mca_btl_ivshmem_flush_pending(mca_btl_ivshmem_endpoint_t *ep)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int sent = 0;
    mca_btl_ivshmem_frag_t *f;
    if (OPAL_UNLIKELY(ep->in_ring))
        return 0; /* its slot is the next one: the descriptor goes first */
    while ((f = ep->pending.head)) {
        const mca_btl_base_segment_t *seg = f->base.des_segments;
        int rc = ivshm_try_send(c->h, ep->slot, f->tag, seg->seg_addr.pval,
                                seg->seg_len);
        if (rc == -EAGAIN || mca_btl_ivshmem_send_refused(ep, rc))
            break;
        pending_sent(ep, f, rc);
        sent++;
    }
    return sent;
}

/*
 * Sends queued for a receiver whose queue (or our channel to it) is
 * full, nothing else to do, and a CPU shared with other ranks: spinning
 * would only take the CPU from the ranks that have to drain those
 * queues (with a hundred ranks on a few cores, that is most of them).
 * Instead wait, for at most one slice, for room for the first queued
 * fragment: libivshm registers us as a waiter of that receiver, which
 * wakes us when it frees a cell. All or nothing: a fragment fits the
 * queue and a channel, so a timeout leaves no trace. What arrives for us
 * meanwhile waits at most the slice.
 */
static int wait_for_room(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    mca_btl_ivshmem_endpoint_t *ep;
    OPAL_THREAD_LOCK(&c->lock);
    for (ep = c->pending_eps; ep; ep = ep->next_pending)
        if (ep->pending.head && !ep->in_ring && !ep->dead)
            break;
    if (!ep) {
        OPAL_THREAD_UNLOCK(&c->lock);
        return 0;
    }
    mca_btl_ivshmem_frag_t *f = ep->pending.head;
    const mca_btl_base_segment_t *seg = f->base.des_segments;
    int rc = ivshm_send_timeout(c->h, ep->slot, f->tag, seg->seg_addr.pval,
                                seg->seg_len, c->block_ms);
    if (rc == -EAGAIN || rc == -ETIMEDOUT ||
        mca_btl_ivshmem_send_refused(ep, rc)) {
        OPAL_THREAD_UNLOCK(&c->lock);
        return 0;
    }
    pending_sent(ep, f, rc);
    int err = ep->send_error;
    ep->send_error = 0;
    OPAL_THREAD_UNLOCK(&c->lock);
    if (OPAL_UNLIKELY(err))
        mca_btl_ivshmem_peer_failed(ep, err);
    return 1;
}

/* Only the endpoints with queued fragments (pending_eps) are looked
   at; an emptied one leaves the list. Out of line, like run_completions
   and idle_tick: inlined, their registers made every empty progress
   call save and restore six of them. */
static __attribute__((noinline)) int retry_pending(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int n = 0;
    mca_btl_ivshmem_endpoint_t *failed = NULL;
    OPAL_THREAD_LOCK(&c->lock);
    mca_btl_ivshmem_endpoint_t **p = &c->pending_eps;
    while (*p) {
        mca_btl_ivshmem_endpoint_t *ep = *p;
        n += mca_btl_ivshmem_flush_pending(ep);
        if (OPAL_UNLIKELY(ep->send_error) && !failed)
            failed = ep; /* one per call: reported below, unlocked */
        if (0 == ep->pending.count) {
            *p = ep->next_pending;
            ep->on_pending_list = false;
        } else {
            p = &ep->next_pending;
        }
    }
    OPAL_THREAD_UNLOCK(&c->lock);
    if (OPAL_UNLIKELY(failed)) {
        int err = failed->send_error;
        failed->send_error = 0;
        mca_btl_ivshmem_peer_failed(failed, err);
    }
    return n;
}

/* Callbacks of what was queued when we started: those they trigger wait
   for the next call, so a long pipeline cannot monopolize progress. */
static __attribute__((noinline)) int run_completions(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    OPAL_THREAD_LOCK(&c->lock);
    size_t todo = c->complete.count;
    OPAL_THREAD_UNLOCK(&c->lock);
    int n = 0;
    for (; todo; todo--) {
        OPAL_THREAD_LOCK(&c->lock);
        mca_btl_ivshmem_frag_t *f = ivshmem_queue_pop(&c->complete);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (!f)
            break;
        ivshmem_frag_complete(f, f->status);
        n++;
    }
    return n;
}

/* Blocking exists to give the CPU to a rank that has work. On CPUs of
   its own a rank gains nothing by it and loses a lot: the wake-up
   latency and, worse, the work of a caller that polls (MPI_Test,
   MPI_Iprobe) between bits of its own, which idle polling cannot tell
   from a rank waiting in MPI_Wait (HPCC's MPIRandomAccess ran 26x slower
   for it). So by default a rank blocks only if ranks of ours share its
   CPUs: counted from the affinity masks of the trusted peers whose pids
   are ours to look at (same kernel and pid namespace), more ranks than
   CPUs in the union of the masks that overlap ours. Open MPI's own
   yield_when_idle (oversubscribed nodes) counts as sharing too. */
#define CPU_CHECK_NS 1000000000ull     /* affinity changes rarely */

/* Can this rank block at all, whatever the moment? Not with block_us 0,
   not with threads (other threads may need the handle), not (by default)
   with another BTL to poll, and (by default) only on CPUs shared with
   other ranks of ours. */
static bool may_ever_block(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (c->block_ms <= 0 || (c->block_us < 0 && c->mixed) ||
        opal_using_threads())
        return false;
    return c->block_us >= 0 || opal_progress_yield_when_idle ||
           c->shares_cpu;
}

/* A rank that never blocks says so to libivshm (a spin budget of
   "forever"), which tells the peers: their sends and our receives then
   skip the fences that only a sleeper needs (doorbell.c in libivshm), the
   largest cost of a small message. */
static void publish_blocking(bool may)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (may != c->spins_only)
        return;
    c->spins_only = !may;
    OPAL_THREAD_LOCK(&c->lock);
    ivshm_set_spin(c->h, may ? 1 : -1);
    OPAL_THREAD_UNLOCK(&c->lock);
}

static void update_cpu_sharing(uint64_t now)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (c->cpu_checked_ns && now - c->cpu_checked_ns < CPU_CHECK_NS)
        return;
    c->cpu_checked_ns = now;
    cpu_set_t mine, all, theirs, both;
    if (0 != sched_getaffinity(0, sizeof mine, &mine)) {
        c->shares_cpu = false;
        return;
    }
    all = mine;
    int ranks = 1;
    for (int i = 0; i < c->nactive; i++) {
        int s = c->active[i];
        if (s == c->self_slot)
            continue;
        ivshm_peer_info info;
        OPAL_THREAD_LOCK(&c->lock);
        bool ours = 0 == ivshm_peer(c->h, s, &info) &&
                    1 == ivshm_peer_local(c->h, s);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (!ours || info.pid <= 0 ||
            0 != sched_getaffinity(info.pid, sizeof theirs, &theirs))
            continue;
        CPU_AND(&both, &mine, &theirs);
        if (0 == CPU_COUNT(&both))
            continue;
        CPU_OR(&all, &all, &theirs);
        ranks++;
    }
    c->shares_cpu = ranks > CPU_COUNT(&all);
    publish_blocking(may_ever_block());
}

/* Is `slot` live at generation `gen`? With `lock`. */
static inline bool slot_live(int slot, uint32_t gen)
{
    return ivshm_peer_generation(mca_btl_ivshmem_component.h, slot) ==
           (int64_t)gen;
}

/* Has `slot`, which left or died in the incarnation we trust, still
   messages for us in libivshm? Then they come first (poll_region
   delivers them in order, its BYE last), and its departure is decided
   at a later tick: a bounded drain alone can stop short of them (a
   flood of other senders, or a paused idle look), and what is left
   after we distrust the slot would be ignored. Finite: libivshm shows
   a departed sender's ring up to its last head, and its queue cells.
   With `lock`. */
static bool departed_unread(int slot)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    bool gone;
    int64_t gen = sender_generation(slot, &gone);
    if (!gone || !c->trusted[slot] || (uint64_t)gen + 1 != c->trusted[slot])
        return false;
    uint32_t tag;
    const void *data;
    /* a peek, left in place: poll_region takes it again, in order */
    ssize_t n = ivshm_recv_peek(c->h, slot, NULL, &tag, &data);
    return n != IVSHM_EPEERDEAD && n != -EINVAL;
}

/* Every ~100 ms: reap, then check each peer we talk to (endpoints) or
   accept messages from (trusted senders): O(those peers), not O(slots).
   A departed one's messages, its goodbye last, may still wait in our
   queue and channels: they are delivered first (departed_unread), and
   only then is a missing goodbye taken for a crash. */
static int housekeeping(uint64_t now)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int ndeparted = 0, delivered = 0;
    if (now - c->last_reap_ns < IVSHMEM_REAP_NS)
        return 0;
    c->last_reap_ns = now;

    OPAL_THREAD_LOCK(&c->lock);
    (void)ivshm_reap(c->h);
    /* departed[] has max_peers entries and each slot goes in at most
       once: watched endpoints (one per slot), then trusted slots
       without a watched endpoint */
    for (mca_btl_ivshmem_endpoint_t *ep = c->endpoints; ep; ep = ep->next)
        if (!ep->dead && !ep->deleted && !slot_live(ep->slot, ep->generation))
            c->departed[ndeparted++] = ep->slot;
    for (int i = 0; i < c->nactive; i++) {
        int s = c->active[i];
        mca_btl_ivshmem_endpoint_t *ep = c->by_slot[s];
        if (ep && !ep->dead && !ep->deleted)
            continue; /* looked at above */
        if (!slot_live(s, (uint32_t)(c->trusted[s] - 1)))
            c->departed[ndeparted++] = s;
    }
    OPAL_THREAD_UNLOCK(&c->lock);
    update_cpu_sharing(now);
    if (0 == ndeparted)
        return 0;

    delivered += mca_btl_ivshmem_drain(IVSHMEM_DRAIN_BUDGET);
    for (int i = 0; i < ndeparted; i++) {
        int s = c->departed[i];
        mca_btl_ivshmem_endpoint_t *ep = c->by_slot[s];
        OPAL_THREAD_LOCK(&c->lock);
        if (departed_unread(s)) {
            OPAL_THREAD_UNLOCK(&c->lock);
            continue;
        }
        if (c->trusted[s] && !slot_live(s, (uint32_t)(c->trusted[s] - 1)))
            mca_btl_ivshmem_distrust(s);
        bool watched = ep && !ep->dead && !ep->deleted &&
                       !slot_live(s, ep->generation);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (!watched)
            continue;
        if (ep->said_bye)
            ep->dead = true; /* gone for good: sends fail, no more checks */
        else
            mca_btl_ivshmem_peer_failed(ep, IVSHM_EPEERDEAD);
    }
    return delivered;
}

/* Blocking is for ranks that have nothing else to do and a CPU to give
   away: not with callbacks outstanding, with queued sends only to wait
   for their room (`for_room`), not while other threads
   may need the handle, (by default) not when another BTL carries some
   peer, whose progress would then be polled only once per slice, and
   (by default) not on CPUs of its own (update_cpu_sharing). */
static bool may_block(uint64_t now, bool for_room)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    bool ever = may_ever_block();
    publish_blocking(ever); /* before a block: libivshm spins its grace */
    if (!ever)
        return false;
    if ((c->num_pending && !for_room) || c->complete.head)
        return false;
    if (0 == c->num_endpoints && 0 == c->counters.recv_msgs)
        return false; /* not carrying anything (yet) */
    return now - c->idle_since_ns >= (uint64_t)c->spin_us * 1000u;
}

static __attribute__((noinline)) int idle_tick(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    uint64_t now = mca_btl_ivshmem_now_ns();
    /* Only a caller spinning in a wait (MPI_Wait, a blocking receive)
       polls densely. If the last IDLE_POLLS_PER_TICK polls took long,
       it is computing between MPI_Test calls (or sleeping, like the
       finalize fence): blocking would stall it, so restart the spin
       budget instead. Gaps made by opal's own sched_yield (oversubscribed
       runs) are waiting, not work. */
    if (now - c->last_tick_ns > IDLE_TICK_GAP_NS && !opal_progress_yield_when_idle)
        c->idle_since_ns = now;
    c->last_tick_ns = now;
    if (0 == c->idle_since_ns)
        c->idle_since_ns = now;
    int n = housekeeping(now);
    /* nothing arrived before we block? (A rank that never blocks has
       its full peek every 64th progress call already.) */
    if (0 == n && may_ever_block())
        n = poll_region(IVSHMEM_RECV_BATCH);
    if (0 == n && c->num_pending) {
        if (may_block(now, true))
            n = wait_for_room(); /* our sends wait for room: so do we */
    } else if (0 == n && may_block(now, false) &&
               0 == ivshm_wait_message(c->h, c->block_ms)) {
        n = poll_region(IVSHMEM_RECV_BATCH); /* woken by a sender: take it now */
    }
    return n;
}

/* Everything but the empty call of one thread: delivery, retries,
   callbacks, the idle tick. `taken`: what the fast path took (messages
   handed to take_in_place, `delivered` of them to ob1: fast_delivered),
   0 when it found
   something only the general path takes, -EAGAIN when it found nothing;
   NOT_ASKED (threads) when the general path alone is used, which asks
   ivshm_recv_idle first under `lock`. Under the one-progress-at-a-time
   guard. */
#define NOT_ASKED (-1000)
static __attribute__((noinline)) int progress_body(int taken, int delivered)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int events = delivered;
    if (taken == NOT_ASKED) {
        OPAL_THREAD_LOCK(&c->lock);
        taken = ivshm_recv_idle(c->h) ? -EAGAIN : 0;
        OPAL_THREAD_UNLOCK(&c->lock);
    }
    if (OPAL_UNLIKELY(0 == taken || c->stash_ready))
        events += poll_region(IVSHMEM_RECV_BATCH);
    if (OPAL_UNLIKELY(c->num_pending))
        events += retry_pending();
    if (OPAL_UNLIKELY(NULL != c->complete.head))
        events += run_completions();

    if (OPAL_LIKELY(events)) {
        c->idle_since_ns = 0;
        c->idle_polls = 0;
        if (OPAL_UNLIKELY(++c->ticks % BUSY_CALLS_PER_TICK == 0))
            events += housekeeping(mca_btl_ivshmem_now_ns());
    } else if (OPAL_UNLIKELY(++c->idle_polls % IDLE_POLLS_PER_TICK == 0)) {
        events = idle_tick();
    }
    return events;
}

int mca_btl_ivshmem_component_progress(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (OPAL_UNLIKELY(NULL == c->h || c->finalizing))
        return 0;
    /* one progress at a time: other threads, or an upcall re-entering */
    if (OPAL_UNLIKELY(opal_using_threads())) {
        if (opal_atomic_swap_32(&c->in_progress, 1))
            return 0;
        int events = progress_body(NOT_ASKED, 0);
        opal_atomic_wmb();
        c->in_progress = 0;
        return events;
    }
    if (c->in_progress)
        return 0;
    /* One thread: the fast path first (docs/fast-path.md). Whole
       messages at the heads of our fast channels go to ob1 where they
       lie, without the peek/release bookkeeping; most calls (every
       MPI_Test, every spin of MPI_Wait) find nothing there, and
       libivshm says so in a few loads (and "look elsewhere" every 64th
       time, so the general path's checks still run). The look for a
       second message is paused as in poll_region: after a call that
       found only one, the next IVSHMEM_LOOK_PAUSE take one each. The
       upcall sets the re-entrancy guard (take_in_place): an empty call
       stores nothing. */
    const int max = c->looks_paused ? 1 : IVSHMEM_RECV_BATCH;
    int taken = ivshm_recv_each(c->h, take_in_place, NULL, max);
    int events;
    if (OPAL_LIKELY(taken == -EAGAIN && !c->stash_ready && !c->num_pending &&
                    NULL == c->complete.head)) {
        /* Stashed messages are ours, out of libivshm's sight: they
           always get their poll; queued sends and callbacks their turn;
           every IDLE_POLLS_PER_TICK-th empty call its tick. */
        if (OPAL_LIKELY(++c->idle_polls % IDLE_POLLS_PER_TICK != 0))
            return 0;
        c->in_progress = 1;
        events = idle_tick();
    } else {
        c->in_progress = 1;
        if (taken > 0) {
            if (max == 1)
                c->looks_paused--;
            else if (taken == 1)
                c->looks_paused = IVSHMEM_LOOK_PAUSE;
        }
        const int delivered = c->fast_delivered;
        c->fast_delivered = 0;
        /* The usual busy call: what progress_body would do with it, here
           (a call and its checks less per message): ob1 got messages,
           nothing is stashed, queued or owed, and no housekeeping is
           due. The upcalls may have queued sends or callbacks, so this
           looks after them. */
        if (OPAL_LIKELY(taken > 0 && delivered > 0 && !c->stash_ready &&
                        !c->num_pending && NULL == c->complete.head &&
                        (c->ticks + 1) % BUSY_CALLS_PER_TICK != 0)) {
            c->ticks++;
            c->idle_since_ns = 0;
            c->idle_polls = 0;
            c->in_progress = 0;
            return delivered;
        }
        events = progress_body(taken, delivered);
    }
    c->in_progress = 0;
    return events;
}

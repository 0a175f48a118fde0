/*
 * Progress (called from opal_progress once the BML has registered us):
 *   1. deliver what arrived in our rings to the PML's active-message
 *      callbacks (at most IVSHMEM_RECV_BATCH per call),
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

#include <errno.h>
#include <sched.h>
#include <string.h>

/* Clock reads are spaced out: one every this many idle polls. */
#define IDLE_POLLS_PER_TICK 64
/* ...and one every this many busy calls, for housekeeping. */
#define BUSY_CALLS_PER_TICK 1024
/* A tick that comes later than this after the previous one means the
   caller does other work between polls (see idle_tick). */
#define IDLE_TICK_GAP_NS 100000ull

void mca_btl_ivshmem_trust(int slot, uint32_t gen)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!c->trusted[slot])
        c->active[c->nactive++] = slot;
    c->trusted[slot] = (uint64_t)gen + 1;
}

void mca_btl_ivshmem_distrust(int slot)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!c->trusted[slot])
        return;
    c->trusted[slot] = 0;
    for (int i = 0; i < c->nactive; i++)
        if (c->active[i] == slot) {
            c->active[i] = c->active[--c->nactive];
            break;
        }
    c->rr = 0;
}

/* Who wrote a message we just took from `slot`, as far as the registry
   tells after the fact. */
enum sender_state {
    SENDER_CURRENT,  /* live at the generation we trust: deliver          */
    SENDER_DEPARTED, /* left or died: only its BYE still means something */
    SENDER_REPLACED, /* the slot holds another incarnation: drop all      */
};

/* Checked after the take: generations only grow, so a slot live at
   generation g now was at g when libivshm took the message (it delivers
   only frames of the generation it read then). With `lock`. */
static inline enum sender_state sender_state(int slot, uint32_t gen)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int64_t now = ivshm_peer_generation(c->h, slot);
    if (now < 0)
        return SENDER_DEPARTED;
    return (uint32_t)now == gen ? SENDER_CURRENT : SENDER_REPLACED;
}

/* A control message of a trusted sender. BYE is the last message a
   finalizing rank sends us: we stop reading its ring. */
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

/* Hand one received message of a trusted, current sender to the PML.
   Called without `lock`: the callback may send. The descriptor lives on
   our stack and its data in the ring slot (or rxbuf), valid only during
   the callback (the BTL contract). `len` was checked against the slot
   (in place) or rxbuf (copied) by the caller. */
static inline int deliver(int src, uint32_t tag, const void *data, size_t len)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (OPAL_UNLIKELY(tag > 0xff)) {
        handle_control(src, tag);
        return 0;
    }
    const mca_btl_active_message_callback_t *reg =
        mca_btl_base_active_message_trigger + tag;
    if (OPAL_UNLIKELY(NULL == reg->cbfunc || c->finalizing)) {
        c->counters.dropped++;
        return 0;
    }
    c->counters.recv_msgs++;
    c->counters.recv_bytes += len;
    mca_btl_base_segment_t seg = {.seg_addr.pval = (void *)data, .seg_len = len};
    mca_btl_base_descriptor_t des = {.des_segments = &seg, .des_segment_count = 1};
    reg->cbfunc(&mca_btl_ivshmem.super, (mca_btl_base_tag_t)tag, &des, reg->cbdata);
    return 1;
}

/* One received message: in place in its ring slot (in_ring) until
   release_message, or reassembled in rxbuf. */
typedef struct ivshmem_rx_msg {
    int src;
    uint32_t tag;
    bool in_ring;
    enum sender_state sender;
    const void *data;
} ivshmem_rx_msg_t;

/* Next message from slot `from`: its length, -EAGAIN, or an error. With
   `lock`. A message that fits one slot is not copied: the payload is
   shared memory a co-tenant could still scribble on, but ob1 only reads
   it once per use, so that corrupts that message alone, just as a
   scribble before a copy would. */
static inline ssize_t take_message(int from, ivshmem_rx_msg_t *m)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    ssize_t n = ivshm_recv_peek(c->h, from, &m->src, &m->tag, &m->data);
    m->in_ring = n >= 0;
    if (OPAL_UNLIKELY(n == -EMSGSIZE)) {
        /* spans several slots (a user-set max_send_size): copy it out */
        n = ivshm_recv(c->h, from, NULL, &m->tag, c->rxbuf, c->rxcap, 0);
        m->data = c->rxbuf;
    }
    m->src = from;
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

/* Give a taken in-place message's slot back to its sender. */
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

/* One message from the trusted senders, round-robin; -EAGAIN if none.
   With `lock`. Only rings of active[] are ever looked at. */
static inline ssize_t recv_active(ivshmem_rx_msg_t *m)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    const int n = c->nactive;
    int i = c->rr < n ? c->rr : 0;
    for (int k = 0; k < n; k++, i = i + 1 == n ? 0 : i + 1) {
        ssize_t got = take_message(c->active[i], m);
        /* a departed sender with nothing left: housekeeping drops it */
        if (got == -EAGAIN || got == IVSHM_EPEERDEAD)
            continue;
        c->rr = i + 1;
        return got;
    }
    return -EAGAIN;
}

/* What to do with a taken message, by who wrote it. Without `lock`. */
static inline int dispatch(const ivshmem_rx_msg_t *m, size_t len)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (OPAL_LIKELY(m->sender == SENDER_CURRENT))
        return deliver(m->src, m->tag, m->data, len);
    if (m->sender == SENDER_DEPARTED && m->tag == IVSHMEM_TAG_BYE) {
        handle_control(m->src, m->tag);
        return 0;
    }
    /* a departed rank's PML traffic is needed by nobody (a clean leave
       comes after the finalize fence; a crash aborts the job), and a
       reclaimed slot's is not from our job */
    c->counters.dropped++;
    if (m->sender == SENDER_REPLACED) {
        OPAL_THREAD_LOCK(&c->lock);
        mca_btl_ivshmem_distrust(m->src);
        OPAL_THREAD_UNLOCK(&c->lock);
    }
    return 0;
}

/*
 * Hot path of the receiver: poll the rings of the trusted senders (one
 * seq load each when empty), check that the slot still holds the trusted
 * generation, make the upcall on the message where it lies, release it.
 * Invariants: no ring outside active[] is read, so a co-tenant that is
 * not a verified member of our job cannot reach ob1; every taken message
 * is released after its upcall (or drop), so the sender gets its slot
 * back; rxbuf holds ring_capacity bytes, the most any ivshm_try_send can
 * send, so an honest message is never truncated.
 */
static int poll_rings(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int delivered = 0;
    for (int i = 0; i < IVSHMEM_RECV_BATCH; i++) {
        ivshmem_rx_msg_t m = {.src = -1};
        OPAL_THREAD_LOCK(&c->lock);
        ssize_t n = recv_active(&m);
        if (n != -EAGAIN)
            m.sender = sender_state(m.src, (uint32_t)(c->trusted[m.src] - 1));
        OPAL_THREAD_UNLOCK(&c->lock);
        if (OPAL_LIKELY(n == -EAGAIN))
            break;
        if (OPAL_UNLIKELY(n < 0 || !length_ok(&m, n))) {
            receive_error(&m, n < 0 ? n : IVSHM_ECORRUPT);
            if (n >= 0)
                release_message(&m);
            continue;
        }
        delivered += dispatch(&m, (size_t)n);
        release_message(&m);
    }
    return delivered;
}

int mca_btl_ivshmem_drain_slot(int slot, uint32_t gen)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int delivered = 0;
    /* bounded: a live sender could keep its ring busy forever */
    for (uint32_t i = 0; i < 2 * c->geom.ring_slots; i++) {
        ivshmem_rx_msg_t m = {.src = slot};
        OPAL_THREAD_LOCK(&c->lock);
        /* a reclaimed slot's ring is the new occupant's: not ours to read */
        m.sender = sender_state(slot, gen);
        ssize_t n = m.sender == SENDER_REPLACED ? -EAGAIN : take_message(slot, &m);
        if (n >= 0 || n == IVSHM_ECORRUPT)
            m.sender = sender_state(slot, gen);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (n == -EAGAIN || n == IVSHM_EPEERDEAD || n == -EINVAL)
            break;
        if (n < 0 || !length_ok(&m, n)) {
            c->counters.dropped++;
            if (n >= 0)
                release_message(&m);
            continue;
        }
        delivered += dispatch(&m, (size_t)n);
        release_message(&m);
    }
    return delivered;
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
        if (rc == -EAGAIN)
            break;
        (void)ivshmem_queue_pop(&ep->pending);
        c->num_pending--;
        if (rc == 0) {
            c->counters.sent_msgs++;
            c->counters.sent_bytes += seg->seg_len;
        } else {
            f->status = OPAL_ERR_UNREACH;
            ep->send_error = rc; /* reported by the caller, unlocked */
        }
        if (f->base.des_flags & MCA_BTL_DES_SEND_ALWAYS_CALLBACK)
            ivshmem_queue_push(&c->complete, f);
        else if (f->base.des_flags & MCA_BTL_DES_FLAGS_BTL_OWNERSHIP)
            ivshmem_frag_return(f);
        sent++;
    }
    return sent;
}

static int retry_pending(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int n = 0;
    OPAL_THREAD_LOCK(&c->lock);
    for (int s = 0; s < 64 && c->num_pending; s++) {
        mca_btl_ivshmem_endpoint_t *ep = c->by_slot[s];
        if (ep && ep->pending.count)
            n += mca_btl_ivshmem_flush_pending(ep);
    }
    OPAL_THREAD_UNLOCK(&c->lock);
    for (int s = 0; s < 64; s++) {
        mca_btl_ivshmem_endpoint_t *ep = c->by_slot[s];
        if (ep && OPAL_UNLIKELY(ep->send_error)) {
            int err = ep->send_error;
            ep->send_error = 0;
            mca_btl_ivshmem_peer_failed(ep, err);
        }
    }
    return n;
}

/* Callbacks of what was queued when we started: those they trigger wait
   for the next call, so a long pipeline cannot monopolize progress. */
static int run_completions(void)
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
    for (int s = 0; s < (int)c->geom.max_peers; s++) {
        if (!c->trusted[s] || s == c->self_slot)
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
}

/* Every ~100 ms: reap, then check each peer we talk to (endpoints) or
   accept messages from (trusted senders). A departed one is drained
   first: its goodbye is still in its ring; only then is a missing
   goodbye taken for a crash. Last, admit ranks of our job that turned
   up in the registry. */
static int housekeeping(uint64_t now)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    mca_btl_ivshmem_endpoint_t *failed[64];
    int nfailed = 0, delivered = 0;
    if (now - c->last_reap_ns < IVSHMEM_REAP_NS)
        return 0;
    c->last_reap_ns = now;

    OPAL_THREAD_LOCK(&c->lock);
    (void)ivshm_reap(c->h);
    OPAL_THREAD_UNLOCK(&c->lock);
    for (int s = 0; s < (int)c->geom.max_peers; s++) {
        mca_btl_ivshmem_endpoint_t *ep = c->by_slot[s];
        uint64_t t = c->trusted[s];
        bool watched = ep && !ep->dead && !ep->deleted;
        if (!watched && !t)
            continue;
        uint32_t gen = watched ? ep->generation : (uint32_t)(t - 1);
        ivshm_peer_info info;
        OPAL_THREAD_LOCK(&c->lock);
        bool live = ivshm_peer(c->h, s, &info) == 0 && info.generation == gen;
        OPAL_THREAD_UNLOCK(&c->lock);
        if (live)
            continue;
        if (t)
            delivered += mca_btl_ivshmem_drain_slot(s, (uint32_t)(t - 1));
        OPAL_THREAD_LOCK(&c->lock);
        mca_btl_ivshmem_distrust(s);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (watched) {
            if (ep->said_bye)
                ep->dead = true; /* gone for good: sends fail, no more checks */
            else
                failed[nfailed++] = ep;
        }
    }
    for (int i = 0; i < nfailed; i++)
        mca_btl_ivshmem_peer_failed(failed[i], IVSHM_EPEERDEAD);
    mca_btl_ivshmem_admit_job_peers();
    update_cpu_sharing(now);
    return delivered;
}

/* Blocking is for ranks that have nothing else to do and a CPU to give
   away: not with sends or callbacks outstanding, not while other threads
   may need the handle, (by default) not when another BTL carries some
   peer, whose progress would then be polled only once per slice, and
   (by default) not on CPUs of its own (update_cpu_sharing). */
static bool may_block(uint64_t now)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (c->block_ms <= 0 || (c->block_us < 0 && c->mixed))
        return false;
    if (c->num_pending || c->complete.head || opal_using_threads())
        return false;
    if (0 == c->num_endpoints && 0 == c->counters.recv_msgs)
        return false; /* not carrying anything (yet) */
    if (now - c->idle_since_ns < (uint64_t)c->spin_us * 1000u)
        return false;
    return c->block_us >= 0 || opal_progress_yield_when_idle ||
           c->shares_cpu;
}

static int idle_tick(void)
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
    if (0 == n)
        n = poll_rings(); /* nothing arrived before we block? */
    if (0 == n && may_block(now) && 0 == ivshm_wait_message(c->h, c->block_ms))
        n = poll_rings(); /* woken by a sender: take it right away */
    return n;
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
    } else if (c->in_progress) {
        return 0;
    } else {
        c->in_progress = 1;
    }

    int events = poll_rings();
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

    if (OPAL_UNLIKELY(opal_using_threads())) {
        opal_atomic_wmb();
        c->in_progress = 0;
    } else {
        c->in_progress = 0;
    }
    return events;
}

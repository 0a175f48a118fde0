/*
 * The doorbell's two sides: spin-then-block waiting and the waker's
 * kick (docs/waiting.md).
 *
 * A waiter spins for h->spin_ns, then announces `sleeping = 1` in its
 * registry entry and blocks on its doorbell. A producer, after publishing,
 * rings only if it sees `sleeping`: the fast path makes no system call.
 * No wake-up is lost because both sides order a store before a load with
 * a full fence (Dekker): waiter stores sleeping then re-checks the data;
 * producer stores the data then loads sleeping. At least one of them sees
 * the other's store.
 *
 * Blocking announced: those fences stall both sides until their stores
 * reach the other core, on every message, and they only matter if the
 * other side can sleep. So every peer says in its entry whether it may
 * block at all (`may_sleep`, cleared when its spin budget is "never
 * block", ivshm_set_spin), and a waker that sees 0 skips fence and look.
 * Turning it back on: a waker whose load still saw 0 made its data store
 * before that load, so the store is visible within a store buffer's
 * drain time of our announcement; we spin at least ANNOUNCE_GRACE_NS
 * after announcing before we block, and so see it. A co-tenant clearing
 * the flag costs its victim at most one slice per sleep: every sleep
 * re-announces, and every sleep is bounded.
 */
#define _GNU_SOURCE
#include "doorbell.h"

#include "clock.h"
#include "registry.h"

#include <errno.h>

/* While blocked, wake at least this often to re-check the peer's
   liveness: bounds how long a waiter on a dead peer can hang. */
#define LIVENESS_SLICE_MS 20
/* While spinning forever (spin_ns < 0), probe liveness this often. */
#define SPIN_LIVENESS_NS 10000000ull
/* Spinning after announcing that we may block, before the first block:
   far beyond the time a store spends in a store buffer. */
#define ANNOUNCE_GRACE_NS 100000ull

void ivshm_announce_blocking(ivshm *h, bool may_sleep)
{
    /* nobody can ring a DB_NONE attachment (see below): wakers need not
       look at it, ever */
    if (h->db && h->db->kind == DB_NONE)
        may_sleep = false;
    if (h->self < 0 || may_sleep == h->may_sleep)
        return;
    h->may_sleep = may_sleep;
    if (may_sleep)
        h->announced_ns = ivshm_now_ns();
    atomic_store_explicit(&ivshm_entry(h, h->self)->may_sleep, may_sleep,
                          memory_order_seq_cst);
}

int ivshm_wait(ivshm *h, ivshm_ready_fn ready, void *arg, int peer,
               uint32_t peer_gen, int timeout_ms)
{
    /* Every look at the clock below gives `ready` a new work budget
       (clock.h); a look that spent it makes the next one come at once. */
    ivshm_work_start(h);
    if (ready(h, arg))
        return 0;
    uint64_t t0 = ivshm_now_ns();
    uint64_t deadline = timeout_ms < 0 ? UINT64_MAX
                                       : t0 + (uint64_t)timeout_ms * 1000000ull;
    uint64_t spin_end = h->spin_ns < 0 ? UINT64_MAX : t0 + (uint64_t)h->spin_ns;
    if (spin_end < h->announced_ns + ANNOUNCE_GRACE_NS)
        spin_end = h->announced_ns + ANNOUNCE_GRACE_NS;
    uint64_t next_probe = t0 + SPIN_LIVENESS_NS;

    for (unsigned n = 1;; n++) {
        if (ready(h, arg))
            return 0;
        ivshm_cpu_relax();
        if (n % 64 && h->work_left)
            continue;
        uint64_t now = ivshm_now_ns();
        if (now >= deadline)
            return -ETIMEDOUT;
        ivshm_work_start(h);
        if (now >= spin_end)
            break;
        if (now >= next_probe) {
            next_probe = now + SPIN_LIVENESS_NS;
            if (peer >= 0 && !ivshm_peer_alive(h, peer, peer_gen))
                return IVSHM_EPEERDEAD;
        }
    }

    struct ivshm_peer_entry *me = ivshm_entry(h, h->self);
    /* Nobody can ring a DB_NONE attachment: it never announces sleep (so
       nobody tries) and its wait() is a short sleep, after which the
       loop re-checks `ready` like after any wake-up. */
    uint32_t announce = h->db->kind != DB_NONE;
    for (;;) {
        ivshm_work_start(h);
        uint64_t token = h->db->arm(h->db, h);
        atomic_store_explicit(&me->sleeping, announce, memory_order_seq_cst);
        if (announce) /* heals a co-tenant's write; ours says 1 here */
            atomic_store_explicit(&me->may_sleep, 1, memory_order_relaxed);
        atomic_thread_fence(memory_order_seq_cst);
        if (ready(h, arg)) {
            atomic_store_explicit(&me->sleeping, 0, memory_order_relaxed);
            return 0;
        }
        uint64_t now = ivshm_now_ns();
        int slice = LIVENESS_SLICE_MS;
        if (deadline != UINT64_MAX) {
            if (now >= deadline) {
                atomic_store_explicit(&me->sleeping, 0, memory_order_relaxed);
                return -ETIMEDOUT;
            }
            uint64_t left_ms = (deadline - now + 999999) / 1000000;
            if (left_ms < (uint64_t)slice)
                slice = (int)left_ms;
        }
        h->stats.sleeps++;
        int rc = h->db->wait(h->db, h, token, slice);
        atomic_store_explicit(&me->sleeping, 0, memory_order_relaxed);
        ivshm_work_start(h);
        if (ready(h, arg))
            return 0;
        if (rc < 0 && rc != -ETIMEDOUT && rc != -EINTR && rc != -EAGAIN)
            return rc;
        if (peer >= 0 && !ivshm_peer_alive(h, peer, peer_gen))
            return IVSHM_EPEERDEAD;
    }
}

void ivshm_kick(ivshm *h, int slot)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (!atomic_load_explicit(&e->may_sleep, memory_order_relaxed))
        return; /* it spins: no wake, no fence (see the top) */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&e->sleeping, memory_order_relaxed)) {
        h->stats.rings++;
        /* one load: the backend validates this copy before using it */
        int32_t id = __atomic_load_n(&e->doorbell_id, __ATOMIC_RELAXED);
        h->db->ring(h->db, h, slot, id);
    }
}

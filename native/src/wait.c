/*
 * Spin-then-block waiting (docs/waiting.md).
 *
 * A waiter spins for h->spin_ns, then announces `sleeping = 1` in its
 * registry entry and blocks on its doorbell. A producer, after publishing,
 * rings only if it sees `sleeping`: the fast path makes no system call.
 * No wake-up is lost because both sides order a store before a load with
 * a full fence (Dekker): waiter stores sleeping then re-checks the data;
 * producer stores the data then loads sleeping. At least one of them sees
 * the other's store.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>

/* While blocked, wake at least this often to re-check the peer's
   liveness: bounds how long a waiter on a dead peer can hang. */
#define LIVENESS_SLICE_MS 20
/* While spinning forever (spin_ns < 0), probe liveness this often. */
#define SPIN_LIVENESS_NS 10000000ull

int ivshm_wait(ivshm *h, ivshm_ready_fn ready, void *arg, int peer,
               uint32_t peer_gen, int timeout_ms)
{
    if (ready(h, arg))
        return 0;
    uint64_t t0 = ivshm_now_ns();
    uint64_t deadline = timeout_ms < 0 ? UINT64_MAX
                                       : t0 + (uint64_t)timeout_ms * 1000000ull;
    uint64_t spin_end = h->spin_ns < 0 ? UINT64_MAX : t0 + (uint64_t)h->spin_ns;
    uint64_t next_probe = t0 + SPIN_LIVENESS_NS;

    for (unsigned n = 1;; n++) {
        if (ready(h, arg))
            return 0;
        ivshm_cpu_relax();
        if (n % 64)
            continue;
        uint64_t now = ivshm_now_ns();
        if (now >= deadline)
            return -ETIMEDOUT;
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
        uint64_t token = h->db->arm(h->db, h);
        atomic_store_explicit(&me->sleeping, announce, memory_order_seq_cst);
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
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&e->sleeping, memory_order_relaxed)) {
        h->stats.rings++;
        /* one load: the backend validates this copy before using it */
        int32_t id = __atomic_load_n(&e->doorbell_id, __ATOMIC_RELAXED);
        h->db->ring(h->db, h, slot, id);
    }
}

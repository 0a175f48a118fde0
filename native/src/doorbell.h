/*
 * The doorbell (docs/waiting.md): the words of a registry entry's second
 * line (`sleeping`, `may_sleep`, the futex word `wake`) through which a
 * waiter that spun long enough blocks and a producer wakes it, both
 * sides (doorbell.c); and the interface of the backends that carry a
 * ring: futex on one kernel (doorbell_futex.c), eventfd from an
 * ivshmem-server (doorbell_eventfd.c), the ivshmem device's BAR0 and
 * interrupt inside a guest (doorbell_uio.c).
 */
#ifndef IVSHM_DOORBELL_H
#define IVSHM_DOORBELL_H

#include "attachment.h"

struct ivshm_doorbell {
    int kind;                 /* DB_* */
    /* Wake the peer in `slot` whose registry says `doorbell_id`. */
    int (*ring)(struct ivshm_doorbell *db, ivshm *h, int slot,
                int32_t doorbell_id);
    /* Called before announcing sleep; returns a token for wait(). */
    uint64_t (*arm)(struct ivshm_doorbell *db, ivshm *h);
    /* Block until rung (since arm) or timeout; 0, or -errno. */
    int (*wait)(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                int timeout_ms);
    /* Pollable fd, or -1. */
    int (*fd)(struct ivshm_doorbell *db);
    /* Drain out-of-band notices (server join/leave): returns number of
       peers that left since the last call and marks them dead. */
    int (*poll_notices)(struct ivshm_doorbell *db, ivshm *h);
    void (*destroy)(struct ivshm_doorbell *db);
};

/* ---- the backends ---- */
IVSHM_INTERNAL struct ivshm_doorbell *ivshm_db_futex_new(void);
/* The guest backend. When the device's vfio group is held by another
   process of the guest (EBUSY) and *doorbell_id is known (>= 0), returns
   a DB_NONE doorbell instead: the region is shared, interrupts are not. */
IVSHM_INTERNAL struct ivshm_doorbell *ivshm_db_uio_new(const char *uio_dev,
                                                       const char *bar0_path,
                                                       int32_t *doorbell_id,
                                                       int *err);
/* The eventfd backend over a connected ivshmem-server socket whose
   opening messages were read (attach_server.c). */
IVSHM_INTERNAL struct ivshm_doorbell *ivshm_db_server_new(int sock,
                                                          int32_t my_id,
                                                          int *err);

/* ---- waiting and waking ---- */

/* Spin, then declare ourselves asleep and block on the doorbell.
   `ready` is re-checked after announcing sleep so a wake cannot be lost.
   `peer`/`peer_gen` (peer < 0: none) is checked for liveness while blocked.
   Returns 0 when ready, -ETIMEDOUT, -IVSHM_EPEERDEAD. */
typedef bool (*ivshm_ready_fn)(ivshm *h, void *arg);
IVSHM_INTERNAL int ivshm_wait(ivshm *h, ivshm_ready_fn ready, void *arg,
                              int peer, uint32_t peer_gen, int timeout_ms);
/* After publishing something `slot` may wait for: ring it if it sleeps.
   The seq_cst fence pairs with the one in ivshm_wait (Dekker). */
IVSHM_INTERNAL void ivshm_kick(ivshm *h, int slot);
/* Tell the peers whether we may block from now on. */
IVSHM_INTERNAL void ivshm_announce_blocking(ivshm *h, bool may_sleep);

/* May `slot` block in a wait? If not, nothing we publish needs a wake,
   nor the fence that orders it. One load of a word that rarely
   changes. */
static inline bool ivshm_peer_may_sleep(const ivshm *h, int slot)
{
    return atomic_load_explicit(&ivshm_entry(h, slot)->may_sleep,
                                memory_order_relaxed) != 0;
}

#endif

/*
 * Futex doorbell: for peers on one kernel that map the same region file.
 * The futex word is the `wake` counter in each registry entry; a shared
 * (non-PRIVATE) futex keys on the backing page, so it works across
 * processes whatever address each one mapped the region at.
 */
#define _GNU_SOURCE
#include "doorbell.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int futex_ring(struct ivshm_doorbell *db, ivshm *h, int slot,
                      int32_t doorbell_id)
{
    (void)db;
    (void)doorbell_id;
    if (!ivshm_slot_ok(h, slot))
        return -EINVAL;
    _Atomic uint32_t *w = &ivshm_entry(h, slot)->wake;
    atomic_fetch_add_explicit(w, 1, memory_order_seq_cst);
    if (syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0) < 0)
        return -errno;
    return 0;
}

static uint64_t futex_arm(struct ivshm_doorbell *db, ivshm *h)
{
    (void)db;
    return atomic_load_explicit(&ivshm_entry(h, h->self)->wake,
                                memory_order_seq_cst);
}

static int futex_wait(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                      int timeout_ms)
{
    (void)db;
    struct timespec ts = {timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L};
    _Atomic uint32_t *w = &ivshm_entry(h, h->self)->wake;
    /* Returns at once (EAGAIN) if someone rang since arm(). */
    if (syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, (uint32_t)token,
                timeout_ms < 0 ? NULL : &ts, NULL, 0) < 0)
        return -errno;
    return 0;
}

static int futex_fd(struct ivshm_doorbell *db)
{
    (void)db;
    return -1;
}

static int futex_notices(struct ivshm_doorbell *db, ivshm *h)
{
    (void)db;
    (void)h;
    return 0;
}

static void futex_destroy(struct ivshm_doorbell *db)
{
    free(db);
}

static const struct ivshm_doorbell futex_ops = {
    .kind = DB_FUTEX,
    .ring = futex_ring,
    .arm = futex_arm,
    .wait = futex_wait,
    .fd = futex_fd,
    .poll_notices = futex_notices,
    .destroy = futex_destroy,
};

struct ivshm_doorbell *ivshm_db_futex_new(void)
{
    struct ivshm_doorbell *db = malloc(sizeof *db);
    if (db)
        *db = futex_ops;
    return db;
}

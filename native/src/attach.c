/*
 * An attachment's life: attach by path (a host file, or the BAR of the
 * ivshmem device in a guest; through a server: attach_server.c), join the
 * registry, reap dead peers, detach; and the handle's accessors.
 */
#define _GNU_SOURCE
#include "attach.h"

#include "clock.h"
#include "doorbell.h"
#include "peer_local.h"
#include "region.h"
#include "registry.h"
#include "rx_area.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The integer in environment variable `name` if it is set, a whole
   number and within [lo, hi]. */
static bool env_number(const char *name, long long lo, long long hi,
                       long long *out)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return false;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*end != '\0' || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

/* IVSHM_SPIN_NS: the spin budget when the config leaves it at 0. */
static int64_t default_spin_ns(void)
{
    long long v;
    if (env_number("IVSHM_SPIN_NS", LLONG_MIN, LLONG_MAX, &v))
        return v;
    return 20000; /* 20 us: several round trips of a busy peer */
}

/* IVSHM_LOCK_TIMEOUT_MS: how long a window lock (and, capped at 5 s,
   the allocation lock) may be waited for while a live peer holds it. */
static uint64_t default_lock_timeout_ns(void)
{
    long long v;
    if (env_number("IVSHM_LOCK_TIMEOUT_MS", 1, 3600000, &v))
        return (uint64_t)v * 1000000ull;
    return 30ull * 1000000000ull;
}

/* IVSHM_FAST_AFTER: messages sent to a peer through its queue before we
   try to take a fast channel to it (0: at the first message). */
static uint32_t default_fast_after(void)
{
    long long v;
    if (env_number("IVSHM_FAST_AFTER", 0, 1000000000, &v))
        return (uint32_t)v;
    return 4;
}

int ivshm_join(ivshm *h, const ivshm_config *cfg, int32_t doorbell_id,
               int backend)
{
    if (cfg->name && strlen(cfg->name) >= sizeof(((struct ivshm_peer_entry *)0)->name))
        return -ENAMETOOLONG;
    h->job_id = cfg->job_id;
    h->rank = cfg->rank;
    h->spin_ns = cfg->spin_ns ? cfg->spin_ns : default_spin_ns();
    h->lock_timeout_ns = default_lock_timeout_ns();
    h->fast_after = default_fast_after();

    /* A (job, rank) pair names one process: refuse a live duplicate. */
    int dup = ivshm_find(h, cfg->job_id, cfg->rank);
    if (dup >= 0)
        return -EEXIST;

    /* nobody can ring a DB_NONE attachment: it never announces sleep */
    const bool may_sleep =
        h->spin_ns >= 0 && (!h->db || h->db->kind != DB_NONE);
    for (int attempt = 0; attempt < 2; attempt++) {
        uint32_t gen;
        if (ivshm_registry_claim(h, cfg, doorbell_id, backend, may_sleep,
                                 &gen) == 0) {
            for (uint32_t x = 0; x < h->max_peers; x++)
                ivshm_peer_local_reset(h, (int)x, 0);
            /* nobody sends to a slot that is not ACTIVE: ours to empty */
            ivshm_rx_area_reset(h);
            ivshm_registry_publish(h, gen);
            return 0;
        }
        /* Full: dead peers may still hold slots. */
        if (ivshm_reap(h) == 0)
            break;
    }
    h->self = -1;
    return IVSHM_EFULL;
}

int ivshm_reap(ivshm *h)
{
    int dead = 0;
    if (h->db && h->db->poll_notices) {
        int n = h->db->poll_notices(h->db, h);
        if (n > 0)
            dead += n;
    }
    ivshm_work_count(h, h->max_peers);
    for (uint32_t s = 0; s < h->max_peers; s++) {
        struct ivshm_peer_entry *e = ivshm_entry(h, (int)s);
        if ((int)s == h->self ||
            atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE)
            continue;
        if (!ivshm_peer_alive(h, (int)s, 0))
            dead++;
    }
    if (h->self >= 0)
        ivshm_fast_sweep(h);
    return dead;
}

int ivshm_attach_path(const char *path, const ivshm_config *cfg, ivshm **out)
{
    if (!path || !cfg || !out)
        return -EINVAL;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ivshm *h;
    int rc = cfg->flags & IVSHM_F_FORMAT ? ivshm_region_map_or_format(fd, &h)
                                         : ivshm_region_map(fd, &h);
    if (rc < 0) {
        close(fd);
        return rc;
    }
    int32_t db_id = -1;
    int kind = DB_FUTEX;
    if (cfg->uio_dev && cfg->bar0_path) {
        db_id = cfg->doorbell_id;
        h->db = ivshm_db_uio_new(cfg->uio_dev, cfg->bar0_path, &db_id, &rc);
        kind = h->db ? h->db->kind : DB_UIO;
    } else {
        h->db = ivshm_db_futex_new();
        if (!h->db)
            rc = -ENOMEM;
    }
    if (h->db)
        rc = ivshm_join(h, cfg, db_id, kind);
    if (rc < 0) {
        if (h->db)
            h->db->destroy(h->db);
        ivshm_region_unmap(h);
        return rc;
    }
    *out = h;
    return 0;
}

void ivshm_detach(ivshm *h)
{
    if (!h)
        return;
    if (h->self >= 0)
        ivshm_registry_leave(h);
    /* local memory only: what we kept for each peer */
    for (uint32_t x = 0; x < h->max_peers; x++)
        ivshm_peer_local_free(h, (int)x);
    if (h->db)
        h->db->destroy(h->db);
    ivshm_region_unmap(h);
}

void ivshm_get_stats(const ivshm *h, ivshm_stats *out)
{
    *out = h->stats;
}

void ivshm_get_geometry(const ivshm *h, ivshm_geometry *out)
{
    out->max_peers = h->max_peers;
    out->ring_slots = h->ring_slots;
    out->slot_size = h->slot_size;
    out->max_windows = h->max_windows;
    out->queue_slots = h->queue_slots;
    out->fast_channels = h->fast_channels ? h->fast_channels : IVSHM_FAST_NONE;
}

void ivshm_set_spin(ivshm *h, int64_t spin_ns)
{
    h->spin_ns = spin_ns;
    ivshm_announce_blocking(h, spin_ns >= 0);
}

int ivshm_event_fd(ivshm *h)
{
    return h->db && h->db->fd ? h->db->fd(h->db) : -1;
}

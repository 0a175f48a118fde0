/*
 * Peer registry: the locality detector. Every attached peer publishes
 * (job, rank, name, doorbell id, pid) in a slot; anyone who can read the
 * region is co-resident with everyone listed there.
 *
 * Slot life cycle: FREE/DEAD -> CLAIMING (CAS, owner fills identity and
 * empties its own receive area) -> ACTIVE (release) -> FREE at
 * detach, or DEAD when found dead (pid gone, or the server's leave
 * notice). `gen` bumps at every claim, so peers can tell a new incarnation
 * from the old one and reset their local ring positions.
 */
#define _GNU_SOURCE
#include "registry.h"

#include "clock.h"
#include "window_table.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The FREE or DEAD slot claimed the fewest times (lowest generation,
   0 for never), or -1. Invariant: a slot whose peer left or died is
   claimed again as late as the registry allows, because its claim ends
   the delivery of what that peer published and nobody has read yet
   (RX_GONE, peer_local.c: a receiver may start reading after the sender
   is gone). Claims taken this way keep the generations of cycling slots
   within one of each other, so the slot claimed longest ago goes first,
   and the one just left last. A co-tenant's forged generations only
   change the choice; the CAS decides. */
static int least_claimed(ivshm *h)
{
    int best = -1;
    uint32_t best_gen = 0;
    for (uint32_t s = 0; s < h->max_peers; s++) {
        struct ivshm_peer_entry *e = ivshm_entry(h, (int)s);
        uint32_t st = atomic_load_explicit(&e->state, memory_order_relaxed);
        if (st != PEER_FREE && st != PEER_DEAD)
            continue;
        uint32_t gen = atomic_load_explicit(&e->gen, memory_order_relaxed);
        if (best < 0 || gen < best_gen) {
            best = (int)s;
            best_gen = gen;
        }
    }
    return best;
}

int ivshm_registry_claim(ivshm *h, const ivshm_config *cfg,
                         int32_t doorbell_id, int backend, bool may_sleep,
                         uint32_t *gen_out)
{
    /* a lost CAS means somebody else took that slot: max_peers tries */
    for (uint32_t tries = 0; tries < h->max_peers; tries++) {
        int found = least_claimed(h);
        if (found < 0)
            break;
        uint32_t s = (uint32_t)found;
        struct ivshm_peer_entry *e = ivshm_entry(h, found);
        uint32_t st = atomic_load_explicit(&e->state, memory_order_relaxed);
        if (st != PEER_FREE && st != PEER_DEAD)
            continue;
        if (!atomic_compare_exchange_strong(&e->state, &st, PEER_CLAIMING))
            continue;
        /* The slot is ours; leftovers of a dead owner go first. */
        h->self = (int)s;
        ivshm_windows_on_leave(h, (int)s);
        uint32_t gen = atomic_load_explicit(&e->gen, memory_order_relaxed) + 1;
        if (gen == 0)
            gen = 1; /* 0 means "never talked" in ivshm_peer_local */
        atomic_store_explicit(&e->gen, gen, memory_order_relaxed);
        e->job_id = cfg->job_id;
        e->rank = cfg->rank;
        e->doorbell_id = doorbell_id;
        e->pid = (int32_t)getpid();
        e->backend = (uint32_t)backend;
        e->pidns = h->pidns;
        memset(e->name, 0, sizeof e->name);
        if (cfg->name)
            memcpy(e->name, cfg->name, strlen(cfg->name));
        atomic_store_explicit(&e->sleeping, 0, memory_order_relaxed);
        /* published with the state below: no waker has looked yet,
           so no grace is owed (doorbell.c) */
        h->may_sleep = may_sleep;
        h->announced_ns = 0;
        atomic_store_explicit(&e->may_sleep, h->may_sleep,
                              memory_order_relaxed);
        atomic_store_explicit(&e->heartbeat, ivshm_now_ns(), memory_order_relaxed);
        /* a request to the slot's last holder is not ours */
        atomic_store_explicit(&e->drain_req, 0, memory_order_relaxed);
        atomic_store_explicit(&e->drain_ack, 0, memory_order_relaxed);
        atomic_store_explicit(&e->drain_status, 0, memory_order_relaxed);
        *gen_out = gen;
        return 0;
    }
    return IVSHM_EFULL;
}

void ivshm_registry_publish(ivshm *h, uint32_t gen)
{
    h->self_gen = gen;
    atomic_store_explicit(&ivshm_entry(h, h->self)->state, PEER_ACTIVE,
                          memory_order_release);
}

void ivshm_registry_leave(ivshm *h)
{
    if (h->self < 0)
        return;
    ivshm_windows_on_leave(h, h->self);
    struct ivshm_peer_entry *e = ivshm_entry(h, h->self);
    atomic_store_explicit(&e->state, PEER_FREE, memory_order_release);
    h->self = -1;
}

static bool mark_dead(ivshm *h, int slot, uint32_t gen)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    uint32_t st = PEER_ACTIVE;
    if (atomic_load_explicit(&e->gen, memory_order_acquire) != gen)
        return false;
    /* O(1): what it held in the window tables is broken by whoever
       waits for it, and not counted as a member (window_table.h) */
    return atomic_compare_exchange_strong(&e->state, &st, PEER_DEAD);
}

/* Process state from /proc: a zombie (killed, not yet reaped by its
   parent) still answers kill(pid, 0) but is gone for us. */
static bool pid_gone(int32_t pid)
{
    if (pid <= 0)
        return false;
    if (kill(pid, 0) < 0 && errno == ESRCH)
        return true;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = '\0';
    const char *rp = strrchr(buf, ')'); /* comm may contain spaces */
    return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

bool ivshm_peer_alive(ivshm *h, int slot, uint32_t gen)
{
    if (!ivshm_slot_ok(h, slot))
        return false;
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE)
        return false;
    uint32_t cur = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (gen != 0 && cur != gen)
        return false;
    /* Only a peer in our pid namespace can be probed by pid; others (VMs,
       other instances) are declared dead by the server's leave notice.
       Each field is loaded once: the owner (or a scribbler) may change
       it while we look, and a copy cannot change between check and use. */
    uint64_t pidns = __atomic_load_n(&e->pidns, __ATOMIC_RELAXED);
    int32_t pid = __atomic_load_n(&e->pid, __ATOMIC_RELAXED);
    if (pidns == h->pidns && h->pidns != 0 && slot != h->self &&
        pid_gone(pid)) {
        mark_dead(h, slot, cur);
        return false;
    }
    return true;
}

static int cmp_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

/* One pass over the registry for a whole batch of leavers: O(max_peers x
   log n + n log n), however many entries carry their ids (a leaver can
   have written its id into every entry). `ids` is sorted in place. */
int ivshm_mark_doorbells_dead(ivshm *h, int32_t *ids, size_t n)
{
    if (n == 0)
        return 0;
    if (n > 1)
        qsort(ids, n, sizeof *ids, cmp_id);
    int marked = 0;
    ivshm_work_count(h, h->max_peers);
    for (uint32_t s = 0; s < h->max_peers; s++) {
        struct ivshm_peer_entry *e = ivshm_entry(h, (int)s);
        if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE)
            continue;
        int32_t id = __atomic_load_n(&e->doorbell_id, __ATOMIC_RELAXED);
        if (id >= 0 && bsearch(&id, ids, n, sizeof *ids, cmp_id) &&
            mark_dead(h, (int)s,
                      atomic_load_explicit(&e->gen, memory_order_relaxed)))
            marked++;
    }
    return marked;
}

int ivshm_mark_doorbell_dead(ivshm *h, int32_t doorbell_id)
{
    return doorbell_id < 0 ? 0 : ivshm_mark_doorbells_dead(h, &doorbell_id, 1);
}

/* ---- drain requests (docs/migration.md) ---- */

uint32_t ivshm_drain_requested(const ivshm *h)
{
    if (!h || h->self < 0)
        return 0;
    uint32_t req = atomic_load_explicit(&ivshm_entry(h, h->self)->drain_req,
                                        memory_order_relaxed);
    uint32_t ack = atomic_load_explicit(&ivshm_entry(h, h->self)->drain_ack,
                                        memory_order_relaxed);
    return req != ack ? req : 0;
}

void ivshm_drain_ack(ivshm *h, uint32_t req, int32_t status)
{
    if (!h || h->self < 0)
        return;
    struct ivshm_peer_entry *e = ivshm_entry(h, h->self);
    atomic_store_explicit(&e->drain_status, status, memory_order_relaxed);
    atomic_store_explicit(&e->drain_ack, req, memory_order_release);
}

int ivshm_drain_request(ivshm *h, int slot, uint32_t gen, uint32_t req)
{
    if (slot < 0 || (uint32_t)slot >= h->max_peers || req == 0)
        return -EINVAL;
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE ||
        atomic_load_explicit(&e->gen, memory_order_acquire) != gen)
        return -ENOENT;
    atomic_store_explicit(&e->drain_req, req, memory_order_release);
    return 0;
}

int ivshm_drain_request_id(ivshm *h, int32_t doorbell_id, uint32_t req)
{
    if (doorbell_id < 0 || req == 0)
        return -EINVAL;
    int n = 0;
    ivshm_work_count(h, h->max_peers);
    for (uint32_t s = 0; s < h->max_peers; s++) {
        struct ivshm_peer_entry *e = ivshm_entry(h, (int)s);
        if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE ||
            __atomic_load_n(&e->doorbell_id, __ATOMIC_RELAXED) != doorbell_id)
            continue;
        atomic_store_explicit(&e->drain_req, req, memory_order_release);
        n++;
    }
    return n;
}

int ivshm_drain_state(ivshm *h, int slot, uint32_t gen, uint32_t req,
                      int32_t *status)
{
    if (slot < 0 || (uint32_t)slot >= h->max_peers)
        return -EINVAL;
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    /* each word read once; the owner writes the status before the ack */
    uint32_t g = atomic_load_explicit(&e->gen, memory_order_acquire);
    uint32_t ack = atomic_load_explicit(&e->drain_ack, memory_order_acquire);
    int32_t st = atomic_load_explicit(&e->drain_status, memory_order_relaxed);
    uint32_t state = atomic_load_explicit(&e->state, memory_order_acquire);
    if (g != gen)
        return -ENOENT; /* claimed again since: whatever it said is gone */
    if (ack == req) {
        if (status)
            *status = st;
        return 1;
    }
    return state == PEER_ACTIVE ? 0 : -ENOENT;
}

int ivshm_self(const ivshm *h)
{
    return h->self;
}

int ivshm_max_peers(const ivshm *h)
{
    return (int)h->max_peers;
}

/* The entry of `slot` while its state is one of `want` (a bit per
   state) and its generation stays: 0 and *out filled, else -ENOENT. */
static int read_entry(ivshm *h, int slot, ivshm_peer_info *out,
                      unsigned want)
{
    if (!ivshm_slot_ok(h, slot) || !out)
        return -EINVAL;
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    uint32_t st = atomic_load_explicit(&e->state, memory_order_acquire);
    if (st > PEER_DEAD || !(want & 1u << st))
        return -ENOENT;
    /* Copy field by field, each loaded once; the owner could rewrite
       them, but they are only reported, never used as indices here. */
    out->slot = slot;
    out->generation = atomic_load_explicit(&e->gen, memory_order_relaxed);
    out->job_id = __atomic_load_n(&e->job_id, __ATOMIC_RELAXED);
    out->rank = __atomic_load_n(&e->rank, __ATOMIC_RELAXED);
    out->doorbell_id = __atomic_load_n(&e->doorbell_id, __ATOMIC_RELAXED);
    out->pid = __atomic_load_n(&e->pid, __ATOMIC_RELAXED);
    for (size_t i = 0; i < sizeof e->name; i++)
        out->name[i] = __atomic_load_n(&e->name[i], __ATOMIC_RELAXED);
    out->name[sizeof e->name - 1] = '\0';
    /* still that incarnation: a claim meanwhile changed the state (to
       CLAIMING) and the generation, before it rewrote the fields */
    atomic_thread_fence(memory_order_acquire);
    st = atomic_load_explicit(&e->state, memory_order_relaxed);
    if (st > PEER_DEAD || !(want & 1u << st) ||
        atomic_load_explicit(&e->gen, memory_order_relaxed) != out->generation)
        return -ENOENT;
    return 0;
}

int ivshm_peer(ivshm *h, int slot, ivshm_peer_info *out)
{
    return read_entry(h, slot, out, 1u << PEER_ACTIVE);
}

/* A peer that left (FREE) or died (DEAD) keeps its entry until the slot
   is claimed again (which bumps the generation first): its identity is
   still the one of the messages it published (RX_GONE). A FREE slot of
   generation 0 was never held. */
int ivshm_peer_last(ivshm *h, int slot, ivshm_peer_info *out)
{
    int rc = read_entry(h, slot, out, 1u << PEER_ACTIVE);
    if (rc != -ENOENT)
        return rc;
    rc = read_entry(h, slot, out, 1u << PEER_FREE | 1u << PEER_DEAD);
    if (rc < 0 || out->generation == 0)
        return -ENOENT;
    return 1;
}

/* Detach frees the slot (ivshm_registry_leave); a death found by
   anyone marks it DEAD, and a peer that never detached stays ACTIVE
   until then. */
int ivshm_peer_left(ivshm *h, int slot, uint32_t generation)
{
    ivshm_peer_info info;
    int rc = read_entry(h, slot, &info, 1u << PEER_FREE);
    if (rc == -EINVAL)
        return rc;
    return rc == 0 && generation != 0 && info.generation == generation;
}

int64_t ivshm_peer_generation(ivshm *h, int slot)
{
    if (!ivshm_slot_ok(h, slot))
        return -EINVAL;
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE)
        return -ENOENT;
    /* loaded once; a generation read after ACTIVE was seen is one the
       slot had while active (it only grows) */
    return atomic_load_explicit(&e->gen, memory_order_relaxed);
}

int ivshm_peer_local(ivshm *h, int slot)
{
    if (!ivshm_slot_ok(h, slot))
        return -EINVAL;
    uint64_t pidns = __atomic_load_n(&ivshm_entry(h, slot)->pidns,
                                     __ATOMIC_RELAXED);
    return h->pidns != 0 && pidns == h->pidns;
}

int ivshm_find(ivshm *h, uint64_t job_id, uint32_t rank)
{
    ivshm_work_count(h, h->max_peers);
    for (uint32_t s = 0; s < h->max_peers; s++) {
        struct ivshm_peer_entry *e = ivshm_entry(h, (int)s);
        if (atomic_load_explicit(&e->state, memory_order_acquire) == PEER_ACTIVE &&
            __atomic_load_n(&e->job_id, __ATOMIC_RELAXED) == job_id &&
            __atomic_load_n(&e->rank, __ATOMIC_RELAXED) == rank &&
            ivshm_peer_alive(h, (int)s, 0))
            return (int)s;
    }
    return -ENOENT;
}

/*
 * The marking thread (marker.h). Two single-producer, single-consumer
 * rings and two eventfds, no lock: the thread runs at a lower priority
 * and may be preempted anywhere, and a lock it held then would stall
 * the event loop for as long (on a loaded host, hundreds of ms).
 *   todo: the loop appends, then bumps todo_efd; the thread takes ids
 *         until the ring is empty, then blocks reading todo_efd.
 *   done: the thread appends, then bumps done_efd, which the loop polls;
 *         the loop resets it before it drains the ring, so an id
 *         appended meanwhile leaves it readable.
 */
#define _GNU_SOURCE
#include "marker.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

/* Below the event loop: a leaver whose co-tenants armed the registry
   costs this thread CPU time, never the loop's. */
#define MARKER_NICE 10

struct ring {
    struct ivs_marked *items;
    _Atomic uint64_t head, tail; /* consumer's, producer's */
};

struct ivs_marker {
    ivshm_admin *region;
    uint32_t capacity;
    pthread_t thread;
    struct ring todo, done;
    atomic_bool stopping;
    int todo_efd, done_efd;
};

static void ring_put(struct ring *r, uint32_t cap, struct ivs_marked m)
{
    uint64_t t = atomic_load_explicit(&r->tail, memory_order_relaxed);
    r->items[t % cap] = m;
    atomic_store_explicit(&r->tail, t + 1, memory_order_release);
}

static bool ring_get(struct ring *r, uint32_t cap, struct ivs_marked *out)
{
    uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (h == atomic_load_explicit(&r->tail, memory_order_acquire))
        return false;
    *out = r->items[h % cap];
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
    return true;
}

static void bump(int efd)
{
    uint64_t one = 1;
    ssize_t n = write(efd, &one, sizeof one);
    (void)n; /* cannot fail: each reader resets the counter */
}

static void *marker_main(void *arg)
{
    struct ivs_marker *m = arg;
    setpriority(PRIO_PROCESS, (id_t)gettid(), MARKER_NICE);
    for (;;) {
        struct ivs_marked job;
        while (ring_get(&m->todo, m->capacity, &job)) {
            job.entries = ivshm_admin_mark_dead(m->region, job.id);
            ring_put(&m->done, m->capacity, job);
            bump(m->done_efd);
        }
        if (atomic_load(&m->stopping))
            return NULL; /* and the queue is empty */
        uint64_t count;
        ssize_t n = read(m->todo_efd, &count, sizeof count); /* blocks */
        (void)n;
    }
}

int ivs_marker_start(ivshm_admin *region, uint32_t capacity,
                     struct ivs_marker **out)
{
    struct ivs_marker *m = calloc(1, sizeof *m);
    if (!m)
        return -ENOMEM;
    m->region = region;
    m->capacity = capacity;
    m->todo.items = calloc(capacity, sizeof *m->todo.items);
    m->done.items = calloc(capacity, sizeof *m->done.items);
    m->todo_efd = eventfd(0, EFD_CLOEXEC);
    m->done_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int rc = !m->todo.items || !m->done.items         ? -ENOMEM
             : m->todo_efd < 0 || m->done_efd < 0     ? -errno
                                                      : 0;
    if (rc == 0) {
        /* The stop signals are for the event loop's ppoll only. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        rc = -pthread_create(&m->thread, NULL, marker_main, m);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    if (rc < 0) {
        if (m->todo_efd >= 0)
            close(m->todo_efd);
        if (m->done_efd >= 0)
            close(m->done_efd);
        free(m->todo.items);
        free(m->done.items);
        free(m);
        return rc;
    }
    *out = m;
    return 0;
}

int ivs_marker_fd(const struct ivs_marker *m)
{
    return m->done_efd;
}

void ivs_marker_push(struct ivs_marker *m, int32_t id)
{
    ring_put(&m->todo, m->capacity, (struct ivs_marked){id, 0});
    bump(m->todo_efd);
}

size_t ivs_marker_done(struct ivs_marker *m, struct ivs_marked *out,
                       size_t cap)
{
    uint64_t count;
    ssize_t r = read(m->done_efd, &count, sizeof count);
    (void)r; /* EAGAIN: nothing new since the last reset */
    size_t n = 0;
    while (n < cap && ring_get(&m->done, m->capacity, &out[n]))
        n++;
    if (n == cap)
        bump(m->done_efd); /* more may wait: stay readable */
    return n;
}

void ivs_marker_stop(struct ivs_marker *m)
{
    if (!m)
        return;
    atomic_store(&m->stopping, true);
    bump(m->todo_efd);
    pthread_join(m->thread, NULL);
    close(m->todo_efd);
    close(m->done_efd);
    free(m->todo.items);
    free(m->done.items);
    free(m);
}

/*
 * The marking thread (marker.h): two rings under one mutex, the queue
 * and the done list, and an eventfd that is readable while the done
 * list is not empty. The thread holds the mutex only to move one id.
 */
#define _GNU_SOURCE
#include "marker.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
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
    uint64_t head, tail;
};

struct ivs_marker {
    ivshm_admin *region;
    uint32_t capacity;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct ring todo, done;
    bool stopping;
    int efd;
};

static void ring_put(struct ring *r, uint32_t cap, struct ivs_marked m)
{
    r->items[r->tail++ % cap] = m;
}

static struct ivs_marked ring_get(struct ring *r, uint32_t cap)
{
    return r->items[r->head++ % cap];
}

static void *marker_main(void *arg)
{
    struct ivs_marker *m = arg;
    setpriority(PRIO_PROCESS, (id_t)gettid(), MARKER_NICE);
    pthread_mutex_lock(&m->lock);
    for (;;) {
        while (m->todo.head == m->todo.tail && !m->stopping)
            pthread_cond_wait(&m->wake, &m->lock);
        if (m->todo.head == m->todo.tail)
            break; /* stopping, and nothing left to mark */
        struct ivs_marked job = ring_get(&m->todo, m->capacity);
        pthread_mutex_unlock(&m->lock);
        job.entries = ivshm_admin_mark_dead(m->region, job.id);
        pthread_mutex_lock(&m->lock);
        bool was_empty = m->done.head == m->done.tail;
        ring_put(&m->done, m->capacity, job);
        if (was_empty) {
            uint64_t one = 1;
            ssize_t n = write(m->efd, &one, sizeof one);
            (void)n; /* cannot fail: the counter is reset below 2^64 */
        }
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
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
    m->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int rc = !m->todo.items || !m->done.items ? -ENOMEM
             : m->efd < 0                      ? -errno
                                               : 0;
    if (rc == 0) {
        pthread_mutex_init(&m->lock, NULL);
        pthread_cond_init(&m->wake, NULL);
        /* The stop signals are for the event loop's ppoll only. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        rc = -pthread_create(&m->thread, NULL, marker_main, m);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc < 0) {
            pthread_mutex_destroy(&m->lock);
            pthread_cond_destroy(&m->wake);
        }
    }
    if (rc < 0) {
        if (m->efd >= 0)
            close(m->efd);
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
    return m->efd;
}

void ivs_marker_push(struct ivs_marker *m, int32_t id)
{
    pthread_mutex_lock(&m->lock);
    ring_put(&m->todo, m->capacity, (struct ivs_marked){id, 0});
    pthread_cond_signal(&m->wake);
    pthread_mutex_unlock(&m->lock);
}

size_t ivs_marker_done(struct ivs_marker *m, struct ivs_marked *out,
                       size_t cap)
{
    size_t n = 0;
    pthread_mutex_lock(&m->lock);
    while (n < cap && m->done.head != m->done.tail)
        out[n++] = ring_get(&m->done, m->capacity);
    if (m->done.head == m->done.tail) {
        uint64_t count;
        ssize_t r = read(m->efd, &count, sizeof count);
        (void)r; /* EAGAIN: already reset */
    }
    pthread_mutex_unlock(&m->lock);
    return n;
}

void ivs_marker_stop(struct ivs_marker *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->lock);
    m->stopping = true;
    pthread_cond_signal(&m->wake);
    pthread_mutex_unlock(&m->lock);
    pthread_join(m->thread, NULL);
    pthread_mutex_destroy(&m->lock);
    pthread_cond_destroy(&m->wake);
    close(m->efd);
    free(m->todo.items);
    free(m->done.items);
    free(m);
}

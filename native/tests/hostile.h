/* Shared by the test_hostile_*.c files: attacks by a co-tenant of the
   region (docs/security.md, "libivshm"), each file one family of them,
   each attack replayed by a real hostile thread or process. Time bounds
   are generous (the machine is shared): they separate "returned by its
   deadline" from "hung", not fast from slow. */
#ifndef IVSHM_HOSTILE_H
#define IVSHM_HOSTILE_H

#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* The job of the attack at hand (bumped by each test: a fresh region
   and fresh ranks) and its region file. */
static uint64_t job = 0x4057;
static const char *path;

/* The fast ring from -> to (opened with ivshm_fast_open: these attacks
   write into a pair's ring; test_queue attacks the shared queues). */
static inline uint8_t *fast_ring(ivshm *h, int from, int to)
{
    uint8_t *r = ivshm_fast_ring_of(h, from, to);
    if (!r) {
        fprintf(stderr, "no fast ring %d -> %d\n", from, to);
        exit(1);
    }
    return r;
}

static inline struct ivshm_slot *ring_slot(ivshm *h, int from, int to,
                                           uint64_t pos)
{
    return (struct ivshm_slot *)(fast_ring(h, from, to) + IVSHM_RING_CTRL +
                                 (pos & (h->ring_slots - 1)) *
                                     (uint64_t)h->slot_size);
}

static inline struct ivshm_ring_ctrl *ring_ctrl(ivshm *h, int from, int to)
{
    return (struct ivshm_ring_ctrl *)fast_ring(h, from, to);
}

/* Publish a hand-made fragment at `pos` of ring(h -> to), bypassing
   every check ivshm_send makes: what a hostile sender can do. */
static inline void raw_publish(ivshm *h, int to, uint64_t pos, uint32_t tag,
                               uint32_t flags, uint32_t len, uint64_t total,
                               uint8_t fill)
{
    struct ivshm_slot *s = ring_slot(h, h->self, to, pos);
    s->len = len;
    s->tag = tag;
    s->gen = h->self_gen;
    s->flags = flags;
    s->total = total;
    memset((uint8_t *)s + IVSHM_SLOT_HDR, fill, len);
    atomic_store_explicit(&s->seq, pos + 1, memory_order_release);
    ivshm_kick(h, to);
}

/* Before the tests of a file: pairs on their fast rings from the first
   message on, and a dead peer's pipe is an error return, not a signal. */
static inline void hostile_setup(void)
{
    signal(SIGPIPE, SIG_IGN);
    setenv("IVSHM_FAST_AFTER", "0", 1);
}

#endif

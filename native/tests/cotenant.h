/* A co-tenant's view of a region (mapped read-write, no registry slot,
   the layout of src/internal.h) and what the tests that play one share:
   gates between processes, timings of victim calls against their stated
   bounds. Linked into every C test. */
#ifndef IVSHM_TESTS_COTENANT_H
#define IVSHM_TESTS_COTENANT_H

#include "internal.h"

#include <stdbool.h>
#include <stdint.h>

/* Map the region at `path` as a co-tenant without a registry slot:
   the handle only addresses shared memory (ivshm_entry, ivshm_qcell,
   ivshm_fring...). Exits the process on failure. */
ivshm *ct_map(const char *path);
void ct_unmap(ivshm *raw);

/* The fast ring `from` -> `to` as its descriptor names it, or NULL. */
uint8_t *ct_ring(ivshm *raw, int from, int to);
static inline struct ivshm_slot *ct_slot(ivshm *raw, uint8_t *ring,
                                         uint64_t pos)
{
    return (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                 (pos & (raw->ring_slots - 1)) *
                                     (uint64_t)raw->slot_size);
}

/* Pin the calling process to the n-th CPU of those the test process
   started with (ct_pin_init, called first), where there are two or
   more: an attack that must keep pace with its victim needs both to
   run at once, not in turns on one CPU. ct_unpin undoes it. */
void ct_pin_init(void);
void ct_pin(int n);
void ct_unpin(void);

/* A one-byte pipe between a test and its children: ct_signal writes,
   ct_await reads within timeout_ms (false on timeout or EOF). */
struct ct_gate {
    int fd[2];
};
void ct_gate_init(struct ct_gate *g);
void ct_signal(struct ct_gate *g);
bool ct_await(struct ct_gate *g, int timeout_ms);

/* The longest of a series of timed calls, and how many there were. */
struct ct_timing {
    uint64_t calls, worst_ns, total_ns;
};
static inline void ct_note(struct ct_timing *t, uint64_t ns)
{
    t->calls++;
    t->total_ns += ns;
    if (ns > t->worst_ns)
        t->worst_ns = ns;
}

/* The work of one victim call, as the counting library measures it
   (tests linked with ivshm_counted; src/clock.h, "the work budget"):
   ct_work_begin before the call, ct_work_end after it. */
struct ct_work {
    uint64_t start; /* work_units when the call began */
    uint64_t total; /* units of the call */
    uint64_t peak;  /* the most between two looks at the clock */
};
static inline void ct_work_begin(ivshm *h, struct ct_work *w)
{
    w->start = h->work_units;
    h->work_mark = h->work_units;
    h->work_peak = 0;
}
static inline void ct_work_end(ivshm *h, struct ct_work *w)
{
    uint64_t run = h->work_units - h->work_mark;
    w->total = h->work_units - w->start;
    w->peak = run > h->work_peak ? run : h->work_peak;
}
/* The bounds ivshm.h states ("Bounds"), in units, for its geometry: a
   message call between two looks at the clock, and a call that never
   waits in all. */
static inline uint64_t ct_bound_per_look(const ivshm *h)
{
    return 2ull * ivshm_work_budget(h);
}
static inline uint64_t ct_bound_nowait(const ivshm *h)
{
    return 3ull * ivshm_work_budget(h);
}

#endif

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

#endif

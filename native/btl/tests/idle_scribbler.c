/*
 * A co-tenant that maps a region and scribbles what ivshm_recv_idle
 * reads, for tests/test_btl_trust.py: in every receive area, the head
 * slot of each fast ring in use and the queue's head cell and
 * enqueue_pos. Only what an MPI job must survive untouched: a
 * published ring message made to look empty (at most one every 50 ms,
 * and on each ring at most one per HIDE_EVERY slots its receiver took:
 * the receiver shows it again within its 200 ms sweep, so hiding costs
 * the job at most 200 ms per HIDE_EVERY slots, whatever the load; by
 * time alone, on a loaded machine, where messages wait long for their
 * receiver, 1600 were hidden and the 2000 round trips took 225 s, past
 * the test's 180), "empty"
 * garbage in free head slots and cells, enqueue_pos out of range. No
 * forged message: the BTL hands ob1 raw fragments, and a forgery a
 * validation cannot tell from a rank's own is why a region belongs to
 * one job (docs/security.md). Each write is a CAS on the value seen,
 * so it never lands on what a sender published since.
 *   idle_scribbler REGION SECONDS   (until then or SIGTERM; then prints
 *   what landed, as JSON)
 * Built with -I native/src: it reads the layout from the header
 * (scribbler.h).
 */
#include "scribbler.h"

#define HIDE_EVERY 1024 /* slots: a 1 MiB message takes 256 */

static bool cas(_Atomic uint64_t *p, uint64_t seen, uint64_t to)
{
    return atomic_compare_exchange_strong(p, &seen, to);
}

int main(int argc, char **argv)
{
    struct scribbled r;
    int rc = scribbler_open("idle_scribbler", argc, argv, &r);
    if (rc)
        return rc;
    uint8_t *const base = r.base;
    const struct ivshm_header hdr = r.hdr;
    const uint64_t S = r.S, Q = r.Q, Z = r.Z;
    const uint32_t F = r.F;
    unsigned long long hide = 0, ring_junk = 0, q_junk = 0, enq = 0;
    const uint64_t end = r.end_ms;
    uint64_t next_hide = 0;
    /* per ring: the tail at which the next hide may land */
    uint64_t *hide_from = calloc((size_t)hdr.max_peers * F, sizeof *hide_from);
    if (!hide_from)
        return 1;
    for (unsigned n = 0; !stop && now_ms() < end; n++) {
        for (uint32_t j = 0; j < hdr.max_peers; j++) {
            uint8_t *area = base + hdr.rx_off + j * hdr.rx_bytes;
            struct ivshm_queue_ctrl *qc = (struct ivshm_queue_ctrl *)area;
            uint8_t *cells = area + IVSHM_QUEUE_CTRL;
            struct ivshm_fast_desc *desc =
                (struct ivshm_fast_desc *)(cells + Q * Z);
            uint8_t *rings = (uint8_t *)(desc + F);
            for (uint32_t k = 0; k < F; k++) {
                if (!atomic_load(&desc[k].owner))
                    continue;
                uint8_t *ring = rings + k * hdr.ring_bytes;
                uint64_t tail =
                    atomic_load(&((struct ivshm_ring_ctrl *)ring)->tail);
                struct ivshm_slot *s =
                    (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                          (tail & (S - 1)) * Z);
                uint64_t v = atomic_load(&s->seq);
                uint64_t *from = &hide_from[j * F + k];
                if (v == tail + 1 && now_ms() >= next_hide && tail >= *from) {
                    if (cas(&s->seq, v, tail)) {
                        hide++;
                        next_hide = now_ms() + 50;
                        *from = tail + HIDE_EVERY;
                    }
                } else if (v <= tail && v != tail - S + 1 + (n & 1)) {
                    /* still free: another "empty" value */
                    ring_junk += cas(&s->seq, v, tail - S + 1 + (n & 1));
                }
            }
            uint64_t pos = atomic_load(&qc->head);
            struct ivshm_cell *c =
                (struct ivshm_cell *)(cells + (pos & (Q - 1)) * Z);
            const uint64_t junk[] = {pos + 12345, ~0ull,
                                     ivshm_claim_word(pos, 1000, 1)};
            q_junk += cas(&c->seq, pos, junk[n % 3]);
            enq += cas(&qc->enqueue_pos, pos, pos + Q + 7);
        }
        usleep(200);
    }
    printf("{\"hide\": %llu, \"ring_junk\": %llu, \"q_junk\": %llu, "
           "\"enqueue_pos\": %llu}\n", hide, ring_junk, q_junk, enq);
    return 0;
}

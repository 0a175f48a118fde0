/*
 * A co-tenant that maps a region and scribbles what ivshm_recv_idle
 * reads, for tests/test_btl_trust.py: in every receive area, the head
 * slot of each fast ring in use and the queue's head cell and
 * enqueue_pos. Only what an MPI job must survive untouched: a
 * published ring message made to look empty (at most one every 50 ms:
 * the receiver shows it again within its 200 ms sweep), "empty"
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
                if (v == tail + 1 && now_ms() >= next_hide) {
                    if (cas(&s->seq, v, tail)) {
                        hide++;
                        next_hide = now_ms() + 50;
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

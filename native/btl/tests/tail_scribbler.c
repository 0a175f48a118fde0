/*
 * A co-tenant that rewinds the consumer tails of the fast rings in use,
 * for tests/test_btl_trust.py: a sender whose cached tail says "full"
 * then loads a tail far below its head, which libivshm refuses with
 * IVSHM_ECORRUPT (nothing is sent). The receiver puts its own tail back
 * whenever it finds its ring empty, so the pair is not stuck; before,
 * the BTL failed the peer at the first refusal and the job aborted.
 * Bursts of 20 ms (rewinding as fast as it can) alternate with 20 ms of
 * quiet, and a burst rewinds a ring only if its receiver's tail has
 * moved on since the last burst that rewound it (the refused send got
 * through), so a refusal outlasts a burst only by the time the pair
 * itself needs to recover, whatever the load: never near the BTL's
 * bound (IVSHMEM_REFUSED_NS). By time alone, a loaded machine (the
 * ranks running a few ms every tens of ms, this process, which sleeps
 * between bursts, more often) made refusals chain across bursts for
 * 1.3 s, and the BTL aborted the job at 2 s.
 * A rewind never lets a sender write over what its receiver has not
 * read: the job's data stays intact. Each write is a CAS on the value
 * seen.
 *   tail_scribbler REGION SECONDS   (until then or SIGTERM; then prints
 *   how many rewinds landed, as JSON)
 * Built with -I native/src: it reads the layout from the header
 * (scribbler.h).
 */
#include "scribbler.h"

#define BURST_MS 20
#define QUIET_MS 20

int main(int argc, char **argv)
{
    struct scribbled r;
    int rc = scribbler_open("tail_scribbler", argc, argv, &r);
    if (rc)
        return rc;
    uint8_t *const base = r.base;
    const struct ivshm_header hdr = r.hdr;
    const uint64_t S = r.S, Q = r.Q, Z = r.Z;
    const uint32_t F = r.F;
    unsigned long long rewound = 0;
    const uint64_t end = r.end_ms;
    /* per ring: the highest tail its last burst saw (the receiver's own,
       rewinds go below it), and the highest this burst has seen */
    uint64_t *gate = calloc((size_t)hdr.max_peers * F, sizeof *gate);
    uint64_t *seen = calloc((size_t)hdr.max_peers * F, sizeof *seen);
    if (!gate || !seen)
        return 1;
    while (!stop && now_ms() < end) {
        const uint64_t burst_end = now_ms() + BURST_MS;
        memcpy(seen, gate, (size_t)hdr.max_peers * F * sizeof *seen);
        while (!stop && now_ms() < burst_end) {
            for (uint32_t j = 0; j < hdr.max_peers; j++) {
                uint8_t *area = base + hdr.rx_off + j * hdr.rx_bytes;
                struct ivshm_fast_desc *desc =
                    (struct ivshm_fast_desc *)(area + IVSHM_QUEUE_CTRL + Q * Z);
                uint8_t *rings = (uint8_t *)(desc + F);
                for (uint32_t k = 0; k < F; k++) {
                    if (!atomic_load(&desc[k].owner))
                        continue;
                    struct ivshm_ring_ctrl *c =
                        (struct ivshm_ring_ctrl *)(rings + k * hdr.ring_bytes);
                    uint64_t tail = atomic_load(&c->tail);
                    uint64_t *hi = &seen[j * F + k];
                    if (tail > *hi)
                        *hi = tail;
                    /* more than a ring below the sender's head, which is
                       at or above this tail: refused at once */
                    if (tail > 2 * S && *hi > gate[j * F + k] &&
                        atomic_compare_exchange_strong(&c->tail, &tail,
                                                       tail - 2 * S))
                        rewound++;
                }
            }
        }
        memcpy(gate, seen, (size_t)hdr.max_peers * F * sizeof *gate);
        usleep(QUIET_MS * 1000);
    }
    printf("{\"rewound\": %llu}\n", rewound);
    return 0;
}

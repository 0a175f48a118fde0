/*
 * A co-tenant that is no rank of the job asks every rank for a fast
 * channel, for tests/test_btl_trust.py: it attaches twice (once as a
 * foreign Open MPI job, once as a job of nobody), takes a free channel
 * descriptor of each rank's receive area with libivshm's own code
 * (ivshm_fast_open: the OPEN cell goes through the rank's queue) and
 * keeps sending on those rings. The BTL listens only to the ranks it
 * verified (ivshm_listen_only): such an OPEN is refused and the ring is
 * never read, which the consumer tail shows (only a reader moves it).
 *   foreign_ring REGION SECONDS   (until then or SIGTERM; then prints
 *   JSON: channels opened, and rings whose tail moved)
 * Built with -I native/src against libivshm.a (scribbler.h).
 */
#include "scribbler.h"

#define OMPI_TAG 0x4f4d5049ull /* the job tag of the BTL's registry entries */

static void nap_ms(int ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv)
{
    struct scribbled r; /* the arguments, SIGTERM; the mapping unused */
    int rc = scribbler_open("foreign_ring", argc, argv, &r);
    if (rc)
        return rc;
    const uint64_t end = r.end_ms;
    const uint64_t jobs[2] = {OMPI_TAG << 32 | 0xf0f0, 0x5eed};
    ivshm *h[2];
    for (int i = 0; i < 2; i++) {
        ivshm_config cfg = {.job_id = jobs[i], .rank = 0, .name = "foreign"};
        rc = ivshm_attach_path(argv[1], &cfg, &h[i]);
        if (rc < 0) {
            fprintf(stderr, "foreign_ring: attach: %s\n", ivshm_strerror(rc));
            return 1;
        }
    }
    /* the ranks: every other entry with the Open MPI tag */
    int ranks[8], nranks = 0;
    while (nranks < 2 && !stop && now_ms() < end) {
        nranks = 0;
        for (int s = 0; s < ivshm_max_peers(h[0]) && nranks < 8; s++) {
            ivshm_peer_info p;
            if (ivshm_peer(h[0], s, &p) == 0 && p.job_id >> 32 == OMPI_TAG &&
                p.job_id != jobs[0])
                ranks[nranks++] = s;
        }
        nap_ms(2);
    }
    int opened = 0;
    uint8_t *rings[2][8] = {{0}};
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < nranks; r++)
            if (ivshm_fast_open(h[i], ranks[r]) == 0 &&
                (rings[i][r] = ivshm_fast_ring_of(h[i], ivshm_self(h[i]),
                                                  ranks[r])))
                opened++;
    /* ob1-shaped garbage on those rings until the end */
    uint8_t junk[64];
    memset(junk, 0x41, sizeof junk);
    while (!stop && now_ms() < end) {
        for (int i = 0; i < 2; i++)
            for (int r = 0; r < nranks; r++)
                if (rings[i][r])
                    (void)ivshm_try_send(h[i], ranks[r], 0x41, junk,
                                         sizeof junk);
        nap_ms(1);
    }
    int read = 0;
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < nranks; r++)
            if (rings[i][r] &&
                atomic_load(&((struct ivshm_ring_ctrl *)rings[i][r])->tail))
                read++;
    printf("{\"ranks\": %d, \"opened\": %d, \"read\": %d}\n", nranks, opened,
           read);
    return 0;
}

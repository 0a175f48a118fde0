/*
 * A co-tenant that rewinds the consumer tails of the fast rings in use,
 * for tests/test_btl_trust.py: a sender whose cached tail says "full"
 * then loads a tail far below its head, which libivshm refuses with
 * IVSHM_ECORRUPT (nothing is sent). The receiver puts its own tail back
 * whenever it finds its ring empty, so the pair is not stuck; before,
 * the BTL failed the peer at the first refusal and the job aborted.
 * Bursts of 20 ms (rewinding as fast as it can) alternate with 20 ms of
 * quiet, so no refusal lasts near the BTL's bound (IVSHMEM_REFUSED_NS).
 * A rewind never lets a sender write over what its receiver has not
 * read: the job's data stays intact. Each write is a CAS on the value
 * seen.
 *   tail_scribbler REGION SECONDS   (until then or SIGTERM; then prints
 *   how many rewinds landed, as JSON)
 * Built with -I native/src: it reads the layout from the header.
 */
#include "internal.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BURST_MS 20
#define QUIET_MS 20

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: tail_scribbler REGION SECONDS\n");
        return 2;
    }
    signal(SIGTERM, on_term);
    int fd = open(argv[1], O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(argv[1]);
        return 1;
    }
    uint8_t *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                         MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    struct ivshm_header hdr;
    memcpy(&hdr, base, sizeof hdr);
    const uint64_t S = hdr.ring_slots, Q = hdr.queue_slots, Z = hdr.slot_size;
    const uint32_t F = hdr.fast_channels == IVSHM_FAST_NONE ? 0
                                                            : hdr.fast_channels;
    if (hdr.magic != IVSHM_MAGIC || !S || !Q || !Z ||
        hdr.rx_off + hdr.max_peers * hdr.rx_bytes > (uint64_t)st.st_size ||
        IVSHM_QUEUE_CTRL + Q * Z + F * (IVSHM_FAST_DESC + hdr.ring_bytes) >
            hdr.rx_bytes) {
        fprintf(stderr, "tail_scribbler: not a region it understands\n");
        return 1;
    }
    unsigned long long rewound = 0;
    const uint64_t end = now_ms() + 1000 * strtoull(argv[2], NULL, 10);
    while (!stop && now_ms() < end) {
        const uint64_t burst_end = now_ms() + BURST_MS;
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
                    /* more than a ring below the sender's head, which is
                       at or above this tail: refused at once */
                    if (tail > 2 * S &&
                        atomic_compare_exchange_strong(&c->tail, &tail,
                                                       tail - 2 * S))
                        rewound++;
                }
            }
        }
        usleep(QUIET_MS * 1000);
    }
    printf("{\"rewound\": %llu}\n", rewound);
    return 0;
}

/* libFuzzer: attach to a region whose header and registry are fuzz input.
   Must fail cleanly or attach and detach; never touch memory outside. */
#define _GNU_SOURCE
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int region_fd = -1;
static uint8_t *region;
static uint64_t region_size;
static uint8_t *pristine;

static void setup(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 4, .slot_size = 256,
                        .max_windows = 4};
    region_size = ivshm_min_region_size(&g);
    region_fd = memfd_create("fuzz-attach", MFD_CLOEXEC);
    if (ftruncate(region_fd, (off_t)region_size) < 0)
        __builtin_trap();
    region = mmap(NULL, region_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                  region_fd, 0);
    if (region == MAP_FAILED || ivshm_format(region, region_size, &g) < 0)
        __builtin_trap();
    pristine = malloc(IVSHM_PAGE * 2);
    memcpy(pristine, region, IVSHM_PAGE * 2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (region_fd < 0)
        setup();
    /* header page + registry page: restore, then overlay the input. The
       first input byte picks whether to keep the magic valid, so the
       fuzzer gets past the first check often. */
    memcpy(region, pristine, IVSHM_PAGE * 2);
    if (size == 0)
        return 0;
    size_t n = size - 1 < IVSHM_PAGE * 2 ? size - 1 : IVSHM_PAGE * 2;
    size_t start = data[0] & 1 ? 8 : 0;
    if (n > start)
        memcpy(region + start, data + 1 + start, n - start);
    /* FORMATTING makes attach wait (bounded, 2 s) for the formatter:
       correct, but it would only slow the fuzzer down. */
    struct ivshm_header *hdr = (void *)region;
    if (atomic_load(&hdr->state) == REGION_FORMATTING)
        atomic_store(&hdr->state, REGION_READY);

    char fdpath[64];
    snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", region_fd);
    ivshm_config cfg = {.job_id = 3, .rank = data[0] >> 1, .spin_ns = -1};
    ivshm *h = NULL;
    if (ivshm_attach_path(fdpath, &cfg, &h) == 0) {
        ivshm_peer_info info;
        for (int s = 0; s < ivshm_max_peers(h); s++)
            ivshm_peer(h, s, &info);
        ivshm_find(h, 3, 1);
        ivshm_reap(h);
        ivshm_detach(h);
    }
    return 0;
}

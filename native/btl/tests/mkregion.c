/* Format a libivshm region file for the BTL smoke test.
   usage: btl_mkregion PATH [SIZE_MIB [MAX_PEERS [RING_SLOTS SLOT_SIZE]]]
   SIZE_MIB 0 (the default) or too small: the smallest size that holds
   the geometry. Default rings as ivcloud mpirun's (ivcloud/mpi.py): 64
   slots of 16 KiB + 64, one BTL fragment each, 16 peers: ~146 MiB. */
#include "ivshm.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 6 || argc == 5) {
        fprintf(stderr, "usage: %s PATH [SIZE_MIB [MAX_PEERS [RING_SLOTS SLOT_SIZE]]]\n",
                argv[0]);
        return 2;
    }
    uint64_t mib = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    ivshm_geometry g = {.max_peers = argc > 3 ? (uint32_t)atoi(argv[3]) : 16,
                        .ring_slots = 64,
                        .slot_size = 16 * 1024 + 64};
    if (argc == 6) {
        g.ring_slots = (uint32_t)atoi(argv[4]);
        g.slot_size = (uint32_t)atoi(argv[5]);
    }
    uint64_t size = mib << 20, min = ivshm_min_region_size(&g);
    if (size < min)
        size = (min + 0xfffff) & ~(uint64_t)0xfffff;
    int rc = ivshm_format_file(argv[1], size, &g, 0600);
    if (rc < 0) {
        fprintf(stderr, "%s: %s\n", argv[1], ivshm_strerror(rc));
        return 1;
    }
    return 0;
}

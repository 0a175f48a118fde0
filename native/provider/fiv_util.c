/*
 * What every layer of the provider uses: its parameters' values
 * (fiv_init.c fills them in; a guest's device paths, read here), the
 * clock and deadlines, and error texts.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fiv.h"

struct fiv_config fiv_cfg = {.position = -1,
                             .peer_answer_bytes = FIV_PEER_ANSWER_BYTES,
                             .peer_queue = FIV_PEER_QUEUE,
                             .drain_ms = 5000,
                             .peer_unexp_bytes = FIV_PEER_UNEXP_BYTES};

uint64_t fiv_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t fiv_deadline(int timeout_ms)
{
    return timeout_ms < 0 ? UINT64_MAX
                          : fiv_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

const char *fiv_strerror(int prov_errno, char *buf, size_t len)
{
    const char *s = fi_strerror(prov_errno < 0 ? -prov_errno : prov_errno);
    if (!buf || !len)
        return s;
    snprintf(buf, len, "%s", s);
    return buf;
}

/* Inside a guest, ivshm-bind writes the device's paths to
   /run/ivshm/ivshm.env (docs/vm.md): the same defaults the BTL gets from
   Open MPI's parameter file. A rank whose device is another one (a Slurm
   job's own, docs/cluster.md "Regions of VM clusters") is given that
   device's file instead (FI_IVSHM_DEVICE_ENV), so that a rejoin takes
   the device its job was given again, not the guest's device of boot.
   `force`: what the file says replaces what we had (a device bound
   again after a move: docs/migration.md, "Core back to region"; no file
   then means the device is not back yet, as the host hides it before it
   asks for the drain). Returns whether the file named a BAR2. */
bool fiv_guest_defaults(bool force)
{
    /* kept for the process's life: fiv_cfg points here */
    static char keep[3][256];
    FILE *f = fopen(fiv_cfg.device_env ? fiv_cfg.device_env : FIV_GUEST_ENV,
                    "re");
    if (!f)
        return false;
    bool bar2 = false;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *eq = strchr(line, '=');
        if (!eq || !eq[1])
            continue;
        *eq = 0;
        const char *v = eq + 1;
        if (strlen(v) >= sizeof keep[0])
            continue;
        if (!strcmp(line, "IVSHM_BAR2")) {
            bar2 = true;
            if (force || (!fiv_cfg.region && !fiv_cfg.socket))
                fiv_cfg.region = strcpy(keep[0], v);
        } else if (!strcmp(line, "IVSHM_UIO") && (force || !fiv_cfg.uio_dev)) {
            fiv_cfg.uio_dev = strcpy(keep[1], v);
        } else if (!strcmp(line, "IVSHM_BAR0") && (force || !fiv_cfg.bar0)) {
            fiv_cfg.bar0 = strcpy(keep[2], v);
        } else if (!strcmp(line, "IVSHM_POSITION") &&
                   (force || fiv_cfg.position < 0)) {
            fiv_cfg.position = atoi(v);
        }
    }
    fclose(f);
    return bar2;
}

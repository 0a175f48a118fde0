/*
 * What every file of the component shares beyond btl_ivshmem.h's types:
 * the clock, our registry job ids, and the per-slot arrays of the
 * component's state (allocated at init, freed at close or finalize).
 */
#include "btl_ivshmem.h"

#include <stdlib.h>
#include <time.h>

uint64_t mca_btl_ivshmem_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t mca_btl_ivshmem_job_id(uint32_t opal_jobid)
{
    return (IVSHMEM_JOB_TAG << 32) | opal_jobid;
}

/* Per-slot state, sized by the region's max_peers (up to 1024: a few
   tens of KiB, so allocated rather than fixed at the largest). */
int mca_btl_ivshmem_alloc_slot_arrays(uint32_t n)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    c->by_slot = calloc(n, sizeof *c->by_slot);
    c->trusted = calloc(n, sizeof *c->trusted);
    c->active = calloc(n, sizeof *c->active);
    c->rejected = calloc(n, sizeof *c->rejected);
    c->stashed = calloc(n, sizeof *c->stashed);
    c->departed = calloc(n, sizeof *c->departed);
    c->nactive = 0;
    if (!c->by_slot || !c->trusted || !c->active || !c->rejected ||
        !c->stashed || !c->departed)
        return OPAL_ERR_OUT_OF_RESOURCE;
    return OPAL_SUCCESS;
}

void mca_btl_ivshmem_free_slot_arrays(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    free(c->by_slot);
    free(c->trusted);
    free(c->active);
    free(c->rejected);
    free(c->stashed);
    free(c->departed);
    c->by_slot = NULL;
    c->trusted = NULL;
    c->active = NULL;
    c->rejected = NULL;
    c->stashed = NULL;
    c->departed = NULL;
    c->nactive = 0;
}

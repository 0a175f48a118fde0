/*
 * Peers: the modex check that makes a registry slot one of our peers
 * (add_procs, and the admission of a rank of our job that writes before
 * ob1 adds it), and a peer's failure, which is fatal for the job.
 */
#include "btl_ivshmem.h"

#include "opal/mca/pmix/pmix.h"
#include "opal/util/output.h"
#include "opal/util/proc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Registry slot of the proc `name` in our region, or -1: the slot its
   modex names, if that slot holds it live with the same job, rank,
   generation and random name. The modex comes from Open MPI's runtime,
   which no co-tenant of the region can write: this check, not the job
   tag in the registry, is what makes a slot one of our peers. `gone`:
   also a proc that left or died since (ivshm_peer_last), whose messages
   are still delivered. Takes `lock` only around libivshm calls: the
   modex lookup may take a while. */
int mca_btl_ivshmem_locate_name(opal_process_name_t name, uint32_t *generation,
                                bool gone)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    uint64_t job = mca_btl_ivshmem_job_id(name.jobid);
    uint32_t vpid = name.vpid;

    OPAL_THREAD_LOCK(&c->lock);
    int found = gone ? 0 : ivshm_find(c->h, job, vpid);
    OPAL_THREAD_UNLOCK(&c->lock);
    if (found < 0)
        return -1;
    ivshmem_modex_t *mx = NULL;
    size_t mx_size = 0;
    int rc;
    OPAL_MODEX_RECV(rc, &c->super.btl_version, &name, (void **)&mx, &mx_size);
    if (OPAL_SUCCESS != rc || NULL == mx || mx_size != sizeof *mx) {
        free(mx);
        return -1;
    }
    int slot = -1;
    ivshm_peer_info info;
    /* ivshm_find returns the first match; the modex names the right one
       should two jobs share an id (or a co-tenant pose as this rank) */
    if (mx->attached && mx->slot >= 0 && mx->slot < (int)c->geom.max_peers &&
        mx->slot != c->self_slot) {
        OPAL_THREAD_LOCK(&c->lock);
        int ok = gone ? ivshm_peer_last(c->h, mx->slot, &info)
                      : ivshm_peer(c->h, mx->slot, &info);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (ok >= 0 && info.job_id == job && info.rank == vpid &&
            info.generation == mx->generation &&
            strncmp(info.name, mx->name, sizeof info.name) == 0) {
            slot = mx->slot;
            *generation = mx->generation;
        }
    }
    free(mx);
    return slot;
}

void mca_btl_ivshmem_peer_failed(mca_btl_ivshmem_endpoint_t *ep, int err)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    static char msg[256];
    if (ep->dead || ep->said_bye || c->finalizing)
        return;
    ep->dead = true;
    /* Detached at the generation we know: it finalized, and its goodbye
       did not reach us (it gives up on a full queue after BYE_BUDGET_NS,
       btl_ivshmem_module.c, and we may be descheduled that long). Not a
       crash. */
    if (err == IVSHM_EPEERDEAD &&
        1 == ivshm_peer_left(c->h, ep->slot, ep->generation))
        return;
    char why[128];
    if (err == IVSHM_ECORRUPT && ep->refused_since_ns &&
        mca_btl_ivshmem_now_ns() - ep->refused_since_ns >= IVSHMEM_REFUSED_NS)
        /* not its messages: our sends to it (mca_btl_ivshmem_send_refused) */
        snprintf(why, sizeof why,
                 "refused our sends for %llu s in a row (a forged ring tail)",
                 IVSHMEM_REFUSED_NS / 1000000000ull);
    else if (err == IVSHM_ECORRUPT)
        snprintf(why, sizeof why, "sent a corrupt message");
    else if (err == IVSHM_EPEERDEAD)
        snprintf(why, sizeof why, "died or left without finalizing");
    else /* a send to it failed: say how */
        snprintf(why, sizeof why, "cannot be sent to (%s)", ivshm_strerror(err));
    snprintf(msg, sizeof msg,
             "btl_ivshmem: peer rank %u (region slot %d) %s; aborting the job",
             ep->vpid, ep->slot, why);
    if (mca_btl_ivshmem.error_cb) {
        /* ob1 prints msg and aborts the job; if it ever returns, our
           sends to this peer fail from now on */
        mca_btl_ivshmem.error_cb(&mca_btl_ivshmem.super, MCA_BTL_ERROR_FLAGS_FATAL,
                                 ep->proc, msg);
        return;
    }
    /* nobody to tell: ending beats hanging on a peer that is gone */
    fprintf(stderr, "%s\n", msg);
    exit(1);
}

/*
 * Module: which peers we reach (add/del procs), and finalize (goodbye to
 * every peer, counters, detach).
 *
 * Reachability does not look at hostnames or Open MPI's locality flags:
 * co-resident VMs have different hostnames, yet share the region. A peer
 * is ours iff the registry holds it live, as (job, vpid) and with the
 * slot, generation and random name it published in the modex
 * (btl_ivshmem_peer.c).
 */
#define _GNU_SOURCE
#include "btl_ivshmem.h"
#include "btl_ivshmem_frag.h"

#include "opal/class/opal_bitmap.h"
#include "opal/mca/btl/base/base.h"
#include "opal/util/output.h"
#include "opal/util/proc.h"

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How long finalize keeps trying to get a goodbye into a full ring. */
#define BYE_BUDGET_NS 2000000000ull

static int ivshmem_ft_event(int state)
{
    (void)state;
    return OPAL_SUCCESS;
}

mca_btl_ivshmem_module_t mca_btl_ivshmem = {
    .super = {
        .btl_component = &mca_btl_ivshmem_component.super,
        .btl_add_procs = mca_btl_ivshmem_add_procs,
        .btl_del_procs = mca_btl_ivshmem_del_procs,
        .btl_finalize = mca_btl_ivshmem_finalize,
        .btl_alloc = mca_btl_ivshmem_alloc,
        .btl_free = mca_btl_ivshmem_free,
        .btl_prepare_src = mca_btl_ivshmem_prepare_src,
        .btl_send = mca_btl_ivshmem_send,
        .btl_sendi = mca_btl_ivshmem_sendi,
        .btl_dump = mca_btl_base_dump,
        .btl_register_error = mca_btl_ivshmem_register_error,
        .btl_ft_event = ivshmem_ft_event,
    },
};

#define VERBOSE(lvl, ...)                                                     \
    opal_output_verbose((lvl), opal_btl_base_framework.framework_output,      \
                        __VA_ARGS__)

/* The endpoint for `proc` in `slot`, created if needed. With `lock`. */
static mca_btl_ivshmem_endpoint_t *endpoint_for(struct opal_proc_t *proc,
                                                int slot, uint32_t gen)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    mca_btl_ivshmem_endpoint_t *ep = c->by_slot[slot];
    if (ep && ep->generation == gen && ep->proc == proc) {
        if (ep->deleted && !ep->dead) { /* added again after del_procs */
            ep->deleted = false;
            mca_btl_ivshmem_trust(slot, gen);
        }
        return ep;
    }
    if (ep) {
        /* left over from an earlier occupant of the slot */
        if (ep->pending.count)
            return NULL; /* still draining: the PML uses another BTL */
        /* the PML may still hold it: retire it (sends fail), free it at
           finalize */
        ep->dead = true;
        for (mca_btl_ivshmem_endpoint_t **p = &c->endpoints; *p; p = &(*p)->next)
            if (*p == ep) {
                *p = ep->next;
                break;
            }
        ep->next = c->retired;
        c->retired = ep;
        c->num_endpoints--;
        c->by_slot[slot] = NULL;
    }
    ep = calloc(1, sizeof *ep);
    if (!ep)
        return NULL;
    ep->proc = proc;
    ep->job_id = mca_btl_ivshmem_job_id(proc->proc_name.jobid);
    ep->vpid = proc->proc_name.vpid;
    ep->slot = slot;
    ep->generation = gen;
    c->by_slot[slot] = ep;
    ep->next = c->endpoints;
    c->endpoints = ep;
    c->num_endpoints++;
    mca_btl_ivshmem_trust(slot, gen); /* its messages are welcome */
    return ep;
}

/* Is a node-local BTL (vader, sm) also selected? It ranks above us, so
   ob1 sends our node's peers through it even though we reach them too:
   then those peers' traffic is progressed by someone else, and we must
   not block our progress call on our doorbell while it arrives there. */
static bool node_local_btl_selected(void)
{
    mca_btl_base_selected_module_t *sm;
    OPAL_LIST_FOREACH (sm, &mca_btl_base_modules_initialized,
                       mca_btl_base_selected_module_t) {
        const char *name = sm->btl_component->btl_version.mca_component_name;
        if (sm->btl_module != &mca_btl_ivshmem.super &&
            (0 == strcmp(name, "vader") || 0 == strcmp(name, "sm")))
            return true;
    }
    return false;
}

int mca_btl_ivshmem_add_procs(struct mca_btl_base_module_t *btl, size_t nprocs,
                              struct opal_proc_t **procs,
                              struct mca_btl_base_endpoint_t **peers,
                              struct opal_bitmap_t *reachable)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    const opal_proc_t *me = opal_proc_local_get();
    (void)btl;
    if (!c->h)
        return OPAL_ERR_UNREACH;

    for (size_t i = 0; i < nprocs; i++) {
        struct opal_proc_t *proc = procs[i];
        peers[i] = NULL;
        if (proc == me ||
            0 == opal_compare_proc(proc->proc_name, OPAL_PROC_MY_NAME))
            continue; /* btl/self */
        uint32_t gen = 0;
        int slot = mca_btl_ivshmem_locate_name(proc->proc_name, &gen, false);
        mca_btl_ivshmem_endpoint_t *ep = NULL;
        if (slot >= 0) {
            OPAL_THREAD_LOCK(&c->lock);
            ep = endpoint_for(proc, slot, gen);
            OPAL_THREAD_UNLOCK(&c->lock);
        }
        if (!ep) {
            c->mixed = true; /* someone else carries this peer */
            VERBOSE(20, "btl_ivshmem: %s (%s) is not in our region",
                    OPAL_NAME_PRINT(proc->proc_name),
                    proc->proc_hostname ? proc->proc_hostname : "?");
            continue;
        }
        if (OPAL_PROC_ON_LOCAL_NODE(proc->proc_flags) &&
            node_local_btl_selected())
            c->mixed = true; /* vader carries it, not us */
        peers[i] = ep;
        if (reachable)
            opal_bitmap_set_bit(reachable, (int)i);
        VERBOSE(10, "btl_ivshmem: reaching %s (%s) through slot %d",
                OPAL_NAME_PRINT(proc->proc_name),
                proc->proc_hostname ? proc->proc_hostname : "?", slot);
    }
    return OPAL_SUCCESS;
}

int mca_btl_ivshmem_del_procs(struct mca_btl_base_module_t *btl, size_t nprocs,
                              struct opal_proc_t **procs,
                              struct mca_btl_base_endpoint_t **peers)
{
    /* The PML is done with these peers (finalize, after its fence): stop
       reading their rings and watching their liveness. Endpoints stay
       until finalize: they are few (one per slot) and finalize still
       owes each peer its goodbye. */
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    (void)btl;
    (void)procs;
    OPAL_THREAD_LOCK(&c->lock);
    for (size_t i = 0; i < nprocs; i++) {
        mca_btl_ivshmem_endpoint_t *ep = peers[i];
        if (ep && c->by_slot[ep->slot] == ep) {
            ep->deleted = true;
            if (c->trusted[ep->slot] == (uint64_t)ep->generation + 1)
                mca_btl_ivshmem_distrust(ep->slot);
        }
        peers[i] = NULL;
    }
    OPAL_THREAD_UNLOCK(&c->lock);
    return OPAL_SUCCESS;
}

int mca_btl_ivshmem_register_error(struct mca_btl_base_module_t *btl,
                                   mca_btl_base_module_error_cb_fn_t cbfunc)
{
    ((mca_btl_ivshmem_module_t *)btl)->error_cb = cbfunc;
    return OPAL_SUCCESS;
}

/* Tell every peer we are leaving cleanly, so its liveness check does not
   take our departure for a crash. Bounded: a peer that never drains its
   ring cannot hold finalize. */
static void say_goodbye(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    uint64_t deadline = mca_btl_ivshmem_now_ns() + BYE_BUDGET_NS;
    for (mca_btl_ivshmem_endpoint_t *ep = c->endpoints; ep; ep = ep->next) {
        if (ep->dead)
            continue;
        ep->in_ring = NULL; /* a descriptor the PML never sent: dropped */
        for (;;) {
            /* queued fragments first: the goodbye must not overtake them */
            (void)mca_btl_ivshmem_flush_pending(ep);
            int rc = ep->pending.count
                         ? -EAGAIN
                         : ivshm_try_send(c->h, ep->slot, IVSHMEM_TAG_BYE, NULL, 0);
            if (rc != -EAGAIN || mca_btl_ivshmem_now_ns() > deadline)
                break;
            /* the peer may be waiting for room in our queue meanwhile:
               take (and drop, we are finalizing) what arrived */
            (void)mca_btl_ivshmem_drain(IVSHMEM_RECV_BATCH);
            sched_yield();
        }
    }
}

int mca_btl_ivshmem_finalize(struct mca_btl_base_module_t *btl)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    (void)btl;
    if (!c->h)
        return OPAL_SUCCESS;
    /* MPI is single-threaded again here (after the finalize fence and
       the PML teardown), so no lock; from now on nothing is delivered to
       the PML, and peers leaving is no longer news */
    c->finalizing = true;
    say_goodbye();
    /* what never got trusted stays undelivered: counted as ignored */
    c->counters.ignored += c->stash_msgs;
    mca_btl_ivshmem_stash_clear();
    ivshm_stats st;
    ivshm_get_stats(c->h, &st);
    if (c->verbose >= 1)
        fprintf(stderr,
                "btl_ivshmem: rank %u sent %" PRIu64 " msgs %" PRIu64
                " bytes, received %" PRIu64 " msgs %" PRIu64
                " bytes, sleeps %" PRIu64 "\n",
                c->vpid, c->counters.sent_msgs, c->counters.sent_bytes,
                c->counters.recv_msgs, c->counters.recv_bytes, st.sleeps);
    if (c->verbose >= 2)
        fprintf(stderr,
                "btl_ivshmem: rank %u dropped %" PRIu64 " messages, rejected %"
                PRIu64 " slots posing as ranks of this job, ignored %" PRIu64
                " messages of untrusted senders, retried %" PRIu64
                " sends refused for a forged ring tail, streamed %" PRIu64
                " large payloads\n",
                c->vpid, c->counters.dropped, c->counters.rejected,
                c->counters.ignored, c->counters.refused,
                c->counters.streamed);
    while (c->endpoints) {
        mca_btl_ivshmem_endpoint_t *ep = c->endpoints;
        c->endpoints = ep->next;
        /* the PML is gone: whatever is still queued is dropped silently */
        mca_btl_ivshmem_frag_t *f;
        while ((f = ivshmem_queue_pop(&ep->pending)))
            ivshmem_frag_return(f);
        c->by_slot[ep->slot] = NULL;
        free(ep);
    }
    while (c->retired) {
        mca_btl_ivshmem_endpoint_t *ep = c->retired;
        c->retired = ep->next;
        free(ep);
    }
    c->num_endpoints = 0;
    c->pending_eps = NULL;
    c->num_pending = 0;
    mca_btl_ivshmem_frag_t *f;
    while ((f = ivshmem_queue_pop(&c->complete)))
        ivshmem_frag_return(f);
    ivshm_detach(c->h);
    c->h = NULL;
    free(c->rxbuf);
    c->rxbuf = NULL;
    mca_btl_ivshmem_free_slot_arrays();
    return OPAL_SUCCESS;
}

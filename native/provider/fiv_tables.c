/*
 * What the objects hold that the layers below them read or fill: an
 * endpoint's peers (by id, and in turn), an AV's names, and the
 * endpoints an AV or a domain serves (the endpoint binds itself to
 * them: fiv_ep.c sits below the AV and the domain, whose tables point
 * at it), and a domain's open counters (what a triggered operation may
 * name, fiv_trigger.c).
 */
#include <stdlib.h>

#include "fiv.h"

struct fiv_peer *fiv_peer(struct fiv_ep *ep, fi_addr_t a)
{
    if (a < ep->npeers)
        return &ep->peers[a];
    if (a >= FIV_HIDDEN && ep->hidden && a - FIV_HIDDEN < (fi_addr_t)ep->max_peers &&
        ep->hidden[a - FIV_HIDDEN].path == PATH_REGION)
        return &ep->hidden[a - FIV_HIDDEN];
    return NULL;
}

struct fiv_peer *fiv_peer_next(struct fiv_ep *ep, fi_addr_t *id)
{
    fi_addr_t i = *id == FI_ADDR_NOTAVAIL ? 0 : *id + 1;
    if (i < FIV_HIDDEN) {
        if (i < ep->npeers) {
            *id = i;
            return &ep->peers[i];
        }
        i = FIV_HIDDEN;
    }
    for (; ep->hidden && i - FIV_HIDDEN < (fi_addr_t)ep->max_peers; i++)
        if (ep->hidden[i - FIV_HIDDEN].path == PATH_REGION) {
            *id = i;
            return &ep->hidden[i - FIV_HIDDEN];
        }
    return NULL;
}

const struct fiv_addr *fiv_av_addr(struct fiv_av *av, fi_addr_t a)
{
    if (a >= av->count || !av->entries[a].used)
        return NULL;
    return &av->entries[a].addr;
}

void fiv_av_add_ep(struct fiv_av *av, struct fiv_ep *ep)
{
    void *p = realloc(av->eps, (av->neps + 1) * sizeof *av->eps);
    if (!p)
        return;
    av->eps = p;
    av->eps[av->neps++] = ep;
    av->refs++;
}

void fiv_av_del_ep(struct fiv_av *av, struct fiv_ep *ep)
{
    for (size_t i = 0; i < av->neps; i++)
        if (av->eps[i] == ep) {
            av->eps[i] = av->eps[--av->neps];
            av->refs--;
            return;
        }
}

void fiv_domain_add_ep(struct fiv_domain *d, struct fiv_ep *ep)
{
    fiv_lock(d);
    if (d->neps == d->capeps) {
        size_t n = d->capeps ? 2 * d->capeps : 4;
        void *p = realloc(d->eps, n * sizeof *d->eps);
        if (p) {
            d->eps = p;
            d->capeps = n;
        }
    }
    if (d->neps < d->capeps)
        d->eps[d->neps++] = ep;
    fiv_unlock(d);
}

void fiv_domain_del_ep(struct fiv_domain *d, struct fiv_ep *ep)
{
    fiv_lock(d);
    for (size_t i = 0; i < d->neps; i++)
        if (d->eps[i] == ep) {
            d->eps[i] = d->eps[--d->neps];
            break;
        }
    fiv_unlock(d);
}

bool fiv_domain_add_cntr(struct fiv_domain *d, struct fiv_cntr *c)
{
    if (d->ncntrs == d->capcntrs) {
        size_t n = d->capcntrs ? 2 * d->capcntrs : 4;
        void *p = realloc(d->cntrs, n * sizeof *d->cntrs);
        if (p) {
            d->cntrs = p;
            d->capcntrs = n;
        }
    }
    bool ok = d->ncntrs < d->capcntrs;
    if (ok)
        d->cntrs[d->ncntrs++] = c;
    return ok;
}

void fiv_domain_del_cntr(struct fiv_domain *d, struct fiv_cntr *c)
{
    for (size_t i = 0; i < d->ncntrs; i++)
        if (d->cntrs[i] == c) {
            d->cntrs[i] = d->cntrs[--d->ncntrs];
            break;
        }
}

struct fiv_cntr *fiv_domain_cntr(struct fiv_domain *d, const struct fid_cntr *f)
{
    for (size_t i = 0; i < d->ncntrs; i++)
        if (&d->cntrs[i]->cntr == f)
            return d->cntrs[i];
    return NULL;
}

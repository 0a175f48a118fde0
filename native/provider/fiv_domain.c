/*
 * The domain: threading (one mutex when the caller shares objects between
 * threads), memory registrations, and the progress thread of
 * FI_PROGRESS_AUTO.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fiv.h"

/* FI_PROGRESS_AUTO: targets of RMA and atomics answer while the
   application computes. Polls every endpoint at ~1 kHz under the lock
   (auto progress implies a thread-safe domain). */
static void *progress_main(void *arg)
{
    struct fiv_domain *d = arg;
    const struct timespec pause = {0, 1000000};
    while (!__atomic_load_n(&d->stop, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&d->lock);
        fiv_progress_eps(d->eps, d->neps);
        pthread_mutex_unlock(&d->lock);
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static int domain_close(struct fid *fid)
{
    struct fiv_domain *d = container_of(fid, struct fiv_domain, dom.fid);
    /* a registration still open is the application's fid: it keeps the
       domain open until it is closed (fi_domain(3)) */
    fiv_lock(d);
    bool busy = d->refs || d->nmrs;
    fiv_unlock(d);
    if (busy)
        return -FI_EBUSY;
    if (d->auto_progress) {
        __atomic_store_n(&d->stop, true, __ATOMIC_RELEASE);
        pthread_join(d->progress_thread, NULL);
    }
    free(d->mrs);
    free(d->eps);
    free(d->cntrs);
    pthread_mutex_destroy(&d->lock);
    free(d);
    return 0;
}

static struct fi_ops domain_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = domain_close,
    .bind = fiv_no_bind,
    .control = fiv_no_control,
    .ops_open = fiv_no_ops_open,
};

static int no_sep(struct fid_domain *domain, struct fi_info *info,
                  struct fid_ep **sep, void *context)
{
    (void)domain; (void)info; (void)sep; (void)context;
    return -FI_ENOSYS;
}
static int no_poll(struct fid_domain *domain, struct fi_poll_attr *attr,
                   struct fid_poll **pollset)
{
    (void)domain; (void)attr; (void)pollset;
    return -FI_ENOSYS;
}
static int no_stx(struct fid_domain *domain, struct fi_tx_attr *attr,
                  struct fid_stx **stx, void *context)
{
    (void)domain; (void)attr; (void)stx; (void)context;
    return -FI_ENOSYS;
}
static int no_srx(struct fid_domain *domain, struct fi_rx_attr *attr,
                  struct fid_ep **rx_ep, void *context)
{
    (void)domain; (void)attr; (void)rx_ep; (void)context;
    return -FI_ENOSYS;
}
static int no_query_coll(struct fid_domain *domain, enum fi_collective_op coll,
                         struct fi_collective_attr *attr, uint64_t flags)
{
    (void)domain; (void)coll; (void)attr; (void)flags;
    return -FI_ENOSYS;
}

static struct fi_ops_domain domain_ops = {
    .size = sizeof(struct fi_ops_domain),
    .av_open = fiv_av_open,
    .cq_open = fiv_cq_open,
    .endpoint = fiv_ep_open,
    .scalable_ep = no_sep,
    .cntr_open = fiv_cntr_open,
    .poll_open = no_poll,
    .stx_ctx = no_stx,
    .srx_ctx = no_srx,
    .query_atomic = fiv_query_atomic,
    .query_collective = no_query_coll,
};

static struct fi_ops_mr mr_ops = {
    .size = sizeof(struct fi_ops_mr),
    .reg = fiv_mr_reg,
    .regv = fiv_mr_regv,
    .regattr = fiv_mr_regattr,
};

int fiv_domain_open(struct fid_fabric *fabric, struct fi_info *info,
                    struct fid_domain **dom, void *context)
{
    struct fiv_fabric *f = container_of(fabric, struct fiv_fabric, fab);
    struct fiv_domain *d = calloc(1, sizeof *d);
    if (!d)
        return -FI_ENOMEM;
    d->fab = f;
    d->api_version = f->api_version;
    const struct fi_domain_attr *a = info ? info->domain_attr : NULL;
    if (a && a->name && strcmp(a->name, FIV_DOMAIN_NAME)) {
        free(d);
        return -FI_EINVAL;
    }
    d->mr_mode = a ? a->mr_mode : FI_MR_VIRT_ADDR | FI_MR_PROV_KEY;
    if (d->mr_mode == 1 || d->mr_mode == 2) {
        /* the old modes: basic = virtual addresses and our keys */
        d->mr_mode = d->mr_mode == 1 ? FI_MR_VIRT_ADDR | FI_MR_PROV_KEY : 0;
    }
    enum fi_threading t = a ? a->threading : FI_THREAD_SAFE;
    d->auto_progress = a && (a->data_progress == FI_PROGRESS_AUTO ||
                             a->control_progress == FI_PROGRESS_AUTO);
    /* Only FI_THREAD_DOMAIN has the application serialize the whole
       domain. Under FID and ENDPOINT it serializes each object, not the
       provider's own work on objects endpoints share (a CQ both write, a
       counter whose increment moves another endpoint's triggered
       operations), so those take the lock too. */
    d->locking = t != FI_THREAD_DOMAIN || d->auto_progress;
    pthread_mutex_init(&d->lock, NULL);
    d->next_key = 1;
    d->dom.fid.fclass = FI_CLASS_DOMAIN;
    d->dom.fid.context = context;
    d->dom.fid.ops = &domain_fi_ops;
    d->dom.ops = &domain_ops;
    d->dom.mr = &mr_ops;
    if (d->auto_progress &&
        pthread_create(&d->progress_thread, NULL, progress_main, d) != 0) {
        pthread_mutex_destroy(&d->lock);
        free(d);
        return -FI_ENOMEM;
    }
    *dom = &d->dom;
    return 0;
}

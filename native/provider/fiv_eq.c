/*
 * Event queues: an RDM endpoint without connections reports nothing
 * here, but the MPIs open one and bind it; events written by the
 * application come back to it.
 */
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

struct fiv_eq_event {
    uint32_t event;
    size_t len;
    uint8_t data[256];
};

struct fiv_eq_impl {
    struct fiv_eq base;
    pthread_mutex_t lock;
    struct fiv_eq_event ev[64];
    size_t head, count;
};

static ssize_t eq_read(struct fid_eq *f, uint32_t *event, void *buf,
                       size_t len, uint64_t flags)
{
    struct fiv_eq_impl *q = container_of(f, struct fiv_eq_impl, base.eq);
    ssize_t n = -FI_EAGAIN;
    pthread_mutex_lock(&q->lock);
    if (q->count) {
        struct fiv_eq_event *e = &q->ev[q->head];
        size_t m = e->len < len ? e->len : len;
        if (event)
            *event = e->event;
        memcpy(buf, e->data, m);
        n = (ssize_t)m;
        if (!(flags & FI_PEEK)) {
            q->head = (q->head + 1) % 64;
            q->count--;
        }
    }
    pthread_mutex_unlock(&q->lock);
    return n;
}

static ssize_t eq_readerr(struct fid_eq *f, struct fi_eq_err_entry *buf,
                          uint64_t flags)
{
    (void)f; (void)buf; (void)flags;
    return -FI_EAGAIN;
}

static ssize_t eq_write(struct fid_eq *f, uint32_t event, const void *buf,
                        size_t len, uint64_t flags)
{
    (void)flags;
    struct fiv_eq_impl *q = container_of(f, struct fiv_eq_impl, base.eq);
    if (len > sizeof q->ev[0].data)
        return -FI_EINVAL;
    ssize_t n = -FI_EAGAIN;
    pthread_mutex_lock(&q->lock);
    if (q->count < 64) {
        struct fiv_eq_event *e = &q->ev[(q->head + q->count) % 64];
        e->event = event;
        e->len = len;
        memcpy(e->data, buf, len);
        q->count++;
        n = (ssize_t)len;
    }
    pthread_mutex_unlock(&q->lock);
    return n;
}

static ssize_t eq_sread(struct fid_eq *f, uint32_t *event, void *buf,
                        size_t len, int timeout, uint64_t flags)
{
    uint64_t deadline = fiv_deadline(timeout);
    for (;;) {
        ssize_t n = eq_read(f, event, buf, len, flags);
        if (n != -FI_EAGAIN || fiv_now_ns() >= deadline)
            return n;
    }
}

static const char *eq_strerror(struct fid_eq *f, int prov_errno,
                               const void *err_data, char *buf, size_t len)
{
    (void)f;
    (void)err_data;
    return fiv_strerror(prov_errno, buf, len);
}

static int eq_close(struct fid *fid)
{
    struct fiv_eq_impl *q = container_of(fid, struct fiv_eq_impl, base.eq.fid);
    pthread_mutex_destroy(&q->lock);
    free(q);
    return 0;
}

static struct fi_ops eq_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = eq_close,
    .bind = fiv_no_bind,
    .control = fiv_no_control,
    .ops_open = fiv_no_ops_open,
};

static struct fi_ops_eq eq_ops = {
    .size = sizeof(struct fi_ops_eq),
    .read = eq_read,
    .readerr = eq_readerr,
    .write = eq_write,
    .sread = eq_sread,
    .strerror = eq_strerror,
};

int fiv_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr,
                struct fid_eq **eq, void *context)
{
    (void)attr;
    struct fiv_eq_impl *q = calloc(1, sizeof *q);
    if (!q)
        return -FI_ENOMEM;
    q->base.fab = container_of(fabric, struct fiv_fabric, fab);
    pthread_mutex_init(&q->lock, NULL);
    q->base.eq.fid.fclass = FI_CLASS_EQ;
    q->base.eq.fid.context = context;
    q->base.eq.fid.ops = &eq_fi_ops;
    q->base.eq.ops = &eq_ops;
    *eq = &q->base.eq;
    return 0;
}

/*
 * Sending: every BTL fragment is one libivshm message (the BTL tag is the
 * message tag), copied into the ring by ivshm_try_send. When the ring is
 * full the fragment waits on its endpoint's FIFO and progress retries it;
 * nothing overtakes a queued fragment, so each peer sees our fragments in
 * order.
 *
 * Completion callbacks are never made from inside btl_send: ob1 updates
 * its pipeline counters after btl_send returns, and it advances its own
 * pending lists only from callbacks (Open MPI issue #3845, which is why
 * vader always calls back too). So sent fragments go on the completion
 * queue and progress makes their callbacks.
 */
#include "btl_ivshmem.h"
#include "btl_ivshmem_frag.h"

#include "opal/datatype/opal_convertor.h"

#include <errno.h>
#include <string.h>

/* sendi copies header + payload into one stack buffer up to this size
   (the default eager limit is one 4 KiB slot's payload). */
#define SENDI_STACK_BYTES 4096

mca_btl_base_descriptor_t *mca_btl_ivshmem_alloc(struct mca_btl_base_module_t *btl,
                                                 struct mca_btl_base_endpoint_t *ep,
                                                 uint8_t order, size_t size,
                                                 uint32_t flags)
{
    (void)btl;
    mca_btl_ivshmem_frag_t *f = ivshmem_frag_get(size);
    if (OPAL_UNLIKELY(NULL == f))
        return NULL;
    f->endpoint = ep;
    f->base.des_flags = flags;
    f->base.order = order;
    return &f->base;
}

int mca_btl_ivshmem_free(struct mca_btl_base_module_t *btl,
                         mca_btl_base_descriptor_t *des)
{
    (void)btl;
    ivshmem_frag_return((mca_btl_ivshmem_frag_t *)des);
    return OPAL_SUCCESS;
}

/* Always a copy (no in-place segments): a fragment has to be one buffer
   for ivshm_try_send, and it may wait in a queue after we return. */
mca_btl_base_descriptor_t *mca_btl_ivshmem_prepare_src(
    struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
    struct opal_convertor_t *convertor, uint8_t order, size_t reserve,
    size_t *size, uint32_t flags)
{
    const size_t max = btl->btl_max_send_size;
    if (OPAL_UNLIKELY(reserve >= max))
        return NULL;
    if (*size > max - reserve)
        *size = max - reserve;
    mca_btl_ivshmem_frag_t *f = ivshmem_frag_get(reserve + *size);
    if (OPAL_UNLIKELY(NULL == f))
        return NULL;
    if (*size) {
        struct iovec iov = {.iov_base = (IOVBASE_TYPE *)(f->data + reserve),
                            .iov_len = *size};
        uint32_t iov_count = 1;
        size_t packed = *size;
        if (OPAL_UNLIKELY(opal_convertor_pack(convertor, &iov, &iov_count, &packed) < 0)) {
            ivshmem_frag_return(f);
            return NULL;
        }
        *size = packed;
    }
    f->segment.seg_len = reserve + *size;
    f->endpoint = ep;
    f->base.des_flags = flags;
    f->base.order = order;
    return &f->base;
}

/* Queue `f` behind whatever `ep` already waits for. With `lock`. */
static inline void enqueue_pending(mca_btl_ivshmem_endpoint_t *ep,
                                   mca_btl_ivshmem_frag_t *f)
{
    ivshmem_queue_push(&ep->pending, f);
    mca_btl_ivshmem_component.num_pending++;
}

static inline void count_sent(size_t len)
{
    mca_btl_ivshmem_component.counters.sent_msgs++;
    mca_btl_ivshmem_component.counters.sent_bytes += len;
}

int mca_btl_ivshmem_send(struct mca_btl_base_module_t *btl,
                         struct mca_btl_base_endpoint_t *ep,
                         mca_btl_base_descriptor_t *des, mca_btl_base_tag_t tag)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    mca_btl_ivshmem_frag_t *f = (mca_btl_ivshmem_frag_t *)des;
    (void)btl;
    if (OPAL_UNLIKELY(ep->dead))
        return OPAL_ERR_UNREACH;
    f->endpoint = ep;
    f->tag = tag;
    f->status = OPAL_SUCCESS;
    if (des->des_cbfunc)
        des->des_flags |= MCA_BTL_DES_SEND_ALWAYS_CALLBACK; /* see top */

    const void *buf = des->des_segments[0].seg_addr.pval;
    const size_t len = des->des_segments[0].seg_len;
    OPAL_THREAD_LOCK(&c->lock);
    if (OPAL_LIKELY(0 == ep->pending.count)) {
        int rc = ivshm_try_send(c->h, ep->slot, tag, buf, len);
        if (OPAL_LIKELY(0 == rc)) {
            count_sent(len);
            ivshmem_queue_push(&c->complete, f);
            OPAL_THREAD_UNLOCK(&c->lock);
            return OPAL_SUCCESS;
        }
        if (rc != -EAGAIN) {
            OPAL_THREAD_UNLOCK(&c->lock);
            mca_btl_ivshmem_peer_failed(ep, rc);
            return OPAL_ERR_UNREACH;
        }
    }
    enqueue_pending(ep, f);
    OPAL_THREAD_UNLOCK(&c->lock);
    return OPAL_SUCCESS;
}

/*
 * Hot path of small messages (ob1's match header + up to eager_limit
 * bytes). Invariant: we only write the ring when the endpoint's FIFO is
 * empty, so a sendi never overtakes a queued fragment; contiguous data is
 * read in place (the convertor is not advanced), so a refusal leaves the
 * caller's convertor as it was.
 */
int mca_btl_ivshmem_sendi(struct mca_btl_base_module_t *btl,
                          struct mca_btl_base_endpoint_t *ep,
                          struct opal_convertor_t *convertor, void *header,
                          size_t header_size, size_t payload_size,
                          uint8_t order, uint32_t flags, mca_btl_base_tag_t tag,
                          mca_btl_base_descriptor_t **descriptor)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    const size_t total = header_size + payload_size;
    mca_btl_ivshmem_frag_t *f;
    int rc;
    (void)order;
    (void)flags;

    if (OPAL_UNLIKELY(ep->pending.count || ep->dead ||
                      total > btl->btl_eager_limit)) {
        if (descriptor)
            *descriptor = NULL;
        return ep->dead ? OPAL_ERR_UNREACH : OPAL_ERR_OUT_OF_RESOURCE;
    }

    if (OPAL_LIKELY(total <= SENDI_STACK_BYTES &&
                    (0 == payload_size || !opal_convertor_need_buffers(convertor)))) {
        unsigned char stage[SENDI_STACK_BYTES] __attribute__((aligned(16)));
        const void *msg = header;
        if (payload_size) {
            void *data = NULL;
            opal_convertor_get_current_pointer(convertor, &data);
            memcpy(stage, header, header_size);
            memcpy(stage + header_size, data, payload_size);
            msg = stage;
        }
        OPAL_THREAD_LOCK(&c->lock);
        rc = ivshm_try_send(c->h, ep->slot, tag, msg, total);
        if (OPAL_LIKELY(0 == rc)) {
            count_sent(total);
            OPAL_THREAD_UNLOCK(&c->lock);
            return OPAL_SUCCESS;
        }
        OPAL_THREAD_UNLOCK(&c->lock);
        if (rc != -EAGAIN)
            goto failed;
        /* ring full: keep our own copy in the FIFO; the PML is done */
        f = ivshmem_frag_get(total);
        if (!f)
            goto busy;
        memcpy(f->data, msg, total);
    } else {
        /* non-contiguous (or oversized for the stack): pack into a frag */
        f = ivshmem_frag_get(total);
        if (!f)
            goto busy;
        memcpy(f->data, header, header_size);
        if (payload_size) {
            struct iovec iov = {.iov_base = (IOVBASE_TYPE *)(f->data + header_size),
                                .iov_len = payload_size};
            uint32_t iov_count = 1;
            size_t packed = payload_size;
            if (opal_convertor_pack(convertor, &iov, &iov_count, &packed) < 0 ||
                packed != payload_size) {
                ivshmem_frag_return(f);
                goto busy;
            }
        }
    }
    f->segment.seg_len = total;
    f->endpoint = ep;
    f->tag = tag;
    f->base.des_flags = MCA_BTL_DES_FLAGS_BTL_OWNERSHIP; /* no callback */
    OPAL_THREAD_LOCK(&c->lock);
    if (0 == ep->pending.count) {
        rc = ivshm_try_send(c->h, ep->slot, tag, f->data, total);
        if (0 == rc) {
            count_sent(total);
            OPAL_THREAD_UNLOCK(&c->lock);
            ivshmem_frag_return(f);
            return OPAL_SUCCESS;
        }
        if (rc != -EAGAIN) {
            OPAL_THREAD_UNLOCK(&c->lock);
            ivshmem_frag_return(f);
            goto failed;
        }
    }
    enqueue_pending(ep, f);
    OPAL_THREAD_UNLOCK(&c->lock);
    return OPAL_SUCCESS;

failed:
    mca_btl_ivshmem_peer_failed(ep, rc);
    if (descriptor)
        *descriptor = NULL;
    return OPAL_ERR_UNREACH;
busy:
    if (descriptor)
        *descriptor = NULL;
    return OPAL_ERR_OUT_OF_RESOURCE;
}

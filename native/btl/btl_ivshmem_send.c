/*
 * Sending: every BTL fragment is one libivshm message (the BTL tag is the
 * message tag). When the fragment fits one ring slot and nothing waits
 * for the endpoint, it is packed straight into the slot
 * (ivshm_send_reserve) and published by ivshm_send_commit: the only copy
 * is the pack. Otherwise it goes through our own buffer and
 * ivshm_try_send. When the ring is full the fragment waits on its
 * endpoint's FIFO and progress retries it; nothing overtakes a queued
 * fragment, so each peer sees our fragments in order.
 *
 * A prepare_src descriptor packed in a slot holds the reservation of the
 * slot at our ring head (ep->in_ring) until btl_send commits it or it is
 * freed; meanwhile every other send to that peer queues, since it would
 * take the same slot.
 *
 * Completion callbacks are never made from inside btl_send: ob1 updates
 * its pipeline counters after btl_send returns, and it advances its own
 * pending lists only from callbacks (which is why vader always calls
 * back too). So sent fragments go on the completion queue and progress
 * makes their callbacks.
 */
#include "btl_ivshmem.h"
#include "btl_ivshmem_frag.h"

#include "opal/datatype/opal_convertor.h"

#include <errno.h>
#include <string.h>

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
    mca_btl_ivshmem_frag_t *f = (mca_btl_ivshmem_frag_t *)des;
    mca_btl_ivshmem_endpoint_t *ep = f->endpoint;
    if (OPAL_UNLIKELY(ep && ep->in_ring == f)) {
        /* never sent: the reserved slot was never published, drop it */
        OPAL_THREAD_LOCK(&mca_btl_ivshmem_component.lock);
        ep->in_ring = NULL;
        OPAL_THREAD_UNLOCK(&mca_btl_ivshmem_component.lock);
    }
    ivshmem_frag_return(f);
    return OPAL_SUCCESS;
}

/* Always a copy: into the ring slot the fragment will be published from
   when the endpoint has nothing queued or reserved, else into the
   fragment's own buffer (it may wait in a queue after we return). The
   convertor packs, except a large contiguous payload into a slot, which
   btl_ivshmem_copy.c copies. */
mca_btl_base_descriptor_t *mca_btl_ivshmem_prepare_src(
    struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
    struct opal_convertor_t *convertor, uint8_t order, size_t reserve,
    size_t *size, uint32_t flags)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    const size_t max = btl->btl_max_send_size;
    if (OPAL_UNLIKELY(reserve >= max))
        return NULL;
    if (*size > max - reserve)
        *size = max - reserve;
    mca_btl_ivshmem_frag_t *f = ivshmem_frag_get(reserve + *size);
    if (OPAL_UNLIKELY(NULL == f))
        return NULL;
    f->endpoint = ep;
    unsigned char *dst = f->data;
    if (OPAL_LIKELY(0 == ep->pending.count && NULL == ep->in_ring)) {
        OPAL_THREAD_LOCK(&c->lock);
        if (0 == ep->pending.count && NULL == ep->in_ring && !ep->dead) {
            int err;
            unsigned char *slot = ivshm_send_reserve(c->h, ep->slot, reserve + *size, &err);
            if (OPAL_LIKELY(NULL != slot)) {
                ep->in_ring = f;
                dst = slot;
            }
        }
        OPAL_THREAD_UNLOCK(&c->lock);
    }
    if (*size >= IVSHMEM_STREAM_MIN && dst != f->data &&
        !opal_convertor_need_buffers(convertor)) {
        /* contiguous, into the slot: copied here rather than by the
           convertor, so that a large payload can take non-temporal
           stores; then the convertor is moved on as a pack would */
        size_t left = convertor->local_size - convertor->bConverted;
        if (*size > left)
            *size = left;
        void *src;
        opal_convertor_get_current_pointer(convertor, &src);
        mca_btl_ivshmem_copy_to_slot(ep, dst + reserve, src, *size);
        size_t pos = convertor->bConverted + *size;
        opal_convertor_set_position(convertor, &pos);
    } else if (*size) {
        struct iovec iov = {.iov_base = (IOVBASE_TYPE *)(dst + reserve),
                            .iov_len = *size};
        uint32_t iov_count = 1;
        size_t packed = *size;
        if (OPAL_UNLIKELY(opal_convertor_pack(convertor, &iov, &iov_count, &packed) < 0)) {
            mca_btl_ivshmem_free(btl, &f->base);
            return NULL;
        }
        *size = packed;
    }
    f->segment.seg_addr.pval = dst;
    f->segment.seg_len = reserve + *size;
    f->base.des_flags = flags;
    f->base.order = order;
    return &f->base;
}

/* Queue `f` behind whatever `ep` already waits for; progress retries
   the endpoints on pending_eps only. With `lock`. */
void mca_btl_ivshmem_enqueue_pending(mca_btl_ivshmem_endpoint_t *ep,
                                     mca_btl_ivshmem_frag_t *f)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    ivshmem_queue_push(&ep->pending, f);
    c->num_pending++;
    if (!ep->on_pending_list) {
        ep->on_pending_list = true;
        ep->next_pending = c->pending_eps;
        c->pending_eps = ep;
    }
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
    /* Published now only if nothing waits for the endpoint; -EAGAIN
       stands for "queue it". */
    int rc = -EAGAIN;
    const bool packed = ep->in_ring == f;
    if (OPAL_LIKELY(packed)) {
        /* packed in the slot at our ring head (prepare_src) */
        ep->in_ring = NULL;
        f->segment.seg_addr.pval = f->data; /* the slot is not ours after */
        if (OPAL_LIKELY(0 == ep->pending.count))
            rc = ivshm_send_commit(c->h, ep->slot, tag, len);
    } else if (OPAL_LIKELY(0 == ep->pending.count && NULL == ep->in_ring)) {
        rc = ivshm_try_send(c->h, ep->slot, tag, buf, len);
    }
    if (OPAL_LIKELY(0 == rc)) {
        count_sent(len);
        ivshmem_queue_push(&c->complete, f);
        OPAL_THREAD_UNLOCK(&c->lock);
        return OPAL_SUCCESS;
    }
    if (rc != -EAGAIN && !mca_btl_ivshmem_send_refused(ep, rc)) {
        OPAL_THREAD_UNLOCK(&c->lock);
        mca_btl_ivshmem_peer_failed(ep, rc);
        return OPAL_ERR_UNREACH;
    }
    /* Queued behind earlier fragments, or refused for now (a packed one
       was packed for the receiver's queue, whose room other senders
       took since the reservation): a packed fragment leaves the
       unpublished slot for our own buffer. */
    if (packed)
        memcpy(f->data, buf, len);
    mca_btl_ivshmem_enqueue_pending(ep, f);
    OPAL_THREAD_UNLOCK(&c->lock);
    return OPAL_SUCCESS;
}

/* Header + payload into `dst` (a ring slot or a fragment): 0, or -1 if
   the convertor fails. Contiguous data is read in place and the convertor
   is not advanced, so a refusal leaves it as it was. */
static inline int pack_inline(unsigned char *dst, const void *header,
                              size_t header_size, struct opal_convertor_t *convertor,
                              size_t payload_size)
{
    memcpy(dst, header, header_size);
    if (0 == payload_size)
        return 0;
    if (OPAL_LIKELY(!opal_convertor_need_buffers(convertor))) {
        void *data = NULL;
        opal_convertor_get_current_pointer(convertor, &data);
        memcpy(dst + header_size, data, payload_size);
        return 0;
    }
    struct iovec iov = {.iov_base = (IOVBASE_TYPE *)(dst + header_size),
                        .iov_len = payload_size};
    uint32_t iov_count = 1;
    size_t packed = payload_size;
    if (opal_convertor_pack(convertor, &iov, &iov_count, &packed) < 0 ||
        packed != payload_size)
        return -1;
    return 0;
}

/* How a way of sendi ended. */
enum sendi_result {
    SENDI_SENT,   /* published */
    SENDI_COPY,   /* not now: keep a copy in the endpoint's FIFO */
    SENDI_BUSY,   /* no fragment for a copy: ob1 keeps the message */
    SENDI_FAILED, /* the peer failed (rc says how) */
};

/* A fragment of ours holding a `total`-byte message to `ep` that waits in
   its FIFO: no completion callback, the PML is done with it. */
static mca_btl_ivshmem_frag_t *fifo_frag(mca_btl_ivshmem_endpoint_t *ep,
                                         mca_btl_base_tag_t tag, size_t total)
{
    mca_btl_ivshmem_frag_t *f = ivshmem_frag_get(total);
    if (!f)
        return NULL;
    f->segment.seg_len = total;
    f->endpoint = ep;
    f->tag = tag;
    f->base.des_flags = MCA_BTL_DES_FLAGS_BTL_OWNERSHIP; /* no callback */
    return f;
}

/* What else than -EAGAIN sendi retries from the FIFO rather than failing
   the peer: -EMSGSIZE (an eager limit set above one slot's payload: the
   copy goes through try_send, which streams) and a refusal. */
static inline bool sendi_retry(int rc)
{
    return rc == -EAGAIN || rc == -EMSGSIZE || rc == IVSHM_ECORRUPT;
}

/* Contiguous data (the common case): header and payload go into the next
   slot in one libivshm call, no reservation. Invariant: the ring is
   written only while the endpoint has nothing queued or reserved. */
static inline enum sendi_result sendi_contiguous(
    mca_btl_ivshmem_component_t *c, mca_btl_ivshmem_endpoint_t *ep,
    struct opal_convertor_t *convertor, void *header, size_t header_size,
    size_t payload_size, mca_btl_base_tag_t tag, int *rc)
{
    void *data = NULL;
    if (payload_size)
        opal_convertor_get_current_pointer(convertor, &data);
    OPAL_THREAD_LOCK(&c->lock);
    if (OPAL_UNLIKELY(ep->pending.count || ep->in_ring)) {
        OPAL_THREAD_UNLOCK(&c->lock); /* another thread got there first */
        return SENDI_COPY;
    }
    *rc = ivshm_send_small(c->h, ep->slot, tag, header, header_size, data,
                           payload_size);
    OPAL_THREAD_UNLOCK(&c->lock);
    if (OPAL_LIKELY(0 == *rc)) {
        count_sent(header_size + payload_size);
        return SENDI_SENT;
    }
    /* ring or queue full, or refused: retried from the FIFO */
    return sendi_retry(*rc) ? SENDI_COPY : SENDI_FAILED;
}

/* Data the convertor must pack: reserve the next slot, pack into it,
   commit. With `lock`; `slot` reserved, nothing queued or reserved
   before. */
static enum sendi_result sendi_pack_commit(
    mca_btl_ivshmem_component_t *c, mca_btl_ivshmem_endpoint_t *ep,
    unsigned char *slot, struct opal_convertor_t *convertor, void *header,
    size_t header_size, size_t payload_size, mca_btl_base_tag_t tag, int *rc)
{
    const size_t total = header_size + payload_size;
    if (OPAL_UNLIKELY(pack_inline(slot, header, header_size, convertor,
                                  payload_size) < 0))
        return SENDI_BUSY; /* never committed: nothing sent */
    *rc = ivshm_send_commit(c->h, ep->slot, tag, total);
    if (OPAL_LIKELY(0 == *rc))
        return SENDI_SENT;
    if (*rc != -EAGAIN)
        return SENDI_FAILED;
    /* Packed for the receiver's queue (staged in our memory), whose
       room other senders took since the reservation: a copy waits in
       the FIFO, as for a full ring; the PML is done. */
    mca_btl_ivshmem_frag_t *f = fifo_frag(ep, tag, total);
    if (!f)
        return SENDI_BUSY; /* never committed: nothing sent */
    memcpy(f->data, slot, total);
    mca_btl_ivshmem_enqueue_pending(ep, f);
    return SENDI_SENT;
}

static enum sendi_result sendi_packed(
    mca_btl_ivshmem_component_t *c, mca_btl_ivshmem_endpoint_t *ep,
    struct opal_convertor_t *convertor, void *header, size_t header_size,
    size_t payload_size, mca_btl_base_tag_t tag, int *rc)
{
    const size_t total = header_size + payload_size;
    OPAL_THREAD_LOCK(&c->lock);
    unsigned char *slot = ivshm_send_reserve(c->h, ep->slot, total, rc);
    if (OPAL_LIKELY(NULL != slot && NULL == ep->in_ring && 0 == ep->pending.count)) {
        enum sendi_result r = sendi_pack_commit(c, ep, slot, convertor, header,
                                                header_size, payload_size, tag,
                                                rc);
        OPAL_THREAD_UNLOCK(&c->lock);
        if (SENDI_SENT == r && 0 == *rc)
            count_sent(total);
        return r;
    }
    OPAL_THREAD_UNLOCK(&c->lock);
    if (NULL != slot)
        return SENDI_BUSY; /* another thread queued or reserved meanwhile */
    return sendi_retry(*rc) ? SENDI_COPY : SENDI_FAILED;
}

/* Ring full or fragments queued: our own copy goes to the FIFO, unless
   the endpoint has become idle meanwhile and it goes out at once. */
static enum sendi_result sendi_copy(
    mca_btl_ivshmem_component_t *c, mca_btl_ivshmem_endpoint_t *ep,
    struct opal_convertor_t *convertor, void *header, size_t header_size,
    size_t payload_size, mca_btl_base_tag_t tag, int *rc)
{
    const size_t total = header_size + payload_size;
    mca_btl_ivshmem_frag_t *f = fifo_frag(ep, tag, total);
    if (!f)
        return SENDI_BUSY;
    if (pack_inline(f->data, header, header_size, convertor, payload_size) < 0) {
        ivshmem_frag_return(f);
        return SENDI_BUSY;
    }
    OPAL_THREAD_LOCK(&c->lock);
    if (0 == ep->pending.count && NULL == ep->in_ring) {
        *rc = ivshm_try_send(c->h, ep->slot, tag, f->data, total);
        if (0 == *rc || (*rc != -EAGAIN && !mca_btl_ivshmem_send_refused(ep, *rc))) {
            if (0 == *rc)
                count_sent(total);
            OPAL_THREAD_UNLOCK(&c->lock);
            ivshmem_frag_return(f);
            return 0 == *rc ? SENDI_SENT : SENDI_FAILED;
        }
    }
    mca_btl_ivshmem_enqueue_pending(ep, f);
    OPAL_THREAD_UNLOCK(&c->lock);
    return SENDI_SENT;
}

/* Everything sendi's hot path leaves: a dead peer, a message above the
   eager limit, an endpoint with fragments queued or a slot reserved,
   data the convertor must pack, threads (the path below takes no lock),
   and a small send libivshm did not take (ring full, refused, ...).
   Behind queued fragments a copy joins the queue, never a refusal: a
   refused sendi sends ob1's request to its own pending list, and ob1
   retries all of those on every progress call, each retry one more
   refusal, until our queue drains (a retry storm that halved the
   message rate). */
static __attribute__((noinline)) int sendi_general(
    struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
    struct opal_convertor_t *convertor, void *header, size_t header_size,
    size_t payload_size, mca_btl_base_tag_t tag,
    mca_btl_base_descriptor_t **descriptor)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (OPAL_UNLIKELY(ep->dead ||
                      header_size + payload_size > btl->btl_eager_limit)) {
        if (descriptor)
            *descriptor = NULL;
        return ep->dead ? OPAL_ERR_UNREACH : OPAL_ERR_OUT_OF_RESOURCE;
    }
    int rc = 0;
    enum sendi_result r = SENDI_COPY;
    if (OPAL_LIKELY(0 == ep->pending.count && NULL == ep->in_ring))
        r = OPAL_LIKELY(0 == payload_size ||
                        !opal_convertor_need_buffers(convertor))
                ? sendi_contiguous(c, ep, convertor, header, header_size,
                                   payload_size, tag, &rc)
                : sendi_packed(c, ep, convertor, header, header_size,
                               payload_size, tag, &rc);
    if (OPAL_UNLIKELY(SENDI_COPY == r))
        r = sendi_copy(c, ep, convertor, header, header_size, payload_size,
                       tag, &rc);
    if (OPAL_LIKELY(SENDI_SENT == r))
        return OPAL_SUCCESS;
    if (descriptor)
        *descriptor = NULL;
    if (SENDI_BUSY == r)
        return OPAL_ERR_OUT_OF_RESOURCE;
    mca_btl_ivshmem_peer_failed(ep, rc);
    return OPAL_ERR_UNREACH;
}

/*
 * Hot path of small messages (ob1's match header + up to eager_limit
 * bytes of contiguous data, one thread): header and payload go straight
 * into the next ring slot in one libivshm call, one release store
 * publishes them. Invariant: we only write the ring when the endpoint
 * has nothing queued or reserved, so a sendi never overtakes a queued
 * fragment. Anything else, and a send libivshm did not take, is
 * sendi_general's (which may try the same send again: a failed
 * ivshm_send_small sent nothing).
 */
int mca_btl_ivshmem_sendi(struct mca_btl_base_module_t *btl,
                          struct mca_btl_base_endpoint_t *ep,
                          struct opal_convertor_t *convertor, void *header,
                          size_t header_size, size_t payload_size,
                          uint8_t order, uint32_t flags, mca_btl_base_tag_t tag,
                          mca_btl_base_descriptor_t **descriptor)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    (void)order;
    (void)flags;
    if (OPAL_LIKELY(!ep->dead && 0 == ep->pending.count &&
                    NULL == ep->in_ring && !opal_using_threads() &&
                    header_size + payload_size <= btl->btl_eager_limit &&
                    (0 == payload_size ||
                     !opal_convertor_need_buffers(convertor)))) {
        void *data = NULL;
        if (payload_size)
            opal_convertor_get_current_pointer(convertor, &data);
        if (OPAL_LIKELY(0 == ivshm_send_small(c->h, ep->slot, tag, header,
                                              header_size, data,
                                              payload_size))) {
            count_sent(header_size + payload_size);
            return OPAL_SUCCESS;
        }
    }
    return sendi_general(btl, ep, convertor, header, header_size,
                         payload_size, tag, descriptor);
}

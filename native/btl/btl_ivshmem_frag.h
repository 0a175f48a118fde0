/*
 * Send fragments: a BTL descriptor with its data inline after it, so a
 * fragment is always one contiguous buffer that ivshm_try_send can copy
 * into a ring in one call.
 */
#ifndef MCA_BTL_IVSHMEM_FRAG_H
#define MCA_BTL_IVSHMEM_FRAG_H

#include "btl_ivshmem.h"

BEGIN_C_DECLS

typedef struct mca_btl_ivshmem_frag_t {
    mca_btl_base_descriptor_t base;
    mca_btl_base_segment_t segment;  /* one: header and data together */
    struct mca_btl_base_endpoint_t *endpoint;
    opal_free_list_t *my_list;
    struct mca_btl_ivshmem_frag_t *next; /* queue link */
    size_t capacity;                     /* bytes in data[]             */
    uint32_t tag;                        /* ivshm tag while queued      */
    int status;                          /* for the completion callback */
    unsigned char data[] __attribute__((aligned(16)));
} mca_btl_ivshmem_frag_t;

OBJ_CLASS_DECLARATION(mca_btl_ivshmem_frag_t);

/* free-list item initializer: remembers the owning list and capacity */
int mca_btl_ivshmem_frag_init(opal_free_list_item_t *item, void *ctx);

/* A fragment that holds at least `size` bytes, or NULL. */
static inline mca_btl_ivshmem_frag_t *ivshmem_frag_get(size_t size)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    opal_free_list_t *list;
    if (size <= mca_btl_ivshmem.super.btl_eager_limit)
        list = &c->frags_eager;
    else if (size <= mca_btl_ivshmem.super.btl_max_send_size)
        list = &c->frags_max;
    else
        return NULL;
    mca_btl_ivshmem_frag_t *f = (mca_btl_ivshmem_frag_t *)opal_free_list_get(list);
    if (OPAL_UNLIKELY(NULL == f))
        return NULL;
    f->segment.seg_addr.pval = f->data;
    f->segment.seg_len = size;
    f->base.des_segments = &f->segment;
    f->base.des_segment_count = 1;
    f->base.des_cbfunc = NULL;
    f->base.des_cbdata = NULL;
    f->base.des_flags = 0;
    f->base.order = MCA_BTL_NO_ORDER;
    f->endpoint = NULL;
    f->next = NULL;
    f->status = OPAL_SUCCESS;
    return f;
}

static inline void ivshmem_frag_return(mca_btl_ivshmem_frag_t *f)
{
    opal_free_list_return(f->my_list, (opal_free_list_item_t *)f);
}

static inline void ivshmem_queue_push(ivshmem_frag_queue_t *q,
                                      mca_btl_ivshmem_frag_t *f)
{
    f->next = NULL;
    if (q->tail)
        q->tail->next = f;
    else
        q->head = f;
    q->tail = f;
    q->count++;
}

static inline mca_btl_ivshmem_frag_t *ivshmem_queue_pop(ivshmem_frag_queue_t *q)
{
    mca_btl_ivshmem_frag_t *f = q->head;
    if (f) {
        q->head = f->next;
        if (!q->head)
            q->tail = NULL;
        q->count--;
        f->next = NULL;
    }
    return f;
}

/* Local completion of a sent fragment, outside `lock`: the callback may
   send again or free the descriptor, so the flags are read first. */
static inline void ivshmem_frag_complete(mca_btl_ivshmem_frag_t *f, int status)
{
    uint32_t flags = f->base.des_flags;
    if ((flags & MCA_BTL_DES_SEND_ALWAYS_CALLBACK) && f->base.des_cbfunc)
        f->base.des_cbfunc(&mca_btl_ivshmem.super, f->endpoint, &f->base, status);
    if (flags & MCA_BTL_DES_FLAGS_BTL_OWNERSHIP)
        ivshmem_frag_return(f);
}

END_C_DECLS
#endif

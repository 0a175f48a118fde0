#include "btl_ivshmem_frag.h"

static void frag_construct(mca_btl_ivshmem_frag_t *f)
{
    f->segment.seg_addr.pval = f->data;
    f->segment.seg_len = 0;
    f->base.des_segments = &f->segment;
    f->base.des_segment_count = 1;
    f->my_list = NULL;
    f->next = NULL;
    f->capacity = 0;
}

OBJ_CLASS_INSTANCE(mca_btl_ivshmem_frag_t, mca_btl_base_descriptor_t,
                   frag_construct, NULL);

int mca_btl_ivshmem_frag_init(opal_free_list_item_t *item, void *ctx)
{
    mca_btl_ivshmem_frag_t *f = (mca_btl_ivshmem_frag_t *)item;
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    f->my_list = (opal_free_list_t *)ctx;
    f->capacity = f->my_list == &c->frags_eager
                      ? mca_btl_ivshmem.super.btl_eager_limit
                      : mca_btl_ivshmem.super.btl_max_send_size;
    return OPAL_SUCCESS;
}

/*
 * The copy of a large payload into its ring slot (prepare_src): plain
 * stores, or non-temporal ones while plain stores are slow.
 *
 * The receiver reads a slot right after we fill it. Normally its lines
 * then go from our cache to the receiver's, and plain stores are the
 * fastest way. But the lines of a slot were last read by the receiver,
 * and there are stretches of seconds on the project's VMs in which
 * writing lines the other CPU holds runs at 2-4 GB/s instead of up to 27
 * (`handoff` shows it without MPI; docs/btl.md, "Message path"): a
 * 2 MB MPI_Sendrecv then takes 1.33 ms instead of 0.19. Non-temporal
 * stores need no copy of the line first and keep 9-20 GB/s (median 16)
 * in those stretches, but make that exchange 1.8-2.9x slower when the
 * machine is fine (the receiver then reads from memory, not from our
 * cache). So by default (btl_ivshmem_stream_copy -1) we time every
 * IVSHMEM_COPY_SAMPLE-th plain copy of a large payload; two timed copies
 * in a row slower than IVSHMEM_SLOW_NS_PER_KIB make the next
 * IVSHMEM_STREAM_RUN copies to that peer non-temporal, after which plain
 * copies are timed again.
 *
 * The state is per endpoint and only steers a heuristic: two threads
 * sending to one peer at once may lose an update, never data.
 */
#include "btl_ivshmem.h"

#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* 4 GB/s: the fast state copies 16 KiB in 0.6-1.4 us, the slow one in
   6-8 us. */
#define IVSHMEM_SLOW_NS_PER_KIB 250u
#define IVSHMEM_COPY_SAMPLE 4u
#define IVSHMEM_STREAM_RUN 256u /* 4 MiB of 16 KiB fragments */

/* Non-temporal copy. The fence orders the stores before the release
   store that publishes the slot (x86 orders plain stores, not these). */
static void copy_streaming(unsigned char *dst, const unsigned char *src,
                           size_t n)
{
#if defined(__SSE2__)
    size_t head = (16u - ((uintptr_t)dst & 15u)) & 15u;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

void mca_btl_ivshmem_copy_to_slot(mca_btl_ivshmem_endpoint_t *ep, void *dst,
                                  const void *src, size_t n)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (n < IVSHMEM_STREAM_MIN || 0 == c->stream_copy) {
        memcpy(dst, src, n);
        return;
    }
    uint32_t left = __atomic_load_n(&ep->stream_left, __ATOMIC_RELAXED);
    if (c->stream_copy > 0 || left) {
        if (left)
            __atomic_store_n(&ep->stream_left, left - 1, __ATOMIC_RELAXED);
        copy_streaming(dst, src, n);
        __atomic_fetch_add(&c->counters.streamed, 1, __ATOMIC_RELAXED);
        return;
    }
    uint32_t k = __atomic_add_fetch(&ep->plain_copies, 1, __ATOMIC_RELAXED);
    if (k % IVSHMEM_COPY_SAMPLE) {
        memcpy(dst, src, n);
        return;
    }
    uint64_t t0 = mca_btl_ivshmem_now_ns();
    memcpy(dst, src, n);
    uint64_t ns = mca_btl_ivshmem_now_ns() - t0;
    if (ns * 1024u <= (uint64_t)IVSHMEM_SLOW_NS_PER_KIB * n) {
        __atomic_store_n(&ep->slow_copies, 0, __ATOMIC_RELAXED);
        return;
    }
    /* one slow copy may be an interrupt; two in a row are the state */
    if (__atomic_add_fetch(&ep->slow_copies, 1, __ATOMIC_RELAXED) >= 2) {
        __atomic_store_n(&ep->slow_copies, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&ep->stream_left, IVSHMEM_STREAM_RUN,
                         __ATOMIC_RELAXED);
    }
}

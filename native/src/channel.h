/*
 * Fast channels (docs/region-layout.md, "Fast channels"): each receive
 * area holds fast_channels rings (ring.h), each with a descriptor that
 * says which sender owns it. Both sides of the descriptor and the
 * bookkeeping of who uses which channel (channel.c). The OPEN handshake
 * that announces a taken channel goes through the receiver's queue: the
 * sender's side is in send.c, the receiver's in recv.c; the sweep of
 * descriptors left behind is in rx_area.c.
 */
#ifndef IVSHM_CHANNEL_H
#define IVSHM_CHANNEL_H

#include "attachment.h"

/* ---- sender ---- */

/* Take a free fast channel of `j`'s area (a CAS on its descriptor): its
   index, or -1 if none is free. */
IVSHM_INTERNAL int ivshm_chan_claim(ivshm *h, int j);
/* Give back channel k of `j` we claimed but could not announce. */
IVSHM_INTERNAL void ivshm_chan_giveback(ivshm *h, int j, uint32_t k);
/* Send to `j` on its channel k from now on (announced). */
IVSHM_INTERNAL void ivshm_chan_use(ivshm *h, int j, uint32_t k);

/* ---- receiver: the channels of our area ---- */

/* Empty fast ring k of our area and free its descriptor for the next
   sender. */
IVSHM_INTERNAL void ivshm_chan_reset(ivshm *h, uint32_t k);
/* Sender `slot` no longer uses its channel (gone and drained, or a new
   incarnation): free it. */
IVSHM_INTERNAL void ivshm_chan_free(ivshm *h, int slot);
/* Read `slot`'s messages from fast channel k of our area from now on
   (validated by the caller: k is free on our side, its descriptor names
   the sender, the sender has no channel with us). */
IVSHM_INTERNAL void ivshm_chan_adopt(ivshm *h, int slot, uint32_t k);
/* The OPEN cell of `slot` names channel k: adopt it if the descriptor
   says so (loaded once: the sender took it with its slot and the
   generation we know) and neither side uses a channel already. */
IVSHM_INTERNAL bool ivshm_chan_accept(ivshm *h, int slot, uint64_t k);
/* Does the ring of channel k say that its owner in generation `g`
   writes to it (position 0 published in that generation)? */
IVSHM_INTERNAL bool ivshm_chan_in_use(ivshm *h, uint32_t k, uint32_t g);
/* The fast ring `from` -> `to` if `from` owns a channel of `to`'s area
   (for tests and diagnostics), else NULL. */
IVSHM_INTERNAL uint8_t *ivshm_fast_ring_of(const ivshm *h, int from, int to);

#endif

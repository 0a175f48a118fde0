/*
 * Sending (send.c): the message API of ivshm.h chooses the path to a
 * peer, its queue or our fast channel to it.
 */
#ifndef IVSHM_SEND_H
#define IVSHM_SEND_H

#include "attachment.h"

/* Take a fast channel to `slot` now, whatever fast_after says (tests,
   and callers that know a pair will be busy): 0, -EAGAIN if none is
   free. */
IVSHM_INTERNAL int ivshm_fast_open(ivshm *h, int slot);

#endif

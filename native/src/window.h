/*
 * The window API of ivshm.h (window.c) and the lock over the heap and
 * the window directory that creating and freeing a window take.
 */
#ifndef IVSHM_WINDOW_H
#define IVSHM_WINDOW_H

#include "attachment.h"

/* Lock over heap + window directory; a dead owner is broken. 0, or
   -ETIMEDOUT while a live one holds it past its bound. */
IVSHM_INTERNAL int ivshm_alloc_lock(ivshm *h);
IVSHM_INTERNAL void ivshm_alloc_unlock(ivshm *h);

#endif

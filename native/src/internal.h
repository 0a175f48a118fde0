/*
 * Everything private to libivshm, in one include: for the C tests and
 * the fuzzers, which reach into the region and the handle. The library's
 * own files include only the headers of what they use (the layer order
 * is in docs/ARCHITECTURE.md, checked by tests/test_native_layers.py).
 */
#ifndef IVSHM_INTERNAL_H
#define IVSHM_INTERNAL_H

#include "layout.h"
#include "attachment.h"
#include "clock.h"
#include "region.h"
#include "window_table.h"
#include "registry.h"
#include "doorbell.h"
#include "doorbell_eventfd.h"
#include "ring.h"
#include "channel.h"
#include "peer_local.h"
#include "queue.h"
#include "rx_area.h"
#include "send.h"
#include "window.h"
#include "attach.h"

#endif

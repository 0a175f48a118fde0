/*
 * The eventfd doorbell of an ivshmem-server (QEMU's ivshmem-doorbell
 * protocol, docs/server-protocol.md): what attaching through a server
 * (attach_server.c) needs of its wire and its notices.
 */
#ifndef IVSHM_DOORBELL_EVENTFD_H
#define IVSHM_DOORBELL_EVENTFD_H

#include "doorbell.h"

#define SERVER_MAX_ID 65535         /* 16 bits in the Doorbell register */
/* The whole initial burst. The server greets a newcomer with every
   peer's vectors and tells every peer about it, so a job of hundreds of
   ranks attaching at once keeps it busy for seconds on a loaded host
   (128 ranks on 2 busy cores overran 5 s). Still a bound: a server that
   stalls fails the attach instead of hanging it. */
#define ATTACH_TIMEOUT_MS 30000

/* Read one message of the server: 8 bytes and at most one fd.
   `timeout_ms` bounds the wait for its first byte (0: only if one is
   pending). Returns 1 with a message, 0 if none came, -ECONNRESET at a
   clean EOF, -EPROTO for a malformed one, -EMFILE for a whole message
   whose fd the kernel could not give us (*value is set). */
IVSHM_INTERNAL int ivshm_server_recv(int sock, int timeout_ms, int64_t *value,
                                     int *fd_out);
/* The attachment whose registry the server's leave notices mark (from
   the moment the region is mapped). */
IVSHM_INTERNAL void ivshm_db_server_attach(struct ivshm_doorbell *db,
                                           ivshm *h);

#endif

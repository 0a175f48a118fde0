/*
 * ivshmem-server core: the QEMU ivshmem-doorbell protocol and the peer
 * table (docs/server-protocol.md). main.c owns options, daemonizing and
 * signals; this part owns the socket, the region and the clients.
 * Built on the public headers only (ivshm.h, ivshm_admin.h).
 */
#ifndef IVS_SERVER_H
#define IVS_SERVER_H

#include "ivshm.h"
#include "ivshm_admin.h"
#include "log.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define IVS_MAX_VECTORS 64
#define IVS_MAX_IDS 65536 /* the Doorbell register has 16 bits for the id */
#define IVS_MAX_CLIENTS 4096
/* Registry slots of a region: libivshm's limit (region layout v2) */
#define IVS_MAX_PEERS 1024
#define IVS_MAX_QUEUE 65536 /* cells of one receive queue */
#define IVS_MAX_FAST 64     /* fast channels per receiver */

struct ivs_config {
    const char *socket_path;  /* absolute */
    const char *shm_path;     /* absolute: host-file mode; NULL: sealed memfd */
    const char *state_path;   /* absolute, or NULL */
    uint64_t size;            /* power of two */
    unsigned vectors;         /* 1..IVS_MAX_VECTORS */
    ivshm_geometry geometry;
    gid_t gid;                /* with `shared_group` */
    bool shared_group;        /* socket and region 0660 with gid, else 0600 */
    bool keep_shm;            /* host-file mode: leave the file at shutdown */
    /* Never send leave notices: for a server whose clients are all QEMU
       ivshmem-doorbell devices (docs/server-protocol.md, "Quiet
       leaves"); leavers' registry entries are marked all the same. */
    bool no_leave_notices;
    unsigned max_clients;     /* connections at once, 1..IVS_MAX_CLIENTS */
    unsigned max_per_uid;     /* connections at once from one uid */
    /* Budgets (budget.h); 0: no limit. */
    unsigned max_per_pid;     /* connections at once from one process */
    unsigned uid_rate;        /* new connections per second, one uid */
    unsigned pid_rate;        /* ... one process */
    unsigned ids_per_pid;     /* ids one process may leave unusable */
    uint32_t max_ids;         /* id space 0..max_ids-1; 0: IVS_MAX_IDS */
};

struct ivs_server;

/* Create and format the region, then listen on the socket. Logs the
   reason and returns a negative errno/IVSHM_E* on failure (nothing left
   behind). */
int ivs_server_start(const struct ivs_config *cfg, struct ivs_server **out);
/* Write the first state file: the foreground server's "ready" signal,
   so main calls it once the pid file is written too. */
void ivs_server_publish(struct ivs_server *s);
/* One round of the loop: wait at most timeout_ms (-1: no limit) in
   ppoll with `wait_mask` (NULL: the current mask), then serve what is
   ready. Returns 0 (also when interrupted by a signal), or a negative
   errno when the loop cannot continue. */
int ivs_server_poll_once(struct ivs_server *s, const sigset_t *wait_mask,
                         int timeout_ms);
/* Serve until *stop becomes non-zero. `wait_mask` is the signal mask
   while blocked in ppoll (stop signals unblocked there only). */
int ivs_server_run(struct ivs_server *s, volatile sig_atomic_t *stop,
                   const sigset_t *wait_mask);
/* Connected clients (for tests and the fuzzer). */
size_t ivs_server_nclients(const struct ivs_server *s);
/* Write `path` through "<path>.tmp" (created O_EXCL|O_NOFOLLOW: a link
   planted there is never followed) and rename: readers see the old or
   the new content. 0 or -errno. */
int ivs_write_file_atomic(const char *path, const char *data, size_t len);
/* Disconnect every client, remove socket, state file and (host-file
   mode, unless keep_shm) the region file; free. NULL is ignored. */
void ivs_server_stop(struct ivs_server *s);

#endif

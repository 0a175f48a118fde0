/*
 * ivshmem-server core: the QEMU ivshmem-doorbell protocol and the peer
 * table (docs/server-protocol.md). main.c owns options, daemonizing and
 * signals; this part owns the socket, the region file and the clients.
 */
#ifndef IVS_SERVER_H
#define IVS_SERVER_H

#include "ivshm.h"

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define IVS_MAX_VECTORS 64
#define IVS_MAX_IDS 65536 /* the Doorbell register has 16 bits for the id */

struct ivs_config {
    const char *socket_path;  /* absolute */
    const char *shm_path;     /* absolute */
    const char *state_path;   /* absolute, or NULL */
    uint64_t size;            /* power of two */
    unsigned vectors;         /* 1..IVS_MAX_VECTORS */
    ivshm_geometry geometry;
    gid_t gid;                /* with `shared_group` */
    bool shared_group;        /* socket and region 0660 with gid, else 0600 */
    bool keep_shm;            /* leave the region file at shutdown */
};

/* Where log lines go: stderr (foreground) or syslog (daemon). */
enum { IVS_LOG_STDERR = 0, IVS_LOG_SYSLOG = 1 };
extern int ivs_log_target;
extern int ivs_verbose;
/* Errors are always logged; info lines only with ivs_verbose. */
void ivs_log_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void ivs_log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

struct ivs_server;

/* Create and format the region file, then listen on the socket. Logs the
   reason and returns a negative errno/IVSHM_E* on failure (nothing left
   behind). */
int ivs_server_start(const struct ivs_config *cfg, struct ivs_server **out);
/* Write the first state file: the foreground server's "ready" signal,
   so main calls it once the pid file is written too. */
void ivs_server_publish(struct ivs_server *s);
/* Serve until *stop becomes non-zero. `wait_mask` is the signal mask
   while blocked in ppoll (stop signals unblocked there only). Returns 0,
   or a negative errno when the loop cannot continue. */
int ivs_server_run(struct ivs_server *s, volatile sig_atomic_t *stop,
                   const sigset_t *wait_mask);
/* Disconnect every client, remove socket, state file and (unless
   keep_shm) the region file; free. NULL is ignored. */
void ivs_server_stop(struct ivs_server *s);

#endif

/*
 * libivshm administration API: what an ivshmem-server (native/server)
 * needs from the library, and nothing a peer needs. Peers use ivshm.h.
 *
 * An ivshmem-server owns one region per trust domain: it creates the
 * region, hands its fd to every client, and keeps its own mapping only
 * to mark the registry entries of clients that went away. It never joins
 * the registry and never sends or receives messages.
 *
 * All functions return 0 (or a non-negative count) on success and a
 * negative error code on failure: -errno or an IVSHM_E* code of ivshm.h
 * (ivshm_strerror() gives the text).
 */
#ifndef IVSHM_ADMIN_H
#define IVSHM_ADMIN_H

#include "ivshm.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * ivshm_admin_create_memfd:
 * @name: a label for /proc/PID/fd and /proc/PID/maps ("memfd:NAME");
 *        not a path, nothing is created in any file system
 * @size: region size in bytes (the server requires a power of two)
 * @geometry: the layout to format; NULL or zero fields take defaults
 * @fd_out: on success, the region fd (O_RDWR, close-on-exec)
 *
 * Create an anonymous region, format it, and seal its size
 * (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): nobody holding the fd,
 * however they got it, can then shrink it (which would make every other
 * mapping fault with SIGBUS), grow it, or remove the seals. The fd is what the server
 * hands to its clients (QEMU maps it as BAR2; host peers map it through
 * ivshm_attach_server()). The memory lives as long as some process holds
 * the fd or a mapping of it, and needs no clean-up.
 *
 * Returns: 0, -EINVAL for a bad size, IVSHM_ESIZE if @size cannot hold
 * @geometry, or -errno.
 */
int ivshm_admin_create_memfd(const char *name, uint64_t size,
                             const ivshm_geometry *geometry, int *fd_out);

/*
 * ivshm_admin_create_file:
 * @path: the region file to create; must not exist (not even as a
 *        dangling symbolic link)
 * @size: region size in bytes
 * @geometry: the layout to format; NULL or zero fields take defaults
 * @mode: permission bits of the new file (the umask still applies at
 *        creation; they are set again with fchmod afterwards)
 * @fd_out: on success, the region fd (O_RDWR, close-on-exec)
 *
 * Host-file mode: create @path exclusively (O_CREAT | O_EXCL, so an
 * existing file or link is never reused or followed), size and format it,
 * and return the open fd, so nothing else can swap the file between
 * creation and use. Such a region cannot be sealed: anyone who can open
 * it for writing can truncate it and make every peer fault. Use it only
 * where every peer is one user (docs/security.md).
 *
 * Returns: 0, -EEXIST if @path exists, -EINVAL, IVSHM_ESIZE, or -errno.
 * On failure nothing is left at @path.
 */
int ivshm_admin_create_file(const char *path, uint64_t size,
                            const ivshm_geometry *geometry, unsigned mode,
                            int *fd_out);

/*
 * ivshm_admin_sealed:
 * @fd: a region fd
 *
 * Returns: 1 if @fd carries the size seals of ivshm_admin_create_memfd
 * (its size can never change), 0 if not (a host file, or unsealed), or
 * -errno if @fd is not valid.
 */
int ivshm_admin_sealed(int fd);

/* The server's view of a region: a mapping without a registry slot. */
typedef struct ivshm_admin ivshm_admin;

/*
 * ivshm_admin_open:
 * @fd: a region fd; duplicated, so the caller keeps its own
 * @out: on success, the new handle
 *
 * Map the region and validate its header like a peer would (the layout
 * is copied out once; later changes to the header are not followed).
 *
 * Returns: 0, or the error of validation (IVSHM_EMAGIC, IVSHM_EVERSION,
 * IVSHM_ESIZE) or -errno.
 */
int ivshm_admin_open(int fd, ivshm_admin **out);

/*
 * ivshm_admin_mark_dead:
 * @a: the server's handle
 * @doorbell_id: the server id (QEMU's IVPosition) of a client that left
 *
 * Mark every ACTIVE registry entry published under @doorbell_id DEAD,
 * as if its owner had died: software inside a guest never sees the
 * server's leave notices, so this is how its peers learn that the VM
 * went away. Call it before the id can be handed out again, so a new
 * client with the same id is never hit. Negative ids mark nothing.
 * O(max_peers) work: one look at each entry, one compare-and-swap per
 * entry marked (what the entry's owner held in the window tables is
 * released lazily, by whoever waits for it), whatever the leaver wrote.
 *
 * Returns: the number of entries marked (0 or more).
 */
int ivshm_admin_mark_dead(ivshm_admin *a, int32_t doorbell_id);

/*
 * ivshm_admin_mark_dead_ids:
 * @a: the server's handle
 * @ids: the server ids of clients that left (negative ones are ignored)
 * @n: how many
 *
 * ivshm_admin_mark_dead for a batch of ids in one pass over the
 * registry: O(max_peers x log n + n log n) work, however many entries
 * carry those ids. Marking an entry is one compare-and-swap; what its
 * owner held in the window tables is broken by whoever waits for it.
 * For a server that handles many departures at once.
 *
 * Returns: the number of entries marked, or -EINVAL / -ENOMEM.
 */
int ivshm_admin_mark_dead_ids(ivshm_admin *a, const int32_t *ids, size_t n);

/*
 * ivshm_admin_drain:
 * @a: the server's handle
 * @doorbell_id: a server id (QEMU's IVPosition: every rank in one guest)
 * @req: the request's number, not 0, a new one for each request
 *
 * Ask every ACTIVE registry entry published under @doorbell_id to let go
 * of the region (docs/migration.md): each owner moves its pairs to
 * another path, acknowledges @req in its entry and leaves. O(max_peers).
 *
 * Returns: how many entries were asked, or -EINVAL.
 */
int ivshm_admin_drain(ivshm_admin *a, int32_t doorbell_id, uint32_t req);

/*
 * ivshm_admin_drain_slot:
 * @a: the server's handle
 * @slot, @gen: the entry's slot and generation (ivshm_admin_peer_id)
 * @req: as for ivshm_admin_drain
 *
 * Returns: 0, -ENOENT if @slot does not hold @gen live, -EINVAL.
 */
int ivshm_admin_drain_slot(ivshm_admin *a, int slot, uint32_t gen,
                           uint32_t req);

/*
 * ivshm_admin_drain_state:
 * @a, @slot, @gen, @req: as asked
 * @status: the owner's status once it acknowledged (0, or a negative
 *   errno: -ETIMEDOUT, a pair did not switch within the owner's deadline;
 *   -EHOSTUNREACH, a peer had no other path: if one of its AV, the
 *   owner refused and stays, its pairs untouched)
 *
 * What the owner wrote, read once: each word is the owner's own claim,
 * like everything in the registry.
 *
 * Returns: 1 acknowledged (*status set), 0 not yet, -ENOENT if the entry
 * left without acknowledging or changed hands, -EINVAL.
 */
int ivshm_admin_drain_state(ivshm_admin *a, int slot, uint32_t gen,
                            uint32_t req, int32_t *status);

/*
 * ivshm_admin_peer_id:
 * @a, @slot: as above
 * @doorbell_id, @gen: filled with the live entry's server id (a guest's
 *   IVPosition, -1 none) and generation, the entry's own claim
 *
 * What ivshm_admin_drain_slot needs to ask one guest's ranks and
 * ivshm_admin_drain_state to wait for each of them.
 *
 * Returns: 0, -ENOENT if the slot holds no live entry, -EINVAL.
 */
int ivshm_admin_peer_id(ivshm_admin *a, int slot, int32_t *doorbell_id,
                        uint32_t *gen);

/*
 * ivshm_admin_close:
 * @a: a handle from ivshm_admin_open, or NULL (ignored)
 *
 * Unmap the region and free the handle. The registry is not touched.
 */
void ivshm_admin_close(ivshm_admin *a);

#ifdef __cplusplus
}
#endif
#endif

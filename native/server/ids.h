/*
 * Doorbell ids for the server's clients (docs/server-protocol.md, "Ids").
 *
 * QEMU's ivshmem-doorbell device frees a peer's eventfd array when it is
 * told that the peer left, and never allocates it again: a later join
 * notice for that id writes into freed memory, a second leave frees it
 * twice. So an id that left while some client was connected must not be
 * announced to that client again. Every client gets a connect number
 * (seq) in connect order; an id that leaves is stamped with the next
 * connect number and becomes reusable only once every client connected
 * before the stamp has gone (and the server's clean-up of its registry
 * entries is done). Ids are handed out never-used ones first, then in
 * the order they became reusable; when none is, there is none to give
 * and the new client is refused.
 *
 * The rule holds as it is for a server that never sends leave notices
 * (--no-leave-notices): a QEMU that was not told of the leave keeps the
 * peer's eventfds, and a join notice for that id again would overflow
 * them ("Too many eventfd received") and leave the new peer unrung. The
 * stamp covers every client connected before the leave, told or not.
 *
 * Every operation is O(1) (amortized for ivs_ids_release).
 */
#ifndef IVS_IDS_H
#define IVS_IDS_H

#include <stdbool.h>
#include <stdint.h>

struct ivs_ids;

/* Ids 0..space-1 (2..65536). NULL when out of memory. */
struct ivs_ids *ivs_ids_new(uint32_t space);
void ivs_ids_free(struct ivs_ids *ids);

/* An id for a new client, or -1 when no id is safe to hand out. */
int32_t ivs_ids_take(struct ivs_ids *ids);

/* `id` left. `stamp` is the connect number the next client will get:
   the id is reusable once no client with a smaller one is connected.
   `owner` (may be NULL) is told through ivs_ids_owner_released when it
   becomes reusable. The id waits for ivs_ids_cleaned too, unless
   `cleaned` says the clean-up is already done (a client that never
   got to announce its id). */
void ivs_ids_retire(struct ivs_ids *ids, int32_t id, uint64_t stamp,
                    void *owner, bool cleaned);

/* The server's clean-up of `id` (registry entries marked) is done. */
void ivs_ids_cleaned(struct ivs_ids *ids, int32_t id);

/* Make reusable what has become safe: every retired id, oldest first,
   that is cleaned and whose stamp is <= `oldest_seq` (the connect
   number of the oldest connected client, or the next one when none is
   connected). Calls `released(owner, arg)` for each. */
void ivs_ids_release(struct ivs_ids *ids, uint64_t oldest_seq,
                     void (*released)(void *owner, void *arg), void *arg);

/* Ids that could be handed out now (never used + reusable). */
uint32_t ivs_ids_available(const struct ivs_ids *ids);

#endif

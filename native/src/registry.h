/*
 * The peer registry (docs/region-layout.md, "Slot life cycle"): our own
 * entry's claim and release, and what we learn from the others' entries:
 * who is there, in which incarnation, and whether it still lives. A peer
 * found dead is marked DEAD and what it held in the window tables is
 * released (window_table.c).
 */
#ifndef IVSHM_REGISTRY_H
#define IVSHM_REGISTRY_H

#include "attachment.h"

/* Claim a FREE or DEAD slot (it becomes CLAIMING, ours: h->self): what a
   dead owner held in the window tables is released, the generation
   bumps (*gen_out), our identity and doorbell line are written, with
   `may_sleep` as what we announce. IVSHM_EFULL if no slot is free. The
   caller empties what it keeps about the slot's peers and its receive
   area (nobody sends to a slot that is not ACTIVE), then publishes. */
IVSHM_INTERNAL int ivshm_registry_claim(ivshm *h, const ivshm_config *cfg,
                                        int32_t doorbell_id, int backend,
                                        bool may_sleep, uint32_t *gen_out);
/* Our claimed slot becomes ACTIVE in generation `gen` (release). */
IVSHM_INTERNAL void ivshm_registry_publish(ivshm *h, uint32_t gen);
/* Leave: release our window holds, FREE our slot. */
IVSHM_INTERNAL void ivshm_registry_leave(ivshm *h);
/* Live peer in `slot` with generation `gen` (0: any)? Checks pids when we
   share a pid namespace and marks a dead one. */
IVSHM_INTERNAL bool ivshm_peer_alive(ivshm *h, int slot, uint32_t gen);
/* Mark every ACTIVE slot whose doorbell id is `doorbell_id` dead (the
   server's leave notice). Returns how many. O(max_peers): a mark is one
   CAS (what the peer held is released lazily, window_table.h). */
IVSHM_INTERNAL int ivshm_mark_doorbell_dead(ivshm *h, int32_t doorbell_id);
/* The same for the n ids of `ids` (sorted in place) in one pass over the
   registry: O(max_peers x log n + n log n). */
IVSHM_INTERNAL int ivshm_mark_doorbells_dead(ivshm *h, int32_t *ids, size_t n);
/* Drain requests in the registry (docs/migration.md): the host's side.
   Ask `slot`'s holder at `gen` (0 or -EINVAL/-ENOENT), or every ACTIVE
   entry of a server id (how many); read its answer back: 1 with
   *status once it acknowledged `req`, 0 while it has not, -ENOENT once
   the entry left unacknowledged or changed hands. */
IVSHM_INTERNAL int ivshm_drain_request(ivshm *h, int slot, uint32_t gen,
                                       uint32_t req);
IVSHM_INTERNAL int ivshm_drain_request_id(ivshm *h, int32_t doorbell_id,
                                          uint32_t req);
IVSHM_INTERNAL int ivshm_drain_state(ivshm *h, int slot, uint32_t gen,
                                     uint32_t req, int32_t *status);

#endif

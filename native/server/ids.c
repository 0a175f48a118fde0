/*
 * Doorbell ids (ids.h): never-used ids first, then a FIFO of retired
 * ids. The FIFO is one ring: [head, rel) are reusable, [rel, tail) wait
 * for their clean-up and for the clients that saw them leave. Stamps
 * grow with the order of leaving and clean-ups finish in that order, so
 * only the oldest waiting id ever needs to be looked at.
 */
#include "ids.h"

#include <stdlib.h>

struct retired {
    int32_t id;
    bool cleaned;
    uint64_t stamp;
    void *owner;
};

struct ivs_ids {
    uint32_t space;
    uint32_t next_fresh;     /* ids >= this were never handed out */
    uint64_t head, rel, tail; /* positions in ring, modulo space */
    struct retired *ring;    /* each id is in it at most once */
    uint32_t *slot_of;       /* id -> ring index while it waits */
};

struct ivs_ids *ivs_ids_new(uint32_t space)
{
    if (space < 2 || space > 65536)
        return NULL;
    struct ivs_ids *ids = calloc(1, sizeof *ids);
    if (!ids)
        return NULL;
    ids->space = space;
    ids->ring = calloc(space, sizeof *ids->ring);
    ids->slot_of = calloc(space, sizeof *ids->slot_of);
    if (!ids->ring || !ids->slot_of) {
        ivs_ids_free(ids);
        return NULL;
    }
    return ids;
}

void ivs_ids_free(struct ivs_ids *ids)
{
    if (!ids)
        return;
    free(ids->ring);
    free(ids->slot_of);
    free(ids);
}

int32_t ivs_ids_take(struct ivs_ids *ids)
{
    if (ids->next_fresh < ids->space)
        return (int32_t)ids->next_fresh++;
    if (ids->head == ids->rel)
        return -1;
    return ids->ring[ids->head++ % ids->space].id;
}

void ivs_ids_retire(struct ivs_ids *ids, int32_t id, uint64_t stamp,
                    void *owner, bool cleaned)
{
    /* Cannot overflow: an id is taken before it is retired, and the
       ring holds each id at most once. */
    uint32_t slot = (uint32_t)(ids->tail++ % ids->space);
    ids->ring[slot] = (struct retired){id, cleaned, stamp, owner};
    ids->slot_of[id] = slot;
}

void ivs_ids_cleaned(struct ivs_ids *ids, int32_t id)
{
    if (id >= 0 && (uint32_t)id < ids->space)
        ids->ring[ids->slot_of[id]].cleaned = true;
}

void ivs_ids_release(struct ivs_ids *ids, uint64_t oldest_seq,
                     void (*released)(void *owner, void *arg), void *arg)
{
    while (ids->rel < ids->tail) {
        struct retired *r = &ids->ring[ids->rel % ids->space];
        if (!r->cleaned || r->stamp > oldest_seq)
            return;
        if (released && r->owner)
            released(r->owner, arg);
        ids->rel++;
    }
}

uint32_t ivs_ids_available(const struct ivs_ids *ids)
{
    return ids->space - ids->next_fresh + (uint32_t)(ids->rel - ids->head);
}

/*
 * What we keep about each peer: its incarnation, its backlog, a message
 * of it in progress. Local memory only, except that forgetting a sender
 * frees the fast channel of our area it used (channel.c).
 */
#define _GNU_SOURCE
#include "peer_local.h"

#include "channel.h"

#include <errno.h>
#include <string.h>

/* Bound on what the backlogs hold (payload + record headers). */
#define BACKLOG_MAX_BYTES (64ull << 20)

/* ---- incarnations ---- */

/* A sender that left or died keeps its generation in the registry until
   the slot is claimed again: so what it published is still that
   generation's and may be delivered. We never write the tail of a
   departed sender's ring. */
enum rx_view ivshm_rx_view_slow(ivshm *h, int slot)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    uint32_t st = atomic_load_explicit(&e->state, memory_order_acquire);
    if (st != PEER_FREE && st != PEER_DEAD)
        return RX_NONE;
    uint32_t gen = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (gen == 0)
        return RX_NONE;
    /* an incarnation we never talked to: its positions began at 0 */
    if (h->peers[slot].gen != gen)
        ivshm_peer_local_reset(h, slot, gen);
    return RX_GONE;
}

static void bl_clear(ivshm *h, int slot)
{
    while (h->peers[slot].bl_head)
        ivshm_bl_pop(h, slot);
}

void ivshm_peer_local_free(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    bl_clear(h, slot);
    ivshm_peek_end(p);
    free(p->rx_stage);
    free(p->tx_stage);
    p->rx_stage = p->tx_stage = NULL;
}

/* What the caller may still hold survives the reset: the stage of a
   reservation (or of ivshm_send_small's general path, which stages and
   then sends) and a peeked backlog record. Everything else goes. */
void ivshm_peer_local_reset(ivshm *h, int slot, uint32_t gen)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->rx_chan >= 0 && h->self >= 0)
        ivshm_chan_free(h, slot);
    if (h->q_peek_src == slot)
        h->q_peek_src = -1;
    bl_clear(h, slot); /* a peeked record is only unlinked */
    free(p->rx_stage);
    uint8_t *tx_stage = p->tx_stage;
    struct ivshm_backlog *peek_rec = p->peek_rec;
    bool peek_orphan = p->peek_orphan;
    memset(p, 0, sizeof *p);
    p->gen = gen;
    p->tx_chan = p->rx_chan = -1;
    p->tx_stage = tx_stage;
    p->peek_rec = peek_rec;
    p->peek_orphan = peek_orphan;
}

void ivshm_peek_begin(struct ivshm_peer_local *p, struct ivshm_backlog *rec)
{
    if (p->peek_rec == rec)
        return; /* the same message again */
    ivshm_peek_end(p);
    p->peek_rec = rec;
}

/* ---- backlogs ---- */

void ivshm_bl_pop(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    struct ivshm_backlog *b = p->bl_head;
    if (!b)
        return;
    p->bl_head = b->next;
    if (!p->bl_head)
        p->bl_tail = NULL;
    h->bl_bytes -= sizeof *b + b->len;
    if (b == p->peek_rec)
        p->peek_orphan = true; /* handed out: ivshm_peek_end frees it */
    else
        free(b);
    if (--p->bl_count == 0)
        for (int x = 0; x < h->n_bl; x++)
            if (h->bl_list[x] == slot) {
                h->bl_list[x] = h->bl_list[--h->n_bl];
                break;
            }
}

int ivshm_bl_push(ivshm *h, int src, const struct frag *cell,
                  const uint8_t *data)
{
    struct frag f = *cell;
    if (f.len > slot_payload(h)) {
        f.len = 0;        /* kept as a marker: reported as corrupt */
        f.flags = 0xffff;
    }
    if (h->bl_bytes + sizeof(struct ivshm_backlog) + f.len > BACKLOG_MAX_BYTES)
        return -ENOBUFS;
    struct ivshm_backlog *b = malloc(sizeof *b + f.len);
    if (!b)
        return -ENOMEM;
    b->next = NULL;
    b->len = f.len;
    b->tag = f.tag;
    b->gen = f.gen;
    b->flags = f.flags;
    b->total = f.total;
    if (f.len)
        memcpy(b->data, data, f.len);
    struct ivshm_peer_local *p = &h->peers[src];
    if (p->bl_tail)
        p->bl_tail->next = b;
    else
        p->bl_head = b;
    p->bl_tail = b;
    if (p->bl_count++ == 0)
        h->bl_list[h->n_bl++] = src;
    h->bl_bytes += sizeof *b + f.len;
    return 0;
}

/* ---- a message in progress ---- */

/* Grows by doubling, so the memory follows the bytes actually received,
   not a forged total, and never exceeds rx_keep (at most the caller's
   cap). */
bool ivshm_stage_room(struct ivshm_peer_local *p, uint64_t n)
{
    if (n <= p->rx_stage_cap)
        return true;
    if (p->rx_nomem || n > p->rx_keep) /* (never more than it may keep) */
        return false;
    uint64_t cap = p->rx_stage_cap ? p->rx_stage_cap : 4096;
    while (cap < n)
        cap *= 2;
    if (cap > p->rx_keep)
        cap = p->rx_keep;
    uint8_t *st = realloc(p->rx_stage, cap);
    if (!st) {
        p->rx_nomem = true;
        return false;
    }
    p->rx_stage = st;
    p->rx_stage_cap = cap;
    return true;
}

void ivshm_stage_append(struct ivshm_peer_local *p, const uint8_t *data,
                        uint32_t len)
{
    if (p->rx_kept >= p->rx_keep || len == 0)
        return;
    uint64_t n = p->rx_keep - p->rx_kept < len ? p->rx_keep - p->rx_kept : len;
    if (!ivshm_stage_room(p, p->rx_kept + n))
        return;
    memcpy(p->rx_stage + p->rx_kept, data, n);
    p->rx_kept += n;
}

/*
 * Introductions: hearing a region peer the application has not inserted
 * (docs/provider.md, "Locality and admission"; docs/security.md, "The
 * libfabric provider").
 *
 * An MPI may insert a peer only when it first sends to it (Open MPI 5
 * does, for peers on other hosts and for one-sided targets), so a rank
 * that only receives from a peer, or only serves its RMA, must hear it
 * without an AV entry. Being heard still needs the job's out-of-band
 * exchange: every name carries a random key that travels only in names
 * (never in the region), and a sender's first region message to a peer
 * is an INTRO, its own slot, generation and registry nonce with a MAC of
 * them under the receiver's key. Only a holder of the receiver's name can
 * write one; it names the slot libivshm saw it come from, at that slot's
 * generation, so a co-tenant who copies one gains nothing.
 *
 * A verified INTRO makes its slot a hidden peer (id FIV_HIDDEN + slot):
 * its messages are matched and its RMA served like anybody's, with
 * FI_ADDR_NOTAVAIL as their source. When the application then inserts
 * that peer's name, the AV entry adopts the hidden peer with what it had
 * under way (unexpected messages, a message in progress, queued answers).
 *
 * The sender's side is here (below the send queues that call it); the
 * receiver's check, where admission is decided, is fiv_progress.c's
 * fiv_intro_receive. The MAC is fiv_mac.c's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "fiv.h"

void fiv_new_key(uint8_t key[FIV_KEY_LEN])
{
    if (getrandom(key, FIV_KEY_LEN, 0) == FIV_KEY_LEN)
        return;
    /* no entropy source: still unique, if guessable */
    uint64_t a = fiv_now_ns(), b = (uint64_t)getpid() << 32 ^ (uintptr_t)key;
    memcpy(key, &a, 8);
    memcpy(key + 8, &b, 8);
}

/* What the MAC covers: the sender's slot, generation and nonce. */
uint64_t fiv_intro_mac(const uint8_t key[FIV_KEY_LEN],
                       const struct fiv_intro *in)
{
    uint8_t m[16];
    uint16_t slot = (uint16_t)in->slot;
    memcpy(m, &slot, 2);
    memset(m + 2, 0, 2);
    memcpy(m + 4, &in->generation, 4);
    memcpy(m + 8, in->nonce, 8);
    return fiv_mac(key, m, sizeof m);
}

/* ---- the sender ---- */

/* Before the first region message to `p`: 0 (sent, or none needed),
   -EAGAIN, or a libivshm error. */
int fiv_introduce(struct fiv_ep *ep, struct fiv_peer *p)
{
    if (p->introduced || p->path != PATH_REGION)
        return 0;
    struct fiv_intro in = {.slot = (int16_t)ep->self_slot,
                           .generation = ep->self_gen,
                           .nonce = {(uint32_t)ep->nonce,
                                     (uint32_t)(ep->nonce >> 32)}};
    in.mac = fiv_intro_mac(p->key, &in);
    int rc = fiv_region_send(ep, p->slot, p->generation, FIV_OP_INTRO, &in,
                             sizeof in, NULL, 0);
    if (rc < 0)
        return rc;
    p->introduced = true;
    return 0;
}

/* References to peer `from` become references to `to`. */
static void rename_peer(struct fiv_ep *ep, struct fiv_peer *p, fi_addr_t from,
                        fi_addr_t to)
{
    struct fiv_unexp *lists[] = {ep->tunexp, ep->unexp};
    for (int l = 0; l < 2; l++)
        for (struct fiv_unexp *u = lists[l]; u; u = u->next)
            if (u->src == from)
                u->src = to;
    for (struct fiv_op_req *r = ep->waiting; r; r = r->next)
        if (r->peer == from)
            r->peer = to;
    for (struct fiv_op_req *r = p->txq; r; r = r->next)
        if (r->peer == from)
            r->peer = to;
    if (p->as.req && p->as.req->peer == from)
        p->as.req->peer = to;
}

bool fiv_intro_adopt(struct fiv_ep *ep, size_t index, const struct fiv_addr *a)
{
    if (!ep->hidden || a->slot < 0 || a->slot >= ep->max_peers)
        return false;
    fi_addr_t h = FIV_HIDDEN + (fi_addr_t)a->slot;
    struct fiv_peer *hp = &ep->hidden[a->slot];
    uint64_t nonce = (uint64_t)a->nonce[1] << 32 | a->nonce[0];
    if (ep->by_slot[a->slot] != h || hp->path != PATH_REGION ||
        hp->generation != a->generation || hp->nonce != nonce)
        return false;
    struct fiv_peer *p = &ep->peers[index];
    *p = *hp;
    memcpy(p->key, a->key, FIV_KEY_LEN);
    memset(hp, 0, sizeof *hp);
    rename_peer(ep, p, h, index);
    ep->by_slot[a->slot] = index;
    return true;
}

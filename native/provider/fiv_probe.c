/*
 * Broken paths: a message a co-tenant destroyed must end what waits for
 * it with an error, as a failed network would, not leave two ranks each
 * waiting for the other (docs/provider.md, "Failures"; docs/security.md,
 * "The libfabric provider").
 *
 * Most damage shows itself: libivshm reports a slot it could not
 * validate (IVSHM_ECORRUPT, with the writer), the tag's wire check fails,
 * a message breaks our protocol (a continuation of nothing, a malformed
 * header, an unknown operation: fiv_peer.violated), or the holder of a
 * peer's slot changes. A message that vanished leaves no trace, and a
 * receiver cannot tell it from one not sent yet; its sender can. So each
 * endpoint counts, per region slot, the messages it sent to the holder
 * and received from it, and a receiver that waits on a peer that has
 * been silent for FIV_PROBE_NS asks it: a PROBE carries what we sent and
 * received, its answer what the peer sent and received. Each pair keeps
 * its order, so when a probe is read everything its writer sent before
 * it has arrived or is lost: the counts must agree exactly, and a
 * difference is a lost (or an added) message. The answer also says
 * whether the peer still has messages for us queued; if not, a message
 * of which we hold only the first part will never be completed. A peer
 * busy outside libfabric answers later, which costs nothing but time.
 *
 * A broken path fails what waits on that peer (its message in progress,
 * queued sends, RMA awaiting answers, receives directed at it) and every
 * receive of any source, which is how an MPI learns of it (an error
 * completion ends the job under its default error handler), and nothing
 * more goes either way; the peer is told with a probe marked broken. A peer that leaves fails only what waits on it
 * by name: receives of any source stay, since leaving is what every rank
 * does at MPI_Finalize.
 */
#include <errno.h>
#include <string.h>

#include "fiv.h"

void fiv_pair_received(struct fiv_ep *ep, int slot, int64_t gen, uint32_t op)
{
    struct fiv_pair *pr = &ep->pairs[slot];
    if (gen >= 0 && pr->rx_gen != (uint32_t)gen) {
        pr->rx_gen = (uint32_t)gen;
        pr->rx = pr->rx_seen = 0;
    }
    if (fiv_pair_counts(op))
        pr->rx++;
}

/* Our counts with the holder of `slot` at `gen`. */
static uint64_t sent_to(const struct fiv_ep *ep, int slot, uint32_t gen)
{
    const struct fiv_pair *pr = &ep->pairs[slot];
    return pr->tx_gen == gen ? pr->tx : 0;
}

static uint64_t received_from(const struct fiv_ep *ep, int slot, uint32_t gen)
{
    const struct fiv_pair *pr = &ep->pairs[slot];
    return pr->rx_gen == gen ? pr->rx : 0;
}

static void send_counts(struct fiv_ep *ep, int slot, uint32_t gen,
                        uint32_t op, uint64_t echo, uint64_t flags)
{
    struct fiv_probe m = {.tx = sent_to(ep, slot, gen),
                          .rx = received_from(ep, slot, gen),
                          .echo = echo, .flags = flags};
    /* never waits: a probe that finds no room is asked again later */
    (void)fiv_region_send(ep, slot, gen, op, &m, sizeof m, NULL, 0);
}

void fiv_path_broken(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     const char *why)
{
    if (peer->dead)
        return;
    FIV_WARN("path to peer %d (slot %d) broken: %s\n",
             a >= FIV_HIDDEN ? -1 : (int)a, peer->slot, why);
    fiv_peer_failed(ep, a, peer, FI_EIO);
    fiv_fail_receives(ep, a, true, FI_EIO);
    /* the peer learns it now, not at its next probe: what it waits on
       from us fails too (if the slot is still that peer's) */
    if (peer->path == PATH_REGION &&
        ivshm_peer_generation(ep->h, peer->slot) == (int64_t)peer->generation)
        send_counts(ep, peer->slot, peer->generation, FIV_OP_PROBE, 0,
                    FIV_PROBE_BROKEN);
}

void fiv_send_failed(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     int err)
{
    /* A send that finds its peer gone fails alone. What the peer wrote
       before it left may still wait on our queue unread, and failing
       the peer now would drop it; the looks for departed peers
       (fiv_probe_tick) fail it once those messages are taken. */
    if (err == FI_EHOSTUNREACH)
        return;
    fiv_path_broken(ep, a, peer, "a send found it corrupt");
}

void fiv_probe_receive(struct fiv_ep *ep, int slot, int64_t gen,
                       fi_addr_t a, struct fiv_peer *heard, uint32_t op,
                       const uint8_t *p, size_t n)
{
    struct fiv_probe m;
    if (n != sizeof m || gen < 0) {
        if (heard)
            heard->violated = true;
        return;
    }
    memcpy(&m, p, sizeof m); /* once: the region is shared */
    uint64_t got = received_from(ep, slot, (uint32_t)gen);
    if ((op & FIV_OP_MASK) == FIV_OP_PROBE) {
        /* answered whoever asks: two counts the asker knows anyway */
        send_counts(ep, slot, (uint32_t)gen, FIV_OP_PROBE_ACK, m.tx,
                    heard && heard->txq ? FIV_PROBE_BUSY : 0);
        if (heard && !heard->dead && (m.flags & FIV_PROBE_BROKEN))
            fiv_path_broken(ep, a, heard, "it found our path broken");
        else if (heard && !heard->dead && m.tx != got)
            fiv_path_broken(ep, a, heard, "a probe counts messages we never "
                            "received");
        return;
    }
    if (!heard || heard->dead)
        return;
    ep->pairs[slot].probe_gap_ns = 0; /* answered: ask again after FIV_PROBE_NS */
    if (m.tx != got)
        fiv_path_broken(ep, a, heard, "its messages to us were lost");
    else if (m.rx != m.echo)
        fiv_path_broken(ep, a, heard, "our messages to it were lost");
    else if (heard->as.kind != ASM_NONE && !(m.flags & FIV_PROBE_BUSY))
        fiv_path_broken(ep, a, heard, "the rest of its message never comes");
}

/* Is nothing of departed `slot` left for us? A peek directed at it
   reaches all of its messages (its backlog, its ring, its cells in our
   queue past other senders'), and libivshm answers IVSHM_EPEERDEAD only
   once none is left anywhere, a cell behind a held queue head included
   (ivshm_q_holds). What it finds stays where it lies, for the poll to
   take in its turn. */
static bool left_nothing(struct fiv_ep *ep, int slot)
{
    int src = -1;
    uint32_t tag = 0;
    const void *data = NULL;
    return ivshm_recv_peek(ep->h, slot, &src, &tag, &data) == IVSHM_EPEERDEAD;
}

/* Does something we hold wait on peer `id`? */
static bool waits_on(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p,
                     bool wildcard)
{
    if (p->awaited || p->as.kind != ASM_NONE || p->txq)
        return true;
    for (struct fiv_op_req *r = ep->waiting; r; r = r->next)
        if (r->peer == id)
            return true;
    /* a receive of any source: the peers we talk with */
    return wildcard && (sent_to(ep, p->slot, p->generation) ||
                        received_from(ep, p->slot, p->generation));
}

void fiv_probe_tick(struct fiv_ep *ep, uint64_t now)
{
    bool wildcard = fiv_mark_awaited(ep);
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        /* a pair switching to the core has the drain's deadline */
        bool waits = p->path == PATH_REGION && !p->dead && !p->sw_want &&
                     waits_on(ep, id, p, wildcard);
        p->awaited = false;
        if (!waits)
            continue;
        /* gone (its slot free) or replaced (another generation) */
        int64_t g = ivshm_peer_generation(ep->h, p->slot);
        if (g < 0 || (p->leaving && g != (int64_t)p->generation)) {
            /* What it sent before it left is still ours to take, but it
               may have sent and left after this call's poll (we look
               here only once a poll found nothing, and give the CPU away
               in between). So the first look that finds it gone only
               notes it; it fails at a later look, which follows a poll
               begun after this one that found nothing: by then every
               message it wrote before freeing its slot has been taken.
               While a remote write waits for room in the CQ
               (ep->writes_wait) a poll finds nothing while what lies
               behind the held write (its writer's later messages, the
               shared queue's cells behind a held cell) is unread: a look
               at the departed sender's own messages decides then, and a
               peer with some behind the held write waits until the
               application's next CQ read lets them through
               (docs/provider.md, "Caps per peer"). */
            if (!p->leaving) {
                p->leaving = true;
                ep->last_check_ns = 0; /* look again at the next idle call */
                continue;
            }
            if (ep->writes_wait && (g >= 0 || !left_nothing(ep, p->slot)))
                continue;
            fiv_peer_failed(ep, id, p, FI_EIO);
            continue;
        }
        if (g != (int64_t)p->generation) {
            fiv_path_broken(ep, id, p, "its slot changed hands");
            continue;
        }
        struct fiv_pair *pr = &ep->pairs[p->slot];
        if (pr->rx != pr->rx_seen || !pr->heard_ns) {
            pr->rx_seen = pr->rx;
            pr->heard_ns = now;
        }
        /* a peer that does not answer (busy outside libfabric) is asked
           at doubling intervals: its queue does not fill with probes */
        uint64_t gap = pr->probe_gap_ns ? pr->probe_gap_ns : FIV_PROBE_NS;
        if (now - pr->heard_ns < FIV_PROBE_NS || now - pr->probed_ns < gap)
            continue;
        pr->probed_ns = now;
        pr->probe_gap_ns = gap * 2 > FIV_PROBE_MAX_NS ? FIV_PROBE_MAX_NS
                                                      : gap * 2;
        send_counts(ep, p->slot, p->generation, FIV_OP_PROBE, 0, false);
    }
}

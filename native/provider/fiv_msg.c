/*
 * FI_MSG and FI_TAGGED: posting, matching and delivery.
 *
 * Receives are matched in the order they were posted, messages in the
 * order they arrived from each sender (both paths keep a pair's order):
 * what MPI's matching needs. A message that finds no receive is copied
 * out of the region into an unexpected entry; a receive looks there
 * first. A message longer than the receive is delivered truncated and
 * reported as an FI_ETRUNC error entry. FI_PEEK / FI_CLAIM / FI_DISCARD
 * look at and take unexpected messages (MPI probes).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fiv_complete.h"

/* ---- posted receives: kept on a short free list (one malloc and one
   free less per message on the hot path). The list holds at most
   RX_CACHE entries; what is given back beyond that goes to free(), so a
   window of thousands of receives costs no more memory afterwards. ---- */

#define RX_CACHE 64

static struct fiv_rx *rx_get(struct fiv_ep *ep)
{
    struct fiv_rx *rx = ep->rx_cache;
    if (rx) {
        ep->rx_cache = rx->next;
        ep->rx_cached--;
        /* what post does not set; clearing the iovec array too cost a
           measurable share of a small receive */
        rx->next = NULL;
        rx->multi_used = 0;
        rx->pending = 0;
        rx->retired = false;
        return rx;
    }
    return calloc(1, sizeof *rx);
}

/* rx at the end of a posted list (recv or trecv), in posting order */
static inline void rx_append(struct fiv_rx **head, struct fiv_rx **tail,
                             struct fiv_rx *rx)
{
    rx->next = NULL;
    if (*tail)
        (*tail)->next = rx;
    else
        *head = rx;
    *tail = rx;
}

void fiv_rx_put(struct fiv_ep *ep, struct fiv_rx *rx)
{
    if (!rx)
        return;
    if (ep->rx_cached >= RX_CACHE) {
        free(rx);
        return;
    }
    rx->next = ep->rx_cache;
    ep->rx_cache = rx;
    ep->rx_cached++;
}

/* ---- completions of receives ---- */

static bool want_rx(struct fiv_ep *ep, uint64_t flags)
{
    return !(ep->rx_cq_flags & FI_SELECTIVE_COMPLETION) ||
           (flags & FI_COMPLETION);
}

/* Complete `rx` for a message of `total` bytes of which `stored` landed
   at `at` in its buffers. Inline: it ends every delivery, and as a call
   its ten arguments and saved registers cost more than its success path. */
static inline __attribute__((always_inline)) void finish_rx(struct fiv_ep *ep, struct fiv_rx *rx, fi_addr_t src,
                      uint64_t tag, uint64_t data, uint32_t mflags,
                      size_t total, size_t stored, void *at, bool last)
{
    /* the flags of each combination of the two wire bits, looked up
       rather than built from them bit by bit */
    static const uint64_t by_bits[4] = {
        FI_RECV | FI_MSG, FI_RECV | FI_TAGGED,
        FI_RECV | FI_MSG | FI_REMOTE_CQ_DATA,
        FI_RECV | FI_TAGGED | FI_REMOTE_CQ_DATA};
    _Static_assert(FIV_F_TAGGED == 0x100u && FIV_F_DATA == 0x200u,
                   "by_bits is indexed by the two bits above the op");
    uint64_t flags = by_bits[(mflags >> 8) & 3] |
                     (last && rx->flags & FI_MULTI_RECV ? FI_MULTI_RECV : 0);
    /* a peer heard only through its introduction has no address the
       application knows (fiv_complete.c's store) */
    fi_addr_t from = ep->caps & FI_SOURCE && src < FIV_HIDDEN
                         ? src : FI_ADDR_NOTAVAIL;
    if (total <= stored) {
        /* whole: straight into the CQ (fiv_complete_rx's success path),
           field by field: an entry built aside and assigned whole was
           built, then copied. Every field cq_readfrom reads is written:
           a new one must be written here too (fiv.h, struct fiv_cqe);
           err and olen are an error entry's, never read in the ring. */
        fiv_cntr_inc(ep->cntr_recv);
        struct fiv_cqe *to;
        if (want_rx(ep, rx->flags) && ep->rx_cq &&
            (to = fiv_cq_claim(ep->rx_cq))) {
            to->context = rx->context;
            to->flags = flags;
            to->len = stored;
            to->buf = at;
            to->data = mflags & FIV_F_DATA ? data : 0;
            to->tag = mflags & FIV_F_TAGGED ? tag : 0;
            to->src = from;
            to->core = false;
        }
        return;
    }
    struct fiv_cqe e = {
        .context = rx->context, .flags = flags, .len = stored, .buf = at,
        .data = mflags & FIV_F_DATA ? data : 0,
        .tag = mflags & FIV_F_TAGGED ? tag : 0, .src = from,
        .err = FI_ETRUNC, .olen = total - stored,
    };
    fiv_complete_rx(ep, &e, true);
}

/* ---- matching ---- */

static bool rx_matches(const struct fiv_rx *rx, fi_addr_t src, uint64_t tag,
                       bool tagged)
{
    if (rx->src != FI_ADDR_UNSPEC && rx->src != src)
        return false;
    return !tagged || ((rx->tag ^ tag) & ~rx->ignore) == 0;
}

static struct fiv_rx *take_rx(struct fiv_ep *ep, fi_addr_t src, uint64_t tag,
                              bool tagged)
{
    struct fiv_rx **head = tagged ? &ep->trecv : &ep->recv;
    struct fiv_rx **tail = tagged ? &ep->trecv_tail : &ep->recv_tail;
    struct fiv_rx *prev = NULL;
    for (struct fiv_rx *r = *head; r; prev = r, r = r->next) {
        if (!rx_matches(r, src, tag, tagged))
            continue;
        if (r->flags & FI_MULTI_RECV)
            return r; /* stays posted until it fills */
        if (prev)
            prev->next = r->next;
        else
            *head = r->next;
        if (*tail == r)
            *tail = prev;
        r->next = NULL;
        return r;
    }
    return NULL;
}

static void unlink_rx(struct fiv_ep *ep, struct fiv_rx *rx)
{
    struct fiv_rx **head = &ep->recv, **tail = &ep->recv_tail;
    struct fiv_rx *prev = NULL;
    for (struct fiv_rx *r = *head; r; prev = r, r = r->next)
        if (r == rx) {
            if (prev)
                prev->next = r->next;
            else
                *head = r->next;
            if (*tail == r)
                *tail = prev;
            return;
        }
}

/* A multi-receive buffer hands out the next `len` bytes (or what is
   left): where the message goes. */
static struct iovec multi_slice(struct fiv_ep *ep, struct fiv_rx *rx,
                                size_t len, bool *last)
{
    size_t left = rx->total - rx->multi_used;
    size_t take = len < left ? len : left;
    struct iovec v = {(uint8_t *)rx->iov[0].iov_base + rx->multi_used, take};
    rx->multi_used += take;
    *last = rx->total - rx->multi_used < ep->min_multi_recv;
    if (*last) {
        rx->retired = true;
        unlink_rx(ep, rx);
    }
    return v;
}

/* ---- arrival ---- */

static void append_unexp(struct fiv_ep *ep, struct fiv_unexp *u, bool tagged)
{
    struct fiv_unexp **head = tagged ? &ep->tunexp : &ep->unexp;
    struct fiv_unexp **tail = tagged ? &ep->tunexp_tail : &ep->unexp_tail;
    u->next = NULL;
    if (*tail)
        (*tail)->next = u;
    else
        *head = u;
    *tail = u;
}

static void remove_unexp(struct fiv_ep *ep, struct fiv_unexp *u, bool tagged)
{
    struct fiv_unexp **head = tagged ? &ep->tunexp : &ep->unexp;
    struct fiv_unexp **tail = tagged ? &ep->tunexp_tail : &ep->unexp_tail;
    struct fiv_unexp *prev = NULL;
    for (struct fiv_unexp *x = *head; x; prev = x, x = x->next)
        if (x == u) {
            if (prev)
                prev->next = x->next;
            else
                *head = x->next;
            if (*tail == x)
                *tail = prev;
            return;
        }
}

/* An unexpected message's memory goes, and its sender's count with it
   (the peer may be gone from the AV by now: its entry stays). */
static void unexp_free(struct fiv_ep *ep, struct fiv_unexp *u)
{
    struct fiv_peer *p = fiv_peer(ep, u->src);
    if (p)
        p->unexp_bytes -= u->charged < p->unexp_bytes ? u->charged
                                                      : p->unexp_bytes;
    free(u->buf);
    free(u);
}

/* The peer whose assembly is of `kind` and points at `rec`, if any. */
static struct fiv_peer *asm_holder(struct fiv_ep *ep, enum fiv_asm_kind kind,
                                   const void *rec)
{
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));)
        if (p->as.kind == kind &&
            (kind == ASM_RECV ? (const void *)p->as.rx
                              : (const void *)p->as.ux) == rec)
            return p;
    return NULL;
}

/* The rest of the message `p` is sending goes nowhere. */
static void asm_discard(struct fiv_peer *p)
{
    p->as = (struct fiv_asm){.kind = ASM_DISCARD, .total = p->as.total,
                             .got = p->as.got};
}

/* The application takes an unexpected message away (FI_DISCARD): one
   still arriving is cut off its sender's assembly first. */
static void unexp_drop(struct fiv_ep *ep, struct fiv_unexp *u, bool tagged)
{
    remove_unexp(ep, u, tagged);
    if (u->got < u->len) {
        struct fiv_peer *p = asm_holder(ep, ASM_UNEXP, u);
        if (p)
            asm_discard(p);
    }
    unexp_free(ep, u);
}

void fiv_rx_cut(struct fiv_ep *ep, struct fiv_rx *rx)
{
    struct fiv_peer *p;
    while (rx->pending > 0 && (p = asm_holder(ep, ASM_RECV, rx))) {
        asm_discard(p);
        rx->pending--;
    }
    rx->pending = 0;
}

/* Copy a complete unexpected message into `rx` and complete it. */
static void unexp_to_rx(struct fiv_ep *ep, struct fiv_unexp *u, struct fiv_rx *rx)
{
    size_t stored;
    void *at;
    bool last = false;
    if (rx->flags & FI_MULTI_RECV) {
        struct iovec v = multi_slice(ep, rx, u->len, &last);
        memcpy(v.iov_base, u->buf, v.iov_len);
        stored = v.iov_len;
        at = v.iov_base;
    } else {
        stored = fiv_iov_write(rx->iov, rx->iov_count, 0, u->buf, u->len);
        at = rx->iov_count ? rx->iov[0].iov_base : NULL;
    }
    finish_rx(ep, rx, u->src, u->tag, u->data, u->flags, u->len, stored, at, last);
    if (!(rx->flags & FI_MULTI_RECV) || last)
        fiv_rx_put(ep, rx);
}

/* A message's first part, its header `*hdr` read already (once) and
   `chunk` bytes of payload at `p`: every case of it (a posted receive,
   a multi-receive's slice, an unexpected one, the first of several
   parts). Out of line: fiv_msg_expected's general cases, and the rest
   of msg_first. */
static __attribute__((noinline)) void msg_hdr(struct fiv_ep *ep, fi_addr_t src,
                                              struct fiv_peer *peer, uint32_t op,
                                              const struct fiv_msg_hdr *hdr,
                                              const uint8_t *p, size_t chunk)
{
    struct fiv_msg_hdr h = *hdr;
    if (h.len > ep->max_msg || chunk > h.len) {
        peer->violated = true; /* malformed: not what a peer of ours sends */
        return;
    }
    bool tagged = op & FIV_F_TAGGED;
    uint32_t mflags = op & (FIV_F_TAGGED | FIV_F_DATA);
    struct fiv_asm *as = &peer->as;
    struct fiv_rx *rx = take_rx(ep, src, h.tag, tagged);
    if (rx) {
        bool last = false;
        struct iovec v;
        if (rx->flags & FI_MULTI_RECV) {
            v = multi_slice(ep, rx, h.len, &last);
            memcpy(v.iov_base, p, chunk < v.iov_len ? chunk : v.iov_len);
        } else {
            v.iov_base = rx->iov_count ? rx->iov[0].iov_base : NULL;
            v.iov_len = rx->total;
            if (rx->iov_count == 1) /* fiv_iov_write's one element */
                fiv_copy_small(v.iov_base, p, chunk < v.iov_len ? chunk
                                                                : v.iov_len);
            else
                fiv_iov_write(rx->iov, rx->iov_count, 0, p, chunk);
        }
        if (chunk == h.len) {
            size_t stored = h.len < v.iov_len ? h.len : v.iov_len;
            /* a retired multi-receive buffer is released by the last of
               its messages to complete */
            last = last && rx->pending == 0;
            finish_rx(ep, rx, src, h.tag, h.data, mflags, h.len, stored,
                      v.iov_base, last);
            if (!(rx->flags & FI_MULTI_RECV) || last)
                fiv_rx_put(ep, rx);
            return;
        }
        if (rx->flags & FI_MULTI_RECV)
            rx->pending++;
        *as = (struct fiv_asm){.kind = ASM_RECV, .total = h.len, .got = chunk,
                               .rx = rx, .tag = h.tag, .data = h.data,
                               .flags = mflags, .dst = v.iov_base,
                               .olen = v.iov_len};
        as->rx_off = 0;
        if (rx->flags & FI_MULTI_RECV) {
            /* the slice is the destination, whatever else fills the buffer */
            as->rx_off = (size_t)-1;
        }
        return;
    }
    /* a datagram endpoint posts no tagged receive, so a tagged message
       reaches it only here, off the path of an expected one */
    if (tagged && ep->dgram) {
        peer->violated = true;
        peer->over = "it sent a datagram endpoint a tagged message";
        return;
    }
    /* counted where unexp_free finds it again: the sender's entry (for
       our own messages not the handler's stand-in peer, and uncapped) */
    struct fiv_peer *acct = fiv_peer(ep, src);
    size_t held = acct ? acct->unexp_bytes : 0;
    /* a message costs at least its record, so empty ones are not free
       to hold; no more than its bytes, so one of the maximum size fits
       the default cap */
    size_t charge = h.len > sizeof(struct fiv_unexp) ? h.len
                                                     : sizeof(struct fiv_unexp);
    if (acct && peer != &ep->self_peer_dummy &&
        (held > fiv_cfg.peer_unexp_bytes ||
         charge > fiv_cfg.peer_unexp_bytes - held)) {
        peer->violated = true;
        peer->over = "it sent more unexpected bytes than its cap "
                     "(FI_IVSHM_PEER_UNEXPECTED_BYTES)";
        return;
    }
    struct fiv_unexp *u = calloc(1, sizeof *u);
    uint8_t *buf = malloc(h.len ? h.len : 1);
    if (!u || !buf) {
        free(u);
        free(buf);
        if (chunk < h.len)
            *as = (struct fiv_asm){.kind = ASM_DISCARD, .total = h.len,
                                   .got = chunk};
        return;
    }
    memcpy(buf, p, chunk);
    *u = (struct fiv_unexp){.src = src, .tag = h.tag, .data = h.data,
                            .flags = mflags, .len = h.len, .got = chunk,
                            .buf = buf, .charged = acct ? charge : 0};
    if (acct)
        acct->unexp_bytes += charge;
    append_unexp(ep, u, tagged);
    if (chunk < h.len)
        *as = (struct fiv_asm){.kind = ASM_UNEXP, .total = h.len, .got = chunk,
                               .ux = u};
}

static void msg_first(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                      uint32_t op, const uint8_t *p, size_t n)
{
    struct fiv_msg_hdr h;
    if (n < sizeof h) {
        peer->violated = true;
        return;
    }
    memcpy(&h, p, sizeof h); /* once: the region is shared */
    msg_hdr(ep, src, peer, op, &h, p + sizeof h, n - sizeof h);
}

/* The expected receive, whole: a region message of one part from a peer
   we hear on the region, for the receive at the head of its posted list
   (one buffer, no multi-receive), as every MPI's small message is. The
   arrival, the pair's count, the dispatch and the delivery in one:
   take_message's chain of cases and fiv_deliver's are what this skips.
   Everything else is branched off by the one check at the top, before
   anything of the message is read or any state changes (returns 0: the
   caller's take_message decides afresh); once the header is read, the
   message is this function's: it fails its wire check (returns -2: the
   caller breaks the path, as take_message would), or is handed with
   that header to msg_hdr's general cases (returns -1 if the sender
   broke our protocol there: the caller breaks the path).
   `src` is libivshm's slot index and `g` the generation it read the
   message from (take_in_place). */
#ifdef FIV_IPO_BUILD
/* Optimized as one module, inlined with its caller into libivshm's walk
   (fiv_progress.c, take_in_place): the walk and the receive in one frame,
   one set of saved registers. Across files only the link can inline it;
   elsewhere it stays a call. */
#define FIV_WALK_INLINE inline __attribute__((always_inline))
#else
#define FIV_WALK_INLINE
#endif
FIV_WALK_INLINE int fiv_msg_expected(struct fiv_ep *ep, int src, uint32_t g,
                                     uint32_t tag, const uint8_t *data,
                                     size_t n)
{
    fi_addr_t a = ep->by_slot[src];
    uint32_t op = tag & FIV_WIRE_OP;
    struct fiv_pair *pr = &ep->pairs[src];
    /* The one check: an AV peer at the generation we hear it on the
       region (take_message's admission); not failed, not switching or
       switched away (fiv_drain.c: sw_rx, and a path other than the
       region); no message of it in progress (a first part now would be
       a violation); the pair's count already at this generation
       (fiv_pair_received's reset is not needed); a MSG with room for its
       header. Each of those is take_message's delivery branch's own
       condition, so what passes is delivered exactly as there. */
    if (a >= ep->npeers)
        return 0;
    struct fiv_peer *peer = &ep->peers[a];
    if (((op & FIV_OP_MASK) != FIV_OP_MSG) | (peer->path != PATH_REGION) |
        peer->dead | peer->sw_rx | (peer->as.kind != ASM_NONE) |
        (g != ep->gen_by_slot[src]) | (pr->rx_gen != g) |
        (n < sizeof(struct fiv_msg_hdr)))
        return 0;
    struct fiv_msg_hdr h;
    memcpy(&h, data, sizeof h); /* once: the region is shared */
    pr->rx++;
    /* the wire check over that copy: it covers a first part's header
       alone, the bytes used below, so they are read once */
    _Static_assert(sizeof h == FIV_WIRE_CHECKED, "the check covers the header");
    if (fiv_wire_tag(op, &h, n) != tag)
        return -2;
    ep->received++;
    size_t chunk = n - sizeof h;
    bool tagged = op & FIV_F_TAGGED;
    struct fiv_rx **head = tagged ? &ep->trecv : &ep->recv;
    struct fiv_rx *rx = *head;
    /* whole, within our limit, and for the first posted receive of one
       buffer: receives are matched in posting order, so the head is the
       one take_rx would find first */
    if (h.len != chunk || h.len > ep->max_msg || !rx ||
        !rx_matches(rx, a, h.tag, tagged) ||
        (rx->flags & FI_MULTI_RECV) || rx->iov_count != 1) {
        msg_hdr(ep, a, peer, op, &h, data + sizeof h, chunk);
        return peer->violated ? -1 : 1;
    }
    *head = rx->next;
    if (!rx->next)
        *(tagged ? &ep->trecv_tail : &ep->recv_tail) = NULL;
    void *to = rx->iov[0].iov_base;
    size_t stored = chunk < rx->total ? chunk : rx->total;
    fiv_copy_small(to, data + sizeof h, stored);
    finish_rx(ep, rx, a, h.tag, h.data, op & (FIV_F_TAGGED | FIV_F_DATA),
              h.len, stored, to, false);
    fiv_rx_put(ep, rx);
    return 1;
}

/* An unexpected message completed while a receive waited for it. */
static void unexp_complete(struct fiv_ep *ep, struct fiv_unexp *u)
{
    if (!u->waiting)
        return;
    bool tagged = u->flags & FIV_F_TAGGED;
    remove_unexp(ep, u, tagged);
    unexp_to_rx(ep, u, u->waiting);
    unexp_free(ep, u);
}

static void msg_more(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                     const uint8_t *p, size_t n)
{
    struct fiv_asm *as = &peer->as;
    if (as->kind == ASM_NONE || n > as->total - as->got) {
        /* a continuation of nothing, or past what the first part said */
        peer->violated = true;
        return;
    }
    switch (as->kind) {
    case ASM_RECV:
        if (as->rx_off == (size_t)-1) {
            if (as->got < as->olen) {
                size_t k = as->olen - as->got < n ? as->olen - as->got : n;
                memcpy((uint8_t *)as->dst + as->got, p, k);
            }
        } else {
            fiv_iov_write(as->rx->iov, as->rx->iov_count, as->got, p, n);
        }
        break;
    case ASM_UNEXP:
        memcpy(as->ux->buf + as->got, p, n);
        break;
    case ASM_WRITE:
    case ASM_READ_RESP:
        fiv_rma_answer(ep, src, peer, FIV_OP_MORE, p, n);
        return;
    default:
        break;
    }
    as->got += n;
    if (as->got < as->total)
        return;
    struct fiv_asm done = *as;
    memset(as, 0, sizeof *as);
    if (done.kind == ASM_RECV) {
        struct fiv_rx *rx = done.rx;
        bool multi = rx->flags & FI_MULTI_RECV;
        bool last = multi && rx->retired && --rx->pending == 0;
        if (multi && !last && !rx->retired)
            rx->pending--;
        size_t cap = multi ? done.olen : rx->total;
        size_t stored = done.total < cap ? done.total : cap;
        finish_rx(ep, rx, src, done.tag, done.data, done.flags, done.total,
                  stored, done.dst, last);
        if (!multi || last)
            fiv_rx_put(ep, rx);
    } else if (done.kind == ASM_UNEXP) {
        done.ux->got = done.total;
        unexp_complete(ep, done.ux);
    }
}

/* What a sender's continuations were filling fails (it died, was
   removed, or began another message before finishing this one); with
   err 0 (the endpoint closes) nothing completes, records only go. */
void fiv_asm_fail(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                  int err)
{
    struct fiv_asm *as = &peer->as;
    if (as->kind == ASM_RECV) {
        struct fiv_rx *rx = as->rx;
        struct fiv_cqe e = {.context = rx->context,
                            .flags = FI_RECV | (as->flags & FIV_F_TAGGED ? FI_TAGGED : FI_MSG),
                            .len = 0, .tag = as->tag, .err = err,
                            .src = a};
        if (err)
            fiv_complete_rx(ep, &e, true);
        if (!(rx->flags & FI_MULTI_RECV))
            fiv_rx_put(ep, rx);
        else if (--rx->pending == 0 && rx->retired)
            fiv_rx_put(ep, rx); /* its last message: the buffer goes */
    } else if (as->kind == ASM_UNEXP) {
        struct fiv_unexp *u = as->ux;
        bool tagged = u->flags & FIV_F_TAGGED;
        remove_unexp(ep, u, tagged);
        if (u->waiting) {
            struct fiv_cqe e = {.context = u->waiting->context,
                                .flags = FI_RECV | (tagged ? FI_TAGGED : FI_MSG),
                                .tag = u->tag, .err = err, .src = a};
            if (err)
                fiv_complete_rx(ep, &e, true);
            fiv_rx_put(ep, u->waiting);
        }
        unexp_free(ep, u);
    } else if (as->kind == ASM_READ_RESP && as->req) {
        /* taken off the waiting list when its answer began */
        if (err)
            fiv_complete_tx(ep, as->req->context, as->req->flags,
                            as->req->complete_ev, err);
        fiv_req_free(as->req);
    }
    memset(as, 0, sizeof *as);
}

/* A peer that died or whose slot changed hands: everything we wait on
   from it fails, and nothing more goes to it. */
void fiv_peer_failed(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     int err)
{
    fiv_asm_fail(ep, a, peer, err);
    peer->dead = true;
    fiv_tx_fail_peer(ep, peer, err);
    fiv_rma_fail_peer(ep, a, err);
    fiv_fail_receives(ep, a, false, err);
}

void fiv_fail_receives(struct fiv_ep *ep, fi_addr_t a, bool wildcard, int err)
{
    struct fiv_rx **lists[] = {&ep->trecv, &ep->recv};
    struct fiv_rx **tails[] = {&ep->trecv_tail, &ep->recv_tail};
    for (int l = 0; l < 2; l++) {
        struct fiv_rx *prev = NULL, *r = *lists[l];
        while (r) {
            struct fiv_rx *next = r->next;
            /* a multi-receive buffer that messages still fill is
               released by the last of them (finish_rx), not here */
            bool filling = (r->flags & FI_MULTI_RECV) && r->pending;
            if (!filling &&
                (r->src == a || (wildcard && r->src == FI_ADDR_UNSPEC))) {
                if (prev)
                    prev->next = next;
                else
                    *lists[l] = next;
                if (*tails[l] == r)
                    *tails[l] = prev;
                struct fiv_cqe e = {.context = r->context,
                                    .flags = r->flags & (FI_TAGGED | FI_MSG |
                                                         FI_RECV |
                                                         FI_MULTI_RECV),
                                    .tag = r->tag, .err = err, .src = a};
                fiv_complete_rx(ep, &e, true);
                fiv_rx_put(ep, r);
            } else {
                prev = r;
            }
            r = next;
        }
    }
}

bool fiv_mark_awaited(struct fiv_ep *ep)
{
    bool any = false;
    struct fiv_rx *lists[] = {ep->trecv, ep->recv};
    for (int l = 0; l < 2; l++)
        for (struct fiv_rx *r = lists[l]; r; r = r->next) {
            struct fiv_peer *p = r->src == FI_ADDR_UNSPEC ? NULL
                                                          : fiv_peer(ep, r->src);
            if (p)
                p->awaited = true;
            else
                any |= r->src == FI_ADDR_UNSPEC;
        }
    return any;
}

void fiv_deliver(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                 uint32_t op, const uint8_t *p, size_t n)
{
    if ((op & FIV_OP_MASK) != FIV_OP_MORE && peer->as.kind != ASM_NONE) {
        /* the previous message was cut short: the caller breaks the path */
        peer->violated = true;
        return;
    }
    switch (op & FIV_OP_MASK) {
    case FIV_OP_MSG:
        msg_first(ep, src, peer, op, p, n);
        break;
    case FIV_OP_MORE:
        msg_more(ep, src, peer, p, n);
        break;
    case FIV_OP_WRITE:
    case FIV_OP_READ:
    case FIV_OP_ATOMIC:
        /* a datagram endpoint serves messages alone (docs/provider.md,
           "Datagram endpoints"): no registration is reached through it */
        if (ep->dgram) {
            peer->violated = true;
            peer->over = "it sent a datagram endpoint an RMA request";
            break;
        }
        fiv_rma_target(ep, src, peer, op, p, n);
        break;
    case FIV_OP_READ_RESP:
    case FIV_OP_ACK:
        /* a datagram endpoint asks for nothing: no answer is awaited */
        if (ep->dgram) {
            peer->violated = true;
            peer->over = "it sent a datagram endpoint an answer it never "
                         "asked for";
            break;
        }
        fiv_rma_answer(ep, src, peer, op, p, n);
        break;
    case FIV_OP_INTRO:
        break; /* heard already */
    default:
        peer->violated = true; /* not an operation of ours */
        break;
    }
}

void fiv_rx_free_all(struct fiv_ep *ep)
{
    struct fiv_rx *lists[] = {ep->trecv, ep->recv};
    for (int l = 0; l < 2; l++)
        while (lists[l]) {
            struct fiv_rx *r = lists[l];
            lists[l] = r->next;
            fiv_rx_put(ep, r);
        }
    struct fiv_unexp *ul[] = {ep->tunexp, ep->unexp};
    for (int l = 0; l < 2; l++)
        while (ul[l]) {
            struct fiv_unexp *u = ul[l];
            ul[l] = u->next;
            fiv_rx_put(ep, u->waiting);
            unexp_free(ep, u);
        }
    ep->trecv = ep->recv = NULL;
    ep->tunexp = ep->unexp = NULL;
    while (ep->rx_cache) {
        struct fiv_rx *rx = ep->rx_cache;
        ep->rx_cache = rx->next;
        free(rx);
    }
    ep->rx_cached = 0;
}

/* ---- posting receives ---- */

static struct fiv_unexp *find_unexp(struct fiv_ep *ep, fi_addr_t src,
                                    uint64_t tag, uint64_t ignore, bool tagged,
                                    void *claim_ctx, bool claimed)
{
    for (struct fiv_unexp *u = tagged ? ep->tunexp : ep->unexp; u; u = u->next) {
        if (u->waiting)
            continue;
        if (claimed) {
            if (u->claimed && u->claim == claim_ctx)
                return u;
            continue;
        }
        if (u->claimed)
            continue;
        if (src != FI_ADDR_UNSPEC && u->src != src)
            continue;
        if (tagged && ((u->tag ^ tag) & ~ignore))
            continue;
        return u;
    }
    return NULL;
}

static ssize_t post(struct fiv_ep *ep, const struct iovec *iov, size_t count,
                    fi_addr_t src, uint64_t tag, uint64_t ignore,
                    void *context, uint64_t flags, bool tagged)
{
    if (count > FIV_IOV_LIMIT)
        return -FI_EINVAL;
    if (!(ep->caps & FI_DIRECTED_RECV))
        src = FI_ADDR_UNSPEC;
    struct fiv_domain *d = ep->dom;
    fiv_lock(d);
    if (tagged && (flags & FI_PEEK)) {
        /* what has arrived by now: the peek's caller made progress first
           (fiv_msg_ops.c) */
        struct fiv_unexp *u = find_unexp(ep, src, tag, ignore, true, NULL, false);
        if (!u) {
            struct fiv_cqe e = {.context = context, .flags = FI_RECV | FI_TAGGED,
                                .tag = tag, .err = FI_ENOMSG,
                                .src = FI_ADDR_NOTAVAIL};
            if (ep->rx_cq)
                fiv_cq_push_err(ep->rx_cq, &e);
        } else {
            if (flags & FI_CLAIM) {
                u->claimed = true;
                u->claim = context;
            }
            struct fiv_cqe e = {.context = context,
                                .flags = FI_RECV | FI_TAGGED |
                                         (u->flags & FIV_F_DATA ? FI_REMOTE_CQ_DATA : 0),
                                .len = u->len, .tag = u->tag, .data = u->data,
                                .src = ep->caps & FI_SOURCE ? u->src : FI_ADDR_NOTAVAIL};
            if (flags & FI_DISCARD)
                unexp_drop(ep, u, true);
            if (ep->rx_cq)
                fiv_cq_push(ep->rx_cq, &e);
        }
        fiv_unlock(d);
        return 0;
    }
    struct fiv_rx *rx = rx_get(ep);
    if (!rx) {
        fiv_unlock(d);
        return -FI_ENOMEM;
    }
    if (count == 1) {
        rx->iov[0] = iov[0];
        rx->total = iov[0].iov_len;
    } else {
        if (count)
            memcpy(rx->iov, iov, count * sizeof *iov);
        rx->total = fiv_iov_total(iov, count);
    }
    rx->iov_count = count;
    rx->src = src;
    rx->tag = tag;
    rx->ignore = ignore;
    rx->context = context;
    rx->flags = flags | FI_RECV | (tagged ? FI_TAGGED : FI_MSG);
    if ((flags & FI_MULTI_RECV) && (tagged || count != 1))
        rx->flags &= ~FI_MULTI_RECV;
    struct fiv_unexp *u = NULL;
    struct fiv_peer *from;
    if (tagged && (flags & FI_CLAIM))
        u = find_unexp(ep, src, tag, ignore, true, context, true);
    else if (!(rx->flags & FI_MULTI_RECV))
        u = find_unexp(ep, src, tag, ignore, tagged, NULL, false);
    if (u && (flags & FI_DISCARD)) {
        struct fiv_cqe e = {.context = context, .flags = rx->flags & (FI_RECV | FI_TAGGED | FI_MSG),
                            .len = 0, .tag = u->tag, .src = u->src};
        unexp_drop(ep, u, tagged);
        fiv_complete_rx(ep, &e, want_rx(ep, rx->flags));
        fiv_rx_put(ep, rx);
    } else if (u && u->got == u->len) {
        remove_unexp(ep, u, tagged);
        unexp_to_rx(ep, u, rx);
        unexp_free(ep, u);
    } else if (u) {
        u->waiting = rx; /* still arriving: completes when whole */
    } else if (src != FI_ADDR_UNSPEC && (from = fiv_peer(ep, src)) &&
               from->dead) {
        /* nothing more comes from a failed peer (fiv_peer_failed) */
        struct fiv_cqe e = {.context = context,
                            .flags = rx->flags & (FI_RECV | FI_TAGGED | FI_MSG),
                            .tag = tag, .err = FI_EIO, .src = src};
        fiv_complete_rx(ep, &e, true);
        fiv_rx_put(ep, rx);
    } else if (rx->flags & FI_MULTI_RECV) {
        /* whatever waits unexpected fills the new buffer first */
        rx_append(&ep->recv, &ep->recv_tail, rx);
        struct fiv_unexp *x;
        while (!rx->retired &&
               (x = find_unexp(ep, FI_ADDR_UNSPEC, 0, 0, false, NULL, false)) &&
               x->got == x->len) {
            remove_unexp(ep, x, false);
            bool last = rx->total - rx->multi_used - (x->len < rx->total - rx->multi_used ? x->len : rx->total - rx->multi_used) < ep->min_multi_recv;
            unexp_to_rx(ep, x, rx);
            unexp_free(ep, x);
            if (last)
                break;
        }
    } else {
        rx_append(tagged ? &ep->trecv : &ep->recv,
                  tagged ? &ep->trecv_tail : &ep->recv_tail, rx);
    }
    fiv_unlock(d);
    return 0;
}

/* The receive every MPI posts per message (fi_recv, fi_trecv): one
   buffer, none of the flags post() has cases for, nothing unexpected
   waiting on the list it would search, the source (if any) alive. Then
   post() would only fill a record and append it; this does that without
   post()'s general cases (docs/fast-path.md, "The provider's
   per-message path"). Anything else: post(), which decides afresh. */
static inline __attribute__((always_inline)) void
rx_plain(struct fiv_ep *ep, struct fiv_rx *rx, void *buf, size_t len,
         fi_addr_t src, uint64_t tag, uint64_t ignore, void *context,
         uint64_t flags, bool tagged)
{
    rx->iov[0] = (struct iovec){buf, len};
    rx->total = len;
    rx->iov_count = 1;
    rx->src = src;
    rx->tag = tag;
    rx->ignore = ignore;
    rx->context = context;
    rx->flags = flags | FI_RECV | (tagged ? FI_TAGGED : FI_MSG);
    rx_append(tagged ? &ep->trecv : &ep->recv,
              tagged ? &ep->trecv_tail : &ep->recv_tail, rx);
}

/* post_plain under the domain's lock (FI_THREAD_SAFE and the models
   fiv_lock serializes), or with no record on the free list: out of
   line, so that the unlocked path saves no registers for its calls. */
static __attribute__((noinline)) ssize_t
post_plain_locked(struct fiv_ep *ep, void *buf, size_t len, fi_addr_t src,
                  uint64_t tag, uint64_t ignore, void *context,
                  uint64_t flags, bool tagged)
{
    struct fiv_domain *d = ep->dom;
    fiv_lock(d);
    struct fiv_peer *from;
    struct fiv_rx *rx;
    if ((tagged ? ep->tunexp : ep->unexp) ||
        (src != FI_ADDR_UNSPEC && (from = fiv_peer(ep, src)) &&
         from->dead) ||
        !(rx = rx_get(ep))) {
        fiv_unlock(d);
        struct iovec v = {buf, len};
        return post(ep, &v, 1, src, tag, ignore, context, flags, tagged);
    }
    rx_plain(ep, rx, buf, len, src, tag, ignore, context, flags, tagged);
    fiv_unlock(d);
    return 0;
}

static inline __attribute__((always_inline)) ssize_t
post_plain(struct fiv_ep *ep, void *buf, size_t len, fi_addr_t src,
           uint64_t tag, uint64_t ignore, void *context, uint64_t flags,
           bool tagged)
{
    if (!(ep->caps & FI_DIRECTED_RECV))
        src = FI_ADDR_UNSPEC;
    struct fiv_rx *rx = ep->rx_cache;
    struct fiv_peer *from;
    /* with no lock to take, a record on the free list and post()'s cases
       absent (the conditions post_plain_locked tests again under its
       lock), nothing here calls out */
    if (ep->dom->locking || !rx || (tagged ? ep->tunexp : ep->unexp) ||
        (src != FI_ADDR_UNSPEC && (from = fiv_peer(ep, src)) &&
         from->dead))
        return post_plain_locked(ep, buf, len, src, tag, ignore, context,
                                 flags, tagged);
    /* rx_get's, inline: what post does not set */
    ep->rx_cache = rx->next;
    ep->rx_cached--;
    rx->multi_used = 0;
    rx->pending = 0;
    rx->retired = false;
    rx_plain(ep, rx, buf, len, src, tag, ignore, context, flags, tagged);
    return 0;
}

/* the flags that take a receive off post_plain's path */
#define POST_GENERAL (FI_PEEK | FI_CLAIM | FI_DISCARD | FI_MULTI_RECV)

#define EP(e) container_of(e, struct fiv_ep, ep)

ssize_t fiv_msg_recv(struct fid_ep *e, void *buf, size_t len, void *desc,
                     fi_addr_t src, void *context)
{
    (void)desc;
    uint64_t flags = EP(e)->rx_op_flags | FI_COMPLETION;
    if (!(flags & POST_GENERAL))
        return post_plain(EP(e), buf, len, src, 0, 0, context, flags, false);
    struct iovec v = {buf, len};
    return post(EP(e), &v, 1, src, 0, 0, context, flags, false);
}

ssize_t fiv_msg_recvv(struct fid_ep *e, const struct iovec *iov, void **desc,
                      size_t count, fi_addr_t src, void *context)
{
    (void)desc;
    return post(EP(e), iov, count, src, 0, 0, context,
                EP(e)->rx_op_flags | FI_COMPLETION, false);
}

ssize_t fiv_msg_recvmsg(struct fid_ep *e, const struct fi_msg *msg,
                        uint64_t flags)
{
    return post(EP(e), msg->msg_iov, msg->iov_count, msg->addr, 0, 0,
                msg->context, flags, false);
}

ssize_t fiv_tagged_recv(struct fid_ep *e, void *buf, size_t len, void *desc,
                        fi_addr_t src, uint64_t tag, uint64_t ignore,
                        void *context)
{
    (void)desc;
    uint64_t flags = EP(e)->rx_op_flags | FI_COMPLETION;
    if (!(flags & POST_GENERAL))
        return post_plain(EP(e), buf, len, src, tag, ignore, context, flags,
                          true);
    struct iovec v = {buf, len};
    return post(EP(e), &v, 1, src, tag, ignore, context, flags, true);
}

ssize_t fiv_tagged_recvv(struct fid_ep *e, const struct iovec *iov, void **desc,
                         size_t count, fi_addr_t src, uint64_t tag,
                         uint64_t ignore, void *context)
{
    (void)desc;
    return post(EP(e), iov, count, src, tag, ignore, context,
                EP(e)->rx_op_flags | FI_COMPLETION, true);
}

ssize_t fiv_tagged_recvmsg(struct fid_ep *e, const struct fi_msg_tagged *msg,
                           uint64_t flags)
{
    return post(EP(e), msg->msg_iov, msg->iov_count, msg->addr, msg->tag,
                msg->ignore, msg->context, flags, true);
}

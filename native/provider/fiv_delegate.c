/*
 * Delegation: every peer outside our region goes through a core provider
 * the endpoint opens itself through the public fi_getinfo, transparently
 * to the application (as libfabric's efa provider does with shm).
 *
 * The core carries our own protocol (fiv.h) as untagged messages of at
 * most one bounce buffer each, preceded by the operation word; matching,
 * RMA and atomics stay ours, so one key and one tag space serve both
 * paths. Only the core's FI_MSG and FI_SOURCE are needed: a message whose
 * source the core cannot name (not inserted by the application) is
 * dropped, the core path's admission.
 *
 * Default "tcp;ofi_rxm", then "tcp" (2.x: RDM of its own), then "sockets"
 * (1.x); FI_IVSHM_CORE overrides ("none": none). We never open ourselves (no recursion), and ask for hidden
 * providers too: an application that sets FI_PROVIDER=ivshm hides the
 * others from fi_getinfo, ours included.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

/* libfabric's own flag for "include providers hidden by FI_PROVIDER"
   (ofi.h, unchanged from 1.17 to 2.5): the one efa uses to open shm */
#define FIV_GETINFO_HIDDEN (1ULL << 60)
#define CORE_WINDOW 4096 /* how far ahead a sequence number may be */

struct fiv_held {
    struct fiv_held *next;
    uint32_t seq, op;
    size_t len;
    uint8_t data[];
};

static bool is_us(const struct fi_info *i)
{
    return i->fabric_attr && i->fabric_attr->prov_name &&
           strstr(i->fabric_attr->prov_name, FIV_PROV_NAME);
}

static struct fi_info *find_core(const char *name)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return NULL;
    hints->caps = FI_MSG | FI_SEND | FI_RECV | FI_SOURCE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
    struct fi_info *found = NULL;
    hints->fabric_attr->prov_name = strdup(name);
    struct fi_info *all = NULL;
    if (hints->fabric_attr->prov_name &&
        fi_getinfo(FI_VERSION(1, 17), NULL, NULL, FIV_GETINFO_HIDDEN, hints,
                   &all) == 0) {
        /* not us; exactly the name asked for ("tcp" also matches the
           layered "tcp;ofi_rxm", which may not open: see fiv_core_open);
           a real interface before lo */
        struct fi_info *pick = NULL;
        int best = -1;
        for (struct fi_info *i = all; i; i = i->next) {
            if (is_us(i))
                continue;
            int score = !strcmp(i->fabric_attr->prov_name, name) * 2 +
                        (i->domain_attr && i->domain_attr->name &&
                         strcmp(i->domain_attr->name, "lo") != 0);
            if (score > best) {
                best = score;
                pick = i;
            }
        }
        if (pick)
            found = fi_dupinfo(pick);
        fi_freeinfo(all);
    }
    fi_freeinfo(hints);
    return found;
}

static int post_rx(struct fiv_core *c, struct core_buf *b)
{
    b->busy = true;
    return (int)fi_recv(c->ep, b->mem, CORE_BUF, b->desc, FI_ADDR_UNSPEC,
                        &b->ctx);
}

void fiv_core_close(struct fiv_ep *ep)
{
    struct fiv_core *c = ep->core;
    if (!c)
        return;
    if (c->dropped)
        FIV_WARN("core provider: %llu messages of senders not in the AV "
                 "dropped\n", (unsigned long long)c->dropped);
    if (c->ep)
        fi_close(&c->ep->fid);
    for (size_t i = 0; i < CORE_RX + CORE_TX; i++) {
        if (c->bufs[i].mr)
            fi_close(&c->bufs[i].mr->fid);
        free(c->bufs[i].mem);
    }
    if (c->av)
        fi_close(&c->av->fid);
    if (c->cq)
        fi_close(&c->cq->fid);
    if (c->domain)
        fi_close(&c->domain->fid);
    if (c->fabric)
        fi_close(&c->fabric->fid);
    if (c->info)
        fi_freeinfo(c->info);
    free(c->owner);
    free(c);
    ep->core = NULL;
}

static int open_one(struct fiv_ep *ep, const char *name)
{
    struct fiv_core *c = calloc(1, sizeof *c);
    if (!c)
        return -FI_ENOMEM;
    ep->core = c;
    c->info = find_core(name);
    if (!c->info) {
        FIV_INFO("no core provider %s\n", name);
        fiv_core_close(ep);
        return -FI_ENODATA;
    }
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_MSG,
                             .wait_obj = FI_WAIT_NONE, .size = 1024};
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    const char *step = "";
    int rc;
#define STEP(call)                                                            \
    do {                                                                      \
        step = #call;                                                         \
        if ((rc = (int)(call)) != 0)                                          \
            goto fail;                                                        \
    } while (0)
    STEP(fi_fabric(c->info->fabric_attr, &c->fabric, NULL));
    STEP(fi_domain(c->fabric, c->info, &c->domain, NULL));
    STEP(fi_cq_open(c->domain, &cqa, &c->cq, NULL));
    STEP(fi_av_open(c->domain, &ava, &c->av, NULL));
    STEP(fi_endpoint(c->domain, c->info, &c->ep, NULL));
    STEP(fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV));
    STEP(fi_ep_bind(c->ep, &c->av->fid, 0));
    STEP(fi_enable(c->ep));
    c->namelen = sizeof c->name;
    STEP(fi_getname(&c->ep->fid, c->name, &c->namelen));
    if (c->namelen == 0 || c->namelen > sizeof c->name) {
        rc = -FI_ETOOSMALL;
        goto fail;
    }
    bool need_mr = c->info->domain_attr->mr_mode & FI_MR_LOCAL;
    for (size_t i = 0; i < CORE_RX + CORE_TX; i++) {
        struct core_buf *b = &c->bufs[i];
        b->mem = malloc(CORE_BUF);
        if (!b->mem) {
            rc = -FI_ENOMEM;
            goto fail;
        }
        b->rx = i < CORE_RX;
        if (need_mr) {
                STEP(fi_mr_reg(c->domain, b->mem, CORE_BUF, FI_SEND | FI_RECV, 0,
                           i, 0, &b->mr, NULL));
            b->desc = fi_mr_desc(b->mr);
        }
        if (b->rx) {
            STEP(post_rx(c, b));
        } else {
            b->next_free = c->free_tx;
            c->free_tx = b;
        }
    }
    FIV_INFO("core provider %s\n", c->info->fabric_attr->prov_name);
    return 0;
fail:
    FIV_INFO("core provider %s: %s failed: %s\n", c->info->fabric_attr->prov_name,
             step, fi_strerror(-rc));
    fiv_core_close(ep);
    return -FI_ENODATA;
}

/* The first of the comma-separated names that opens. A layered one
   (tcp;ofi_rxm) cannot open when FI_PROVIDER hides its core (the
   utility provider asks without libfabric's hidden flag): the next name
   is tried. */
int fiv_core_open(struct fiv_ep *ep)
{
    const char *names = fiv_cfg.core ? fiv_cfg.core : "tcp;ofi_rxm,tcp,sockets";
    if (!strcmp(names, "none"))
        return -FI_ENODATA;
    char *list = strdup(names);
    int rc = -FI_ENODATA;
    for (char *save = NULL, *n = list ? strtok_r(list, ",", &save) : NULL;
         n && rc; n = strtok_r(NULL, ",", &save))
        if (!strstr(n, FIV_PROV_NAME))
            rc = open_one(ep, n);
    free(list);
    if (rc)
        FIV_WARN("no core provider of \"%s\" opens: only peers in the region "
                 "are reachable\n", names);
    return rc;
}

size_t fiv_core_name(struct fiv_ep *ep, uint8_t *out, size_t cap)
{
    if (!ep->core || ep->core->namelen > cap)
        return 0;
    memcpy(out, ep->core->name, ep->core->namelen);
    return ep->core->namelen;
}

bool fiv_core_sending(const struct fiv_ep *ep)
{
    if (!ep->core)
        return false;
    for (size_t i = CORE_RX; i < CORE_RX + CORE_TX; i++)
        if (ep->core->bufs[i].busy)
            return true;
    return false;
}

bool fiv_core_active(const struct fiv_ep *ep)
{
    return ep->core && ep->core->nowner;
}

int fiv_core_insert(struct fiv_ep *ep, const uint8_t *addr, size_t index,
                    fi_addr_t *out)
{
    struct fiv_core *c = ep->core;
    fi_addr_t ca = FI_ADDR_NOTAVAIL;
    if (fi_av_insert(c->av, addr, 1, &ca, 0, NULL) != 1)
        return -FI_EADDRNOTAVAIL;
    if (ca >= c->nowner) {
        size_t n = c->nowner ? c->nowner : 16;
        while (n <= ca)
            n *= 2;
        fi_addr_t *p = realloc(c->owner, n * sizeof *p);
        if (!p)
            return -FI_ENOMEM;
        for (size_t i = c->nowner; i < n; i++)
            p[i] = FI_ADDR_NOTAVAIL;
        c->owner = p;
        c->nowner = n;
    }
    c->owner[ca] = index; /* whose messages its source names */
    *out = ca;
    return 0;
}

void fiv_core_forget(struct fiv_ep *ep, fi_addr_t core_addr)
{
    struct fiv_core *c = ep->core;
    if (c && core_addr < c->nowner)
        c->owner[core_addr] = FI_ADDR_NOTAVAIL; /* unheard from now on */
}

void fiv_core_release_peer(struct fiv_peer *p)
{
    while (p->held) {
        struct fiv_held *h = p->held;
        p->held = h->next;
        free(h);
    }
}

void fiv_core_control(struct fiv_ep *ep, struct fiv_peer *peer, uint32_t op,
                      uint32_t seq, const uint8_t *p, size_t n)
{
    if ((op & FIV_OP_MASK) == FIV_OP_OFFER) {
        if (n != sizeof peer->of) {
            peer->violated = true;
            return;
        }
        memcpy(&peer->of, p, sizeof peer->of);
        peer->of_new = true;
    } else {
        if (n != sizeof peer->bk || peer->bk_end) {
            peer->violated = true;
            return;
        }
        memcpy(&peer->bk, p, sizeof peer->bk);
        peer->bk_seq = seq;
        peer->bk_new = peer->bk_end = true; /* its last core message */
    }
    ep->switching++; /* the next progress call's tick handles it */
}

/* A message of the core path in its turn: our control messages to
   fiv_drain.c, the rest to the receive side. */
static void deliver_one(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                        uint32_t op, uint32_t seq, const uint8_t *p, size_t n)
{
    if ((op & FIV_OP_MASK) == FIV_OP_OFFER || (op & FIV_OP_MASK) == FIV_OP_BACK)
        fiv_core_control(ep, peer, op, seq, p, n);
    else {
        ep->core_rx = true; /* no waiting where it lies (fiv_rma.c) */
        fiv_deliver(ep, a, peer, op, p, n);
        ep->core_rx = false;
    }
}

/* One message of `peer` from the core, delivered in its sender's order:
   early ones wait (copied) for those before them. */
static void in_order(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                     const uint8_t *m, size_t len)
{
    struct fiv_core *c = ep->core;
    uint32_t op, seq;
    memcpy(&op, m, sizeof op);
    memcpy(&seq, m + sizeof op, sizeof seq);
    uint32_t ahead = seq - peer->core_rx_seq;
    /* a region peer's core messages wait for its SWITCH, which comes
       after its last region message (fiv_drain.c) */
    if (ahead == 0 && fiv_core_delivers(peer)) {
        peer->core_rx_seq++;
        deliver_one(ep, a, peer, op, seq, m + CORE_WORD, len - CORE_WORD);
        fiv_core_release_held(ep, a, peer);
        return;
    }
    if (ahead >= CORE_WINDOW) {
        c->dropped++; /* behind us (a repeat) or impossibly far ahead */
        return;
    }
    struct fiv_held *h = malloc(sizeof *h + len - CORE_WORD);
    if (!h) {
        c->dropped++;
        return;
    }
    h->seq = seq;
    h->op = op;
    h->len = len - CORE_WORD;
    memcpy(h->data, m + CORE_WORD, h->len);
    struct fiv_held **pp = &peer->held;
    while (*pp && (*pp)->seq - peer->core_rx_seq < ahead)
        pp = &(*pp)->next;
    if (*pp && (*pp)->seq == seq) {
        free(h); /* a repeat of one held */
        return;
    }
    h->next = *pp;
    *pp = h;
}

void fiv_core_release_held(struct fiv_ep *ep, fi_addr_t a,
                           struct fiv_peer *peer)
{
    while (peer->held && peer->held->seq == peer->core_rx_seq &&
           fiv_core_delivers(peer) && !peer->violated) {
        struct fiv_held *h = peer->held;
        peer->held = h->next;
        peer->core_rx_seq++;
        deliver_one(ep, a, peer, h->op, h->seq, h->data, h->len);
        free(h);
    }
}

int fiv_core_progress(struct fiv_ep *ep)
{
    struct fiv_core *c = ep->core;
    struct fi_cq_msg_entry ev[16];
    fi_addr_t from[16];
    ssize_t n = fi_cq_readfrom(c->cq, ev, 16, from);
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        if (fi_cq_readerr(c->cq, &err, 0) == 1 && err.op_context) {
            struct core_buf *b = err.op_context;
            if (b->rx) {
                (void)post_rx(c, b);
            } else {
                b->busy = false;
                b->next_free = c->free_tx;
                c->free_tx = b;
                FIV_WARN("core provider send failed: %s\n",
                         fi_strerror(err.err));
            }
        }
        return 0;
    }
    if (n <= 0)
        return 0;
    for (ssize_t i = 0; i < n; i++) {
        struct core_buf *b = ev[i].op_context;
        if (!b->rx) {
            b->busy = false;
            b->next_free = c->free_tx;
            c->free_tx = b;
            continue;
        }
        fi_addr_t a = from[i] < c->nowner ? c->owner[from[i]] : FI_ADDR_NOTAVAIL;
        struct fiv_peer *peer = fiv_peer(ep, a);
        if (!peer || !fiv_core_hears(peer) || ev[i].len < CORE_WORD ||
            ev[i].len > CORE_BUF) {
            c->dropped++; /* not inserted by the application: unheard */
        } else {
            in_order(ep, a, peer, b->mem, ev[i].len);
            if (peer->violated) {
                const char *why = peer->over ? peer->over : "it broke our protocol";
                peer->violated = false;
                peer->over = NULL;
                fiv_path_broken(ep, a, peer, why);
            }
        }
        (void)post_rx(c, b);
    }
    return (int)n;
}

/*
 * Which cache lines of the region each side of a pair stores to and loads
 * from per small message: the driver of `line_count.py`, which runs it
 * under valgrind's lackey (every load and store of the program, with its
 * address) and counts per message the distinct lines each side touches
 * and the handoffs between the sides (docs/fast-path.md).
 *
 * Both ends of the pair live in this one thread, each with its own
 * mapping of the region (two attachments of one file, or two mappings of
 * one memfd for the model below), so the address of every access says
 * which side made it; steps run in a fixed order, so a trace is the same
 * on every run. The steps are the calls the BTL makes (docs/btl.md):
 *   send      ivshm_send_small(ob1's 14-byte match header, the payload);
 *   progress  what mca_btl_ivshmem_component_progress does with
 *             libivshm: ivshm_recv_each with a read of the payload (ob1's
 *             match) in the upcall, and when it says "look elsewhere" up
 *             to 16 rounds of ivshm_recv_peek(IVSHM_ANY), the sender's
 *             generation (the BTL's trust check), the payload read,
 *             ivshm_recv_release; the look for a second message and its
 *             pause after a "no" as in the BTL.
 *
 * --path ring     libivshm as built (the pair moves to its fast channel
 *                 during the warm-up)
 * --path queue    libivshm with fast channels off: every message through
 *                 the receiver's shared queue
 * --path fbox     a model of Open MPI's vader fast box as its source
 *                 (btl_vader_fbox.h) describes it: a 4 KiB buffer per
 *                 ordered pair, messages packed at 32-byte alignment
 *                 behind an 8-byte header (size; tag and sequence number
 *                 written last), the sender zeroing the next header, the
 *                 receiver storing its start offset after every poll that
 *                 took something and the sender reading it only when it
 *                 runs short. Written here from that description.
 *
 * --pattern pingpong   A sends, B takes it and answers, A takes that
 *           exchange   both send, then both take (HPCC's ring latency,
 *                      MPI_Sendrecv): A sends, A polls (nothing yet),
 *                      B sends, B takes, A takes
 *           window     A sends --window messages, B takes them all and
 *                      answers with one (osu's message rate)
 * Before each message a receiver polls once and finds nothing: a rank
 * spinning in MPI_Wait holds the line it polls.
 *
 * On stdout: the mappings, the marker page and labelled ranges of the
 * region (line_count.py reads them). The marker page gets one store per
 * step, at an offset naming the step, so the trace says where each step
 * begins. Without valgrind it simply runs (a quick check that it works).
 *
 *   ivshm-line-trace [--path ring|queue|fbox] [--pattern P] [--messages N]
 *                    [--warmup N] [--window N] [--payload B] [--blocking]
 *
 * Bad arguments: one line on stderr, exit 2.
 */
#define _GNU_SOURCE
#include "ivshm.h"
#include "internal.h" /* the layout, to label the region's ranges */

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define OB1_MATCH_HDR 14 /* ob1's match header, Debian's Open MPI 4.1 */
#define BTL_RECV_BATCH 16
#define BTL_LOOK_PAUSE 32

/* marker offsets: one store at MARK(step) starts that step */
enum { M_BEGIN = 1, M_END, M_A_SEND, M_A_POLL, M_B_SEND, M_B_POLL };
#define MARK(m) ((m) * 64)

static volatile uint64_t *marker;

static void mark(int m)
{
    marker[MARK(m) / 8] = 1;
}

static void usage_error(const char *msg)
{
    fprintf(stderr, "ivshm-line-trace: %s\n", msg);
    exit(2);
}

static void fail(const char *what, int rc)
{
    fprintf(stderr, "ivshm-line-trace: %s: %s\n", what,
            rc ? ivshm_strerror(rc) : "failed");
    exit(1);
}

/* ------------------------------------------------------------------ */
/* one end of the pair                                                */
/* ------------------------------------------------------------------ */

struct side;
struct path_ops {
    void (*send)(struct side *s, const uint8_t *hdr, size_t hlen,
                 const uint8_t *data, size_t dlen);
    int (*progress)(struct side *s); /* messages taken */
};

/* A model of vader's fast box: the buffer, and each end's local view. */
#define FBOX_SIZE 4096u
#define FBOX_ALIGN 32u
#define FBOX_POLLS 32
struct fbox_out {
    uint8_t *buf;            /* the box we write, in our mapping */
    uint32_t start, end;     /* offsets; bit 31: the lap's parity */
    uint16_t seq;
};
struct fbox_in {
    uint8_t *buf;            /* the box we read, in our mapping */
    uint32_t start;
    uint16_t seq;
};

struct side {
    const struct path_ops *ops;
    ivshm *h;
    int peer;
    unsigned looks_paused;
    int got;
    struct fbox_out out;
    struct fbox_in in;
    uint64_t taken;
    uint8_t sink[4096];
};

/* ---- libivshm, called as the BTL calls it ---- */

static void ivshm_side_send(struct side *s, const uint8_t *hdr, size_t hlen,
                            const uint8_t *data, size_t dlen)
{
    int rc = ivshm_send_small(s->h, s->peer, 65, hdr, hlen, data, dlen);
    if (rc < 0)
        fail("send", rc);
}

/* One message at most: peek, trust check, ob1 reads it, release. */
static int take_one(struct side *s)
{
    int src;
    uint32_t tag;
    const void *data;
    ssize_t n = ivshm_recv_peek(s->h, IVSHM_ANY, &src, &tag, &data);
    if (n == -EAGAIN)
        return 0;
    if (n < 0)
        fail("peek", (int)n);
    if (ivshm_peer_generation(s->h, src) < 0)
        fail("sender's generation", -ENOENT);
    memcpy(s->sink, data, (size_t)n);
    int rc = ivshm_recv_release(s->h, src);
    if (rc < 0)
        fail("release", rc);
    return 1;
}

static void take_in_place(void *arg, int src, uint32_t gen, uint32_t tag,
                          const void *data, size_t len)
{
    struct side *s = arg;
    (void)src;
    (void)gen;
    (void)tag;
    memcpy(s->sink, data, len);
    s->got++;
}

/* The BTL's progress: the fast path, paused looks, the general path when
   the fast path says "look elsewhere". */
static int ivshm_side_progress(struct side *s)
{
    const int max = s->looks_paused ? 1 : BTL_RECV_BATCH;
    s->got = 0;
    int taken = ivshm_recv_each(s->h, take_in_place, s, max);
    if (taken > 0) {
        if (max == 1)
            s->looks_paused--;
        else if (taken == 1)
            s->looks_paused = BTL_LOOK_PAUSE;
        return taken;
    }
    if (taken < 0)
        return 0;
    int got = 0;
    for (int i = 0; i < BTL_RECV_BATCH; i++) {
        if (i == 1) {
            if (s->looks_paused) {
                s->looks_paused--;
                break;
            }
            if (ivshm_recv_idle(s->h)) {
                s->looks_paused = BTL_LOOK_PAUSE;
                break;
            }
        }
        if (!take_one(s))
            break;
        got++;
    }
    return got;
}

static const struct path_ops ivshm_ops = {ivshm_side_send, ivshm_side_progress};

/* ---- the fast box model ---- */

/* header: size (u32), then tag (u16) and seq (u16) in the second word */
static void fbox_header(uint8_t *at, uint16_t tag, uint16_t seq, uint32_t size)
{
    volatile uint32_t *w = (volatile uint32_t *)at;
    w[1] = 0;                                   /* not yet */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    w[0] = size;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    w[1] = (uint32_t)tag | (uint32_t)seq << 16; /* published */
}

static uint32_t fbox_free(uint32_t start, uint32_t end)
{
    uint32_t s = start & 0x7fffffffu, e = end & 0x7fffffffu;
    bool same_lap = (start >> 31) == (end >> 31);
    return same_lap ? FBOX_SIZE - e : s - e;
}

static void fbox_side_send(struct side *s, const uint8_t *hdr, size_t hlen,
                           const uint8_t *data, size_t dlen)
{
    struct fbox_out *o = &s->out;
    const uint32_t len = (uint32_t)(hlen + dlen);
    const uint32_t need = (len + 8 + FBOX_ALIGN - 1) & ~(FBOX_ALIGN - 1);
    uint32_t lap = o->end & 0x80000000u, end = o->end & 0x7fffffffu;
    uint32_t room = fbox_free(o->start, o->end);
    if (room < need) {
        /* short: the receiver's position, the one shared read */
        o->start = __atomic_load_n((uint32_t *)o->buf, __ATOMIC_ACQUIRE);
        room = fbox_free(o->start, o->end);
        if (room < need && (o->start >> 31) == (o->end >> 31)) {
            /* no room before the end: a skip record, go round */
            fbox_header(o->buf + end, 0xff, o->seq++, room - 8);
            end = FBOX_ALIGN;
            lap ^= 0x80000000u;
            o->end = lap | end;
            room = fbox_free(o->start, o->end);
        }
        if (room < need)
            fail("fast box full (the model has no fallback)", 0);
    }
    uint8_t *at = o->buf + end;
    memcpy(at + 8, hdr, hlen);
    memcpy(at + 8 + hlen, data, dlen);
    end += need;
    if (end == FBOX_SIZE) {
        end = FBOX_ALIGN;
        lap ^= 0x80000000u;
    } else if (room > need) {
        *(volatile uint64_t *)(o->buf + end) = 0; /* the next header */
    }
    fbox_header(at, 65, o->seq++, len);
    o->end = lap | end;
}

static int fbox_side_progress(struct side *s)
{
    struct fbox_in *in = &s->in;
    uint32_t lap = in->start & 0x80000000u, start = in->start & 0x7fffffffu;
    int got = 0, polls;
    for (polls = 0; polls < FBOX_POLLS; polls++) {
        volatile uint32_t *w = (volatile uint32_t *)(in->buf + start);
        uint32_t tagseq = w[1];
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint32_t size = w[0];
        uint16_t tag = (uint16_t)tagseq, seq = (uint16_t)(tagseq >> 16);
        if (tag == 0 || seq != in->seq)
            break;
        in->seq++;
        if (tag != 0xff) {
            memcpy(s->sink, in->buf + start + 8, size);
            got++;
        }
        start = (start + size + 8 + FBOX_ALIGN - 1) & ~(FBOX_ALIGN - 1);
        if (start == FBOX_SIZE) {
            start = FBOX_ALIGN;
            lap ^= 0x80000000u;
        }
    }
    if (polls) {
        in->start = lap | start;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        __atomic_store_n((uint32_t *)in->buf, in->start, __ATOMIC_RELAXED);
    }
    return got;
}

static const struct path_ops fbox_ops = {fbox_side_send, fbox_side_progress};

/* ------------------------------------------------------------------ */
/* setup and labels                                                   */
/* ------------------------------------------------------------------ */

static void label(const char *name, uint64_t off, uint64_t len)
{
    printf("label %s %llu %llu\n", name, (unsigned long long)off,
           (unsigned long long)len);
}

/* The ranges of the region a small message may touch, by name: the two
   peers' registry entries and the parts of their receive areas. */
static void label_ivshm(ivshm *h)
{
    const char *who[2] = {"A", "B"};
    for (int i = 0; i < 2; i++) {
        int slot = i; /* A claimed slot 0, B slot 1 (checked by the caller) */
        char n[96];
        uint64_t e = (uint64_t)((uint8_t *)ivshm_entry(h, slot) - h->base);
        snprintf(n, sizeof n, "registry[%s].identity", who[i]);
        label(n, e, 64);
        snprintf(n, sizeof n, "registry[%s].sleeping,may_sleep", who[i]);
        label(n, e + 64, 64);
        uint64_t a = (uint64_t)(ivshm_rx_area(h, slot) - h->base);
        snprintf(n, sizeof n, "queue[%s].enqueue_pos", who[i]);
        label(n, a, 64);
        snprintf(n, sizeof n, "queue[%s].head", who[i]);
        label(n, a + 64, 64);
        snprintf(n, sizeof n, "queue[%s].waiters", who[i]);
        label(n, a + 128, IVSHM_QUEUE_CTRL - 128);
        snprintf(n, sizeof n, "queue[%s].cells", who[i]);
        label(n, a + IVSHM_QUEUE_CTRL, (uint64_t)h->queue_slots * h->slot_size);
        if (!h->fast_channels)
            continue;
        uint64_t d = (uint64_t)((uint8_t *)ivshm_fdesc(h, slot, 0) - h->base);
        snprintf(n, sizeof n, "channels[%s].descriptors", who[i]);
        label(n, d, (uint64_t)h->fast_channels * IVSHM_FAST_DESC);
        for (uint32_t k = 0; k < h->fast_channels; k++) {
            uint64_t r = (uint64_t)(ivshm_fring(h, slot, k) - h->base);
            snprintf(n, sizeof n, "ring[%s:%u].head", who[i], k);
            label(n, r, 64);
            snprintf(n, sizeof n, "ring[%s:%u].tail", who[i], k);
            label(n, r + 64, 64);
            snprintf(n, sizeof n, "ring[%s:%u].slots", who[i], k);
            label(n, r + IVSHM_RING_CTRL, h->ring_bytes - IVSHM_RING_CTRL);
        }
    }
}

static ivshm *attach_side(const char *path, uint32_t rank, bool blocking)
{
    ivshm_config cfg = {.job_id = 7, .rank = rank, .name = "line-trace",
                        .spin_ns = blocking ? 1000 : -1};
    ivshm *h = NULL;
    int rc = ivshm_attach_path(path, &cfg, &h);
    if (rc < 0)
        fail("attach", rc);
    return h;
}

static void print_map(const char *side, const void *base, uint64_t size)
{
    printf("map %s %llx %llu\n", side, (unsigned long long)(uintptr_t)base,
           (unsigned long long)size);
}

static void setup_ivshm(struct side *a, struct side *b, bool fast,
                        bool blocking)
{
    /* the geometry `ivcloud mpirun` gives a job of up to 8 ranks
       (ivcloud/mpi.py, mpi_geometry) */
    ivshm_geometry g = {.max_peers = 8, .ring_slots = 64,
                        .slot_size = 16 * 1024 + 64, .queue_slots = 64,
                        .fast_channels = fast ? 8 : IVSHM_FAST_NONE};
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/ivshm-line-trace-%d", (int)getpid());
    uint64_t size = ivshm_min_region_size(&g) + (1u << 20);
    size = (size + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
    int rc = ivshm_format_file(path, size, &g, 0600);
    if (rc < 0)
        fail("format region", rc);
    a->h = attach_side(path, 0, blocking);
    b->h = attach_side(path, 1, blocking);
    unlink(path);
    if (ivshm_self(a->h) != 0 || ivshm_self(b->h) != 1)
        fail("unexpected registry slots", 0);
    a->peer = 1;
    b->peer = 0;
    a->ops = b->ops = &ivshm_ops;
    print_map("A", a->h->base, a->h->size);
    print_map("B", b->h->base, b->h->size);
    label_ivshm(a->h);
}

static void setup_fbox(struct side *a, struct side *b)
{
    /* box A->B at 0, box B->A at FBOX_SIZE, each side mapping both */
    int fd = memfd_create("fbox-model", 0);
    if (fd < 0 || ftruncate(fd, 2 * FBOX_SIZE) < 0)
        fail("memfd", -errno);
    uint8_t *ma = mmap(NULL, 2 * FBOX_SIZE, PROT_READ | PROT_WRITE,
                       MAP_SHARED, fd, 0);
    uint8_t *mb = mmap(NULL, 2 * FBOX_SIZE, PROT_READ | PROT_WRITE,
                       MAP_SHARED, fd, 0);
    close(fd);
    if (ma == MAP_FAILED || mb == MAP_FAILED)
        fail("mmap", -errno);
    a->ops = b->ops = &fbox_ops;
    a->out = (struct fbox_out){ma, FBOX_ALIGN, FBOX_ALIGN, 0};
    b->in = (struct fbox_in){mb, FBOX_ALIGN, 0};
    b->out = (struct fbox_out){mb + FBOX_SIZE, FBOX_ALIGN, FBOX_ALIGN, 0};
    a->in = (struct fbox_in){ma + FBOX_SIZE, FBOX_ALIGN, 0};
    *(uint32_t *)ma = FBOX_ALIGN;
    *(uint32_t *)(ma + FBOX_SIZE) = FBOX_ALIGN;
    print_map("A", ma, 2 * FBOX_SIZE);
    print_map("B", mb, 2 * FBOX_SIZE);
    label("fbox[A->B].start", 0, 32);
    label("fbox[A->B].messages", 32, FBOX_SIZE - 32);
    label("fbox[B->A].start", FBOX_SIZE, 32);
    label("fbox[B->A].messages", FBOX_SIZE + 32, FBOX_SIZE - 32);
}

/* ------------------------------------------------------------------ */
/* patterns                                                           */
/* ------------------------------------------------------------------ */

struct run {
    struct side *a, *b;
    uint8_t hdr[OB1_MATCH_HDR];
    uint8_t data[4096];
    size_t dlen;
    int window;
};

static void send_as(struct run *r, struct side *s)
{
    mark(s == r->a ? M_A_SEND : M_B_SEND);
    r->hdr[0]++; /* a different message each time, as ob1's sequence */
    s->ops->send(s, r->hdr, sizeof r->hdr, r->data, r->dlen);
}

static int poll_as(struct run *r, struct side *s)
{
    mark(s == r->a ? M_A_POLL : M_B_POLL);
    int n = s->ops->progress(s);
    s->taken += (uint64_t)n;
    return n;
}

/* Poll until `n` more messages have been taken (bounded: every message
   was published before, so each poll takes at least one). */
static void take_as(struct run *r, struct side *s, int n)
{
    uint64_t want = s->taken + (uint64_t)n;
    for (int polls = 0; s->taken < want; polls++) {
        if (polls > 64 * n + 64)
            fail("a published message did not arrive", 0);
        poll_as(r, s);
    }
}

static void empty_poll(struct run *r, struct side *s)
{
    if (poll_as(r, s))
        fail("a message arrived that nobody sent", 0);
}

static void pingpong(struct run *r)
{
    empty_poll(r, r->b);
    send_as(r, r->a);
    take_as(r, r->b, 1);
    empty_poll(r, r->a);
    send_as(r, r->b);
    take_as(r, r->a, 1);
}

static void exchange(struct run *r)
{
    send_as(r, r->a);
    empty_poll(r, r->a);
    send_as(r, r->b);
    take_as(r, r->b, 1);
    take_as(r, r->a, 1);
}

static void window(struct run *r)
{
    empty_poll(r, r->b);
    for (int i = 0; i < r->window; i++)
        send_as(r, r->a);
    take_as(r, r->b, r->window);
    empty_poll(r, r->a);
    send_as(r, r->b);
    take_as(r, r->a, 1);
}

int main(int argc, char **argv)
{
    const char *path = "ring", *pattern = "pingpong";
    long messages = 200, warmup = 200, win = 64, payload = OB1_MATCH_HDR + 8;
    bool blocking = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        long *num = !strcmp(argv[i], "--messages") ? &messages
                    : !strcmp(argv[i], "--warmup")  ? &warmup
                    : !strcmp(argv[i], "--window")  ? &win
                    : !strcmp(argv[i], "--payload") ? &payload
                                                    : NULL;
        if (!strcmp(argv[i], "--blocking")) {
            blocking = true;
        } else if (!strcmp(argv[i], "--path") && v) {
            path = v;
            i++;
        } else if (!strcmp(argv[i], "--pattern") && v) {
            pattern = v;
            i++;
        } else if (num && v) {
            *num = strtol(v, &end, 10);
            if (!*v || *end || *num < 0 || *num > 1000000)
                usage_error("a count must be a number from 0 to 1000000");
            i++;
        } else {
            usage_error("usage: ivshm-line-trace [--path ring|queue|fbox] "
                        "[--pattern pingpong|exchange|window] [--messages N] "
                        "[--warmup N] [--window N] [--payload B] [--blocking]");
        }
    }
    void (*step)(struct run *) = !strcmp(pattern, "pingpong") ? pingpong
                                 : !strcmp(pattern, "exchange") ? exchange
                                 : !strcmp(pattern, "window")   ? window
                                                                : NULL;
    if (!step)
        usage_error("--pattern is pingpong, exchange or window");
    if (strcmp(path, "ring") && strcmp(path, "queue") && strcmp(path, "fbox"))
        usage_error("--path is ring, queue or fbox");
    if (payload < OB1_MATCH_HDR || payload > 1000)
        usage_error("--payload is 14 (ob1's match header) to 1000 bytes");
    if (win < 1 || win > 100)
        usage_error("--window is 1 to 100 (the fast box holds 127 messages)");
    if (messages < 1)
        usage_error("--messages is at least 1");

    marker = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (marker == MAP_FAILED)
        fail("mmap", -errno);
    static struct side a, b;
    if (!strcmp(path, "fbox"))
        setup_fbox(&a, &b);
    else
        setup_ivshm(&a, &b, !strcmp(path, "ring"), blocking);
    printf("marker %llx\n", (unsigned long long)(uintptr_t)marker);
    printf("geometry payload %ld window %ld\n", payload, win);

    static struct run r;
    r.a = &a;
    r.b = &b;
    r.dlen = (size_t)payload - OB1_MATCH_HDR;
    r.window = (int)win;
    /* iterations: a ping-pong and an exchange move two messages, a
       window window + 1 */
    const long per = !strcmp(pattern, "window") ? win + 1 : 2;
    for (long i = 0; i < (warmup + per - 1) / per; i++)
        step(&r);
    long iters = (messages + per - 1) / per;
    printf("iterations %ld messages %ld\n", iters, iters * per);
    fflush(stdout);
    mark(M_BEGIN);
    for (long i = 0; i < iters; i++)
        step(&r);
    mark(M_END);
    if (a.h) {
        ivshm_detach(a.h);
        ivshm_detach(b.h);
    }
    return 0;
}

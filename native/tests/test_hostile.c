/* Attacks by a co-tenant of the region (docs/security.md, "libivshm"),
   each replayed by a real hostile thread or process:
   - a header flipper racing attach (heap_size double fetch),
   - a sender that stalls or streams forever in the middle of a message,
   - a tail rewound behind the producer's back,
   - garbage in what ivshm_recv_idle reads (ring head slots, the queue
     head cell and enqueue_pos) while honest processes send,
   - a published message made to look empty, a forged producer head, a
     lost OPEN cell,
   - names planted where ivshm_format_file will create its file.
   Time bounds are generous (the machine is shared): they separate
   "returned by its deadline" from "hung", not fast from slow. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t job = 0x4057;
static const char *path;

/* The fast ring from -> to (opened with ivshm_fast_open: these attacks
   write into a pair's ring; test_queue attacks the shared queues). */
static uint8_t *ivshm_ring(ivshm *h, int from, int to)
{
    uint8_t *r = ivshm_fast_ring_of(h, from, to);
    if (!r) {
        fprintf(stderr, "no fast ring %d -> %d\n", from, to);
        exit(1);
    }
    return r;
}

static struct ivshm_slot *ring_slot(ivshm *h, int from, int to, uint64_t pos)
{
    return (struct ivshm_slot *)(ivshm_ring(h, from, to) + IVSHM_RING_CTRL +
                                 (pos & (h->ring_slots - 1)) *
                                     (uint64_t)h->slot_size);
}

static struct ivshm_ring_ctrl *ring_ctrl(ivshm *h, int from, int to)
{
    return (struct ivshm_ring_ctrl *)ivshm_ring(h, from, to);
}

/* Publish a hand-made fragment at `pos` of ring(h -> to), bypassing
   every check ivshm_send makes: what a hostile sender can do. */
static void raw_publish(ivshm *h, int to, uint64_t pos, uint32_t tag,
                        uint32_t flags, uint32_t len, uint64_t total,
                        uint8_t fill)
{
    struct ivshm_slot *s = ring_slot(h, h->self, to, pos);
    s->len = len;
    s->tag = tag;
    s->gen = h->self_gen;
    s->flags = flags;
    s->total = total;
    memset((uint8_t *)s + IVSHM_SLOT_HDR, fill, len);
    atomic_store_explicit(&s->seq, pos + 1, memory_order_release);
    ivshm_kick(h, to);
}

/* ---- attack 2: heap_size flipped while the victim attaches ---- */

struct flipper {
    uint64_t *heap_size;
    uint64_t good, bad;
    atomic_bool stop;
    uint64_t flips;
};

static void *flip_heap_size(void *arg)
{
    struct flipper *f = arg;
    while (!atomic_load(&f->stop)) {
        __atomic_store_n(f->heap_size, f->good, __ATOMIC_RELAXED);
        __atomic_store_n(f->heap_size, f->bad, __ATOMIC_RELAXED);
        f->flips++;
    }
    __atomic_store_n(f->heap_size, f->good, __ATOMIC_RELAXED);
    return NULL;
}

static void test_attach_race(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 4, .slot_size = 256,
                        .max_windows = 2};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    /* The flipper's own mapping of the header. */
    int fd = open(path, O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0);
    struct ivshm_header *hdr =
        mmap(NULL, IVSHM_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(hdr != MAP_FAILED);
    close(fd);
    uint64_t heap_off = hdr->heap_off;

    /* A READY window whose extent is valid only for a heap of ~2^64
       bytes: joined with a forged heap_size, a put would land 1 TiB past
       the mapping. Member (the bitmap at the start of its extent): slot
       3, so it is neither empty nor ours. */
    ivshm *owner = tu_attach(path, job, 0, 0);
    struct ivshm_win_desc *d =
        (struct ivshm_win_desc *)(owner->base + owner->windir_off);
    const uint64_t tib = 1ull << 40;
    d->nseg = 2;
    d->job_id = job;
    memset(d->name, 0, sizeof d->name);
    strcpy(d->name, "forged");
    d->data_off = heap_off;
    d->data_bytes = 2 * tib;
    d->seg_size = tib;
    d->gen = 1;
    atomic_store((_Atomic uint64_t *)(owner->base + heap_off), 1ull << 3);
    atomic_store(&d->state, WIN_READY);

    struct flipper f = {.heap_size = &hdr->heap_size,
                        .good = hdr->heap_size,
                        .bad = 0 - heap_off};
    atomic_init(&f.stop, false);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, flip_heap_size, &f) == 0);

    unsigned attached = 0, refused = 0, escaped = 0, put_ok = 0;
    uint64_t end = tu_now_ms() + 2000;
    ivshm_config cfg = {.job_id = job, .rank = 1};
    while (tu_now_ms() < end) {
        ivshm *v = NULL;
        int rc = ivshm_attach_path(path, &cfg, &v);
        if (rc == IVSHM_ESIZE) {
            refused++;
            continue;
        }
        CHECK_RC(rc, 0);
        if (rc < 0)
            break;
        attached++;
        /* the victim's view of the heap must lie inside its mapping */
        if (v->heap_off + v->heap_size > v->size || v->heap_size > v->size)
            escaped++;
        ivshm_window *w = NULL;
        rc = ivshm_win_open(v, "forged", 2, tib, &w);
        if (rc == 0) {
            /* must never get here; if it does, do not write */
            put_ok++;
            ivshm_win_close(w);
        }
        ivshm_detach(v);
    }
    atomic_store(&f.stop, true);
    pthread_join(th, NULL);
    printf("attach race: %u attached, %u refused, %llu flips\n", attached,
           refused, (unsigned long long)f.flips);
    CHECK(attached > 10);
    CHECK(escaped == 0);
    CHECK(put_ok == 0);
    /* after the flipping, a clean attach still works */
    ivshm *v = NULL;
    CHECK_RC(ivshm_attach_path(path, &cfg, &v), 0);
    if (v) {
        CHECK(v->heap_size == f.good);
        ivshm_window *w = NULL;
        CHECK(ivshm_win_open(v, "forged", 2, tib, &w) < 0);
        ivshm_detach(v);
    }
    ivshm_detach(owner);
    munmap(hdr, IVSHM_PAGE);
}

/* ---- attack 4: a sender stalls in the middle of a message ---- */

struct stall_args {
    int ready_fd, stop_fd;
    bool endless; /* keep streaming continuation fragments */
};

/* Hostile sender (rank 1): a FIRST fragment of a 1 TiB message, then
   either nothing (stays alive, never sends the rest) or continuation
   fragments for as long as there is room, until told to stop. */
static int stall_child(void *arg)
{
    struct stall_args *a = arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int victim = tu_await_peer(h, job, 0, 10000);
    REQUIRE(victim >= 0);
    REQUIRE(ivshm_peer_current(h, victim));
    REQUIRE(ivshm_fast_open(h, victim) == 0);
    const uint32_t payload = h->slot_size - IVSHM_SLOT_HDR;
    const uint64_t total = 1ull << 40;
    raw_publish(h, victim, 0, 77, SLOT_FIRST, payload, total, 0xaa);
    char c = 'r';
    REQUIRE(write(a->ready_fd, &c, 1) == 1);
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(h, h->self, victim);
    uint64_t pos = 1;
    for (;;) {
        if (read(a->stop_fd, &c, 1) != -1 || errno != EAGAIN)
            break; /* parent wrote or closed: stop */
        if (!a->endless) {
            tu_sleep_ms(5);
            continue;
        }
        uint64_t tail = atomic_load(&ctrl->tail);
        if (pos - tail >= h->ring_slots) {
            sched_yield();
            continue;
        }
        raw_publish(h, victim, pos++, 77, 0, payload, total, 0xbb);
    }
    ivshm_detach(h);
    return 0;
}

static void run_stall(bool endless)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *h = tu_attach(path, job, 0, 0);
    int ready[2], stop[2];
    CHECK(pipe(ready) == 0 && pipe2(stop, O_NONBLOCK) == 0);
    struct stall_args a = {.ready_fd = ready[1], .stop_fd = stop[0],
                           .endless = endless};
    pid_t pid = tu_fork(stall_child, &a);
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    int src = tu_await_peer(h, job, 1, 10000);
    CHECK(src >= 0);

    uint8_t buf[4096];
    uint32_t tag = 0;
    int got = -2;
    /* poll: returns at once, the partial message kept */
    uint64_t t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(h, src, &got, &tag, buf, sizeof buf, 0), -EAGAIN);
    CHECK(tu_now_ms() - t0 < 1000);
    t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(h, IVSHM_ANY, &got, &tag, buf, sizeof buf, 0),
             -EAGAIN);
    CHECK(tu_now_ms() - t0 < 1000);
    /* bounded waits end at their deadline, not when the message does */
    t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(h, src, &got, &tag, buf, sizeof buf, 50), -ETIMEDOUT);
    uint64_t el = tu_now_ms() - t0;
    CHECK(el >= 45 && el < 2000);
    t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(h, IVSHM_ANY, &got, &tag, buf, sizeof buf, 50),
             -ETIMEDOUT);
    el = tu_now_ms() - t0;
    CHECK(el >= 45 && el < 2000);
    /* the BTL's sequence: peek says multi-slot, then a polling recv */
    const void *data = NULL;
    int psrc = -1;
    CHECK_RC(ivshm_recv_peek(h, IVSHM_ANY, &psrc, &tag, &data), -EMSGSIZE);
    CHECK(psrc == src);
    t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(h, psrc, NULL, &tag, buf, sizeof buf, 0), -EAGAIN);
    CHECK(tu_now_ms() - t0 < 1000);
    t0 = tu_now_ms();
    int wm = ivshm_wait_message(h, 20);
    CHECK(wm == 0 || wm == -ETIMEDOUT);
    CHECK(tu_now_ms() - t0 < 1000);

    /* the sender dies: the message in progress ends as EPEERDEAD */
    CHECK(write(stop[1], "s", 1) == 1);
    CHECK(tu_wait(pid, 5000) == 0);
    ssize_t rc = 0;
    t0 = tu_now_ms();
    do {
        rc = ivshm_recv(h, src, NULL, NULL, buf, sizeof buf, 100);
    } while (rc == -ETIMEDOUT && tu_now_ms() - t0 < 3000);
    CHECK_RC(rc, IVSHM_EPEERDEAD);
    close(ready[0]);
    close(ready[1]);
    close(stop[0]);
    close(stop[1]);
    ivshm_detach(h);
}

static void test_mid_message_stall(void)
{
    run_stall(false);
    run_stall(true);
}

/* A message cut by deadlines is resumed by later calls, also with
   another buffer, and arrives whole; its cap is the smallest one seen. */
static void test_resume(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *a = tu_attach(path, job, 0, 0), *b = tu_attach(path, job, 1, 0);
    int sa = ivshm_self(a), sb = ivshm_self(b);
    CHECK(ivshm_peer_current(a, sb));
    CHECK_RC(ivshm_fast_open(a, sb), 0);
    const uint32_t pl = a->slot_size - IVSHM_SLOT_HDR;
    const uint64_t total = 2 * pl + 10;
    uint8_t buf1[1024], buf2[1024];
    uint32_t tag = 0;
    raw_publish(a, sb, 0, 5, SLOT_FIRST, pl, total, 1);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, sizeof buf1, 0), -EAGAIN);
    raw_publish(a, sb, 1, 5, 0, pl, total, 2);
    CHECK_RC(ivshm_recv(b, IVSHM_ANY, NULL, &tag, buf2, sizeof buf2, 20),
             -ETIMEDOUT);
    const void *data;
    CHECK_RC(ivshm_recv_peek(b, sa, NULL, &tag, &data), -EMSGSIZE);
    raw_publish(a, sb, 2, 5, SLOT_LAST, 10, total, 3);
    memset(buf1, 0, sizeof buf1);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, sizeof buf1, 0), total);
    CHECK(tag == 5);
    bool ok = true;
    for (uint64_t i = 0; i < total; i++)
        ok &= buf1[i] == (i < pl ? 1 : i < 2 * pl ? 2 : 3);
    CHECK(ok);

    /* caps differ: a smaller cap later truncates as usual ... */
    raw_publish(a, sb, 3, 6, SLOT_FIRST, pl, total, 4);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, sizeof buf1, 0), -EAGAIN);
    raw_publish(a, sb, 4, 6, 0, pl, total, 5);
    raw_publish(a, sb, 5, 6, SLOT_LAST, 10, total, 6);
    memset(buf2, 0, sizeof buf2);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf2, 100, 0), total);
    ok = true;
    for (int i = 0; i < 100; i++)
        ok &= buf2[i] == 4;
    CHECK(ok && buf2[100] == 0);
    /* ... but bytes dropped by a smaller earlier cap are not passed off
       as the message to a larger later one */
    raw_publish(a, sb, 6, 9, SLOT_FIRST, pl, total, 4);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, 100, 0), -EAGAIN);
    raw_publish(a, sb, 7, 9, 0, pl, total, 5);
    raw_publish(a, sb, 8, 9, SLOT_LAST, 10, total, 6);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf2, sizeof buf2, 0), -EMSGSIZE);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf2, sizeof buf2, 0), -EAGAIN);

    /* a sender that breaks off (a new FIRST) costs that message only */
    raw_publish(a, sb, 9, 7, SLOT_FIRST, pl, total, 7);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, sizeof buf1, 0), -EAGAIN);
    raw_publish(a, sb, 10, 8, SLOT_FIRST | SLOT_LAST, 3, 3, 8);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, sizeof buf1, 0),
             IVSHM_ECORRUPT);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, buf1, sizeof buf1, 0), 3);
    CHECK(tag == 8 && buf1[0] == 8);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* A real sender streams a 3 MiB message through an 8-slot ring while the
   receiver only ever polls (timeout 0), alternating buffers: it arrives
   whole and in order. */
static int stream_child(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int to = tu_await_peer(h, job, 0, 10000);
    REQUIRE(to >= 0);
    size_t n = 3u << 20;
    uint8_t *m = malloc(n);
    REQUIRE(m);
    for (size_t i = 0; i < n; i++)
        m[i] = (uint8_t)(i * 131 + (i >> 12));
    REQUIRE(ivshm_send(h, to, 9, m, n) == 0);
    REQUIRE(ivshm_send(h, to, 10, "end", 3) == 0);
    free(m);
    /* stay until the receiver has everything */
    char c;
    REQUIRE(ivshm_recv(h, to, NULL, NULL, &c, 1, 10000) == 1);
    ivshm_detach(h);
    return 0;
}

static void test_poll_stream(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 4096};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *h = tu_attach(path, job, 0, 0);
    pid_t pid = tu_fork(stream_child, NULL);
    int src = tu_await_peer(h, job, 1, 10000);
    CHECK(src >= 0);
    size_t n = 3u << 20;
    uint8_t *bufs[2] = {malloc(n), malloc(n)};
    CHECK(bufs[0] && bufs[1]);
    ssize_t rc = -EAGAIN;
    uint32_t tag = 0;
    unsigned calls = 0;
    uint64_t end = tu_now_ms() + 60000;
    while (rc == -EAGAIN && tu_now_ms() < end) {
        rc = ivshm_recv(h, src, NULL, &tag, bufs[calls & 1], n, 0);
        calls++;
    }
    CHECK_RC(rc, (ssize_t)n);
    CHECK(calls > 2); /* it really was resumed */
    const uint8_t *m = bufs[(calls - 1) & 1];
    bool ok = tag == 9;
    for (size_t i = 0; i < n && ok; i++)
        ok = m[i] == (uint8_t)(i * 131 + (i >> 12));
    CHECK(ok);
    char end_msg[8];
    CHECK_RC(ivshm_recv(h, src, NULL, &tag, end_msg, sizeof end_msg, 5000), 3);
    CHECK_RC(ivshm_send(h, src, 0, "k", 1), 0);
    CHECK(tu_wait(pid, 10000) == 0);
    free(bufs[0]);
    free(bufs[1]);
    ivshm_detach(h);
}

/* ---- attack 7: the ring's tail rewound ---- */

struct rewinder {
    _Atomic uint64_t *tail;
    uint64_t value;
    atomic_bool stop;
};

static void *rewind_tail(void *arg)
{
    struct rewinder *r = arg;
    while (!atomic_load(&r->stop)) {
        atomic_store(r->tail, r->value);
        sched_yield();
    }
    return NULL;
}

struct blocked_send {
    ivshm *h;
    int to;
    int rc;
    atomic_bool done;
};

static void *do_send(void *arg)
{
    struct blocked_send *s = arg;
    s->rc = ivshm_send(s->h, s->to, 3, "late", 4);
    atomic_store(&s->done, true);
    return NULL;
}

static void test_tail_rewind(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *a = tu_attach(path, job, 0, 0), *b = tu_attach(path, job, 1, 0);
    int sa = ivshm_self(a), sb = ivshm_self(b);
    CHECK_RC(ivshm_fast_open(a, sb), 0);
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(a, sa, sb);
    char in[8];
    /* fill the ring, the receiver drains it all */
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_send(a, sb, 0, "x", 1), 0);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, in, sizeof in, 0), 1);

    /* one write rewinds the tail to "full"; a hostile thread keeps it so */
    struct rewinder r = {.tail = &ctrl->tail, .value = 0};
    atomic_init(&r.stop, false);
    /* rewound before the thread runs: on a loaded host it may not get a
       CPU before our send looks at the tail */
    atomic_store(&ctrl->tail, r.value);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, rewind_tail, &r) == 0);
    uint64_t t0 = tu_now_ms();
    CHECK_RC(ivshm_send_timeout(a, sb, 0, "x", 1, 100), -ETIMEDOUT);
    uint64_t el = tu_now_ms() - t0;
    CHECK(el >= 95 && el < 3000);
    /* a message longer than the ring streams: the deadline still holds */
    static uint8_t big[8 * 256];
    t0 = tu_now_ms();
    CHECK_RC(ivshm_send_timeout(a, sb, 0, big, sizeof big, 100), -ETIMEDOUT);
    el = tu_now_ms() - t0;
    CHECK(el >= 95 && el < 3000);
    CHECK_RC(ivshm_send_timeout(a, sb, 0, "x", 1, 0), -EAGAIN);
    atomic_store(&r.stop, true);
    pthread_join(th, NULL);

    /* Without a deadline: the consumer's next receive finds its ring
       empty, puts its tail back and wakes the sender. */
    struct blocked_send bs = {.h = a, .to = sb, .rc = 1};
    atomic_init(&bs.done, false);
    atomic_store(&ctrl->tail, 0);
    pthread_t st;
    CHECK(pthread_create(&st, NULL, do_send, &bs) == 0);
    tu_sleep_ms(30);
    CHECK(!atomic_load(&bs.done)); /* blocked on the rewound tail */
    uint32_t tag = 0;
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 5000), 4);
    CHECK(tag == 3 && memcmp(in, "late", 4) == 0);
    pthread_join(st, NULL);
    CHECK_RC(bs.rc, 0);

    /* A receiver that polls with ivshm_recv_idle first (the BTL's
       progress) peeks fully at least every 64th poll, and that peek
       heals the tail too. */
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_send(a, sb, 0, "w", 1), 0);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, in, sizeof in, 0), 1);
    atomic_store(&ctrl->tail, atomic_load(&ctrl->tail) - 8);
    atomic_init(&bs.done, false);
    bs.rc = 1;
    CHECK(pthread_create(&st, NULL, do_send, &bs) == 0);
    tu_sleep_ms(30);
    CHECK(!atomic_load(&bs.done)); /* blocked on the rewound tail */
    t0 = tu_now_ms();
    int got = 0;
    while (!got && tu_now_ms() - t0 < 5000) {
        const void *data;
        int from;
        if (ivshm_recv_idle(b))
            continue;
        if (ivshm_recv_peek(b, IVSHM_ANY, &from, NULL, &data) == 4) {
            got = memcmp(data, "late", 4) == 0;
            CHECK_RC(ivshm_recv_release(b, from), 0);
        }
    }
    CHECK(got);
    pthread_join(st, NULL);
    CHECK_RC(bs.rc, 0);

    /* A tail below one the sender saw before is proof of tampering. */
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_send(a, sb, 0, "y", 1), 0);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, in, sizeof in, 0), 1);
    CHECK_RC(ivshm_send(a, sb, 0, "y", 1), 0); /* reads tail 17 */
    atomic_store(&ctrl->tail, 12);             /* plausible, but rewound */
    for (int i = 0; i < 7; i++)
        CHECK_RC(ivshm_try_send(a, sb, 0, "z", 1), 0);
    t0 = tu_now_ms();
    CHECK_RC(ivshm_send(a, sb, 0, "z", 1), IVSHM_ECORRUPT);
    CHECK(tu_now_ms() - t0 < 1000);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* ---- attack 8: garbage in exactly what ivshm_recv_idle reads ---- */

/* ivshm_recv_idle loads the seq of the head slot of each active fast
   ring and our queue head cell's seq and enqueue_pos. Here a hostile
   PROCESS of the same job keeps writing garbage there (and rewinds a
   ring tail) while two honest processes send, one on a fast ring, one
   through the queue, and the receiver polls idle-then-peek as the BTL's
   progress does. */

enum { IS_RING = 0, IS_QUEUE = 1, IS_N = 2 };
#define IS_LEN 48u
#define IS_TAG 0x1d1e0000u
/* hostile modes, counted in the board */
enum {
    HM_RING_EMPTY, /* garbage "empty" seq at the ring head (CAS on free) */
    HM_RING_FULL,  /* a forged slot published at the ring head           */
    HM_RING_HIDE,  /* the message at the ring head made to look empty    */
    HM_TAIL,       /* ring tail rewound                                   */
    HM_Q_GARBAGE,  /* garbage seq in a free queue head cell               */
    HM_Q_FULL,     /* a forged cell at the queue head                     */
    HM_Q_EMPTY,    /* a full queue head cell made free, enqueue_pos too   */
    HM_ENQ,        /* garbage enqueue_pos                                 */
    HM_N
};

struct idle_board {
    _Atomic int phase;         /* 0: hostile at work; 1: it is dead     */
    _Atomic uint32_t sent[IS_N];       /* messages sent (send returned 0) */
    _Atomic uint32_t phase2_first[IS_N]; /* first index sent in phase 1: set
                                            before it is sent, else MAX */
    _Atomic uint32_t done[IS_N];
    _Atomic uint32_t refused[IS_N];    /* -ETIMEDOUT / ECORRUPT: sent again */
    _Atomic uint32_t refused_dead[IS_N]; /* ECORRUPT after the death: a tail
                                            it left behind, sent again   */
    _Atomic uint32_t bad_rc[IS_N];     /* any other result                */
    _Atomic uint32_t late[IS_N];       /* a call outlived its deadline    */
    _Atomic uint64_t max_call_ms[IS_N];
    _Atomic uint64_t max_dead_ms[IS_N]; /* after the death: a message's
                                           first try to its send       */
    _Atomic uint64_t hits[HM_N];       /* hostile writes that landed      */
};

static struct idle_board *board;

static void is_fill(uint8_t *m, int who, uint32_t i)
{
    memset(m, 0, IS_LEN);
    uint32_t w = (uint32_t)who, chk = i * 2654435761u ^ (w + 1) * 40503u;
    memcpy(m, &w, 4);
    memcpy(m + 4, &i, 4);
    memcpy(m + 8, &chk, 4);
    for (uint32_t k = 12; k < IS_LEN; k++)
        m[k] = (uint8_t)(chk + k);
}

/* Is `m` (a private copy) honest message i of `who`? */
static bool is_honest(const uint8_t *m, uint32_t len, uint32_t tag, int who,
                      uint32_t *index)
{
    if (len != IS_LEN || tag != IS_TAG + (uint32_t)who)
        return false;
    uint32_t i;
    memcpy(&i, m + 4, 4);
    uint8_t want[IS_LEN];
    is_fill(want, who, i);
    if (memcmp(m, want, IS_LEN) != 0)
        return false;
    *index = i;
    return true;
}

static void note_max(_Atomic uint64_t *m, uint64_t v)
{
    uint64_t old = atomic_load(m);
    while (v > old && !atomic_compare_exchange_weak(m, &old, v))
        ;
}

/* An honest sender: while the hostile one works, each send has a 100 ms
   deadline and is sent again when refused (a message that fits the ring
   is all or nothing); once it is dead, 100 more with 5 s each, which
   must all go through. A send that loads a tail the hostile process wrote
   just before its death is refused at once (IVSHM_ECORRUPT, nothing sent,
   as ivshm.h documents) until the receiver puts the tail back or, if it
   is ahead of our head, it has stood 200 ms: sent again within the same
   5 s, as tail_sender does. */
static int idle_sender(void *arg)
{
    int who = (int)(intptr_t)arg;
    if (who == IS_QUEUE) /* stays on the receiver's queue */
        setenv("IVSHM_FAST_AFTER", "1000000000", 1);
    ivshm *h = tu_attach(path, job, 1 + (uint32_t)who, 0);
    int to = tu_await_peer(h, job, 0, 10000);
    REQUIRE(to >= 0);
    uint8_t m[IS_LEN];
    uint32_t i = 0, end = UINT32_MAX;
    uint64_t msg_t0 = tu_now_ms(); /* when message i was first tried */
    while (i < end) {
        int phase = atomic_load(&board->phase);
        if (phase >= 1 && end == UINT32_MAX) {
            atomic_store(&board->phase2_first[who], i);
            end = i + 100;
        }
        const int timeout = phase ? 5000 : 100;
        is_fill(m, who, i);
        uint64_t t0 = tu_now_ms();
        int rc = ivshm_send_timeout(h, to, IS_TAG + (uint32_t)who, m, IS_LEN,
                                    timeout);
        uint64_t el = tu_now_ms() - t0;
        note_max(&board->max_call_ms[who], el);
        if (el > (uint64_t)timeout + 2000)
            atomic_fetch_add(&board->late[who], 1);
        if (rc == 0) {
            if (phase)
                note_max(&board->max_dead_ms[who], tu_now_ms() - msg_t0);
            atomic_store(&board->sent[who], ++i);
            msg_t0 = tu_now_ms();
        } else if (phase == 0 && (rc == -ETIMEDOUT || rc == IVSHM_ECORRUPT)) {
            atomic_fetch_add(&board->refused[who], 1);
        } else if (phase && rc == IVSHM_ECORRUPT &&
                   tu_now_ms() - msg_t0 < (uint64_t)timeout) {
            atomic_fetch_add(&board->refused_dead[who], 1);
            sched_yield(); /* returned at once: no busy loop */
        } else {
            fprintf(stderr, "idle sender %d: message %u: %s (phase %d)\n",
                    who, i, ivshm_strerror(rc), phase);
            atomic_fetch_add(&board->bad_rc[who], 1);
            if (phase)
                break;
        }
    }
    atomic_store(&board->done[who], 1);
    /* stay attached until the receiver has looked at everything: a
       departed sender's ring is drained, but its slot could be reused */
    while (atomic_load(&board->phase) != 2)
        tu_sleep_ms(5);
    ivshm_detach(h);
    return 0;
}

struct idle_targets {
    int r, s_ring, s_queue;
    uint32_t gen_ring, gen_queue;
};

/* The hostile co-tenant: a peer of the job (rank 3) writing, in turns,
   garbage into the head slot of the ring from s_ring, the receiver's
   queue head cell and enqueue_pos, and the ring's tail. It runs until
   SIGKILL. */
static int idle_hostile(void *arg)
{
    const struct idle_targets *t = arg;
    ivshm *h = tu_attach(path, job, 3, 0);
    const int r = t->r, me = ivshm_self(h);
    uint8_t *ring = NULL;
    while (!(ring = ivshm_fast_ring_of(h, t->s_ring, r)))
        tu_sleep_ms(1);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, r);
    const uint64_t S = h->ring_slots, Q = h->queue_slots;
    const uint32_t pl = h->slot_size - IVSHM_SLOT_HDR;
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    for (unsigned n = 0;; n++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (n % 64 == 0)
            tu_sleep_ms(1); /* leave the honest ones a CPU, too */
        int mode = (int)(x % HM_N);
        /* the receiver's published positions: where it looks next */
        uint64_t tail = atomic_load(&ctrl->tail);
        struct ivshm_slot *s =
            (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                  (tail & (S - 1)) * h->slot_size);
        uint64_t v = atomic_load(&s->seq);
        uint64_t qpos = atomic_load(&qc->head);
        struct ivshm_cell *c = ivshm_qcell(h, r, qpos);
        uint64_t cv = atomic_load(&c->seq);
        bool landed = false;
        switch (mode) {
        case HM_RING_EMPTY: {
            /* only a slot no position >= tail is published in (v <= tail):
               one the producer writes later, with one store */
            const uint64_t junk[] = {tail, tail + 2, ~0ull, tail - S + 1,
                                     0x5a5a5a5a5a5a5a5aull};
            if (v <= tail)
                landed = atomic_compare_exchange_strong(&s->seq, &v,
                                                        junk[(x >> 8) % 5]);
            break;
        }
        case HM_RING_FULL: {
            /* a slot that says "full" at the receiver's position, at most
               one ahead of what the producer published, so the pair can
               catch up; its header is garbage the receiver must report
               (bad flags, a multi-slot FIRST, an oversized length) or a
               plausible header over garbage bytes */
            uint64_t head = atomic_load(&ctrl->head);
            if (v > tail || tail > head)
                break;
            unsigned kind = (unsigned)(x >> 8) % 4;
            s->gen = t->gen_ring;
            s->tag = kind == 3 ? IS_TAG + IS_RING : 0xbad;
            s->flags = kind == 0 ? 0x40 | SLOT_FIRST | SLOT_LAST
                       : kind == 1 ? SLOT_FIRST
                                   : SLOT_FIRST | SLOT_LAST;
            s->len = kind == 2 ? 0xffffff00u : kind == 1 ? pl : IS_LEN;
            s->total = kind == 1 ? 1ull << 40 : kind == 2 ? 0xffffff00u : IS_LEN;
            memset((uint8_t *)s + IVSHM_SLOT_HDR, 0xee, IS_LEN);
            landed = atomic_compare_exchange_strong(&s->seq, &v, tail + 1);
            break;
        }
        case HM_RING_HIDE:
            /* the receiver finds it again (rx_heal_hidden): not lost */
            if (v == tail + 1)
                landed = atomic_compare_exchange_strong(&s->seq, &v, tail);
            break;
        case HM_TAIL: {
            /* backwards only: the ring looks fuller than it is */
            uint64_t k = 1 + (x >> 8) % S;
            if (tail >= k)
                landed = atomic_compare_exchange_strong(&ctrl->tail, &tail,
                                                        tail - k);
            break;
        }
        case HM_Q_GARBAGE: {
            /* values no producer writes, a claim naming no slot, a claim
               in another generation of the queue sender */
            const uint64_t junk[] = {qpos + 12345, ~0ull,
                                     ivshm_claim_word(qpos, 1000, 1),
                                     ivshm_claim_word(qpos, t->s_queue,
                                                      t->gen_queue + 5)};
            if (cv == qpos)
                landed = atomic_compare_exchange_strong(&c->seq, &cv,
                                                        junk[(x >> 8) % 4]);
            break;
        }
        case HM_Q_FULL: {
            /* claimed as a producer would, so no honest cell is touched;
               then published naming the queue sender (plausible or bad
               flags) or a slot that does not exist */
            if (cv != qpos ||
                !atomic_compare_exchange_strong(
                    &c->seq, &cv, ivshm_claim_word(qpos, me, h->self_gen)))
                break;
            unsigned kind = (unsigned)(x >> 8) % 3;
            c->src = kind == 2 ? 1000 : (uint16_t)t->s_queue;
            c->gen = t->gen_queue;
            c->tag = IS_TAG + IS_QUEUE;
            c->flags = kind == 1 ? 0x40 | SLOT_FIRST | SLOT_LAST
                                 : SLOT_FIRST | SLOT_LAST;
            c->len = IS_LEN;
            c->total = IS_LEN;
            memset((uint8_t *)c + IVSHM_SLOT_HDR, 0xdd, IS_LEN);
            atomic_store(&c->seq, qpos + 1);
            landed = true;
            break;
        }
        case HM_Q_EMPTY:
            /* a message at the head vanishes: cell and enqueue_pos say
               "empty" (counted: that message is lost) */
            if (cv == qpos + 1) {
                landed = atomic_compare_exchange_strong(&c->seq, &cv, qpos);
                atomic_store(&qc->enqueue_pos, qpos);
            }
            break;
        case HM_ENQ: {
            const uint64_t junk[] = {qpos + Q + 7, ~0ull >> 1, qpos - 3,
                                     qpos + 1 + (x >> 20) % Q};
            atomic_store(&qc->enqueue_pos, junk[(x >> 8) % 4]);
            landed = true;
            break;
        }
        }
        if (landed)
            atomic_fetch_add(&board->hits[mode], 1);
    }
    return 0; /* not reached: SIGKILL ends it */
}

/* Every message the receiver meets: honest (in order, intact), forged
   (delivered, but not the sender's next message), or reported. */
struct idle_tally {
    uint32_t next[IS_N];      /* next index expected (last honest + 1) */
    uint32_t honest[IS_N];
    uint32_t phase2_honest[IS_N]; /* of those sent after the hostile died */
    uint32_t forged[IS_N], corrupt[IS_N];
    uint32_t other_src, bad_rc, release_bad, unheard;
};

static void idle_take(struct idle_tally *t, const struct idle_targets *tg,
                      int src, uint32_t tag, const uint8_t *m, ssize_t len)
{
    int who = src == tg->s_ring ? IS_RING : src == tg->s_queue ? IS_QUEUE : -1;
    if (who < 0) {
        t->unheard++; /* listen_only: nobody else is ever delivered */
        return;
    }
    uint32_t i;
    if (len >= 0 && is_honest(m, (uint32_t)len, tag, who, &i) &&
        i >= t->next[who]) {
        t->honest[who]++;
        /* the sender stored this before it sent message i, so a message
           of phase 2 finds it stored */
        t->phase2_honest[who] += i >= atomic_load(&board->phase2_first[who]);
        t->next[who] = i + 1;
    } else {
        t->forged[who]++;
    }
}

static void test_idle_scribble(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256,
                        .queue_slots = 8};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    board = mmap(NULL, sizeof *board, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(board != MAP_FAILED);
    memset(board, 0, sizeof *board);
    for (int w = 0; w < IS_N; w++)
        atomic_store(&board->phase2_first[w], UINT32_MAX);
    ivshm *r = tu_attach(path, job, 0, -1); /* spins, as the BTL's rank */
    pid_t senders[IS_N];
    for (int w = 0; w < IS_N; w++)
        senders[w] = tu_fork(idle_sender, (void *)(intptr_t)w);
    struct idle_targets tg = {.r = ivshm_self(r)};
    tg.s_ring = tu_await_peer(r, job, 1, 10000);
    tg.s_queue = tu_await_peer(r, job, 2, 10000);
    CHECK(tg.s_ring >= 0 && tg.s_queue >= 0);
    ivshm_peer_info pi;
    CHECK_RC(ivshm_peer(r, tg.s_ring, &pi), 0);
    tg.gen_ring = pi.generation;
    CHECK_RC(ivshm_peer(r, tg.s_queue, &pi), 0);
    tg.gen_queue = pi.generation;
    /* the BTL hears only the ranks it verified */
    CHECK_RC(ivshm_listen_only(r, 1), 0);
    CHECK_RC(ivshm_listen(r, tg.s_ring, tg.gen_ring), 0);
    CHECK_RC(ivshm_listen(r, tg.s_queue, tg.gen_queue), 0);
    pid_t hostile = tu_fork(idle_hostile, &tg);

    struct idle_tally t = {0};
    unsigned run = 0, max_run = 0, run_there = 0, max_run_there = 0;
    uint64_t polls = 0, peeks = 0, max_call_ns = 0;
    const uint64_t start = tu_now_ms();
    uint64_t phase1_end = start + 3000, end = start + 60000;
    bool killed = false, finished = false;
    uint8_t m[IS_LEN];
    while (tu_now_ms() < end) {
        if ((++polls & 255) == 0) {
            sched_yield();
            if (!killed && tu_now_ms() >= phase1_end) {
                /* the hostile process dies, in the middle of whatever it
                   was writing */
                CHECK(kill(hostile, SIGKILL) == 0);
                CHECK(tu_wait(hostile, 5000) == -1);
                CHECK(kill(hostile, 0) == -1 && errno == ESRCH);
                killed = true;
                atomic_store(&board->phase, 1);
            }
            if (killed && atomic_load(&board->done[0]) &&
                atomic_load(&board->done[1]) &&
                t.next[0] >= atomic_load(&board->sent[0]) &&
                t.next[1] >= atomic_load(&board->sent[1])) {
                finished = true;
                break;
            }
        }
        if (ivshm_recv_idle(r)) {
            run++;
            if (run > max_run)
                max_run = run;
            /* is there something at a head all the same? (our own look,
               after the call's: a message that arrived in between is
               counted once) */
            bool there = false;
            for (int x = 0; x < r->n_act; x++) {
                struct ivshm_peer_local *p = &r->peers[r->act[x]];
                struct ivshm_slot *s =
                    (struct ivshm_slot *)(p->rx_ring + IVSHM_RING_CTRL +
                                          (p->rx_tail & (r->ring_slots - 1)) *
                                              r->slot_size);
                there |= atomic_load(&s->seq) == p->rx_tail + 1;
            }
            there |= atomic_load(&ivshm_my_qcell(r, r->q_head)->seq) ==
                     r->q_head + 1;
            run_there = there ? run_there + 1 : 0;
            if (run_there > max_run_there)
                max_run_there = run_there;
            continue;
        }
        run = run_there = 0;
        peeks++;
        const void *data = NULL;
        int src = -1;
        uint32_t tag = 0;
        uint64_t t0 = tu_now_ns();
        ssize_t rc = ivshm_recv_peek(r, IVSHM_ANY, &src, &tag, &data);
        if (rc >= 0) {
            /* shared bytes: copy, then check the copy */
            memset(m, 0, sizeof m);
            memcpy(m, data, (size_t)rc < sizeof m ? (size_t)rc : sizeof m);
            if (ivshm_recv_release(r, src) != 0)
                t.release_bad++;
            idle_take(&t, &tg, src, tag, m, rc);
        } else if (rc == -EMSGSIZE) {
            /* the BTL's way with a multi-slot message: a polling recv */
            ssize_t n = ivshm_recv(r, src, NULL, &tag, m, sizeof m, 0);
            if (n >= 0)
                idle_take(&t, &tg, src, tag, m, n);
            else if (n == IVSHM_ECORRUPT && ivshm_slot_ok(r, src))
                t.corrupt[src == tg.s_ring ? IS_RING : IS_QUEUE]++;
            else if (n != -EAGAIN)
                t.bad_rc++;
        } else if (rc == IVSHM_ECORRUPT) {
            if (src == tg.s_ring)
                t.corrupt[IS_RING]++;
            else if (src == tg.s_queue)
                t.corrupt[IS_QUEUE]++;
            else
                t.other_src++;
        } else if (rc != -EAGAIN) {
            fprintf(stderr, "idle scribble: peek: %s\n", ivshm_strerror((int)rc));
            t.bad_rc++;
        }
        uint64_t el = tu_now_ns() - t0;
        if (el > max_call_ns)
            max_call_ns = el;
    }
    if (!killed) {
        kill(hostile, SIGKILL);
        tu_wait(hostile, 5000);
    }
    atomic_store(&board->phase, 2);
    for (int w = 0; w < IS_N; w++)
        CHECK(tu_wait(senders[w], 10000) == 0);

    ivshm_stats st;
    ivshm_get_stats(r, &st);
    printf("idle scribble: %llu polls, %llu peeks, longest idle run %u "
           "(%u with a message there), longest peek %.1f ms, %llu dropped\n",
           (unsigned long long)polls, (unsigned long long)peeks, max_run,
           max_run_there, max_call_ns / 1e6, (unsigned long long)st.dropped);
    static const char *const hm_name[HM_N] = {
        "ring-empty", "ring-full", "ring-hide", "tail", "q-garbage", "q-full",
        "q-empty",
        "enqueue_pos"};
    printf("idle scribble: hostile writes:");
    for (int k = 0; k < HM_N; k++)
        printf(" %s %llu", hm_name[k],
               (unsigned long long)atomic_load(&board->hits[k]));
    printf("\n");
    for (int w = 0; w < IS_N; w++) {
        uint32_t sent = atomic_load(&board->sent[w]);
        uint32_t p2 = atomic_load(&board->phase2_first[w]);
        uint32_t lost = sent - t.honest[w];
        printf("idle scribble: %s sender: %u sent (%u in phase 2), %u refused "
               "and sent again (%u after the death, the longest for %llu ms), "
               "longest send %llu ms; %u honest, %u lost, %u forged, "
               "%u corrupt\n",
               w == IS_RING ? "ring" : "queue", sent, sent - p2,
               atomic_load(&board->refused[w]),
               atomic_load(&board->refused_dead[w]),
               (unsigned long long)atomic_load(&board->max_dead_ms[w]),
               (unsigned long long)atomic_load(&board->max_call_ms[w]),
               t.honest[w], lost, t.forged[w], t.corrupt[w]);
        CHECK(atomic_load(&board->bad_rc[w]) == 0);
        CHECK(atomic_load(&board->late[w]) == 0);
        CHECK(sent > p2 && sent - p2 == 100); /* phase 2: all went through */
        /* every message lost was reported in its place: a forged one
           delivered, IVSHM_ECORRUPT, or (queue) one the hostile process
           made vanish */
        uint64_t gone = w == IS_QUEUE ? atomic_load(&board->hits[HM_Q_EMPTY])
                                      : 0;
        CHECK(lost <= t.forged[w] + t.corrupt[w] + gone);
        /* once the hostile process is dead, at most what it left at the
           head costs a message */
        CHECK(t.phase2_honest[w] + 1 >= sent - p2);
        CHECK(t.next[w] == sent); /* the last one arrived */
    }
    CHECK(finished);
    CHECK(max_run <= 63);       /* every 64th poll peeks */
    CHECK(max_run_there <= 64); /* never blind to a message at a head */
    CHECK(max_call_ns < 1000000000ull);
    CHECK(t.bad_rc == 0 && t.release_bad == 0 && t.other_src == 0);
    CHECK(t.unheard == 0);
    /* the dead hostile peer is found dead and its slot reclaimed */
    CHECK(TU_EVENTUALLY(ivshm_reap(r) >= 0 && ivshm_find(r, job, 3) < 0, 5000));
    ivshm_detach(r);
    munmap(board, sizeof *board);
    board = NULL;
}

/* ---- attack 9: a published message made to look empty ---- */

/* A co-tenant rewrites the seq of a slot the producer published back to
   an "empty" value: nothing in the slot tells it from an empty one, so
   the receiver would wait there for good, and the producer, once the
   ring is full, too; the pair never recovered. The producer's published
   head tells (rx_heal_hidden). Processes: the receiver (us), an honest
   sender and a hostile one, driven step by step through pipes. */

struct hide_pipes {
    int cmd[2], ack[2]; /* to the child / back */
};

/* One step of a child, acknowledged within 20 s (a child that died or
   hangs fails the step instead of holding us). */
static void hide_ack(struct hide_pipes *p, char c)
{
    char a = 0;
    struct pollfd pf = {.fd = p->ack[0], .events = POLLIN};
    CHECK(poll(&pf, 1, 20000) == 1 && read(p->ack[0], &a, 1) == 1 && a == c);
}

static void hide_step(struct hide_pipes *p, char c)
{
    CHECK(write(p->cmd[1], &c, 1) == 1);
    hide_ack(p, c);
}

/* A step that needs us to receive meanwhile: acknowledged later. */
static void hide_start(struct hide_pipes *p, char c)
{
    CHECK(write(p->cmd[1], &c, 1) == 1);
}

/* A message of three fragments (slots of 256 bytes): its number, then
   bytes that depend on it. */
#define HIDE_LONG 600
#define HIDE_LONG_TAG 41

static void hide_long_fill(uint8_t *m, uint32_t n)
{
    memcpy(m, &n, sizeof n);
    for (uint32_t i = sizeof n; i < HIDE_LONG; i++)
        m[i] = (uint8_t)(n * 7 + i);
}

/* Sender: 'a' .. 'z' sends that many messages (1 .. 26), numbered on;
   'M' one long message (HIDE_LONG), numbered on; 'R' one message,
   sending it again while the send says IVSHM_ECORRUPT (at most 5 s).
   It leaves (detaches) when the receiver closes the command pipe. */
static int hide_sender(void *arg)
{
    struct hide_pipes *p = arg;
    close(p->cmd[1]); /* our reads end when the receiver closes it */
    ivshm *h = tu_attach(path, job, 1, 0);
    int r = tu_await_peer(h, job, 0, 10000);
    REQUIRE(r >= 0);
    uint32_t next = 0;
    char c;
    while (read(p->cmd[0], &c, 1) == 1) {
        if (c == 'M') {
            uint8_t m[HIDE_LONG];
            hide_long_fill(m, next++);
            REQUIRE(ivshm_send_timeout(h, r, HIDE_LONG_TAG, m, sizeof m,
                                       10000) == 0);
        } else if (c == 'R') {
            uint64_t t0 = tu_now_ms();
            int rc;
            while ((rc = ivshm_send_timeout(h, r, 40, &next, sizeof next,
                                            10000)) == IVSHM_ECORRUPT &&
                   tu_now_ms() - t0 < 5000)
                tu_sleep_ms(10);
            REQUIRE(rc == 0);
            next++;
        }
        for (int k = 0; k <= c - 'a'; k++, next++)
            REQUIRE(ivshm_send_timeout(h, r, 40, &next, sizeof next, 10000) ==
                    0);
        REQUIRE(write(p->ack[1], &c, 1) == 1);
    }
    ivshm_detach(h);
    return 0;
}

/* Hostile: 'h' waits for the message at the receiver's tail and makes it
   look empty; 'C' does so with the slot after the tail (a long message's
   second fragment); 'f' forges the producer's head one past the tail;
   'F' writes the tail forward to the producer's head (what the receiver
   has not read looks consumed); 'L' writes the head back to 0; 'E' forges a message (number
   HIDE_FORGED) at the tail, and 'X' later makes its slot say "empty"
   (the evidence of what the receiver took is gone); 'o' makes the
   sender's OPEN cell vanish from the receiver's queue (cell and
   enqueue_pos say "empty"). */
#define HIDE_FORGED 0xfeedbeefu
static int hide_hostile(void *arg)
{
    struct hide_pipes *p = arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    int r = tu_await_peer(h, job, 0, 10000), s = tu_await_peer(h, job, 1, 10000);
    REQUIRE(r >= 0 && s >= 0);
    char c;
    struct ivshm_slot *forged = NULL;
    while (read(p->cmd[0], &c, 1) == 1) {
        uint8_t *ring = ivshm_fast_ring_of(h, s, r);
        REQUIRE(ring);
        struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
        uint64_t tail = atomic_load(&ctrl->tail);
        uint64_t at = c == 'C' ? tail + 1 : tail;
        struct ivshm_slot *sl =
            (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                  (at & (h->ring_slots - 1)) * h->slot_size);
        if (c == 'C') {
            REQUIRE(TU_EVENTUALLY(atomic_load(&sl->seq) == at + 1, 5000));
            atomic_store(&sl->seq, at);
        } else if (c == 'L') {
            atomic_store(&ctrl->head, 0);
        } else if (c == 'F') {
            atomic_store(&ctrl->tail, atomic_load(&ctrl->head));
        } else if (c == 'E') {
            uint32_t v = HIDE_FORGED;
            sl->len = sizeof v;
            sl->tag = 40;
            sl->gen = atomic_load(&ivshm_entry(h, s)->gen);
            sl->flags = SLOT_FIRST | SLOT_LAST;
            sl->total = sizeof v;
            memcpy((uint8_t *)sl + IVSHM_SLOT_HDR, &v, sizeof v);
            atomic_store(&sl->seq, tail + 1);
            forged = sl;
        } else if (c == 'X') {
            REQUIRE(forged);
            atomic_store(&forged->seq, 0);
        } else if (c == 'o') {
            struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, r);
            uint64_t pos = atomic_load(&qc->head);
            struct ivshm_cell *cell = ivshm_qcell(h, r, pos);
            REQUIRE(TU_EVENTUALLY(atomic_load(&cell->seq) == pos + 1, 5000));
            REQUIRE(cell->flags & CELL_OPEN);
            atomic_store(&cell->seq, pos);
            atomic_store(&qc->enqueue_pos, pos);
        } else if (c == 'h') {
            REQUIRE(TU_EVENTUALLY(atomic_load(&sl->seq) == tail + 1, 5000));
            atomic_store(&sl->seq, tail);
        } else {
            atomic_store(&ctrl->head, tail + 1);
        }
        REQUIRE(write(p->ack[1], &c, 1) == 1);
    }
    for (;;)
        pause(); /* until SIGKILL */
}

/* The receiver (us, rank 0), a hide_sender and a hide_hostile process
   on a fresh region, driven through pipes. */
struct hide_run {
    ivshm *r;
    int s; /* the sender's slot */
    struct hide_pipes sp, hp;
    pid_t sender, hostile;
};

static void hide_begin(struct hide_run *t, int64_t spin_ns)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    t->r = tu_attach(path, job, 0, spin_ns);
    CHECK(pipe(t->sp.cmd) == 0 && pipe(t->sp.ack) == 0 &&
          pipe(t->hp.cmd) == 0 && pipe(t->hp.ack) == 0);
    t->sender = tu_fork(hide_sender, &t->sp);
    t->hostile = tu_fork(hide_hostile, &t->hp);
    t->s = tu_await_peer(t->r, job, 1, 10000);
    CHECK(t->s >= 0 && tu_await_peer(t->r, job, 2, 10000) >= 0);
}

/* Kill the hostile process (it holds the sender's command pipe open
   too), then close that pipe: the sender detaches and exits. */
static void hide_kill_hostile(struct hide_run *t)
{
    CHECK(kill(t->hostile, SIGKILL) == 0);
    CHECK(tu_wait(t->hostile, 5000) == -1);
    t->hostile = -1;
}

static void hide_sender_leaves(struct hide_run *t)
{
    close(t->sp.cmd[1]);
    t->sp.cmd[1] = -1;
    CHECK(tu_wait(t->sender, 10000) == 0);
    t->sender = -1;
}

static void hide_end(struct hide_run *t)
{
    if (t->hostile > 0)
        hide_kill_hostile(t);
    if (t->sender > 0)
        hide_sender_leaves(t);
    int *fds[] = {t->sp.cmd, t->sp.ack, t->hp.cmd, t->hp.ack};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++)
            if (fds[i][j] >= 0)
                close(fds[i][j]);
    CHECK(TU_EVENTUALLY(ivshm_reap(t->r) >= 0 && ivshm_find(t->r, job, 2) < 0,
                        5000));
    ivshm_detach(t->r);
}

/* Poll as the BTL does until a message arrives or `ms` pass: its
   number, or -1. */
static int64_t idle_poll(ivshm *r, int ms, uint64_t *took_ms)
{
    uint64_t t0 = tu_now_ms();
    while (tu_now_ms() - t0 < (uint64_t)ms) {
        if (ivshm_recv_idle(r))
            continue;
        const void *data;
        int src;
        uint32_t tag;
        ssize_t rc = ivshm_recv_peek(r, IVSHM_ANY, &src, &tag, &data);
        if (rc == -EAGAIN)
            continue;
        uint32_t v = UINT32_MAX;
        if (rc == (ssize_t)sizeof v && tag == 40)
            memcpy(&v, data, sizeof v);
        if (rc >= 0)
            CHECK_RC(ivshm_recv_release(r, src), 0);
        *took_ms = tu_now_ms() - t0;
        return rc >= 0 ? (int64_t)v : rc;
    }
    *took_ms = tu_now_ms() - t0;
    return -1;
}

static void test_hidden_slot(void)
{
    struct hide_run t;
    hide_begin(&t, -1);
    ivshm *r = t.r;
    const int s = t.s;
    uint32_t v = 0;
    uint64_t took = 0;
    /* message 0 opens the fast ring, but its OPEN cell vanishes before
       we look: the sender is on a ring we were never told of, and its
       message arrives all the same (the sweep adopts the channel) */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'o');
    CHECK(idle_poll(r, 5000, &took) == 0);
    printf("hidden slot: lost OPEN: the ring's message after %llu ms\n",
           (unsigned long long)took);
    CHECK(ivshm_fast_ring_of(r, s, ivshm_self(r)) != NULL);

    /* polling idle-then-peek: message 1, hidden, is shown again */
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 0), -EAGAIN);
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    CHECK(idle_poll(r, 5000, &took) == 1);
    printf("hidden slot: shown to the poller after %llu ms\n",
           (unsigned long long)took);
    /* a blocking receive, from anyone and from the sender */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    uint64_t t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(r, IVSHM_ANY, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == 2);
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    /* a progress engine's long wait for "some message" sees it too
       (it waits in slices), then takes it */
    uint64_t t1 = tu_now_ms();
    CHECK_RC(ivshm_wait_message(r, 5000), 0);
    CHECK(tu_now_ms() - t1 < 2000);
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, -1), 4);
    CHECK(v == 3);
    printf("hidden slot: shown to blocking receives within %llu ms\n",
           (unsigned long long)(tu_now_ms() - t0));
    /* a full ring's worth and more goes through: the pair is in step */
    hide_start(&t.sp, 'l'); /* 4 .. 15 */
    for (uint32_t i = 4; i < 16; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == i);
    }
    hide_ack(&t.sp, 'l');

    /* A forged head: we take what lies in the slot (a message of the
       ring's last lap, replayed, or a stale one, dropped) and are one
       ahead of the producer, which follows (tail_ahead): at most the
       message it sent into the skipped position is lost. */
    hide_step(&t.hp, 'f');
    int64_t stale = idle_poll(r, 600, &took);
    CHECK(stale == -1 || (stale >= 0 && stale < 16)); /* nothing, or a replay */
    hide_start(&t.sp, 't'); /* 16 .. 35 */
    uint32_t got = 0, last = 15;
    bool in_order = true;
    while (last < 35) {
        ssize_t n = ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000);
        CHECK_RC(n, 4);
        if (n != 4)
            break;
        in_order &= v > last;
        last = v;
        got++;
    }
    CHECK(in_order && last == 35 && got >= 19);
    hide_ack(&t.sp, 't');
    hide_start(&t.sp, 'z'); /* 36 .. 61: nothing lost any more */
    for (uint32_t i = 36; i < 62; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == i);
    }
    hide_ack(&t.sp, 'z');
    printf("hidden slot: forged head: took %lld from the slot, then %u of 20 "
           "arrived, in order\n", (long long)stale, got);

    hide_end(&t);
}

/* ---- attack 10: what else one co-tenant write leaves in a pair ---- */

struct watchdog {
    pid_t victim;
    atomic_bool done;
};

/* A receive that hangs would hang the test: after 8 s its sender is
   killed (the checks on the elapsed time have failed by then). */
static void *watchdog_run(void *arg)
{
    struct watchdog *w = arg;
    uint64_t t0 = tu_now_ms();
    while (!atomic_load(&w->done) && tu_now_ms() - t0 < 8000)
        tu_sleep_ms(5);
    if (!atomic_load(&w->done))
        kill(w->victim, SIGKILL);
    return NULL;
}

static bool long_ok(const uint8_t *m, ssize_t n, uint32_t want)
{
    uint8_t e[HIDE_LONG];
    hide_long_fill(e, want);
    return n == HIDE_LONG && memcmp(m, e, HIDE_LONG) == 0;
}

/* A receive of `from` that blocks without deadline, bounded by a
   watchdog on the sender; its time in ms. */
static uint64_t guarded_recv(ivshm *r, int from, pid_t sender, uint8_t *m,
                             ssize_t *n)
{
    struct watchdog w = {.victim = sender};
    atomic_init(&w.done, false);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, watchdog_run, &w) == 0);
    uint64_t t0 = tu_now_ms();
    uint32_t tag = 0;
    *n = ivshm_recv(r, from, NULL, &tag, m, HIDE_LONG, -1);
    uint64_t el = tu_now_ms() - t0;
    atomic_store(&w.done, true);
    pthread_join(th, NULL);
    return el;
}

/* Poll as the BTL does (idle, peek, -EMSGSIZE: ivshm_recv(src, 0))
   until a long message arrives or `ms` pass: its length or error. */
static ssize_t idle_poll_long(ivshm *r, int ms, uint8_t *m, uint64_t *took)
{
    uint64_t t0 = tu_now_ms();
    ssize_t rc = -EAGAIN;
    while (tu_now_ms() - t0 < (uint64_t)ms) {
        if (ivshm_recv_idle(r))
            continue;
        const void *data;
        int src;
        rc = ivshm_recv_peek(r, IVSHM_ANY, &src, NULL, &data);
        if (rc == -EMSGSIZE)
            rc = ivshm_recv(r, src, NULL, NULL, m, HIDE_LONG, 0);
        if (rc != -EAGAIN)
            break;
    }
    *took = tu_now_ms() - t0;
    return rc;
}

/* A hidden continuation fragment, a ring tail written forward (within
   the producer's head, and past it), the hidden last message of a
   sender that left: each stalled a pair for good. Processes: the
   receiver (us), an honest sender and a hostile one. */
static void test_hostile_ring(void)
{
    struct hide_run t;
    hide_begin(&t, 0);
    ivshm *r = t.r;
    const int s = t.s;
    uint8_t m[HIDE_LONG];
    uint32_t v = 0, next = 0;
    uint64_t took = 0;
    ssize_t n;
    hide_step(&t.sp, 'a'); /* message 0 opens the fast ring */
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == next++);

    /* 1. A long message's second fragment made to look empty: a receive
       without deadline waited at it for good; now it is shown again
       within a 200 ms slice, intact. */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    took = guarded_recv(r, s, t.sender, m, &n);
    CHECK(long_ok(m, n, next++));
    CHECK(took < 3000);
    printf("hostile ring: hidden fragment, blocking receive: %llu ms\n",
           (unsigned long long)took);
    /* from anyone, with a deadline longer than a slice */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    uint64_t t0 = tu_now_ms();
    CHECK(long_ok(m, ivshm_recv(r, IVSHM_ANY, NULL, NULL, m, HIDE_LONG, 3000),
                  next++));
    CHECK(tu_now_ms() - t0 < 2500);
    /* a deadline shorter than a slice is kept, and the next receive
       finds the fragment shown again */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, m, HIDE_LONG, 50), -ETIMEDOUT);
    took = tu_now_ms() - t0;
    CHECK(took >= 45 && took < 2000);
    CHECK(long_ok(m, ivshm_recv(r, s, NULL, NULL, m, HIDE_LONG, 0), next++));
    /* a hidden message under receives with short deadlines, in a loop:
       the sweep comes by time, not only every 4096 empty polls */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    t0 = tu_now_ms();
    while ((n = ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 20)) ==
               -ETIMEDOUT &&
           tu_now_ms() - t0 < 3000)
        ;
    CHECK_RC(n, 4);
    CHECK(v == next++);
    /* polled as the BTL polls */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    n = idle_poll_long(r, 5000, m, &took);
    CHECK(long_ok(m, n, next++));
    printf("hostile ring: hidden fragment, poller: %llu ms\n",
           (unsigned long long)took);

    /* 2a. The tail written forward over 8 messages we had not read: the
       sender wrote 8 more over them. The 8 are lost (one IVSHM_ECORRUPT
       says so), the next 8 arrive in order, and the pair is in step. */
    hide_step(&t.sp, 'h'); /* 8: the ring is full */
    hide_step(&t.hp, 'F');
    hide_step(&t.sp, 'h'); /* 8 more, over the first 8 */
    next += 8;
    t0 = tu_now_ms();
    int src = -1;
    CHECK_RC(ivshm_recv(r, s, &src, NULL, &v, sizeof v, 5000),
             IVSHM_ECORRUPT);
    CHECK(src == s);
    took = tu_now_ms() - t0;
    for (int i = 0; i < 8; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_step(&t.sp, 'e'); /* 5 */
    for (int i = 0; i < 5; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    printf("hostile ring: tail written forward: reported after %llu ms, "
           "in step again\n", (unsigned long long)took);
    /* the same, and the producer's head written back: the sender's
       refused send shows the receiver its head again */
    hide_step(&t.sp, 'h');
    hide_step(&t.hp, 'F');
    hide_step(&t.sp, 'h');
    hide_step(&t.hp, 'L');
    next += 8;
    /* our ring looks empty: we put our tail back, so the sender's next
       send is refused, before any wait for room could show its head */
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 0), -EAGAIN);
    hide_start(&t.sp, 'R');
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000),
             IVSHM_ECORRUPT);
    for (int i = 0; i < 9; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_ack(&t.sp, 'R');

    /* 2b. We take a message forged at our position, then its slot is
       made to say "empty": the sender finds our tail past its head with
       no forged slot to explain it. It refused every send for good; now
       it follows a tail that stands. */
    hide_step(&t.sp, 'h'); /* 8: the sender's next send reads our tail */
    for (int i = 0; i < 8; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_step(&t.hp, 'E');
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == HIDE_FORGED);
    hide_step(&t.hp, 'X');
    t0 = tu_now_ms();
    hide_step(&t.sp, 'R');
    took = tu_now_ms() - t0;
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == next++);
    hide_start(&t.sp, 'l'); /* 12: more than a ring, in order */
    for (int i = 0; i < 12; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_ack(&t.sp, 'l');
    printf("hostile ring: tail past the head: the sender followed after "
           "%llu ms\n", (unsigned long long)took);

    /* 3. The sender's last message made to look empty, then the sender
       leaves: it is still delivered, then IVSHM_EPEERDEAD. */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    hide_kill_hostile(&t);
    hide_sender_leaves(&t);
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == next++);
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 1000),
             IVSHM_EPEERDEAD);
    hide_end(&t);
}

/* ---- attack 11: tails scribbled for a while, then the writer dies ---- */

struct tail_board {
    _Atomic int phase;         /* 0: hostile at work; 1: it is dead      */
    _Atomic uint32_t sent;     /* messages whose send returned 0         */
    _Atomic uint32_t p2_first; /* first number sent in phase 1           */
    _Atomic uint32_t refused;  /* sends refused (ECORRUPT, deadline)     */
    _Atomic uint32_t p2_bad;   /* phase 1 sends that did not go through  */
    _Atomic uint64_t hits;
};
static struct tail_board *tboard;

/* Sends numbered messages with 50 ms deadlines, again when refused; once
   the hostile is dead, 100 more, each of which must go through within
   5 s (a refusal may repeat for the 200 ms a tail past our head needs). */
static int tail_sender(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int r = tu_await_peer(h, job, 0, 10000);
    REQUIRE(r >= 0);
    uint32_t i = 0, end = UINT32_MAX;
    while (i != end) {
        if (end == UINT32_MAX && atomic_load(&tboard->phase) == 1) {
            atomic_store(&tboard->p2_first, i);
            end = i + 100;
        }
        uint64_t t0 = tu_now_ms();
        int rc;
        while ((rc = ivshm_send_timeout(h, r, 40, &i, sizeof i, 50)) != 0) {
            atomic_fetch_add(&tboard->refused, 1);
            if (rc == IVSHM_ECORRUPT) /* returned at once: no busy loop */
                sched_yield();
            if (end != UINT32_MAX && tu_now_ms() - t0 > 5000) {
                atomic_fetch_add(&tboard->p2_bad, 1);
                break;
            }
        }
        atomic_store(&tboard->sent, ++i);
    }
    ivshm_detach(h);
    return 0;
}

/* Writes the receiver's tail of the sender's ring: forward within the
   sender's head (it writes over what the receiver has not read), past
   the head, and back. */
static int tail_hostile(void *arg)
{
    const int *ids = arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    uint8_t *ring;
    while (!(ring = ivshm_fast_ring_of(h, ids[1], ids[0])))
        tu_sleep_ms(1);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    const uint64_t S = h->ring_slots;
    uint64_t x = 0x2545f4914f6cdd1dull ^ (uint64_t)getpid();
    for (unsigned n = 0;; n++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (n % 16 == 0)
            tu_sleep_ms(1);
        uint64_t tail = atomic_load(&ctrl->tail), head = atomic_load(&ctrl->head);
        uint64_t k = 1 + (x >> 8) % S, to;
        switch (x % 3) {
        case 0: to = head > tail ? tail + 1 + (x >> 16) % (head - tail) : tail;
                break;
        case 1: to = head + k; break;
        default: to = tail >= k ? tail - k : tail; break;
        }
        if (atomic_compare_exchange_strong(&ctrl->tail, &tail, to))
            atomic_fetch_add(&tboard->hits, 1);
    }
    return 0; /* not reached: SIGKILL ends it */
}

static void test_tail_scribble(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    tboard = mmap(NULL, sizeof *tboard, PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(tboard != MAP_FAILED);
    memset(tboard, 0, sizeof *tboard);
    ivshm *r = tu_attach(path, job, 0, 0);
    pid_t sender = tu_fork(tail_sender, NULL);
    int ids[2] = {ivshm_self(r), tu_await_peer(r, job, 1, 10000)};
    CHECK(ids[1] >= 0);
    pid_t hostile = tu_fork(tail_hostile, ids);
    uint32_t last = 0, got = 0, corrupt = 0, p2_got = 0, longest = 0;
    bool any = false;
    uint64_t t0 = tu_now_ms(), killed_at = 0;
    for (;;) {
        uint64_t now = tu_now_ms();
        if (!killed_at && now - t0 >= 2000) {
            CHECK(kill(hostile, SIGKILL) == 0);
            CHECK(tu_wait(hostile, 5000) == -1);
            atomic_store(&tboard->phase, 1);
            killed_at = tu_now_ms();
        }
        uint32_t v;
        uint64_t c0 = tu_now_ms();
        ssize_t rc = ivshm_recv(r, ids[1], NULL, NULL, &v, sizeof v, 20);
        uint64_t el = tu_now_ms() - c0;
        if (el > longest)
            longest = (uint32_t)el;
        if (rc == IVSHM_ECORRUPT)
            corrupt++;
        if (rc == 4) {
            got++;
            if (!any || v > last) /* else a replay of an earlier lap */
                last = v;
            any = true;
            uint32_t p2 = atomic_load(&tboard->p2_first);
            if (killed_at && p2 && v >= p2)
                p2_got++;
        }
        CHECK(rc == 4 || rc == -ETIMEDOUT || rc == IVSHM_ECORRUPT);
        if (killed_at && atomic_load(&tboard->p2_first) &&
            any && last + 1 == atomic_load(&tboard->p2_first) + 100)
            break; /* the last one arrived */
        if (killed_at && tu_now_ms() - killed_at > 20000)
            break; /* stalled: the checks below fail */
    }
    CHECK(tu_wait(sender, 10000) == 0);
    uint32_t p2 = atomic_load(&tboard->p2_first);
    CHECK(p2 > 0 && last + 1 == p2 + 100);
    CHECK(atomic_load(&tboard->p2_bad) == 0);
    /* after the death at most a ring's worth of the sender's messages
       (overwritten just before it, or their replays) is missing */
    CHECK(p2_got + g.ring_slots >= 100);
    CHECK(longest < 1000);
    printf("tail scribble: %llu hostile writes; %u received (%u after its "
           "death), %u IVSHM_ECORRUPT, %u sends refused; after the death the "
           "last of 100 arrived %llu ms later\n",
           (unsigned long long)atomic_load(&tboard->hits), got, p2_got,
           corrupt, atomic_load(&tboard->refused),
           (unsigned long long)(tu_now_ms() - killed_at));
    CHECK(TU_EVENTUALLY(ivshm_reap(r) >= 0 && ivshm_find(r, job, 2) < 0, 5000));
    ivshm_detach(r);
    munmap(tboard, sizeof *tboard);
    tboard = NULL;
}

/* ---- two honest races of the repairs, replayed by hand ---- */

/* The OPEN cell the sweep's hook puts back: the sender's OPEN arriving
   between the sweep's look at the queue and chan_orphaned's. */
static struct ivshm_cell *race_cell;
static uint64_t race_pos;

static void open_arrives(ivshm *h)
{
    atomic_store(&race_cell->seq, race_pos + 1);
    atomic_store(&h->my_qctrl->enqueue_pos, race_pos + 1);
}

static void test_repair_races(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *r = tu_attach(path, job, 0, 0), *a = tu_attach(path, job, 1, 0);
    int sr = ivshm_self(r), sa = ivshm_self(a);
    char in[8];

    /* chan_orphaned adopts a live sender's channel only when its OPEN is
       not in the queue: a's OPEN and first message are out, and the OPEN
       cell is made to look free (lost) ... */
    CHECK_RC(ivshm_send(a, sr, 5, "open", 4), 0);
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(r, sr);
    race_pos = r->q_head;
    race_cell = ivshm_qcell(r, sr, race_pos);
    CHECK(atomic_load(&race_cell->seq) == race_pos + 1 &&
          (race_cell->flags & CELL_OPEN));
    atomic_store(&race_cell->seq, race_pos);
    atomic_store(&qc->enqueue_pos, race_pos);
    /* ... but shows up again after the sweep's first look at the queue
       (an honest OPEN still being enqueued): not adopted; the OPEN is
       taken as such, no IVSHM_ECORRUPT */
    ivshm_sweep_test_hook = open_arrives;
    ivshm_fast_sweep(r);
    ivshm_sweep_test_hook = NULL;
    CHECK(r->peers[sa].rx_chan < 0);
    uint32_t tag = 0;
    CHECK_RC(ivshm_recv(r, sa, NULL, &tag, in, sizeof in, 1000), 4);
    CHECK(tag == 5 && memcmp(in, "open", 4) == 0);
    CHECK(r->peers[sa].rx_chan >= 0);

    /* tail_ahead follows the consumer incarnation we know only: r leaves,
       its slot's next incarnation resets the ring, another sender fills
       it and the newcomer reads 5 messages. Its tail is past a's head
       over slots that say "full", but it is not a's consumer. */
    CHECK_RC(ivshm_send(r, sa, 0, "x", 1), 0); /* r -> a: a ring of a's */
    ivshm_detach(a);
    ivshm *a2 = tu_attach(path, job, 1, 0);
    CHECK(ivshm_self(a2) == sa);
    uint8_t *ring = r->peers[sa].tx_ring;
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    for (uint64_t pos = 0; pos < 5; pos++)
        atomic_store(&slot_at(r, ring, pos)->seq, pos + 1);
    atomic_store(&ctrl->tail, 5);
    uint64_t head = r->peers[sa].tx_head;
    CHECK(head == 1);
    CHECK_RC(ivshm_tx_reserve(r, sa, ctrl, g.ring_slots), IVSHM_EPEERDEAD);
    CHECK(r->peers[sa].tx_head == head);
    ivshm_detach(a2);
    ivshm_detach(r);
}

/* ivshm_send_timeout: all or nothing for a message that fits the ring; a
   longer one cut by its deadline costs that message only. */
static void test_send_timeout(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *a = tu_attach(path, job, 0, 0), *b = tu_attach(path, job, 1, 0);
    int sa = ivshm_self(a), sb = ivshm_self(b);
    const uint32_t pl = a->slot_size - IVSHM_SLOT_HDR;
    static uint8_t msg[20 * 256], in[20 * 256];
    for (size_t i = 0; i < sizeof msg; i++)
        msg[i] = (uint8_t)i;
    uint32_t tag = 0;

    for (int i = 0; i < 6; i++)
        CHECK_RC(ivshm_send_timeout(a, sb, 1, "m", 1, 10), 0);
    /* 3 fragments, 2 free slots: nothing may be published */
    CHECK_RC(ivshm_send_timeout(a, sb, 2, msg, 3 * pl, 30), -ETIMEDOUT);
    for (int i = 0; i < 6; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 0), 1);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 0), -EAGAIN);
    /* now it fits: sent whole, and the receiver sees it whole */
    CHECK_RC(ivshm_send_timeout(a, sb, 2, msg, 3 * pl, 30), 0);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 0), 3 * pl);
    CHECK(tag == 2 && memcmp(in, msg, 3 * pl) == 0);

    /* 20 fragments through 8 slots with nobody receiving: cut */
    CHECK_RC(ivshm_send_timeout(a, sb, 3, msg, 20 * pl, 30), -ETIMEDOUT);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 0), -EAGAIN);
    CHECK_RC(ivshm_send_timeout(a, sb, 4, "next", 4, 1000), 0);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 0), IVSHM_ECORRUPT);
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 0), 4);
    CHECK(tag == 4 && memcmp(in, "next", 4) == 0);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* ---- ivshm_format_file: no following, no replacing, no half files ---- */

static bool file_is(const char *p, const char *content)
{
    char got[64] = {0};
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, got, sizeof got - 1);
    close(fd);
    return n == (ssize_t)strlen(content) && strcmp(got, content) == 0;
}

static void write_file(const char *p, const char *content)
{
    unlink(p);
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0600);
    CHECK(fd >= 0 && write(fd, content, strlen(content)) ==
                         (ssize_t)strlen(content));
    close(fd);
}

struct watcher {
    const char *path;
    atomic_bool stop;
    unsigned seen, half;
};

/* Whenever the name exists, the file behind it must be formatted. */
static void *watch_name(void *arg)
{
    struct watcher *w = arg;
    while (!atomic_load(&w->stop)) {
        int fd = open(w->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct ivshm_header hdr;
        ssize_t n = pread(fd, &hdr, sizeof hdr, 0);
        close(fd);
        w->seen++;
        if (n != (ssize_t)sizeof hdr || hdr.magic != IVSHM_MAGIC ||
            hdr.state != REGION_READY)
            w->half++;
    }
    return NULL;
}

static void test_format_file(void)
{
    char p[96], target[128];
    snprintf(p, sizeof p, "/dev/shm/ivshm-hostile-%d", (int)getpid());
    snprintf(target, sizeof target, "%s-target", p);
    ivshm_geometry g = {.max_peers = 4};
    uint64_t size = ivshm_min_region_size(&g);
    struct stat st;

    /* a symlink to a victim's file: refused, neither followed nor removed */
    write_file(target, "precious");
    CHECK(symlink(target, p) == 0);
    int rc = ivshm_format_file(p, size, &g, 0600);
    CHECK(rc == -EEXIST || rc == -ELOOP);
    CHECK(file_is(target, "precious"));
    CHECK(lstat(p, &st) == 0 && S_ISLNK(st.st_mode));
    unlink(p);
    /* a dangling symlink: its target is not created */
    unlink(target);
    CHECK(symlink(target, p) == 0);
    rc = ivshm_format_file(p, size, &g, 0600);
    CHECK(rc == -EEXIST || rc == -ELOOP);
    CHECK(access(target, F_OK) != 0);
    CHECK(lstat(p, &st) == 0 && S_ISLNK(st.st_mode));
    unlink(p);

    /* an existing file with content: not truncated, not removed, even
       when the request fails for another reason */
    write_file(p, "someone's data");
    CHECK_RC(ivshm_format_file(p, size, &g, 0600), -EEXIST);
    CHECK(file_is(p, "someone's data"));
    CHECK_RC(ivshm_format_file(p, 4096, &g, 0600), IVSHM_ESIZE);
    CHECK(file_is(p, "someone's data"));
    unlink(p);

    /* an empty file of ours (a name reserved with O_EXCL) is adopted */
    int fd = open(p, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    CHECK(fd >= 0);
    close(fd);
    CHECK_RC(ivshm_format_file(p, size, &g, 0600), 0);
    CHECK(stat(p, &st) == 0 && (uint64_t)st.st_size == size &&
          (st.st_mode & 0777) == 0600);
    job++;
    ivshm *h = tu_attach(p, job, 0, 0);
    ivshm_detach(h);
    unlink(p);
    /* ... but not an empty file of another user */
    if (geteuid() == 0) {
        fd = open(p, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        CHECK(fd >= 0 && fchown(fd, 65534, 65534) == 0);
        close(fd);
        CHECK_RC(ivshm_format_file(p, size, &g, 0600), -EEXIST);
        CHECK(stat(p, &st) == 0 && st.st_size == 0 && st.st_uid == 65534);
        unlink(p);
    }

    /* a fresh name: exactly `mode`, and never visible half formatted */
    struct watcher w = {.path = p};
    atomic_init(&w.stop, false);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, watch_name, &w) == 0);
    ivshm_geometry big = {.max_peers = 8, .ring_slots = 64, .slot_size = 4096};
    for (int i = 0; i < 5; i++) {
        mode_t old = umask(0077);
        CHECK_RC(ivshm_format_file(p, 64ull << 20, &big, 0640), 0);
        umask(old);
        CHECK(stat(p, &st) == 0 && (st.st_mode & 0777) == 0640);
        tu_sleep_ms(5);
        unlink(p);
    }
    atomic_store(&w.stop, true);
    pthread_join(th, NULL);
    printf("format watcher: %u looks, %u half-formatted\n", w.seen, w.half);
    CHECK(w.half == 0);
    /* a refused request leaves nothing */
    CHECK_RC(ivshm_format_file(p, 4096, &g, 0600), IVSHM_ESIZE);
    CHECK(access(p, F_OK) != 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    /* pairs on their fast rings from the first message on */
    setenv("IVSHM_FAST_AFTER", "0", 1);
    test_attach_race();
    test_mid_message_stall();
    test_resume();
    test_poll_stream();
    test_tail_rewind();
    test_idle_scribble();
    test_hidden_slot();
    test_hostile_ring();
    test_repair_races();
    test_tail_scribble();
    test_send_timeout();
    test_format_file();
    return tu_summary("test_hostile");
}

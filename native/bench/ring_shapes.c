/*
 * Small messages between two CPUs through shared memory, in several
 * shapes of a single-producer ring, without libivshm or MPI: what the
 * shape alone costs (docs/fast-path.md). Each shape carries 22-byte messages
 * (ob1's match header and 8 bytes) with the checks a receiver of
 * untrusted memory makes (one load of each header field, the length
 * bounded before the copy).
 *
 *   slots   libivshm's fast ring: 64 slots of 16,448 bytes, a 32-byte
 *           header (seq = position + 1, stored last) and the payload in
 *           the slot's first line; the producer stores its head after
 *           each message, the consumer its tail; the producer reads the
 *           tail only when its cached copy says "full"
 *   lines   the same protocol with each position's header and up to 32
 *           payload bytes in one line of a dense array (64 lines, 4 KiB)
 *   box     packed records at 32-byte alignment in a 4 KiB box: an
 *           8-byte header word (position, length and tag, XORed with a
 *           key chosen per channel, so that stale bytes of an earlier
 *           lap never look like the next header), stored last; the
 *           consumer publishes its position once per poll that took
 *           something, the producer reads it only when short of room;
 *           nothing else shared
 *   vader   the same box with Open MPI vader's rules (btl_vader_fbox.h):
 *           a 2-word header, the next header zeroed before publishing,
 *           the consumer's position stored after a full fence
 * and three variants of one rule each (not run unless named):
 *   box-zero        the box storing "not yet" into the next header before
 *                   publishing, as vader does
 *   slots-zero      the ring storing its next slot's "not yet" seq again
 *                   before publishing (the next line is then the
 *                   producer's before the next message)
 *   slots-prefetch  the ring prefetching the next slot's line for
 *                   writing after publishing
 *
 * Patterns: pingpong (one-way time), exchange (both send, then both
 * receive: time per exchange), stream (windows of 64 messages and one
 * answer: time per message). Shapes alternate in rounds; the median of
 * the rounds is printed per shape, with the spread, and one JSON line
 * per (shape, pattern) with every round.
 *
 *   ring-shapes [--cpus A,B] [--rounds N] [--iters N] [--shapes LIST]
 *               [--patterns LIST] [--work N] [--send-stores N] [--gap-ms N]
 *
 * --work: what a receiver does per message besides taking it (MPI's
 * matching and completion), as N steps of a dependent multiply-add
 * chain: with it the producer runs ahead in a stream, as the sender of
 * an MPI message-rate test does. --send-stores: stores to private memory
 * a sender makes per message besides the message (MPI's request and
 * bookkeeping), which queue in the store buffer behind the message's.
 *
 * --gap-ms: a pause between runs, so that under a real-time class
 * (`chrt -f 5 ring-shapes ...`, which keeps a loaded machine's other
 * processes from splitting the pair) each run is one short burst.
 *
 * Bad arguments: one line on stderr, exit 2. An alarm ends a stuck run;
 * the child dies with its parent.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MSG 22          /* ob1's 14-byte match header + 8 bytes */
#define WINDOW 64
#define MAX_ROUNDS 64

/* What a shape is made of. */
enum layout { L_SLOTS, L_LINES, L_BOX, L_VADER };
struct shape {
    const char *name;
    enum layout layout;
    bool zero_next;     /* store "not yet" into the next header first   */
    bool prefetch_next; /* prefetch the next header's line for writing  */
};
static const struct shape shapes_known[] = {
    {"slots", L_SLOTS, false, false},
    {"lines", L_LINES, false, false},
    {"box", L_BOX, false, false},
    {"vader", L_VADER, true, false},
    {"box-zero", L_BOX, true, false},
    {"slots-zero", L_SLOTS, true, false},
    {"slots-prefetch", L_SLOTS, false, true},
};
#define NSHAPES (int)(sizeof shapes_known / sizeof shapes_known[0])
#define DEFAULT_SHAPES 0xf /* slots, lines, box, vader */

enum { PINGPONG, EXCHANGE, STREAM, NPATTERNS };
static const char *pattern_name[NPATTERNS] = {"pingpong", "exchange",
                                              "stream"};

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Ask for the line at `p` in exclusive state (a prefetch for a write). */
static inline void prefetch_write(const void *p)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetchw %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 1, 3);
#endif
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ */
/* one direction of a pair: a channel in shared memory                 */
/* ------------------------------------------------------------------ */

#define SLOT_N 64
#define SLOT_SIZE 16448
#define SLOT_HDR 32
#define BOX_SIZE 4096u
#define BOX_ALIGN 32u
#define BOX_UNITS (BOX_SIZE / BOX_ALIGN)

struct slot_hdr {
    _Atomic uint64_t seq;
    uint32_t len, tag, gen, flags;
    uint64_t total;
};

/* shared part of a channel: every shape's memory, only one is used */
struct chan_shm {
    _Atomic uint64_t head __attribute__((aligned(64)));
    _Atomic uint64_t tail __attribute__((aligned(64)));
    uint8_t pad[64];
    uint8_t lines[SLOT_N * 64] __attribute__((aligned(4096)));
    uint8_t box[BOX_SIZE] __attribute__((aligned(4096)));
    uint8_t slots[SLOT_N * SLOT_SIZE] __attribute__((aligned(4096)));
};

/* each end's private view */
struct chan {
    struct chan_shm *m;
    const struct shape *sh;
    uint64_t key;            /* box: XORed into headers; vader: sequence */
    /* producer */
    uint64_t head, tail_cache;
    /* consumer */
    uint64_t pos;
};

/* -- slots and lines: libivshm's ring protocol -- */

static inline struct slot_hdr *pos_hdr(struct chan *c, uint64_t pos)
{
    if (c->sh->layout == L_LINES)
        return (struct slot_hdr *)(c->m->lines + (pos % SLOT_N) * 64);
    return (struct slot_hdr *)(c->m->slots + (pos % SLOT_N) * SLOT_SIZE);
}

static bool ring_send(struct chan *c, const uint8_t *msg, uint32_t len)
{
    if (c->head - c->tail_cache >= SLOT_N) {
        c->tail_cache = atomic_load_explicit(&c->m->tail, memory_order_acquire);
        if (c->head - c->tail_cache >= SLOT_N)
            return false;
    }
    struct slot_hdr *s = pos_hdr(c, c->head);
    s->len = len;
    s->tag = 65;
    s->gen = 1;
    s->flags = 3;
    s->total = len;
    memcpy((uint8_t *)s + SLOT_HDR, msg, len);
    uint64_t next = c->head + 1;
    if (c->sh->zero_next && next - c->tail_cache < SLOT_N)
        /* the next slot says "not yet" again (the value its last lap
           left): its line is ours before the next message */
        atomic_store_explicit(&pos_hdr(c, next)->seq,
                              next >= SLOT_N ? next + 1 - SLOT_N : 0,
                              memory_order_relaxed);
    atomic_store_explicit(&s->seq, c->head + 1, memory_order_release);
    c->head = next;
    atomic_store_explicit(&c->m->head, c->head, memory_order_release);
    if (c->sh->prefetch_next && next - c->tail_cache < SLOT_N)
        prefetch_write(pos_hdr(c, next));
    return true;
}

static int ring_recv(struct chan *c, uint8_t *out)
{
    struct slot_hdr *s = pos_hdr(c, c->pos);
    if (atomic_load_explicit(&s->seq, memory_order_acquire) != c->pos + 1)
        return -1;
    uint32_t len = __atomic_load_n(&s->len, __ATOMIC_RELAXED);
    uint32_t tag = __atomic_load_n(&s->tag, __ATOMIC_RELAXED);
    uint32_t gen = __atomic_load_n(&s->gen, __ATOMIC_RELAXED);
    uint32_t flags = __atomic_load_n(&s->flags, __ATOMIC_RELAXED);
    if (len > 32 || gen != 1 || flags != 3 || tag != 65)
        abort();
    memcpy(out, (uint8_t *)s + SLOT_HDR, len);
    c->pos++;
    atomic_store_explicit(&c->m->tail, c->pos, memory_order_release);
    return (int)len;
}

/* -- box: positions in 32-byte units -- */

static inline uint64_t box_word(const struct chan *c, uint64_t unit,
                                uint32_t len, uint32_t tag)
{
    return ((unit + 1) << 24 | (uint64_t)len << 12 | tag) ^ c->key;
}

static bool box_room(struct chan *c, uint64_t need)
{
    if (c->head + need - c->tail_cache <= BOX_UNITS)
        return true;
    c->tail_cache = atomic_load_explicit(&c->m->tail, memory_order_acquire);
    return c->head + need - c->tail_cache <= BOX_UNITS;
}

static bool box_send(struct chan *c, const uint8_t *msg, uint32_t len)
{
    uint64_t units = (8 + len + BOX_ALIGN - 1) / BOX_ALIGN;
    uint64_t at = c->head % BOX_UNITS;
    uint64_t skip = at + units > BOX_UNITS ? BOX_UNITS - at : 0;
    if (!box_room(c, units + skip))
        return false;
    if (skip) { /* a skip record to the end of the box */
        __atomic_store_n((uint64_t *)(c->m->box + at * BOX_ALIGN),
                         box_word(c, c->head, 0xfff, 0), __ATOMIC_RELEASE);
        c->head += skip;
        at = 0;
    }
    uint8_t *p = c->m->box + at * BOX_ALIGN;
    memcpy(p + 8, msg, len);
    if (c->sh->zero_next && c->head + units + 1 - c->tail_cache <= BOX_UNITS)
        *(volatile uint64_t *)(c->m->box +
                               ((at + units) % BOX_UNITS) * BOX_ALIGN) = 0;
    __atomic_store_n((uint64_t *)p, box_word(c, c->head, len, 65),
                     __ATOMIC_RELEASE);
    c->head += units;
    return true;
}

static int box_recv(struct chan *c, uint8_t *out)
{
    for (;;) {
        uint64_t at = c->pos % BOX_UNITS;
        uint8_t *p = c->m->box + at * BOX_ALIGN;
        uint64_t w = __atomic_load_n((uint64_t *)p, __ATOMIC_ACQUIRE) ^ c->key;
        if (w >> 24 != c->pos + 1)
            return -1;
        uint32_t len = (w >> 12) & 0xfff, tag = w & 0xfff;
        if (len == 0xfff) {
            c->pos += BOX_UNITS - at;
            continue;
        }
        if (len > BOX_SIZE / 4 || tag != 65)
            abort();
        memcpy(out, p + 8, len);
        c->pos += (8 + len + BOX_ALIGN - 1) / BOX_ALIGN;
        return (int)len;
    }
}

/* -- vader's rules on the box: 2-word header, a 16-bit sequence -- */

static void vader_header(uint8_t *p, uint32_t len, uint16_t seq)
{
    volatile uint32_t *w = (volatile uint32_t *)p;
    w[1] = 0;
    atomic_thread_fence(memory_order_release);
    w[0] = len;
    atomic_thread_fence(memory_order_release);
    w[1] = 65u | (uint32_t)seq << 16;
}

static bool vader_send(struct chan *c, const uint8_t *msg, uint32_t len)
{
    uint64_t units = (8 + len + BOX_ALIGN - 1) / BOX_ALIGN;
    uint64_t at = c->head % BOX_UNITS;
    uint64_t skip = at + units > BOX_UNITS ? BOX_UNITS - at : 0;
    if (!box_room(c, units + skip))
        return false;
    if (skip) {
        vader_header(c->m->box + at * BOX_ALIGN, 0xfff, (uint16_t)c->key++);
        c->head += skip;
        at = 0;
    }
    uint8_t *p = c->m->box + at * BOX_ALIGN;
    memcpy(p + 8, msg, len);
    if (c->head + units + 1 - c->tail_cache <= BOX_UNITS)
        *(volatile uint64_t *)(c->m->box +
                               ((at + units) % BOX_UNITS) * BOX_ALIGN) = 0;
    vader_header(p, len, (uint16_t)c->key++);
    c->head += units;
    return true;
}

static int vader_recv(struct chan *c, uint8_t *out)
{
    for (;;) {
        uint64_t at = c->pos % BOX_UNITS;
        volatile uint32_t *w = (volatile uint32_t *)(c->m->box + at * BOX_ALIGN);
        uint32_t tagseq = w[1];
        atomic_thread_fence(memory_order_acquire);
        uint32_t len = w[0];
        if ((tagseq & 0xffff) == 0 || (uint16_t)(tagseq >> 16) != (uint16_t)c->key)
            return -1;
        c->key++;
        if (len == 0xfff) {
            c->pos += BOX_UNITS - at;
            continue;
        }
        if (len > BOX_SIZE / 4)
            abort();
        memcpy(out, (uint8_t *)w + 8, len);
        c->pos += (8 + len + BOX_ALIGN - 1) / BOX_ALIGN;
        return (int)len;
    }
}

/* -- dispatch -- */

static bool chan_send(struct chan *c, const uint8_t *msg, uint32_t len)
{
    switch (c->sh->layout) {
    case L_BOX:
        return box_send(c, msg, len);
    case L_VADER:
        return vader_send(c, msg, len);
    default:
        return ring_send(c, msg, len);
    }
}

/* Take up to `max` messages (a progress call): how many. A box's
   consumer tells its position once per call that took something (vader:
   after a full fence); a ring's after each message. */
static int chan_poll(struct chan *c, uint8_t *out, int max)
{
    int n = 0;
    switch (c->sh->layout) {
    case L_BOX:
        while (n < max && box_recv(c, out) >= 0)
            n++;
        if (n)
            atomic_store_explicit(&c->m->tail, c->pos, memory_order_release);
        return n;
    case L_VADER:
        while (n < max && vader_recv(c, out) >= 0)
            n++;
        if (n) {
            atomic_thread_fence(memory_order_seq_cst);
            atomic_store_explicit(&c->m->tail, c->pos, memory_order_relaxed);
        }
        return n;
    default:
        while (n < max && ring_recv(c, out) >= 0)
            n++;
        return n;
    }
}

/* ------------------------------------------------------------------ */
/* the two processes                                                   */
/* ------------------------------------------------------------------ */

struct shared {
    _Atomic int go __attribute__((aligned(64)));  /* round number to run */
    _Atomic int done __attribute__((aligned(64)));
    int shape, pattern;
    long iters;
    struct chan_shm ch[2]; /* 0: parent -> child, 1: child -> parent */
};

static struct shared *sh;

static void reset_chan(struct chan *c, struct chan_shm *m, int shape)
{
    memset(c, 0, sizeof *c);
    c->m = m;
    c->sh = &shapes_known[shape];
    c->key = c->sh->layout == L_BOX ? 0x5a17c3e9d2b4f681ull & ~0xffffffull : 0;
}

/* Stores a sender makes per message besides the message (MPI's request
   and bookkeeping), into private memory. They wait in the store buffer
   behind the message's stores, which wait for the message line. */
static long sender_stores;
static uint64_t sender_scratch[512];

static void send_spin(struct chan *c, const uint8_t *msg)
{
    while (!chan_send(c, msg, MSG))
        relax();
    static unsigned at;
    for (long i = 0; i < sender_stores; i++)
        ((volatile uint64_t *)sender_scratch)[(at++ * 9) & 511] = (uint64_t)i;
}

/* Work a receiver does per message besides taking it (MPI's matching
   and completion): that many steps of a dependent chain, ~1 ns each. */
static long consumer_work;
static volatile uint64_t work_sink;

static void work(int messages)
{
    uint64_t x = work_sink;
    for (long i = 0; i < consumer_work * messages; i++)
        x = x * 6364136223846793005ull + 1442695040888963407ull;
    work_sink = x;
}

static void recv_n(struct chan *c, uint8_t *buf, int n)
{
    while (n > 0) {
        int got = chan_poll(c, buf, n < 16 ? n : 16);
        if (got && consumer_work)
            work(got);
        n -= got;
    }
}

/* One run of a pattern from one side (`me` 0 = parent, 1 = child). */
static double run_pattern(int me, int shape, int pattern, long iters)
{
    struct chan tx, rx;
    reset_chan(&tx, &sh->ch[me], shape);
    reset_chan(&rx, &sh->ch[1 - me], shape);
    uint8_t msg[64] = {0}, buf[4096];
    uint64_t t0 = now_ns();
    for (long i = 0; i < iters; i++) {
        msg[0] = (uint8_t)i;
        switch (pattern) {
        case PINGPONG:
            if (me == 0) {
                send_spin(&tx, msg);
                recv_n(&rx, buf, 1);
            } else {
                recv_n(&rx, buf, 1);
                send_spin(&tx, msg);
            }
            break;
        case EXCHANGE:
            send_spin(&tx, msg);
            recv_n(&rx, buf, 1);
            break;
        case STREAM:
            if (me == 0) {
                for (int k = 0; k < WINDOW; k++)
                    send_spin(&tx, msg);
                recv_n(&rx, buf, 1);
            } else {
                recv_n(&rx, buf, WINDOW);
                send_spin(&tx, msg);
            }
            break;
        }
    }
    uint64_t t = now_ns() - t0;
    double per = pattern == PINGPONG ? 2.0 * iters
                 : pattern == STREAM ? (double)WINDOW * iters
                                     : (double)iters;
    return (double)t / per;
}

static void pin(int cpu)
{
    if (cpu < 0)
        return;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (sched_setaffinity(0, sizeof s, &s) < 0) {
        fprintf(stderr, "ring-shapes: cannot run on CPU %d\n", cpu);
        exit(2);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void usage(const char *msg)
{
    fprintf(stderr, "ring-shapes: %s\n", msg);
    exit(2);
}

static const char *shape_name(int k)
{
    return shapes_known[k].name;
}

static const char *pattern_of(int k)
{
    return pattern_name[k];
}

static int parse_list(const char *s, const char *(*name)(int), int n)
{
    int mask = 0;
    char *copy = strdup(s), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int k;
        for (k = 0; k < n && strcmp(t, name(k)); k++)
            ;
        if (k == n) {
            free(copy);
            return -1;
        }
        mask |= 1 << k;
    }
    free(copy);
    return mask;
}

int main(int argc, char **argv)
{
    int cpu[2] = {0, 1};
    long rounds = 7, iters = 200000, gap_ms = 0;
    consumer_work = 0;
    sender_stores = 0;
    int shapes = DEFAULT_SHAPES, patterns = (1 << NPATTERNS) - 1;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end;
        if (!v)
            usage("usage: ring-shapes [--cpus A,B] [--rounds N] [--iters N] "
                  "[--shapes LIST] "
                  "[--patterns pingpong,exchange,stream] [--work N] "
                  "[--send-stores N] [--gap-ms N]");
        if (!strcmp(argv[i], "--cpus")) {
            if (sscanf(v, "%d,%d", &cpu[0], &cpu[1]) != 2 || cpu[0] < -1 ||
                cpu[1] < -1)
                usage("--cpus is A,B (-1,-1: not pinned)");
        } else if (!strcmp(argv[i], "--rounds")) {
            rounds = strtol(v, &end, 10);
            if (*end || rounds < 1 || rounds > MAX_ROUNDS)
                usage("--rounds is 1 to 64");
        } else if (!strcmp(argv[i], "--iters")) {
            iters = strtol(v, &end, 10);
            if (*end || iters < 64 || iters > 100000000)
                usage("--iters is 64 to 100000000");
        } else if (!strcmp(argv[i], "--work")) {
            consumer_work = strtol(v, &end, 10);
            if (*end || consumer_work < 0 || consumer_work > 100000)
                usage("--work is 0 to 100000");
        } else if (!strcmp(argv[i], "--send-stores")) {
            sender_stores = strtol(v, &end, 10);
            if (*end || sender_stores < 0 || sender_stores > 100000)
                usage("--send-stores is 0 to 100000");
        } else if (!strcmp(argv[i], "--gap-ms")) {
            gap_ms = strtol(v, &end, 10);
            if (*end || gap_ms < 0 || gap_ms > 10000)
                usage("--gap-ms is 0 to 10000");
        } else if (!strcmp(argv[i], "--shapes")) {
            if ((shapes = parse_list(v, shape_name, NSHAPES)) <= 0)
                usage("--shapes is a comma list of slots, lines, box, vader, "
                      "box-zero, slots-zero, slots-prefetch");
        } else if (!strcmp(argv[i], "--patterns")) {
            if ((patterns = parse_list(v, pattern_of, NPATTERNS)) <= 0)
                usage("--patterns is a comma list of pingpong, exchange, "
                      "stream");
        } else {
            usage("unknown argument");
        }
        i++;
    }
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED)
        usage("cannot map the shared area");
    signal(SIGALRM, SIG_DFL);
    alarm(1800);
    pid_t parent = getpid();
    pid_t child = fork();
    if (child < 0)
        usage("fork failed");
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        pin(cpu[1]);
        for (int seen = 0;;) {
            int go;
            while ((go = atomic_load(&sh->go)) == seen)
                relax();
            if (go < 0)
                _exit(0);
            seen = go;
            run_pattern(1, sh->shape, sh->pattern, sh->iters);
            atomic_store(&sh->done, go);
        }
    }
    pin(cpu[0]);
    static double res[NSHAPES][NPATTERNS][MAX_ROUNDS];
    int round_no = 0;
    for (int r = 0; r < rounds; r++) {
        for (int p = 0; p < NPATTERNS; p++) {
            if (!(patterns & 1 << p))
                continue;
            for (int k = 0; k < NSHAPES; k++) {
                /* alternate the order every second round */
                int s = r % 2 ? NSHAPES - 1 - k : k;
                if (!(shapes & 1 << s))
                    continue;
                memset(sh->ch, 0, sizeof sh->ch);
                sh->shape = s;
                sh->pattern = p;
                sh->iters = p == STREAM ? iters / WINDOW : iters;
                atomic_store(&sh->go, ++round_no);
                res[s][p][r] = run_pattern(0, s, p, sh->iters);
                while (atomic_load(&sh->done) != round_no)
                    relax();
                if (gap_ms)
                    usleep((useconds_t)gap_ms * 1000);
            }
        }
    }
    atomic_store(&sh->go, -1);
    waitpid(child, NULL, 0);
    printf("%-8s %-9s %10s %21s\n", "shape", "pattern", "ns (median)",
           "(min..max)");
    for (int p = 0; p < NPATTERNS; p++)
        for (int s = 0; s < NSHAPES; s++) {
            if (!(patterns & 1 << p) || !(shapes & 1 << s))
                continue;
            double sorted[MAX_ROUNDS];
            memcpy(sorted, res[s][p], sizeof(double) * (size_t)rounds);
            qsort(sorted, (size_t)rounds, sizeof(double), cmp_double);
            printf("%-8s %-9s %10.1f %10.1f..%-10.1f\n", shape_name(s),
                   pattern_name[p], sorted[rounds / 2], sorted[0],
                   sorted[rounds - 1]);
            fprintf(stderr, "{\"shape\":\"%s\",\"pattern\":\"%s\",\"ns\":[",
                    shape_name(s), pattern_name[p]);
            for (int r = 0; r < rounds; r++)
                fprintf(stderr, "%s%.2f", r ? "," : "", res[s][p][r]);
            fprintf(stderr, "]}\n");
        }
    return 0;
}

/* Scribbler: a hostile thread writes random bytes (and plausible small
   numbers) all over a live region -- header, registry, ring control
   lines, slot headers and payloads, window descriptors, lock lines, heap
   -- while victim threads keep calling every libivshm operation with
   deadlines. Passes when nothing crashes, the sanitizers stay silent and
   a watchdog sees every call return within its bound.

   IVSHM_SCRIBBLE_SECONDS sets the duration (default 10). */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CAP 4096
/* Any call may take its own deadline (20 ms here) plus scheduling on a
   loaded machine; locks are bounded by IVSHM_LOCK_TIMEOUT_MS (200 ms
   here) and attach by its 2 s wait for a formatter. */
#define ALLOW_MS 3000
#define ALLOW_ATTACH_MS 6000

static const char *path;
static uint64_t job = 0x5c21;
static atomic_bool stop;

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* ---- watchdog ---- */

struct victim {
    const char *name;
    uint32_t rank;
    _Atomic uint64_t op_start; /* ms, 0 = not inside a call */
    const char *_Atomic op;
    _Atomic uint64_t allow;
    uint64_t calls, ok, errors;
    uint64_t seed;
};

#define CALL(v, what, allow_ms, expr)                                      \
    ({                                                                     \
        atomic_store(&(v)->op, what);                                      \
        atomic_store(&(v)->allow, (uint64_t)(allow_ms));                   \
        atomic_store(&(v)->op_start, tu_now_ms());                            \
        uint64_t t_ = ivshm_now_ns();                                      \
        long long r_ = (long long)(expr);                                  \
        account(what, ivshm_now_ns() - t_);                                \
        atomic_store(&(v)->op_start, 0);                                   \
        (v)->calls++;                                                      \
        if (r_ >= 0)                                                       \
            (v)->ok++;                                                     \
        else                                                               \
            (v)->errors++;                                                 \
        r_;                                                                \
    })

/* time spent per operation, for the report */
static struct {
    const char *op;
    _Atomic uint64_t ns, n;
} spent[32];

static void account(const char *op, uint64_t ns)
{
    for (int i = 0; i < 32; i++) {
        const char *cur = __atomic_load_n(&spent[i].op, __ATOMIC_ACQUIRE);
        if (!cur) {
            const char *none = NULL;
            if (!__atomic_compare_exchange_n(&spent[i].op, &none, op, false,
                                             __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                cur = none;
            else
                cur = op;
        }
        if (cur == op) {
            atomic_fetch_add(&spent[i].ns, ns);
            atomic_fetch_add(&spent[i].n, 1);
            return;
        }
    }
}

static struct victim victims[3];
static const int nvictims = 3;

static void *watchdog(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        uint64_t t = tu_now_ms();
        for (int i = 0; i < nvictims; i++) {
            struct victim *v = &victims[i];
            uint64_t s = atomic_load(&v->op_start);
            if (s && t > s && t - s > atomic_load(&v->allow)) {
                fprintf(stderr, "scribble: %s stuck in %s for %llu ms\n",
                        v->name, atomic_load(&v->op),
                        (unsigned long long)(t - s));
                abort();
            }
        }
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* ---- the scribbler ---- */

struct area {
    uint64_t off, len;
    unsigned weight;
};

static struct area areas[8];
static int nareas;
static uint8_t *scribble_base;
static uint64_t scribble_writes;
static uint8_t pristine_header[IVSHM_PAGE];

static void *scribbler(void *arg)
{
    (void)arg;
    uint64_t seed = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    uint64_t next_quiet = tu_now_ms() + 200;
    while (!atomic_load(&stop)) {
        /* bursts of writes, then a pause in which traffic can succeed */
        unsigned total = 0;
        for (int i = 0; i < nareas; i++)
            total += areas[i].weight;
        unsigned burst = (unsigned)(xorshift(&seed) % 16);
        for (unsigned k = 0; k < burst; k++) {
            unsigned pick = (unsigned)(xorshift(&seed) % total);
            const struct area *a = areas;
            while (pick >= a->weight)
                pick -= (a++)->weight;
            uint64_t r = xorshift(&seed);
            unsigned width = 1u << (r % 4); /* 1, 2, 4 or 8 bytes */
            uint64_t off = a->off + (xorshift(&seed) % (a->len - 8));
            off &= ~(uint64_t)(width - 1);
            uint64_t val = xorshift(&seed);
            switch ((r >> 8) % 4) {
            case 0: /* small: slot numbers, states, flags, lengths */
                val %= 72;
                break;
            case 1: /* near a ring position or generation */
                val = (val % 4096) - 2048 + 64;
                break;
            default:
                break;
            }
            uint8_t *p = scribble_base + off;
            switch (width) {
            case 1: __atomic_store_n(p, (uint8_t)val, __ATOMIC_RELAXED); break;
            case 2: __atomic_store_n((uint16_t *)p, (uint16_t)val, __ATOMIC_RELAXED); break;
            case 4: __atomic_store_n((uint32_t *)p, (uint32_t)val, __ATOMIC_RELAXED); break;
            default: __atomic_store_n((uint64_t *)p, val, __ATOMIC_RELAXED); break;
            }
            scribble_writes++;
        }
        /* now and then the header is put back, so that attaches keep
           racing the scribbles instead of failing on a dead magic */
        if (xorshift(&seed) % 4 == 0)
            for (unsigned i = 0; i < IVSHM_PAGE; i += 8)
                __atomic_store_n((uint64_t *)(scribble_base + i),
                                 *(uint64_t *)(pristine_header + i),
                                 __ATOMIC_RELAXED);
        struct timespec ts = {0, (long)(xorshift(&seed) % 2000000)};
        nanosleep(&ts, NULL);
        /* Every 200 ms: a quiet spell with the window tables wiped, in
           which traffic gets going again (victims rejoin to repair their
           registry entries and rings), so the next storm hits live
           windows and messages in flight, not only dead tables. */
        if (tu_now_ms() >= next_quiet) {
            memset(scribble_base + areas[4].off, 0, areas[4].len);
            memset(scribble_base + areas[5].off, 0, areas[5].len);
            struct timespec q = {0, 100000000};
            nanosleep(&q, NULL);
            next_quiet = tu_now_ms() + 200;
        }
    }
    return NULL;
}

/* ---- victims ---- */

/* Mostly a victim's slot, sometimes any slot (ours and free ones too). */
static int random_peer(ivshm *h, uint64_t *seed)
{
    uint64_t r = xorshift(seed);
    if (r % 4) {
        int s = ivshm_find(h, job, (uint32_t)((r >> 8) % 3));
        if (s >= 0 && s != ivshm_self(h))
            return s;
    }
    return (int)((r >> 16) % (uint64_t)ivshm_max_peers(h));
}

static void window_ops(struct victim *v, ivshm *h, uint64_t *seed)
{
    ivshm_window *w = NULL;
    /* a window shared by all three, or one of our own */
    char name[16];
    bool shared = xorshift(seed) % 2;
    snprintf(name, sizeof name, shared ? "shared" : "own-%u", v->rank);
    int rc = (int)CALL(v, "win_open", ALLOW_MS,
                       ivshm_win_open(h, name, shared ? 3 : 2, 8192, &w));
    if (rc < 0) {
        if (getenv("IVSHM_SCRIBBLE_DEBUG"))
            fprintf(stderr, "win_open: %s\n", ivshm_strerror(rc));
        return;
    }
    uint8_t buf[256];
    memset(buf, (int)(*seed & 0xff), sizeof buf);
    for (int i = 0; i < 20; i++) {
        uint32_t seg = (uint32_t)(xorshift(seed) % 4); /* 3 out of range */
        uint64_t off = xorshift(seed) % 9000;
        size_t len = (size_t)(xorshift(seed) % sizeof buf);
        int64_t old;
        uint64_t o2;
        switch (xorshift(seed) % 8) {
        case 0: CALL(v, "win_put", ALLOW_MS, ivshm_win_put(w, seg, off, buf, len)); break;
        case 1: CALL(v, "win_get", ALLOW_MS, ivshm_win_get(w, seg, off, buf, len)); break;
        case 2: CALL(v, "win_fetch_add", ALLOW_MS, ivshm_win_fetch_add(w, seg, off & ~7ull, 1, &old)); break;
        case 3: CALL(v, "win_cas", ALLOW_MS, ivshm_win_cas(w, seg, off & ~7ull, 0, 1, &o2)); break;
        case 4:
            if (CALL(v, "win_lock", ALLOW_MS,
                     ivshm_win_lock(w, seg, (int)(xorshift(seed) % 2))) == 0)
                CALL(v, "win_unlock", ALLOW_MS, ivshm_win_unlock(w, seg));
            break;
        case 5: CALL(v, "win_flush", ALLOW_MS, ivshm_win_flush(w, seg)); break;
        case 6: CALL(v, "win_barrier", ALLOW_MS, ivshm_win_barrier(w, 5)); break;
        default: {
            uint8_t *p = ivshm_win_ptr(w, seg);
            if (p) /* the validated extent: inside the heap */
                p[xorshift(seed) % ivshm_win_seg_size(w)] ^= 1;
        }
        }
    }
    CALL(v, "win_close", ALLOW_MS, (ivshm_win_close(w), 0));
}

static void message_ops(struct victim *v, ivshm *h, uint64_t *seed)
{
    static _Thread_local uint8_t out[3 * CAP], in[CAP];
    for (int i = 0; i < 50; i++) {
        int to = random_peer(h, seed);
        size_t len = (size_t)(xorshift(seed) % sizeof out);
        uint32_t tag = (uint32_t)xorshift(seed);
        int src = -1;
        const void *data = NULL;
        ssize_t n;
        switch (xorshift(seed) % 8) {
        case 0:
            CALL(v, "send_timeout", ALLOW_MS,
                 ivshm_send_timeout(h, to, tag, out, len, 5));
            break;
        case 1:
            CALL(v, "try_send", ALLOW_MS, ivshm_try_send(h, to, tag, out, len % CAP));
            break;
        case 2: {
            int err = 0;
            void *p = (void *)CALL(v, "send_reserve", ALLOW_MS,
                                   (intptr_t)ivshm_send_reserve(h, to, len % 200, &err));
            if (p) {
                memset(p, 1, len % 200);
                CALL(v, "send_commit", ALLOW_MS,
                     ivshm_send_commit(h, to, tag, len % 200));
            }
            break;
        }
        case 3:
        case 4:
            CALL(v, "recv_any", ALLOW_MS,
                 ivshm_recv(h, IVSHM_ANY, &src, &tag, in,
                            (size_t)(xorshift(seed) % CAP), 5));
            break;
        case 5:
            CALL(v, "recv_poll", ALLOW_MS,
                 ivshm_recv(h, to, &src, &tag, in, sizeof in, 0));
            break;
        case 6:
            n = CALL(v, "recv_peek", ALLOW_MS,
                     ivshm_recv_peek(h, IVSHM_ANY, &src, &tag, &data));
            if (n >= 0) {
                /* shared bytes: read them, trust nothing */
                volatile uint8_t sink = 0;
                for (ssize_t k = 0; k < n && k < 64; k++)
                    sink ^= ((const uint8_t *)data)[k];
                (void)sink;
                CALL(v, "recv_release", ALLOW_MS, ivshm_recv_release(h, src));
            } else if (n == -EMSGSIZE && src >= 0) {
                CALL(v, "recv_after_peek", ALLOW_MS,
                     ivshm_recv(h, src, NULL, &tag, in, sizeof in, 0));
            }
            break;
        default:
            CALL(v, "wait_message", ALLOW_MS, ivshm_wait_message(h, 2));
            break;
        }
    }
}

static void registry_ops(struct victim *v, ivshm *h, uint64_t *seed)
{
    ivshm_peer_info info;
    CALL(v, "peer", ALLOW_MS, ivshm_peer(h, random_peer(h, seed), &info));
    CALL(v, "find", ALLOW_MS, ivshm_find(h, job, (uint32_t)(xorshift(seed) % 4)));
    CALL(v, "reap", ALLOW_MS, ivshm_reap(h));
    ivshm_geometry g;
    ivshm_get_geometry(h, &g);
}

static void *victim_main(void *arg)
{
    struct victim *v = arg;
    uint64_t seed = v->seed;
    ivshm *h = NULL;
    ivshm_config cfg = {.job_id = job, .rank = v->rank, .spin_ns = 2000};
    /* The rejoiner leaves and joins every round, the others every 8th:
       a scribbled registry entry of ours is only repaired by joining. */
    unsigned every = v->rank == 2 ? 1 : 8;
    for (unsigned round = 1; !atomic_load(&stop); round++) {
        if (!h) {
            int rc = (int)CALL(v, "attach", ALLOW_ATTACH_MS,
                               ivshm_attach_path(path, &cfg, &h));
            if (rc < 0) {
                h = NULL;
                struct timespec ms = {0, 1000000};
                nanosleep(&ms, NULL);
                continue;
            }
        }
        message_ops(v, h, &seed);
        window_ops(v, h, &seed);
        registry_ops(v, h, &seed);
        if (round % every == 0) {
            CALL(v, "detach", ALLOW_MS, (ivshm_detach(h), 0));
            h = NULL;
        }
    }
    if (h)
        CALL(v, "detach", ALLOW_MS, (ivshm_detach(h), 0));
    return NULL;
}

int main(void)
{
    const char *env = getenv("IVSHM_SCRIBBLE_SECONDS");
    int seconds = env && atoi(env) > 0 ? atoi(env) : 10;
    /* locks held by a live peer (or a slot number scribbled into a lock
       word) are waited for this long, not 30 s */
    setenv("IVSHM_LOCK_TIMEOUT_MS", "200", 1);

    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256,
                        .max_windows = 16};
    uint64_t size = ivshm_min_region_size(&g);
    path = tu_region(size, &g);

    /* the scribbler's own mapping, and where the interesting parts are */
    int fd = open(path, O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0);
    scribble_base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(scribble_base != MAP_FAILED);
    close(fd);
    memcpy(pristine_header, scribble_base, IVSHM_PAGE);
    ivshm *probe = tu_attach(path, job, 99, 0);
    /* weights: where the parsing is, more often */
    areas[nareas++] = (struct area){0, IVSHM_PAGE, 1}; /* header, alloc_lock */
    areas[nareas++] = (struct area){probe->registry_off,
                                    probe->max_peers * sizeof(struct ivshm_peer_entry), 1};
    /* receive areas: queue ctrl, cells, descriptors, fast rings */
    areas[nareas++] = (struct area){probe->rx_off,
                                    (uint64_t)probe->max_peers * probe->rx_bytes, 3};
    areas[nareas++] = (struct area){probe->rx_off, /* queue ctrl + cells */
                                    IVSHM_QUEUE_CTRL +
                                        (uint64_t)probe->queue_slots * probe->slot_size, 3};
    areas[nareas++] = (struct area){probe->windir_off,
                                    probe->max_windows * sizeof(struct ivshm_win_desc), 2};
    areas[nareas++] = (struct area){probe->wctl_off,
                                    (uint64_t)probe->max_windows * probe->max_peers *
                                        sizeof(struct ivshm_win_lock), 2};
    areas[nareas++] = (struct area){probe->heap_off, 65536, 1};
    ivshm_detach(probe);

    atomic_init(&stop, false);
    for (int i = 0; i < nvictims; i++) {
        victims[i].name = i == 0 ? "victim-0" : i == 1 ? "victim-1" : "rejoiner";
        victims[i].rank = (uint32_t)i;
        victims[i].seed = 0x1234567ull * (uint64_t)(i + 1);
        atomic_init(&victims[i].op_start, 0);
        atomic_init(&victims[i].allow, ALLOW_MS);
    }
    pthread_t vt[3], st, wt;
    for (int i = 0; i < nvictims; i++)
        CHECK(pthread_create(&vt[i], NULL, victim_main, &victims[i]) == 0);
    CHECK(pthread_create(&wt, NULL, watchdog, NULL) == 0);
    CHECK(pthread_create(&st, NULL, scribbler, NULL) == 0);

    struct timespec ts = {seconds, 0};
    nanosleep(&ts, NULL);
    atomic_store(&stop, true);
    pthread_join(st, NULL);
    for (int i = 0; i < nvictims; i++)
        pthread_join(vt[i], NULL);
    pthread_join(wt, NULL);

    uint64_t calls = 0;
    for (int i = 0; i < nvictims; i++) {
        printf("%s: %llu calls, %llu ok, %llu errors\n", victims[i].name,
               (unsigned long long)victims[i].calls,
               (unsigned long long)victims[i].ok,
               (unsigned long long)victims[i].errors);
        calls += victims[i].calls;
        CHECK(victims[i].ok > 0);
    }
    for (int i = 0; i < 32 && spent[i].op; i++)
        printf("  %-16s %8llu calls %8.1f ms\n", spent[i].op,
               (unsigned long long)spent[i].n, (double)spent[i].ns / 1e6);
    printf("scribbler: %llu writes in %d s\n",
           (unsigned long long)scribble_writes, seconds);
    CHECK(calls > 1000);
    CHECK(scribble_writes > 1000);
    munmap(scribble_base, size);
    return tu_summary("test_scribble");
}

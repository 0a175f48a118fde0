/*
 * The hostile-peer harness (docs/security.md, "libivshm"): for every
 * shared field libivshm reads, an adversary process writes boundary
 * values, rewinds, flips bits and streams increments into it, while the
 * victim (this process) runs the message and window calls against an
 * honest peer and an unlisted sender (both processes). The oracle, after
 * every victim call:
 *   (a) no sanitizer report (the ASan/UBSan build aborts on one);
 *   (b) the call returned within its deadline plus the stated constant
 *       (ivshm.h, "Bounds"; plus SLACK_MS for a shared machine);
 *   (c) its work (loop iterations driven by region contents, counted by
 *       a test build of the library: IVSHM_WORK_COUNT) stayed within the
 *       stated bound between two looks at the clock, and within the
 *       bound in all for a call that never waits;
 *   (d) nothing was delivered from a sender the victim does not listen
 *       to (ivshm_listen_only).
 * A watchdog thread ends the test with the case and the call named if a
 * call outlives its bound by far (a hang).
 *
 *   test_hostile_harness [FIELD-SUBSTRING]   one field's cases, or all
 *   IVSHM_HOSTILE_MS=n   each case's duration (default 120 ms; `make
 *                        test-hostile-long` runs 2000)
 */
#define _GNU_SOURCE
#include "cotenant.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static const uint64_t job = 0x4a7e55;
static const char *path;

/* What a loaded, shared machine adds to any stated bound, on top of the
   scheduling delays the watchdog sees meanwhile (sched_late_ms) and the
   time the victim's own thread waited for a CPU during the call
   (run_delay_ns). */
#define SLACK_MS 100
/* The stated constant a call may overrun its deadline by (ivshm.h). */
#define OVERRUN_MS 25
/* The window lock bound the victim attaches with (IVSHM_LOCK_TIMEOUT_MS);
   longer for the case that holds a lock's two phases, so that twice the
   bound stands out from the slack. */
#define LOCK_MS 100
#define PHASES_LOCK_MS 600
/* A call that outlives this is hung: the watchdog ends the test. */
#define HANG_MS 10000

static const ivshm_geometry geom = {.max_peers = 8, .ring_slots = 16,
                                    .slot_size = 256, .max_windows = 4,
                                    .queue_slots = 16, .fast_channels = 4};

/* ------------------------------------------------------------------ */
/* what the processes of one case share                               */
/* ------------------------------------------------------------------ */

struct board {
    int v, p, u;          /* slots: victim, honest peer, unlisted sender */
    int q;                /* a second honest peer (backlogs form)        */
    int d;                /* a sender that left (scenario GONE), or -1  */
    uint32_t v_gen, p_gen, u_gen;
    int32_t dead_pid;     /* a pid that no longer runs (scenario MASS)   */
    uint32_t win;         /* the window's directory index */
    uint64_t win_data_off;/* its extent, as created (for the bitmaps)   */
    uint32_t win_nseg;
    _Atomic int stop;
    _Atomic int d_sent;   /* the departing sender's message is out     */
    _Atomic int d_leave;  /* the departing sender may go               */
    _Atomic uint64_t writes; /* by the adversary */
};
static struct board *board;

/* ------------------------------------------------------------------ */
/* the field catalogue                                                */
/* ------------------------------------------------------------------ */

#define MAX_AT 64
struct where {
    void *at[MAX_AT];
    int n;
    int width; /* bytes: 1, 2, 4 or 8 */
};

typedef void (*locate_fn)(ivshm *raw, struct where *w);

static void add(struct where *w, void *p)
{
    if (w->n < MAX_AT)
        w->at[w->n++] = p;
}

/* registry entries: the victim's, the honest peer's, the unlisted
   sender's, and a free one */
#define ENTRY_FIELD(fname, member)                                         \
    static void fname(ivshm *raw, struct where *w)                         \
    {                                                                      \
        int slots[4] = {board->v, board->p, board->u, 0};                  \
        for (int s = 0; s < (int)raw->max_peers; s++)                      \
            if (s != board->v && s != board->p && s != board->u) {         \
                slots[3] = s;                                              \
                break;                                                     \
            }                                                              \
        for (int i = 0; i < 4; i++) {                                      \
            struct ivshm_peer_entry *e = ivshm_entry(raw, slots[i]);       \
            w->width = sizeof e->member;                                   \
            add(w, (void *)&e->member);                                    \
        }                                                                  \
    }
ENTRY_FIELD(at_state, state)
ENTRY_FIELD(at_gen, gen)
ENTRY_FIELD(at_job, job_id)
ENTRY_FIELD(at_rank, rank)
ENTRY_FIELD(at_doorbell, doorbell_id)
ENTRY_FIELD(at_pid, pid)
ENTRY_FIELD(at_backend, backend)
ENTRY_FIELD(at_pidns, pidns)
ENTRY_FIELD(at_sleeping, sleeping)
ENTRY_FIELD(at_wake, wake)
ENTRY_FIELD(at_heartbeat, heartbeat)
ENTRY_FIELD(at_may_sleep, may_sleep)

/* queues: the victim's (it consumes) and the honest peer's (it sends) */
#define QCTRL_FIELD(fname, member)                                         \
    static void fname(ivshm *raw, struct where *w)                         \
    {                                                                      \
        int slots[2] = {board->v, board->p};                               \
        for (int i = 0; i < 2; i++) {                                      \
            struct ivshm_queue_ctrl *q = ivshm_qctrl(raw, slots[i]);       \
            w->width = sizeof q->member;                                   \
            add(w, (void *)&q->member);                                    \
        }                                                                  \
    }
QCTRL_FIELD(at_enqueue_pos, enqueue_pos)
QCTRL_FIELD(at_qhead, head)
QCTRL_FIELD(at_waiters_any, waiters_any)
QCTRL_FIELD(at_waiters, waiters[0])

#define CELL_FIELD(fname, member)                                          \
    static void fname(ivshm *raw, struct where *w)                         \
    {                                                                      \
        int slots[2] = {board->v, board->p};                               \
        for (int i = 0; i < 2; i++)                                        \
            for (uint32_t c = 0; c < raw->queue_slots; c++) {              \
                struct ivshm_cell *cell = ivshm_qcell(raw, slots[i], c);   \
                w->width = sizeof cell->member;                            \
                add(w, (void *)&cell->member);                             \
            }                                                              \
    }
CELL_FIELD(at_cell_seq, seq)
CELL_FIELD(at_cell_len, len)
CELL_FIELD(at_cell_tag, tag)
CELL_FIELD(at_cell_gen, gen)
CELL_FIELD(at_cell_flags, flags)
CELL_FIELD(at_cell_src, src)
CELL_FIELD(at_cell_total, total)

/* fast channel descriptors of both areas */
static void at_desc_owner(ivshm *raw, struct where *w)
{
    int slots[2] = {board->v, board->p};
    for (int i = 0; i < 2; i++)
        for (uint32_t k = 0; k < raw->fast_channels; k++) {
            w->width = 8;
            add(w, (void *)&ivshm_fdesc(raw, slots[i], k)->owner);
        }
}

/* every fast ring of both areas (whoever uses them) */
static void rings(ivshm *raw, uint8_t **out, int *n)
{
    int slots[2] = {board->v, board->p};
    *n = 0;
    for (int i = 0; i < 2; i++)
        for (uint32_t k = 0; k < raw->fast_channels; k++)
            out[(*n)++] = ivshm_fring(raw, slots[i], k);
}

#define RING_CTRL_FIELD(fname, member)                                     \
    static void fname(ivshm *raw, struct where *w)                         \
    {                                                                      \
        uint8_t *r[2 * IVSHM_MAX_FAST];                                    \
        int n;                                                             \
        rings(raw, r, &n);                                                 \
        for (int i = 0; i < n; i++) {                                      \
            struct ivshm_ring_ctrl *c = (struct ivshm_ring_ctrl *)r[i];    \
            w->width = sizeof c->member;                                   \
            add(w, (void *)&c->member);                                    \
        }                                                                  \
    }
RING_CTRL_FIELD(at_ring_head, head)
RING_CTRL_FIELD(at_ring_tail, tail)

#define SLOT_FIELD(fname, member)                                          \
    static void fname(ivshm *raw, struct where *w)                         \
    {                                                                      \
        uint8_t *r[2 * IVSHM_MAX_FAST];                                    \
        int n;                                                             \
        rings(raw, r, &n);                                                 \
        for (int i = 0; i < n; i++)                                        \
            for (uint32_t s = 0; s < raw->ring_slots; s++) {               \
                struct ivshm_slot *sl = ct_slot(raw, r[i], s);             \
                w->width = sizeof sl->member;                              \
                add(w, (void *)&sl->member);                               \
            }                                                              \
    }
SLOT_FIELD(at_slot_seq, seq)
SLOT_FIELD(at_slot_len, len)
SLOT_FIELD(at_slot_tag, tag)
SLOT_FIELD(at_slot_gen, gen)
SLOT_FIELD(at_slot_flags, flags)
SLOT_FIELD(at_slot_total, total)

/* the window: its descriptor, bitmaps (as created) and lock lines */
static struct ivshm_win_desc *win_desc_of(ivshm *raw)
{
    return (struct ivshm_win_desc *)(raw->base + raw->windir_off) + board->win;
}

#define WIN_FIELD(fname, member)                                           \
    static void fname(ivshm *raw, struct where *w)                         \
    {                                                                      \
        struct ivshm_win_desc *d = win_desc_of(raw);                       \
        w->width = sizeof d->member;                                       \
        add(w, (void *)&d->member);                                        \
    }
WIN_FIELD(at_win_state, state)
WIN_FIELD(at_win_nseg, nseg)
WIN_FIELD(at_win_job, job_id)
WIN_FIELD(at_win_data_off, data_off)
WIN_FIELD(at_win_data_bytes, data_bytes)
WIN_FIELD(at_win_seg_size, seg_size)
WIN_FIELD(at_win_gen, gen)
WIN_FIELD(at_win_bar_count, bar_count)
WIN_FIELD(at_win_bar_phase, bar_phase)

static void at_win_bitmaps(ivshm *raw, struct where *w)
{
    /* members, then one readers bitmap per segment: one word each here
       (8 peers) */
    uint64_t *bm = (uint64_t *)(raw->base + board->win_data_off);
    for (uint32_t i = 0; i <= board->win_nseg; i++) {
        w->width = 8;
        add(w, &bm[i]);
    }
}

static void at_lock_writer(ivshm *raw, struct where *w)
{
    struct ivshm_win_lock *l = (struct ivshm_win_lock *)(raw->base +
                                                         raw->wctl_off) +
                               (uint64_t)board->win * raw->max_peers;
    for (uint32_t s = 0; s < board->win_nseg; s++) {
        w->width = 8;
        add(w, (void *)&l[s].writer);
    }
}

static void at_alloc_lock(ivshm *raw, struct where *w)
{
    w->width = 8;
    add(w, (void *)&ivshm_hdr(raw)->alloc_lock);
}

/* How values are made for a field, beyond the four modes: plain
   numbers, or whole structures the field is part of. */
enum shape {
    PLAIN,
    CLAIM,  /* queue cell seq: claim words of plausible and absurd claimers */
    OPEN,   /* a whole OPEN cell at the victim's queue head */
    /* the attacks of docs/security.md's libivshm section, as scenarios: */
    GONE,   /* a departed sender's ring whose head is kept just ahead of
               the victim: looks endless */
    PHASES, /* a window lock's writer word held by a live slot almost to
               the bound, then one of its reader bits: both phases */
    MASS,   /* every free registry entry forged ACTIVE with a dead pid, and
               forged again once found dead */
};

struct field {
    const char *name;
    locate_fn locate;
    enum shape shape;
};

static void at_departed_ring(ivshm *raw, struct where *w)
{
    uint8_t *ring = ct_ring(raw, board->d, board->v);
    w->width = 8;
    if (ring)
        add(w, (void *)&((struct ivshm_ring_ctrl *)ring)->head);
}

static void at_registry(ivshm *raw, struct where *w)
{
    w->width = 4;
    add(w, (void *)&ivshm_entry(raw, 0)->state);
}

static const struct field fields[] = {
    {"entry.state", at_state, PLAIN},
    {"entry.gen", at_gen, PLAIN},
    {"entry.job_id", at_job, PLAIN},
    {"entry.rank", at_rank, PLAIN},
    {"entry.doorbell_id", at_doorbell, PLAIN},
    {"entry.pid", at_pid, PLAIN},
    {"entry.backend", at_backend, PLAIN},
    {"entry.pidns", at_pidns, PLAIN},
    {"entry.sleeping", at_sleeping, PLAIN},
    {"entry.wake", at_wake, PLAIN},
    {"entry.heartbeat", at_heartbeat, PLAIN},
    {"entry.may_sleep", at_may_sleep, PLAIN},
    {"queue.enqueue_pos", at_enqueue_pos, PLAIN},
    {"queue.head", at_qhead, PLAIN},
    {"queue.waiters_any", at_waiters_any, PLAIN},
    {"queue.waiters", at_waiters, PLAIN},
    {"cell.seq", at_cell_seq, PLAIN},
    {"cell.claim", at_cell_seq, CLAIM},
    {"cell.open", at_cell_seq, OPEN},
    {"cell.len", at_cell_len, PLAIN},
    {"cell.tag", at_cell_tag, PLAIN},
    {"cell.gen", at_cell_gen, PLAIN},
    {"cell.flags", at_cell_flags, PLAIN},
    {"cell.src", at_cell_src, PLAIN},
    {"cell.total", at_cell_total, PLAIN},
    {"channel.owner", at_desc_owner, PLAIN},
    {"ring.head", at_ring_head, PLAIN},
    {"ring.tail", at_ring_tail, PLAIN},
    {"slot.seq", at_slot_seq, PLAIN},
    {"slot.len", at_slot_len, PLAIN},
    {"slot.tag", at_slot_tag, PLAIN},
    {"slot.gen", at_slot_gen, PLAIN},
    {"slot.flags", at_slot_flags, PLAIN},
    {"slot.total", at_slot_total, PLAIN},
    {"window.state", at_win_state, PLAIN},
    {"window.nseg", at_win_nseg, PLAIN},
    {"window.job_id", at_win_job, PLAIN},
    {"window.data_off", at_win_data_off, PLAIN},
    {"window.data_bytes", at_win_data_bytes, PLAIN},
    {"window.seg_size", at_win_seg_size, PLAIN},
    {"window.gen", at_win_gen, PLAIN},
    {"window.bar_count", at_win_bar_count, PLAIN},
    {"window.bar_phase", at_win_bar_phase, PLAIN},
    {"window.bitmaps", at_win_bitmaps, PLAIN},
    {"lock.writer", at_lock_writer, PLAIN},
    {"header.alloc_lock", at_alloc_lock, PLAIN},
    {"scenario.departed_ring", at_departed_ring, GONE},
    {"scenario.lock_phases", at_lock_writer, PHASES},
    {"scenario.mass_forge", at_registry, MASS},
};
#define NFIELDS (sizeof fields / sizeof *fields)

enum mode { BOUNDARY, REWIND, FLIP, STREAM, NMODES };
static const char *const mode_names[NMODES] = {"boundary", "rewind", "flip",
                                               "stream"};

/* ------------------------------------------------------------------ */
/* the adversary                                                      */
/* ------------------------------------------------------------------ */

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static uint64_t load_w(void *p, int width)
{
    switch (width) {
    case 1: return __atomic_load_n((uint8_t *)p, __ATOMIC_RELAXED);
    case 2: return __atomic_load_n((uint16_t *)p, __ATOMIC_RELAXED);
    case 4: return __atomic_load_n((uint32_t *)p, __ATOMIC_RELAXED);
    default: return __atomic_load_n((uint64_t *)p, __ATOMIC_RELAXED);
    }
}

static void store_w(void *p, int width, uint64_t v)
{
    switch (width) {
    case 1: __atomic_store_n((uint8_t *)p, (uint8_t)v, __ATOMIC_RELEASE); break;
    case 2: __atomic_store_n((uint16_t *)p, (uint16_t)v, __ATOMIC_RELEASE); break;
    case 4: __atomic_store_n((uint32_t *)p, (uint32_t)v, __ATOMIC_RELEASE); break;
    default: __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); break;
    }
}

/* Values at the edges of what a reader checks: counts and slots around
   the geometry, the generations and slots of the participants, the
   extremes of each width. */
static uint64_t boundary_value(ivshm *raw, uint64_t i, uint64_t cur)
{
    const uint64_t v[] = {
        0, 1, 2, raw->max_peers - 1, raw->max_peers, raw->max_peers + 1,
        raw->queue_slots - 1, raw->queue_slots, raw->queue_slots + 1,
        raw->ring_slots, raw->slot_size - IVSHM_SLOT_HDR,
        raw->slot_size - IVSHM_SLOT_HDR + 1, board->v, board->p, board->u,
        (uint64_t)board->v + 1, (uint64_t)board->p + 1, board->p_gen,
        board->p_gen + 1ull, board->u_gen, cur + 1, cur - 1,
        cur + raw->queue_slots, cur + raw->ring_slots, 0x7fffffffull,
        0x80000000ull, 0xffffffffull, 1ull << 40, 1ull << 63,
        (1ull << 63) + 1, UINT64_MAX, UINT64_MAX - 1};
    return v[i % (sizeof v / sizeof *v)];
}

static void put_claim(ivshm *raw, void *at, uint64_t i)
{
    uint64_t seq = load_w(at, 8);
    uint64_t pos = seq & 0xffffffffull;
    const int who[] = {board->p, board->u, board->v, 1023 % (int)raw->max_peers,
                       (int)raw->max_peers - 1};
    uint32_t gen = i & 1 ? board->p_gen : board->p_gen + 1;
    store_w(at, 8, ivshm_claim_word(pos + (i % 3) - 1, who[i % 5], gen));
}

/* A whole OPEN cell at the victim's queue head, as if sender `src` had
   announced channel `k` (values at the edges of the descriptors). */
static void put_open(ivshm *raw, uint64_t i)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(raw, board->v);
    uint64_t pos = atomic_load(&qc->head);
    struct ivshm_cell *c = ivshm_qcell(raw, board->v, pos);
    int src = i & 1 ? board->p : board->u;
    const uint64_t ks[] = {0, 1, raw->fast_channels - 1u, raw->fast_channels,
                           UINT64_MAX};
    c->len = 0;
    c->tag = 0;
    c->gen = src == board->p ? board->p_gen : board->u_gen;
    c->flags = CELL_OPEN;
    c->src = (uint16_t)src;
    c->total = ks[i % 5];
    atomic_store(&c->seq, pos + 1);
}

struct adv_arg {
    const struct field *f;
    enum mode m;
    uint64_t seed;
};

/* GONE: the departed sender's ring describes one endless message, and
   its head is kept just ahead of the victim, whose position shows in
   the slots it showed again (their seq set to position + 1). */
static void run_gone(ivshm *raw)
{
    uint8_t *ring = ct_ring(raw, board->d, board->v);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    const uint32_t S = raw->ring_slots;
    const uint32_t gen = atomic_load(&ivshm_entry(raw, board->d)->gen);
    uint64_t seen = atomic_load(&ctrl->head) - 1, writes = 0;
    for (uint32_t i = 0; i < S; i++) {
        struct ivshm_slot *sl = ct_slot(raw, ring, seen + 1 + i);
        sl->len = raw->slot_size - IVSHM_SLOT_HDR;
        sl->tag = 7;
        sl->gen = gen;
        sl->flags = i == 0 ? SLOT_FIRST : 0;
        sl->total = 1ull << 40;
        atomic_store(&sl->seq, 0);
    }
    atomic_store(&ctrl->head, seen + 1 + S);
    const uint64_t first = seen + 1;
    while (!atomic_load(&board->stop)) {
        while (atomic_load(&ct_slot(raw, ring, seen + 1)->seq) == seen + 2)
            seen++;
        if (seen > first)
            ct_slot(raw, ring, first)->flags = 0;
        atomic_store(&ctrl->head, seen + S);
        atomic_store(&board->writes, ++writes);
    }
}

/* PHASES: the honest peer's (live) slot in the writer word for most of
   the bound, then in the readers bitmap of the same segment. */
static void run_phases(ivshm *raw, struct where *w)
{
    uint64_t *readers = (uint64_t *)(raw->base + board->win_data_off) + 1;
    uint64_t writes = 0;
    while (!atomic_load(&board->stop)) {
        __atomic_store_n((uint64_t *)w->at[0], (uint64_t)board->p + 1,
                         __ATOMIC_SEQ_CST);
        atomic_store(&board->writes, ++writes);
        for (uint64_t end = tu_now_ms() + PHASES_LOCK_MS * 9 / 10;
             tu_now_ms() < end && !atomic_load(&board->stop);)
            tu_sleep_ms(1);
        __atomic_fetch_or(readers, 1ull << board->p, __ATOMIC_SEQ_CST);
        __atomic_store_n((uint64_t *)w->at[0], 0, __ATOMIC_SEQ_CST);
        for (uint64_t end = tu_now_ms() + PHASES_LOCK_MS;
             tu_now_ms() < end && !atomic_load(&board->stop);)
            tu_sleep_ms(1);
        __atomic_fetch_and(readers, ~(1ull << board->p), __ATOMIC_SEQ_CST);
    }
}

/* MASS: every free or dead entry forged ACTIVE under a pid that is gone
   (in the victim's pid namespace: found dead by a probe), again and
   again; every window descriptor in use looks so too. */
static void run_mass(ivshm *raw)
{
    uint64_t pidns = ivshm_entry(raw, board->v)->pidns, writes = 0;
    while (!atomic_load(&board->stop)) {
        for (uint32_t s = 0; s < raw->max_peers; s++) {
            struct ivshm_peer_entry *e = ivshm_entry(raw, (int)s);
            uint32_t st = atomic_load(&e->state);
            if (st != PEER_FREE && st != PEER_DEAD)
                continue;
            atomic_store(&e->gen, atomic_load(&e->gen) + 1);
            e->pid = board->dead_pid;
            e->pidns = pidns;
            e->doorbell_id = -1;
            atomic_store(&e->state, PEER_ACTIVE);
            writes++;
        }
        atomic_store(&board->writes, ++writes);
        tu_sleep_ms(1);
    }
}

static int adversary(const struct field *f, enum mode m, uint64_t seed)
{
    ivshm *raw = ct_map(path);
    struct where w = {.n = 0};
    f->locate(raw, &w);
    if (w.n == 0)
        return 3;
    switch (f->shape) {
    case GONE: run_gone(raw); return 0;
    case PHASES: run_phases(raw, &w); return 0;
    case MASS: run_mass(raw); return 0;
    default: break;
    }
    uint64_t snap[MAX_AT];
    for (int k = 0; k < w.n; k++)
        snap[k] = load_w(w.at[k], w.width);
    uint64_t s = seed | 1, writes = 0;
    for (uint64_t i = 0; !atomic_load(&board->stop); i++) {
        int k = (int)(i % (uint64_t)w.n);
        void *at = w.at[k];
        if (f->shape == CLAIM) {
            put_claim(raw, at, i);
        } else if (f->shape == OPEN) {
            put_open(raw, i);
        } else {
            uint64_t cur = load_w(at, w.width), v = cur;
            switch (m) {
            case BOUNDARY: v = boundary_value(raw, i / (uint64_t)w.n, cur); break;
            case REWIND:
                /* back to what it said at the start, or a step back */
                v = (i / (uint64_t)w.n) & 1 ? snap[k] : cur - 1 - (i % 4);
                if (((i / (uint64_t)w.n) & 63) == 0)
                    snap[k] = cur; /* a newer past to rewind to */
                break;
            case FLIP: v = cur ^ (1ull << (xorshift(&s) % (8u * (unsigned)w.width))); break;
            case STREAM: v = cur + 1; break;
            default: break;
            }
            store_w(at, w.width, v);
        }
        writes++;
        if ((i & 255) == 0 || i < 16)
            atomic_store(&board->writes, writes);
    }
    atomic_store(&board->writes, writes);
    return 0;
}

static int adversary_main(void *arg)
{
    const struct adv_arg *a = arg;
    ct_pin(1); /* the victim is on the first CPU */
    return adversary(a->f, a->m, a->seed);
}

/* ------------------------------------------------------------------ */
/* the honest peers, the unlisted sender, the departed sender         */
/* ------------------------------------------------------------------ */

#define TAG_HONEST 0x600d
#define TAG_UNLISTED 0xbad

static void await_victim(void)
{
    while (board->v < 0 && !atomic_load(&board->stop))
        tu_sleep_ms(1);
}

/* rank 1 (the victim's main peer: fast channels both ways, a window
   member) and rank 3 (queue only: its cells go to the victim's backlog
   whenever a receive from rank 1 must get past them) */
static int honest(void *arg)
{
    uint32_t rank = (uint32_t)(uintptr_t)arg;
    ivshm *h = tu_attach(path, job, rank, 0);
    ivshm_listen_only(h, IVSHM_LISTEN_LISTED);
    await_victim();
    ivshm_listen(h, board->v, board->v_gen);
    ivshm_window *w = NULL;
    if (rank == 1) {
        (void)ivshm_fast_open(h, board->v);
        (void)ivshm_win_open(h, "harness", 2, 4096, &w);
    }
    uint8_t m[3000], in[4096];
    memset(m, 0x5a, sizeof m);
    for (uint64_t i = 0; !atomic_load(&board->stop); i++) {
        size_t len = i % 7 == 6 ? sizeof m : 8 + i % 64;
        (void)ivshm_send_timeout(h, board->v, TAG_HONEST, m, len, 5);
        (void)ivshm_recv(h, IVSHM_ANY, NULL, NULL, in, sizeof in, 1);
        if (w && i % 16 == 0 && ivshm_win_lock(w, 1, (int)(i / 16 % 2)) == 0)
            ivshm_win_unlock(w, 1);
    }
    return 0;
}

static int unlisted(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    await_victim();
    (void)ivshm_fast_open(h, board->v);
    uint8_t m[64];
    memset(m, 0xee, sizeof m);
    while (!atomic_load(&board->stop)) {
        (void)ivshm_try_send(h, board->v, TAG_UNLISTED, m, sizeof m);
        tu_sleep_ms(1);
    }
    return 0;
}

/* rank 4, for the GONE scenario: takes a channel of the victim's area,
   sends one message on it, and leaves when told (board->d set back to
   -2 by the victim once it read that ring). */
static int departing(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 4, 0);
    await_victim();
    REQUIRE(ivshm_fast_open(h, board->v) == 0);
    uint8_t m[8] = {4};
    REQUIRE(ivshm_send(h, board->v, TAG_HONEST, m, sizeof m) == 0);
    atomic_store(&board->d_sent, 1);
    while (atomic_load(&board->d_leave) == 0 && !atomic_load(&board->stop))
        tu_sleep_ms(1);
    ivshm_detach(h);
    return 0;
}

/* ------------------------------------------------------------------ */
/* the victim and the oracle                                          */
/* ------------------------------------------------------------------ */

/* What a call's work is checked against (ivshm.h, "Bounds"). */
enum work_kind {
    W_NOWAIT,   /* never waits: 3 budgets in all                        */
    W_WAIT,     /* waits: 2 budgets between two looks at the clock      */
    W_REGISTRY, /* a pass over the registry and the channels            */
    W_ANY,      /* not a loop over region contents (or not counted)     */
};

struct oracle {
    const char *casename;
    _Atomic(const char *) call;
    _Atomic uint64_t call_start_ns; /* 0: not inside a call */
    uint64_t calls, late, unlisted, overworked;
    uint64_t worst_over_ms;          /* beyond deadline + constant */
    const char *worst_call, *worst_work_call;
    uint64_t worst_work, worst_work_bound;
};
static struct oracle orc;

/* The scheduler's delays on this machine now: how late the watchdog's
   naps of 10 ms end (the most since the case began). A call that
   returns late by no more than that was not run, not held. */
static _Atomic uint64_t sched_late_ms;

/* How long the calling thread has been runnable without a CPU, in ns
   (the second field of /proc/thread-self/schedstat; 0 where the kernel
   keeps no such count). A call that overruns its bound by no more than
   it waited for a CPU meanwhile was descheduled, not held: what it ran
   stayed within the bound. Unbounded work still shows, as time on a
   CPU, and as work counted against (c). */
static uint64_t run_delay_ns(void)
{
    static __thread int fd = -2;
    if (fd == -2)
        fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char b[96];
    ssize_t n = pread(fd, b, sizeof b - 1, 0);
    if (n <= 0)
        return 0;
    b[n] = 0;
    unsigned long long ran = 0, waited = 0;
    if (sscanf(b, "%llu %llu", &ran, &waited) != 2)
        return 0;
    return waited;
}

static void *watchdog(void *arg)
{
    (void)arg;
    for (int n = 0;; n++) {
        uint64_t t = tu_now_ns();
        tu_sleep_ms(10);
        uint64_t late = (tu_now_ns() - t) / 1000000ull - 10;
        if (late > atomic_load(&sched_late_ms))
            atomic_store(&sched_late_ms, late);
        if (n % 10)
            continue;
        uint64_t t0 = atomic_load(&orc.call_start_ns);
        if (t0 && tu_now_ns() - t0 > HANG_MS * 1000000ull) {
            fprintf(stderr, "HANG: case %s, call %s running for %d ms\n",
                    orc.casename, atomic_load(&orc.call), HANG_MS);
            _exit(1);
        }
    }
    return NULL;
}

/* (c): the work of a call against its stated bound. */
static void check_work(ivshm *v, const char *what, enum work_kind kind,
                       const struct ct_work *wk)
{
    uint64_t got, bound;
    switch (kind) {
    case W_NOWAIT: got = wk->total; bound = ct_bound_nowait(v); break;
    case W_WAIT: got = wk->peak; bound = ct_bound_per_look(v); break;
    case W_REGISTRY:
        got = wk->total;
        bound = 2ull * v->max_peers + 2 * IVSHM_MAX_FAST;
        break;
    default: return;
    }
    if (got > bound) {
        orc.overworked++;
        if (got - bound > orc.worst_work - orc.worst_work_bound ||
            !orc.worst_work_call) {
            orc.worst_work = got;
            orc.worst_work_bound = bound;
            orc.worst_work_call = what;
        }
    }
}

/* One victim call: (b) its time against `bound_ms` (its deadline plus
   OVERRUN_MS), (c) its work against the bound of its kind. */
#define CALL(what, bound_ms, kind, expr)                                    \
    ({                                                                      \
        atomic_store(&orc.call, what);                                      \
        struct ct_work wk_;                                                 \
        ct_work_begin(v, &wk_);                                             \
        uint64_t rd0_ = run_delay_ns();                                     \
        uint64_t t0_ = tu_now_ns();                                         \
        atomic_store(&orc.call_start_ns, t0_);                              \
        __typeof__(expr) r_ = (expr);                                       \
        uint64_t ms_ = (tu_now_ns() - t0_) / 1000000ull;                    \
        uint64_t off_cpu_ = (run_delay_ns() - rd0_) / 1000000ull;           \
        atomic_store(&orc.call_start_ns, 0);                                \
        ct_work_end(v, &wk_);                                               \
        check_work(v, what, kind, &wk_);                                    \
        orc.calls++;                                                        \
        if (ms_ > (uint64_t)(bound_ms) + SLACK_MS + off_cpu_ +              \
                      atomic_load(&sched_late_ms)) {                        \
            orc.late++;                                                     \
            if (ms_ - (bound_ms) > orc.worst_over_ms) {                     \
                orc.worst_over_ms = ms_ - (bound_ms);                       \
                orc.worst_call = what;                                      \
            }                                                               \
        }                                                                   \
        r_;                                                                 \
    })

/* (d): a message handed out must come from a sender the victim hears:
   its honest peers, and the departed sender of the GONE scenario. */
static void delivered(int src)
{
    if (src != board->p && src != board->q && src != board->d)
        orc.unlisted++;
}

/* Read every byte of what a peek handed out: under ASan, a pointer that
   died before its release is a report. */
static void touch(const void *data, ssize_t n)
{
    volatile uint8_t sink = 0;
    for (ssize_t k = 0; k < n; k++)
        sink ^= ((const uint8_t *)data)[k];
    (void)sink;
}

/* The fast path's upcall (ivshm_recv_each): as the BTL's, it reads the
   message where it lies and replies to the sender before returning. */
static ivshm *each_victim;
static void each_upcall(void *arg, int src, uint32_t gen, uint32_t tag,
                        const void *data, size_t len)
{
    (void)arg;
    (void)gen;
    (void)tag;
    delivered(src);
    touch(data, (ssize_t)len);
    uint8_t reply[8] = {0};
    (void)ivshm_send_small(each_victim, src, 4, reply, sizeof reply, NULL, 0);
    touch(data, (ssize_t)len);
}

static void victim_round(ivshm *v, ivshm_window *w, int lock_ms, uint64_t i)
{
    static uint8_t buf[8192];
    uint8_t m[600];
    memset(m, 0x11, sizeof m);
    const int p = board->p;
    int src = -1;
    uint32_t tag;
    const void *data;
    ssize_t n;

    (void)CALL("try_send", OVERRUN_MS, W_NOWAIT,
               ivshm_try_send(v, p, 1, m, 8 + i % 200));
    (void)CALL("send_timeout(20)", 20 + OVERRUN_MS, W_WAIT,
               ivshm_send_timeout(v, p, 1, m, sizeof m, 20));
    (void)CALL("send_small", OVERRUN_MS, W_NOWAIT,
               ivshm_send_small(v, p, 2, m, 8, m, 24));
    int err;
    void *res = CALL("send_reserve", OVERRUN_MS, W_NOWAIT,
                     ivshm_send_reserve(v, p, 64, &err));
    if (res) {
        /* a receive between reserve and commit (a new incarnation of the
           peer meanwhile must leave the buffer ours) */
        (void)CALL("recv(any,0)", OVERRUN_MS, W_NOWAIT,
                   ivshm_recv(v, IVSHM_ANY, &src, &tag, buf, sizeof buf, 0));
        memset(res, 0x22, 64);
        (void)CALL("send_commit", OVERRUN_MS, W_NOWAIT,
                   ivshm_send_commit(v, p, 3, 64));
    }

    n = CALL("recv(any,0)", OVERRUN_MS, W_NOWAIT,
             ivshm_recv(v, IVSHM_ANY, &src, &tag, buf, sizeof buf, 0));
    if (n >= 0)
        delivered(src);
    n = CALL("recv(p,0)", OVERRUN_MS, W_NOWAIT,
             ivshm_recv(v, p, &src, &tag, buf, sizeof buf, 0));
    n = CALL("recv(any,10)", 10 + OVERRUN_MS, W_WAIT,
             ivshm_recv(v, IVSHM_ANY, &src, &tag, buf, sizeof buf, 10));
    if (n >= 0)
        delivered(src);
    n = CALL("recv(p,10)", 10 + OVERRUN_MS, W_WAIT,
             ivshm_recv(v, p, &src, &tag, buf, sizeof buf, 10));
    /* the departed sender: polled in a row, as a progress engine would */
    for (int k = 0; board->d >= 0 && k < 16; k++)
        n = CALL("recv(d,0)", OVERRUN_MS, W_NOWAIT,
                 ivshm_recv(v, board->d, &src, &tag, buf, sizeof buf, 0));
    if (board->d >= 0) {
        n = CALL("recv(d,10)", 10 + OVERRUN_MS, W_WAIT,
                 ivshm_recv(v, board->d, &src, &tag, buf, sizeof buf, 10));
    }
    (void)CALL("recv_idle", OVERRUN_MS, W_NOWAIT, ivshm_recv_idle(v));
    each_victim = v;
    (void)CALL("recv_each", OVERRUN_MS, W_NOWAIT,
               ivshm_recv_each(v, each_upcall, NULL, 1 + (int)(i % 16)));
    src = -1;
    n = CALL("recv_peek(any)", OVERRUN_MS, W_NOWAIT,
             ivshm_recv_peek(v, IVSHM_ANY, &src, &tag, &data));
    if (n >= 0) {
        delivered(src);
        touch(data, n);
        /* ob1's callback replies to the sender before the release; a
           new incarnation of it meanwhile must not free what we hold */
        (void)CALL("send_small(src)", OVERRUN_MS, W_NOWAIT,
                   ivshm_send_small(v, src, 4, m, 8, NULL, 0));
        touch(data, n);
        (void)CALL("recv_release", OVERRUN_MS, W_NOWAIT,
                   ivshm_recv_release(v, src));
    } else if (n == -EMSGSIZE && src >= 0) {
        /* the BTL's way with a message spanning slots */
        n = CALL("recv(src,0)", OVERRUN_MS, W_NOWAIT,
                 ivshm_recv(v, src, &src, &tag, buf, sizeof buf, 0));
        if (n >= 0)
            delivered(src);
    }
    (void)CALL("wait_message(5)", 5 + OVERRUN_MS, W_WAIT,
               ivshm_wait_message(v, 5));

    if (w) {
        int kind = i % 2 ? IVSHM_LOCK_SHARED : IVSHM_LOCK_EXCLUSIVE;
        if (CALL("win_lock", lock_ms + OVERRUN_MS, W_WAIT,
                 ivshm_win_lock(w, 0, kind)) == 0)
            (void)CALL("win_unlock", OVERRUN_MS, W_ANY, ivshm_win_unlock(w, 0));
        (void)CALL("win_put", OVERRUN_MS, W_ANY, ivshm_win_put(w, 1, 8, m, 64));
        (void)CALL("win_get", OVERRUN_MS, W_ANY, ivshm_win_get(w, 1, 8, buf, 64));
        int64_t old;
        (void)CALL("win_fetch_add", OVERRUN_MS, W_ANY,
                   ivshm_win_fetch_add(w, 0, 0, 1, &old));
        (void)CALL("win_barrier(5)", 5 + OVERRUN_MS, W_WAIT,
                   ivshm_win_barrier(w, 5));
    }
    if (i % 8 == 0)
        (void)CALL("reap", OVERRUN_MS, W_REGISTRY, ivshm_reap(v));
}

/* ------------------------------------------------------------------ */
/* one case: fresh region, processes, the calls, the verdict          */
/* ------------------------------------------------------------------ */

static int case_ms(void)
{
    const char *s = getenv("IVSHM_HOSTILE_MS");
    int ms = s && *s ? atoi(s) : 0;
    return ms > 0 ? ms : 120;
}

static int exit_now(void *arg)
{
    (void)arg;
    return 0;
}

/* Receive from `slot` until the victim reads its channel (its OPEN
   taken), for 5 s at most: a count of calls would be short on a loaded
   machine, where a 1 ms receive may return before the sender has run. */
static void adopt(ivshm *v, int slot)
{
    uint8_t buf[8192];
    uint64_t end = tu_now_ms() + 5000;
    while (v->peers[slot].rx_chan < 0 && tu_now_ms() < end)
        (void)ivshm_recv(v, slot, NULL, NULL, buf, sizeof buf, 1);
}

/* The cases that failed, repeated at the end: a long log is often seen
   only by its head and tail. */
static char failed_cases[2048];

static void run_case(const struct field *f, enum mode m)
{
    static char name[96];
    const int failed_before = tu_failed;
    snprintf(name, sizeof name, "%s/%s", f->name,
             f->shape == PLAIN ? mode_names[m] : "scenario");
    if (f->shape == CLAIM || f->shape == OPEN)
        snprintf(name, sizeof name, "%s", f->name);
    memset(board, 0, sizeof *board);
    board->v = board->p = board->u = board->q = board->d = -1;
    orc = (struct oracle){.casename = name};
    atomic_store(&sched_late_ms, 0);
    pid_t hp = -1, hq = -1, up = -1, dp = -1, ap = -1;

    /* GONE: a ring long enough that the adversary keeps pace with the
       victim (it sees the victim's position only after the fact) */
    ivshm_geometry g = geom;
    if (f->shape == GONE)
        g.ring_slots = 16384;
    path = tu_region(ivshm_min_region_size(&g) + (1 << 20), &g);
    const int lock_ms = f->shape == PHASES ? PHASES_LOCK_MS : LOCK_MS;
    char bound[16];
    snprintf(bound, sizeof bound, "%d", lock_ms);
    setenv("IVSHM_LOCK_TIMEOUT_MS", bound, 1); /* read at attach */
    ivshm *v = tu_attach(path, job, 0, 0);
    ivshm_listen_only(v, IVSHM_LISTEN_LISTED);
    board->v_gen = v->self_gen;
    ivshm_window *w = NULL;
    CHECK_RC(ivshm_win_open(v, "harness", 2, 4096, &w), 0);
    for (uint32_t i = 0; w && i < v->max_windows; i++) {
        struct ivshm_win_desc *d =
            (struct ivshm_win_desc *)(v->base + v->windir_off) + i;
        if (atomic_load(&d->state) == WIN_READY) {
            board->win = i;
            board->win_data_off = d->data_off;
            board->win_nseg = d->nseg;
        }
    }
    if (f->shape == MASS) {
        pid_t gone = tu_fork(exit_now, NULL);
        tu_wait(gone, 5000);
        board->dead_pid = gone;
    }
    hp = tu_fork(honest, (void *)(uintptr_t)1);
    hq = tu_fork(honest, (void *)(uintptr_t)3);
    up = tu_fork(unlisted, NULL);
    if (f->shape == GONE)
        dp = tu_fork(departing, NULL);
    board->v = ivshm_self(v); /* the peers start now */
    board->p = tu_await_peer(v, job, 1, 5000);
    board->q = tu_await_peer(v, job, 3, 5000);
    board->u = tu_await_peer(v, job, 2, 5000);
    CHECK(board->p >= 0 && board->q >= 0 && board->u >= 0);
    if (board->p < 0 || board->q < 0 || board->u < 0)
        goto out;
    board->p_gen = (uint32_t)ivshm_peer_generation(v, board->p);
    board->u_gen = (uint32_t)ivshm_peer_generation(v, board->u);
    ivshm_listen(v, board->p, board->p_gen);
    ivshm_listen(v, board->q,
                 (uint32_t)ivshm_peer_generation(v, board->q));
    (void)ivshm_fast_open(v, board->p);
    adopt(v, board->p);
    if (f->shape == GONE) {
        int d = tu_await_peer(v, job, 4, 5000);
        CHECK(d >= 0);
        if (d < 0)
            goto out;
        ivshm_listen(v, d, (uint32_t)ivshm_peer_generation(v, d));
        CHECK(TU_EVENTUALLY(atomic_load(&board->d_sent), 5000));
        adopt(v, d);
        CHECK(v->peers[d].rx_chan >= 0);
        atomic_store(&board->d_leave, 1);
        CHECK_RC(tu_wait(dp, 5000), 0);
        dp = -1;
        board->d = d; /* read-only from now on: it left */
    }

    struct adv_arg a = {f, m, (uint64_t)tu_now_ns()};
    ct_pin(0);
    ap = tu_fork(adversary_main, &a);
    /* the case starts with the adversary's first write */
    CHECK(TU_EVENTUALLY(atomic_load(&board->writes) > 0, 5000));
    uint64_t end = tu_now_ms() + (uint64_t)case_ms();
    for (uint64_t i = 0; tu_now_ms() < end; i++)
        victim_round(v, w, lock_ms, i);
    uint64_t writes = atomic_load(&board->writes);
    atomic_store(&board->stop, 1);
    CHECK_RC(tu_wait(ap, 5000), 0);
    ap = -1;
    ct_unpin();

    bool ok = orc.late == 0 && orc.unlisted == 0 && orc.overworked == 0 &&
              writes > 0;
    printf("%-30s %6llu calls %9llu writes  %s", name,
           (unsigned long long)orc.calls, (unsigned long long)writes,
           ok ? "ok\n" : "FAIL:");
    if (orc.late)
        printf(" %llu late (worst %s, %llu ms past its bound)",
               (unsigned long long)orc.late, orc.worst_call,
               (unsigned long long)orc.worst_over_ms);
    if (orc.overworked)
        printf(" %llu over their work bound (worst %s, %llu units for %llu)",
               (unsigned long long)orc.overworked, orc.worst_work_call,
               (unsigned long long)orc.worst_work,
               (unsigned long long)orc.worst_work_bound);
    if (orc.unlisted)
        printf(" %llu delivered from unlisted senders",
               (unsigned long long)orc.unlisted);
    if (!writes)
        printf(" the adversary wrote nothing");
    if (!ok)
        printf("\n");
    fflush(stdout);
    CHECK(orc.late == 0);
    CHECK(orc.overworked == 0);
    CHECK(orc.unlisted == 0);
    CHECK(writes > 0);
out:
    if (tu_failed != failed_before &&
        strlen(failed_cases) + strlen(name) + 2 < sizeof failed_cases) {
        strcat(failed_cases, " ");
        strcat(failed_cases, name);
    }
    atomic_store(&board->stop, 1);
    pid_t kids[] = {ap, hp, hq, up, dp};
    for (size_t k = 0; k < sizeof kids / sizeof *kids; k++)
        if (kids[k] > 0) {
            kill(kids[k], SIGKILL);
            tu_wait(kids[k], 5000);
        }
    ivshm_win_close(w);
    ivshm_detach(v);
}

int main(int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : NULL;
    board = mmap(NULL, sizeof *board, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (board == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    ct_pin_init();
    pthread_t dog;
    pthread_create(&dog, NULL, watchdog, NULL);
    int cases = 0;
    for (size_t f = 0; f < NFIELDS; f++) {
        if (only && !strstr(fields[f].name, only))
            continue;
        /* whole-structure shapes have one way of writing */
        int modes = fields[f].shape == PLAIN ? NMODES : 1;
        for (int m = 0; m < modes; m++, cases++)
            run_case(&fields[f], (enum mode)m);
    }
    printf("%d cases of %d ms\n", cases, case_ms());
    if (failed_cases[0])
        printf("failed:%s\n", failed_cases);
    return tu_summary("test_hostile_harness");
}

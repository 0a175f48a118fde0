/* A sender's last messages outlive it (docs/region-layout.md,
   "Receiving"; MPI's eager send): senders (processes) send numbered
   messages through the queue and then their fast channel, and leave at
   once -- detach, _exit without detaching, or kill -9 right after the
   last send -- while the receiver has not read them yet, or is still
   reading, and the next senders attach meanwhile. Every published
   message arrives, whole and in order, then IVSHM_EPEERDEAD; the
   departed senders' identities stay readable (ivshm_peer_last). The
   receiver reads as the BTL does (peek from anyone, release; a message
   of several slots copied out), and reaps every 100 ms as the BTL's
   housekeeping does. Before, a sender attaching after another had
   detached took that sender's slot (the first free one), and the
   departed sender's unread messages were dropped as stale. Time bounds
   are generous (shared machine). */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t job = 0xde9a0000;
static const char *path;

#define SENDERS 3
#define MAX_MSGS 64

enum leave { LEAVE_DETACH, LEAVE_EXIT, LEAVE_KILL };

struct sender_arg {
    uint32_t rank;
    uint32_t msgs;
    enum leave how;
    int slot_fd; /* the sender's slot goes here once it has one */
};

/* Message `i` of sender `rank`: its length (mostly one slot, every
   seventh several) and bytes both sides can compute. */
static bool small_only;

static size_t msg_len(uint32_t rank, uint32_t i, uint32_t payload)
{
    return !small_only && (i + rank) % 7 == 3 ? 3 * payload + 5
                                              : 8 + (i * 13 + rank) % 64;
}

static void fill(uint8_t *b, size_t n, uint32_t rank, uint32_t i)
{
    for (size_t k = 0; k < n; k++)
        b[k] = (uint8_t)(rank * 31 + i * 7 + k);
}

static bool msg_ok(const uint8_t *b, size_t n, uint32_t rank, uint32_t i,
                   uint32_t payload)
{
    if (n != msg_len(rank, i, payload))
        return false;
    for (size_t k = 0; k < n; k++)
        if (b[k] != (uint8_t)(rank * 31 + i * 7 + k))
            return false;
    return true;
}

static int sender(void *argp)
{
    const struct sender_arg *a = argp;
    ivshm *h = tu_attach(path, job, a->rank, 0);
    int me[2] = {(int)a->rank, ivshm_self(h)};
    REQUIRE(write(a->slot_fd, me, sizeof me) == sizeof me);
    int to = tu_await_peer(h, job, 0, 10000);
    REQUIRE(to >= 0);
    ivshm_geometry g;
    ivshm_get_geometry(h, &g);
    const uint32_t payload = g.slot_size - 32;
    uint8_t buf[4 * 256];
    for (uint32_t i = 0; i < a->msgs; i++) {
        size_t n = msg_len(a->rank, i, payload);
        fill(buf, n, a->rank, i);
        REQUIRE(ivshm_send(h, to, i, buf, n) == 0);
    }
    switch (a->how) {
    case LEAVE_DETACH:
        ivshm_detach(h);
        return 0;
    case LEAVE_EXIT:
        _exit(0);
    case LEAVE_KILL:
        raise(SIGKILL);
    }
    return 0;
}

/* Receive from everybody as the BTL does until each sender's `msgs`
   arrived and its departure was seen, or `timeout_ms`. got[r]: how many
   of rank r's arrived in order and intact (a bad one stops the count). */
static void receive_all(ivshm *h, const int *slot_of, uint32_t msgs,
                        uint32_t *got, bool *bad, int timeout_ms)
{
    ivshm_geometry g;
    ivshm_get_geometry(h, &g);
    const uint32_t payload = g.slot_size - 32;
    uint8_t buf[4 * 256];
    uint64_t end = tu_now_ms() + (uint64_t)timeout_ms, last_reap = 0;
    for (;;) {
        bool all = true;
        for (int r = 0; r < SENDERS; r++)
            all &= got[r] == msgs || bad[r];
        if (all || tu_now_ms() > end)
            return;
        if (tu_now_ms() - last_reap >= 100) {
            last_reap = tu_now_ms();
            ivshm_reap(h);
        }
        int src = -1;
        uint32_t tag = 0;
        const void *data = NULL;
        ssize_t n = ivshm_recv_peek(h, IVSHM_ANY, &src, &tag, &data);
        const uint8_t *msg = data;
        if (n == -EMSGSIZE && src >= 0) {
            n = ivshm_recv(h, src, NULL, &tag, buf, sizeof buf, 0);
            msg = buf;
        } else if (n >= 0) {
            memcpy(buf, data, (size_t)n < sizeof buf ? (size_t)n : sizeof buf);
            ivshm_recv_release(h, src);
            msg = buf;
        }
        if (n == -EAGAIN) {
            ivshm_wait_message(h, 1);
            continue;
        }
        int r = -1;
        for (int k = 0; k < SENDERS; k++)
            if (slot_of[k] == src)
                r = k;
        if (r < 0)
            continue;
        if (n < 0 || bad[r]) {
            if (n < 0 && n != IVSHM_EPEERDEAD && !bad[r]) {
                fprintf(stderr, "rank %d: error %zd (%s) after %u\n", r + 1,
                        n, ivshm_strerror((int)n), got[r]);
                bad[r] = true;
            }
            continue;
        }
        if (tag != got[r] || !msg_ok(msg, (size_t)n, (uint32_t)r + 1, tag,
                                     payload)) {
            fprintf(stderr, "rank %d: message %u wrong (tag %u, %zd B)\n",
                    r + 1, got[r], tag, n);
            bad[r] = true;
            continue;
        }
        got[r]++;
    }
}

/* One round: SENDERS senders of `msgs` messages each leave `how`; the
   receiver starts reading after `delay_ms`. */
static bool one_round(enum leave how, uint32_t msgs, int delay_ms)
{
    ivshm *h = tu_attach(path, job, 0, 0);
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    struct sender_arg args[SENDERS];
    pid_t pids[SENDERS];
    int slot_of[SENDERS];
    for (int r = 0; r < SENDERS; r++) {
        args[r] = (struct sender_arg){(uint32_t)r + 1, msgs, how, fds[1]};
        pids[r] = tu_fork(sender, &args[r]);
    }
    for (int r = 0; r < SENDERS; r++) {
        int me[2];
        REQUIRE(read(fds[0], me, sizeof me) == sizeof me);
        REQUIRE(me[0] >= 1 && me[0] <= SENDERS);
        slot_of[me[0] - 1] = me[1];
    }
    close(fds[0]);
    close(fds[1]);
    int st[SENDERS];
    if (delay_ms < 0) /* all gone before we read anything */
        for (int r = 0; r < SENDERS; r++)
            st[r] = tu_wait(pids[r], 10000);
    for (int r = 0; r < SENDERS && delay_ms < 0; r++) {
        /* whose messages they are, though the peer is gone (the BTL's
           trust check): identity and generation of the departed */
        ivshm_peer_info info;
        int rc = ivshm_peer_last(h, slot_of[r], &info);
        /* one that did not detach is ACTIVE until found dead */
        CHECK(how == LEAVE_DETACH ? rc == 1 : rc >= 0);
        CHECK(rc < 0 || (info.rank == (uint32_t)r + 1 && info.job_id == job));
        const uint32_t gen = info.generation;
        CHECK_RC(ivshm_peer(h, slot_of[r], &info), rc == 1 ? -ENOENT : 0);
        /* how it went: only a detach frees the slot (the BTL's clean
           leave without a goodbye); found dead or not yet, the others
           did not leave */
        if (rc >= 0) {
            CHECK_RC(ivshm_peer_left(h, slot_of[r], gen), how == LEAVE_DETACH);
            CHECK_RC(ivshm_peer_left(h, slot_of[r], gen + 1), 0);
        }
    }
    ivshm_reap(h);
    for (int r = 0; r < SENDERS && delay_ms < 0; r++) {
        ivshm_peer_info info;
        CHECK(ivshm_peer_last(h, slot_of[r], &info) == 1);
        CHECK_RC(ivshm_peer_left(h, slot_of[r], info.generation),
                 how == LEAVE_DETACH);
    }
    tu_sleep_ms(delay_ms < 0 ? 0 : delay_ms);
    uint32_t got[SENDERS] = {0};
    bool bad[SENDERS] = {false};
    receive_all(h, slot_of, msgs, got, bad, 10000);
    bool ok = true;
    for (int r = 0; r < SENDERS; r++) {
        if (delay_ms >= 0)
            st[r] = tu_wait(pids[r], 10000);
        if (how != LEAVE_KILL)
            CHECK(st[r] == 0);
        if (got[r] != msgs || bad[r]) {
            fprintf(stderr, "leave %d, delay %d ms: rank %d: %u of %u\n",
                    (int)how, delay_ms, r + 1, got[r], msgs);
            ok = false;
        }
    }
    /* found dead (pid gone), or left: nothing more, and so it says */
    ivshm_reap(h);
    for (int r = 0; r < SENDERS; r++)
        CHECK_RC(ivshm_recv(h, slot_of[r], NULL, NULL, NULL, 0, 0),
                 IVSHM_EPEERDEAD);
    ivshm_detach(h);
    return ok;
}

/* A producer stopped mid-send: it took the head cell of rank 0's queue
   and claimed it, as ivshm_q_send does before it writes, and writes no
   further. */
static int stalled_writer(void *argp)
{
    int ready_fd = *(const int *)argp;
    ivshm *h = tu_attach(path, job, 5, 0);
    int to = tu_await_peer(h, job, 0, 10000);
    REQUIRE(to >= 0);
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, to);
    uint64_t pos = atomic_fetch_add(&qc->enqueue_pos, 1);
    uint64_t want = pos;
    REQUIRE(atomic_compare_exchange_strong(
        &ivshm_qcell(h, to, pos)->seq, &want,
        ivshm_claim_word(pos, h->self, h->self_gen)));
    char c = 'r';
    REQUIRE(write(ready_fd, &c, 1) == 1);
    for (;;)
        pause();
}

/* A sender's last message queued behind a cell another producer is
   still writing (on a loaded machine a producer can be descheduled
   mid-send, as at the end of an MPI job when every rank says goodbye at
   once). The head hides the message, and the sender has left: the
   receiver must wait for the writer, not answer "nothing more of it"
   (the BTL takes that answer, without a goodbye, for a crash). */
static void behind_a_cell_in_writing(void)
{
    job++;
    ivshm *rx = tu_attach(path, job, 0, 0);
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_t writer = tu_fork(stalled_writer, &fds[1]);
    char c;
    REQUIRE(read(fds[0], &c, 1) == 1);
    ivshm *tx = tu_attach(path, job, 1, 0);
    const int gone = ivshm_self(tx);
    CHECK_RC(ivshm_send(tx, ivshm_self(rx), 7, "last", 4), 0);
    ivshm_detach(tx);
    ivshm_reap(rx);

    char buf[16];
    uint32_t tag = 0;
    const void *data = NULL;
    CHECK_RC(ivshm_recv_peek(rx, gone, NULL, &tag, &data), -EAGAIN);
    CHECK_RC(ivshm_recv(rx, gone, NULL, &tag, buf, sizeof buf, 0), -EAGAIN);
    uint64_t t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(rx, gone, NULL, &tag, buf, sizeof buf, 300),
             -ETIMEDOUT);
    CHECK(tu_now_ms() - t0 >= 250);

    /* the writer dies: its cell is skipped, the message comes out */
    kill(writer, SIGKILL);
    CHECK(tu_wait(writer, 5000) == -1);
    CHECK_RC(ivshm_recv(rx, gone, NULL, &tag, buf, sizeof buf, 10000), 4);
    CHECK(tag == 7 && memcmp(buf, "last", 4) == 0);
    CHECK_RC(ivshm_recv(rx, gone, NULL, NULL, NULL, 0, 0), IVSHM_EPEERDEAD);
    close(fds[0]);
    close(fds[1]);
    ivshm_detach(rx);
}

int main(int argc, char **argv)
{
    ivshm_geometry g = {.max_peers = 8, .ring_slots = 8, .slot_size = 256,
                        .queue_slots = 16, .fast_channels = 4};
    path = tu_region(ivshm_min_region_size(&g), &g);
    int rounds = argc > 1 ? atoi(argv[1]) : 3;
    for (int k = 0; k < rounds; k++) {
        for (int how = LEAVE_DETACH; how <= LEAVE_KILL; how++) {
            /* all of it fits queue and rings: read after all left */
            small_only = true;
            CHECK(one_round((enum leave)how, 12, -1));
            /* more than fits: read while they send and leave */
            small_only = false;
            CHECK(one_round((enum leave)how, 12, 200));
            CHECK(one_round((enum leave)how, MAX_MSGS, 0));
            CHECK(one_round((enum leave)how, MAX_MSGS, 20));
        }
    }
    behind_a_cell_in_writing();
    return tu_summary("test_departed");
}

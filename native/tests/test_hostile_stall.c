/* A sender that stalls, or streams without end, in the middle of a
   message: every receive returns by its deadline and a cut message is
   resumed by the next receive; ivshm_send_timeout cuts only the message
   its deadline ends. */
#include "hostile.h"

/* ---- a sender stalls in the middle of a message ---- */

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

int main(void)
{
    hostile_setup();
    test_mid_message_stall();
    test_resume();
    test_poll_stream();
    test_send_timeout();
    return tu_summary("test_hostile_stall");
}

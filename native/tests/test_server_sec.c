/* Hostile clients against ivshmem-server (docs/security.md, "The
   server"), each a real process or socket:
   - a client truncates the sealed region it was handed: EPERM, and the
     server and a peer keep working on the memory;
   - a connect/close storm while a busy client does not read its socket:
     the busy client is not dropped, its registry entry stays ACTIVE,
     and afterwards it reads a consistent history (every join it got is
     followed by its leave; the rest coalesced away);
   - fd flooding from another uid: the per-uid cap refuses the extra
     connections, the victim keeps its connection and gets only the
     admitted peers' eventfds; a uid outside the group is refused;
   - malformed clients (garbage, half-closed, a torn message) are
     disconnected alone;
   - host-file mode never follows a planted link, nor do state files.
   Every wait is bounded; the whole program is under alarm(). */
#define _GNU_SOURCE
#include "internal.h"
#include "ivshm_admin.h"
#include "testutil.h"
#include "test_server_raw.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define JOB 0x5ec
#define STORM 600            /* connect/close cycles (the old server
                                dropped a busy peer after ~75) */
#define FLOOD 12             /* connections the flooder tries */
#define PER_UID 2

static const char *server_bin;
static pid_t owner_pid, server_pid = -1;
static char sock_path[108], state_path[128], link_path[128], victim_path[128];

static void stop_server(void)
{
    if (server_pid > 0) {
        kill(server_pid, SIGTERM);
        if (tu_wait(server_pid, 5000) < 0)
            fprintf(stderr, "server did not exit on SIGTERM\n");
        server_pid = -1;
    }
}

static void cleanup(void)
{
    if (getpid() != owner_pid)
        return;
    if (server_pid > 0) {
        kill(server_pid, SIGKILL);
        waitpid(server_pid, NULL, 0);
        server_pid = -1;
    }
    const char *paths[] = {sock_path, state_path, link_path, victim_path};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
        if (paths[i][0])
            unlink(paths[i]);
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", state_path);
    unlink(tmp);
}

static bool state_has_peer(int32_t id)
{
    char want[64];
    snprintf(want, sizeof want, "{\"id\":%d,", (int)id);
    const char *text = tu_read_text(state_path);
    return text && strstr(text, want);
}

/* Start a foreground server with `extra` options (NULL-terminated). */
static bool start_server(const char *const *extra)
{
    char *args[32] = {"ivshmem-server", "-F", "-S", sock_path, "-s", state_path,
                      "-l", "32M", "--max-peers", "8", "--ring-slots", "16",
                      "--slot-size", "1024"};
    int n = 14;
    for (; extra && *extra && n < 31; extra++)
        args[n++] = (char *)*extra;
    args[n] = NULL;
    unlink(state_path);
    fflush(NULL);
    server_pid = tu_fork_child();
    if (server_pid == 0) {
        execv(server_bin, args);
        _exit(127);
    }
    bool up = TU_EVENTUALLY(tu_exists(state_path), 5000);
    CHECK(up);
    return up;
}

/* ---- raw protocol (test_server_raw.h) ---- */

/* Read an opening burst with `vectors` vectors and `npeers` peers already
   there: returns the socket (-1 on failure), our id, the region fd. */
static int raw_attach(int vectors, int npeers, int64_t *id, int *shm_fd)
{
    int sock = connect_to(sock_path);
    if (sock < 0)
        return -1;
    int64_t version = -2, marker = 0, v;
    int fd = -1;
    bool ok = raw_recv(sock, &version, &fd, 5000) == 1 && version == 0 &&
              fd < 0 && raw_recv(sock, id, &fd, 5000) == 1 && *id >= 0 &&
              fd < 0 && raw_recv(sock, &marker, shm_fd, 5000) == 1 &&
              marker == -1 && *shm_fd >= 0;
    for (int i = 0; ok && i < (npeers + 1) * vectors; i++) {
        ok = raw_recv(sock, &v, &fd, 5000) == 1 && fd >= 0;
        ok = ok && (i < npeers * vectors ? v != *id : v == *id);
        if (fd >= 0)
            close(fd);
    }
    if (!ok) {
        close(sock);
        return -1;
    }
    return sock;
}

/* Has the server closed `sock` (EOF after whatever was queued)? */
static bool closed_by_server(int sock, int timeout_ms)
{
    uint64_t end = ivshm_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    char buf[256];
    while (ivshm_now_ns() < end) {
        struct pollfd p = {.fd = sock, .events = POLLIN};
        if (poll(&p, 1, 50) < 0)
            return false;
        if (!p.revents)
            continue;
        /* drain queued messages; their fds are closed on receipt */
        union {
            struct cmsghdr align;
            char b[CMSG_SPACE(sizeof(int) * 8)];
        } ctl;
        struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1,
                           .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
        ssize_t n = recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); n > 0 && c;
             c = CMSG_NXTHDR(&m, c)) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                close(fd);
            }
        }
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return true;
    }
    return false;
}

/* ---- 1. sealed region ---- */

static void test_sealed_region(void)
{
    if (!start_server(NULL))
        return;
    const char *text = tu_read_text(state_path);
    CHECK(text && strstr(text, "\"shm\":null") && strstr(text, "\"sealed\":true"));

    ivshm_config cfg = {.job_id = JOB, .rank = 0, .name = "honest"};
    ivshm *a = NULL;
    CHECK_RC(ivshm_attach_server(sock_path, &cfg, &a), 0);
    int64_t id = -1;
    int shm = -1;
    int evil = raw_attach(1, 1, &id, &shm);
    CHECK(evil >= 0);
    if (!a || evil < 0)
        goto out;
    struct stat st;
    CHECK(fstat(shm, &st) == 0 && st.st_size == 32 << 20);
    CHECK_RC(ivshm_admin_sealed(shm), 1);
    /* the truncation attack: every mapping would SIGBUS after it */
    errno = 0;
    CHECK(ftruncate(shm, 0) < 0 && errno == EPERM);
    CHECK(ftruncate(shm, 64 << 20) < 0 && errno == EPERM);
    CHECK(fcntl(shm, F_ADD_SEALS, 0) < 0 && errno == EPERM);
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", shm);
    int again = open(proc, O_RDWR | O_CLOEXEC); /* by path: same inode */
    CHECK(again >= 0 && ftruncate(again, 4096) < 0 && errno == EPERM);
    if (again >= 0)
        close(again);
    CHECK(fstat(shm, &st) == 0 && st.st_size == 32 << 20);

    /* the hostile client goes; the server marks the registry (touching
       the memory) and a new peer talks to the honest one */
    ivshm *h = NULL;
    CHECK_RC(ivshm_region_map(shm, &h), 0);
    shm = -1;
    if (h) {
        ivshm_config ecfg = {.job_id = JOB, .rank = 7};
        CHECK_RC(ivshm_join(h, &ecfg, (int32_t)id, DB_UIO), 0);
        int slot = ivshm_self(h);
        close(evil);
        evil = -1;
        CHECK(TU_EVENTUALLY(atomic_load(&ivshm_entry(h, slot)->state) == PEER_DEAD,
                         2000));
        ivshm_region_unmap(h);
    }
    CHECK(kill(server_pid, 0) == 0);
    ivshm_config bcfg = {.job_id = JOB, .rank = 1, .name = "b"};
    ivshm *b = NULL;
    CHECK_RC(ivshm_attach_server(sock_path, &bcfg, &b), 0);
    if (b) {
        int sa = -1;
        CHECK(TU_EVENTUALLY((sa = ivshm_find(b, JOB, 0)) >= 0, 2000));
        uint64_t v = 42;
        CHECK_RC(ivshm_send(b, sa, 5, &v, sizeof v), 0);
        uint64_t got = 0;
        uint32_t tag = 0;
        CHECK_RC(ivshm_recv(a, IVSHM_ANY, NULL, &tag, &got, sizeof got, 2000), 8);
        CHECK(tag == 5 && got == 42);
        ivshm_detach(b);
    }
out:
    if (evil >= 0)
        close(evil);
    if (shm >= 0)
        close(shm);
    ivshm_detach(a);
    stop_server();
    CHECK(!tu_exists(sock_path) && !tu_exists(state_path));
}

/* ---- 2. storm against a busy client ---- */

static int storm(void *arg)
{
    (void)arg;
    for (int i = 0; i < STORM; i++) {
        int s = connect_to(sock_path);
        REQUIRE(s >= 0);
        int64_t v;
        int fd = -1;
        /* the version: the server has taken us in */
        REQUIRE(raw_recv(s, &v, &fd, 5000) == 1 && v == 0);
        close(s);
    }
    return 0;
}

static void test_storm(void)
{
    /* One process storming: the budgets (test_server_dos) would refuse
       it, and this is about what the storm does to the busy client. */
    const char *extra[] = {"--connect-rate-per-uid", "0",
                           "--connect-rate-per-pid", "0", NULL};
    if (!start_server(extra))
        return;
    int64_t id = -1;
    int shm = -1;
    int busy = raw_attach(1, 0, &id, &shm);
    CHECK(busy >= 0);
    ivshm *h = NULL;
    if (busy < 0 || ivshm_region_map(shm, &h) < 0) {
        CHECK(!"busy client set up");
        stop_server();
        return;
    }
    /* a registry entry whose liveness is our (live) pid */
    ivshm_config cfg = {.job_id = JOB, .rank = 3};
    CHECK_RC(ivshm_join(h, &cfg, (int32_t)id, DB_UIO), 0);
    struct ivshm_peer_entry *me = ivshm_entry(h, ivshm_self(h));

    /* busy computing: we do not read our socket while the storm runs */
    uint64_t t0 = ivshm_now_ns();
    pid_t p = tu_fork(storm, NULL);
    CHECK_RC(tu_wait(p, 60000), 0);
    printf("storm: %d connect/close cycles in %.0f ms\n", STORM,
           (ivshm_now_ns() - t0) / 1e6);
    tu_sleep_ms(200); /* the server has seen the last close */
    CHECK(kill(server_pid, 0) == 0);
    CHECK(atomic_load(&me->state) == PEER_ACTIVE);
    CHECK(state_has_peer((int32_t)id));

    /* now read: every join (one fd) must be followed by its leave */
    static bool seen[IVSHM_MAX_PEERS * 1024];
    int joins = 0, leaves = 0, bad = 0;
    for (;;) {
        int64_t v;
        int fd = -1;
        int r = raw_recv(busy, &v, &fd, 500);
        if (r <= 0) {
            CHECK(r == 0); /* quiet, not closed */
            break;
        }
        if (v < 0 || v >= (int64_t)(sizeof seen)) {
            bad++;
        } else if (fd >= 0) {
            bad += seen[v];
            seen[v] = true;
            joins++;
            close(fd);
        } else {
            bad += !seen[v];
            seen[v] = false;
            leaves++;
        }
    }
    int still = 0;
    for (size_t i = 0; i < sizeof seen; i++)
        still += seen[i];
    printf("busy client read %d joins, %d leaves (%d cycles coalesced)\n",
           joins, leaves, STORM - joins);
    CHECK(bad == 0 && still == 0 && joins == leaves && joins > 0);

    /* the connection is alive: a newcomer is announced to us */
    int64_t nid = -1, v = -1;
    int nshm = -1, fd = -1;
    int n = raw_attach(1, 1, &nid, &nshm);
    CHECK(n >= 0);
    CHECK(raw_recv(busy, &v, &fd, 2000) == 1 && v == nid && fd >= 0);
    if (fd >= 0)
        close(fd);
    if (n >= 0) {
        close(n);
        close(nshm);
    }
    CHECK(atomic_load(&me->state) == PEER_ACTIVE);
    ivshm_registry_leave(h);
    ivshm_region_unmap(h);
    close(busy);
    stop_server();
}

/* ---- 3. fd flooding from another uid ---- */

static int flooder(void *arg)
{
    int *admitted = arg; /* in shared memory */
    REQUIRE(setgroups(0, NULL) == 0);
    REQUIRE(setgid(0) == 0 && setuid(65534) == 0);
    int socks[FLOOD], n = 0;
    for (int i = 0; i < FLOOD; i++) {
        socks[i] = connect_to(sock_path);
        REQUIRE(socks[i] >= 0);
        int64_t v;
        int fd = -1;
        int r = raw_recv(socks[i], &v, &fd, 5000);
        if (r == 1 && v == 0)
            n++;
        else
            REQUIRE(r == -1); /* refused: closed without a word */
    }
    *admitted = n;
    tu_sleep_ms(300); /* hold them while the victim counts */
    for (int i = 0; i < FLOOD; i++)
        close(socks[i]);
    return 0;
}

static int stranger(void *arg)
{
    (void)arg;
    REQUIRE(setgroups(0, NULL) == 0);
    REQUIRE(setgid(65534) == 0 && setuid(65534) == 0);
    int s = connect_to(sock_path);
    REQUIRE(s >= 0); /* the test opened the socket's mode */
    int64_t v;
    int fd = -1;
    return raw_recv(s, &v, &fd, 5000) == -1 ? 0 : 1;
}

static void test_fd_flood(void)
{
    char per_uid[8];
    snprintf(per_uid, sizeof per_uid, "%d", PER_UID);
    const char *extra[] = {"-n", "4", "-g", "0", "--max-clients-per-uid",
                           per_uid, NULL};
    if (!start_server(extra))
        return;
    int64_t id = -1;
    int shm = -1;
    int victim = raw_attach(4, 0, &id, &shm);
    CHECK(victim >= 0);
    int *admitted = mmap(NULL, sizeof *admitted, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    *admitted = -1;
    pid_t p = tu_fork(flooder, admitted);
    /* the victim reads while the flood goes on: 4 fds per admitted one */
    int fds = 0, leaves = 0;
    uint64_t end = ivshm_now_ns() + 10000000000ull;
    while (ivshm_now_ns() < end && leaves < PER_UID) {
        int64_t v;
        int fd = -1;
        int r = raw_recv(victim, &v, &fd, 100);
        CHECK(r >= 0);
        if (r < 0)
            break;
        if (r == 1 && fd >= 0) {
            fds++;
            close(fd);
        } else if (r == 1) {
            leaves++;
        }
    }
    CHECK_RC(tu_wait(p, 20000), 0);
    printf("flood: %d of %d connections admitted, victim got %d eventfds\n",
           *admitted, FLOOD, fds);
    CHECK(*admitted == PER_UID);
    CHECK(fds == PER_UID * 4 && leaves == PER_UID);
    /* the victim's connection survives: a newcomer is announced */
    int64_t nid = -1, v;
    int nshm = -1, fd = -1;
    int n = raw_attach(4, 1, &nid, &nshm);
    CHECK(n >= 0);
    CHECK(raw_recv(victim, &v, &fd, 2000) == 1 && v == nid && fd >= 0);
    if (fd >= 0)
        close(fd);
    if (n >= 0) {
        close(n);
        close(nshm);
    }
    /* a uid outside the group, with the socket's mode opened by mistake,
       is refused by the SO_PEERCRED check */
    CHECK(chmod(sock_path, 0666) == 0);
    p = tu_fork(stranger, NULL);
    CHECK_RC(tu_wait(p, 10000), 0);
    CHECK(state_has_peer((int32_t)id));
    munmap(admitted, sizeof *admitted);
    close(victim);
    close(shm);
    stop_server();
}

/* A victim at its RLIMIT_NOFILE: joins whose eventfds do not fit are
   skipped, the server connection is kept (caps misconfigured, or a
   victim with a tiny limit). Paced through a pipe with the parent. */
struct victim_pipes {
    int to_parent, from_parent;
};

static int victim_at_limit(void *arg)
{
    struct victim_pipes *p = arg;
    ivshm_config cfg = {.job_id = JOB, .rank = 5, .name = "victim"};
    ivshm *h = NULL;
    REQUIRE(ivshm_attach_server(sock_path, &cfg, &h) == 0);
    int32_t ids[16];
    int vec[16];
    REQUIRE(TU_EVENTUALLY(ivshm_server_peers(h, ids, vec, 16) == 1 && vec[0] == 4,
                       2000));
    /* room for two more fds only */
    int probe = open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(probe >= 0);
    close(probe);
    struct rlimit old, low;
    REQUIRE(getrlimit(RLIMIT_NOFILE, &old) == 0);
    low = old;
    low.rlim_cur = (rlim_t)probe + 2;
    REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
    REQUIRE(write(p->to_parent, "a", 1) == 1);
    char go;
    REQUIRE(read(p->from_parent, &go, 1) == 1); /* two peers joined */
    /* drains the notices; a peer none of whose fds fitted is not listed */
    int n = ivshm_server_peers(h, ids, vec, 16);
    int got = 0;
    for (int i = 0; i < n; i++)
        got += vec[i];
    REQUIRE(n >= 2 && got == 4 + 2); /* ours, and the two fds that fitted */
    REQUIRE(setrlimit(RLIMIT_NOFILE, &old) == 0);
    REQUIRE(write(p->to_parent, "b", 1) == 1);
    REQUIRE(read(p->from_parent, &go, 1) == 1); /* a third one joined */
    /* still connected: the newcomer arrives whole */
    REQUIRE(TU_EVENTUALLY((n = ivshm_server_peers(h, ids, vec, 16)) == 3 ||
                           n == 4, 2000));
    got = 0;
    for (int i = 0; i < n; i++)
        got += vec[i];
    REQUIRE(got == 4 + 2 + 4);
    ivshm_detach(h);
    return 0;
}

static void test_victim_fd_limit(void)
{
    const char *extra[] = {"-n", "4", NULL};
    if (!start_server(extra))
        return;
    int up[2], down[2];
    CHECK(pipe2(up, O_CLOEXEC) == 0 && pipe2(down, O_CLOEXEC) == 0);
    struct victim_pipes vp = {up[1], down[0]};
    pid_t p = tu_fork(victim_at_limit, &vp);
    char c = 0;
    struct pollfd pf = {.fd = up[0], .events = POLLIN};
    CHECK(poll(&pf, 1, 10000) == 1 && read(up[0], &c, 1) == 1 && c == 'a');
    int64_t id[3];
    int sock[3] = {-1, -1, -1}, shm[3] = {-1, -1, -1};
    for (int i = 0; i < 2; i++)
        sock[i] = raw_attach(4, 1 + i, &id[i], &shm[i]);
    CHECK(sock[0] >= 0 && sock[1] >= 0);
    CHECK(write(down[1], "x", 1) == 1);
    CHECK(poll(&pf, 1, 10000) == 1 && read(up[0], &c, 1) == 1 && c == 'b');
    sock[2] = raw_attach(4, 3, &id[2], &shm[2]);
    CHECK(sock[2] >= 0);
    CHECK(write(down[1], "x", 1) == 1);
    CHECK_RC(tu_wait(p, 20000), 0);
    for (int i = 0; i < 3; i++) {
        if (sock[i] >= 0)
            close(sock[i]);
        if (shm[i] >= 0)
            close(shm[i]);
    }
    close(up[0]);
    close(up[1]);
    close(down[0]);
    close(down[1]);
    stop_server();
}

/* ---- 4. malformed clients ---- */

static void test_malformed(void)
{
    if (!start_server(NULL))
        return;
    int64_t id = -1, gid_ = -1, hid = -1, tid = -1;
    int shm = -1, gshm = -1, hshm = -1, tshm = -1;
    int good = raw_attach(1, 0, &id, &shm);
    int garbage = raw_attach(1, 1, &gid_, &gshm);
    int half = raw_attach(1, 2, &hid, &hshm);
    int torn = raw_attach(1, 3, &tid, &tshm);
    CHECK(good >= 0 && garbage >= 0 && half >= 0 && torn >= 0);
    if (good < 0 || garbage < 0 || half < 0 || torn < 0) {
        stop_server();
        return;
    }
    /* let the join notices reach everyone before anybody misbehaves */
    CHECK(TU_EVENTUALLY(state_has_peer((int32_t)tid), 2000));
    static const char junk[] = "GET / HTTP/1.0\r\n\r\n";
    CHECK(write(garbage, junk, sizeof junk) == (ssize_t)sizeof junk);
    CHECK(shutdown(half, SHUT_WR) == 0);
    uint8_t four[4] = {1, 2, 3, 4};
    CHECK(write(torn, four, sizeof four) == 4);
    CHECK(closed_by_server(garbage, 3000));
    CHECK(closed_by_server(half, 3000));
    CHECK(closed_by_server(torn, 3000));
    /* the good one: three joins, then three leaves, and still connected */
    int joins = 0, leaves = 0;
    for (;;) {
        int64_t v;
        int fd = -1;
        int r = raw_recv(good, &v, &fd, 500);
        CHECK(r >= 0);
        if (r <= 0)
            break;
        if (fd >= 0) {
            joins++;
            close(fd);
        } else {
            leaves++;
        }
    }
    CHECK(joins == 3 && leaves == 3);
    CHECK(state_has_peer((int32_t)id) && !state_has_peer((int32_t)gid_) &&
          !state_has_peer((int32_t)hid) && !state_has_peer((int32_t)tid));
    int fds[] = {good, garbage, half, torn, shm, gshm, hshm, tshm};
    for (size_t i = 0; i < sizeof fds / sizeof *fds; i++)
        close(fds[i]);
    stop_server();
}

/* ---- 5. links are not followed ---- */

static void test_no_links_followed(void)
{
    /* host-file mode at a dangling link: refused, the target not made */
    CHECK(symlink(victim_path, link_path) == 0);
    char *args[] = {"ivshmem-server", "-F", "-S", sock_path, "-M", link_path,
                    NULL};
    fflush(NULL);
    pid_t p = tu_fork_child();
    if (p == 0) {
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 2);
        execv(server_bin, args);
        _exit(127);
    }
    CHECK_RC(tu_wait(p, 5000), 1);
    CHECK(!tu_exists(victim_path) && !tu_exists(sock_path));
    unlink(link_path);

    /* a link planted at the state file's temporary: replaced, not
       written through */
    int vfd = open(victim_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    CHECK(vfd >= 0 && write(vfd, "precious\n", 9) == 9);
    close(vfd);
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", state_path);
    CHECK(symlink(victim_path, tmp) == 0);
    if (start_server(NULL)) {
        const char *text = tu_read_text(victim_path);
        CHECK(text && strcmp(text, "precious\n") == 0);
        text = tu_read_text(state_path);
        CHECK(text && strstr(text, "\"peers\":[]"));
        stop_server();
    }
    CHECK(!tu_exists(tmp));
    unlink(victim_path);
}

/* ---- new options: bad values are one line and exit 2 ---- */

static void test_bad_options(void)
{
    char *cases[][8] = {
        {"ivshmem-server", "-F", "-S", sock_path, "--keep-shm", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "--max-clients", "0", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "--max-clients", "x", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "--max-clients-per-uid",
         "99999", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "-M", "", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int pfd[2];
        CHECK(pipe2(pfd, O_CLOEXEC) == 0);
        fflush(NULL);
        pid_t p = tu_fork_child();
        if (p == 0) {
            dup2(pfd[1], 2);
            execv(server_bin, cases[i]);
            _exit(127);
        }
        close(pfd[1]);
        CHECK_RC(tu_wait(p, 5000), 2);
        char err[1024];
        ssize_t n = read(pfd[0], err, sizeof err - 1);
        close(pfd[0]);
        err[n > 0 ? n : 0] = '\0';
        int lines = 0;
        for (char *c = err; *c; c++)
            lines += *c == '\n';
        CHECK(lines == 1);
        if (lines != 1)
            fprintf(stderr, "  case %zu printed: %s", i, err);
    }
    CHECK(!tu_exists(sock_path));
}

int main(void)
{
    server_bin = tu_server_bin();
    if (!server_bin)
        return 1;
    owner_pid = getpid();
    int me = (int)getpid();
    snprintf(sock_path, sizeof sock_path, "/tmp/ivshm-sec-%d.sock", me);
    snprintf(state_path, sizeof state_path, "/tmp/ivshm-sec-%d.json", me);
    snprintf(link_path, sizeof link_path, "/tmp/ivshm-sec-%d.link", me);
    snprintf(victim_path, sizeof victim_path, "/tmp/ivshm-sec-%d.victim", me);
    tu_cleanup_on_exit(cleanup);
    alarm(240);

    test_bad_options();
    test_sealed_region();
    test_storm();
    if (geteuid() == 0)
        test_fd_flood();
    else
        printf("test_fd_flood: needs root (a second uid): skipped\n");
    test_victim_fd_limit();
    test_malformed();
    test_no_links_followed();
    return tu_summary("test_server_sec");
}

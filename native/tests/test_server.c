/* ivshmem-server end to end: options, modes, state and pid files, two
   host peers talking through the eventfd doorbell, a SIGKILLed peer seen
   dead in bounded time, fresh ids, the server marking the registry
   (with and without leave notices), SIGTERM clean-up, daemon mode; and the client against a scripted fake
   server that sends malformed messages. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"
#include "test_server_raw.h"

#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define JOB 0x5e7
#define ROUNDS 100
#define CHILD_TIMEOUT_MS 30000

static const char *server_bin;
static pid_t owner_pid;
static pid_t server_pid = -1;
/* main server instance, daemon instance, fake server */
static char sock_path[108], shm_path[128], state_path[128], pid_path[128];
static char d_sock[108], d_shm[128], d_pid[128], d_sock2[108];
static char f_sock[108];
/* the server with --no-leave-notices */
static char q_sock[108], q_state[128];
static pid_t q_pid = -1;

/* Test bookkeeping shared by the parent and its children. */
struct board {
    _Atomic int32_t id_a, id_b, id_c;
    _Atomic int a_attached, b_attached, c_attached;
    _Atomic int b_done, a_waiting, a_checked, c_done;
    _Atomic uint64_t kill_ns, dead_after_ns;
    _Atomic uint64_t sent_ns[ROUNDS], recv_ns[ROUNDS];
};
static struct board *board;

static pid_t read_pidfile(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int pid = -1;
    if (fscanf(f, "%d", &pid) != 1)
        pid = -1;
    fclose(f);
    return pid;
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
    if (q_pid > 0) {
        kill(q_pid, SIGKILL);
        waitpid(q_pid, NULL, 0);
        q_pid = -1;
    }
    pid_t d = read_pidfile(d_pid);
    if (d > 0)
        kill(d, SIGKILL);
    const char *paths[] = {sock_path, shm_path, state_path, pid_path, d_sock,
                           d_shm, d_pid, d_sock2, f_sock, q_sock, q_state};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
        if (paths[i][0])
            unlink(paths[i]);
}

static bool state_has_peer(const char *path, int32_t id, int vectors)
{
    char want[64];
    snprintf(want, sizeof want, "{\"id\":%d,\"vectors\":%d}", (int)id, vectors);
    const char *text = tu_read_text(path);
    return text && strstr(text, want);
}

static pid_t spawn_server(char *const args[])
{
    fflush(NULL);
    pid_t pid = tu_fork_child();
    if (pid == 0) {
        execv(server_bin, args);
        _exit(127);
    }
    return pid;
}

/* Run the server to completion (it must exit within 5 s); its stderr is
   returned in `err`. Returns the exit status or -1. */
static int run_server(char *const args[], char *err, size_t cap)
{
    int pipefd[2];
    if (pipe(pipefd) < 0)
        return -1;
    fflush(NULL);
    pid_t pid = tu_fork_child();
    if (pid == 0) {
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        close(pipefd[1]);
        execv(server_bin, args);
        _exit(127);
    }
    close(pipefd[1]);
    size_t got = 0;
    uint64_t end = ivshm_now_ns() + 5000000000ull;
    for (;;) {
        struct pollfd p = {.fd = pipefd[0], .events = POLLIN};
        uint64_t now = ivshm_now_ns();
        if (now >= end || poll(&p, 1, (int)((end - now) / 1000000) + 1) <= 0)
            break;
        ssize_t n = read(pipefd[0], err + got, cap - 1 - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    err[got] = '\0';
    close(pipefd[0]);
    return tu_wait(pid, 5000);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* ---- bad command lines ---- */

static void test_bad_options(void)
{
    char *cases[][8] = {
        {"ivshmem-server", "-F", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "-l", "3M", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "--bogus", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "-n", "0", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "-n", "65", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "-l", "12Q", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "-l", "1M", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "--ring-slots", "3", NULL},
        {"ivshmem-server", "-F", "-S", sock_path, "stray", NULL},
        {"ivshmem-server", "-F", "-S", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char err[1024];
        int st = run_server(cases[i], err, sizeof err);
        CHECK_RC(st, 2);
        CHECK(count_lines(err) == 1);
        if (st != 2 || count_lines(err) != 1)
            fprintf(stderr, "  case %zu printed: %s", i, err);
    }
    CHECK(!tu_exists(sock_path) && !tu_exists(shm_path));
}

/* ---- peers ---- */

static int wait_find(ivshm *h, uint32_t rank)
{
    int slot = -ENOENT;
    TU_EVENTUALLY((slot = ivshm_find(h, JOB, rank)) >= 0, 10000);
    return slot;
}

/* Does the server list `id` with `vectors` eventfds? */
static bool server_lists(ivshm *h, int32_t id, int vectors)
{
    int32_t ids[16];
    int vec[16];
    int n = ivshm_server_peers(h, ids, vec, 16);
    for (int i = 0; i < n; i++)
        if (ids[i] == id)
            return vec[i] == vectors;
    return false;
}

static ivshm *attach_rank(uint32_t rank, const char *name)
{
    /* this server runs in host-file mode (-M): an unsealed region */
    ivshm_config cfg = {.job_id = JOB, .rank = rank, .spin_ns = 1000,
                        .name = name, .flags = IVSHM_F_UNSEALED};
    ivshm *h = NULL;
    int rc = ivshm_attach_server(sock_path, &cfg, &h);
    if (rc < 0) {
        fprintf(stderr, "[%s] attach_server: %s\n", name, ivshm_strerror(rc));
        _exit(98);
    }
    return h;
}

static int32_t my_doorbell(ivshm *h)
{
    ivshm_peer_info me;
    REQUIRE(ivshm_peer(h, ivshm_self(h), &me) == 0);
    return me.doorbell_id;
}

static int child_a(void *arg)
{
    (void)arg;
    ivshm *h = attach_rank(0, "a");
    board->id_a = my_doorbell(h);
    REQUIRE(ivshm_event_fd(h) >= 0);
    board->a_attached = 1;
    int b = wait_find(h, 1);
    REQUIRE(b >= 0);
    REQUIRE(TU_EVENTUALLY(server_lists(h, board->id_b, 1), 2000));
    REQUIRE(server_lists(h, board->id_a, 1));

    /* B pauses before each send, so we are asleep on the eventfd. */
    for (uint32_t i = 0; i < ROUNDS; i++) {
        uint64_t v = 0;
        uint32_t tag = 0;
        int src = -1;
        ssize_t n = ivshm_recv(h, b, &src, &tag, &v, sizeof v, 5000);
        board->recv_ns[i] = ivshm_now_ns();
        REQUIRE(n == 8 && src == b && tag == i && v == i * 3u);
        v++;
        REQUIRE(ivshm_send(h, b, i, &v, sizeof v) == 0);
    }
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    printf("a: %llu sleeps, %llu rings\n", (unsigned long long)st.sleeps,
           (unsigned long long)st.rings);
    fflush(stdout);
    REQUIRE(st.sleeps > 0);

    /* Block on B while the parent SIGKILLs it. */
    REQUIRE(TU_EVENTUALLY(board->b_done, 10000));
    board->a_waiting = 1;
    uint64_t v;
    ssize_t rc = ivshm_recv(h, b, NULL, NULL, &v, sizeof v, 10000);
    uint64_t now = ivshm_now_ns();
    if (rc != IVSHM_EPEERDEAD)
        fprintf(stderr, "a: recv from killed peer: %s\n", ivshm_strerror((int)rc));
    REQUIRE(rc == IVSHM_EPEERDEAD);
    REQUIRE(board->kill_ns != 0);
    board->dead_after_ns = now - board->kill_ns;
    ivshm_peer_info info;
    REQUIRE(ivshm_peer(h, b, &info) == -ENOENT);
    REQUIRE(ivshm_find(h, JOB, 1) == -ENOENT);
    uint32_t state = atomic_load(&ivshm_entry(h, b)->state);
    REQUIRE(state == PEER_DEAD || state == PEER_FREE);
    REQUIRE(TU_EVENTUALLY(!server_lists(h, board->id_b, 1), 2000));
    board->a_checked = 1;

    /* A newcomer takes the lowest free id, and we can talk to it. */
    REQUIRE(TU_EVENTUALLY(board->c_attached, 10000));
    int c = wait_find(h, 2);
    REQUIRE(c >= 0);
    REQUIRE(TU_EVENTUALLY(server_lists(h, board->id_c, 1), 2000));
    uint64_t hello = 77;
    REQUIRE(ivshm_send(h, c, 77, &hello, sizeof hello) == 0);
    REQUIRE(TU_EVENTUALLY(board->c_done, 10000)); /* stay findable till then */
    ivshm_detach(h);
    return 0;
}

static int child_b(void *arg)
{
    (void)arg;
    ivshm *h = attach_rank(1, "b");
    board->id_b = my_doorbell(h);
    board->b_attached = 1;
    int a = wait_find(h, 0);
    REQUIRE(a >= 0);
    for (uint32_t i = 0; i < ROUNDS; i++) {
        tu_sleep_ms(1);
        uint64_t v = i * 3u;
        board->sent_ns[i] = ivshm_now_ns();
        REQUIRE(ivshm_send(h, a, i, &v, sizeof v) == 0);
        uint32_t tag = 0;
        REQUIRE(ivshm_recv(h, a, NULL, &tag, &v, sizeof v, 5000) == 8);
        REQUIRE(tag == i && v == i * 3u + 1);
    }
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    printf("b: %llu sleeps, %llu rings\n", (unsigned long long)st.sleeps,
           (unsigned long long)st.rings);
    fflush(stdout);
    REQUIRE(st.rings > 0);
    board->b_done = 1;
    for (int i = 0; i < 300; i++)
        tu_sleep_ms(100); /* until SIGKILL */
    return 3;
}

static int child_c(void *arg)
{
    (void)arg;
    ivshm *h = attach_rank(2, "c");
    board->id_c = my_doorbell(h);
    board->c_attached = 1;
    int a = wait_find(h, 0);
    REQUIRE(a >= 0);
    uint64_t v = 0;
    uint32_t tag = 0;
    REQUIRE(ivshm_recv(h, a, NULL, &tag, &v, sizeof v, 10000) == 8);
    REQUIRE(tag == 77 && v == 77);
    board->c_done = 1;
    ivshm_detach(h);
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* A host-file region (this server runs with -M) can be truncated by
   anyone who can open the file: attach_server refuses it unless asked. */
static void test_unsealed_refused(void)
{
    ivshm_config cfg = {.job_id = JOB, .rank = 30};
    ivshm *h = NULL;
    CHECK_RC(ivshm_attach_server(sock_path, &cfg, &h), -EPERM);
    CHECK(h == NULL);
    cfg.flags = IVSHM_F_UNSEALED;
    CHECK_RC(ivshm_attach_server(sock_path, &cfg, &h), 0);
    if (h)
        ivshm_detach(h);
}

static void test_peers(void)
{
    pid_t a = tu_fork(child_a, NULL);
    CHECK(TU_EVENTUALLY(board->a_attached, 10000));
    /* B connects after A: ids 0 and 1, so the newcomer C must get 1. */
    pid_t b = tu_fork(child_b, NULL);
    CHECK(TU_EVENTUALLY(board->b_attached, 10000));
    CHECK(board->id_a == 0 && board->id_b == 1);
    CHECK(TU_EVENTUALLY(state_has_peer(state_path, board->id_a, 1) &&
                     state_has_peer(state_path, board->id_b, 1), 2000));

    bool pingpong = TU_EVENTUALLY(board->b_done, 20000);
    CHECK(pingpong);
    if (pingpong) {
        /* Woken by the doorbell, not by the 20 ms liveness slices. */
        uint64_t lat[ROUNDS];
        for (int i = 0; i < ROUNDS; i++)
            lat[i] = board->recv_ns[i] - board->sent_ns[i];
        qsort(lat, ROUNDS, sizeof *lat, cmp_u64);
        printf("wake-up latency: median %.1f us, max %.1f us\n",
               lat[ROUNDS / 2] / 1e3, lat[ROUNDS - 1] / 1e3);
        CHECK(lat[ROUNDS / 2] < 5000000);
    }

    CHECK(TU_EVENTUALLY(board->a_waiting, 10000));
    tu_sleep_ms(200); /* let A block in ivshm_recv */
    board->kill_ns = ivshm_now_ns();
    kill(b, SIGKILL);
    CHECK_RC(tu_wait(b, 5000), -1);
    CHECK(TU_EVENTUALLY(board->a_checked, 10000));
    printf("killed peer seen dead after %.1f ms\n", board->dead_after_ns / 1e6);
    CHECK(board->dead_after_ns > 0 && board->dead_after_ns < 2000000000ull);
    CHECK(TU_EVENTUALLY(!state_has_peer(state_path, board->id_b, 1), 2000));

    pid_t c = tu_fork(child_c, NULL);
    CHECK_RC(tu_wait(c, CHILD_TIMEOUT_MS), 0);
    CHECK_RC(tu_wait(a, CHILD_TIMEOUT_MS), 0);
    /* ids are not reused while others are free (QEMU mishandles reuse) */
    CHECK(board->id_c > board->id_b);
}

/* ---- the server marks the registry when a connection ends ---- */

/* Read the opening burst of a raw connection to `path` with one vector:
   returns the socket, our id, the region fd and our vector-0 eventfd.
   Messages about peers already connected are checked to carry one fd
   each. */
static int raw_attach(const char *path, int64_t *id, int *shm_fd,
                      int *vec_fd, int npeers)
{
    int sock = connect_to(path);
    if (sock < 0)
        return -1;
    int64_t version = -2, marker = 0, v;
    int fd = -1;
    bool ok = raw_recv(sock, &version, &fd, 5000) == 1 && version == 0 && fd < 0 &&
              raw_recv(sock, id, &fd, 5000) == 1 && *id >= 0 && fd < 0 &&
              raw_recv(sock, &marker, shm_fd, 5000) == 1 && marker == -1 && *shm_fd >= 0;
    for (int i = 0; ok && i < npeers; i++) {
        ok = raw_recv(sock, &v, &fd, 5000) == 1 && v != *id && fd >= 0;
        if (fd >= 0)
            close(fd);
    }
    ok = ok && raw_recv(sock, &v, vec_fd, 5000) == 1 && v == *id && *vec_fd >= 0;
    CHECK(ok);
    return sock;
}

/* A registry entry whose owner is alive (our own pid) but whose server
   connection ends must be marked DEAD by the server itself: that is all
   a guest's peers ever learn about a VM that went away. The remaining
   client gets a ring on vector 0, and a leave notice unless the server
   runs with --no-leave-notices. The stayer's socket and the leaver's id
   are returned for the caller's id checks. */
static int leaver_marked(const char *path, const char *state,
                         bool notices, int64_t *left_id)
{
    /* earlier peers are gone from the server's table too */
    CHECK(TU_EVENTUALLY(tu_read_text(state) &&
                         strstr(tu_read_text(state), "\"peers\":[]"), 5000));
    int64_t stay_id = -1, gone_id = -1, v = -1;
    int stay_shm = -1, stay_vec = -1, gone_shm = -1, gone_vec = -1, fd = -1;
    int stay = raw_attach(path, &stay_id, &stay_shm, &stay_vec, 0);
    int gone = stay >= 0 ? raw_attach(path, &gone_id, &gone_shm, &gone_vec, 1)
                         : -1;
    CHECK(stay >= 0 && gone >= 0);
    /* the stayer hears about the newcomer: one join, one fd */
    CHECK(stay >= 0 && raw_recv(stay, &v, &fd, 5000) == 1 && v == gone_id && fd >= 0);
    if (fd >= 0)
        close(fd);
    ivshm *h = NULL;
    if (gone >= 0 && ivshm_region_map(gone_shm, &h) == 0) {
        gone_shm = -1; /* owned by h */
        ivshm_config cfg = {.job_id = JOB, .rank = 40};
        CHECK_RC(ivshm_join(h, &cfg, (int32_t)gone_id, DB_UIO), 0);
        int self = ivshm_self(h);
        close(gone);
        gone = -1;
        if (self >= 0) {
            struct ivshm_peer_entry *e = ivshm_entry(h, self);
            CHECK(TU_EVENTUALLY(atomic_load(&e->state) == PEER_DEAD, 2000));
        }
        uint64_t count = 0;
        CHECK(TU_EVENTUALLY(read(stay_vec, &count, sizeof count) == 8, 2000));
        if (notices) {
            CHECK(raw_recv(stay, &v, &fd, 5000) == 1 && v == gone_id && fd < 0);
        } else {
            /* marked and rung above, so the leave is done: a notice
               would be in the socket by now */
            fd = -1;
            CHECK(raw_recv(stay, &v, &fd, 300) == 0);
            if (fd >= 0)
                close(fd);
        }
        ivshm_detach(h);
    } else {
        CHECK(!"map the server's region");
    }
    int fds[] = {gone, stay_shm, stay_vec, gone_shm, gone_vec};
    for (size_t i = 0; i < sizeof fds / sizeof *fds; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    *left_id = gone_id;
    return stay;
}

static void test_server_marks_registry(void)
{
    int64_t left = -1;
    int stay = leaver_marked(sock_path, state_path, true, &left);
    if (stay >= 0)
        close(stay);
}

/* --no-leave-notices: no leave notice, the registry marked all the same,
   and the leaver's id, which the stayer still knows, is not handed out
   while the stayer is connected (ids.h); it is once the stayer is gone.
   Two ids only, so that a newcomer would have to get that one. */
static void test_no_leave_notices(void)
{
    char *args[] = {"ivshmem-server", "-F", "-S", q_sock, "-s", q_state,
                    "-l", "32M", "--max-peers", "8", "--ring-slots", "16",
                    "--slot-size", "1024", "--max-clients", "2",
                    "--max-ids", "2", "--no-leave-notices", NULL};
    pid_t pid = spawn_server(args);
    q_pid = pid;
    CHECK(TU_EVENTUALLY(tu_exists(q_state), 5000));
    int64_t left = -1, v = -1;
    int fd = -1;
    int stay = leaver_marked(q_sock, q_state, false, &left);
    CHECK(stay >= 0 && left >= 0);
    /* refused: the only free id is the one the stayer knows */
    int late = connect_to(q_sock);
    CHECK(late >= 0 && raw_recv(late, &v, &fd, 5000) == -1);
    if (late >= 0)
        close(late);
    CHECK(raw_recv(stay, &v, &fd, 300) == 0);
    if (stay >= 0)
        close(stay);
    /* the stayer gone, the id is free again (once its own clean-up is
       done too: retried, within the per-process connect rate) */
    int64_t id = -1;
    for (int tries = 0; tries < 8 && id != left; tries++) {
        usleep(250000);
        int c = connect_to(q_sock);
        int64_t version = -1;
        id = -1;
        if (c >= 0 && raw_recv(c, &version, &fd, 5000) == 1 && version == 0)
            (void)raw_recv(c, &id, &fd, 5000);
        if (c >= 0)
            close(c);
    }
    CHECK(id == left);
    kill(pid, SIGTERM);
    CHECK_RC(tu_wait(pid, 5000), 0);
    q_pid = -1;
    CHECK(!tu_exists(q_sock) && !tu_exists(q_state));
}

/* ---- shutdown, daemon ---- */

static void test_sigterm(void)
{
    kill(server_pid, SIGTERM);
    CHECK_RC(tu_wait(server_pid, 5000), 0);
    server_pid = -1;
    CHECK(!tu_exists(sock_path));
    CHECK(!tu_exists(pid_path));
    CHECK(!tu_exists(state_path));
    CHECK(!tu_exists(shm_path));
}

static void test_daemon(void)
{
    char *args[] = {"ivshmem-server", "-S", d_sock, "-M", d_shm, "-p", d_pid,
                    "-g", "0", NULL};
    char err[1024];
    CHECK_RC(run_server(args, err, sizeof err), 0);
    pid_t pid = read_pidfile(d_pid);
    CHECK(pid > 0 && kill(pid, 0) == 0);
    struct stat st;
    CHECK(stat(d_sock, &st) == 0 && (st.st_mode & 0777) == 0660 && st.st_gid == 0);
    CHECK(stat(d_shm, &st) == 0 && (st.st_mode & 0777) == 0660 && st.st_gid == 0);

    /* a second server on the same socket refuses and leaves it alone */
    char *again[] = {"ivshmem-server", "-F", "-S", d_sock, "-M", shm_path, NULL};
    CHECK_RC(run_server(again, err, sizeof err), 1);
    CHECK(tu_exists(d_sock) && !tu_exists(shm_path));
    /* so does one asked to create an existing region file */
    char *clash[] = {"ivshmem-server", "-F", "-S", d_sock2, "-M", d_shm, NULL};
    CHECK_RC(run_server(clash, err, sizeof err), 1);
    CHECK(tu_exists(d_shm) && !tu_exists(d_sock2));

    if (pid > 0)
        kill(pid, SIGTERM);
    CHECK(TU_EVENTUALLY(!tu_exists(d_sock) && !tu_exists(d_pid) && !tu_exists(d_shm), 5000));
}

/* ---- the client against a scripted fake server ---- */

#define STEP_FDS_SHM (-1) /* attach the region fd */
struct step {
    int64_t value;
    int nfds;             /* eventfds to attach, or STEP_FDS_SHM */
};

static void fake_send(int sock, int64_t value, const int *fds, int nfds)
{
    uint64_t le = htole64((uint64_t)value);
    struct iovec iov = {.iov_base = &le, .iov_len = sizeof le};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * 4)];
    } ctl;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        memset(&ctl, 0, sizeof ctl);
        m.msg_control = ctl.buf;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    REQUIRE(sendmsg(sock, &m, MSG_NOSIGNAL) == 8);
}

static int fake_listen(void)
{
    unlink(f_sock);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", f_sock);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || bind(s, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        listen(s, 4) < 0) {
        perror("fake server");
        exit(1);
    }
    return s;
}

static int fake_accept(int lsock)
{
    struct pollfd p = {.fd = lsock, .events = POLLIN};
    REQUIRE(poll(&p, 1, 5000) == 1);
    int c = accept(lsock, NULL, NULL);
    REQUIRE(c >= 0);
    return c;
}

/* Wait (bounded) until the client closes its end. */
static void fake_await_eof(int c)
{
    char b[64];
    for (;;) {
        struct pollfd p = {.fd = c, .events = POLLIN};
        REQUIRE(poll(&p, 1, 5000) == 1);
        if (read(c, b, sizeof b) <= 0)
            return;
    }
}

static int fake_run_steps(int c, int shm_fd, const struct step *steps, int n)
{
    for (int i = 0; i < n; i++) {
        int fds[4], k = steps[i].nfds;
        if (k == STEP_FDS_SHM) {
            fds[0] = shm_fd;
            k = 1;
        } else {
            for (int j = 0; j < k; j++)
                REQUIRE((fds[j] = eventfd(0, EFD_CLOEXEC)) >= 0);
        }
        fake_send(c, steps[i].value, fds, k);
        if (steps[i].nfds != STEP_FDS_SHM)
            for (int j = 0; j < k; j++)
                close(fds[j]);
    }
    return 0;
}

struct fake_script {
    const struct step *steps;
    int nsteps;
    int lsock, shm_fd;
    int extra_vectors; /* then this many (1 + eventfd) joins: too many */
    int go_fd;         /* fake_conversation: one byte per phase from the test */
};

static int fake_server(void *arg)
{
    struct fake_script *fs = arg;
    int c = fake_accept(fs->lsock);
    fake_run_steps(c, fs->shm_fd, fs->steps, fs->nsteps);
    for (int i = 0; i < fs->extra_vectors; i++) {
        struct step s = {1, 1};
        fake_run_steps(c, fs->shm_fd, &s, 1);
    }
    /* half a message, then the end of the stream */
    if (fs->nsteps == 0) {
        uint8_t half[4] = {0};
        REQUIRE(write(c, half, sizeof half) == 4);
        close(c);
        return 0;
    }
    fake_await_eof(c);
    return 0;
}

static void expect_attach(int lsock, int shm_fd, const struct step *steps,
                          int n, int extra, int want)
{
    struct fake_script fs = {steps, n, lsock, shm_fd, extra, -1};
    pid_t pid = tu_fork(fake_server, &fs);
    /* the fake server hands out unsealed fds: only the protocol counts */
    ivshm_config cfg = {.job_id = JOB, .rank = 9, .flags = IVSHM_F_UNSEALED};
    ivshm *h = NULL;
    CHECK_RC(ivshm_attach_server(f_sock, &cfg, &h), want);
    if (h)
        ivshm_detach(h);
    CHECK_RC(tu_wait(pid, 10000), 0);
}

/* The valid fake conversation: join/leave notices, rings both ways, then a
   malformed notice that must only cost us the server connection. */
static int fake_conversation(void *arg)
{
    struct fake_script *fs = arg;
    int c = fake_accept(fs->lsock);
    int peer_vec[2], own_vec[2];
    for (int j = 0; j < 2; j++) {
        REQUIRE((peer_vec[j] = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) >= 0);
        REQUIRE((own_vec[j] = eventfd(0, EFD_CLOEXEC)) >= 0);
    }
    fake_send(c, 0, NULL, 0);
    /* the id in two halves: framing must not depend on message boundaries */
    uint64_t le = htole64(3);
    REQUIRE(write(c, &le, 4) == 4);
    tu_sleep_ms(20);
    REQUIRE(write(c, (char *)&le + 4, 4) == 4);
    fake_send(c, -1, &fs->shm_fd, 1);
    fake_send(c, 1, &peer_vec[0], 1);
    fake_send(c, 1, &peer_vec[1], 1);
    fake_send(c, 3, &own_vec[0], 1);
    fake_send(c, 3, &own_vec[1], 1);

    /* phase 2: the client rang peer 1 once; leaves; we ring the client */
    char go;
    REQUIRE(read(fs->go_fd, &go, 1) == 1);
    uint64_t count = 0;
    REQUIRE(read(peer_vec[0], &count, sizeof count) == 8 && count == 1);
    fake_send(c, 1, NULL, 0);
    fake_send(c, 9, NULL, 0); /* unknown id: ignored */
    uint64_t one = 1;
    REQUIRE(write(own_vec[0], &one, sizeof one) == 8);

    /* phase 3: a leave notice carrying an fd with a negative id */
    REQUIRE(read(fs->go_fd, &go, 1) == 1);
    fake_send(c, -7, &peer_vec[1], 1);
    fake_await_eof(c);
    return 0;
}

static void test_fake_server(void)
{
    ivshm_geometry geo = {.max_peers = 4, .ring_slots = 4, .slot_size = 256,
                          .max_windows = 2};
    const char *region = tu_region(ivshm_min_region_size(&geo), &geo);
    int shm_fd = open(region, O_RDWR | O_CLOEXEC);
    int lsock = fake_listen();
    int fds_before = count_fds();

    const struct step bad_version[] = {{1, 0}};
    const struct step version_fd[] = {{0, 1}};
    const struct step id_range[] = {{0, 0}, {70000, 0}};
    const struct step id_fd[] = {{0, 0}, {0, 1}};
    const struct step no_shm_fd[] = {{0, 0}, {0, 0}, {-1, 0}};
    const struct step two_fds[] = {{0, 0}, {0, 0}, {-1, STEP_FDS_SHM}, {1, 2}};
    const struct step neg_id[] = {{0, 0}, {0, 0}, {-1, STEP_FDS_SHM}, {-5, 1}};
    const struct step big_id[] = {{0, 0}, {0, 0}, {-1, STEP_FDS_SHM}, {65536, 1}};
    const struct step own_leave[] = {{0, 0}, {0, 0}, {-1, STEP_FDS_SHM}, {0, 0}};
    const struct step eof_burst[] = {{0, 0}, {0, 0}, {-1, STEP_FDS_SHM}, {1, 1}};
    const struct step many_vec[] = {{0, 0}, {0, 0}, {-1, STEP_FDS_SHM}};
    const struct step none[] = {{0, 0}};
#define RUN(steps, extra, want) \
    expect_attach(lsock, shm_fd, steps, (int)(sizeof steps / sizeof *steps), extra, want)
    RUN(bad_version, 0, -EPROTONOSUPPORT);
    RUN(version_fd, 0, -EPROTO);
    RUN(id_range, 0, -EPROTO);
    RUN(id_fd, 0, -EPROTO);
    RUN(no_shm_fd, 0, -EPROTO);
    RUN(two_fds, 0, -EPROTO);
    RUN(neg_id, 0, -EPROTO);
    RUN(big_id, 0, -EPROTO);
    RUN(own_leave, 0, -EPROTO);
    RUN(many_vec, 65, -EPROTO);
#undef RUN
    /* the server hangs up mid-burst, and in the middle of a message */
    {
        struct fake_script fs = {eof_burst, 4, lsock, shm_fd, 0, -1};
        pid_t pid = tu_fork_child();
        if (pid == 0) {
            int c = fake_accept(lsock);
            fake_run_steps(c, shm_fd, fs.steps, fs.nsteps);
            close(c);
            _exit(0);
        }
        ivshm_config cfg = {.job_id = JOB, .rank = 9,
                            .flags = IVSHM_F_UNSEALED};
        ivshm *h = NULL;
        CHECK_RC(ivshm_attach_server(f_sock, &cfg, &h), -ECONNRESET);
        CHECK_RC(tu_wait(pid, 10000), 0);
    }
    expect_attach(lsock, shm_fd, none, 0, 0, -EPROTO);
    CHECK_RC(count_fds(), fds_before);

    /* the good conversation, paced by "go" bytes through a pipe */
    int go[2];
    CHECK(pipe(go) == 0);
    struct fake_script fs = {NULL, 0, lsock, shm_fd, 0, go[0]};
    pid_t pid = tu_fork(fake_conversation, &fs);
    ivshm_config cfg = {.job_id = JOB, .rank = 9,
                            .flags = IVSHM_F_UNSEALED};
    ivshm *h = NULL;
    CHECK_RC(ivshm_attach_server(f_sock, &cfg, &h), 0);
    if (h) {
        int32_t ids[8];
        int vec[8];
        /* no end-of-burst marker: the last vector may still be coming */
        CHECK(TU_EVENTUALLY(ivshm_server_peers(h, ids, vec, 8) == 2 &&
                             ids[0] == 1 && vec[0] == 2 && ids[1] == 3 &&
                             vec[1] == 2 && ids[2] == -1, 2000));
        CHECK_RC(ivshm_server_peers(h, ids, vec, 1), 1);
        /* a guest in the registry behind doorbell id 1 */
        ivshm *guest = NULL;
        CHECK_RC(ivshm_region_map(fcntl(shm_fd, F_DUPFD_CLOEXEC, 0), &guest), 0);
        ivshm_config gcfg = {.job_id = JOB, .rank = 10};
        CHECK_RC(ivshm_join(guest, &gcfg, 1, DB_UIO), 0);
        int gslot = ivshm_self(guest);
        CHECK(ivshm_find(h, JOB, 10) == gslot);
        CHECK_RC(h->db->ring(h->db, h, gslot, 1), 0);
        CHECK_RC(h->db->ring(h->db, h, gslot, 5), IVSHM_EPEERDEAD);
        CHECK_RC(h->db->ring(h->db, h, gslot, 70000), -EINVAL);
        CHECK_RC(h->db->ring(h->db, h, gslot, -1), -EINVAL);

        CHECK(write(go[1], "x", 1) == 1);
        struct pollfd p = {.fd = ivshm_event_fd(h), .events = POLLIN};
        CHECK(poll(&p, 1, 2000) == 1);
        CHECK(TU_EVENTUALLY(ivshm_server_peers(h, ids, vec, 8) == 1, 2000));
        CHECK(ids[0] == 3);
        CHECK(atomic_load(&ivshm_entry(h, gslot)->state) == PEER_DEAD);
        CHECK(ivshm_find(h, JOB, 10) == -ENOENT);
        CHECK_RC(h->db->ring(h->db, h, gslot, 1), IVSHM_EPEERDEAD);

        CHECK(write(go[1], "x", 1) == 1);
        /* The bad notice costs us the server connection (the fake sees
           EOF), nothing else: known peers and our own vectors stay. */
        uint64_t end = ivshm_now_ns() + 5000000000ull;
        int st = -1;
        while (ivshm_now_ns() < end) {
            ivshm_server_peers(h, ids, vec, 8); /* drains the notice */
            if (waitpid(pid, &st, WNOHANG) == pid)
                break;
            tu_sleep_ms(1);
        }
        CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
        if (st == -1)
            tu_wait(pid, 0); /* kills it */
        CHECK_RC(ivshm_server_peers(h, ids, vec, 8), 1);
        CHECK_RC(h->db->ring(h->db, h, ivshm_self(h), 3), 0);
        ivshm_registry_leave(guest);
        ivshm_region_unmap(guest);
        ivshm_detach(h);
    } else {
        kill(pid, SIGKILL);
        tu_wait(pid, 1000);
    }
    close(go[0]);
    close(go[1]);
    close(lsock);
    close(shm_fd);
    unlink(f_sock);
}

int main(void)
{
    server_bin = tu_server_bin();
    if (!server_bin)
        return 1;
    owner_pid = getpid();
    int me = (int)getpid();
    snprintf(sock_path, sizeof sock_path, "/tmp/ivshm-test-%d.sock", me);
    snprintf(shm_path, sizeof shm_path, "/dev/shm/ivshm-test-srv-%d", me);
    snprintf(state_path, sizeof state_path, "/tmp/ivshm-test-%d.json", me);
    snprintf(pid_path, sizeof pid_path, "/tmp/ivshm-test-%d.pid", me);
    snprintf(d_sock, sizeof d_sock, "/tmp/ivshm-test-%d-d.sock", me);
    snprintf(d_sock2, sizeof d_sock2, "/tmp/ivshm-test-%d-d2.sock", me);
    snprintf(d_shm, sizeof d_shm, "/dev/shm/ivshm-test-srv-%d-d", me);
    snprintf(d_pid, sizeof d_pid, "/tmp/ivshm-test-%d-d.pid", me);
    snprintf(f_sock, sizeof f_sock, "/tmp/ivshm-test-%d-f.sock", me);
    snprintf(q_sock, sizeof q_sock, "/tmp/ivshm-test-%d-q.sock", me);
    snprintf(q_state, sizeof q_state, "/tmp/ivshm-test-%d-q.json", me);
    tu_cleanup_on_exit(cleanup);
    board = mmap(NULL, sizeof *board, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (board == MAP_FAILED)
        return 1;

    test_bad_options();

    char *args[] = {"ivshmem-server", "-F", "-S", sock_path, "-M", shm_path,
                    "-s", state_path, "-p", pid_path, "-l", "32M",
                    "--max-peers", "8", "--ring-slots", "16", "--slot-size",
                    "1024", NULL};
    server_pid = spawn_server(args);
    bool up = TU_EVENTUALLY(tu_exists(state_path), 5000);
    CHECK(up);
    if (up) {
        struct stat st;
        CHECK(stat(sock_path, &st) == 0 && S_ISSOCK(st.st_mode) &&
              (st.st_mode & 0777) == 0600);
        CHECK(stat(shm_path, &st) == 0 && (st.st_mode & 0777) == 0600 &&
              st.st_size == 32 << 20);
        CHECK(read_pidfile(pid_path) == server_pid);
        const char *text = tu_read_text(state_path);
        CHECK(text && strstr(text, "\"peers\":[]") && strstr(text, "\"vectors\":1") &&
              strstr(text, "\"size\":33554432"));
        test_peers();
        test_server_marks_registry();
        test_unsealed_refused(); /* after the tests that count ids */
        test_sigterm();
    }
    test_no_leave_notices();
    test_daemon();
    test_fake_server();
    return tu_summary("test_server");
}

/* Our ivshmem-server with a real QEMU ivshmem-doorbell device, the region
   a sealed memfd (the server's default, no file): the VM
   (paused, no guest) must appear as a peer with 4 vectors, in the host
   client's view and in the state file, be ringable, and leave when QEMU
   is killed, taking down a registry entry "its guest" published.
   A hostile client then connects and closes more times than there are
   ids (65,536; the old server wrapped and QEMU 7.2 aborted with
   "free(): invalid pointer"): every id it is given is new, the rest of
   its connections are refused, and QEMU stays up and answers QMP. The
   ids come back once the clients that saw them leave are gone.
   Exits 77 (skip) only when qemu-system-x86_64 is not installed. */
#define _GNU_SOURCE
#include "internal.h"
#include "ivshm_admin.h"
#include "testutil.h"
#include "test_server_raw.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define JOB 0x9e4
#define VECTORS 4
#define IDS 65536
#define CHURN (IDS + 64)

static pid_t owner_pid, server_pid = -1, qemu_pid = -1;
static char sock_path[108], shm_path[128], state_path[128], qmp_path[108];

static void cleanup(void)
{
    if (getpid() != owner_pid)
        return;
    pid_t *pids[] = {&qemu_pid, &server_pid};
    for (int i = 0; i < 2; i++) {
        if (*pids[i] > 0) {
            kill(*pids[i], SIGKILL);
            waitpid(*pids[i], NULL, 0);
            *pids[i] = -1;
        }
    }
    unlink(sock_path);
    unlink(shm_path);
    unlink(state_path);
    unlink(qmp_path);
}

static bool find_on_path(const char *name, char *out, size_t cap)
{
    const char *path = getenv("PATH");
    if (!path)
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path) {
        size_t len = strcspn(path, ":");
        if (len > 0 && (size_t)snprintf(out, cap, "%.*s/%s", (int)len, path,
                                        name) < cap &&
            access(out, X_OK) == 0)
            return true;
        path += len + (path[len] == ':');
    }
    return false;
}

static bool state_has_peer(int32_t id, int vectors)
{
    char want[64];
    snprintf(want, sizeof want, "{\"id\":%d,\"vectors\":%d}", (int)id, vectors);
    const char *text = tu_read_text(state_path);
    return text && strstr(text, want) != NULL;
}

/* The first server peer other than `self` and its vector count, or -1. */
static int32_t other_peer(ivshm *h, int32_t self, int *vectors)
{
    int32_t ids[16];
    int vec[16];
    int n = ivshm_server_peers(h, ids, vec, 16);
    for (int i = 0; i < n; i++) {
        if (ids[i] != self) {
            *vectors = vec[i];
            return ids[i];
        }
    }
    return -1;
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Read until `want` bytes or `until` appears, EOF or 5 s; NUL-terminated. */
static size_t read_some(int s, char *buf, size_t cap, size_t want,
                        const char *until)
{
    size_t have = 0;
    buf[0] = '\0';
    while (have < want && have + 1 < cap && !(until && strstr(buf, until))) {
        struct pollfd p = {.fd = s, .events = POLLIN};
        if (poll(&p, 1, 5000) != 1)
            break;
        ssize_t n = recv(s, buf + have, cap - 1 - have, 0);
        if (n <= 0)
            break;
        have += (size_t)n;
        buf[have] = '\0';
    }
    return have;
}

/* Does QEMU answer QMP query-status? */
static bool qmp_answers(void)
{
    int s = connect_to(qmp_path);
    if (s < 0)
        return false;
    char buf[4096];
    static const char caps[] = "{\"execute\":\"qmp_capabilities\"}\n";
    static const char query[] = "{\"execute\":\"query-status\"}\n";
    bool ok = read_some(s, buf, sizeof buf, sizeof buf, "\n") > 0 &&
              strstr(buf, "QMP") &&
              send(s, caps, sizeof caps - 1, MSG_NOSIGNAL) > 0 &&
              read_some(s, buf, sizeof buf, sizeof buf, "\n") > 0 &&
              strstr(buf, "return") &&
              send(s, query, sizeof query - 1, MSG_NOSIGNAL) > 0 &&
              read_some(s, buf, sizeof buf, sizeof buf, "status") > 0 &&
              strstr(buf, "\"status\"");
    close(s);
    return ok;
}

/* One hostile connection: the id the server gave, or -1 when refused
   (closed without a word). The eventfds it was sent are dropped by the
   kernel, as the fd-less recv gives them no place. */
static int64_t connect_once(void)
{
    int s = connect_to(sock_path);
    if (s < 0)
        return -2;
    char buf[2 * sizeof(int64_t) + 1];
    size_t n = read_some(s, buf, sizeof buf, sizeof buf - 1, NULL);
    close(s);
    int64_t msg[2];
    memcpy(msg, buf, sizeof msg);
    return n == sizeof msg && msg[0] == 0 ? msg[1] : -1;
}

struct churn_result {
    int admitted, refused, errors, reused, min_id, max_id;
};

/* Connect and close CHURN times; no id may come twice. */
static int churn(void *arg)
{
    struct churn_result *r = arg;
    static bool seen[IDS];
    *r = (struct churn_result){.min_id = IDS, .max_id = -1};
    for (int i = 0; i < CHURN; i++) {
        int64_t id = connect_once();
        if (id == -2 || id < -2 || id >= IDS) {
            r->errors++;
        } else if (id == -1) {
            r->refused++;
        } else {
            r->admitted++;
            r->reused += seen[id];
            seen[id] = true;
            r->min_id = id < r->min_id ? (int)id : r->min_id;
            r->max_id = id > r->max_id ? (int)id : r->max_id;
        }
    }
    return 0;
}

int main(void)
{
    char qemu[4096];
    if (!find_on_path("qemu-system-x86_64", qemu, sizeof qemu)) {
        printf("test_qemu: qemu-system-x86_64 not found: skipped\n");
        return 77;
    }
    const char *server_bin = tu_server_bin();
    if (!server_bin)
        return 1;
    owner_pid = getpid();
    int me = (int)getpid();
    snprintf(sock_path, sizeof sock_path, "/tmp/ivshm-qtest-%d.sock", me);
    snprintf(shm_path, sizeof shm_path, "/dev/shm/ivshm-qtest-%d", me);
    snprintf(state_path, sizeof state_path, "/tmp/ivshm-qtest-%d.json", me);
    snprintf(qmp_path, sizeof qmp_path, "/tmp/ivshm-qtest-%d.qmp", me);
    tu_cleanup_on_exit(cleanup);

    char vec_arg[8];
    snprintf(vec_arg, sizeof vec_arg, "%d", VECTORS);
    /* Without the budgets (test_server_dos), so that one process can
       churn through every id: the id rule alone must keep QEMU safe. */
    char *sargs[] = {"ivshmem-server", "-F", "-S", sock_path,
                     "-s", state_path, "-n", vec_arg, "-l", "32M",
                     "--connect-rate-per-uid", "0", "--connect-rate-per-pid",
                     "0", "--ids-per-pid", "0", NULL};
    fflush(NULL);
    server_pid = tu_fork_child();
    if (server_pid == 0) {
        execv(server_bin, sargs);
        _exit(127);
    }
    if (!TU_EVENTUALLY(exists(state_path), 5000)) {
        CHECK(!"server started");
        return tu_summary("test_qemu");
    }

    ivshm_config cfg = {.job_id = JOB, .rank = 0, .name = "host"};
    ivshm *h = NULL;
    CHECK_RC(ivshm_attach_server(sock_path, &cfg, &h), 0);
    if (!h)
        return tu_summary("test_qemu");
    ivshm_peer_info me_info;
    CHECK_RC(ivshm_peer(h, ivshm_self(h), &me_info), 0);
    int32_t self_id = me_info.doorbell_id;
    /* The region QEMU maps too cannot be truncated under it. */
    CHECK_RC(ivshm_admin_sealed(h->map_fd), 1);
    CHECK(ftruncate(h->map_fd, 0) < 0 && errno == EPERM);
    CHECK(!exists(shm_path));
    int32_t ids[4];
    int vec[4];
    /* The protocol has no end-of-burst marker: our last vectors may
       still be in flight when attach returns. */
    CHECK(TU_EVENTUALLY(ivshm_server_peers(h, ids, vec, 4) == 1 &&
                         ids[0] == self_id && vec[0] == VECTORS, 2000));

    char chardev[256], device[128], qmp[160];
    snprintf(chardev, sizeof chardev, "socket,path=%s,id=ivs", sock_path);
    snprintf(device, sizeof device, "ivshmem-doorbell,chardev=ivs,vectors=%d",
             VECTORS);
    snprintf(qmp, sizeof qmp, "unix:%s,server=on,wait=off", qmp_path);
    char *qargs[] = {qemu, "-S", "-display", "none", "-nodefaults",
                     "-machine", "pc", "-chardev", chardev,
                     "-device", device, "-qmp", qmp, NULL};
    fflush(NULL);
    qemu_pid = tu_fork_child();
    if (qemu_pid == 0) {
        int null = open("/dev/null", O_RDWR);
        if (null >= 0)
            dup2(null, 0);
        execv(qemu, qargs);
        _exit(127);
    }

    int vectors = 0;
    int32_t vm_id = -1;
    CHECK(TU_EVENTUALLY((vm_id = other_peer(h, self_id, &vectors)) >= 0 &&
                         vectors == VECTORS, 10000));
    printf("QEMU joined as id %d with %d vectors\n", (int)vm_id, vectors);
    CHECK(vm_id >= 0 && vm_id != self_id && vectors == VECTORS);
    if (vm_id >= 0) {
        CHECK(TU_EVENTUALLY(state_has_peer(vm_id, VECTORS) &&
                             state_has_peer(self_id, VECTORS), 2000));

        /* What a guest would publish through BAR2: an entry behind the
           VM's doorbell id. Its pid is ours (alive), so only the
           server's leave handling can mark it dead. */
        ivshm *guest = NULL;
        CHECK_RC(ivshm_region_map(fcntl(h->map_fd, F_DUPFD_CLOEXEC, 0), &guest), 0);
        int gslot = -1;
        if (guest) {
            ivshm_config gcfg = {.job_id = JOB, .rank = 1, .name = "guest"};
            CHECK_RC(ivshm_join(guest, &gcfg, vm_id, DB_UIO), 0);
            gslot = ivshm_self(guest);
            CHECK(ivshm_find(h, JOB, 1) == gslot);
            /* Ring the VM's vector 0: QEMU takes the eventfd write. */
            CHECK_RC(h->db->ring(h->db, h, gslot, vm_id), 0);
        }

        /* More connect/close cycles than there are ids, while QEMU
           watches every one come and go. */
        CHECK(TU_EVENTUALLY(qmp_answers(), 5000)); /* its monitor is up */
        struct churn_result *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE,
                                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        uint64_t t0 = tu_now_ns();
        CHECK_RC(tu_wait(tu_fork(churn, r), 120000), 0);
        printf("churn: %d connections in %.1f s: %d admitted (ids %d..%d), "
               "%d refused\n", CHURN, (tu_now_ns() - t0) / 1e9, r->admitted,
               r->min_id, r->max_id, r->refused);
        /* ids 0 and 1 are ours and QEMU's; none comes back */
        CHECK(r->admitted == IDS - 2 && r->reused == 0 && r->errors == 0);
        CHECK(r->refused == CHURN - (IDS - 2));
        CHECK(r->min_id == 2 && r->max_id == IDS - 1);
        munmap(r, sizeof *r);
        CHECK(kill(qemu_pid, 0) == 0 && waitpid(qemu_pid, NULL, WNOHANG) == 0);
        CHECK(qmp_answers());
        if (guest)
            CHECK_RC(h->db->ring(h->db, h, gslot, vm_id), 0);
        /* still no id: we and QEMU saw them all leave */
        CHECK(connect_once() == -1);

        kill(qemu_pid, SIGKILL);
        waitpid(qemu_pid, NULL, 0);
        qemu_pid = -1;
        CHECK(TU_EVENTUALLY(other_peer(h, self_id, &vectors) < 0, 5000));
        CHECK(TU_EVENTUALLY(!state_has_peer(vm_id, VECTORS), 5000));
        if (gslot >= 0) {
            CHECK(TU_EVENTUALLY(ivshm_find(h, JOB, 1) == -ENOENT, 2000));
            CHECK(atomic_load(&ivshm_entry(h, gslot)->state) == PEER_DEAD);
            CHECK_RC(h->db->ring(h->db, h, gslot, vm_id), IVSHM_EPEERDEAD);
        }
        if (guest) {
            ivshm_registry_leave(guest);
            ivshm_region_unmap(guest);
        }
    }
    ivshm_detach(h);
    /* the clients that saw the churn are gone: ids are reused */
    int64_t again = -1;
    CHECK(TU_EVENTUALLY((again = connect_once()) >= 0, 2000));
    CHECK(again >= 0 && again < IDS);

    kill(server_pid, SIGTERM);
    CHECK_RC(tu_wait(server_pid, 5000), 0);
    server_pid = -1;
    CHECK(!exists(sock_path) && !exists(shm_path) && !exists(state_path));
    return tu_summary("test_qemu");
}

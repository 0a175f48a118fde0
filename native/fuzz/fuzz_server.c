/* libFuzzer: the server's side of the socket protocol, in process. The
   input is a script of client actions against a real ivs_server on a
   UNIX socket: connect, send garbage (with or without fds), half-close,
   close, read a little, run a server round. Whatever the clients do, the
   server must neither crash nor leak: at the end of every input all
   clients are gone from its table and it holds as many fds as before. */
#define _GNU_SOURCE
#include "server.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_SOCKS 6

static struct ivs_server *srv;
static char sock_path[108];

static void stop_server(void)
{
    ivs_server_stop(srv);
    srv = NULL;
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

static void setup(void)
{
    signal(SIGPIPE, SIG_IGN);
    ivs_log_target = IVS_LOG_QUIET;
    snprintf(sock_path, sizeof sock_path, "/tmp/ivshm-fuzz-%d.sock",
             (int)getpid());
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 4, .slot_size = 256,
                        .max_windows = 2};
    uint64_t size = 1;
    while (size < ivshm_min_region_size(&g))
        size <<= 1;
    struct ivs_config cfg = {.socket_path = sock_path, .size = size,
                             .vectors = 2, .geometry = g, .max_clients = 4,
                             .max_per_uid = 3};
    if (ivs_server_start(&cfg, &srv) < 0)
        __builtin_trap();
    atexit(stop_server);
}

static int connect_client(void)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, sock_path, strlen(sock_path) + 1);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0 &&
        errno != EAGAIN) {
        close(s);
        return -1;
    }
    return s;
}

/* Send `len` input bytes, with an fd of ours attached when asked. */
static void client_send(int s, const uint8_t *buf, size_t len, bool with_fd)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len ? len : 1};
    static const uint8_t zero;
    if (!len)
        iov.iov_base = (void *)&zero;
    union {
        struct cmsghdr align;
        char b[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    int fd = with_fd ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
    if (fd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        m.msg_control = ctl.b;
        m.msg_controllen = sizeof ctl.b;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t n = sendmsg(s, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)n;
    if (fd >= 0)
        close(fd);
}

/* Read up to `len` bytes without waiting; close every fd received. */
static void client_read(int s, size_t len)
{
    uint8_t buf[256];
    union {
        struct cmsghdr align;
        char b[CMSG_SPACE(sizeof(int) * 8)];
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = len < sizeof buf ? len + 1 : sizeof buf};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                       .msg_controllen = sizeof ctl.b};
    if (recvmsg(s, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0)
        return;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            close(fd);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!srv)
        setup();
    /* fds now, with no client: the same must be open at the end */
    int baseline_fds = count_fds();
    int socks[MAX_SOCKS];
    int n = 0;
    for (size_t i = 0; i < size;) {
        uint8_t op = data[i++];
        int k = n ? (op >> 3) % n : -1;
        switch (op & 7) {
        case 0:
        case 1:
            if (n < MAX_SOCKS && (socks[n] = connect_client()) >= 0)
                n++;
            break;
        case 2: { /* garbage, the length is the next byte */
            size_t len = i < size ? data[i++] % 16 : 0;
            if (len > size - i)
                len = size - i;
            if (k >= 0)
                client_send(socks[k], data + i, len, false);
            i += len;
            break;
        }
        case 3:
            if (k >= 0)
                client_send(socks[k], data + (i < size ? i : 0), i < size, true);
            break;
        case 4:
            if (k >= 0)
                shutdown(socks[k], SHUT_WR);
            break;
        case 5:
            if (k >= 0) {
                close(socks[k]);
                socks[k] = socks[--n];
            }
            break;
        case 6:
            if (k >= 0)
                client_read(socks[k], op >> 5);
            break;
        default:
            if (ivs_server_poll_once(srv, NULL, 0) < 0)
                __builtin_trap();
        }
    }
    while (n > 0)
        close(socks[--n]);
    /* Every client hung up: the server must notice each, in bounded time,
       including connections still in the listen backlog (accepted, then
       found hung up): three quiet rounds in a row with an empty table. */
    for (int round = 0, quiet = 0; quiet < 3; round++) {
        if (round > 2000 || ivs_server_poll_once(srv, NULL, 1) < 0)
            __builtin_trap();
        quiet = ivs_server_nclients(srv) ? 0 : quiet + 1;
    }
    if (count_fds() != baseline_fds)
        __builtin_trap();
    return 0;
}

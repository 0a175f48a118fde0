/*
 * TCP ping-pong reference for `ivcloud bench p2p` (loopback, or across two
 * network namespaces joined by a bridge).
 *
 *   tcp-pingpong server [--bind ADDR] [--port P] [--timeout S]
 *       Listens, prints "PORT <n>" once ready (so --port 0 works), serves
 *       one client, then exits.
 *   tcp-pingpong client --connect ADDR --port P [--sizes 8,64,...]
 *       [--iters N] [--budget BYTES] [--transport NAME] [--mode NAME]
 *       Prints one JSON line per size, like ivshm-pingpong.
 *
 * Protocol: for each size the client sends a 16-byte header {size, count}
 * and then `count` full-size messages, each echoed back whole by the
 * server before the next one; size 0 ends the connection. TCP_NODELAY on
 * both ends. The server trusts nothing: sizes are capped.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"

#define IO_TIMEOUT_MS 20000

struct header {
    uint64_t size;
    uint64_t count;
};

static void die(const char *what)
{
    fprintf(stderr, "tcp-pingpong[%d]: %s: %s\n", (int)getpid(), what,
            errno ? strerror(errno) : "failed");
    exit(1);
}

/* Wait (bounded) for the listening socket to have a client. */
static void wait_readable(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int rc;
    while ((rc = poll(&p, 1, IO_TIMEOUT_MS)) < 0 && errno == EINTR)
        ;
    if (rc == 0)
        errno = ETIMEDOUT;
    if (rc <= 0)
        die("waiting for a client");
}

/* Plain blocking I/O, as a TCP application would do it; the socket
   timeouts (SO_RCVTIMEO/SO_SNDTIMEO) turn a vanished peer into an error
   instead of a hang. */
static int read_full(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t n = recv(fd, p, len, 0);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n == 0) {
            return -1; /* orderly close */
        } else if (errno != EINTR) {
            die("recv");
        }
    }
    return 0;
}

static void write_full(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n < 0 && errno != EINTR) {
            die("send");
        }
    }
}

static void setup_stream(int fd)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0)
        die("TCP_NODELAY");
    struct timeval tv = {IO_TIMEOUT_MS / 1000, 0};
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
        die("socket timeouts");
}

static int resolve(const char *host, const char *port, struct addrinfo **out,
                   int passive)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    int rc = getaddrinfo(host, port, &hints, out);
    if (rc != 0) {
        fprintf(stderr, "tcp-pingpong: %s: %s\n", host ? host : "*",
                gai_strerror(rc));
        exit(1);
    }
    return 0;
}

static int run_server(const char *bind_addr, const char *port)
{
    struct addrinfo *ai;
    resolve(bind_addr, port, &ai, 1);
    int ls = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0)
        die("socket");
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, ai->ai_addr, ai->ai_addrlen) < 0)
        die("bind");
    freeaddrinfo(ai);
    if (listen(ls, 1) < 0)
        die("listen");
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(ls, (struct sockaddr *)&ss, &sl) < 0)
        die("getsockname");
    int bound = ss.ss_family == AF_INET6
                    ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                    : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    printf("PORT %d\n", bound);
    fflush(stdout);

    wait_readable(ls);
    int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
        die("accept");
    close(ls);
    setup_stream(fd);
    char *buf = NULL;
    size_t cap = 0;
    for (;;) {
        struct header h;
        if (read_full(fd, &h, sizeof h) < 0 || h.size == 0)
            break;
        if (h.size > BENCH_MAX_MSG) {
            errno = EMSGSIZE;
            die("header");
        }
        if (h.size > cap) {
            free(buf);
            cap = h.size;
            buf = malloc(cap);
            if (!buf)
                die("malloc");
        }
        for (uint64_t i = 0; i < h.count; i++) {
            if (read_full(fd, buf, h.size) < 0) {
                errno = ECONNRESET;
                die("client left mid-size");
            }
            write_full(fd, buf, h.size);
        }
    }
    free(buf);
    close(fd);
    return 0;
}

static int connect_to(const char *host, const char *port)
{
    struct addrinfo *ai;
    resolve(host, port, &ai, 0);
    /* the server may still be starting (another namespace): retry briefly */
    uint64_t deadline = bench_now_ns() + 10000000000ull;
    for (;;) {
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            die("socket");
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            freeaddrinfo(ai);
            return fd;
        }
        int e = errno;
        close(fd);
        if (bench_now_ns() > deadline) {
            errno = e;
            die("connect");
        }
        usleep(20000);
    }
}

static void usage(void)
{
    fprintf(stderr,
            "usage: tcp-pingpong server [--bind ADDR] [--port P] [--timeout S]\n"
            "       tcp-pingpong client --connect ADDR --port P [--sizes LIST]\n"
            "            [--iters N] [--budget BYTES] [--transport NAME]\n"
            "            [--mode NAME] [--timeout S]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        usage();
    const char *role = argv[1];
    const char *addr = NULL, *port = "0", *transport = "tcp-loopback",
               *mode = "nodelay";
    size_t sizes[BENCH_MAX_SIZES];
    int nsizes = 0;
    long iters = 10000, timeout_s = 300;
    uint64_t budget = 256u << 20;
    bench_parse_sizes(BENCH_DEFAULT_SIZES, sizes, &nsizes);
    for (int i = 2; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage();
        if (!strcmp(a, "--bind") || !strcmp(a, "--connect"))
            addr = v;
        else if (!strcmp(a, "--port"))
            port = v;
        else if (!strcmp(a, "--sizes")) {
            if (bench_parse_sizes(v, sizes, &nsizes) < 0)
                usage();
        } else if (!strcmp(a, "--iters"))
            iters = atol(v);
        else if (!strcmp(a, "--budget"))
            budget = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--transport"))
            transport = v;
        else if (!strcmp(a, "--mode"))
            mode = v;
        else if (!strcmp(a, "--timeout"))
            timeout_s = atol(v);
        else
            usage();
    }
    if (iters < 1 || timeout_s < 1 || budget < 1)
        usage();
    alarm((unsigned)timeout_s);
    if (!strcmp(role, "server"))
        return run_server(addr, port);
    if (strcmp(role, "client") || !addr || !strcmp(port, "0"))
        usage();

    int fd = connect_to(addr, port);
    setup_stream(fd);
    size_t cap = bench_max_size(sizes, nsizes);
    char *buf = malloc(cap);
    if (!buf)
        die("malloc");
    memset(buf, 0x3c, cap);
    for (int s = 0; s < nsizes; s++) {
        size_t size = sizes[s];
        struct bench_plan p = bench_plan_for(size, iters, budget);
        /* the server learns the whole count up front, warm-up included */
        struct header h = {size, (uint64_t)(p.warm + p.per * p.nb)};
        write_full(fd, &h, sizeof h);
        uint64_t batch[BENCH_NBATCH];
        for (int b = -1; b < p.nb; b++) {
            uint64_t t0 = bench_now_ns();
            long count = b < 0 ? p.warm : p.per;
            for (long i = 0; i < count; i++) {
                write_full(fd, buf, size);
                if (read_full(fd, buf, size) < 0) {
                    errno = ECONNRESET;
                    die("server closed");
                }
            }
            if (b >= 0)
                batch[b] = bench_now_ns() - t0;
        }
        bench_report_ns(transport, mode, size, batch, p.nb, p.per, 2);
    }
    struct header end = {0, 0};
    write_full(fd, &end, sizeof end);
    free(buf);
    close(fd);
    return 0;
}

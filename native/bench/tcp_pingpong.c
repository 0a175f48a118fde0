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
 * server before the next one; size 0 ends the session. TCP_NODELAY on
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

#define MAX_SIZES 64
#define MAX_MSG (64u << 20)
#define IO_TIMEOUT_MS 20000
#define NBATCH 5

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

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
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
        if (h.size > MAX_MSG) {
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
    uint64_t deadline = now_ns() + 10000000000ull;
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
        if (now_ns() > deadline) {
            errno = e;
            die("connect");
        }
        usleep(20000);
    }
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int parse_sizes(const char *s, size_t *sizes, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (end == s || errno)
            return -1;
        if (*end == 'k' || *end == 'K')
            v <<= 10, end++;
        else if (*end == 'm' || *end == 'M')
            v <<= 20, end++;
        if (v == 0 || v > MAX_MSG || *n == MAX_SIZES)
            return -1;
        sizes[(*n)++] = (size_t)v;
        if (*end == ',')
            end++;
        else if (*end)
            return -1;
        s = end;
    }
    return *n ? 0 : -1;
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
    size_t sizes[MAX_SIZES];
    int nsizes = 0;
    long iters = 10000, timeout_s = 300;
    uint64_t budget = 256u << 20;
    parse_sizes("8,64,512,4096,32768,262144,1048576,4194304", sizes, &nsizes);
    for (int i = 2; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage();
        if (!strcmp(a, "--bind") || !strcmp(a, "--connect"))
            addr = v;
        else if (!strcmp(a, "--port"))
            port = v;
        else if (!strcmp(a, "--sizes")) {
            if (parse_sizes(v, sizes, &nsizes) < 0)
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
    size_t cap = 8;
    for (int s = 0; s < nsizes; s++)
        if (sizes[s] > cap)
            cap = sizes[s];
    char *buf = malloc(cap);
    if (!buf)
        die("malloc");
    memset(buf, 0x3c, cap);
    for (int s = 0; s < nsizes; s++) {
        size_t size = sizes[s];
        uint64_t n = budget / size;
        if (n > (uint64_t)iters)
            n = (uint64_t)iters;
        if (n < 10)
            n = 10;
        /* median of NBATCH timed batches, as in ivshm-pingpong */
        int nb = n >= 10 * NBATCH ? NBATCH : 1;
        uint64_t per = n / (uint64_t)nb, warm = per / 5 + 2;
        struct header h = {size, warm + per * (uint64_t)nb};
        write_full(fd, &h, sizeof h);
        uint64_t batch[NBATCH];
        for (int b = -1; b < nb; b++) {
            uint64_t t0 = now_ns(), count = b < 0 ? warm : per;
            for (uint64_t i = 0; i < count; i++) {
                write_full(fd, buf, size);
                if (read_full(fd, buf, size) < 0) {
                    errno = ECONNRESET;
                    die("server closed");
                }
            }
            if (b >= 0)
                batch[b] = now_ns() - t0;
        }
        qsort(batch, (size_t)nb, sizeof batch[0], cmp_u64);
        double div = (double)per * 2 * 1e3;
        double lat_us = (double)batch[nb / 2] / div;
        printf("{\"transport\":\"%s\",\"mode\":\"%s\",\"size\":%zu,"
               "\"latency_us\":%.4f,\"bandwidth_MBps\":%.2f,\"iters\":%llu,"
               "\"latency_min_us\":%.4f,\"batches\":%d}\n",
               transport, mode, size, lat_us, (double)size / lat_us,
               (unsigned long long)(per * (uint64_t)nb),
               (double)batch[0] / div, nb);
        fflush(stdout);
    }
    struct header end = {0, 0};
    write_full(fd, &end, sizeof end);
    free(buf);
    close(fd);
    return 0;
}

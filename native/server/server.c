/*
 * ivshmem-server core: QEMU's ivshmem-doorbell protocol
 * (docs/server-protocol.md), single-threaded around one ppoll() loop.
 *
 * Every message is an 8-byte little-endian signed number, optionally with
 * one fd (SCM_RIGHTS). Sockets to clients are blocking with a send
 * timeout: a client that cannot take a message within SEND_TIMEOUT_MS is
 * dropped like one that disconnected, so one stuck VM cannot stall the
 * others for long and a message is never half-sent then forgotten.
 */
#define _GNU_SOURCE
#include "server.h"

#include "internal.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <syslog.h>
#include <unistd.h>

#define SEND_TIMEOUT_MS 1000
#define ACCEPTS_PER_ROUND 16

int ivs_log_target = IVS_LOG_STDERR;
int ivs_verbose;

static void vlog(int prio, const char *fmt, va_list ap)
{
    if (ivs_log_target == IVS_LOG_SYSLOG) {
        vsyslog(prio, fmt, ap);
        return;
    }
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    fprintf(stderr, "ivshmem-server: %s\n", line);
}

void ivs_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(LOG_ERR, fmt, ap);
    va_end(ap);
}

void ivs_log_info(const char *fmt, ...)
{
    if (!ivs_verbose)
        return;
    va_list ap;
    va_start(ap, fmt);
    vlog(LOG_INFO, fmt, ap);
    va_end(ap);
}

struct client {
    int sock;
    int32_t id;
    int efd[IVS_MAX_VECTORS]; /* the vectors this client is interrupted on */
    bool dropping;            /* send failed or hung up: remove at next reap */
};

struct ivs_server {
    struct ivs_config cfg;
    int listen_fd;
    int shm_fd;
    int reserve_fd;           /* spare fd, released to shed a client at EMFILE */
    ivshm *region;            /* our view of the registry, to mark leavers */
    struct client **clients;  /* sorted by id */
    size_t nclients, cap;
    int32_t next_id;          /* where the search for a free id starts */
    struct pollfd *pfds;
    size_t pfds_cap;
    bool own_socket, own_shm, own_state;
};

/* ---- protocol messages ---- */

static int send_msg(int sock, int64_t value, int fd)
{
    uint64_t le = htole64((uint64_t)value);
    struct iovec iov = {.iov_base = &le, .iov_len = sizeof le};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        msg.msg_control = ctl.buf;
        msg.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t n;
    do
        n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n == (ssize_t)sizeof le)
        return 0;
    /* A short write means the timeout hit mid-message: the stream is no
       longer framed, so the caller drops the client either way. */
    return n < 0 ? -errno : -EIO;
}

/* Tell `to` about every vector of `about` (a join, or its own setup). */
static int send_vectors(struct ivs_server *s, struct client *to,
                        const struct client *about)
{
    for (unsigned v = 0; v < s->cfg.vectors; v++) {
        int rc = send_msg(to->sock, about->id, about->efd[v]);
        if (rc < 0)
            return rc;
    }
    return 0;
}

static void ring_vector0(const struct client *c)
{
    uint64_t one = 1;
    /* Non-blocking eventfd: EAGAIN only at counter overflow, when the
       owner has a wake-up pending anyway. */
    if (write(c->efd[0], &one, sizeof one) < 0 && errno != EAGAIN)
        ivs_log_info("ring id %d: %s", (int)c->id, strerror(errno));
}

/* ---- state file ---- */

static void json_string(FILE *f, const char *str)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)str; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

/* Rewrite the state file through a temporary + rename, so readers see
   either the old or the new content, never a torn one. */
static void write_state(struct ivs_server *s)
{
    const char *path = s->cfg.state_path;
    if (!path)
        return;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) {
        ivs_log_error("state: %s", strerror(errno));
        return;
    }
    fprintf(f, "{\"pid\":%d,\"socket\":", (int)getpid());
    json_string(f, s->cfg.socket_path);
    fputs(",\"shm\":", f);
    json_string(f, s->cfg.shm_path);
    fprintf(f, ",\"size\":%llu,\"vectors\":%u,\"peers\":[",
            (unsigned long long)s->cfg.size, s->cfg.vectors);
    for (size_t i = 0; i < s->nclients; i++)
        fprintf(f, "%s{\"id\":%d,\"vectors\":%u}", i ? "," : "",
                (int)s->clients[i]->id, s->cfg.vectors);
    fputs("]}\n", f);
    if (fclose(f) != 0) {
        free(buf);
        ivs_log_error("state: %s", strerror(errno));
        return;
    }

    char tmp[4096];
    int rc = -ENAMETOOLONG;
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) < (int)sizeof tmp) {
        int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        rc = fd < 0 ? -errno : 0;
        for (size_t off = 0; rc == 0 && off < len;) {
            ssize_t n = write(fd, buf + off, len - off);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                rc = n < 0 ? -errno : -EIO;
            else
                off += (size_t)n;
        }
        if (fd >= 0 && close(fd) < 0 && rc == 0)
            rc = -errno;
        if (rc == 0 && rename(tmp, path) < 0)
            rc = -errno;
        if (rc < 0 && fd >= 0)
            unlink(tmp);
    }
    if (rc < 0)
        ivs_log_error("state %s: %s", path, strerror(-rc));
    free(buf);
}

void ivs_server_publish(struct ivs_server *s)
{
    s->own_state = s->cfg.state_path != NULL;
    write_state(s);
}

/* ---- peer table ---- */

static void client_free(struct ivs_server *s, struct client *c)
{
    if (c->sock >= 0)
        close(c->sock);
    for (unsigned v = 0; v < s->cfg.vectors; v++)
        if (c->efd[v] >= 0)
            close(c->efd[v]);
    free(c);
}

/* The id after the last one handed out, skipping ids in use, and the
   table position that keeps the table sorted. Ids are not reused while
   others are free: QEMU (7.2) keeps a departed peer's vector table and
   corrupts its heap when the same id connects again. */
static int32_t next_free_id(struct ivs_server *s, size_t *pos)
{
    if (s->nclients >= IVS_MAX_IDS)
        return -1;
    for (int32_t n = 0; n < IVS_MAX_IDS; n++) {
        int32_t id = (int32_t)((s->next_id + n) % IVS_MAX_IDS);
        size_t i = 0;
        while (i < s->nclients && s->clients[i]->id < id)
            i++;
        if (i < s->nclients && s->clients[i]->id == id)
            continue;
        s->next_id = (id + 1) % IVS_MAX_IDS;
        *pos = i;
        return id;
    }
    return -1;
}

static void remove_client(struct ivs_server *s, size_t idx)
{
    struct client *gone = s->clients[idx];
    int32_t id = gone->id;
    memmove(&s->clients[idx], &s->clients[idx + 1],
            (s->nclients - idx - 1) * sizeof *s->clients);
    s->nclients--;
    client_free(s, gone);

    /* Guests cannot see leave notices: mark the registry ourselves, before
       the notices and rings, so whoever is woken finds the entry DEAD.
       The id is only reused after this (single thread), so a later peer
       with the same id is never hit. */
    int marked = ivshm_mark_doorbell_dead(s->region, id);
    ivs_log_info("id %d left (%d registry entr%s marked dead)", (int)id,
                 marked, marked == 1 ? "y" : "ies");
    for (size_t i = 0; i < s->nclients; i++) {
        struct client *o = s->clients[i];
        if (!o->dropping && send_msg(o->sock, id, -1) < 0)
            o->dropping = true;
    }
    /* Blocked waiters re-check their peer's liveness when woken. */
    for (size_t i = 0; i < s->nclients; i++)
        ring_vector0(s->clients[i]);
}

/* Remove every client marked dropping; removing one can fail sends to
   others and mark them too, hence the loop. */
static void reap_dropped(struct ivs_server *s)
{
    bool changed = false;
    for (;;) {
        size_t i = 0;
        while (i < s->nclients && !s->clients[i]->dropping)
            i++;
        if (i == s->nclients)
            break;
        remove_client(s, i);
        changed = true;
    }
    if (changed)
        write_state(s);
}

static void log_peer_pid(int sock, int32_t id)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
        ivs_log_info("id %d joined (pid %d, uid %d)", (int)id, (int)cred.pid,
                     (int)cred.uid);
    else
        ivs_log_info("id %d joined", (int)id);
}

static void client_join(struct ivs_server *s, int sock)
{
    size_t pos;
    int32_t id = next_free_id(s, &pos);
    if (id < 0) {
        ivs_log_error("all %d ids in use: refusing a client", IVS_MAX_IDS);
        close(sock);
        return;
    }
    if (s->nclients == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        struct client **t = realloc(s->clients, cap * sizeof *t);
        if (!t) {
            close(sock);
            return;
        }
        s->clients = t;
        s->cap = cap;
    }
    struct client *c = calloc(1, sizeof *c);
    if (!c) {
        close(sock);
        return;
    }
    c->sock = sock;
    c->id = id;
    for (unsigned v = 0; v < IVS_MAX_VECTORS; v++)
        c->efd[v] = -1;
    for (unsigned v = 0; v < s->cfg.vectors; v++) {
        c->efd[v] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (c->efd[v] < 0) {
            ivs_log_error("eventfd: %s", strerror(errno));
            client_free(s, c);
            return;
        }
    }
    struct timeval tv = {SEND_TIMEOUT_MS / 1000, (SEND_TIMEOUT_MS % 1000) * 1000};
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);

    /* 1-3: version, id, region. */
    if (send_msg(sock, 0, -1) < 0 || send_msg(sock, id, -1) < 0 ||
        send_msg(sock, -1, s->shm_fd) < 0) {
        ivs_log_info("new client went away during setup");
        client_free(s, c);
        return;
    }
    /* The others learn about the newcomer before it gets its own vectors:
       once it has them it may join the registry and be rung, so the join
       notice must already sit in every other client's socket. */
    for (size_t i = 0; i < s->nclients; i++) {
        struct client *o = s->clients[i];
        if (!o->dropping && send_vectors(s, o, c) < 0)
            o->dropping = true;
    }
    memmove(&s->clients[pos + 1], &s->clients[pos],
            (s->nclients - pos) * sizeof *s->clients);
    s->clients[pos] = c;
    s->nclients++;
    /* 4-5: the existing peers, then its own vectors (ends the burst). */
    for (size_t i = 0; i < s->nclients && !c->dropping; i++) {
        struct client *o = s->clients[i];
        if (o != c && !o->dropping && send_vectors(s, c, o) < 0)
            c->dropping = true;
    }
    if (!c->dropping && send_vectors(s, c, c) < 0)
        c->dropping = true;
    if (!c->dropping)
        log_peer_pid(sock, id);
    write_state(s);
    reap_dropped(s);
}

static void accept_clients(struct ivs_server *s)
{
    for (int k = 0; k < ACCEPTS_PER_ROUND; k++) {
        int sock = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (sock >= 0) {
            client_join(s, sock);
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED)
            continue;
        if ((errno == EMFILE || errno == ENFILE) && s->reserve_fd >= 0) {
            /* Out of fds: the pending connection would keep the listener
               readable forever. Free the spare fd, accept and close it. */
            ivs_log_error("out of file descriptors: refusing a client");
            close(s->reserve_fd);
            sock = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (sock >= 0)
                close(sock);
            s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            ivs_log_error("accept: %s", strerror(errno));
        return;
    }
}

/* Clients never send: data, EOF or an error all end the connection. */
static void client_event(struct client *c, short revents)
{
    if (revents & (POLLERR | POLLHUP | POLLNVAL)) {
        c->dropping = true;
        return;
    }
    if (!(revents & POLLIN))
        return;
    char buf[64];
    ssize_t n = recv(c->sock, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n > 0)
        ivs_log_info("id %d sent data (protocol is one-way): dropped",
                     (int)c->id);
    c->dropping = true;
}

int ivs_server_run(struct ivs_server *s, volatile sig_atomic_t *stop,
                   const sigset_t *wait_mask)
{
    while (!*stop) {
        size_t n = 1 + s->nclients;
        if (n > s->pfds_cap) {
            size_t cap = n * 2;
            struct pollfd *p = realloc(s->pfds, cap * sizeof *p);
            if (!p)
                return -ENOMEM;
            s->pfds = p;
            s->pfds_cap = cap;
        }
        s->pfds[0] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
        for (size_t i = 0; i < s->nclients; i++)
            s->pfds[1 + i] =
                (struct pollfd){.fd = s->clients[i]->sock, .events = POLLIN};
        if (ppoll(s->pfds, n, NULL, wait_mask) < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        /* pfds[1 + i] still matches clients[i]: nothing changed the table
           since ppoll; removals wait for reap_dropped. */
        for (size_t i = 0; i + 1 < n; i++)
            if (s->pfds[1 + i].revents)
                client_event(s->clients[i], s->pfds[1 + i].revents);
        reap_dropped(s);
        if (s->pfds[0].revents & POLLIN)
            accept_clients(s);
    }
    return 0;
}

/* ---- start / stop ---- */

/* A socket file left by a server that died is removed; a live one, or
   something that is not a socket, is an error. */
static int clear_stale_socket(const char *path)
{
    struct stat st;
    if (lstat(path, &st) < 0)
        return errno == ENOENT ? 0 : -errno;
    if (!S_ISSOCK(st.st_mode)) {
        ivs_log_error("%s exists and is not a socket", path);
        return -EEXIST;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, path, strlen(path) + 1);
    int rc = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    int err = errno;
    close(fd);
    if (rc == 0) {
        ivs_log_error("%s: another server is listening", path);
        return -EADDRINUSE;
    }
    if (err != ECONNREFUSED) {
        ivs_log_error("%s: %s", path, strerror(err));
        return -err;
    }
    ivs_log_info("removing stale socket %s", path);
    return unlink(path) < 0 ? -errno : 0;
}

static int set_mode(int fd, const char *path, const struct ivs_config *cfg)
{
    if (cfg->shared_group && fchown(fd, (uid_t)-1, cfg->gid) < 0) {
        ivs_log_error("chown %s: %s", path, strerror(errno));
        return -errno;
    }
    if (fchmod(fd, cfg->shared_group ? 0660 : 0600) < 0) {
        ivs_log_error("chmod %s: %s", path, strerror(errno));
        return -errno;
    }
    return 0;
}

static int create_region(struct ivs_server *s)
{
    const struct ivs_config *cfg = &s->cfg;
    struct stat st;
    /* Never reformat an existing file: peers may be using it. */
    if (lstat(cfg->shm_path, &st) == 0) {
        ivs_log_error("%s already exists (remove it or choose another name)",
                      cfg->shm_path);
        return -EEXIST;
    }
    int rc = ivshm_format_file(cfg->shm_path, cfg->size, &cfg->geometry, 0600);
    if (rc < 0) {
        ivs_log_error("format %s: %s", cfg->shm_path, ivshm_strerror(rc));
        return rc;
    }
    s->own_shm = true;
    s->shm_fd = open(cfg->shm_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (s->shm_fd < 0) {
        ivs_log_error("open %s: %s", cfg->shm_path, strerror(errno));
        return -errno;
    }
    rc = set_mode(s->shm_fd, cfg->shm_path, cfg);
    if (rc < 0)
        return rc;
    int map_fd = fcntl(s->shm_fd, F_DUPFD_CLOEXEC, 0);
    if (map_fd < 0)
        return -errno;
    rc = ivshm_region_map(map_fd, &s->region);
    if (rc < 0) {
        close(map_fd);
        ivs_log_error("map %s: %s", cfg->shm_path, ivshm_strerror(rc));
    }
    return rc;
}

static int create_socket(struct ivs_server *s)
{
    const char *path = s->cfg.socket_path;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return -ENAMETOOLONG;
    memcpy(addr.sun_path, path, strlen(path) + 1);
    s->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s->listen_fd < 0)
        return -errno;
    /* Created 0600 so it is never reachable by others before chmod. */
    mode_t old = umask(0177);
    int rc = bind(s->listen_fd, (struct sockaddr *)&addr, sizeof addr);
    int err = errno;
    umask(old);
    if (rc < 0) {
        ivs_log_error("bind %s: %s", path, strerror(err));
        return -err;
    }
    s->own_socket = true;
    /* A socket file's owner and mode are those of its inode: set by path. */
    if (s->cfg.shared_group && chown(path, (uid_t)-1, s->cfg.gid) < 0) {
        ivs_log_error("chown %s: %s", path, strerror(errno));
        return -errno;
    }
    if (chmod(path, s->cfg.shared_group ? 0660 : 0600) < 0) {
        ivs_log_error("chmod %s: %s", path, strerror(errno));
        return -errno;
    }
    if (listen(s->listen_fd, 64) < 0) {
        ivs_log_error("listen %s: %s", path, strerror(errno));
        return -errno;
    }
    return 0;
}

int ivs_server_start(const struct ivs_config *cfg, struct ivs_server **out)
{
    if (!cfg || !cfg->socket_path || !cfg->shm_path || cfg->vectors < 1 ||
        cfg->vectors > IVS_MAX_VECTORS)
        return -EINVAL;
    struct ivs_server *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->cfg = *cfg;
    s->listen_fd = s->shm_fd = -1;
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int rc = clear_stale_socket(cfg->socket_path);
    if (rc == 0)
        rc = create_region(s);
    if (rc == 0)
        rc = create_socket(s);
    if (rc < 0) {
        ivs_server_stop(s);
        return rc;
    }
    ivs_log_info("listening on %s, region %s (%llu bytes, %u vector%s)",
                 cfg->socket_path, cfg->shm_path, (unsigned long long)cfg->size,
                 cfg->vectors, cfg->vectors == 1 ? "" : "s");
    *out = s;
    return 0;
}

void ivs_server_stop(struct ivs_server *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->nclients; i++)
        client_free(s, s->clients[i]);
    free(s->clients);
    free(s->pfds);
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    if (s->own_socket)
        unlink(s->cfg.socket_path);
    if (s->own_state)
        unlink(s->cfg.state_path);
    ivshm_region_unmap(s->region);
    if (s->shm_fd >= 0)
        close(s->shm_fd);
    if (s->own_shm && !s->cfg.keep_shm)
        unlink(s->cfg.shm_path);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    free(s);
}

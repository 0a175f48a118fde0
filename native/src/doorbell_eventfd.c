/*
 * The eventfd doorbell an ivshmem-server gives us, and its notices
 * (QEMU's ivshmem-doorbell protocol, docs/server-protocol.md); attaching
 * through the server is attach_server.c.
 *
 * The server sends 8-byte little-endian numbers, some carrying one fd:
 * version 0, our id, -1 + the region fd, then "id + eventfd" once per
 * vector for every other peer (to ring it) and for ourselves (to be rung),
 * and later join (id + fd) and leave (id, no fd) notices. The server is
 * the one that hands us the region, but its messages are still checked:
 * a malformed one is an error (-EPROTO), never a crash or an fd leak.
 */
#define _GNU_SOURCE
#include "doorbell_eventfd.h"

#include "clock.h"
#include "registry.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SERVER_MAX_VECTORS 64       /* per peer; more is a protocol error */
#define FDS_PER_MSG_ROOM 4          /* control buffer: >1 fd is detected */
#define MSG_REST_TIMEOUT_MS 1000    /* rest of a message once it started */
#define NOTICES_PER_DRAIN 4096      /* bounds one drain against a flood */
#define EV_SOCKET UINT64_MAX        /* epoll tag; eventfds are tagged by fd */

struct server_peer {
    int32_t id;
    int nfds;
    int fds[SERVER_MAX_VECTORS]; /* vector v of that peer */
};

struct db_server {
    struct ivshm_doorbell ops;   /* first: handed out as the doorbell */
    int sock;                    /* -1 once the server is gone */
    int epfd;
    int32_t my_id;
    ivshm *h;                    /* set once the region is mapped */
    struct server_peer self;     /* our vectors: we are rung on these */
    struct server_peer *peers;   /* other peers, sorted by id */
    size_t npeers, cap;
    int32_t *left;               /* leaves read in the current drain */
    size_t nleft, left_cap;
    int left_unreported;         /* leaves since the last poll_notices */
    unsigned long lost_fds;      /* join fds dropped at our RLIMIT_NOFILE */
};

static struct db_server *as_server(struct ivshm_doorbell *db)
{
    return (struct db_server *)db;
}

/* ---- wire ---- */

/* Take ownership of every fd that arrived in `m` before judging them,
   so none leaks whatever the verdict: the first into *fd (if it holds
   none yet), any other closed. Truncated control data with no fd at all
   is an fd lost on our side (EMFILE: *lost_fd), not a malformed message;
   with fds, the sender sent too many. False if it sent too many. */
static bool take_fds(struct msghdr *m, int *fd, bool *lost_fd)
{
    bool too_many = false;
    int nrecv = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfds; i++) {
            int x;
            memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
            nrecv++;
            if (*fd < 0) {
                *fd = x;
            } else {
                close(x);
                too_many = true;
            }
        }
    }
    if (m->msg_flags & MSG_CTRUNC) {
        if (nrecv > 0)
            too_many = true;
        else
            *lost_fd = true;
    }
    return !too_many;
}

/* A started message must complete within MSG_REST_TIMEOUT_MS. -EMFILE:
   we are at RLIMIT_NOFILE; the stream is still framed. */
int ivshm_server_recv(int sock, int timeout_ms, int64_t *value, int *fd_out)
{
    uint8_t bytes[8];
    size_t got = 0;
    int fd = -1, rc;
    bool lost_fd = false;
    while (got < sizeof bytes) {
        struct pollfd p = {.fd = sock, .events = POLLIN};
        int r = poll(&p, 1, got ? MSG_REST_TIMEOUT_MS : timeout_ms);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = -errno;
            goto fail;
        }
        if (r == 0) {
            if (!got)
                return 0;
            rc = -EPROTO;
            goto fail;
        }
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int) * FDS_PER_MSG_ROOM)];
        } ctl;
        struct iovec iov = {.iov_base = bytes + got, .iov_len = sizeof bytes - got};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1,
                           .msg_control = ctl.buf,
                           .msg_controllen = sizeof ctl.buf};
        ssize_t n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            continue;
        if (n < 0) {
            rc = -errno;
            goto fail;
        }
        bool too_many = !take_fds(&m, &fd, &lost_fd);
        if (too_many) {
            rc = -EPROTO;
            goto fail;
        }
        if (n == 0) {
            rc = got ? -EPROTO : -ECONNRESET;
            goto fail;
        }
        got += (size_t)n;
    }
    uint64_t le;
    memcpy(&le, bytes, sizeof le);
    *value = (int64_t)le64toh(le);
    if (lost_fd && fd < 0) {
        *fd_out = -1;
        return -EMFILE;
    }
    if (lost_fd) {
        rc = -EPROTO; /* one fd in one piece, truncation in another */
        goto fail;
    }
    *fd_out = fd;
    return 1;
fail:
    if (fd >= 0)
        close(fd);
    return rc;
}

/* ---- peer table ---- */

static struct server_peer *find_peer(struct db_server *s, int32_t id,
                                     size_t *pos)
{
    size_t lo = 0, hi = s->npeers;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->peers[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (pos)
        *pos = lo;
    return lo < s->npeers && s->peers[lo].id == id ? &s->peers[lo] : NULL;
}

static struct server_peer *add_peer(struct db_server *s, int32_t id)
{
    size_t pos;
    struct server_peer *p = find_peer(s, id, &pos);
    if (p)
        return p;
    if (s->npeers == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        struct server_peer *t = realloc(s->peers, cap * sizeof *t);
        if (!t)
            return NULL;
        s->peers = t;
        s->cap = cap;
    }
    memmove(&s->peers[pos + 1], &s->peers[pos],
            (s->npeers - pos) * sizeof *s->peers);
    s->npeers++;
    p = &s->peers[pos];
    p->id = id;
    p->nfds = 0;
    return p;
}

static void close_peer_fds(struct server_peer *p)
{
    for (int v = 0; v < p->nfds; v++)
        close(p->fds[v]);
    p->nfds = 0;
}

static void remove_peer(struct db_server *s, struct server_peer *p)
{
    close_peer_fds(p);
    size_t idx = (size_t)(p - s->peers);
    memmove(&s->peers[idx], &s->peers[idx + 1],
            (s->npeers - idx - 1) * sizeof *s->peers);
    s->npeers--;
}

/* Apply one message after the initial three. */
static int handle_msg(struct db_server *s, int64_t value, int fd)
{
    if (value < 0 || value > SERVER_MAX_ID) {
        if (fd >= 0)
            close(fd);
        return -EPROTO;
    }
    int32_t id = (int32_t)value;
    if (fd < 0) {
        /* Leave notice. Our own id leaving makes no sense. */
        if (id == s->my_id)
            return -EPROTO;
        struct server_peer *p = find_peer(s, id, NULL);
        if (!p)
            return 0; /* never heard of it (left during our setup) */
        remove_peer(s, p);
        s->left_unreported++;
        if (s->nleft == s->left_cap) {
            size_t cap = s->left_cap ? s->left_cap * 2 : 8;
            int32_t *t = realloc(s->left, cap * sizeof *t);
            if (!t)
                return -ENOMEM;
            s->left = t;
            s->left_cap = cap;
        }
        s->left[s->nleft++] = id;
        return 0;
    }
    /* Join notice (another id) or interrupt setup (ours): one vector. */
    struct server_peer *p = id == s->my_id ? &s->self : add_peer(s, id);
    int rc = 0;
    if (!p)
        rc = -ENOMEM;
    else if (p->nfds >= SERVER_MAX_VECTORS)
        rc = -EPROTO;
    /* Non-blocking, so a ring never blocks on a counter a co-tenant has
       pushed to its maximum, and draining ours never blocks either. */
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0)
        rc = -errno;
    else if (id == s->my_id) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)fd};
        if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
            rc = -errno;
    }
    if (rc < 0) {
        close(fd);
        return rc;
    }
    p->fds[p->nfds++] = fd;
    return 0;
}

/* The server closed or broke the protocol: keep ringing the peers we
   know (the spec lets clients carry on), stop listening for notices. */
static void server_gone(struct db_server *s)
{
    if (s->sock < 0)
        return;
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, s->sock, NULL);
    close(s->sock);
    s->sock = -1;
}

/* Process every pending notice without blocking. Leavers are marked dead
   in the registry only after the socket is drained: a peer that reuses a
   leaver's id can only be in the registry after the server queued its
   join notice to us, so an id that re-joined in this batch is skipped and
   its new incarnation is never marked. Returns 0 or -EPROTO/-errno. */
static int drain_notices(struct db_server *s)
{
    int rc = 0;
    for (int n = 0; s->sock >= 0 && n < NOTICES_PER_DRAIN; n++) {
        int64_t value;
        int fd;
        int r = ivshm_server_recv(s->sock, 0, &value, &fd);
        if (r == 0)
            break;
        if (r == -EMFILE) {
            /* A join whose eventfd did not fit under our fd limit: that
               vector is skipped (a ring it would have carried costs the
               peer a liveness slice), the connection is kept. */
            s->lost_fds++;
            continue;
        }
        if (r > 0)
            r = handle_msg(s, value, fd);
        if (r < 0) {
            if (r != -ECONNRESET)
                rc = r;
            server_gone(s);
        }
    }
    /* the leavers that did not come back in this batch, marked in one
       pass over the registry (however many entries carry their ids) */
    size_t n = 0;
    if (s->h)
        ivshm_work_count(s->h, (uint32_t)s->nleft);
    for (size_t i = 0; i < s->nleft; i++)
        if (!find_peer(s, s->left[i], NULL))
            s->left[n++] = s->left[i];
    if (s->h)
        ivshm_mark_doorbells_dead(s->h, s->left, n);
    s->nleft = 0;
    return rc;
}

/* ---- doorbell ops ---- */

static int es_ring(struct ivshm_doorbell *db, ivshm *h, int slot,
                   int32_t doorbell_id)
{
    struct db_server *s = as_server(db);
    (void)slot;
    /* doorbell_id comes from the shared registry: only used as a key. */
    if (doorbell_id < 0 || doorbell_id > SERVER_MAX_ID)
        return -EINVAL;
    s->h = h;
    struct server_peer *p =
        doorbell_id == s->my_id ? &s->self : find_peer(s, doorbell_id, NULL);
    if (!p || !p->nfds) {
        /* It may have joined the registry before we read its join notice
           (which the server queued to us before it could join). */
        drain_notices(s);
        p = doorbell_id == s->my_id ? &s->self : find_peer(s, doorbell_id, NULL);
        if (!p || !p->nfds)
            return IVSHM_EPEERDEAD;
    }
    uint64_t one = 1;
    if (write(p->fds[0], &one, sizeof one) < 0 && errno != EAGAIN)
        return -errno;
    return 0;
}

/* Nothing to arm: a ring between arm and wait stays in the eventfd's
   counter and makes epoll return at once. */
static uint64_t es_arm(struct ivshm_doorbell *db, ivshm *h)
{
    (void)db;
    (void)h;
    return 0;
}

static int es_wait(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                   int timeout_ms)
{
    struct db_server *s = as_server(db);
    (void)token;
    s->h = h;
    struct epoll_event ev[8];
    int n = epoll_wait(s->epfd, ev, 8, timeout_ms);
    if (n < 0)
        return -errno;
    if (n == 0)
        return -ETIMEDOUT;
    int rc = 0;
    for (int i = 0; i < n; i++) {
        if (ev[i].data.u64 == EV_SOCKET) {
            int r = drain_notices(s);
            if (r < 0)
                rc = r;
        } else {
            uint64_t count;
            /* One read resets the counter: all pending rings consumed. */
            if (read((int)ev[i].data.u64, &count, sizeof count) < 0 &&
                errno != EAGAIN)
                rc = -errno;
        }
    }
    return rc;
}

static int es_fd(struct ivshm_doorbell *db)
{
    return as_server(db)->epfd;
}

static int es_poll_notices(struct ivshm_doorbell *db, ivshm *h)
{
    struct db_server *s = as_server(db);
    s->h = h;
    drain_notices(s);
    int left = s->left_unreported;
    s->left_unreported = 0;
    return left;
}

static void es_destroy(struct ivshm_doorbell *db)
{
    struct db_server *s = as_server(db);
    if (!s)
        return;
    server_gone(s);
    close_peer_fds(&s->self);
    for (size_t i = 0; i < s->npeers; i++)
        close_peer_fds(&s->peers[i]);
    if (s->epfd >= 0)
        close(s->epfd);
    free(s->peers);
    free(s->left);
    free(s);
}

static const struct ivshm_doorbell eventfd_ops = {
    .kind = DB_EVENTFD,
    .ring = es_ring,
    .arm = es_arm,
    .wait = es_wait,
    .fd = es_fd,
    .poll_notices = es_poll_notices,
    .destroy = es_destroy,
};

/* Takes ownership of `sock` (closed on failure too). Reads the rest of
   the initial burst: blocks (bounded) until our first own-id vector, then
   takes whatever else is already queued. */
struct ivshm_doorbell *ivshm_db_server_new(int sock, int32_t my_id, int *err)
{
    int rc = 0;
    struct db_server *s = calloc(1, sizeof *s);
    if (!s) {
        close(sock);
        *err = -ENOMEM;
        return NULL;
    }
    s->ops = eventfd_ops;
    s->sock = sock;
    s->my_id = my_id;
    s->self.id = my_id;
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (my_id < 0 || my_id > SERVER_MAX_ID) {
        rc = -EINVAL;
        goto fail;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = EV_SOCKET};
    if (s->epfd < 0 || epoll_ctl(s->epfd, EPOLL_CTL_ADD, sock, &ev) < 0) {
        rc = -errno;
        goto fail;
    }
    uint64_t deadline = ivshm_now_ns() + ATTACH_TIMEOUT_MS * 1000000ull;
    while (s->self.nfds == 0) {
        uint64_t now = ivshm_now_ns();
        if (now >= deadline) {
            rc = -ETIMEDOUT;
            goto fail;
        }
        int64_t value;
        int fd;
        rc = ivshm_server_recv(sock, (int)((deadline - now) / 1000000 + 1), &value, &fd);
        if (rc == 0)
            continue;
        if (rc > 0)
            rc = handle_msg(s, value, fd);
        if (rc < 0)
            goto fail;
    }
    rc = drain_notices(s);
    if (rc < 0)
        goto fail;
    s->left_unreported = 0; /* peers gone before we existed are no news */
    return &s->ops;
fail:
    es_destroy(&s->ops);
    *err = rc;
    return NULL;
}

void ivshm_db_server_attach(struct ivshm_doorbell *db, ivshm *h)
{
    as_server(db)->h = h;
}

int ivshm_server_peers(ivshm *h, int32_t *ids, int *vectors, int n)
{
    if (!h->db || h->db->kind != DB_EVENTFD)
        return -ENOTSUP;
    if (!ids || n < 0)
        return -EINVAL;
    struct db_server *s = as_server(h->db);
    drain_notices(s);
    /* Merge ourselves into the sorted list of the others. */
    int count = 0;
    bool self_done = false;
    for (size_t i = 0; count < n && (i < s->npeers || !self_done);) {
        const struct server_peer *p;
        if (!self_done && (i == s->npeers || s->my_id < s->peers[i].id)) {
            p = &s->self;
            self_done = true;
        } else {
            p = &s->peers[i++];
        }
        if (!p->nfds)
            continue;
        ids[count] = p->id;
        if (vectors)
            vectors[count] = p->nfds;
        count++;
    }
    if (count < n) {
        ids[count] = -1;
        if (vectors)
            vectors[count] = 0;
    }
    return count;
}

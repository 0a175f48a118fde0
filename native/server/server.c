/*
 * ivshmem-server core: QEMU's ivshmem-doorbell protocol
 * (docs/server-protocol.md), single-threaded around one ppoll() loop.
 *
 * Every message is an 8-byte little-endian signed number, optionally with
 * one fd (SCM_RIGHTS). Nothing a client does can stall the loop: client
 * sockets are non-blocking and every message goes through a per-client
 * queue that is flushed when the socket has room. A client that reads
 * slowly, or not at all for a while, loses nothing and is never dropped
 * for it; only its own EOF, an error, or bytes sent to us (the protocol
 * is one-way) end its connection. Queues stay bounded because notices
 * about a peer that left before they went out are coalesced away (see
 * coalesce_leave), and connections are capped per region and per uid.
 */
#define _GNU_SOURCE
#include "server.h"
#include "budget.h"
#include "ids.h"
#include "marker.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define ACCEPTS_PER_ROUND 16
/* A send refused with ETOOMANYREFS (our fds in flight exceed the
   limit) is retried after this long instead of on POLLOUT. */
#define STALL_RETRY_MS 50
/* Safety net only: with coalescing a queue holds at most one join per
   live peer and vector plus one leave per departed peer it was told
   about, far below this. Reaching it drops that client alone. */
#define QUEUE_MAX (1u << 18)
/* The state file is rewritten at most this often (a write and a rename
   per join or leave would let a connect/close storm cost us file I/O). */
#define STATE_EVERY_NS (10ull * 1000000)
#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59
#endif
#define MAX_PEER_GROUPS 256

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* What a queued message carries besides its value. */
enum { ABOUT_NONE = -1, ABOUT_REGION = -2 };

/* One queued message. The fd is not held here but looked up when the
   message is sent: `about` names the client whose vector it is (or the
   region), so a queue never keeps an fd alive and never costs one. */
struct qmsg {
    int64_t value;
    int32_t about;     /* client id, ABOUT_REGION or ABOUT_NONE */
    uint8_t vector;
    uint8_t sent;      /* bytes already written: 0 = not started */
};

struct client {
    int sock;
    int32_t id;
    uid_t uid;
    pid_t pid;
    uint64_t seq;             /* connect number: clients in connect order */
    struct client *older, *newer;
    struct ivs_account *account; /* its process's budget */
    int efd[IVS_MAX_VECTORS]; /* the vectors this client is interrupted on */
    bool dropping;            /* hung up, error or overflow: remove at reap */
    bool stalled;             /* ETOOMANYREFS: retry on the timer */
    struct qmsg *q;           /* pending messages: q[qh .. qh+qn) */
    size_t qh, qn, qcap;
};

struct ivs_server {
    struct ivs_config cfg;
    int listen_fd;
    int shm_fd;
    int reserve_fd;           /* spare fd, released to shed a client at EMFILE */
    ivshm_admin *region;      /* our view of the registry, to mark leavers */
    struct client **clients;  /* sorted by id */
    size_t nclients, cap;
    struct client *oldest, *newest; /* by seq */
    uint64_t next_seq;
    struct ivs_ids *ids;
    struct ivs_budget *budget;
    struct ivs_marker *marker; /* marks leavers' registry entries */
    uint64_t no_id_logged_ns;  /* the "no safe id" line, once a second */
    unsigned no_id_untold;
    struct pollfd *pfds;
    size_t pfds_cap;
    bool any_stalled;
    bool own_socket, own_shm, own_state;
    bool state_dirty;         /* the table changed since the last write */
    uint64_t state_written_ns;
};

/* ---- queues ---- */

/* Where `id` goes in the table sorted by id. */
static size_t table_pos(const struct ivs_server *s, int32_t id)
{
    size_t lo = 0, hi = s->nclients;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->clients[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static struct client *find_client(struct ivs_server *s, int32_t id)
{
    size_t i = table_pos(s, id);
    return i < s->nclients && s->clients[i]->id == id ? s->clients[i] : NULL;
}

static void enqueue(struct client *c, int64_t value, int32_t about,
                    unsigned vector)
{
    if (c->dropping)
        return;
    if (c->qh + c->qn == c->qcap) {
        if (c->qh > 0) {
            memmove(c->q, c->q + c->qh, c->qn * sizeof *c->q);
            c->qh = 0;
        }
        if (c->qn == c->qcap) {
            size_t cap = c->qcap ? c->qcap * 2 : 64;
            struct qmsg *t = cap <= QUEUE_MAX ? realloc(c->q, cap * sizeof *t)
                                              : NULL;
            if (!t) {
                ivs_log_error("id %d: notice queue full: dropped", (int)c->id);
                c->dropping = true;
                return;
            }
            c->q = t;
            c->qcap = cap;
        }
    }
    c->q[c->qh + c->qn++] = (struct qmsg){value, about, (uint8_t)vector, 0};
}

/* Queue the vectors of `about` for `to` (a join, or `to`'s own setup). */
static void enqueue_vectors(struct ivs_server *s, struct client *to,
                            const struct client *about)
{
    for (unsigned v = 0; v < s->cfg.vectors; v++)
        enqueue(to, about->id, about->id, v);
}

/* Write as much of `c`'s queue as its socket takes now, never blocking.
   A message may go out in pieces; its fd travels with the first one. */
static void flush(struct ivs_server *s, struct client *c)
{
    while (c->qn > 0 && !c->dropping && !c->stalled) {
        struct qmsg *m = &c->q[c->qh];
        int fd = -1;
        if (m->sent == 0 && m->about == ABOUT_REGION) {
            fd = s->shm_fd;
        } else if (m->sent == 0 && m->about >= 0) {
            const struct client *o = find_client(s, m->about);
            if (!o) {
                /* Cannot happen (coalesce_leave removes unsent messages
                   about a leaver); sent without its fd it would read as
                   a leave notice, so it is dropped. */
                c->qh++;
                c->qn--;
                continue;
            }
            fd = o->efd[m->vector];
        }
        uint64_t le = htole64((uint64_t)m->value);
        struct iovec iov = {.iov_base = (char *)&le + m->sent,
                            .iov_len = sizeof le - m->sent};
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
        if (fd >= 0) {
            memset(&ctl, 0, sizeof ctl);
            msg.msg_control = ctl.buf;
            msg.msg_controllen = sizeof ctl.buf;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &fd, sizeof fd);
        }
        ssize_t n = sendmsg(c->sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return; /* POLLOUT will bring us back */
            if (errno == ETOOMANYREFS) {
                c->stalled = true;
                s->any_stalled = true;
                return;
            }
            ivs_log_info("id %d: send: %s", (int)c->id, strerror(errno));
            c->dropping = true;
            return;
        }
        m->sent = (uint8_t)(m->sent + n);
        if (m->sent == sizeof le) {
            c->qh++;
            c->qn--;
        }
    }
    if (c->qn == 0)
        c->qh = 0;
}

/* `gone` left: drop the join messages about it that `c` was never sent
   (c never learns about a peer that came and went while it was not
   reading), and queue a leave notice only if c got at least part of one.
   This is the whole coalescing rule: a reader sees a consistent history,
   and a queue holds nothing about departed peers it never saw. With
   no_leave_notices c is never told: it keeps the eventfds it got, which
   nobody reads any more, and the id still counts as known to it (the
   retire stamp in remove_client covers every client connected before
   the leave, told or not). */
static void coalesce_leave(struct ivs_server *s, struct client *c,
                           int32_t gone)
{
    size_t kept = 0, removed = 0;
    for (size_t i = 0; i < c->qn; i++) {
        struct qmsg m = c->q[c->qh + i];
        if (m.about == gone && m.sent == 0) {
            removed++;
            continue;
        }
        c->q[c->qh + kept++] = m;
    }
    c->qn = kept;
    if (removed < s->cfg.vectors && !s->cfg.no_leave_notices)
        enqueue(c, gone, ABOUT_NONE, 0);
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

/* Create `tmp` afresh: O_EXCL|O_NOFOLLOW, so a file or symbolic link
   planted there is never written through; a leftover of ours (or such a
   plant) is removed once, and a second one is an error. */
static int create_tmp(const char *tmp, mode_t mode)
{
    for (int attempt = 0;; attempt++) {
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                      mode);
        if (fd >= 0 || errno != EEXIST || attempt > 0)
            return fd < 0 ? -errno : fd;
        if (unlink(tmp) < 0 && errno != ENOENT)
            return -errno;
    }
}

int ivs_write_file_atomic(const char *path, const char *data, size_t len)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return -ENAMETOOLONG;
    int fd = create_tmp(tmp, 0644);
    if (fd < 0)
        return fd;
    int rc = 0;
    for (size_t off = 0; rc == 0 && off < len;) {
        ssize_t n = write(fd, data + off, len - off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            rc = n < 0 ? -errno : -EIO;
        else
            off += (size_t)n;
    }
    if (close(fd) < 0 && rc == 0)
        rc = -errno;
    /* rename replaces whatever `path` is (a link too), never follows it */
    if (rc == 0 && rename(tmp, path) < 0)
        rc = -errno;
    if (rc < 0)
        unlink(tmp);
    return rc;
}

/* Rewrite the state file through a temporary + rename, so readers see
   either the old or the new content, never a torn one. */
static void write_state(struct ivs_server *s)
{
    const char *path = s->cfg.state_path;
    if (!path || !s->own_state)
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
    if (s->cfg.shm_path)
        json_string(f, s->cfg.shm_path);
    else
        fputs("null", f);
    fprintf(f, ",\"sealed\":%s,\"size\":%llu,\"vectors\":%u,\"peers\":[",
            s->cfg.shm_path ? "false" : "true",
            (unsigned long long)s->cfg.size, s->cfg.vectors);
    for (size_t i = 0; i < s->nclients; i++)
        fprintf(f, "%s{\"id\":%d,\"vectors\":%u}", i ? "," : "",
                (int)s->clients[i]->id, s->cfg.vectors);
    fputs("]}\n", f);
    int rc = fclose(f) == 0 ? ivs_write_file_atomic(path, buf, len) : -errno;
    if (rc < 0)
        ivs_log_error("state %s: %s", path, strerror(-rc));
    free(buf);
}

void ivs_server_publish(struct ivs_server *s)
{
    s->own_state = s->cfg.state_path != NULL;
    write_state(s);
    s->state_written_ns = now_ns();
}

/* The table changed: the state file follows within STATE_EVERY_NS, so
   a storm of joins and leaves costs at most one write per interval. */
static void state_changed(struct ivs_server *s)
{
    s->state_dirty = true;
}

/* Write the state file if it changed and its interval is over; returns
   how long until it may be written (ms, rounded up), or -1 if clean. */
static int flush_state(struct ivs_server *s)
{
    if (!s->state_dirty)
        return -1;
    uint64_t now = now_ns();
    if (now - s->state_written_ns < STATE_EVERY_NS)
        return (int)((STATE_EVERY_NS - (now - s->state_written_ns) + 999999) /
                     1000000);
    write_state(s);
    s->state_written_ns = now;
    s->state_dirty = false;
    return -1;
}

/* ---- peer table ---- */

static void client_free(struct ivs_server *s, struct client *c)
{
    if (c->sock >= 0)
        close(c->sock);
    for (unsigned v = 0; v < s->cfg.vectors; v++)
        if (c->efd[v] >= 0)
            close(c->efd[v]);
    free(c->q);
    free(c);
}

/* The connect number of the oldest client, or the next one if none. */
static uint64_t oldest_seq(const struct ivs_server *s)
{
    return s->oldest ? s->oldest->seq : s->next_seq;
}

static void released_id(void *owner, void *arg)
{
    (void)arg;
    ivs_budget_release_id(owner);
}

/* Ids whose watchers have all gone become reusable (ids.h). */
static void release_ids(struct ivs_server *s)
{
    ivs_ids_release(s->ids, oldest_seq(s), released_id, NULL);
}

static void unlink_client(struct ivs_server *s, struct client *c)
{
    if (c->older)
        c->older->newer = c->newer;
    else
        s->oldest = c->newer;
    if (c->newer)
        c->newer->older = c->older;
    else
        s->newest = c->older;
    c->older = c->newer = NULL;
}

static void remove_client(struct ivs_server *s, size_t idx)
{
    struct client *gone = s->clients[idx];
    int32_t id = gone->id;
    memmove(&s->clients[idx], &s->clients[idx + 1],
            (s->nclients - idx - 1) * sizeof *s->clients);
    s->nclients--;
    unlink_client(s, gone);
    ivs_log_info("id %d left (pid %d)", (int)id, (int)gone->pid);
    for (size_t i = 0; i < s->nclients; i++) {
        coalesce_leave(s, s->clients[i], id);
        flush(s, s->clients[i]);
    }
    /* The id stays out of use until its registry entries are marked
       (so a later client with it is never hit) and every client
       connected before it left has gone, whether or not it was told of
       the leave (QEMU's heap, ids.h). */
    ivs_ids_retire(s->ids, id, s->next_seq, gone->account, false);
    ivs_budget_hold_id(gone->account);
    ivs_marker_push(s->marker, id);
    ivs_budget_leave(gone->account);
    /* Only now: no queue refers to its eventfds any more. */
    client_free(s, gone);
    release_ids(s);
}

/* Registry entries of leavers are marked: wake the blocked waiters (they
   re-check their peer's liveness and find the entry DEAD), and let the
   ids be reused once it is safe. */
static void marks_done(struct ivs_server *s)
{
    struct ivs_marked done[64];
    size_t n, total = 0;
    while ((n = ivs_marker_done(s->marker, done, 64)) > 0) {
        for (size_t i = 0; i < n; i++) {
            ivs_ids_cleaned(s->ids, done[i].id);
            ivs_log_info("id %d: %d registry entr%s marked dead",
                         (int)done[i].id, done[i].entries,
                         done[i].entries == 1 ? "y" : "ies");
        }
        total += n;
    }
    if (!total)
        return;
    release_ids(s);
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
        state_changed(s);
}

/* Is the peer process allowed to be a client? The socket's mode already
   keeps others out; this also holds when the socket or a connection was
   passed on. Root, our own uid, and (with -g) members of the group. */
static bool peer_allowed(const struct ivs_server *s, int sock,
                         const struct ucred *cred)
{
    if (cred->uid == 0 || cred->uid == geteuid())
        return true;
    if (!s->cfg.shared_group)
        return false;
    if (cred->gid == s->cfg.gid)
        return true;
    gid_t groups[MAX_PEER_GROUPS];
    socklen_t len = sizeof groups;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0)
        return false;
    for (size_t i = 0; i < len / sizeof *groups; i++)
        if (groups[i] == s->cfg.gid)
            return true;
    return false;
}

static void client_event(struct ivs_server *s, struct client *c,
                         short revents);

/* Before refusing at a cap: clients that already hung up (a connect/close
   cycle faster than our rounds) must not count. Polls without waiting. */
static void reap_hangups(struct ivs_server *s)
{
    size_t n = s->nclients;
    struct pollfd *p = calloc(n ? n : 1, sizeof *p);
    if (!p)
        return;
    for (size_t i = 0; i < n; i++)
        p[i] = (struct pollfd){.fd = s->clients[i]->sock, .events = POLLIN};
    if (poll(p, n, 0) > 0)
        for (size_t i = 0; i < n; i++)
            if (p[i].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL))
                client_event(s, s->clients[i], p[i].revents & ~POLLOUT);
    free(p);
    reap_dropped(s);
}

/* Refuse a stranger, or a connection over a cap or a budget: logged
   (at most once a second per uid or process), closed. Hung-up clients
   are reaped before a cap refuses: a fast connect/close cycle must not
   count against itself. */
static bool admit(struct ivs_server *s, int sock, struct ucred *cred,
                  struct ivs_account **account)
{
    socklen_t len = sizeof *cred;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, cred, &len) < 0) {
        ivs_log_error("SO_PEERCRED: %s: refusing a client", strerror(errno));
        return false;
    }
    if (!peer_allowed(s, sock, cred)) {
        ivs_log_error("refusing pid %d: uid %d is not allowed", (int)cred->pid,
                      (int)cred->uid);
        return false;
    }
    if (s->nclients >= s->cfg.max_clients)
        reap_hangups(s);
    if (s->nclients >= s->cfg.max_clients) {
        ivs_log_error("refusing pid %d: %u clients connected (--max-clients)",
                      (int)cred->pid, s->cfg.max_clients);
        return false;
    }
    enum ivs_verdict v = ivs_budget_admit(s->budget, cred->pid, cred->uid,
                                          now_ns(), false, account);
    if (v == IVS_UID_CLIENTS || v == IVS_PID_CLIENTS) {
        reap_hangups(s);
        v = ivs_budget_admit(s->budget, cred->pid, cred->uid, now_ns(), true,
                             account);
    }
    if (v == IVS_NO_MEMORY)
        ivs_log_error("out of memory: refusing pid %d", (int)cred->pid);
    return v == IVS_ADMIT;
}

/* No id is safe to hand out (ids.h): one line a second. */
static void log_no_id(struct ivs_server *s, pid_t pid)
{
    uint64_t now = now_ns();
    if (s->no_id_logged_ns && now - s->no_id_logged_ns < 1000000000ull) {
        s->no_id_untold++;
        return;
    }
    char more[64] = "";
    if (s->no_id_untold)
        snprintf(more, sizeof more, " (%u more refused in the last second)",
                 s->no_id_untold);
    ivs_log_error("refusing pid %d: no id is safe to hand out: every free "
                  "id left while the oldest client, pid %d, was connected%s",
                  (int)pid, s->oldest ? (int)s->oldest->pid : -1, more);
    s->no_id_logged_ns = now;
    s->no_id_untold = 0;
}

static void client_join(struct ivs_server *s, int sock)
{
    struct ucred cred;
    struct ivs_account *account = NULL;
    if (!admit(s, sock, &cred, &account)) {
        close(sock);
        return;
    }
    int32_t id = ivs_ids_take(s->ids);
    struct client *c = NULL;
    if (id < 0) {
        log_no_id(s, cred.pid);
        goto refuse;
    }
    if (s->nclients == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        struct client **t = realloc(s->clients, cap * sizeof *t);
        if (!t)
            goto refuse;
        s->clients = t;
        s->cap = cap;
    }
    c = calloc(1, sizeof *c);
    if (!c)
        goto refuse;
    c->sock = sock;
    c->id = id;
    c->uid = cred.uid;
    c->pid = cred.pid;
    c->account = account;
    for (unsigned v = 0; v < IVS_MAX_VECTORS; v++)
        c->efd[v] = -1;
    for (unsigned v = 0; v < s->cfg.vectors; v++) {
        c->efd[v] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (c->efd[v] < 0) {
            ivs_log_error("eventfd: %s", strerror(errno));
            goto refuse;
        }
    }
    size_t pos = table_pos(s, id);
    memmove(&s->clients[pos + 1], &s->clients[pos],
            (s->nclients - pos) * sizeof *s->clients);
    s->clients[pos] = c;
    s->nclients++;
    c->seq = s->next_seq++;
    c->older = s->newest;
    if (s->newest)
        s->newest->newer = c;
    else
        s->oldest = c;
    s->newest = c;

    /* 1-3: version, id, region. */
    enqueue(c, 0, ABOUT_NONE, 0);
    enqueue(c, id, ABOUT_NONE, 0);
    enqueue(c, -1, ABOUT_REGION, 0);
    /* The others are sent the newcomer's vectors before it gets its own:
       once it has them it may join the registry and be rung, so wherever
       a socket has room the join notice is already in it. A peer whose
       socket is full learns it later; a ring it cannot send meanwhile
       costs the sleeper at most its liveness slice (docs/waiting.md). */
    for (size_t i = 0; i < s->nclients; i++) {
        struct client *o = s->clients[i];
        if (o != c) {
            enqueue_vectors(s, o, c);
            flush(s, o);
        }
    }
    /* 4-5: the existing peers, then its own vectors (ends the burst). */
    for (size_t i = 0; i < s->nclients; i++)
        if (s->clients[i] != c)
            enqueue_vectors(s, c, s->clients[i]);
    enqueue_vectors(s, c, c);
    flush(s, c);
    ivs_log_info("id %d joined (pid %d, uid %d)", (int)id, (int)cred.pid,
                 (int)cred.uid);
    state_changed(s);
    return;
refuse:
    /* Nobody heard of the id: usable again at once. */
    if (id >= 0)
        ivs_ids_retire(s->ids, id, 0, NULL, true);
    ivs_budget_leave(account);
    if (c) {
        client_free(s, c); /* closes sock */
        return;
    }
    close(sock);
}

static void accept_clients(struct ivs_server *s)
{
    for (int k = 0; k < ACCEPTS_PER_ROUND; k++) {
        int sock = accept4(s->listen_fd, NULL, NULL,
                           SOCK_CLOEXEC | SOCK_NONBLOCK);
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

/* Clients never send: data, EOF or an error end this connection, and
   only this one. Room in the socket flushes the queue. */
static void client_event(struct ivs_server *s, struct client *c, short revents)
{
    if (revents & (POLLERR | POLLNVAL)) {
        c->dropping = true;
        return;
    }
    if (revents & (POLLIN | POLLHUP)) {
        char buf[64];
        ssize_t n = recv(c->sock, buf, sizeof buf, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        if (n > 0)
            ivs_log_info("id %d sent data (protocol is one-way): dropped",
                         (int)c->id);
        c->dropping = true;
        return;
    }
    if (revents & POLLOUT)
        flush(s, c);
}

/* pfds: the listener, the marker's eventfd, then one per client. */
enum { PFD_LISTEN, PFD_MARKER, PFD_CLIENTS };

int ivs_server_poll_once(struct ivs_server *s, const sigset_t *wait_mask,
                         int timeout_ms)
{
    size_t n = PFD_CLIENTS + s->nclients;
    if (n > s->pfds_cap) {
        size_t cap = n * 2;
        struct pollfd *p = realloc(s->pfds, cap * sizeof *p);
        if (!p)
            return -ENOMEM;
        s->pfds = p;
        s->pfds_cap = cap;
    }
    if (s->any_stalled && (timeout_ms < 0 || timeout_ms > STALL_RETRY_MS))
        timeout_ms = STALL_RETRY_MS;
    int state_due = flush_state(s);
    if (state_due >= 0 && (timeout_ms < 0 || timeout_ms > state_due))
        timeout_ms = state_due;
    s->pfds[PFD_LISTEN] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
    s->pfds[PFD_MARKER] = (struct pollfd){.fd = ivs_marker_fd(s->marker),
                                          .events = POLLIN};
    struct pollfd *cp = s->pfds + PFD_CLIENTS;
    for (size_t i = 0; i < s->nclients; i++) {
        const struct client *c = s->clients[i];
        short ev = POLLIN;
        if (c->qn > 0 && !c->stalled)
            ev |= POLLOUT;
        cp[i] = (struct pollfd){.fd = c->sock, .events = ev};
    }
    struct timespec ts = {timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L};
    int r = ppoll(s->pfds, n, timeout_ms < 0 ? NULL : &ts, wait_mask);
    if (r < 0)
        return errno == EINTR ? 0 : -errno;
    if (s->any_stalled) {
        s->any_stalled = false;
        for (size_t i = 0; i < s->nclients; i++) {
            s->clients[i]->stalled = false;
            flush(s, s->clients[i]);
        }
    }
    /* cp[i] still matches clients[i]: nothing changed the table since
       ppoll; removals wait for reap_dropped. */
    for (size_t i = 0; i < n - PFD_CLIENTS; i++)
        if (cp[i].revents)
            client_event(s, s->clients[i], cp[i].revents);
    reap_dropped(s);
    if (s->pfds[PFD_MARKER].revents & POLLIN)
        marks_done(s);
    if (s->pfds[PFD_LISTEN].revents & POLLIN)
        accept_clients(s);
    reap_dropped(s);
    flush_state(s);
    return 0;
}

int ivs_server_run(struct ivs_server *s, volatile sig_atomic_t *stop,
                   const sigset_t *wait_mask)
{
    while (!*stop) {
        int rc = ivs_server_poll_once(s, wait_mask, -1);
        if (rc < 0)
            return rc;
    }
    return 0;
}

size_t ivs_server_nclients(const struct ivs_server *s)
{
    return s ? s->nclients : 0;
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

/* The region: a sealed memfd (default), or, in host-file mode, a file
   created exclusively at shm_path (never an existing one: peers may be
   using it; never through a link). */
static int create_region(struct ivs_server *s)
{
    const struct ivs_config *cfg = &s->cfg;
    int rc;
    if (!cfg->shm_path) {
        char name[200];
        const char *base = strrchr(cfg->socket_path, '/');
        snprintf(name, sizeof name, "ivshmem-server:%s",
                 base ? base + 1 : cfg->socket_path);
        rc = ivshm_admin_create_memfd(name, cfg->size, &cfg->geometry,
                                      &s->shm_fd);
        if (rc < 0) {
            ivs_log_error("create region: %s", ivshm_strerror(rc));
            return rc;
        }
    } else {
        rc = ivshm_admin_create_file(cfg->shm_path, cfg->size, &cfg->geometry,
                                     0600, &s->shm_fd);
        if (rc == -EEXIST) {
            ivs_log_error("%s already exists (remove it or choose another "
                          "name)", cfg->shm_path);
            return rc;
        }
        if (rc < 0) {
            ivs_log_error("format %s: %s", cfg->shm_path, ivshm_strerror(rc));
            return rc;
        }
        s->own_shm = true;
        if ((cfg->shared_group && fchown(s->shm_fd, (uid_t)-1, cfg->gid) < 0) ||
            fchmod(s->shm_fd, cfg->shared_group ? 0660 : 0600) < 0) {
            rc = -errno;
            ivs_log_error("chown/chmod %s: %s", cfg->shm_path, strerror(-rc));
            return rc;
        }
    }
    rc = ivshm_admin_open(s->shm_fd, &s->region);
    if (rc < 0)
        ivs_log_error("map region: %s", ivshm_strerror(rc));
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

/* Ids, budgets and the marking thread (it needs the region). */
static int start_accounting(struct ivs_server *s)
{
    const struct ivs_config *cfg = &s->cfg;
    uint32_t space = cfg->max_ids ? cfg->max_ids : IVS_MAX_IDS;
    unsigned per_pid = cfg->max_per_pid;
    struct ivs_budget_limits lim = {
        .per_uid = cfg->max_per_uid,
        .per_pid = per_pid,
        .uid_rate = cfg->uid_rate,
        .uid_burst = cfg->max_clients,
        .pid_rate = cfg->pid_rate,
        /* a process may open all its connections at once, twice */
        .pid_burst = per_pid ? 2 * per_pid : cfg->max_clients,
        .ids_per_pid = cfg->ids_per_pid,
    };
    s->ids = ivs_ids_new(space);
    s->budget = ivs_budget_new(&lim);
    if (!s->ids || !s->budget)
        return -ENOMEM;
    int rc = ivs_marker_start(s->region, space, &s->marker);
    if (rc < 0)
        ivs_log_error("marking thread: %s", strerror(-rc));
    return rc;
}

int ivs_server_start(const struct ivs_config *cfg, struct ivs_server **out)
{
    if (!cfg || !cfg->socket_path || cfg->vectors < 1 ||
        cfg->vectors > IVS_MAX_VECTORS || cfg->max_clients < 1 ||
        cfg->max_clients > IVS_MAX_CLIENTS || cfg->max_per_uid < 1 ||
        (cfg->max_ids && (cfg->max_ids < 2 || cfg->max_ids > IVS_MAX_IDS)))
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
        rc = start_accounting(s);
    if (rc == 0)
        rc = create_socket(s);
    if (rc < 0) {
        ivs_server_stop(s);
        return rc;
    }
    ivs_log_info("listening on %s, region %s (%llu bytes, %u vector%s)",
                 cfg->socket_path, cfg->shm_path ? cfg->shm_path : "memfd, sealed",
                 (unsigned long long)cfg->size, cfg->vectors,
                 cfg->vectors == 1 ? "" : "s");
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
    /* Leavers' entries still queued are marked before the region goes. */
    ivs_marker_stop(s->marker);
    ivs_budget_free(s->budget);
    ivs_ids_free(s->ids);
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    if (s->own_socket)
        unlink(s->cfg.socket_path);
    if (s->own_state)
        unlink(s->cfg.state_path);
    ivshm_admin_close(s->region);
    if (s->shm_fd >= 0)
        close(s->shm_fd);
    if (s->own_shm && !s->cfg.keep_shm)
        unlink(s->cfg.shm_path);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    free(s);
}

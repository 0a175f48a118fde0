/*
 * Per-uid and per-process budgets (budget.h). Token buckets count in
 * thousandths of a connection so that slow rates refill smoothly.
 */
#define _GNU_SOURCE
#include "budget.h"
#include "log.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHAINS 1024
/* Look at every account for ones to drop every this many admissions:
   amortized O(1), and memory bounded by the processes that connected
   within one bucket refill. */
#define SWEEP_EVERY 256
#define LOG_EVERY_NS 1000000000ull

struct bucket {
    uint64_t milli; /* tokens x 1000 */
    uint64_t at_ns; /* last refill */
};

/* One log line per second per account; the rest are counted. */
struct quiet {
    uint64_t logged_ns;
    unsigned untold;
};

struct user {
    struct user *next;
    uid_t uid;
    unsigned clients;
    unsigned accounts; /* processes referring to this user */
    struct bucket bucket;
    struct quiet quiet;
};

struct ivs_account {
    struct ivs_account *next;
    pid_t pid;
    unsigned long long start; /* /proc/PID/stat starttime, 0 if unknown */
    struct user *user;
    unsigned clients;
    unsigned held_ids;
    struct bucket bucket;
    struct quiet quiet;
};

struct ivs_budget {
    struct ivs_budget_limits lim;
    struct ivs_account *chain[CHAINS];
    struct user *users;
    unsigned admits;
};

struct ivs_budget *ivs_budget_new(const struct ivs_budget_limits *limits)
{
    struct ivs_budget *b = calloc(1, sizeof *b);
    if (b)
        b->lim = *limits;
    return b;
}

void ivs_budget_free(struct ivs_budget *b)
{
    if (!b)
        return;
    for (size_t i = 0; i < CHAINS; i++)
        while (b->chain[i]) {
            struct ivs_account *a = b->chain[i];
            b->chain[i] = a->next;
            free(a);
        }
    while (b->users) {
        struct user *u = b->users;
        b->users = u->next;
        free(u);
    }
    free(b);
}

/* ---- token buckets ---- */

static void refill(struct bucket *k, unsigned rate, unsigned burst,
                   uint64_t now)
{
    uint64_t cap = (uint64_t)burst * 1000;
    if (now > k->at_ns) {
        uint64_t add = (now - k->at_ns) / 1000000 * rate; /* per ms */
        k->milli = add >= cap - k->milli ? cap : k->milli + add;
        if (add)
            k->at_ns = now - (now - k->at_ns) % 1000000;
    }
}

static bool bucket_full(struct bucket *k, unsigned rate, unsigned burst,
                        uint64_t now)
{
    if (!rate)
        return true;
    refill(k, rate, burst, now);
    return k->milli >= (uint64_t)burst * 1000;
}

static bool bucket_has_one(struct bucket *k, unsigned rate, unsigned burst,
                           uint64_t now)
{
    if (!rate)
        return true;
    refill(k, rate, burst, now);
    return k->milli >= 1000;
}

static void bucket_take(struct bucket *k, unsigned rate)
{
    if (rate)
        k->milli -= 1000;
}

static void bucket_init(struct bucket *k, unsigned burst, uint64_t now)
{
    k->milli = (uint64_t)burst * 1000;
    k->at_ns = now;
}

/* ---- accounts ---- */

/* Field 22 of /proc/PID/stat: the process's start time, which tells a
   recycled pid from the process that had it. 0 when unreadable (another
   pid namespace, or already gone). */
static unsigned long long start_time(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* comm may hold anything */
    for (int field = 2; p && field < 22; field++)
        p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

static bool account_idle(const struct ivs_budget *b, struct ivs_account *a,
                         uint64_t now)
{
    return a->clients == 0 && a->held_ids == 0 &&
           bucket_full(&a->bucket, b->lim.pid_rate, b->lim.pid_burst, now);
}

static bool user_idle(const struct ivs_budget *b, struct user *u,
                      uint64_t now)
{
    return u->clients == 0 && u->accounts == 0 &&
           bucket_full(&u->bucket, b->lim.uid_rate, b->lim.uid_burst, now);
}

/* Drop idle accounts from one chain (all chains when `chain` < 0), then
   idle users. */
static void sweep(struct ivs_budget *b, int chain, uint64_t now)
{
    size_t lo = chain < 0 ? 0 : (size_t)chain;
    size_t hi = chain < 0 ? CHAINS : lo + 1;
    for (size_t i = lo; i < hi; i++)
        for (struct ivs_account **pp = &b->chain[i]; *pp;) {
            struct ivs_account *a = *pp;
            if (!account_idle(b, a, now)) {
                pp = &a->next;
                continue;
            }
            *pp = a->next;
            a->user->accounts--;
            free(a);
        }
    for (struct user **pp = &b->users; *pp;) {
        struct user *u = *pp;
        if (!user_idle(b, u, now)) {
            pp = &u->next;
            continue;
        }
        *pp = u->next;
        free(u);
    }
}

static struct user *find_user(struct ivs_budget *b, uid_t uid, uint64_t now)
{
    for (struct user *u = b->users; u; u = u->next)
        if (u->uid == uid)
            return u;
    struct user *u = calloc(1, sizeof *u);
    if (!u)
        return NULL;
    u->uid = uid;
    bucket_init(&u->bucket, b->lim.uid_burst, now);
    u->next = b->users;
    b->users = u;
    return u;
}

static struct ivs_account *find_account(struct ivs_budget *b, pid_t pid,
                                        uid_t uid, uint64_t now)
{
    size_t chain = (size_t)pid % CHAINS;
    sweep(b, (int)chain, now);
    /* An account with clients is its live process's: no need to read
       /proc for every connection of a storm. Otherwise the start time
       tells a recycled pid. */
    unsigned long long start = 0;
    bool looked = false;
    for (struct ivs_account *a = b->chain[chain]; a; a = a->next) {
        if (a->pid != pid || a->user->uid != uid)
            continue;
        if (a->clients)
            return a;
        if (!looked) {
            start = start_time(pid);
            looked = true;
        }
        if (a->start == start)
            return a;
    }
    if (!looked)
        start = start_time(pid);
    struct user *u = find_user(b, uid, now);
    struct ivs_account *a = u ? calloc(1, sizeof *a) : NULL;
    if (!a)
        return NULL;
    a->pid = pid;
    a->start = start;
    a->user = u;
    u->accounts++;
    bucket_init(&a->bucket, b->lim.pid_burst, now);
    a->next = b->chain[chain];
    b->chain[chain] = a;
    return a;
}

/* ---- verdicts ---- */

static bool may_log(struct quiet *q, uint64_t now)
{
    if (q->logged_ns && now - q->logged_ns < LOG_EVERY_NS) {
        q->untold++;
        return false;
    }
    q->logged_ns = now;
    return true;
}

static void log_refusal(const struct ivs_budget *b, struct ivs_account *a,
                        enum ivs_verdict v, uint64_t now)
{
    bool of_uid = v == IVS_UID_CLIENTS || v == IVS_UID_RATE;
    struct quiet *q = of_uid ? &a->user->quiet : &a->quiet;
    unsigned untold = q->untold;
    if (!may_log(q, now))
        return;
    q->untold = 0;
    char more[64] = "";
    if (untold)
        snprintf(more, sizeof more, " (%u more refused in the last second)",
                 untold);
    int pid = (int)a->pid, uid = (int)a->user->uid;
    switch (v) {
    case IVS_UID_CLIENTS:
        ivs_log_error("refusing pid %d: uid %d has %u clients "
                      "(--max-clients-per-uid)%s", pid, uid, a->user->clients,
                      more);
        break;
    case IVS_PID_CLIENTS:
        ivs_log_error("refusing pid %d (uid %d): it has %u clients "
                      "(--max-clients-per-pid)%s", pid, uid, a->clients, more);
        break;
    case IVS_UID_RATE:
        ivs_log_error("refusing pid %d: uid %d connects faster than %u/s "
                      "(--connect-rate-per-uid)%s", pid, uid, b->lim.uid_rate,
                      more);
        break;
    case IVS_PID_RATE:
        ivs_log_error("refusing pid %d (uid %d): it connects faster than "
                      "%u/s (--connect-rate-per-pid)%s", pid, uid,
                      b->lim.pid_rate, more);
        break;
    case IVS_PID_IDS:
        ivs_log_error("refusing pid %d (uid %d): %u ids it used are unusable "
                      "until the clients that saw them leave go "
                      "(--ids-per-pid)%s", pid, uid, a->held_ids, more);
        break;
    default:
        break;
    }
}

enum ivs_verdict ivs_budget_admit(struct ivs_budget *b, pid_t pid, uid_t uid,
                                  uint64_t now_ns, bool final,
                                  struct ivs_account **account)
{
    if (++b->admits % SWEEP_EVERY == 0)
        sweep(b, -1, now_ns);
    struct ivs_account *a = find_account(b, pid, uid, now_ns);
    if (!a)
        return IVS_NO_MEMORY;
    const struct ivs_budget_limits *l = &b->lim;
    struct user *u = a->user;
    enum ivs_verdict v = IVS_ADMIT;
    /* the process's own limits first: a refusal then names it. Pid 0
       is a process in a pid namespace we cannot see: only its uid's
       limits can apply. */
    bool known = pid > 0;
    if (known && l->per_pid && a->clients >= l->per_pid)
        v = IVS_PID_CLIENTS;
    else if (known && l->ids_per_pid && a->held_ids >= l->ids_per_pid)
        v = IVS_PID_IDS;
    else if (known &&
             !bucket_has_one(&a->bucket, l->pid_rate, l->pid_burst, now_ns))
        v = IVS_PID_RATE;
    else if (l->per_uid && u->clients >= l->per_uid)
        v = IVS_UID_CLIENTS;
    else if (!bucket_has_one(&u->bucket, l->uid_rate, l->uid_burst, now_ns))
        v = IVS_UID_RATE;
    if (v != IVS_ADMIT) {
        bool cap = v == IVS_PID_CLIENTS || v == IVS_UID_CLIENTS;
        if (final || !cap)
            log_refusal(b, a, v, now_ns);
        return v;
    }
    if (known)
        bucket_take(&a->bucket, l->pid_rate);
    bucket_take(&u->bucket, l->uid_rate);
    a->clients++;
    u->clients++;
    *account = a;
    return IVS_ADMIT;
}

void ivs_budget_leave(struct ivs_account *a)
{
    if (!a)
        return;
    a->clients--;
    a->user->clients--;
}

void ivs_budget_hold_id(struct ivs_account *a)
{
    if (a)
        a->held_ids++;
}

void ivs_budget_release_id(struct ivs_account *a)
{
    if (a && a->held_ids)
        a->held_ids--;
}

/*
 * What one uid and one process may cost the server and its other
 * clients (docs/server-protocol.md, "Budgets"): connections at once,
 * new connections per second (a token bucket each), and ids left
 * unusable (ids.h). A tenant's QEMUs share one uid, so the uid's caps
 * alone cannot keep one of them from crowding out the others; the
 * per-process caps are kept below the uid's so that no single process
 * (a QEMU under libvirt's seccomp sandbox cannot fork) takes them all.
 *
 * A process is told apart by its pid and its start time, so a budget
 * is never inherited by a new process that got a recycled pid.
 * Lookups are O(1) on average (a hash by pid); an account is kept
 * while it has clients or unusable ids, or its bucket is not full.
 */
#ifndef IVS_BUDGET_H
#define IVS_BUDGET_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct ivs_budget_limits {
    unsigned per_uid;           /* connections at once; 0: no limit */
    unsigned per_pid;
    unsigned uid_rate;          /* connections per second; 0: no limit */
    unsigned uid_burst;         /* bucket size, >= 1 with uid_rate */
    unsigned pid_rate;
    unsigned pid_burst;
    unsigned ids_per_pid;       /* ids left unusable; 0: no limit */
};

enum ivs_verdict {
    IVS_ADMIT,
    IVS_UID_CLIENTS,  /* connections at once */
    IVS_PID_CLIENTS,
    IVS_UID_RATE,     /* connections per second */
    IVS_PID_RATE,
    IVS_PID_IDS,      /* ids left unusable */
    IVS_NO_MEMORY,
};

struct ivs_budget;
/* A process's account: held by each of its clients and by each id it
   left unusable. */
struct ivs_account;

struct ivs_budget *ivs_budget_new(const struct ivs_budget_limits *limits);
void ivs_budget_free(struct ivs_budget *b);

/* May a process (`pid`, `uid`) connect now (`now_ns`, monotonic)? On
   IVS_ADMIT the connection is counted and *account is the process's.
   A refusal is logged, at most one line per second per uid or process
   (with the count of those not logged), except a refusal at a
   connection cap when `final` is false: the caller may reap hung-up
   clients and ask again. */
enum ivs_verdict ivs_budget_admit(struct ivs_budget *b, pid_t pid, uid_t uid,
                                  uint64_t now_ns, bool final,
                                  struct ivs_account **account);
/* A client of `a` left. */
void ivs_budget_leave(struct ivs_account *a);
/* An id a client of `a` held is unusable for now (ids.h); and usable
   again. */
void ivs_budget_hold_id(struct ivs_account *a);
void ivs_budget_release_id(struct ivs_account *a);

#endif

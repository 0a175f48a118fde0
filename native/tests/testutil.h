/* Small helpers shared by the C tests: checks that count, a unique region
   file that is removed at exit, and fork helpers with bounded waits. */
#ifndef IVSHM_TESTUTIL_H
#define IVSHM_TESTUTIL_H

#include "ivshm.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

extern int tu_failed;
extern int tu_passed;

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (cond) {                                                          \
            tu_passed++;                                                     \
        } else {                                                             \
            tu_failed++;                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                  \
        }                                                                    \
    } while (0)

/* CHECK that an ivshm call returned `want`, printing the error text. */
#define CHECK_RC(expr, want)                                                 \
    do {                                                                     \
        long long rc_ = (long long)(expr);                                   \
        if (rc_ == (long long)(want)) {                                      \
            tu_passed++;                                                     \
        } else {                                                             \
            tu_failed++;                                                     \
            fprintf(stderr, "%s:%d: %s returned %lld (%s), wanted %lld\n",   \
                    __FILE__, __LINE__, #expr, rc_,                          \
                    ivshm_strerror((int)rc_), (long long)(want));            \
        }                                                                    \
    } while (0)

/* In a forked child: abort the child with a message if cond is false. */
#define REQUIRE(cond)                                                        \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: [pid %d] REQUIRE failed: %s\n",          \
                    __FILE__, __LINE__, (int)getpid(), #cond);               \
            _exit(99);                                                       \
        }                                                                    \
    } while (0)

/* Create and format a fresh region file in /dev/shm with a unique name;
   it is unlinked at exit (also when a CHECK fails). Returns the path. */
const char *tu_region(uint64_t size, const ivshm_geometry *g);
/* Attach to `path` as (job, rank); exits the process on failure. */
ivshm *tu_attach(const char *path, uint64_t job, uint32_t rank,
                 int64_t spin_ns);
/* Fork a child running fn(arg); returns its pid. The child _exit()s with
   fn's return value. */
pid_t tu_fork(int (*fn)(void *), void *arg);
/* fork(), and the child dies when the test does (also by SIGKILL). */
pid_t tu_fork_child(void);
/* Wait for `pid` at most timeout_ms; kills it (SIGKILL) on timeout.
   Returns its exit status (0..255), or -1 if killed/timed out. */
int tu_wait(pid_t pid, int timeout_ms);
/* Sleep `ms` milliseconds. */
void tu_sleep_ms(int ms);
/* CLOCK_MONOTONIC in nanoseconds, and in milliseconds. */
uint64_t tu_now_ns(void);
uint64_t tu_now_ms(void);
/* Slot of the live peer (job, rank) in h's region, waiting up to
   timeout_ms for it to attach; -1 if it never does. */
int tu_await_peer(ivshm *h, uint64_t job, uint32_t rank, int timeout_ms);
/* Does `cond` become true within `timeout_ms`? Polled every millisecond;
   a statement expression, usable inside CHECK(). */
#define TU_EVENTUALLY(cond, timeout_ms)                                      \
    ({                                                                       \
        uint64_t end_ = tu_now_ns() + (uint64_t)(timeout_ms) * 1000000ull;   \
        bool ok_;                                                            \
        while (!(ok_ = (cond)) && tu_now_ns() < end_)                        \
            tu_sleep_ms(1);                                                  \
        ok_;                                                                 \
    })
/* $IVSHM_SERVER_BIN (the ivshmem-server under test, set by CTest), or
   NULL after one line on stderr when it is unset or not executable. */
const char *tu_server_bin(void);
/* Does `path` exist (not following a final symlink)? */
bool tu_exists(const char *path);
/* The first 8 KiB of a text file, NUL-terminated, in a static buffer
   (overwritten by the next call), or NULL. */
char *tu_read_text(const char *path);
/* Run `cleanup` at exit, and on SIGINT, SIGTERM, SIGABRT and SIGALRM
   before the signal ends the process as it would have. */
void tu_cleanup_on_exit(void (*cleanup)(void));
/* Print "N passed, N failed" and return the exit code for main. */
int tu_summary(const char *name);

#endif

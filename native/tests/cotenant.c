/* Helpers of the hostile tests (cotenant.h). */
#define _GNU_SOURCE
#include "cotenant.h"

#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

ivshm *ct_map(const char *path)
{
    int fd = open(path, O_RDWR | O_CLOEXEC);
    ivshm *raw = NULL;
    int rc = fd < 0 ? -errno : ivshm_region_map(fd, &raw);
    if (rc < 0) {
        fprintf(stderr, "[pid %d] map %s: %s\n", (int)getpid(), path,
                ivshm_strerror(rc));
        _exit(98);
    }
    return raw;
}

void ct_unmap(ivshm *raw)
{
    ivshm_region_unmap(raw);
}

uint8_t *ct_ring(ivshm *raw, int from, int to)
{
    return ivshm_fast_ring_of(raw, from, to);
}

void ct_gate_init(struct ct_gate *g)
{
    if (pipe2(g->fd, O_CLOEXEC) < 0) {
        perror("pipe");
        exit(1);
    }
}

void ct_signal(struct ct_gate *g)
{
    char c = 1;
    if (write(g->fd[1], &c, 1) != 1)
        perror("gate write");
}

bool ct_await(struct ct_gate *g, int timeout_ms)
{
    struct pollfd p = {.fd = g->fd[0], .events = POLLIN};
    char c;
    return poll(&p, 1, timeout_ms) == 1 && read(g->fd[0], &c, 1) == 1;
}

static cpu_set_t cpus_at_start;

void ct_pin_init(void)
{
    if (sched_getaffinity(0, sizeof cpus_at_start, &cpus_at_start) < 0)
        CPU_ZERO(&cpus_at_start);
}

void ct_pin(int n)
{
    if (CPU_COUNT(&cpus_at_start) < 2)
        return;
    int seen = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &cpus_at_start) && seen++ == n) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(c, &one);
            sched_setaffinity(0, sizeof one, &one);
            return;
        }
}

void ct_unpin(void)
{
    if (CPU_COUNT(&cpus_at_start))
        sched_setaffinity(0, sizeof cpus_at_start, &cpus_at_start);
}

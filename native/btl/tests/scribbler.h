/*
 * What the co-tenant processes of tests/test_btl_trust.py share
 * (idle_scribbler.c, tail_scribbler.c, foreign_ring.c): map the region file named on the
 * command line, take its layout from the header (read once, every area
 * checked against the file's size), stop at SIGTERM or after the given
 * seconds. Built with -I native/src: the layout is libivshm's header.
 */
#ifndef SCRIBBLER_H
#define SCRIBBLER_H

#include "internal.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A mapped region and its geometry. */
struct scribbled {
    uint8_t *base;
    struct ivshm_header hdr;
    uint64_t S, Q, Z;   /* ring slots, queue cells, slot size */
    uint32_t F;         /* fast channels */
    uint64_t end_ms;    /* when to stop */
};

/* `who REGION SECONDS`: 0 with *r filled, else the exit code (the reason
   said on stderr). */
static int scribbler_open(const char *who, int argc, char **argv,
                          struct scribbled *r)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s REGION SECONDS\n", who);
        return 2;
    }
    signal(SIGTERM, on_term);
    int fd = open(argv[1], O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(argv[1]);
        return 1;
    }
    r->base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                   MAP_SHARED, fd, 0);
    if (r->base == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    struct ivshm_header *hdr = &r->hdr;
    memcpy(hdr, r->base, sizeof *hdr);
    r->S = hdr->ring_slots;
    r->Q = hdr->queue_slots;
    r->Z = hdr->slot_size;
    r->F = hdr->fast_channels == IVSHM_FAST_NONE ? 0 : hdr->fast_channels;
    if (hdr->magic != IVSHM_MAGIC || !r->S || !r->Q || !r->Z ||
        hdr->rx_off + hdr->max_peers * hdr->rx_bytes > (uint64_t)st.st_size ||
        IVSHM_QUEUE_CTRL + r->Q * r->Z +
                r->F * (IVSHM_FAST_DESC + hdr->ring_bytes) >
            hdr->rx_bytes) {
        fprintf(stderr, "%s: not a region it understands\n", who);
        return 1;
    }
    r->end_ms = now_ms() + 1000 * strtoull(argv[2], NULL, 10);
    return 0;
}

#endif

/*
 * What the MPI programs of tests/test_btl_trust.py share
 * (trust_pingpong.c, trust_spawn.c): the byte pattern every message
 * carries, and failing the job with one line that says where.
 */
#ifndef TRUST_CHECK_H
#define TRUST_CHECK_H

#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int rank;

static void fail(const char *what, long a, long b)
{
    fprintf(stderr, "FAIL rank %d: %s (%ld, %ld)\n", rank, what, a, b);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

static unsigned char pattern(uint32_t seed, size_t i)
{
    uint32_t x = seed * 2654435761u + (uint32_t)i * 40503u;
    return (unsigned char)(x ^ (x >> 13));
}

#endif

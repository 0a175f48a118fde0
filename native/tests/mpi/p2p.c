/*
 * Point-to-point correctness: blocking and non-blocking sends of 0 B to
 * 256 MiB with content checks, MPI_ANY_SOURCE / MPI_ANY_TAG, probe and
 * iprobe (incl. matched probe), per-sender ordering across the eager /
 * rendezvous switch, 1000 outstanding requests each way, synchronous
 * sends and Waitany/Testsome completion. Run with 2 or more ranks (3+
 * makes ANY_SOURCE meet several senders). Optional argument: the
 * largest size in MiB (default 256).
 */
#include "mpitest.h"

#define TAG_SIZES 11
#define TAG_ECHO 12
#define TAG_PROBE 13
#define TAG_ORDER 14
#define N_OUTSTANDING 1000
#define ANY_PER_SENDER 200
#define ORDER_COUNT 3000

static int rank, nranks;

/* Rank 0 <-> 1: send each size, the peer checks it and echoes a
   differently seeded buffer back; blocking, then non-blocking, then
   synchronous mode. */
static void sizes_pingpong(size_t max_bytes)
{
    static const size_t fixed[] = {0, 1, 7, 8, 63, 64, 65, 4064, 4096, 4097,
                                   12288, 65535, 65536, 65537, 262143,
                                   (1u << 20) - 1, 1u << 20, (4u << 20) + 3,
                                   16u << 20, 64u << 20, 256u << 20};
    if (rank > 1)
        return;
    char *buf = mt_alloc(max_bytes);
    int peer = rank ^ 1, tested = 0;
    for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++) {
        size_t n = fixed[k];
        if (n > max_bytes)
            break;
        for (int mode = 0; mode < 3; mode++) {
            /* the big sizes once (blocking) is enough and keeps it quick */
            if (mode > 0 && n > (16u << 20))
                continue;
            uint64_t seed_out = k * 16 + (uint64_t)mode * 4;
            MPI_Status st;
            int count = -1;
            if (rank == 0) {
                MPI_Request rq[2];
                mt_fill(buf, n, seed_out);
                if (mode == 0) {
                    MPI_OK(MPI_Send(buf, (int)n, MPI_BYTE, peer, TAG_SIZES,
                                    MPI_COMM_WORLD));
                } else if (mode == 1) {
                    MPI_OK(MPI_Isend(buf, (int)n, MPI_BYTE, peer, TAG_SIZES,
                                     MPI_COMM_WORLD, &rq[0]));
                    MPI_OK(MPI_Wait(&rq[0], MPI_STATUS_IGNORE));
                } else {
                    MPI_OK(MPI_Ssend(buf, (int)n, MPI_BYTE, peer, TAG_SIZES,
                                     MPI_COMM_WORLD));
                }
                memset(buf, 0xEE, n);
                if (mode == 1) {
                    MPI_OK(MPI_Irecv(buf, (int)n, MPI_BYTE, peer, TAG_ECHO,
                                     MPI_COMM_WORLD, &rq[1]));
                    MPI_OK(MPI_Wait(&rq[1], &st));
                } else {
                    MPI_OK(MPI_Recv(buf, (int)n, MPI_BYTE, peer, TAG_ECHO,
                                    MPI_COMM_WORLD, &st));
                }
                MPI_Get_count(&st, MPI_BYTE, &count);
                CHECK(count == (int)n, "echo of %zu B: count %d", n, count);
                long long bad = mt_verify(buf, n, seed_out + 1);
                CHECK(bad < 0, "echo of %zu B (mode %d): byte %lld wrong", n,
                      mode, bad);
            } else {
                memset(buf, 0xDD, n);
                if (mode == 1) {
                    MPI_Request rq;
                    MPI_OK(MPI_Irecv(buf, (int)n, MPI_BYTE, peer, TAG_SIZES,
                                     MPI_COMM_WORLD, &rq));
                    MPI_OK(MPI_Wait(&rq, &st));
                } else {
                    MPI_OK(MPI_Recv(buf, (int)n, MPI_BYTE, peer, TAG_SIZES,
                                    MPI_COMM_WORLD, &st));
                }
                MPI_Get_count(&st, MPI_BYTE, &count);
                CHECK(count == (int)n && st.MPI_SOURCE == peer &&
                          st.MPI_TAG == TAG_SIZES,
                      "%zu B: count %d source %d tag %d", n, count,
                      st.MPI_SOURCE, st.MPI_TAG);
                long long bad = mt_verify(buf, n, seed_out);
                CHECK(bad < 0, "%zu B (mode %d): byte %lld wrong", n, mode,
                      bad);
                mt_fill(buf, n, seed_out + 1);
                MPI_OK(MPI_Send(buf, (int)n, MPI_BYTE, peer, TAG_ECHO,
                                MPI_COMM_WORLD));
            }
            tested++;
        }
    }
    free(buf);
    if (rank == 0)
        printf("p2p: sizes 0 B .. %zu MiB, %d exchanges ok\n",
               max_bytes >> 20, tested);
}

/* Every rank but 0 sends ANY_PER_SENDER messages of varying size with
   tags 1000*rank + k; rank 0 takes them with ANY_SOURCE/ANY_TAG and
   checks source, tag, length, content and per-sender order. */
static void any_source(void)
{
    enum { MAXLEN = 70000 };
    char *buf = mt_alloc(MAXLEN);
    if (rank == 0) {
        int *next = calloc((size_t)nranks, sizeof *next);
        CHECK(next != NULL, "calloc");
        for (int m = 0; m < (nranks - 1) * ANY_PER_SENDER; m++) {
            MPI_Status st;
            int count;
            MPI_OK(MPI_Recv(buf, MAXLEN, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG,
                            MPI_COMM_WORLD, &st));
            int src = st.MPI_SOURCE, k = st.MPI_TAG - 1000 * src;
            CHECK(src > 0 && src < nranks, "source %d", src);
            CHECK(k == next[src], "from %d: tag %d, expected k=%d (order)",
                  src, st.MPI_TAG, next[src]);
            size_t len = (size_t)(k * 331 + src * 17) % MAXLEN;
            MPI_Get_count(&st, MPI_BYTE, &count);
            CHECK(count == (int)len, "from %d k %d: %d B, expected %zu", src,
                  k, count, len);
            long long bad = mt_verify(buf, len, (uint64_t)src << 20 | (uint64_t)k);
            CHECK(bad < 0, "from %d k %d: byte %lld wrong", src, k, bad);
            next[src]++;
        }
        free(next);
        printf("p2p: ANY_SOURCE/ANY_TAG %d messages from %d senders ok\n",
               (nranks - 1) * ANY_PER_SENDER, nranks - 1);
    } else {
        for (int k = 0; k < ANY_PER_SENDER; k++) {
            size_t len = (size_t)(k * 331 + rank * 17) % MAXLEN;
            mt_fill(buf, len, (uint64_t)rank << 20 | (uint64_t)k);
            MPI_OK(MPI_Send(buf, (int)len, MPI_BYTE, 0, 1000 * rank + k,
                            MPI_COMM_WORLD));
        }
    }
    free(buf);
}

/* Receiver learns size and sender only by probing: MPI_Probe, an
   MPI_Iprobe polling loop (bounded), and MPI_Mprobe/MPI_Mrecv. */
static void probes(void)
{
    if (rank > 1)
        return;
    static const int lens[] = {0, 5, 4000, 100000, 3 << 20};
    const int nl = (int)(sizeof lens / sizeof lens[0]);
    if (rank == 1) {
        char *buf = mt_alloc(3 << 20);
        for (int how = 0; how < 3; how++)
            for (int i = 0; i < nl; i++) {
                mt_fill(buf, (size_t)lens[i], (uint64_t)(how * 10 + i));
                MPI_OK(MPI_Send(buf, lens[i], MPI_BYTE, 0,
                                TAG_PROBE + how * 100 + i, MPI_COMM_WORLD));
            }
        free(buf);
        return;
    }
    for (int how = 0; how < 3; how++)
        for (int i = 0; i < nl; i++) {
            MPI_Status st;
            MPI_Message msg = MPI_MESSAGE_NULL;
            int count = -1, flag = 0;
            if (how == 0) {
                MPI_OK(MPI_Probe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD,
                                 &st));
            } else if (how == 1) {
                double t0 = MPI_Wtime();
                while (!flag) {
                    MPI_OK(MPI_Iprobe(1, MPI_ANY_TAG, MPI_COMM_WORLD, &flag,
                                      &st));
                    CHECK(flag || !mt_expired(t0, 60),
                          "Iprobe: nothing arrived within 60 s");
                }
            } else {
                MPI_OK(MPI_Mprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD,
                                  &msg, &st));
            }
            MPI_Get_count(&st, MPI_BYTE, &count);
            CHECK(st.MPI_SOURCE == 1 && st.MPI_TAG == TAG_PROBE + how * 100 + i
                      && count == lens[i],
                  "probe %d/%d: source %d tag %d count %d", how, i,
                  st.MPI_SOURCE, st.MPI_TAG, count);
            char *buf = mt_alloc((size_t)count);
            if (how == 2)
                MPI_OK(MPI_Mrecv(buf, count, MPI_BYTE, &msg, &st));
            else
                MPI_OK(MPI_Recv(buf, count, MPI_BYTE, st.MPI_SOURCE,
                                st.MPI_TAG, MPI_COMM_WORLD, &st));
            long long bad = mt_verify(buf, (size_t)count,
                                      (uint64_t)(how * 10 + i));
            CHECK(bad < 0, "probed message %d/%d: byte %lld wrong", how, i,
                  bad);
            free(buf);
        }
    printf("p2p: probe, iprobe, mprobe ok\n");
}

/* One tag, one sender, sizes alternating between tiny and a rendezvous
   size: the non-overtaking rule must hold across protocols. */
static void ordering(void)
{
    if (rank > 1)
        return;
    enum { BIG = 200000 };
    char *buf = mt_alloc(BIG);
    for (int i = 0; i < ORDER_COUNT; i++) {
        size_t len = i % 50 == 49 ? BIG : (size_t)(8 + i % 7);
        if (rank == 1) {
            mt_fill(buf, len, (uint64_t)i + 7777);
            memcpy(buf, &i, sizeof i); /* len >= 8 */
            MPI_OK(MPI_Send(buf, (int)len, MPI_BYTE, 0, TAG_ORDER,
                            MPI_COMM_WORLD));
        } else {
            MPI_Status st;
            int count, seq;
            MPI_OK(MPI_Recv(buf, BIG, MPI_BYTE, 1, TAG_ORDER, MPI_COMM_WORLD,
                            &st));
            MPI_Get_count(&st, MPI_BYTE, &count);
            CHECK(count == (int)len, "message %d: %d B, expected %zu", i,
                  count, len);
            memcpy(&seq, buf, sizeof seq);
            CHECK(seq == i, "message %d arrived as number %d", seq, i);
            /* the sequence number overwrote the first bytes */
            for (size_t b = sizeof seq; b < len; b++)
                CHECK((uint8_t)buf[b] == mt_byte((uint64_t)i + 7777, b),
                      "message %d: byte %zu wrong", i, b);
        }
    }
    free(buf);
    if (rank == 0)
        printf("p2p: ordering of %d mixed-size messages ok\n", ORDER_COUNT);
}

/* Both ranks post N_OUTSTANDING receives and N_OUTSTANDING sends to each
   other at once (tags in reverse posting order on one side), some of
   them large, then complete them with Waitall / Waitany / Testsome. */
static void outstanding(void)
{
    if (rank > 1)
        return;
    int peer = rank ^ 1;
    size_t *len = mt_alloc(N_OUTSTANDING * sizeof *len);
    char **sbuf = mt_alloc(N_OUTSTANDING * sizeof *sbuf);
    char **rbuf = mt_alloc(N_OUTSTANDING * sizeof *rbuf);
    MPI_Request *rq = mt_alloc(2 * N_OUTSTANDING * sizeof *rq);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < N_OUTSTANDING; i++) {
            len[i] = i % 100 == 0 ? 300000 : (size_t)(i * 13 % 2000);
            sbuf[i] = mt_alloc(len[i]);
            rbuf[i] = mt_alloc(len[i]);
            memset(rbuf[i], 0xCC, len[i]);
        }
        /* receives first on rank 0, sends first on rank 1: both orders */
        for (int pass = 0; pass < 2; pass++) {
            int recv_pass = rank == 0 ? 0 : 1;
            for (int j = 0; j < N_OUTSTANDING; j++) {
                if (pass == recv_pass) {
                    int i = N_OUTSTANDING - 1 - j;
                    MPI_OK(MPI_Irecv(rbuf[i], (int)len[i], MPI_BYTE, peer, i,
                                     MPI_COMM_WORLD, &rq[i]));
                } else {
                    int i = j;
                    mt_fill(sbuf[i], len[i],
                            (uint64_t)(rank * 100000 + round * 10000 + i));
                    MPI_OK(MPI_Isend(sbuf[i], (int)len[i], MPI_BYTE, peer, i,
                                     MPI_COMM_WORLD, &rq[N_OUTSTANDING + i]));
                }
            }
        }
        int total = 2 * N_OUTSTANDING;
        if (round == 0) {
            MPI_OK(MPI_Waitall(total, rq, MPI_STATUSES_IGNORE));
        } else if (round == 1) {
            for (int done = 0; done < total; done++) {
                int idx;
                MPI_OK(MPI_Waitany(total, rq, &idx, MPI_STATUS_IGNORE));
                CHECK(idx != MPI_UNDEFINED, "Waitany: undefined after %d",
                      done);
            }
        } else {
            int *idx = mt_alloc((size_t)total * sizeof *idx), done = 0;
            double t0 = MPI_Wtime();
            while (done < total) {
                int outcount;
                MPI_OK(MPI_Testsome(total, rq, &outcount, idx,
                                    MPI_STATUSES_IGNORE));
                CHECK(outcount != MPI_UNDEFINED, "Testsome: undefined");
                done += outcount;
                CHECK(!mt_expired(t0, 120), "Testsome: %d of %d done in 120 s",
                      done, total);
            }
            free(idx);
        }
        for (int i = 0; i < N_OUTSTANDING; i++) {
            long long bad = mt_verify(rbuf[i], len[i],
                                      (uint64_t)(peer * 100000 + round * 10000
                                                 + i));
            CHECK(bad < 0, "round %d request %d (%zu B): byte %lld wrong",
                  round, i, len[i], bad);
            free(sbuf[i]);
            free(rbuf[i]);
        }
    }
    free(rq);
    free(rbuf);
    free(sbuf);
    free(len);
    if (rank == 0)
        printf("p2p: %d outstanding isend+irecv each way x 3 ok\n",
               N_OUTSTANDING);
}

/* Sendrecv around a ring of all ranks, and Sendrecv_replace. */
static void ring(void)
{
    enum { LEN = 50000 };
    char *out = mt_alloc(LEN), *in = mt_alloc(LEN);
    int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    mt_fill(out, LEN, 500 + (uint64_t)rank);
    MPI_OK(MPI_Sendrecv(out, LEN, MPI_BYTE, right, 21, in, LEN, MPI_BYTE, left,
                        21, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    CHECK(mt_verify(in, LEN, 500 + (uint64_t)left) < 0, "Sendrecv from %d",
          left);
    MPI_OK(MPI_Sendrecv_replace(out, LEN, MPI_BYTE, right, 22, left, 22,
                                MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    CHECK(mt_verify(out, LEN, 500 + (uint64_t)left) < 0,
          "Sendrecv_replace from %d", left);
    free(out);
    free(in);
    if (rank == 0)
        printf("p2p: sendrecv ring over %d ranks ok\n", nranks);
}

int main(int argc, char **argv)
{
    mt_init(&argc, &argv, &rank, &nranks);
    CHECK(nranks >= 2, "needs at least 2 ranks, got %d", nranks);
    size_t max_mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    CHECK(max_mib >= 1 && max_mib <= 1024, "max size %zu MiB", max_mib);

    sizes_pingpong(max_mib << 20);
    MPI_Barrier(MPI_COMM_WORLD);
    any_source();
    MPI_Barrier(MPI_COMM_WORLD);
    probes();
    MPI_Barrier(MPI_COMM_WORLD);
    ordering();
    MPI_Barrier(MPI_COMM_WORLD);
    outstanding();
    MPI_Barrier(MPI_COMM_WORLD);
    ring();
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0)
        printf("PASS p2p (%d ranks)\n", nranks);
    MPI_Finalize();
    return 0;
}

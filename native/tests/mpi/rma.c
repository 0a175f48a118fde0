/*
 * One-sided correctness, active and passive target: fence epochs with
 * put/get/accumulate (small and 1 MiB), PSCW (post/start/complete/wait),
 * exclusive locks as a mutex (non-atomic get+put increments must not be
 * lost), fetch_and_op / compare_and_swap tickets, shared locks with
 * put/get/accumulate/flush, lock_all + flush_all, and 4 MiB transfers
 * into an MPI_Win_allocate window. Any number of ranks >= 2.
 */
#include "mpitest.h"

#define ROUNDS 30      /* lock/unlock increments per rank */
#define BIG (1 << 20)  /* bytes of the large fence transfer */
#define HUGE (4 << 20) /* bytes of the passive-target allocate transfer */

static int rank, nranks;

/* Window layout (ints): [0, n) slots written by rank i, then counters,
   then a BIG byte area. */
enum { CTR_MUTEX, CTR_FOP, CTR_ACC, CTR_CAS, NCTR };

struct win {
    MPI_Win win;
    int *slots;   /* nranks ints */
    int *ctr;     /* NCTR ints */
    char *big;    /* BIG bytes */
    void *base;
};

static struct win make_window(int use_allocate)
{
    struct win w;
    MPI_Aint bytes = (MPI_Aint)((size_t)(nranks + NCTR) * sizeof(int) + BIG);
    if (use_allocate) {
        MPI_OK(MPI_Win_allocate(bytes, 1, MPI_INFO_NULL, MPI_COMM_WORLD,
                                &w.base, &w.win));
    } else {
        w.base = mt_alloc((size_t)bytes);
        MPI_OK(MPI_Win_create(w.base, bytes, 1, MPI_INFO_NULL, MPI_COMM_WORLD,
                              &w.win));
    }
    MPI_Win_set_errhandler(w.win, MPI_ERRORS_RETURN);
    w.slots = w.base;
    w.ctr = w.slots + nranks;
    w.big = (char *)(w.ctr + NCTR);
    return w;
}

static void free_window(struct win *w, int use_allocate)
{
    MPI_OK(MPI_Win_free(&w->win));
    if (!use_allocate)
        free(w->base);
}

static MPI_Aint slot_disp(int i)
{
    return (MPI_Aint)((size_t)i * sizeof(int));
}

static MPI_Aint ctr_disp(int c)
{
    return (MPI_Aint)((size_t)(nranks + c) * sizeof(int));
}

static MPI_Aint big_disp(void)
{
    return (MPI_Aint)((size_t)(nranks + NCTR) * sizeof(int));
}

/* Reads of our own window memory outside an active epoch go through an
   exclusive self-lock, so the memory model is never in question. */
static void lock_self(struct win *w)
{
    MPI_OK(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, w->win));
}

static void unlock_self(struct win *w)
{
    MPI_OK(MPI_Win_unlock(rank, w->win));
}

static void fence_epochs(int use_allocate)
{
    struct win w = make_window(use_allocate);
    int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    for (int i = 0; i < nranks; i++)
        w.slots[i] = -1;
    memset(w.ctr, 0, NCTR * sizeof(int));
    MPI_OK(MPI_Win_fence(0, w.win));

    /* put my id into slot[rank] of right; accumulate into rank 0 */
    int mine = 1000 + rank, one = rank + 1;
    MPI_OK(MPI_Put(&mine, 1, MPI_INT, right, slot_disp(rank), 1, MPI_INT,
                   w.win));
    MPI_OK(MPI_Accumulate(&one, 1, MPI_INT, 0, ctr_disp(CTR_ACC), 1, MPI_INT,
                          MPI_SUM, w.win));
    char *src = mt_alloc(BIG);
    mt_fill(src, BIG, 40 + (uint64_t)rank);
    MPI_OK(MPI_Put(src, BIG, MPI_BYTE, right, big_disp(), BIG, MPI_BYTE,
                   w.win));
    MPI_OK(MPI_Win_fence(0, w.win));
    CHECK(w.slots[left] == 1000 + left, "fence put: slot %d = %d", left,
          w.slots[left]);
    if (rank == 0)
        CHECK(w.ctr[CTR_ACC] == nranks * (nranks + 1) / 2,
              "fence accumulate: %d", w.ctr[CTR_ACC]);
    long long bad = mt_verify(w.big, BIG, 40 + (uint64_t)left);
    CHECK(bad < 0, "fence 1 MiB put from %d: byte %lld wrong", left, bad);

    /* get back what I put into right's window, small and large */
    int got = -5;
    memset(src, 0, BIG);
    MPI_OK(MPI_Get(&got, 1, MPI_INT, right, slot_disp(rank), 1, MPI_INT,
                   w.win));
    MPI_OK(MPI_Get(src, BIG, MPI_BYTE, right, big_disp(), BIG, MPI_BYTE,
                   w.win));
    MPI_OK(MPI_Win_fence(0, w.win));
    CHECK(got == mine, "fence get: %d", got);
    bad = mt_verify(src, BIG, 40 + (uint64_t)rank);
    CHECK(bad < 0, "fence 1 MiB get from %d: byte %lld wrong", right, bad);
    free(src);
    MPI_OK(MPI_Win_fence(0, w.win));
    free_window(&w, use_allocate);
}

static void pscw(void)
{
    struct win w = make_window(0);
    for (int i = 0; i < nranks; i++)
        w.slots[i] = -1;
    MPI_Group world, others;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int self = rank;
    MPI_Group_excl(world, 1, &self, &others);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    for (int round = 0; round < 3; round++) {
        MPI_OK(MPI_Win_post(others, 0, w.win));
        MPI_OK(MPI_Win_start(others, 0, w.win));
        int v = rank * 10 + round;
        for (int t = 0; t < nranks; t++)
            if (t != rank)
                MPI_OK(MPI_Put(&v, 1, MPI_INT, t, slot_disp(rank), 1, MPI_INT,
                               w.win));
        MPI_OK(MPI_Win_complete(w.win));
        MPI_OK(MPI_Win_wait(w.win));
        for (int s = 0; s < nranks; s++)
            if (s != rank)
                CHECK(w.slots[s] == s * 10 + round, "pscw round %d: slot %d "
                      "= %d", round, s, w.slots[s]);
    }
    MPI_Group_free(&others);
    MPI_Group_free(&world);
    free_window(&w, 0);
}

static void passive_exclusive(void)
{
    struct win w = make_window(1);
    lock_self(&w);
    memset(w.ctr, 0, NCTR * sizeof(int));
    unlock_self(&w);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));

    int *tickets = mt_alloc(ROUNDS * sizeof *tickets);
    for (int i = 0; i < ROUNDS; i++) {
        /* read-modify-write by get + put: correct only under mutual
           exclusion, so a lost update means the lock did not exclude */
        int v = -1;
        MPI_OK(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 0, 0, w.win));
        MPI_OK(MPI_Get(&v, 1, MPI_INT, 0, ctr_disp(CTR_MUTEX), 1, MPI_INT,
                       w.win));
        MPI_OK(MPI_Win_flush(0, w.win));
        v++;
        MPI_OK(MPI_Put(&v, 1, MPI_INT, 0, ctr_disp(CTR_MUTEX), 1, MPI_INT,
                       w.win));
        MPI_OK(MPI_Win_unlock(0, w.win));

        int one = 1;
        MPI_OK(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 0, 0, w.win));
        MPI_OK(MPI_Fetch_and_op(&one, &tickets[i], MPI_INT, 0,
                                ctr_disp(CTR_FOP), MPI_SUM, w.win));
        MPI_OK(MPI_Win_unlock(0, w.win));
    }
    int *all = rank == 0 ? mt_alloc((size_t)nranks * ROUNDS * sizeof *all)
                         : NULL;
    MPI_OK(MPI_Gather(tickets, ROUNDS, MPI_INT, all, ROUNDS, MPI_INT, 0,
                      MPI_COMM_WORLD));
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0) {
        lock_self(&w);
        int mutex = w.ctr[CTR_MUTEX], fop = w.ctr[CTR_FOP];
        unlock_self(&w);
        CHECK(mutex == nranks * ROUNDS, "exclusive lock lost updates: %d of "
              "%d", mutex, nranks * ROUNDS);
        CHECK(fop == nranks * ROUNDS, "fetch_and_op total %d", fop);
        /* every ticket handed out exactly once */
        char *seen = calloc((size_t)nranks * ROUNDS, 1);
        CHECK(seen != NULL, "calloc");
        for (int i = 0; i < nranks * ROUNDS; i++) {
            CHECK(all[i] >= 0 && all[i] < nranks * ROUNDS && !seen[all[i]],
                  "ticket %d duplicated or out of range", all[i]);
            seen[all[i]] = 1;
        }
        free(seen);
        free(all);
    }
    free(tickets);
    free_window(&w, 1);
}

static void passive_shared(void)
{
    struct win w = make_window(1);
    lock_self(&w);
    for (int i = 0; i < nranks; i++)
        w.slots[i] = -1;
    memset(w.ctr, 0, NCTR * sizeof(int));
    unlock_self(&w);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    int right = (rank + 1) % nranks;

    /* shared lock on a neighbour: put, flush, get back, flush */
    MPI_OK(MPI_Win_lock(MPI_LOCK_SHARED, right, 0, w.win));
    int v = 7000 + rank, back = -1;
    MPI_OK(MPI_Put(&v, 1, MPI_INT, right, slot_disp(rank), 1, MPI_INT, w.win));
    MPI_OK(MPI_Win_flush(right, w.win));
    MPI_OK(MPI_Get(&back, 1, MPI_INT, right, slot_disp(rank), 1, MPI_INT,
                   w.win));
    MPI_OK(MPI_Win_flush(right, w.win));
    CHECK(back == v, "shared lock put/flush/get: %d", back);
    MPI_OK(MPI_Win_unlock(right, w.win));

    /* concurrent accumulates and compare_and_swap under shared locks */
    MPI_OK(MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, w.win));
    for (int i = 0; i < ROUNDS; i++) {
        int inc = rank + 1;
        MPI_OK(MPI_Accumulate(&inc, 1, MPI_INT, 0, ctr_disp(CTR_ACC), 1,
                              MPI_INT, MPI_SUM, w.win));
    }
    MPI_OK(MPI_Win_flush(0, w.win));
    int expect = 0, swapped = -1, desired = rank + 1;
    MPI_OK(MPI_Compare_and_swap(&desired, &expect, &swapped, MPI_INT, 0,
                                ctr_disp(CTR_CAS), w.win));
    MPI_OK(MPI_Win_unlock(0, w.win));
    int winners = 0, won = swapped == 0;
    MPI_OK(MPI_Allreduce(&won, &winners, 1, MPI_INT, MPI_SUM,
                         MPI_COMM_WORLD));
    CHECK(winners == 1, "compare_and_swap: %d winners", winners);

    /* one lock_all epoch reads the accumulate counter of every rank */
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    int *acc = mt_alloc((size_t)nranks * sizeof *acc);
    MPI_OK(MPI_Win_lock_all(0, w.win));
    for (int t = 0; t < nranks; t++)
        MPI_OK(MPI_Get(&acc[t], 1, MPI_INT, t, ctr_disp(CTR_ACC), 1, MPI_INT,
                       w.win));
    MPI_OK(MPI_Win_flush_all(w.win));
    int sum = 0;
    for (int r = 0; r < nranks; r++)
        sum += r + 1;
    for (int t = 0; t < nranks; t++)
        CHECK(acc[t] == (t == 0 ? sum * ROUNDS : 0),
              "lock_all get of counter at %d: %d", t, acc[t]);
    MPI_OK(MPI_Win_unlock_all(w.win));
    free(acc);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    lock_self(&w);
    int left = (rank + nranks - 1) % nranks;
    CHECK(w.slots[left] == 7000 + left, "shared-lock put from %d: %d", left,
          w.slots[left]);
    unlock_self(&w);
    free_window(&w, 1);
}

/* 4 MiB put into the right neighbour's allocated window under an
   exclusive lock, read back with get under a shared lock. */
static void passive_large(void)
{
    void *base;
    MPI_Win win;
    MPI_OK(MPI_Win_allocate(HUGE, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base,
                            &win));
    MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
    int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    char *buf = mt_alloc(HUGE);
    mt_fill(buf, HUGE, 900 + (uint64_t)rank);
    MPI_OK(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, right, 0, win));
    MPI_OK(MPI_Put(buf, HUGE, MPI_BYTE, right, 0, HUGE, MPI_BYTE, win));
    MPI_OK(MPI_Win_unlock(right, win));
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));

    MPI_OK(MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, win));
    long long bad = mt_verify(base, HUGE, 900 + (uint64_t)left);
    MPI_OK(MPI_Win_unlock(rank, win));
    CHECK(bad < 0, "4 MiB passive put from %d: byte %lld wrong", left, bad);

    memset(buf, 0, HUGE);
    MPI_OK(MPI_Win_lock(MPI_LOCK_SHARED, right, 0, win));
    MPI_OK(MPI_Get(buf, HUGE, MPI_BYTE, right, 0, HUGE, MPI_BYTE, win));
    MPI_OK(MPI_Win_flush_local(right, win));
    MPI_OK(MPI_Win_unlock(right, win));
    bad = mt_verify(buf, HUGE, 900 + (uint64_t)rank);
    CHECK(bad < 0, "4 MiB passive get from %d: byte %lld wrong", right, bad);
    free(buf);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    MPI_OK(MPI_Win_free(&win));
}

int main(int argc, char **argv)
{
    mt_init(&argc, &argv, &rank, &nranks);
    CHECK(nranks >= 2, "needs at least 2 ranks, got %d", nranks);
    double t0 = MPI_Wtime();
    fence_epochs(0);
    fence_epochs(1);
    if (rank == 0)
        printf("rma: fence put/get/accumulate ok\n");
    pscw();
    if (rank == 0)
        printf("rma: post/start/complete/wait ok\n");
    passive_exclusive();
    if (rank == 0)
        printf("rma: exclusive lock, fetch_and_op ok\n");
    passive_shared();
    if (rank == 0)
        printf("rma: shared lock, accumulate, compare_and_swap, lock_all "
               "ok\n");
    passive_large();
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0)
        printf("PASS rma (%d ranks, %.2f s)\n", nranks, MPI_Wtime() - t0);
    MPI_Finalize();
    return 0;
}

/*
 * The provider against libfabric's shm provider, both ranks on this host
 * in one region: 8 B latency (tagged ping-pong, half the round trip),
 * 8 B message rate (windows of 64 injected sends) and 1 MiB bandwidth
 * (windows of 8), in alternating rounds. Prints one line per round and
 * provider, then medians and the ratios of the medians. Usage:
 *   FI_PROVIDER_PATH=<dir of libivshm-fi.so> fiv_bench [rounds]
 * Not a test: figures on a shared machine only compare within one run.
 */
#include "fiv_test.h"

static int result_fd = -1;

static void wait_one(struct rank *r)
{
    struct fi_cq_tagged_entry e;
    REQ_RC(t_wait(r, &e, NULL, NULL, 30000), 0);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void bench(struct rank *r)
{
    t_open(r, FI_VERSION(1, 17));
    t_exchange(r);
    int peer = 1 - r->me;
    fi_addr_t to = r->addr[peer];
    uint64_t v = 1, got = 0;
    /* latency */
    const int warm = 2000, iters = 20000;
    double t0 = 0;
    for (int i = 0; i < warm + iters; i++) {
        if (i == warm)
            t0 = now_s();
        if (r->me == 0) {
            REQ_RC(fi_trecv(r->ep, &got, 8, NULL, to, 1, 0, &got), 0);
            while (fi_tinject(r->ep, &v, 8, to, 1) == -FI_EAGAIN)
                (void)fi_cq_read(r->cq, NULL, 0);
            wait_one(r);
        } else {
            REQ_RC(fi_trecv(r->ep, &got, 8, NULL, to, 1, 0, &got), 0);
            wait_one(r);
            while (fi_tinject(r->ep, &v, 8, to, 1) == -FI_EAGAIN)
                (void)fi_cq_read(r->cq, NULL, 0);
        }
    }
    double lat_us = (now_s() - t0) / iters / 2 * 1e6;
    /* message rate: windows of 64 */
    enum { W = 64 };
    static uint64_t rbuf[W];
    const int windows = 500;
    t_barrier_plain(r);
    t0 = now_s();
    for (int w = 0; w < windows; w++) {
        if (r->me == 0) {
            for (int k = 0; k < W; k++)
                while (fi_tinject(r->ep, &v, 8, to, 2) == -FI_EAGAIN)
                    (void)fi_cq_read(r->cq, NULL, 0);
            REQ_RC(fi_trecv(r->ep, &got, 8, NULL, to, 3, 0, &got), 0);
            wait_one(r);
        } else {
            for (int k = 0; k < W; k++)
                REQ_RC(fi_trecv(r->ep, &rbuf[k], 8, NULL, to, 2, 0, &rbuf[k]), 0);
            for (int k = 0; k < W; k++)
                wait_one(r);
            while (fi_tinject(r->ep, &v, 8, to, 3) == -FI_EAGAIN)
                (void)fi_cq_read(r->cq, NULL, 0);
        }
    }
    double rate = (double)windows * W / (now_s() - t0) / 1e6;
    /* bandwidth: windows of 8 x 1 MiB */
    enum { BW = 8 };
    const size_t big = 1 << 20;
    uint8_t *buf = malloc(big * BW);
    REQ(buf);
    memset(buf, 7, big * BW);
    const int bwin = 30;
    t_barrier_plain(r);
    t0 = now_s();
    for (int w = 0; w < bwin; w++) {
        if (r->me == 0) {
            for (int k = 0; k < BW; k++)
                REQ_RC(fi_tsend(r->ep, buf + k * big, big, NULL, to, 4, buf), 0);
            REQ_RC(fi_trecv(r->ep, &got, 8, NULL, to, 5, 0, &got), 0);
            for (int k = 0; k < BW + 1; k++)
                wait_one(r);
        } else {
            for (int k = 0; k < BW; k++)
                REQ_RC(fi_trecv(r->ep, buf + k * big, big, NULL, to, 4, 0, buf), 0);
            for (int k = 0; k < BW; k++)
                wait_one(r);
            while (fi_tinject(r->ep, &v, 8, to, 5) == -FI_EAGAIN)
                (void)fi_cq_read(r->cq, NULL, 0);
        }
    }
    double bw = (double)bwin * BW * big / (now_s() - t0) / 1e9;
    free(buf);
    if (r->me == 0) {
        double res[3] = {lat_us, rate, bw};
        REQ(write(result_fd, res, sizeof res) == sizeof res);
    }
    t_barrier_plain(r);
    t_close(r);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 5;
    if (rounds < 1 || rounds > 50 || !getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "usage: FI_PROVIDER_PATH=DIR fiv_bench [rounds 1..50]\n");
        return 2;
    }
    const char *region = t_region(8, 16384 + 64);
    char env_ivshm[256];
    snprintf(env_ivshm, sizeof env_ivshm,
             "FIV_TEST_PROVIDER=ivshm;FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none",
             region);
    const char *provs[2] = {"ivshm", "shm"};
    const char *envs[2][2] = {{env_ivshm, env_ivshm},
                              {"FIV_TEST_PROVIDER=shm", "FIV_TEST_PROVIDER=shm"}};
    double res[2][3][50];
    printf("%-6s %5s %12s %14s %12s\n", "prov", "round", "8B lat us",
           "8B rate Mmsg/s", "1MiB GB/s");
    for (int k = 0; k < rounds; k++)
        for (int p = 0; p < 2; p++) {
            int fds[2];
            REQ(pipe(fds) == 0);
            result_fd = fds[1];
            int failed = t_run(2, bench, envs[p], 300, NULL);
            close(fds[1]);
            double x[3];
            if (failed || read(fds[0], x, sizeof x) != sizeof x) {
                fprintf(stderr, "%s round %d failed\n", provs[p], k);
                return 1;
            }
            close(fds[0]);
            for (int m = 0; m < 3; m++)
                res[p][m][k] = x[m];
            printf("%-6s %5d %12.3f %14.3f %12.2f\n", provs[p], k, x[0], x[1],
                   x[2]);
            fflush(stdout);
        }
    double med[2][3], lo[2][3], hi[2][3];
    for (int p = 0; p < 2; p++)
        for (int m = 0; m < 3; m++) {
            qsort(res[p][m], (size_t)rounds, sizeof(double), cmp);
            med[p][m] = res[p][m][rounds / 2];
            lo[p][m] = res[p][m][0];
            hi[p][m] = res[p][m][rounds - 1];
        }
    const char *names[3] = {"8B latency us", "8B rate Mmsg/s", "1MiB bw GB/s"};
    printf("\n%-16s %22s %22s %8s\n", "median [min-max]", "ivshm", "shm",
           "ivshm/shm");
    for (int m = 0; m < 3; m++)
        printf("%-16s %8.3f [%5.3f-%5.3f] %8.3f [%5.3f-%5.3f] %8.2f\n",
               names[m], med[0][m], lo[0][m], hi[0][m], med[1][m], lo[1][m],
               hi[1][m], med[0][m] / med[1][m]);
    return 0;
}

/* Region layout and registry: formatting, attach errors, locality
   detection, slot reclaim after a peer dies. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define SIZE (32u << 20)

/* Rewrite one header field of the file, then expect attach to fail. */
static void poke_and_expect(const char *path, size_t off, uint64_t val,
                            size_t width, int want)
{
    int fd = open(path, O_RDWR);
    uint8_t *p = mmap(NULL, IVSHM_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    uint8_t saved[8];
    memcpy(saved, p + off, width);
    memcpy(p + off, &val, width);
    ivshm_config cfg = {.job_id = 1};
    ivshm *h = NULL;
    CHECK_RC(ivshm_attach_path(path, &cfg, &h), want);
    CHECK(h == NULL);
    memcpy(p + off, saved, width);
    munmap(p, IVSHM_PAGE);
    close(fd);
}

static void test_header_errors(void)
{
    const char *path = tu_region(SIZE, NULL);
    poke_and_expect(path, offsetof(struct ivshm_header, magic), 0x1234, 8,
                    IVSHM_EMAGIC);
    poke_and_expect(path, offsetof(struct ivshm_header, version), 99, 4,
                    IVSHM_EVERSION);
    poke_and_expect(path, offsetof(struct ivshm_header, region_size),
                    (uint64_t)SIZE * 4, 8, IVSHM_ESIZE);
    poke_and_expect(path, offsetof(struct ivshm_header, max_peers), 1000, 4,
                    IVSHM_ESIZE);
    poke_and_expect(path, offsetof(struct ivshm_header, rx_off), 12, 8,
                    IVSHM_ESIZE);
    poke_and_expect(path, offsetof(struct ivshm_header, rx_bytes), 4096, 8,
                    IVSHM_ESIZE);
    poke_and_expect(path, offsetof(struct ivshm_header, queue_slots), 48, 4,
                    IVSHM_ESIZE);
    poke_and_expect(path, offsetof(struct ivshm_header, fast_channels), 0, 4,
                    IVSHM_ESIZE);
    poke_and_expect(path, offsetof(struct ivshm_header, heap_size), 1, 8,
                    IVSHM_ESIZE);
    /* unchanged again: attach works */
    ivshm *h = tu_attach(path, 1, 0, 0);
    CHECK(ivshm_self(h) == 0);
    ivshm_detach(h);

    /* a blank file: a clear error, or formatted on request */
    char blank[128];
    snprintf(blank, sizeof blank, "%s-blank", path);
    unlink(blank);
    int fd = open(blank, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0600);
    CHECK(ftruncate(fd, SIZE) == 0);
    close(fd);
    ivshm_config cfg = {.job_id = 1};
    CHECK_RC(ivshm_attach_path(blank, &cfg, &h), IVSHM_EMAGIC);
    cfg.flags = IVSHM_F_FORMAT;
    CHECK_RC(ivshm_attach_path(blank, &cfg, &h), 0);
    CHECK(ivshm_max_peers(h) == 8);
    ivshm_geometry got;
    ivshm_get_geometry(h, &got);
    CHECK(got.max_peers == 8 && got.ring_slots == 64 && got.slot_size == 4096 &&
          got.max_windows == 32);
    ivshm_detach(h);
    unlink(blank);

    /* too small / bad geometry */
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 48};
    CHECK_RC(ivshm_format_file(blank, SIZE, &g, 0600), -EINVAL);
    g.ring_slots = 16;
    CHECK_RC(ivshm_format_file(blank, 4096, &g, 0600), IVSHM_ESIZE);
    CHECK(access(blank, F_OK) != 0); /* nothing left behind */
    CHECK(ivshm_min_region_size(&g) > 0);
    CHECK_RC(ivshm_attach_path("/nonexistent/region", &cfg, &h), -ENOENT);
}

static void test_registry(void)
{
    ivshm_geometry g = {.max_peers = 4};
    const char *path = tu_region(SIZE, &g);
    ivshm *a = tu_attach(path, 7, 0, 0);
    ivshm_config cfg = {.job_id = 7, .rank = 1, .name = "worker-1"};
    ivshm *b = NULL;
    CHECK_RC(ivshm_attach_path(path, &cfg, &b), 0);
    /* locality: each sees the other */
    CHECK(ivshm_find(a, 7, 1) == ivshm_self(b));
    CHECK(ivshm_find(b, 7, 0) == ivshm_self(a));
    CHECK_RC(ivshm_find(a, 8, 0), -ENOENT);
    ivshm_peer_info info;
    CHECK_RC(ivshm_peer(a, ivshm_self(b), &info), 0);
    CHECK(strcmp(info.name, "worker-1") == 0 && info.pid == getpid());
    CHECK(info.rank == 1 && info.job_id == 7 && info.doorbell_id == -1);
    CHECK_RC(ivshm_peer(a, 3, &info), -ENOENT);
    CHECK_RC(ivshm_peer(a, 4, &info), -EINVAL);
    /* the same (job, rank) twice is refused */
    ivshm *dup = NULL;
    CHECK_RC(ivshm_attach_path(path, &cfg, &dup), -EEXIST);
    cfg.name = "a name much longer than thirty-one characters";
    cfg.rank = 9;
    CHECK_RC(ivshm_attach_path(path, &cfg, &dup), -ENAMETOOLONG);

    /* fill the registry */
    ivshm *c = tu_attach(path, 7, 2, 0), *d = tu_attach(path, 7, 3, 0);
    ivshm *e = NULL;
    cfg.name = NULL;
    cfg.rank = 4;
    CHECK_RC(ivshm_attach_path(path, &cfg, &e), IVSHM_EFULL);
    /* a clean leave frees the slot, and the next peer gets a new gen */
    int slot_b = ivshm_self(b);
    uint32_t gen_b = info.generation;
    ivshm_detach(b);
    CHECK_RC(ivshm_find(a, 7, 1), -ENOENT);
    CHECK_RC(ivshm_attach_path(path, &cfg, &e), 0);
    CHECK(ivshm_self(e) == slot_b);
    CHECK_RC(ivshm_peer(a, slot_b, &info), 0);
    CHECK(info.generation == gen_b + 1 && info.rank == 4);
    ivshm_detach(c);
    ivshm_detach(d);
    ivshm_detach(e);
    ivshm_detach(a);
}

static const char *g_path;

static int child_attach_and_wait(void *arg)
{
    (void)arg;
    tu_attach(g_path, 5, 1, 0);
    pause(); /* killed by the parent */
    return 0;
}

static void test_dead_peer_reclaimed(void)
{
    ivshm_geometry g = {.max_peers = 2};
    g_path = tu_region(SIZE, &g);
    ivshm *a = tu_attach(g_path, 5, 0, 0);
    pid_t pid = tu_fork(child_attach_and_wait, NULL);
    int slot = -1;
    for (int i = 0; i < 2000 && slot < 0; i++) {
        slot = ivshm_find(a, 5, 1);
        usleep(1000);
    }
    CHECK(slot >= 0);
    /* the registry is full now */
    ivshm_config cfg = {.job_id = 6};
    ivshm *b = NULL;
    kill(pid, SIGKILL);
    /* not reaped by waitpid yet: a zombie must count as dead */
    usleep(50000);
    CHECK_RC(ivshm_reap(a), 1);
    CHECK_RC(ivshm_find(a, 5, 1), -ENOENT);
    CHECK_RC(ivshm_attach_path(g_path, &cfg, &b), 0);
    CHECK(b && ivshm_self(b) == slot);
    waitpid(pid, NULL, 0);
    ivshm_detach(b);
    ivshm_detach(a);
}

int main(void)
{
    test_header_errors();
    test_registry();
    test_dead_peer_reclaimed();
    return tu_summary("test_region");
}

/* A co-tenant against the region's header and file: a header field
   flipped while the victim attaches (a double fetch would take a
   geometry outside the mapping), and names planted where
   ivshm_format_file will create its file. */
#include "hostile.h"

/* ---- heap_size flipped while the victim attaches ---- */

struct flipper {
    uint64_t *heap_size;
    uint64_t good, bad;
    atomic_bool stop;
    uint64_t flips;
};

static void *flip_heap_size(void *arg)
{
    struct flipper *f = arg;
    while (!atomic_load(&f->stop)) {
        __atomic_store_n(f->heap_size, f->good, __ATOMIC_RELAXED);
        __atomic_store_n(f->heap_size, f->bad, __ATOMIC_RELAXED);
        f->flips++;
    }
    __atomic_store_n(f->heap_size, f->good, __ATOMIC_RELAXED);
    return NULL;
}

static void test_attach_race(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 4, .slot_size = 256,
                        .max_windows = 2};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    /* The flipper's own mapping of the header. */
    int fd = open(path, O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0);
    struct ivshm_header *hdr =
        mmap(NULL, IVSHM_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(hdr != MAP_FAILED);
    close(fd);
    uint64_t heap_off = hdr->heap_off;

    /* A READY window whose extent is valid only for a heap of ~2^64
       bytes: joined with a forged heap_size, a put would land 1 TiB past
       the mapping. Member (the bitmap at the start of its extent): slot
       3, so it is neither empty nor ours. */
    ivshm *owner = tu_attach(path, job, 0, 0);
    struct ivshm_win_desc *d =
        (struct ivshm_win_desc *)(owner->base + owner->windir_off);
    const uint64_t tib = 1ull << 40;
    d->nseg = 2;
    d->job_id = job;
    memset(d->name, 0, sizeof d->name);
    strcpy(d->name, "forged");
    d->data_off = heap_off;
    d->data_bytes = 2 * tib;
    d->seg_size = tib;
    d->gen = 1;
    atomic_store((_Atomic uint64_t *)(owner->base + heap_off), 1ull << 3);
    atomic_store(&d->state, WIN_READY);

    struct flipper f = {.heap_size = &hdr->heap_size,
                        .good = hdr->heap_size,
                        .bad = 0 - heap_off};
    atomic_init(&f.stop, false);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, flip_heap_size, &f) == 0);

    unsigned attached = 0, refused = 0, escaped = 0, put_ok = 0;
    uint64_t end = tu_now_ms() + 2000;
    ivshm_config cfg = {.job_id = job, .rank = 1};
    while (tu_now_ms() < end) {
        ivshm *v = NULL;
        int rc = ivshm_attach_path(path, &cfg, &v);
        if (rc == IVSHM_ESIZE) {
            refused++;
            continue;
        }
        CHECK_RC(rc, 0);
        if (rc < 0)
            break;
        attached++;
        /* the victim's view of the heap must lie inside its mapping */
        if (v->heap_off + v->heap_size > v->size || v->heap_size > v->size)
            escaped++;
        ivshm_window *w = NULL;
        rc = ivshm_win_open(v, "forged", 2, tib, &w);
        if (rc == 0) {
            /* must never get here; if it does, do not write */
            put_ok++;
            ivshm_win_close(w);
        }
        ivshm_detach(v);
    }
    atomic_store(&f.stop, true);
    pthread_join(th, NULL);
    printf("attach race: %u attached, %u refused, %llu flips\n", attached,
           refused, (unsigned long long)f.flips);
    CHECK(attached > 10);
    CHECK(escaped == 0);
    CHECK(put_ok == 0);
    /* after the flipping, a clean attach still works */
    ivshm *v = NULL;
    CHECK_RC(ivshm_attach_path(path, &cfg, &v), 0);
    if (v) {
        CHECK(v->heap_size == f.good);
        ivshm_window *w = NULL;
        CHECK(ivshm_win_open(v, "forged", 2, tib, &w) < 0);
        ivshm_detach(v);
    }
    ivshm_detach(owner);
    munmap(hdr, IVSHM_PAGE);
}

/* ---- ivshm_format_file: no following, no replacing, no half files ---- */

static bool file_is(const char *p, const char *content)
{
    char got[64] = {0};
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, got, sizeof got - 1);
    close(fd);
    return n == (ssize_t)strlen(content) && strcmp(got, content) == 0;
}

static void write_file(const char *p, const char *content)
{
    unlink(p);
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0600);
    CHECK(fd >= 0 && write(fd, content, strlen(content)) ==
                         (ssize_t)strlen(content));
    close(fd);
}

struct watcher {
    const char *path;
    atomic_bool stop;
    unsigned seen, half;
};

/* Whenever the name exists, the file behind it must be formatted. */
static void *watch_name(void *arg)
{
    struct watcher *w = arg;
    while (!atomic_load(&w->stop)) {
        int fd = open(w->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct ivshm_header hdr;
        ssize_t n = pread(fd, &hdr, sizeof hdr, 0);
        close(fd);
        w->seen++;
        if (n != (ssize_t)sizeof hdr || hdr.magic != IVSHM_MAGIC ||
            hdr.state != REGION_READY)
            w->half++;
    }
    return NULL;
}

static void test_format_file(void)
{
    char p[96], target[128];
    snprintf(p, sizeof p, "/dev/shm/ivshm-hostile-%d", (int)getpid());
    snprintf(target, sizeof target, "%s-target", p);
    ivshm_geometry g = {.max_peers = 4};
    uint64_t size = ivshm_min_region_size(&g);
    struct stat st;

    /* a symlink to a victim's file: refused, neither followed nor removed */
    write_file(target, "precious");
    CHECK(symlink(target, p) == 0);
    int rc = ivshm_format_file(p, size, &g, 0600);
    CHECK(rc == -EEXIST || rc == -ELOOP);
    CHECK(file_is(target, "precious"));
    CHECK(lstat(p, &st) == 0 && S_ISLNK(st.st_mode));
    unlink(p);
    /* a dangling symlink: its target is not created */
    unlink(target);
    CHECK(symlink(target, p) == 0);
    rc = ivshm_format_file(p, size, &g, 0600);
    CHECK(rc == -EEXIST || rc == -ELOOP);
    CHECK(access(target, F_OK) != 0);
    CHECK(lstat(p, &st) == 0 && S_ISLNK(st.st_mode));
    unlink(p);

    /* an existing file with content: not truncated, not removed, even
       when the request fails for another reason */
    write_file(p, "someone's data");
    CHECK_RC(ivshm_format_file(p, size, &g, 0600), -EEXIST);
    CHECK(file_is(p, "someone's data"));
    CHECK_RC(ivshm_format_file(p, 4096, &g, 0600), IVSHM_ESIZE);
    CHECK(file_is(p, "someone's data"));
    unlink(p);

    /* an empty file of ours (a name reserved with O_EXCL) is adopted */
    int fd = open(p, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    CHECK(fd >= 0);
    close(fd);
    CHECK_RC(ivshm_format_file(p, size, &g, 0600), 0);
    CHECK(stat(p, &st) == 0 && (uint64_t)st.st_size == size &&
          (st.st_mode & 0777) == 0600);
    job++;
    ivshm *h = tu_attach(p, job, 0, 0);
    ivshm_detach(h);
    unlink(p);
    /* ... but not an empty file of another user */
    if (geteuid() == 0) {
        fd = open(p, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        CHECK(fd >= 0 && fchown(fd, 65534, 65534) == 0);
        close(fd);
        CHECK_RC(ivshm_format_file(p, size, &g, 0600), -EEXIST);
        CHECK(stat(p, &st) == 0 && st.st_size == 0 && st.st_uid == 65534);
        unlink(p);
    }

    /* a fresh name: exactly `mode`, and never visible half formatted */
    struct watcher w = {.path = p};
    atomic_init(&w.stop, false);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, watch_name, &w) == 0);
    ivshm_geometry big = {.max_peers = 8, .ring_slots = 64, .slot_size = 4096};
    for (int i = 0; i < 5; i++) {
        mode_t old = umask(0077);
        CHECK_RC(ivshm_format_file(p, 64ull << 20, &big, 0640), 0);
        umask(old);
        CHECK(stat(p, &st) == 0 && (st.st_mode & 0777) == 0640);
        tu_sleep_ms(5);
        unlink(p);
    }
    atomic_store(&w.stop, true);
    pthread_join(th, NULL);
    printf("format watcher: %u looks, %u half-formatted\n", w.seen, w.half);
    CHECK(w.half == 0);
    /* a refused request leaves nothing */
    CHECK_RC(ivshm_format_file(p, 4096, &g, 0600), IVSHM_ESIZE);
    CHECK(access(p, F_OK) != 0);
}

int main(void)
{
    hostile_setup();
    test_attach_race();
    test_format_file();
    return tu_summary("test_hostile_region");
}

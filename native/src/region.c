/*
 * Region layout: formatting, validating and mapping (docs/region-layout.md).
 *
 * The layout is a pure function of (size, geometry): the header stores
 * the geometry and the offsets, and an attacher recomputes the offsets
 * and requires an exact match. After that check nothing in the header is
 * read again, so a co-tenant rewriting the header later cannot move our
 * view of the rings, registry or heap.
 */
#define _GNU_SOURCE
#include "region.h"

#include "clock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MIN_HEAP (1u << 20)

struct layout {
    uint32_t max_peers, ring_slots, slot_size, max_windows;
    uint32_t queue_slots, fast_channels; /* fast_channels: the real count */
    uint64_t registry_off, rx_off, rx_bytes, ring_bytes, windir_off, wctl_off;
    uint64_t heap_off;
    uint64_t heap_size; /* validate_header only: region_size - heap_off */
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) & ~(a - 1);
}

static bool pow2(uint32_t v)
{
    return v && !(v & (v - 1));
}

static int geometry_defaults(const ivshm_geometry *g, struct layout *l)
{
    l->max_peers = g && g->max_peers ? g->max_peers : 8;
    l->ring_slots = g && g->ring_slots ? g->ring_slots : 64;
    l->slot_size = g && g->slot_size ? g->slot_size : 4096;
    l->max_windows = g && g->max_windows ? g->max_windows : 32;
    l->queue_slots = g && g->queue_slots ? g->queue_slots : 64;
    uint32_t f = g && g->fast_channels ? g->fast_channels : 8;
    l->fast_channels = f == IVSHM_FAST_NONE ? 0 : f;
    if (l->max_peers < 2 || l->max_peers > IVSHM_MAX_PEERS)
        return -EINVAL;
    if (l->ring_slots < 2 || l->ring_slots > 65536 || !pow2(l->ring_slots))
        return -EINVAL;
    if (l->queue_slots < 2 || l->queue_slots > 65536 || !pow2(l->queue_slots))
        return -EINVAL;
    if (f != IVSHM_FAST_NONE && f > IVSHM_MAX_FAST)
        return -EINVAL;
    if (l->slot_size < 128 || l->slot_size > (1u << 20) ||
        l->slot_size % IVSHM_CACHELINE)
        return -EINVAL;
    if (l->max_windows < 1 || l->max_windows > 1024)
        return -EINVAL;
    /* more channels than other peers would never be used: a small job
       pays what it did with one ring per pair */
    if (l->fast_channels > l->max_peers - 1)
        l->fast_channels = l->max_peers - 1;
    return 0;
}

/* Offsets for a validated geometry; all products fit in 64 bits because
   every factor is bounded above (1024 peers, 64 channels, 65536 slots,
   1 MiB slots: a receive area is below 2^43 bytes). Every term is linear
   in max_peers: one receive area, one registry entry and max_windows
   lock lines per peer. */
static void compute_layout(struct layout *l)
{
    uint64_t p = l->max_peers;
    l->registry_off = IVSHM_HEADER_BYTES;
    l->rx_off = align_up(l->registry_off +
                             p * sizeof(struct ivshm_peer_entry), IVSHM_PAGE);
    l->ring_bytes = IVSHM_RING_CTRL + (uint64_t)l->ring_slots * l->slot_size;
    l->rx_bytes = IVSHM_QUEUE_CTRL +
                  (uint64_t)l->queue_slots * l->slot_size +
                  (uint64_t)l->fast_channels *
                      (IVSHM_FAST_DESC + l->ring_bytes);
    l->windir_off = align_up(l->rx_off + p * l->rx_bytes, IVSHM_PAGE);
    l->wctl_off = l->windir_off +
                  (uint64_t)l->max_windows * sizeof(struct ivshm_win_desc);
    l->heap_off = align_up(l->wctl_off + (uint64_t)l->max_windows * p *
                                             sizeof(struct ivshm_win_lock),
                           IVSHM_PAGE);
}

uint64_t ivshm_min_region_size(const ivshm_geometry *g)
{
    struct layout l;
    if (geometry_defaults(g, &l) < 0)
        return 0;
    compute_layout(&l);
    return l.heap_off + MIN_HEAP;
}

/* `zeroed`: the memory is known to be all zero (a file just truncated
   to size), so the receive areas need not be written: a large MPI region
   would otherwise be touched page by page for nothing. (Each peer empties
   its own receive area when it claims its slot.) */
static int format_region(void *base, uint64_t size, const ivshm_geometry *g,
                         bool zeroed)
{
    struct layout l;
    int rc = geometry_defaults(g, &l);
    if (rc < 0)
        return rc;
    compute_layout(&l);
    if (!base || size < l.heap_off + MIN_HEAP)
        return IVSHM_ESIZE;

    struct ivshm_header *hdr = base;
    /* Everything but hdr->state is rewritten: a concurrent attacher that
       sees FORMATTING keeps waiting for READY, published last. */
    if (!zeroed)
        memset((uint8_t *)base + sizeof *hdr, 0, l.heap_off - sizeof *hdr);
    hdr->magic = IVSHM_MAGIC;
    hdr->version = IVSHM_LAYOUT_VERSION;
    hdr->header_bytes = IVSHM_HEADER_BYTES;
    hdr->region_size = size;
    hdr->max_peers = l.max_peers;
    hdr->ring_slots = l.ring_slots;
    hdr->slot_size = l.slot_size;
    hdr->max_windows = l.max_windows;
    hdr->queue_slots = l.queue_slots;
    hdr->fast_channels = l.fast_channels;
    hdr->reserved0 = 0;
    hdr->registry_off = l.registry_off;
    hdr->rx_off = l.rx_off;
    hdr->rx_bytes = l.rx_bytes;
    hdr->ring_bytes = l.ring_bytes;
    hdr->windir_off = l.windir_off;
    hdr->wctl_off = l.wctl_off;
    hdr->heap_off = l.heap_off;
    hdr->heap_size = size - l.heap_off;
    atomic_store_explicit(&hdr->alloc_lock, 0, memory_order_relaxed);
    atomic_store_explicit(&hdr->state, REGION_READY, memory_order_release);
    return 0;
}

int ivshm_format(void *base, uint64_t size, const ivshm_geometry *g)
{
    return format_region(base, size, g, false);
}

int ivshm_format_fresh(void *base, uint64_t size, const ivshm_geometry *g)
{
    return format_region(base, size, g, true);
}

/* Size `fd` (empty, ours) and format it through a temporary mapping. */
static int format_fd(int fd, uint64_t size, const ivshm_geometry *g,
                     unsigned mode)
{
    if (fchmod(fd, mode & 0777) < 0 || ftruncate(fd, (off_t)size) < 0)
        return -errno;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -errno;
    int rc = format_region(p, size, g, true); /* grown from empty: zero */
    munmap(p, size);
    return rc;
}

/* An existing file at the path may be adopted only if formatting it
   destroys nothing and gives nobody else access: a regular, empty file
   with one link, owned by us (callers that reserve the name with
   O_CREAT|O_EXCL first, then format it). */
static bool adoptable(int fd)
{
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 0 &&
           st.st_nlink == 1 && st.st_uid == geteuid();
}

/*
 * The file appears at `path` only once it is fully formatted, and never
 * replaces anything: it is built as an unnamed O_TMPFILE in the target
 * directory and linked in (link() never follows a symlink and fails if
 * the name exists). Without O_TMPFILE, O_CREAT|O_EXCL|O_NOFOLLOW creates
 * it in place. A failure removes only a file we created, checked by
 * inode. An existing empty file of ours is adopted (see adoptable);
 * anything else at the path, a symlink included, is -EEXIST / -ELOOP.
 */
int ivshm_format_file(const char *path, uint64_t size, const ivshm_geometry *g,
                      unsigned mode)
{
    if (!path || !*path || size > (uint64_t)1 << 46)
        return -EINVAL;
    /* geometry and size first: a refused request leaves no file behind */
    struct layout l;
    int rc = geometry_defaults(g, &l);
    if (rc < 0)
        return rc;
    compute_layout(&l);
    if (size < l.heap_off + MIN_HEAP)
        return IVSHM_ESIZE;

    /* directory of `path`, for O_TMPFILE */
    char dir[4096];
    const char *slash = strrchr(path, '/');
    size_t dlen = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    if (dlen >= sizeof dir)
        return -ENAMETOOLONG;
    memcpy(dir, !slash ? "." : path, dlen);
    dir[dlen] = '\0';

    int fd = open(dir, O_RDWR | O_TMPFILE | O_CLOEXEC, mode & 0777);
    if (fd < 0 && errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL)
        return -errno; /* no such directory, not ours to write, ... */
    if (fd >= 0) {
        rc = format_fd(fd, size, g, mode);
        if (rc == 0) {
            char self[64];
            snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
            if (linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW) < 0) {
                rc = -errno;
                /* no /proc: the same link by fd (needs CAP_DAC_READ_SEARCH) */
                if (rc == -ENOENT &&
                    linkat(fd, "", AT_FDCWD, path, AT_EMPTY_PATH) == 0)
                    rc = 0;
            }
        }
        close(fd);
        if (rc != -EEXIST)
            return rc; /* an unlinked O_TMPFILE vanishes with its fd */
        /* the name exists: adopt it below if it is an empty file of ours */
    }

    bool created = true;
    fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
              mode & 0777);
    if (fd < 0 && errno == EEXIST) {
        created = false;
        fd = open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            return -errno; /* ELOOP: a symlink, not followed */
        if (!adoptable(fd)) {
            close(fd);
            return -EEXIST;
        }
    }
    if (fd < 0)
        return -errno;
    struct stat mine;
    bool known = fstat(fd, &mine) == 0;
    rc = known ? format_fd(fd, size, g, mode) : -errno;
    if (rc < 0) {
        struct stat now;
        if (created && known && lstat(path, &now) == 0 &&
            now.st_dev == mine.st_dev && now.st_ino == mine.st_ino)
            unlink(path); /* still the file we created */
        else if (!created)
            (void)ftruncate(fd, 0); /* adopted: leave it empty, as found */
    }
    close(fd);
    return rc;
}

/* Check the header of a mapping of `size` bytes and copy out the layout. */
static int validate_header(const uint8_t *base, uint64_t size, struct layout *out)
{
    const struct ivshm_header *hdr = (const void *)base;
    if (size < IVSHM_HEADER_BYTES)
        return IVSHM_ESIZE;
    /* Snapshot every field once: the header may change under us. */
    uint64_t magic = __atomic_load_n(&hdr->magic, __ATOMIC_RELAXED);
    uint32_t version = __atomic_load_n(&hdr->version, __ATOMIC_RELAXED);
    if (magic != IVSHM_MAGIC)
        return IVSHM_EMAGIC;
    if (version != IVSHM_LAYOUT_VERSION)
        return IVSHM_EVERSION;
    ivshm_geometry g = {
        .max_peers = __atomic_load_n(&hdr->max_peers, __ATOMIC_RELAXED),
        .ring_slots = __atomic_load_n(&hdr->ring_slots, __ATOMIC_RELAXED),
        .slot_size = __atomic_load_n(&hdr->slot_size, __ATOMIC_RELAXED),
        .max_windows = __atomic_load_n(&hdr->max_windows, __ATOMIC_RELAXED),
        .queue_slots = __atomic_load_n(&hdr->queue_slots, __ATOMIC_RELAXED),
        .fast_channels = __atomic_load_n(&hdr->fast_channels, __ATOMIC_RELAXED),
    };
    /* zero would silently mean "default" below (the header stores the
       real channel count, 0 included) */
    if (!g.max_peers || !g.ring_slots || !g.slot_size || !g.max_windows ||
        !g.queue_slots || g.fast_channels == IVSHM_FAST_NONE)
        return IVSHM_ESIZE;
    if (!g.fast_channels)
        g.fast_channels = IVSHM_FAST_NONE;
    if (geometry_defaults(&g, out) < 0)
        return IVSHM_ESIZE;
    compute_layout(out);
    uint64_t region_size = __atomic_load_n(&hdr->region_size, __ATOMIC_RELAXED);
    if (region_size > size || region_size < out->heap_off + MIN_HEAP)
        return IVSHM_ESIZE;
    /* From the checked local copy: heap_off + heap_size = region_size
       <= size. The header's heap_size is only compared below, never used,
       so a co-tenant flipping it between two reads gains nothing. */
    out->heap_size = region_size - out->heap_off;
    if (__atomic_load_n(&hdr->header_bytes, __ATOMIC_RELAXED) != IVSHM_HEADER_BYTES ||
        __atomic_load_n(&hdr->registry_off, __ATOMIC_RELAXED) != out->registry_off ||
        __atomic_load_n(&hdr->rx_off, __ATOMIC_RELAXED) != out->rx_off ||
        __atomic_load_n(&hdr->rx_bytes, __ATOMIC_RELAXED) != out->rx_bytes ||
        __atomic_load_n(&hdr->ring_bytes, __ATOMIC_RELAXED) != out->ring_bytes ||
        __atomic_load_n(&hdr->windir_off, __ATOMIC_RELAXED) != out->windir_off ||
        __atomic_load_n(&hdr->wctl_off, __ATOMIC_RELAXED) != out->wctl_off ||
        __atomic_load_n(&hdr->heap_off, __ATOMIC_RELAXED) != out->heap_off ||
        __atomic_load_n(&hdr->heap_size, __ATOMIC_RELAXED) != out->heap_size)
        return IVSHM_ESIZE;
    return 0;
}

/* Who can probe our pid: processes of the same pid namespace of the same
   kernel. The namespace inode alone is not enough, since every kernel's
   initial namespace has the same inode number: a guest's pid looked up
   in the host would name some unrelated host process (or none, and the
   guest would be declared dead). So the kernel's boot id is mixed in. */
static uint64_t self_pidns(void)
{
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) < 0)
        return 0;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    char boot_id[64];
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, boot_id, sizeof boot_id);
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return 0; /* unknown kernel: never probe by pid */
    for (ssize_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)boot_id[i]) * 0x100000001b3ull;
    h ^= (uint64_t)st.st_ino * 0x9e3779b97f4a7c15ull;
    return h ? h : 1;
}

/* Wait (bounded) for a formatter to finish; format a blank region if asked. */
static int wait_ready(uint8_t *base, uint64_t size, bool may_format,
                      const ivshm_geometry *g)
{
    struct ivshm_header *hdr = (void *)base;
    uint64_t deadline = ivshm_now_ns() + 2000000000ull;
    for (;;) {
        uint32_t st = atomic_load_explicit(&hdr->state, memory_order_acquire);
        if (st == REGION_READY)
            return 0;
        if (st == REGION_BLANK && may_format &&
            __atomic_load_n(&hdr->magic, __ATOMIC_RELAXED) == 0) {
            uint32_t expect = REGION_BLANK;
            if (atomic_compare_exchange_strong(&hdr->state, &expect,
                                               REGION_FORMATTING))
                return ivshm_format(base, size, g);
            continue;
        }
        if (st != REGION_FORMATTING)
            return IVSHM_EMAGIC;
        if (ivshm_now_ns() > deadline)
            return -ETIMEDOUT;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

static int map_fd(int fd, bool may_format, ivshm **out)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -errno;
    uint64_t size = (uint64_t)st.st_size;
    if (size < IVSHM_HEADER_BYTES)
        return IVSHM_ESIZE;
    uint8_t *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return -errno;
    struct layout l;
    int rc = wait_ready(base, size, may_format, NULL);
    if (rc == 0)
        rc = validate_header(base, size, &l);
    ivshm *h = rc == 0 ? calloc(1, sizeof *h) : NULL;
    if (h) {
        /* local state sized by this region's peers, not by the maximum */
        h->peers = calloc(l.max_peers, sizeof *h->peers);
        h->bl_list = calloc(l.max_peers, sizeof *h->bl_list);
        h->listen_gen = calloc(l.max_peers, sizeof *h->listen_gen);
        if (!h->peers || !h->bl_list || !h->listen_gen) {
            free(h->peers);
            free(h->bl_list);
            free(h->listen_gen);
            free(h);
            h = NULL;
        }
    }
    if (rc == 0 && !h)
        rc = -ENOMEM;
    if (rc < 0) {
        munmap(base, size);
        return rc;
    }
    h->base = base;
    h->size = size;
    h->map_fd = fd;
    h->max_peers = l.max_peers;
    h->ring_slots = l.ring_slots;
    h->slot_size = l.slot_size;
    h->max_windows = l.max_windows;
    h->queue_slots = l.queue_slots;
    h->fast_channels = l.fast_channels;
    h->work_budget =
        ivshm_work_budget_of(l.queue_slots, l.ring_slots, l.max_peers);
    h->registry_off = l.registry_off;
    h->rx_off = l.rx_off;
    h->rx_bytes = l.rx_bytes;
    h->ring_bytes = l.ring_bytes;
    h->windir_off = l.windir_off;
    h->wctl_off = l.wctl_off;
    h->heap_off = l.heap_off;
    h->heap_size = l.heap_size; /* validated copy: the header is not re-read */
    h->self = -1;
    h->q_peek_src = -1;
    h->rx_hot = -1;
    for (uint32_t k = 0; k < IVSHM_MAX_FAST; k++)
        h->chan_user[k] = -1;
    for (uint32_t x = 0; x < l.max_peers; x++)
        h->peers[x].tx_chan = h->peers[x].rx_chan = -1;
    h->pidns = self_pidns();
    *out = h;
    return 0;
}

int ivshm_region_map(int fd, ivshm **out)
{
    return map_fd(fd, false, out);
}

int ivshm_region_map_or_format(int fd, ivshm **out)
{
    return map_fd(fd, true, out);
}

void ivshm_region_unmap(ivshm *h)
{
    if (!h)
        return;
    munmap(h->base, h->size);
    if (h->map_fd >= 0)
        close(h->map_fd);
    free(h->peers);
    free(h->bl_list);
    free(h->listen_gen);
    free(h);
}

/*
 * The administration API of ivshm_admin.h: region creation for the
 * ivshmem-server (sealed memfd, or an exclusively created host file) and
 * the server's registry view. Thin wrappers over the library internals,
 * so the server builds against public headers only.
 */
#define _GNU_SOURCE
#include "ivshm_admin.h"

#include "region.h"
#include "registry.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_REGION_SIZE ((uint64_t)1 << 46)
#define SIZE_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

struct ivshm_admin {
    ivshm *h;
};

/* Size `fd` (fresh, empty) to `size` and format it through a temporary
   mapping. Grown from empty, it reads as zeros: the receive areas need
   no writing (each peer empties its own when it joins). */
static int size_and_format(int fd, uint64_t size, const ivshm_geometry *g)
{
    if (ftruncate(fd, (off_t)size) < 0)
        return -errno;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -errno;
    int rc = ivshm_format_fresh(p, size, g);
    munmap(p, size);
    return rc;
}

int ivshm_admin_create_memfd(const char *name, uint64_t size,
                             const ivshm_geometry *g, int *fd_out)
{
    if (!name || !fd_out || size == 0 || size > MAX_REGION_SIZE)
        return -EINVAL;
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -errno;
    int rc = size_and_format(fd, size, g);
    if (rc == 0 && fcntl(fd, F_ADD_SEALS, SIZE_SEALS) < 0)
        rc = -errno;
    if (rc < 0) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return 0;
}

int ivshm_admin_create_file(const char *path, uint64_t size,
                            const ivshm_geometry *g, unsigned mode,
                            int *fd_out)
{
    if (!path || !*path || !fd_out || size == 0 || size > MAX_REGION_SIZE)
        return -EINVAL;
    /* O_EXCL also refuses a symbolic link at `path`, dangling or not. */
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  mode & 0777);
    if (fd < 0)
        return -errno;
    int rc = fchmod(fd, mode & 0777) < 0 ? -errno : 0;
    if (rc == 0)
        rc = size_and_format(fd, size, g);
    if (rc < 0) {
        unlink(path);
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return 0;
}

int ivshm_admin_sealed(int fd)
{
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0)
        return errno == EINVAL ? 0 : -errno; /* EINVAL: not sealable */
    return (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) ==
           (F_SEAL_SHRINK | F_SEAL_GROW);
}

int ivshm_admin_open(int fd, ivshm_admin **out)
{
    if (!out)
        return -EINVAL;
    struct ivshm_admin *a = calloc(1, sizeof *a);
    if (!a)
        return -ENOMEM;
    int map_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (map_fd < 0) {
        free(a);
        return -errno;
    }
    int rc = ivshm_region_map(map_fd, &a->h); /* owns map_fd on success */
    if (rc < 0) {
        close(map_fd);
        free(a);
        return rc;
    }
    *out = a;
    return 0;
}

int ivshm_admin_mark_dead(ivshm_admin *a, int32_t doorbell_id)
{
    if (!a || doorbell_id < 0)
        return 0;
    return ivshm_mark_doorbell_dead(a->h, doorbell_id);
}

int ivshm_admin_mark_dead_ids(ivshm_admin *a, const int32_t *ids, size_t n)
{
    if (!a || (n && !ids))
        return -EINVAL;
    int32_t *sorted = malloc(n ? n * sizeof *ids : 1);
    if (!sorted)
        return -ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= 0)
            sorted[k++] = ids[i];
    int marked = ivshm_mark_doorbells_dead(a->h, sorted, k);
    free(sorted);
    return marked;
}

void ivshm_admin_close(ivshm_admin *a)
{
    if (!a)
        return;
    ivshm_region_unmap(a->h);
    free(a);
}

int ivshm_admin_drain(ivshm_admin *a, int32_t doorbell_id, uint32_t req)
{
    if (!a)
        return -EINVAL;
    return ivshm_drain_request_id(a->h, doorbell_id, req);
}

int ivshm_admin_drain_slot(ivshm_admin *a, int slot, uint32_t gen,
                           uint32_t req)
{
    if (!a)
        return -EINVAL;
    return ivshm_drain_request(a->h, slot, gen, req);
}

int ivshm_admin_drain_state(ivshm_admin *a, int slot, uint32_t gen,
                            uint32_t req, int32_t *status)
{
    if (!a)
        return -EINVAL;
    return ivshm_drain_state(a->h, slot, gen, req, status);
}

int ivshm_admin_peer_id(ivshm_admin *a, int slot, int32_t *doorbell_id,
                        uint32_t *gen)
{
    if (!a)
        return -EINVAL;
    ivshm_peer_info info;
    int rc = ivshm_peer(a->h, slot, &info);
    if (rc < 0)
        return rc;
    if (doorbell_id)
        *doorbell_id = info.doorbell_id;
    if (gen)
        *gen = info.generation;
    return 0;
}

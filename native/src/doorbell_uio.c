/*
 * Guest doorbell: inside a VM whose ivshmem-doorbell device is bound to
 * uio_pci_generic. Ringing writes (peer id << 16 | vector) to the BAR0
 * Doorbell register; waiting is a blocking read of /dev/uioN, which
 * returns once the device raised an interrupt since our last read.
 * uio_pci_generic masks INTx after each interrupt; writing 1 to the uio
 * fd unmasks it again, so arm() re-enables before we announce sleep.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define BAR0_BYTES 256
#define REG_IVPOSITION 8
#define REG_DOORBELL 12

struct uio_db {
    struct ivshm_doorbell db;
    int uio_fd;
    volatile uint32_t *bar0;
};

static int uio_ring(struct ivshm_doorbell *db, ivshm *h, int slot,
                    int32_t doorbell_id)
{
    (void)h;
    (void)slot;
    struct uio_db *u = (struct uio_db *)db;
    /* the id comes from the shared registry: 16 bits or nothing */
    if (doorbell_id < 0 || doorbell_id > 0xffff)
        return IVSHM_ECORRUPT;
    u->bar0[REG_DOORBELL / 4] = (uint32_t)doorbell_id << 16; /* vector 0 */
    return 0;
}

static uint64_t uio_arm(struct ivshm_doorbell *db, ivshm *h)
{
    (void)h;
    struct uio_db *u = (struct uio_db *)db;
    int32_t on = 1;
    if (write(u->uio_fd, &on, sizeof on) != (ssize_t)sizeof on) {
        /* MSI-X devices have no irqcontrol: nothing to re-enable */
    }
    return 0;
}

static int uio_wait(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                    int timeout_ms)
{
    (void)h;
    (void)token;
    struct uio_db *u = (struct uio_db *)db;
    struct pollfd p = {.fd = u->uio_fd, .events = POLLIN};
    int n = poll(&p, 1, timeout_ms);
    if (n < 0)
        return -errno;
    if (n == 0)
        return -ETIMEDOUT;
    uint32_t count;
    if (read(u->uio_fd, &count, sizeof count) < 0)
        return -errno;
    return 0;
}

static int uio_fd(struct ivshm_doorbell *db)
{
    return ((struct uio_db *)db)->uio_fd;
}

static int uio_notices(struct ivshm_doorbell *db, ivshm *h)
{
    /* A guest sees no server: the host-side server marks the dead. */
    (void)db;
    (void)h;
    return 0;
}

static void uio_destroy(struct ivshm_doorbell *db)
{
    struct uio_db *u = (struct uio_db *)db;
    munmap((void *)u->bar0, BAR0_BYTES);
    close(u->uio_fd);
    free(u);
}

struct ivshm_doorbell *ivshm_db_uio_new(const char *uio_dev,
                                        const char *bar0_path,
                                        int32_t *doorbell_id, int *err)
{
    struct uio_db *u = calloc(1, sizeof *u);
    if (!u) {
        *err = -ENOMEM;
        return NULL;
    }
    u->uio_fd = open(uio_dev, O_RDWR | O_CLOEXEC);
    int bar_fd = u->uio_fd < 0 ? -1 : open(bar0_path, O_RDWR | O_SYNC | O_CLOEXEC);
    void *bar = bar_fd < 0 ? MAP_FAILED
                           : mmap(NULL, BAR0_BYTES, PROT_READ | PROT_WRITE,
                                  MAP_SHARED, bar_fd, 0);
    int e = errno;
    if (bar_fd >= 0)
        close(bar_fd);
    if (bar == MAP_FAILED) {
        if (u->uio_fd >= 0)
            close(u->uio_fd);
        free(u);
        *err = -e;
        return NULL;
    }
    u->bar0 = bar;
    if (*doorbell_id < 0)
        *doorbell_id = (int32_t)u->bar0[REG_IVPOSITION / 4];
    u->db.kind = DB_UIO;
    u->db.ring = uio_ring;
    u->db.arm = uio_arm;
    u->db.wait = uio_wait;
    u->db.fd = uio_fd;
    u->db.poll_notices = uio_notices;
    u->db.destroy = uio_destroy;
    return &u->db;
}

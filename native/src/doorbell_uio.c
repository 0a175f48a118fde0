/*
 * Guest doorbell: code inside a VM talking to its ivshmem-doorbell device
 * from user space. Ringing a peer writes (peer id << 16 | vector) to the
 * BAR0 Doorbell register; QEMU turns it into a write to that peer's
 * eventfd. Waiting blocks until our own vector fires. Two kernel drivers
 * can deliver that interrupt to user space, chosen by cfg->uio_dev:
 *
 * - /dev/uioN (uio_pci_generic): INTx only. The device raises INTx only
 *   when its IntrMask register enables it, and holds the level until
 *   IntrStatus is read; uio_pci_generic masks INTx at every interrupt and
 *   writing 1 to the uio fd unmasks it. QEMU's ivshmem-doorbell has no
 *   INTx line at all (it signals MSI-X only, and drops the interrupt while
 *   the guest has MSI-X off): attaching it this way fails with ENOTSUP.
 *   This mode is for devices that do have INTx.
 * - /dev/vfio/G (vfio-pci, the device's IOMMU group): MSI-X vector 0 is
 *   routed to an eventfd with VFIO_DEVICE_SET_IRQS; a blocking read of it
 *   is the wait. This is what works with ivshmem-doorbell. BAR0 is then
 *   accessed through the vfio device fd (pread/pwrite), because vfio-pci
 *   claims the BAR and a sysfs mmap of a claimed BAR is refused.
 *
 * bar0_path is the device's sysfs resource0; in vfio mode its directory
 * name is the PCI address vfio wants.
 *
 * A vfio group is opened by one process at a time. Later processes of the
 * same guest (more MPI ranks in one VM) get EBUSY; when they know the
 * guest's IVPosition (cfg->doorbell_id, from the guest's configuration)
 * they attach with a DB_NONE doorbell instead: the region (resource2)
 * maps for any number of processes, the device's interrupt and registers
 * stay with the first. Such an attachment never announces sleep, so
 * nobody rings it, and waits in POLL_SLICE_US sleeps, re-checking its
 * rings after each. Its own rings are dropped: a peer it wakes that
 * sleeps sees the message at the end of its slice (ivshm_wait's liveness
 * slice, the BTL's block slice; the BTL does not block at all while
 * another BTL such as vader carries some of its peers). It registers the
 * guest's IVPosition as its doorbell id, so when the guest dies the
 * server's notice marks it dead with the first. vfio-pci resets the
 * device when the first opens it, which would take the region away from
 * the others for as long as the reset lasts; ivshm-bind turns the
 * device's resets off (packaging/guest/ivshm-bind).
 */
#define _GNU_SOURCE
#include "doorbell.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/vfio.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define BAR0_BYTES 256
#define REG_INTRMASK 0
#define REG_INTRSTATUS 4
#define REG_IVPOSITION 8
#define REG_DOORBELL 12

#define VFIO_PREFIX "/dev/vfio/"
#define PCI_CMD_REG 0x04    /* config space: command register */
#define PCI_CMD_MASTER 0x4  /* bus master enable */

struct uio_db {
    struct ivshm_doorbell db;
    bool vfio;
    /* uio mode */
    int uio_fd;
    volatile uint32_t *bar0;
    /* vfio mode */
    int container_fd, group_fd, device_fd, irq_fd;
    uint64_t bar0_off;         /* BAR0's offset in the device fd */
};

/* ---- register access, whichever way BAR0 is reachable ---- */

static int reg_write(struct uio_db *u, unsigned reg, uint32_t val)
{
    if (!u->vfio) {
        u->bar0[reg / 4] = val;
        return 0;
    }
    ssize_t n = pwrite(u->device_fd, &val, sizeof val,
                       (off_t)(u->bar0_off + reg));
    return n == (ssize_t)sizeof val ? 0 : n < 0 ? -errno : -EIO;
}

static int reg_read(struct uio_db *u, unsigned reg, uint32_t *val)
{
    if (!u->vfio) {
        *val = u->bar0[reg / 4];
        return 0;
    }
    ssize_t n = pread(u->device_fd, val, sizeof *val,
                      (off_t)(u->bar0_off + reg));
    return n == (ssize_t)sizeof *val ? 0 : n < 0 ? -errno : -EIO;
}

/* ---- doorbell operations ---- */

static int uio_ring(struct ivshm_doorbell *db, ivshm *h, int slot,
                    int32_t doorbell_id)
{
    (void)h;
    (void)slot;
    struct uio_db *u = (struct uio_db *)db;
    /* the id comes from the shared registry: 16 bits or nothing */
    if (doorbell_id < 0 || doorbell_id > 0xffff)
        return IVSHM_ECORRUPT;
    return reg_write(u, REG_DOORBELL, (uint32_t)doorbell_id << 16); /* vector 0 */
}

static uint64_t uio_arm(struct ivshm_doorbell *db, ivshm *h)
{
    (void)h;
    struct uio_db *u = (struct uio_db *)db;
    if (!u->vfio) {
        /* Unmask INTx before announcing sleep, so a ring that follows
           the announcement raises an interrupt. Fails (EIO) for a device
           without an INTx line: wait() then degrades to its timeout. */
        int32_t on = 1;
        if (write(u->uio_fd, &on, sizeof on) != (ssize_t)sizeof on) {
        }
    }
    /* MSI-X needs no re-arming: every ring is a new edge. */
    return 0;
}

static int uio_wait(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                    int timeout_ms)
{
    (void)h;
    (void)token;
    struct uio_db *u = (struct uio_db *)db;
    int fd = u->vfio ? u->irq_fd : u->uio_fd;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int n = poll(&p, 1, timeout_ms);
    if (n < 0)
        return -errno;
    if (n == 0)
        return -ETIMEDOUT;
    if (u->vfio) {
        uint64_t count;
        if (read(fd, &count, sizeof count) < 0 && errno != EAGAIN)
            return -errno;
        return 0;
    }
    /* uio reads are exactly one 32-bit event count */
    uint32_t count;
    if (read(fd, &count, sizeof count) < 0)
        return -errno;
    /* Reading IntrStatus drops the INTx level; without it the line
       would fire again as soon as arm() unmasks it. */
    uint32_t status;
    (void)reg_read(u, REG_INTRSTATUS, &status);
    return 0;
}

static int uio_fd(struct ivshm_doorbell *db)
{
    struct uio_db *u = (struct uio_db *)db;
    return u->vfio ? u->irq_fd : u->uio_fd;
}

static int uio_notices(struct ivshm_doorbell *db, ivshm *h)
{
    /* A guest sees no server: the host-side server marks the dead. */
    (void)db;
    (void)h;
    return 0;
}

static void close_if(int fd)
{
    if (fd >= 0)
        close(fd);
}

static void uio_destroy(struct ivshm_doorbell *db)
{
    struct uio_db *u = (struct uio_db *)db;
    if (u->bar0)
        munmap((void *)u->bar0, BAR0_BYTES);
    if (u->vfio && u->device_fd >= 0 && u->irq_fd >= 0) {
        /* disable the MSI-X trigger before its eventfd goes away */
        struct vfio_irq_set off = {
            .argsz = sizeof off,
            .flags = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            .index = VFIO_PCI_MSIX_IRQ_INDEX,
            .start = 0,
            .count = 0,
        };
        (void)ioctl(u->device_fd, VFIO_DEVICE_SET_IRQS, &off);
    }
    close_if(u->irq_fd);
    close_if(u->device_fd);
    close_if(u->group_fd);
    close_if(u->container_fd);
    close_if(u->uio_fd);
    free(u);
}

/* ---- setup ---- */

static int open_uio(struct uio_db *u, const char *uio_dev,
                    const char *bar0_path)
{
    u->uio_fd = open(uio_dev, O_RDWR | O_CLOEXEC);
    if (u->uio_fd < 0)
        return -errno;
    int bar_fd = open(bar0_path, O_RDWR | O_SYNC | O_CLOEXEC);
    if (bar_fd < 0)
        return -errno;
    void *bar = mmap(NULL, BAR0_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED,
                     bar_fd, 0);
    int e = errno;
    close(bar_fd);
    if (bar == MAP_FAILED)
        return -e;
    u->bar0 = bar;
    /* A device without an INTx line (QEMU's ivshmem-doorbell has none)
       gets no irqcontrol from uio_pci_generic: EIO. Nothing could ever
       wake us, so refuse rather than degrade to timeouts. */
    int32_t on = 1;
    if (write(u->uio_fd, &on, sizeof on) != (ssize_t)sizeof on)
        return errno == EIO ? -ENOTSUP : -errno;
    /* Enable the device's INTx source. */
    return reg_write(u, REG_INTRMASK, 0xffffffffu);
}

/* "…/0000:00:04.0/resource0" -> "0000:00:04.0" */
static int pci_name_of(const char *bar0_path, char *out, size_t cap)
{
    const char *end = strrchr(bar0_path, '/');
    if (!end || end == bar0_path)
        return -EINVAL;
    const char *start = end - 1;
    while (start > bar0_path && start[-1] != '/')
        start--;
    size_t len = (size_t)(end - start);
    if (len == 0 || len >= cap)
        return -EINVAL;
    memcpy(out, start, len);
    out[len] = '\0';
    return 0;
}

static int open_vfio(struct uio_db *u, const char *group_dev,
                     const char *bar0_path)
{
    char pci[64];
    int rc = pci_name_of(bar0_path, pci, sizeof pci);
    if (rc < 0)
        return rc;
    u->container_fd = open(VFIO_PREFIX "vfio", O_RDWR | O_CLOEXEC);
    if (u->container_fd < 0)
        return -errno;
    if (ioctl(u->container_fd, VFIO_GET_API_VERSION) != VFIO_API_VERSION)
        return -EPROTONOSUPPORT;
    int type = VFIO_TYPE1v2_IOMMU;
    if (ioctl(u->container_fd, VFIO_CHECK_EXTENSION, type) <= 0) {
        type = VFIO_TYPE1_IOMMU;
        if (ioctl(u->container_fd, VFIO_CHECK_EXTENSION, type) <= 0)
            return -ENOTSUP;
    }
    /* A group is opened by one process at a time: EBUSY for a second. */
    u->group_fd = open(group_dev, O_RDWR | O_CLOEXEC);
    if (u->group_fd < 0)
        return -errno;
    struct vfio_group_status gs = {.argsz = sizeof gs};
    if (ioctl(u->group_fd, VFIO_GROUP_GET_STATUS, &gs) < 0)
        return -errno;
    if (!(gs.flags & VFIO_GROUP_FLAGS_VIABLE))
        return -EBUSY; /* another device of the group is bound elsewhere */
    if (ioctl(u->group_fd, VFIO_GROUP_SET_CONTAINER, &u->container_fd) < 0 ||
        ioctl(u->container_fd, VFIO_SET_IOMMU, type) < 0)
        return -errno;
    u->device_fd = ioctl(u->group_fd, VFIO_GROUP_GET_DEVICE_FD, pci);
    if (u->device_fd < 0)
        return -errno;

    struct vfio_region_info reg = {.argsz = sizeof reg,
                                   .index = VFIO_PCI_BAR0_REGION_INDEX};
    if (ioctl(u->device_fd, VFIO_DEVICE_GET_REGION_INFO, &reg) < 0)
        return -errno;
    if (reg.size < REG_DOORBELL + 4 || !(reg.flags & VFIO_REGION_INFO_FLAG_READ) ||
        !(reg.flags & VFIO_REGION_INFO_FLAG_WRITE))
        return -ENODEV;
    u->bar0_off = reg.offset;

    /* An MSI is a memory write by the device: without bus mastering
       QEMU drops it, and vfio-pci leaves that bit to user space. */
    struct vfio_region_info cfg = {.argsz = sizeof cfg,
                                   .index = VFIO_PCI_CONFIG_REGION_INDEX};
    if (ioctl(u->device_fd, VFIO_DEVICE_GET_REGION_INFO, &cfg) < 0)
        return -errno;
    uint16_t cmd;
    if (pread(u->device_fd, &cmd, sizeof cmd, (off_t)(cfg.offset + PCI_CMD_REG)) !=
        (ssize_t)sizeof cmd)
        return -EIO;
    if (!(cmd & PCI_CMD_MASTER)) {
        cmd |= PCI_CMD_MASTER;
        if (pwrite(u->device_fd, &cmd, sizeof cmd,
                   (off_t)(cfg.offset + PCI_CMD_REG)) != (ssize_t)sizeof cmd)
            return -EIO;
    }

    struct vfio_irq_info irq = {.argsz = sizeof irq,
                                .index = VFIO_PCI_MSIX_IRQ_INDEX};
    if (ioctl(u->device_fd, VFIO_DEVICE_GET_IRQ_INFO, &irq) < 0)
        return -errno;
    if (irq.count < 1 || !(irq.flags & VFIO_IRQ_INFO_EVENTFD))
        return -ENODEV;
    u->irq_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (u->irq_fd < 0)
        return -errno;
    union {
        struct vfio_irq_set set;
        uint8_t bytes[sizeof(struct vfio_irq_set) + sizeof(int32_t)];
    } req;
    memset(&req, 0, sizeof req);
    req.set.argsz = sizeof req;
    req.set.flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    req.set.index = VFIO_PCI_MSIX_IRQ_INDEX;
    req.set.start = 0;
    req.set.count = 1;
    int32_t efd = u->irq_fd;
    memcpy(req.set.data, &efd, sizeof efd);
    if (ioctl(u->device_fd, VFIO_DEVICE_SET_IRQS, &req.set) < 0)
        return -errno;
    return 0;
}

/* ---- DB_NONE: another process of the guest holds the device ---- */

#define POLL_SLICE_US 100

static int none_ring(struct ivshm_doorbell *db, ivshm *h, int slot,
                     int32_t doorbell_id)
{
    (void)db;
    (void)h;
    (void)slot;
    (void)doorbell_id;
    return -ENOTSUP; /* no register to write: the peer wakes at its slice */
}

static uint64_t none_arm(struct ivshm_doorbell *db, ivshm *h)
{
    (void)db;
    (void)h;
    return 0;
}

static int none_wait(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                     int timeout_ms)
{
    (void)db;
    (void)h;
    (void)token;
    /* a slice of at least 1 ms is never shorter than one poll */
    if (timeout_ms == 0)
        return -ETIMEDOUT;
    struct timespec ts = {0, POLL_SLICE_US * 1000L};
    nanosleep(&ts, NULL);
    return -ETIMEDOUT;
}

static int none_fd(struct ivshm_doorbell *db)
{
    (void)db;
    return -1;
}

static void none_destroy(struct ivshm_doorbell *db)
{
    free(db);
}

static const struct ivshm_doorbell none_ops = {
    .kind = DB_NONE,
    .ring = none_ring,
    .arm = none_arm,
    .wait = none_wait,
    .fd = none_fd,
    .poll_notices = uio_notices,
    .destroy = none_destroy,
};

static struct ivshm_doorbell *none_new(int *err)
{
    struct ivshm_doorbell *db = malloc(sizeof *db);
    if (!db) {
        *err = -ENOMEM;
        return NULL;
    }
    *db = none_ops;
    return db;
}

static const struct ivshm_doorbell uio_ops = {
    .kind = DB_UIO,
    .ring = uio_ring,
    .arm = uio_arm,
    .wait = uio_wait,
    .fd = uio_fd,
    .poll_notices = uio_notices,
    .destroy = uio_destroy,
};

struct ivshm_doorbell *ivshm_db_uio_new(const char *uio_dev,
                                        const char *bar0_path,
                                        int32_t *doorbell_id, int *err)
{
    struct uio_db *u = calloc(1, sizeof *u);
    if (!u) {
        *err = -ENOMEM;
        return NULL;
    }
    u->uio_fd = u->container_fd = u->group_fd = u->device_fd = u->irq_fd = -1;
    u->vfio = strncmp(uio_dev, VFIO_PREFIX, strlen(VFIO_PREFIX)) == 0;
    int rc = u->vfio ? open_vfio(u, uio_dev, bar0_path)
                     : open_uio(u, uio_dev, bar0_path);
    uint32_t pos = 0;
    if (rc == 0 && *doorbell_id < 0) {
        /* IVPosition: our server id; -1 (all ones) until the region is
           mapped, and only 16 bits are addressable by the Doorbell. */
        rc = reg_read(u, REG_IVPOSITION, &pos);
        if (rc == 0 && pos > 0xffff)
            rc = -ENODEV;
        if (rc == 0)
            *doorbell_id = (int32_t)pos;
    }
    if (rc < 0) {
        bool vfio = u->vfio;
        uio_destroy(&u->db);
        /* the group belongs to another process of this guest */
        if (rc == -EBUSY && vfio && *doorbell_id >= 0 &&
            *doorbell_id <= 0xffff)
            return none_new(err);
        *err = rc;
        return NULL;
    }
    u->db = uio_ops;
    return &u->db;
}

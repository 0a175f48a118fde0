/*
 * Attach through an ivshmem-server (QEMU's ivshmem-doorbell protocol,
 * docs/server-protocol.md): connect, read the opening messages (version
 * 0, our id, -1 + the region fd), refuse a region whose size could change
 * under us, then build the eventfd doorbell (doorbell_eventfd.c) from the
 * rest of the initial burst, map the region and join its registry.
 */
#define _GNU_SOURCE
#include "attach.h"
#include "doorbell_eventfd.h"
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SIZE_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

static int connect_server(const char *path)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    if (len == 0)
        return -EINVAL;
    if (len >= sizeof addr.sun_path)
        return -ENAMETOOLONG;
    memcpy(addr.sun_path, path, len + 1);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return -errno;
    int rc;
    do
        rc = connect(sock, (struct sockaddr *)&addr, sizeof addr);
    while (rc < 0 && errno == EINTR);
    if (rc < 0) {
        rc = -errno;
        close(sock);
        return rc;
    }
    return sock;
}

/* One of the three fixed opening messages. */
static int recv_opening(int sock, int64_t *value, int *fd)
{
    int rc = ivshm_server_recv(sock, ATTACH_TIMEOUT_MS, value, fd);
    if (rc == 0)
        return -ETIMEDOUT;
    return rc < 0 ? rc : 0;
}

/* Can nobody change the region's size (the server's sealed memfd)? */
static bool size_sealed(int fd)
{
    int seals = fcntl(fd, F_GET_SEALS);
    return seals >= 0 && (seals & SIZE_SEALS) == SIZE_SEALS;
}

int ivshm_attach_server(const char *socket_path, const ivshm_config *cfg,
                        ivshm **out)
{
    if (!socket_path || !cfg || !out)
        return -EINVAL;
    int sock = connect_server(socket_path);
    if (sock < 0)
        return sock;
    int64_t version, id, shm_marker;
    int fd = -1, shm_fd = -1;
    int rc = recv_opening(sock, &version, &fd);
    if (rc == 0 && (fd >= 0 || version != 0))
        rc = fd >= 0 ? -EPROTO : -EPROTONOSUPPORT;
    if (rc == 0)
        rc = recv_opening(sock, &id, &fd);
    if (rc == 0 && (fd >= 0 || id < 0 || id > SERVER_MAX_ID))
        rc = -EPROTO;
    if (rc == 0)
        rc = recv_opening(sock, &shm_marker, &shm_fd);
    if (rc == 0 && (shm_marker != -1 || shm_fd < 0))
        rc = -EPROTO;
    if (rc == 0 && !(cfg->flags & IVSHM_F_UNSEALED) && !size_sealed(shm_fd))
        rc = -EPERM; /* a file someone could truncate under us */
    if (fd >= 0)
        close(fd);
    if (rc < 0) {
        if (shm_fd >= 0)
            close(shm_fd);
        close(sock);
        return rc;
    }

    struct ivshm_doorbell *db = ivshm_db_server_new(sock, (int32_t)id, &rc);
    if (!db) {
        close(shm_fd);
        return rc;
    }
    ivshm *h;
    rc = ivshm_region_map(shm_fd, &h); /* owns shm_fd on success */
    if (rc < 0) {
        close(shm_fd);
        db->destroy(db);
        return rc;
    }
    h->db = db;
    ivshm_db_server_attach(db, h);
    rc = ivshm_join(h, cfg, (int32_t)id, DB_EVENTFD);
    if (rc < 0) {
        ivshm_detach(h); /* self < 0: destroys db and unmaps only */
        return rc;
    }
    *out = h;
    return 0;
}

/* The server's wire protocol spoken by hand (docs/server-protocol.md),
   for the tests that play hostile or measuring clients. */
#ifndef IVSHM_TEST_SERVER_RAW_H
#define IVSHM_TEST_SERVER_RAW_H

#include <endian.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static inline int connect_to(const char *path)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s >= 0 && connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(s);
        return -1;
    }
    return s;
}

/* One message within timeout_ms: 1, 0 on timeout, -1 on EOF/error. */
static inline int raw_recv(int sock, int64_t *value, int *fd, int timeout_ms)
{
    uint64_t le;
    struct iovec iov = {.iov_base = &le, .iov_len = sizeof le};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1,
                       .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    struct pollfd p = {.fd = sock, .events = POLLIN};
    int r = poll(&p, 1, timeout_ms);
    if (r == 0)
        return 0;
    /* The server writes whole messages unless the socket is full; MSG_WAITALL
       collects a message that went out in pieces. */
    if (r < 0 || recvmsg(sock, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL) != 8)
        return -1;
    *fd = -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (c && c->cmsg_type == SCM_RIGHTS)
        memcpy(fd, CMSG_DATA(c), sizeof *fd);
    *value = (int64_t)le64toh(le);
    return 1;
}

#endif

/*
 * The provider: fi_prov_ini, its parameters (FI_IVSHM_*, listed by
 * `fi_info -e`), and the fabric object.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

struct fi_provider fiv_prov = {
    .name = FIV_PROV_NAME,
    .version = FIV_PROV_VERSION,
    /* replaced in fi_prov_ini by the running core's version: the core
       drops a provider whose fi_version is below what the application
       asks for, and we answer every version from 1.5 on (fiv_getinfo.c) */
    .fi_version = FI_VERSION(1, 17),
    .getinfo = fiv_getinfo,
    .fabric = fiv_fabric_open,
    .cleanup = fiv_cleanup,
};

/* ---- fabric ---- */

static int fabric_close(struct fid *fid)
{
    free(container_of(fid, struct fiv_fabric, fab.fid));
    return 0;
}

static struct fi_ops fabric_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = fabric_close,
    .bind = fiv_no_bind,
    .control = fiv_no_control,
    .ops_open = fiv_no_ops_open,
};

static struct fi_ops_fabric fabric_ops = {
    .size = sizeof(struct fi_ops_fabric),
    .domain = fiv_domain_open,
    .passive_ep = fiv_no_passive_ep,
    .eq_open = fiv_eq_open,
    .wait_open = fiv_no_wait_open,
    .trywait = fiv_no_trywait,
};

int fiv_fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
                    void *context)
{
    if (attr && attr->name && strcmp(attr->name, FIV_FABRIC_NAME))
        return -FI_ENODATA;
    struct fiv_fabric *f = calloc(1, sizeof *f);
    if (!f)
        return -FI_ENOMEM;
    f->fab.fid.fclass = FI_CLASS_FABRIC;
    f->fab.fid.context = context;
    f->fab.fid.ops = &fabric_fi_ops;
    f->fab.ops = &fabric_ops;
    f->api_version = attr && attr->api_version ? attr->api_version
                                               : fiv_prov.fi_version;
    *fabric = &f->fab;
    return 0;
}

/* ---- parameters ---- */

static char *param_str(const char *name, const char *fallback_env)
{
    char *v = NULL;
    if (fi_param_get_str(&fiv_prov, name, &v) == 0 && v && *v)
        return v;
    const char *e = fallback_env ? getenv(fallback_env) : NULL;
    return e && *e ? (char *)e : NULL;
}

FI_EXT_INI
{
    /* Claim the running core's version: it is what the application's
       request is compared with, and we answer in the version asked. */
    uint32_t core = fi_version();
    if (FI_VERSION_GE(core, FI_VERSION(1, 5)))
        fiv_prov.fi_version = core;

    fi_param_define(&fiv_prov, "region", FI_PARAM_STRING,
                    "Region file to attach to (a file formatted by libivshm, "
                    "or the ivshmem BAR resource2 inside a guest); default: "
                    "IVSHM_REGION, else /run/ivshm/ivshm.env in a guest");
    fi_param_define(&fiv_prov, "socket", FI_PARAM_STRING,
                    "ivshmem-server socket to attach through instead; "
                    "default: IVSHM_SOCKET");
    fi_param_define(&fiv_prov, "uio_dev", FI_PARAM_STRING,
                    "Inside a guest: interrupt device of the ivshmem card "
                    "(/dev/vfio/G or /dev/uioN) for doorbells");
    fi_param_define(&fiv_prov, "bar0", FI_PARAM_STRING,
                    "Inside a guest: the ivshmem BAR0 resource file");
    fi_param_define(&fiv_prov, "position", FI_PARAM_INT,
                    "Inside a guest: the device's IVPosition (ranks after "
                    "the first attach without a doorbell of their own)");
    fi_param_define(&fiv_prov, "device_env", FI_PARAM_STRING,
                    "Inside a guest: the file of the device's paths "
                    "(ivshm-bind's), read at start when no region is given "
                    "and again at each rejoin after a drain (default "
                    FIV_GUEST_ENV ")");
    fi_param_define(&fiv_prov, "core", FI_PARAM_STRING,
                    "Core provider for peers outside the region "
                    "(comma-separated, the first that opens; default "
                    "\"tcp;ofi_rxm,tcp,sockets\"; \"none\": region peers "
                    "only)");
    fi_param_define(&fiv_prov, "report", FI_PARAM_BOOL,
                    "Print one line 'fi_ivshm: pid P sent S received R "
                    "delegated D' per process to stderr at exit");

    fi_param_define(&fiv_prov, "peer_answer_bytes", FI_PARAM_SIZE_T,
                    "Bytes of RMA answers copied for one peer and not yet "
                    "sent; past it the peer's path fails (default 64 MiB)");
    fi_param_define(&fiv_prov, "peer_queue", FI_PARAM_SIZE_T,
                    "Messages queued for one peer: past it our sends to it "
                    "return -FI_EAGAIN and its requests fail its path "
                    "(default 65536)");
    fi_param_define(&fiv_prov, "peer_unexpected_bytes", FI_PARAM_SIZE_T,
                    "Bytes of one peer's messages held before a receive "
                    "takes them; past it the peer's path fails (default "
                    "1 GiB, one message of the maximum size)");
    fi_param_define(&fiv_prov, "drain_ms", FI_PARAM_INT,
                    "A drain the host asks for (docs/migration.md) ends "
                    "within this many ms: pairs not moved to the core by "
                    "then fail (default 5000)");
    int drain_ms = 0;
    if (fi_param_get_int(&fiv_prov, "drain_ms", &drain_ms) == 0 &&
        drain_ms > 0)
        fiv_cfg.drain_ms = drain_ms;
    size_t cap;
    if (fi_param_get_size_t(&fiv_prov, "peer_answer_bytes", &cap) == 0)
        fiv_cfg.peer_answer_bytes = cap;
    if (fi_param_get_size_t(&fiv_prov, "peer_queue", &cap) == 0 && cap)
        fiv_cfg.peer_queue = cap;
    if (fi_param_get_size_t(&fiv_prov, "peer_unexpected_bytes", &cap) == 0)
        fiv_cfg.peer_unexp_bytes = cap;

    fiv_cfg.region = param_str("region", "IVSHM_REGION");
    fiv_cfg.socket = param_str("socket", "IVSHM_SOCKET");
    fiv_cfg.uio_dev = param_str("uio_dev", NULL);
    fiv_cfg.bar0 = param_str("bar0", NULL);
    fiv_cfg.device_env = param_str("device_env", NULL);
    int pos = -1;
    if (fi_param_get_int(&fiv_prov, "position", &pos) == 0)
        fiv_cfg.position = pos;
    fiv_cfg.core = param_str("core", NULL);
    int rep = 0;
    if (fi_param_get_bool(&fiv_prov, "report", &rep) == 0)
        fiv_cfg.report = rep;
    if (!fiv_cfg.region && !fiv_cfg.socket)
        (void)fiv_guest_defaults(false);
    /* for the tests of lost messages only (docs/provider.md), so not a
       parameter fi_info lists */
    const char *lose = getenv("FIV_TEST_LOSE");
    fiv_cfg.test_lose = lose ? strtoull(lose, NULL, 10) : 0;
    const char *slow = getenv("FIV_TEST_SLOW_REGION");
    fiv_cfg.test_slow = slow ? (uint32_t)strtoul(slow, NULL, 10) : 0;
    return &fiv_prov;
}

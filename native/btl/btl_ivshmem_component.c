/*
 * Component: MCA parameters, the Open MPI version check, attaching to the
 * region at init (before the modex fence, so every co-resident rank is in
 * the registry by the time add_procs runs) and sizing fragments from the
 * region's geometry.
 */
#define _GNU_SOURCE
#include "btl_ivshmem.h"
#include "btl_ivshmem_frag.h"

#include "opal/mca/base/mca_base_pvar.h"
#include "opal/mca/pmix/pmix.h"
#include "opal/runtime/opal.h"
#include "opal/util/output.h"
#include "opal/util/proc.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* Attempts at attaching through a server (each bounded by libivshm). */
#define ATTACH_TRIES 4

static int ivshmem_register(void);
static int ivshmem_open(void);
static int ivshmem_close(void);
static mca_btl_base_module_t **ivshmem_init(int *num_btls,
                                            bool enable_progress_threads,
                                            bool enable_mpi_threads);

mca_btl_ivshmem_component_t mca_btl_ivshmem_component = {
    .super = {
        .btl_version = {
            MCA_BTL_DEFAULT_VERSION("ivshmem"),
            .mca_open_component = ivshmem_open,
            .mca_close_component = ivshmem_close,
            .mca_register_component_params = ivshmem_register,
        },
        .btl_data = {
            .param_field = MCA_BASE_METADATA_PARAM_NONE,
        },
        .btl_init = ivshmem_init,
        .btl_progress = mca_btl_ivshmem_component_progress,
    },
    .self_slot = -1,
};

/* The component is compiled against one Open MPI's struct layouts (btl
   module, descriptors, convertor): refuse any other major.minor. */
static bool version_matches(void)
{
    unsigned major = 0, minor = 0;
    if (sscanf(opal_version_string, "%u.%u", &major, &minor) == 2 &&
        major == OPAL_MAJOR_VERSION && minor == OPAL_MINOR_VERSION)
        return true;
    fprintf(stderr,
            "btl_ivshmem: built for Open MPI %d.%d.%d but this is Open MPI %s;"
            " component not loaded (rebuild it against this Open MPI)\n",
            OPAL_MAJOR_VERSION, OPAL_MINOR_VERSION, OPAL_RELEASE_VERSION,
            opal_version_string);
    return false;
}

static void reg_string(const char *name, const char *desc, char **storage)
{
    *storage = NULL;
    (void)mca_base_component_var_register(
        &mca_btl_ivshmem_component.super.btl_version, name, desc,
        MCA_BASE_VAR_TYPE_STRING, NULL, 0, 0, OPAL_INFO_LVL_3,
        MCA_BASE_VAR_SCOPE_READONLY, storage);
}

static void reg_int(const char *name, const char *desc, int *storage, int def)
{
    *storage = def;
    (void)mca_base_component_var_register(
        &mca_btl_ivshmem_component.super.btl_version, name, desc,
        MCA_BASE_VAR_TYPE_INT, NULL, 0, 0, OPAL_INFO_LVL_5,
        MCA_BASE_VAR_SCOPE_READONLY, storage);
}

static int sleeps_get(const struct mca_base_pvar_t *pvar, void *value, void *obj)
{
    (void)pvar;
    (void)obj;
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    ivshm_stats st = {0};
    if (c->h)
        ivshm_get_stats(c->h, &st);
    *(unsigned long long *)value = st.sleeps;
    return OPAL_SUCCESS;
}

static void reg_counter(const char *name, const char *desc, uint64_t *ctx,
                        mca_base_get_value_fn_t get)
{
    (void)mca_base_component_pvar_register(
        &mca_btl_ivshmem_component.super.btl_version, name, desc,
        OPAL_INFO_LVL_4, MCA_BASE_PVAR_CLASS_COUNTER,
        MCA_BASE_VAR_TYPE_UNSIGNED_LONG_LONG, NULL, MCA_BASE_VAR_BIND_NO_OBJECT,
        MCA_BASE_PVAR_FLAG_READONLY | MCA_BASE_PVAR_FLAG_CONTINUOUS, get, NULL,
        NULL, ctx);
}

static void register_counters(mca_btl_ivshmem_component_t *c);

static int ivshmem_register(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    if (!version_matches())
        return OPAL_ERR_NOT_AVAILABLE; /* quiet for the MCA base: we said it */

    (void)mca_base_var_group_component_register(
        &c->super.btl_version,
        "Shared-memory BTL over an ivshmem region (co-resident VMs)");
    reg_string("region",
               "Region file formatted for libivshm (host shm file, or the "
               "ivshmem BAR resource2 inside a guest); default: env IVSHM_REGION",
               &c->region_path);
    reg_string("socket",
               "ivshmem-server socket to attach through (eventfd doorbells); "
               "default: env IVSHM_SOCKET",
               &c->socket_path);
    reg_string("uio_dev",
               "Inside a guest: uio device of the ivshmem card (e.g. /dev/uio0) "
               "for doorbells; needs btl_ivshmem_bar0 too",
               &c->uio_dev);
    reg_string("bar0", "Inside a guest: path of the ivshmem BAR0 resource file",
               &c->bar0_path);
    reg_int("position",
            "Inside a guest: the device's IVPosition (ivshm-bind writes it); "
            "lets ranks after the first in a guest, which cannot open the "
            "vfio device the first holds, share the region without a "
            "doorbell. -1: read it from BAR0",
            &c->position, -1);
    reg_int("verbose",
            "1: print per-rank message counters at finalize; 2: also the "
            "counts of dropped messages and of region slots that posed as "
            "ranks of this job (attach, reachability and trust details: "
            "btl_base_verbose 10)",
            &c->verbose, 0);
    reg_int("spin_us",
            "Idle time (us) spent polling before the progress engine blocks "
            "on the doorbell",
            &c->spin_us, 50);
    reg_int("block_us",
            "Longest single block on the doorbell (us, rounded up to ms); "
            "-1: 1000 when every peer is reached through this BTL, else 0; "
            "0: never block (pure polling)",
            &c->block_us, -1);
    reg_int("stream_copy",
            "How a payload of 8 KiB or more is copied into its ring slot: "
            "1 with non-temporal stores, 0 with memcpy, -1 with memcpy "
            "unless timed copies to that peer run below 4 GB/s (then "
            "non-temporal for the next 4 MiB): see btl_ivshmem_copy.c",
            &c->stream_copy, -1);
    reg_int("free_list_num", "Initial number of send fragments per list",
            &c->free_list_num, 8);
    reg_int("free_list_max", "Maximum number of send fragments per list",
            &c->free_list_max, 1024);
    reg_int("free_list_inc", "Send fragments allocated at a time",
            &c->free_list_inc, 32);

    mca_btl_base_module_t *m = &mca_btl_ivshmem.super;
    /* Below vader (same host, single copy), above every network BTL. */
    m->btl_exclusivity = MCA_BTL_EXCLUSIVITY_HIGH - 1;
    /* 0 = sized from the region geometry at init (see size_fragments);
       ompi_info shows these defaults as 0 */
    m->btl_eager_limit = 0;
    m->btl_rndv_eager_limit = 0;
    m->btl_max_send_size = 0;
    m->btl_rdma_pipeline_send_length = 0;
    m->btl_rdma_pipeline_frag_size = 0;
    m->btl_min_rdma_pipeline_size = 0;
    /* send/receive only: one-sided MPI goes through osc/pt2pt over it */
    m->btl_flags = MCA_BTL_FLAGS_SEND;
    m->btl_latency = 1;        /* us */
    m->btl_bandwidth = 10000;  /* Mb/s, like vader without single copy */
    mca_btl_base_param_register(&c->super.btl_version, m);
    register_counters(c);
    return OPAL_SUCCESS;
}

/* The performance variables of docs/btl.md, "Counters". */
static void register_counters(mca_btl_ivshmem_component_t *c)
{
    reg_counter("sent_msgs", "BTL messages sent through the region",
                &c->counters.sent_msgs, NULL);
    reg_counter("sent_bytes", "Bytes sent through the region",
                &c->counters.sent_bytes, NULL);
    reg_counter("recv_msgs", "BTL messages received from the region",
                &c->counters.recv_msgs, NULL);
    reg_counter("recv_bytes", "Bytes received from the region",
                &c->counters.recv_bytes, NULL);
    reg_counter("sleeps", "Times the progress engine blocked on the doorbell",
                &c->sleeps_pvar, sleeps_get);
    reg_counter("dropped",
                "Messages of trusted senders not delivered (malformed, "
                "unregistered tag, or taken after the sender left)",
                &c->counters.dropped, NULL);
    reg_counter("rejected",
                "Region slots that claimed to be a rank of this job but did "
                "not match its modex (their messages are ignored)",
                &c->counters.rejected, NULL);
    reg_counter("ignored",
                "Messages of untrusted senders taken from the region and "
                "never delivered",
                &c->counters.ignored, NULL);
}

static int ivshmem_open(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    OBJ_CONSTRUCT(&c->lock, opal_mutex_t);
    OBJ_CONSTRUCT(&c->frags_eager, opal_free_list_t);
    OBJ_CONSTRUCT(&c->frags_max, opal_free_list_t);
    c->rx_des.des_segments = &c->rx_seg;
    c->rx_des.des_segment_count = 1;
    return OPAL_SUCCESS;
}

static int ivshmem_close(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    OBJ_DESTRUCT(&c->frags_eager);
    OBJ_DESTRUCT(&c->frags_max);
    OBJ_DESTRUCT(&c->lock);
    if (c->h) { /* init succeeded but finalize never ran */
        ivshm_detach(c->h);
        c->h = NULL;
    }
    free(c->rxbuf);
    c->rxbuf = NULL;
    mca_btl_ivshmem_stash_clear();
    mca_btl_ivshmem_free_slot_arrays();
    return OPAL_SUCCESS;
}

#define VERBOSE(lvl, ...)                                                     \
    opal_output_verbose((lvl), opal_btl_base_framework.framework_output,      \
                        __VA_ARGS__)

/* Fragment sizes from the geometry. A message goes through the
   receiver's queue (queue_slots cells) or, once the pair has one, a fast
   channel (ring_slots slots); try_send takes the cells of one message
   all at once, so `ring_capacity` is what the smaller of the two holds.
   Invariant afterwards: eager_limit <= max_send_size <= ring_capacity,
   so every fragment fits either path and ivshm_try_send never answers
   -EMSGSIZE. User-set values are kept but clamped to that. */
static int size_fragments(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    mca_btl_base_module_t *m = &mca_btl_ivshmem.super;
    const size_t payload = c->geom.slot_size - IVSHMEM_SLOT_HDR;
    uint32_t slots_max = c->geom.queue_slots;
    if (c->geom.fast_channels != IVSHM_FAST_NONE &&
        c->geom.ring_slots < slots_max)
        slots_max = c->geom.ring_slots;
    c->ring_capacity = (size_t)slots_max * payload;

    if (0 == m->btl_max_send_size) {
        /* ~32 KiB in whole slots (ob1 pipelines a few of them), but at
           most a quarter of the queue or channel so several are in
           flight at once */
        size_t slots = 32768 / payload;
        if (slots > slots_max / 4)
            slots = slots_max / 4;
        if (slots < 1)
            slots = 1;
        m->btl_max_send_size = slots * payload;
    }
    if (m->btl_max_send_size > c->ring_capacity)
        m->btl_max_send_size = c->ring_capacity;
    if (0 == m->btl_eager_limit) /* one slot: one cache-line hand-off */
        m->btl_eager_limit = payload >= 1024 ? payload : 4096;
    if (m->btl_eager_limit > m->btl_max_send_size)
        m->btl_eager_limit = m->btl_max_send_size;
    if (0 == m->btl_rndv_eager_limit ||
        m->btl_rndv_eager_limit > m->btl_max_send_size)
        m->btl_rndv_eager_limit = m->btl_max_send_size;
    /* ob1's largest header is well under 128 bytes */
    if (m->btl_eager_limit < 128)
        return OPAL_ERR_BAD_PARAM;
    return OPAL_SUCCESS;
}

static uint64_t random_nonce(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) != (ssize_t)sizeof v)
        v = mca_btl_ivshmem_now_ns() ^ ((uint64_t)getpid() << 32);
    return v;
}

/* Post our place in the region (or that we have none) so peers can tell
   a registry entry of ours from a same-named one of another job, and so
   their modex lookups of our key never have to wait for it. */
static void publish_modex(void)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    int rc;
    OPAL_MODEX_SEND(rc, OPAL_PMIX_GLOBAL, &c->super.btl_version, &c->my_modex,
                    sizeof c->my_modex);
    if (OPAL_SUCCESS != rc)
        VERBOSE(1, "btl_ivshmem: modex send failed (%d)", rc);
}

/* Through ivshmem-server every peer of the region sends us its eventfd:
   a region of hundreds of ranks needs more descriptors than the usual
   soft limit of 1024. Raised to the hard limit, which root or the admin
   set; libivshm skips (and counts) a peer's fd beyond it. */
static void raise_fd_limit(void)
{
    struct rlimit rl;
    if (0 == getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static const char *param_or_env(const char *param, const char *env)
{
    if (param && *param)
        return param;
    const char *v = getenv(env);
    return v && *v ? v : NULL;
}

/* Attach to the region as this rank: through the server, or to the
   region file. */
static int attach_region(mca_btl_ivshmem_component_t *c, const char *region,
                         const char *sock)
{
    c->job_id = mca_btl_ivshmem_job_id(OPAL_PROC_MY_NAME.jobid);
    c->vpid = OPAL_PROC_MY_NAME.vpid;
    snprintf(c->my_modex.name, sizeof c->my_modex.name, "ompi.%u.%012" PRIx64,
             c->vpid, random_nonce() & UINT64_C(0xffffffffffff));
    ivshm_config cfg = {
        .job_id = c->job_id,
        .rank = c->vpid,
        .name = c->my_modex.name,
        /* spinning happens in the progress loop, between other BTLs'
           progress: once we call ivshm_wait_message we mean to block */
        .spin_ns = 1,
        .uio_dev = c->uio_dev && *c->uio_dev ? c->uio_dev : NULL,
        .bar0_path = c->bar0_path && *c->bar0_path ? c->bar0_path : NULL,
        .doorbell_id = c->position >= 0 && c->position <= 0xffff
                           ? c->position : -1,
    };
    if (sock)
        raise_fd_limit();
    int rc = sock ? ivshm_attach_server(sock, &cfg, &c->h)
                  : ivshm_attach_path(region, &cfg, &c->h);
    /* A job of hundreds of ranks starting at once on a few cores can keep
       the server from handing out every peer's eventfds within one
       attach's deadline: a few more tries (before the modex fence, so
       nobody waits on us yet). */
    for (int tries = 1; sock && rc == -ETIMEDOUT && tries < ATTACH_TRIES;
         tries++) {
        VERBOSE(1, "btl_ivshmem: rank %u: attach to %s timed out, again",
                c->vpid, sock);
        rc = ivshm_attach_server(sock, &cfg, &c->h);
    }
    return rc;
}

static int init_frag_list(opal_free_list_t *list, size_t payload)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    return opal_free_list_init(list, sizeof(mca_btl_ivshmem_frag_t) + payload,
                               opal_cache_line_size,
                               OBJ_CLASS(mca_btl_ivshmem_frag_t), 0,
                               opal_cache_line_size, c->free_list_num,
                               c->free_list_max, c->free_list_inc, NULL, 0,
                               NULL, mca_btl_ivshmem_frag_init, list);
}

/* What an attached rank needs before it can send: the geometry and the
   fragment sizes from it (an unusable geometry is said on stderr), our
   own registry entry, the receive buffer, the per-slot arrays and the
   fragment lists. */
static int prepare_module(mca_btl_ivshmem_component_t *c, const char *what,
                          ivshm_peer_info *me)
{
    ivshm_get_geometry(c->h, &c->geom);
    c->self_slot = ivshm_self(c->h);
    /* Only the ranks we verified are heard on every path (trust, in
       btl_ivshmem_progress.c, lists them); anybody else only through
       our queue, where admission and the stash see their first
       messages: a stranger's fast ring is never read (docs/btl.md). */
    (void)ivshm_listen_only(c->h, IVSHM_LISTEN_OTHERS_QUEUED);
    if (ivshm_peer(c->h, c->self_slot, me) < 0 ||
        OPAL_SUCCESS != size_fragments()) {
        fprintf(stderr,
                "btl_ivshmem: rank %u: region %s has an unusable geometry "
                "(%u peers, %u slots of %u bytes); traffic falls back to the "
                "other BTLs\n",
                c->vpid, what, c->geom.max_peers, c->geom.ring_slots,
                c->geom.slot_size);
        return OPAL_ERR_BAD_PARAM;
    }
    mca_btl_base_module_t *m = &mca_btl_ivshmem.super;
    c->rxcap = c->ring_capacity;
    c->rxbuf = malloc(c->rxcap);
    if (!c->rxbuf || OPAL_SUCCESS != mca_btl_ivshmem_alloc_slot_arrays(c->geom.max_peers))
        return OPAL_ERR_OUT_OF_RESOURCE;
    int rc = init_frag_list(&c->frags_eager, m->btl_eager_limit);
    if (OPAL_SUCCESS == rc)
        rc = init_frag_list(&c->frags_max, m->btl_max_send_size);
    return rc;
}

/* The vpids that admit_sender may look up (0: it admits nobody, and
   ob1's add_procs alone builds the trusted set). */
static void read_job_size(mca_btl_ivshmem_component_t *c)
{
    opal_process_name_t wild = OPAL_PROC_MY_NAME;
    wild.vpid = OPAL_VPID_WILDCARD;
    uint32_t *job_size = &c->job_size;
    int rc;
    c->job_size = 0;
    OPAL_MODEX_RECV_VALUE_OPTIONAL(rc, OPAL_PMIX_JOB_SIZE, &wild, &job_size,
                                   OPAL_UINT32);
    if (OPAL_SUCCESS != rc)
        c->job_size = 0;
}

/* Attach, size, publish our place in the region (or that we have none:
   peers never wait for our modex entry). Any failure leaves traffic to
   the other BTLs. */
static mca_btl_base_module_t **ivshmem_init(int *num_btls,
                                            bool enable_progress_threads,
                                            bool enable_mpi_threads)
{
    mca_btl_ivshmem_component_t *c = &mca_btl_ivshmem_component;
    *num_btls = 0;
    (void)enable_progress_threads;
    (void)enable_mpi_threads;

    memset(&c->my_modex, 0, sizeof c->my_modex);
    const char *region = param_or_env(c->region_path, "IVSHM_REGION");
    const char *sock = param_or_env(c->socket_path, "IVSHM_SOCKET");
    if (!region && !sock) {
        VERBOSE(10, "btl_ivshmem: no region configured (btl_ivshmem_region, "
                    "btl_ivshmem_socket, IVSHM_REGION, IVSHM_SOCKET); disabled");
        publish_modex();
        return NULL;
    }
    const char *what = sock ? sock : region;
    int rc = attach_region(c, region, sock);
    if (rc < 0) {
        c->h = NULL;
        fprintf(stderr,
                "btl_ivshmem: rank %u cannot attach to %s %s: %s; traffic "
                "falls back to the other BTLs\n",
                c->vpid, sock ? "ivshmem-server" : "region", what,
                ivshm_strerror(rc));
        publish_modex();
        return NULL;
    }

    ivshm_peer_info me;
    mca_btl_base_module_t **btls = NULL;
    if (OPAL_SUCCESS != prepare_module(c, what, &me) ||
        !(btls = malloc(sizeof *btls))) {
        free(btls);
        free(c->rxbuf);
        c->rxbuf = NULL;
        mca_btl_ivshmem_free_slot_arrays();
        ivshm_detach(c->h);
        c->h = NULL;
        memset(&c->my_modex, 0, sizeof c->my_modex);
        publish_modex();
        return NULL;
    }
    read_job_size(c);
    c->my_modex.attached = 1;
    c->my_modex.slot = c->self_slot;
    c->my_modex.generation = me.generation;
    publish_modex();

    mca_btl_base_module_t *m = &mca_btl_ivshmem.super;
    c->block_ms = c->block_us < 0 ? 1 : (c->block_us + 999) / 1000;
    c->last_reap_ns = mca_btl_ivshmem_now_ns();
    VERBOSE(1,
            "btl_ivshmem: rank %u attached to %s as slot %d (%s); eager %zu, "
            "max send %zu, ring %zu bytes",
            c->vpid, what, c->self_slot, c->my_modex.name, m->btl_eager_limit,
            m->btl_max_send_size, c->ring_capacity);
    btls[0] = m;
    *num_btls = 1;
    return btls;
}

/*
 * Open MPI 4.1 BTL over libivshm: ranks attached to one shared-memory
 * region (QEMU ivshmem between co-resident VMs, or a host shm file)
 * exchange BTL fragments through libivshm (each rank's receive queue, fed
 * by every peer, plus fast per-pair channels for its busiest senders).
 *
 * Layout (one file per concern), from the bottom up: a file calls only
 * files listed before it (tests/test_native_layers.py; the state below,
 * in mca_btl_ivshmem_component and mca_btl_ivshmem, is read by all):
 *   btl_ivshmem.[ch]         types, the state, the clock, job ids, the
 *                            per-slot arrays
 *   btl_ivshmem_frag.[ch]    send fragments (descriptors) and queues
 *   btl_ivshmem_copy.c       a large payload into its slot: plain or
 *                            non-temporal stores, by how fast they are
 *   btl_ivshmem_peer.c       the modex check, a peer's failure
 *   btl_ivshmem_progress.c   receive, whose messages we deliver (trust,
 *                            admission, stash), retries, completions,
 *                            liveness, spin-then-block
 *   btl_ivshmem_send.c       alloc/free/prepare_src/send/sendi
 *   btl_ivshmem_module.c     add/del procs (reachability), finalize
 *   btl_ivshmem_component.c  MCA params, version check, attach, sizing
 *
 * Threading: libivshm wants one thread per handle at a time, so every
 * ivshm_* call runs under `lock` (a no-op unless MPI threads are on).
 * Upcalls into the PML are made without holding it, since they may send.
 */
#ifndef MCA_BTL_IVSHMEM_H
#define MCA_BTL_IVSHMEM_H

#include "opal_config.h"

#include "opal/class/opal_free_list.h"
#include "opal/mca/btl/btl.h"
#include "opal/mca/btl/base/base.h"
#include "opal/threads/mutex.h"
#include "opal/util/proc.h"

#include "ivshm.h"

BEGIN_C_DECLS

/* libivshm's slot header (see ivshm.h: a ring holds ring_slots *
   (slot_size - 32) payload bytes). */
#define IVSHMEM_SLOT_HDR 32u

/* ivshm message tags: 0..255 carry a BTL active-message tag unchanged;
   larger values are our own control messages. */
#define IVSHMEM_TAG_BYE 0x100u /* "I am finalizing": a clean leave */

/* Messages delivered per progress call, so other progress functions
   (tcp, pml) get their turn under a flood. */
#define IVSHMEM_RECV_BATCH 16

/* Contiguous payloads of this size or more are copied into their slot by
   btl_ivshmem_copy.c; smaller ones are packed by ob1's convertor (they
   are latency, not bandwidth). */
#define IVSHMEM_STREAM_MIN 8192u

/* After a look for a second message that found none, this many progress
   calls deliver one message each without looking (poll_region). */
#define IVSHMEM_LOOK_PAUSE 32

/* Housekeeping (reap, peer liveness) period. */
#define IVSHMEM_REAP_NS 100000000ull

/* Stash of not-yet-added connected jobs' messages: per slot and in all.
   Beyond it their messages are ignored (counted), so a co-tenant that
   poses as another Open MPI job costs bounded memory. */
#define IVSHMEM_STASH_PER_SLOT 256u
#define IVSHMEM_STASH_MAX_MSGS 4096u
#define IVSHMEM_STASH_MAX_BYTES (16u << 20)

/* Messages a housekeeping drain takes at most (looking for departed
   peers' goodbyes) */
#define IVSHMEM_DRAIN_BUDGET 4096u

/* How long sends to one peer may keep being refused with IVSHM_ECORRUPT
   (our ring's tail fails libivshm's checks: a co-tenant wrote it, and
   nothing was sent) before that peer is failed. The receiver puts back a
   tail it does not hold as soon as it finds its ring empty, and libivshm
   follows one that has stood 200 ms, so an honest pair is through well
   within this; a co-tenant that keeps scribbling gets a clean failure,
   not a hang. */
#define IVSHMEM_REFUSED_NS 2000000000ull

/* High half of our registry job ids ("OMPI"): keeps Open MPI ranks apart
   from other libivshm users of the region, which number jobs from 0. Only
   a naming convention: any co-tenant can write it into its own registry
   entry, so it never makes a sender trusted (see "Trust" below). */
#define IVSHMEM_JOB_TAG UINT64_C(0x4f4d5049)

struct mca_btl_ivshmem_frag_t;
struct ivshmem_stashed;

/* FIFO of fragments linked through frag->next (a frag is on at most one
   queue: an endpoint's pending queue or the completion queue). */
typedef struct ivshmem_frag_queue {
    struct mca_btl_ivshmem_frag_t *head, *tail;
    size_t count;
} ivshmem_frag_queue_t;

/* What a rank publishes in the modex: where it sits in the region.
   Peers accept (job, vpid) found in the registry only if slot,
   generation and the random name match: two jobs that happen to share
   an ORTE jobid can then never be confused. */
typedef struct ivshmem_modex {
    uint32_t attached; /* 0: this rank has no region (disqualified) */
    int32_t slot;
    uint32_t generation;
    uint32_t reserved;
    char name[32];
} ivshmem_modex_t;

struct mca_btl_base_endpoint_t {
    struct opal_proc_t *proc;
    uint64_t job_id;
    uint32_t vpid;
    int slot;                  /* registry slot of the peer               */
    uint32_t generation;       /* its claim generation (from the modex)   */
    ivshmem_frag_queue_t pending; /* sends waiting for ring space, FIFO   */
    /* prepare_src descriptor packed into the slot at our ring head, not
       yet sent: until then nothing else may write that ring */
    struct mca_btl_ivshmem_frag_t *in_ring;
    int send_error;            /* a queued send failed: report it         */
    uint64_t refused_since_ns; /* sends refused (forged tail) since, or 0  */
    /* btl_ivshmem_copy.c: large copies still to stream, plain ones made,
       timed plain ones in a row that were slow */
    uint32_t stream_left, plain_copies, slow_copies;
    bool said_bye;             /* peer finalized: its leave is not death  */
    bool deleted;              /* del_procs: no longer read or watched    */
    bool dead;                 /* reported; every send now fails          */
    bool on_pending_list;      /* in the component's pending_eps list     */
    /* the component's live endpoints (one per slot), or retired ones */
    struct mca_btl_base_endpoint_t *next;
    struct mca_btl_base_endpoint_t *next_pending; /* pending_eps link     */
};
typedef struct mca_btl_base_endpoint_t mca_btl_ivshmem_endpoint_t;

typedef struct mca_btl_ivshmem_module_t {
    mca_btl_base_module_t super;
    mca_btl_base_module_error_cb_fn_t error_cb;
} mca_btl_ivshmem_module_t;

typedef struct ivshmem_counters {
    uint64_t sent_msgs, sent_bytes, recv_msgs, recv_bytes;
    uint64_t dropped;  /* malformed, unregistered-tag or stale messages */
    uint64_t rejected; /* (slot, generation)s that claimed to be a rank of
                          our job but failed the modex check */
    uint64_t ignored;  /* messages of untrusted senders, never delivered */
    uint64_t refused;  /* sends refused for a forged ring tail, retried */
    uint64_t streamed; /* payloads copied with non-temporal stores */
} ivshmem_counters_t;

typedef struct mca_btl_ivshmem_component_t {
    mca_btl_base_component_3_0_0_t super;

    /* MCA parameters */
    char *region_path;
    char *socket_path;
    char *uio_dev;
    char *bar0_path;
    int position;      /* the guest's IVPosition, -1 unknown          */
    int verbose;
    int spin_us;       /* idle polling before blocking                 */
    int block_us;      /* one blocking slice; -1 auto, 0 never block   */
    int free_list_num, free_list_max, free_list_inc;
    int stream_copy;   /* large payloads: -1 by speed, 0 plain, 1 stream */

    /* attachment */
    ivshm *h;
    ivshm_geometry geom;
    uint64_t job_id;
    uint32_t vpid;
    int self_slot;
    ivshmem_modex_t my_modex;
    size_t ring_capacity; /* payload bytes one ring holds: max message */

    opal_mutex_t lock;
    opal_free_list_t frags_eager; /* eager_limit bytes each   */
    opal_free_list_t frags_max;   /* max_send_size bytes each */

    /* endpoints we created, at most one per registry slot: by_slot has
       geom.max_peers entries (allocated at init, like every per-slot
       array below); `endpoints` lists them, so nothing walks every slot */
    mca_btl_ivshmem_endpoint_t **by_slot;
    mca_btl_ivshmem_endpoint_t *endpoints;
    int num_endpoints;
    mca_btl_ivshmem_endpoint_t *retired; /* replaced, freed at finalize */
    mca_btl_ivshmem_endpoint_t *pending_eps; /* those with queued frags */
    bool mixed;        /* some peer is reached through another BTL */
    bool shares_cpu;   /* ranks of ours on this kernel share our CPUs  */
    bool spins_only;   /* told libivshm (and so the peers) we never block */
    uint64_t cpu_checked_ns;
    size_t num_pending;            /* frags on all pending queues */
    ivshmem_frag_queue_t complete; /* sent, callback still owed   */

    /* receive side: messages that span several slots are reassembled
       here (single-slot ones are delivered in place) */
    void *rxbuf;
    size_t rxcap;
    /* the descriptor of the message being handed to the PML, whose
       segment points at it: built once, since deliveries never overlap
       (one progress at a time, and it is not re-entered) */
    mca_btl_base_segment_t rx_seg;
    mca_btl_base_descriptor_t rx_des;
    /*
     * Trust. trusted[slot] = generation+1 of a sender whose messages we
     * deliver, 0 = none. Invariant: a slot is set only for a peer whose
     * modex (posted through Open MPI's runtime, out of the region's reach)
     * names exactly that slot, generation and random name, and whose
     * registry entry matched it: a proc handed to add_procs, or a rank of
     * our own job admitted when its first message arrives before ob1
     * adds it lazily (admit_sender). Cleared by del_procs, by the peer's
     * BYE, and when the slot's live generation is no longer the trusted
     * one. Progress takes every sender's messages from the region (one
     * receive queue per rank, libivshm validates them) but delivers a
     * message only if its sender is trusted and the slot still holds that
     * generation after the message was taken. active[] lists the trusted
     * slots, for the housekeeping that watches them.
     */
    uint64_t *trusted;
    int *active;
    int nactive;
    /* generation+1 of a registry entry that failed the modex check, so a
       co-tenant posing as one of our ranks costs one lookup, not one per
       message */
    uint64_t *rejected;
    /* messages of slots that claim another Open MPI job (a spawned or
       connected job whose add_procs has not run yet here), kept in
       arrival order until ob1 adds the sender; bounded per slot and in
       all (btl_ivshmem_progress.c) */
    struct ivshmem_stashed *stash_head, *stash_tail;
    uint32_t *stashed;         /* per slot: its messages in the stash */
    size_t stash_msgs, stash_bytes;
    bool stash_ready;          /* a stashed sender is trusted now */
    int *departed;             /* housekeeping scratch, max_peers entries */
    uint32_t job_size;         /* ranks in our job (0: unknown) */

    /* progress state */
    volatile int32_t in_progress;
    uint32_t idle_polls;
    uint32_t looks_paused; /* deliveries left before the next look (poll_region) */
    int fast_delivered;    /* ob1 upcalls of the fast path in this call  */
    uint32_t ticks;
    uint64_t idle_since_ns;
    uint64_t last_tick_ns;
    uint64_t last_reap_ns;
    int block_ms;      /* resolved from block_us; 0 = never */
    bool finalizing;

    ivshmem_counters_t counters;
    uint64_t sleeps_pvar;
} mca_btl_ivshmem_component_t;

OPAL_MODULE_DECLSPEC extern mca_btl_ivshmem_component_t mca_btl_ivshmem_component;
OPAL_MODULE_DECLSPEC extern mca_btl_ivshmem_module_t mca_btl_ivshmem;

/* btl_ivshmem.c */
uint64_t mca_btl_ivshmem_now_ns(void);
uint64_t mca_btl_ivshmem_job_id(uint32_t opal_jobid);
/* The per-slot arrays for a region of `n` slots / freed (NULL after). */
int mca_btl_ivshmem_alloc_slot_arrays(uint32_t n);
void mca_btl_ivshmem_free_slot_arrays(void);

/* copy */
/* Copy `n` bytes of a payload into a ring slot of `ep`'s peer, with
   plain or non-temporal stores (btl_ivshmem_copy.c). Without `lock`. */
void mca_btl_ivshmem_copy_to_slot(mca_btl_ivshmem_endpoint_t *ep, void *dst,
                                  const void *src, size_t n);

/* module */
int mca_btl_ivshmem_add_procs(struct mca_btl_base_module_t *btl, size_t nprocs,
                              struct opal_proc_t **procs,
                              struct mca_btl_base_endpoint_t **peers,
                              struct opal_bitmap_t *reachable);
int mca_btl_ivshmem_del_procs(struct mca_btl_base_module_t *btl, size_t nprocs,
                              struct opal_proc_t **procs,
                              struct mca_btl_base_endpoint_t **peers);
int mca_btl_ivshmem_finalize(struct mca_btl_base_module_t *btl);
int mca_btl_ivshmem_register_error(struct mca_btl_base_module_t *btl,
                                   mca_btl_base_module_error_cb_fn_t cbfunc);

/* peer */
/* Registry slot of the proc `name` in our region, or -1: the slot its
   modex names, if that slot holds it live with the same job, rank,
   generation and random name (*generation set); with `gone`, also one
   that left or died since. Without `lock`. */
int mca_btl_ivshmem_locate_name(opal_process_name_t name, uint32_t *generation,
                                bool gone);
/* The peer died without saying goodbye: tell the PML (fatal). */
void mca_btl_ivshmem_peer_failed(mca_btl_ivshmem_endpoint_t *ep, int err);

/* send */
mca_btl_base_descriptor_t *mca_btl_ivshmem_alloc(struct mca_btl_base_module_t *btl,
                                                 struct mca_btl_base_endpoint_t *ep,
                                                 uint8_t order, size_t size,
                                                 uint32_t flags);
int mca_btl_ivshmem_free(struct mca_btl_base_module_t *btl,
                         mca_btl_base_descriptor_t *des);
mca_btl_base_descriptor_t *mca_btl_ivshmem_prepare_src(
    struct mca_btl_base_module_t *btl, struct mca_btl_base_endpoint_t *ep,
    struct opal_convertor_t *convertor, uint8_t order, size_t reserve,
    size_t *size, uint32_t flags);
int mca_btl_ivshmem_send(struct mca_btl_base_module_t *btl,
                         struct mca_btl_base_endpoint_t *ep,
                         mca_btl_base_descriptor_t *des, mca_btl_base_tag_t tag);
int mca_btl_ivshmem_sendi(struct mca_btl_base_module_t *btl,
                          struct mca_btl_base_endpoint_t *ep,
                          struct opal_convertor_t *convertor, void *header,
                          size_t header_size, size_t payload_size,
                          uint8_t order, uint32_t flags, mca_btl_base_tag_t tag,
                          mca_btl_base_descriptor_t **descriptor);
/* Queue a fragment on `ep` (FIFO) and put ep on the pending list. With
   `lock`. */
void mca_btl_ivshmem_enqueue_pending(mca_btl_ivshmem_endpoint_t *ep,
                                     struct mca_btl_ivshmem_frag_t *f);

/* progress */
int mca_btl_ivshmem_component_progress(void);
/* Accept messages from `slot` (generation `gen`) / stop accepting. With
   `lock`. Callers must have checked the peer against its modex. */
void mca_btl_ivshmem_trust(int slot, uint32_t gen);
void mca_btl_ivshmem_distrust(int slot);
/* What to do with a message of an untrusted sender. */
enum ivshmem_untrusted {
    IVSHMEM_ADMITTED, /* a rank of our job, modex checked: now trusted */
    IVSHMEM_STASH,    /* claims another Open MPI job: keep until added */
    IVSHMEM_IGNORE,   /* anybody else, or failed the modex check      */
};
/* A message came from untrusted `slot` at generation `gen`: if the
   registry lists it as a rank of our own job and its modex matches (ob1
   adds remote peers lazily: one may write to us first), trust it. Each
   failing (slot, generation) is looked up once. Without `lock`. */
enum ivshmem_untrusted mca_btl_ivshmem_admit_sender(int slot, uint32_t gen);
/* Push an endpoint's pending frags into its ring while there is room
   (and no slot is reserved); called with `lock` held. Returns how many
   went out. */
int mca_btl_ivshmem_flush_pending(mca_btl_ivshmem_endpoint_t *ep);
/* Take up to `budget` messages from the region now (delivered or dropped
   by their sender's trust, as in progress): a departed peer's goodbye
   is found this way, and a peer blocked on our full queue gets room. */
int mca_btl_ivshmem_drain(uint32_t budget);
/* A send to `ep` failed with `rc`: true if it is to be queued and
   retried (IVSHM_ECORRUPT, a forged tail, for less than
   IVSHMEM_REFUSED_NS in a row), false if the peer is to be failed. With
   `lock`. */
bool mca_btl_ivshmem_send_refused(mca_btl_ivshmem_endpoint_t *ep, int rc);
/* Free what the stash holds (finalize). */
void mca_btl_ivshmem_stash_clear(void);

END_C_DECLS
#endif

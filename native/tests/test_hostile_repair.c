/* The honest races of two repairs, replayed by hand: an OPEN cell that
   arrives while the sweep looks at an orphaned channel, and a tail of
   the receiver's new incarnation over slots that say "full". */
#include "hostile.h"

/* ---- two honest races of the repairs, replayed by hand ---- */

/* The OPEN cell the sweep's hook puts back: the sender's OPEN arriving
   between the sweep's look at the queue and chan_orphaned's. */
static struct ivshm_cell *race_cell;
static uint64_t race_pos;

static void open_arrives(ivshm *h)
{
    atomic_store(&race_cell->seq, race_pos + 1);
    atomic_store(&h->my_qctrl->enqueue_pos, race_pos + 1);
}

static void test_repair_races(void)
{
    /* two slots: a's next incarnation takes a's (a claim prefers a slot
       claimed fewer times, registry.c) */
    ivshm_geometry g = {.max_peers = 2, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *r = tu_attach(path, job, 0, 0), *a = tu_attach(path, job, 1, 0);
    int sr = ivshm_self(r), sa = ivshm_self(a);
    char in[8];

    /* chan_orphaned adopts a live sender's channel only when its OPEN is
       not in the queue: a's OPEN and first message are out, and the OPEN
       cell is made to look free (lost) ... */
    CHECK_RC(ivshm_send(a, sr, 5, "open", 4), 0);
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(r, sr);
    race_pos = r->q_head;
    race_cell = ivshm_qcell(r, sr, race_pos);
    CHECK(atomic_load(&race_cell->seq) == race_pos + 1 &&
          (race_cell->flags & CELL_OPEN));
    atomic_store(&race_cell->seq, race_pos);
    atomic_store(&qc->enqueue_pos, race_pos);
    /* ... but shows up again after the sweep's first look at the queue
       (an honest OPEN still being enqueued): not adopted; the OPEN is
       taken as such, no IVSHM_ECORRUPT */
    ivshm_sweep_test_hook = open_arrives;
    ivshm_fast_sweep(r);
    ivshm_sweep_test_hook = NULL;
    CHECK(r->peers[sa].rx_chan < 0);
    uint32_t tag = 0;
    CHECK_RC(ivshm_recv(r, sa, NULL, &tag, in, sizeof in, 1000), 4);
    CHECK(tag == 5 && memcmp(in, "open", 4) == 0);
    CHECK(r->peers[sa].rx_chan >= 0);

    /* tail_ahead follows the consumer incarnation we know only: r leaves,
       its slot's next incarnation resets the ring, another sender fills
       it and the newcomer reads 5 messages. Its tail is past a's head
       over slots that say "full", but it is not a's consumer. */
    CHECK_RC(ivshm_send(r, sa, 0, "x", 1), 0); /* r -> a: a ring of a's */
    ivshm_detach(a);
    ivshm *a2 = tu_attach(path, job, 1, 0);
    CHECK(ivshm_self(a2) == sa);
    uint8_t *ring = r->peers[sa].tx_ring;
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    for (uint64_t pos = 0; pos < 5; pos++)
        atomic_store(&slot_at(r, ring, pos)->seq, pos + 1);
    atomic_store(&ctrl->tail, 5);
    uint64_t head = r->peers[sa].tx_head;
    CHECK(head == 1);
    CHECK_RC(ivshm_tx_reserve(r, sa, ctrl, g.ring_slots), IVSHM_EPEERDEAD);
    CHECK(r->peers[sa].tx_head == head);
    ivshm_detach(a2);
    ivshm_detach(r);
}

int main(void)
{
    hostile_setup();
    test_repair_races();
    return tu_summary("test_hostile_repair");
}

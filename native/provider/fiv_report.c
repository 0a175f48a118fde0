/*
 * The one report line per process (FI_IVSHM_REPORT): the endpoints that
 * count toward it, and the line printed at the last endpoint's close or
 * at exit/cleanup, whichever comes first.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fiv.h"

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fiv_ep **live_eps;
static size_t nlive, caplive;
static uint64_t done_sent, done_received, done_delegated, done_drained,
    done_switched, done_rejoined;
/* the phases of the first endpoint that had more than one */
static char done_phases[FIV_PHASES * 48];

/* " phases S/D,S/D,...": messages over the region / the core between
   drains and rejoins (docs/migration.md) */
static void phases_of(const struct fiv_ep *ep, char *out, size_t cap)
{
    size_t k = (size_t)snprintf(out, cap, " phases");
    uint64_t s0 = 0, d0 = 0;
    for (int i = 0; i <= ep->nphase && k < cap; i++) {
        uint64_t s = i < ep->nphase ? ep->phase_sent[i] : ep->sent;
        uint64_t d = i < ep->nphase ? ep->phase_deleg[i] : ep->delegated;
        k += (size_t)snprintf(out + k, cap - k, "%s%llu/%llu", i ? "," : " ",
                              (unsigned long long)(s - s0),
                              (unsigned long long)(d - d0));
        s0 = s;
        d0 = d;
    }
}
static bool any_ep, reported;
static pid_t owner; /* a forked child inherits our counters: not its line */

void fiv_register_ep(struct fiv_ep *ep)
{
    pthread_mutex_lock(&reg_lock);
    if (nlive == caplive) {
        size_t n = caplive ? 2 * caplive : 4;
        void *p = realloc(live_eps, n * sizeof *live_eps);
        if (!p) {
            pthread_mutex_unlock(&reg_lock);
            return;
        }
        live_eps = p;
        caplive = n;
    }
    live_eps[nlive++] = ep;
    any_ep = true;
    owner = getpid();
    pthread_mutex_unlock(&reg_lock);
}

static void print_report_locked(void)
{
    if (reported || !any_ep || !fiv_cfg.report || getpid() != owner)
        return;
    uint64_t s = done_sent, r = done_received, d = done_delegated,
             dr = done_drained, sw = done_switched, rj = done_rejoined;
    char ph[sizeof done_phases];
    snprintf(ph, sizeof ph, "%s", done_phases);
    for (size_t i = 0; i < nlive; i++) {
        if (!ph[0] && live_eps[i]->nphase)
            phases_of(live_eps[i], ph, sizeof ph);
        rj += live_eps[i]->rejoined;
        s += live_eps[i]->sent;
        r += live_eps[i]->received;
        d += live_eps[i]->delegated;
        dr += live_eps[i]->drained;
        sw += live_eps[i]->switched;
    }
    /* pairs moved to the core (docs/migration.md): only when there were */
    char moved[64 + sizeof ph] = "";
    if (dr || sw)
        snprintf(moved, sizeof moved, " drained %llu switched %llu rejoined "
                 "%llu%s", (unsigned long long)dr, (unsigned long long)sw,
                 (unsigned long long)rj, ph);
    fprintf(stderr, "fi_ivshm: pid %d sent %llu received %llu delegated %llu"
            "%s\n", (int)getpid(), (unsigned long long)s,
            (unsigned long long)r, (unsigned long long)d, moved);
    fflush(stderr);
    reported = true;
}

void fiv_unregister_ep(struct fiv_ep *ep)
{
    pthread_mutex_lock(&reg_lock);
    for (size_t i = 0; i < nlive; i++) {
        if (live_eps[i] == ep) {
            live_eps[i] = live_eps[--nlive];
            done_sent += ep->sent;
            done_received += ep->received;
            done_delegated += ep->delegated;
            done_drained += ep->drained;
            done_switched += ep->switched;
            done_rejoined += ep->rejoined;
            if (!done_phases[0] && ep->nphase)
                phases_of(ep, done_phases, sizeof done_phases);
            break;
        }
    }
    pthread_mutex_unlock(&reg_lock);
}

/* Called when an endpoint closes: the line is printed once the process
   has no endpoint left (an MPI closes its endpoints in finalize). */
void fiv_report(struct fiv_ep *ep)
{
    (void)ep;
    pthread_mutex_lock(&reg_lock);
    if (nlive == 0)
        print_report_locked();
    pthread_mutex_unlock(&reg_lock);
}

/* Processes that exit without closing (or whose MPI never calls
   fi_fini) still print their line. */
__attribute__((destructor)) static void fiv_report_at_exit(void)
{
    pthread_mutex_lock(&reg_lock);
    print_report_locked();
    pthread_mutex_unlock(&reg_lock);
}

void fiv_cleanup(void)
{
    pthread_mutex_lock(&reg_lock);
    print_report_locked();
    pthread_mutex_unlock(&reg_lock);
}

/* Slots: each job's pool of slots, two versions each (the SwitchML shadow copy), and rule 1 of
 * the state machine of docs/protocol.md ("Slots, pool versions and loss recovery"): a new
 * contribution is added into the slot version's 64-bit integer accumulators. */
#include <stdlib.h>

#include "nc8.h"
#include "state.h"

int nce_pool_alloc(struct nce_job *job)
{
    const size_t versions = 2 * (size_t)job->nslots;
    job->slots = calloc(versions, sizeof *job->slots);
    /* One arena each for the accumulators and the stored results of every slot version. */
    int64_t *acc = calloc(versions * job->k, sizeof *acc);
    uint8_t *res = calloc(versions * job->k, job->elem_size);
    if (job->slots == NULL || acc == NULL || res == NULL) {
        free(acc);
        free(res);
        free(job->slots);
        job->slots = NULL;
        return -1;
    }
    for (size_t i = 0; i < versions; i++) {
        job->slots[i].acc = acc + i * job->k;
        job->slots[i].result = res + i * job->k * job->elem_size;
    }
    return 0;
}

void nce_pool_free(struct nce_job *job)
{
    if (job->slots == NULL)
        return;
    free(job->slots[0].acc);
    free(job->slots[0].result);
    free(job->slots);
    job->slots = NULL;
}

int nce_contribute(struct nce_job *job, struct nce_slot *s, const struct nce_pkt *p,
                   unsigned version)
{
    const uint64_t bit = 1ULL << p->rank;
    if (s->bitmap == 0) {                       /* the first contribution starts the chunk */
        s->offset = p->offset;
        s->count = p->count;
        s->contributors = 0;
        s->complete = 0;
        nc8_codes_to_int(p->payload, s->acc, p->count);
    } else {
        nc8_accumulate(s->acc, p->payload, p->count);
    }
    s->bitmap |= bit;
    job->slots[2 * p->slot + (version ^ 1)].bitmap &= ~bit;    /* the shadow copy's bit */
    job->c.contributions++;
    /* Exactly the Nth: a contribution beyond it (a worker re-contributing after it moved on,
     * which the protocol rules out) is added but completes nothing, as in the reference. */
    return ++s->contributors == job->n;
}

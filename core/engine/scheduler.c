/* Continuous-batching scheduler (see scheduler.h for the policy). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "engine/scheduler.h"
#include "engine/sample.h"
#include "base/error.h"
#include "base/rng.h"

enum { SEQ_UNFORKED = 0, SEQ_WAITING = 1, SEQ_RUNNING = 2, SEQ_FINISHED = 3 };

typedef struct sched_req {
    mrl_sampling_params params;
    int32_t *eos, *stop;
    int n_eos, n_stop;
    int max_new;   /* effective: capped by max_model_len */
    int n;
    int first_seq; /* samples are seqs first_seq .. first_seq + n - 1 */
    int released;  /* mrl_sched_release: its outputs freed */
    int top;       /* top_logprobs kept per generated token */
    int adapter;   /* (mrl_sched_request.adapter, .kv_salt) */
    uint64_t salt;
} sched_req;

typedef struct sched_seq {
    int req, sample, state;
    int32_t *tokens; /* prompt then generated, capacity n_prompt + max_new */
    float *lp, *lpp; /* per generated token */
    int64_t *ver;    /* per generated token: the weights version that sampled it */
    int32_t *top_ids; /* [max_new, top] the most likely tokens at each generated position (req top > 0) */
    float *top_lp;
    int n_prompt, n_tokens, n_computed;
    int kv;          /* kv cache sequence or -1 */
    int group_n;     /* a group leader: itself and the group_n - 1 seqs after it */
    int pending;     /* of those, children not forked yet */
    int finish, stop_flag;
    uint64_t key;
    int32_t draft;   /* a draft of its next token to verify at the next step (-1: none) */
} sched_seq;

typedef struct step_entry {
    int seq, start, take, logits_row;
    int spec; /* its last token and its draft: two rows, two logits */
} step_entry;

struct mrl_sched {
    mrl_sched_config cfg;
    mrl_kv_cache *kv;
    sched_req *reqs;
    int n_reqs, reqs_cap;
    sched_seq *seqs;
    int n_seqs, seqs_cap;
    int *waiting, n_waiting, waiting_cap; /* FIFO, front at 0 */
    int *running, n_running, running_cap; /* admission order */
    int seat_count;                       /* running seqs + their unforked children */
    int n_unfinished;
    /* the planned step */
    int planned;
    step_entry *step;
    int n_step;
    mrl_sched_batch batch;
    int32_t *b_tokens, *b_pos, *b_seq, *b_slots, *b_qs, *b_lens, *b_tables, *b_logits;
    int32_t *b_req, *b_sample; /* per step sequence: its request and sample */
    int tables_cap, seq_arrays_cap, step_cap;
    mrl_sched_stats st;
    int64_t version; /* of the weights now: recorded with each token sampled */
    const mrl_kernels *k; /* the sample and top_logprobs ops' table (NULL: the fast CPU one) */
    /* speculative decoding (mrl_sched_set_mtp): the MTP layer's plan of the last update, its arrays */
    int mtp_on;
    mrl_sched_mtp mtp;
    int32_t *m_tokens, *m_pos, *m_slots, *m_src, *m_qs, *m_lens, *m_tables, *m_drow, *m_dseq;
    int m_rows_cap, m_seqs_cap, m_tables_cap;
    float *verify_row; /* [vocab]: a row with the draft masked (mrl_sample_verify) */
};

/* ---- small helpers ---- */

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static mrl_status oom(const char *what) { return mrl_set_error(MRL_ERR_NOMEM, "scheduler: out of memory (%s)", what); }

static int in_list(const int32_t *v, int n, int32_t t) {
    for (int i = 0; i < n; i++)
        if (v[i] == t) return 1;
    return 0;
}

static void list_remove(int *v, int *n, int x) {
    for (int i = 0; i < *n; i++)
        if (v[i] == x) {
            memmove(v + i, v + i + 1, (size_t)(*n - i - 1) * sizeof(int));
            (*n)--;
            return;
        }
}

static mrl_status waiting_push(mrl_sched *s, int seq, int front) {
    if (grow((void **)&s->waiting, &s->waiting_cap, s->n_waiting + 1, sizeof(int))) return oom("waiting queue");
    if (front) {
        memmove(s->waiting + 1, s->waiting, (size_t)s->n_waiting * sizeof(int));
        s->waiting[0] = seq;
    } else {
        s->waiting[s->n_waiting] = seq;
    }
    s->n_waiting++;
    return MRL_OK;
}

static mrl_status running_push(mrl_sched *s, int seq) {
    if (grow((void **)&s->running, &s->running_cap, s->n_running + 1, sizeof(int))) return oom("running list");
    s->running[s->n_running++] = seq;
    return MRL_OK;
}

/* ---- create / destroy ---- */

mrl_status mrl_sched_create(const mrl_sched_config *cfg, mrl_kv_cache *cache, mrl_sched **out) {
    if (!cfg || !cache || !out) return mrl_set_error(MRL_ERR_INVALID, "sched_create: NULL argument");
    *out = NULL;
    if (cfg->max_num_seqs < 1 || cfg->max_num_batched_tokens < 1 || cfg->max_model_len < 2 || cfg->vocab_size < 1)
        return mrl_set_error(MRL_ERR_INVALID,
                             "sched_create: bad config (max_num_seqs=%d max_num_batched_tokens=%d max_model_len=%d "
                             "vocab_size=%d)",
                             cfg->max_num_seqs, cfg->max_num_batched_tokens, cfg->max_model_len, cfg->vocab_size);
    mrl_sched *s = calloc(1, sizeof(*s));
    if (!s) return oom("scheduler");
    s->cfg = *cfg;
    s->kv = cache;
    int T = cfg->max_num_batched_tokens;
    s->b_tokens = malloc((size_t)T * sizeof(int32_t));
    s->b_pos = malloc((size_t)T * sizeof(int32_t));
    s->b_seq = malloc((size_t)T * sizeof(int32_t));
    s->b_slots = malloc((size_t)T * sizeof(int32_t));
    if (!s->b_tokens || !s->b_pos || !s->b_seq || !s->b_slots) {
        mrl_sched_destroy(s);
        return oom("batch buffers");
    }
    *out = s;
    return MRL_OK;
}

void mrl_sched_destroy(mrl_sched *s) {
    if (!s) return;
    for (int i = 0; i < s->n_reqs; i++) {
        free(s->reqs[i].eos);
        free(s->reqs[i].stop);
    }
    for (int i = 0; i < s->n_seqs; i++) {
        sched_seq *q = &s->seqs[i];
        if (q->kv >= 0) mrl_kv_cache_seq_free(s->kv, q->kv);
        free(q->tokens);
        free(q->lp);
        free(q->lpp);
        free(q->ver);
        free(q->top_ids);
        free(q->top_lp);
    }
    free(s->reqs);
    free(s->seqs);
    free(s->waiting);
    free(s->running);
    free(s->step);
    free(s->m_tokens), free(s->m_pos), free(s->m_slots), free(s->m_src), free(s->m_qs), free(s->m_lens);
    free(s->m_tables), free(s->m_drow), free(s->m_dseq), free(s->verify_row);
    free(s->b_tokens);
    free(s->b_pos);
    free(s->b_seq);
    free(s->b_slots);
    free(s->b_qs);
    free(s->b_lens);
    free(s->b_tables);
    free(s->b_logits);
    free(s->b_req);
    free(s->b_sample);
    free(s);
}

/* ---- requests ---- */

static int32_t *copy_ids(const int32_t *v, int n) {
    int32_t *c = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (c && n > 0) memcpy(c, v, (size_t)n * sizeof(int32_t));
    return c;
}

mrl_status mrl_sched_add(mrl_sched *s, const mrl_sched_request *r, int *req_id) {
    if (!s || !r || !req_id) return mrl_set_error(MRL_ERR_INVALID, "sched_add: NULL argument");
    if (r->prompt_len < 1 || !r->prompt || r->n < 1 || r->max_new_tokens < 1 || r->n_eos < 0 || r->n_stop < 0 ||
        (r->n_eos > 0 && !r->eos_ids) || (r->n_stop > 0 && !r->stop_ids))
        return mrl_set_error(MRL_ERR_INVALID, "sched_add: bad request (prompt_len=%d n=%d max_new_tokens=%d)",
                             r->prompt_len, r->n, r->max_new_tokens);
    if (r->prompt_len >= s->cfg.max_model_len)
        return mrl_set_error(MRL_ERR_INVALID, "sched_add: prompt of %d tokens leaves no room under max_model_len=%d",
                             r->prompt_len, s->cfg.max_model_len);
    for (int i = 0; i < r->prompt_len; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= s->cfg.vocab_size)
            return mrl_set_error(MRL_ERR_INVALID, "sched_add: prompt token %d at position %d is outside the vocabulary "
                                 "(%d)", r->prompt[i], i, s->cfg.vocab_size);
    mrl_status st = mrl_sampling_params_check(&r->params);
    if (st) return st;
    if (r->top_logprobs < 0 || r->top_logprobs > MRL_TOP_LOGPROBS_MAX || r->top_logprobs > s->cfg.vocab_size)
        return mrl_set_error(MRL_ERR_INVALID, "sched_add: top_logprobs = %d (0..%d, at most the vocabulary)",
                             r->top_logprobs, MRL_TOP_LOGPROBS_MAX);
    int max_new = r->max_new_tokens;
    if (max_new > s->cfg.max_model_len - r->prompt_len) max_new = s->cfg.max_model_len - r->prompt_len;
    int bs = mrl_kv_cache_block_size(s->kv);
    int64_t blocks = ((int64_t)r->prompt_len + max_new + bs - 1) / bs;
    if (blocks > mrl_kv_cache_num_blocks(s->kv))
        return mrl_set_error(MRL_ERR_INVALID,
                             "sched_add: a sequence of %d + %d tokens needs %lld blocks, the cache has %d in all",
                             r->prompt_len, max_new, (long long)blocks, mrl_kv_cache_num_blocks(s->kv));
    if (grow((void **)&s->reqs, &s->reqs_cap, s->n_reqs + 1, sizeof(sched_req)) ||
        grow((void **)&s->seqs, &s->seqs_cap, s->n_seqs + r->n, sizeof(sched_seq)))
        return oom("requests");
    sched_req *q = &s->reqs[s->n_reqs];
    memset(q, 0, sizeof(*q));
    q->params = r->params;
    q->eos = copy_ids(r->eos_ids, r->n_eos);
    q->stop = copy_ids(r->stop_ids, r->n_stop);
    q->n_eos = r->n_eos;
    q->n_stop = r->n_stop;
    q->max_new = max_new;
    q->n = r->n;
    q->first_seq = s->n_seqs;
    q->top = r->top_logprobs;
    q->adapter = r->adapter;
    q->salt = r->kv_salt;
    int fail = !q->eos || !q->stop;
    for (int j = 0; j < r->n; j++) {
        sched_seq *x = &s->seqs[s->n_seqs + j];
        memset(x, 0, sizeof(*x));
        x->req = s->n_reqs;
        x->sample = j;
        /* a group larger than max_num_seqs runs as several sub-groups */
        int leader = j % s->cfg.max_num_seqs == 0;
        x->state = leader ? SEQ_WAITING : SEQ_UNFORKED;
        x->kv = -1;
        x->draft = -1;
        x->n_prompt = r->prompt_len;
        x->group_n = leader ? (r->n - j < s->cfg.max_num_seqs ? r->n - j : s->cfg.max_num_seqs) : 1;
        x->pending = x->group_n - 1;
        x->key = mrl_sample_stream_key(r->seed, r->step, r->prompt_index, r->first_sample + j);
        x->tokens = malloc((size_t)(r->prompt_len + max_new) * sizeof(int32_t));
        x->lp = malloc((size_t)max_new * sizeof(float));
        x->lpp = malloc((size_t)max_new * sizeof(float));
        x->ver = malloc((size_t)max_new * sizeof(int64_t));
        fail |= !x->tokens || !x->lp || !x->lpp || !x->ver;
        if (q->top > 0) {
            x->top_ids = malloc((size_t)max_new * (size_t)q->top * sizeof(int32_t));
            x->top_lp = malloc((size_t)max_new * (size_t)q->top * sizeof(float));
            fail |= !x->top_ids || !x->top_lp;
        }
        if (x->tokens) memcpy(x->tokens, r->prompt, (size_t)r->prompt_len * sizeof(int32_t));
        x->n_tokens = leader ? r->prompt_len : 0;
    }
    for (int j = 0; !fail && j < r->n; j += s->cfg.max_num_seqs)
        if (waiting_push(s, s->n_seqs + j, 0)) fail = 1;
    if (fail) {
        /* leaders pushed before the failure: drop them */
        while (s->n_waiting > 0 && s->waiting[s->n_waiting - 1] >= s->n_seqs) s->n_waiting--;
        free(q->eos);
        free(q->stop);
        for (int j = 0; j < r->n; j++) {
            free(s->seqs[s->n_seqs + j].tokens);
            free(s->seqs[s->n_seqs + j].lp);
            free(s->seqs[s->n_seqs + j].lpp);
            free(s->seqs[s->n_seqs + j].ver);
        }
        return oom("request");
    }
    s->n_seqs += r->n;
    s->n_unfinished += r->n;
    *req_id = s->n_reqs++;
    return MRL_OK;
}

static sched_seq *find_seq(const mrl_sched *s, int req_id, int sample) {
    if (!s || req_id < 0 || req_id >= s->n_reqs || sample < 0 || sample >= s->reqs[req_id].n) return NULL;
    if (s->reqs[req_id].released) return NULL;
    return &s->seqs[s->reqs[req_id].first_seq + sample];
}

int mrl_sched_request_done(const mrl_sched *s, int req_id) {
    if (!s || req_id < 0 || req_id >= s->n_reqs) return -1;
    const sched_req *q = &s->reqs[req_id];
    for (int j = 0; j < q->n; j++)
        if (s->seqs[q->first_seq + j].state != SEQ_FINISHED) return 0;
    return 1;
}

mrl_status mrl_sched_release(mrl_sched *s, int req_id) {
    int done = mrl_sched_request_done(s, req_id);
    if (done < 0 || s->reqs[req_id].released)
        return mrl_set_error(MRL_ERR_INVALID, "sched_release: no request %d (or released already)", req_id);
    if (!done) return mrl_set_error(MRL_ERR_INVALID, "sched_release: request %d has samples not finished", req_id);
    sched_req *q = &s->reqs[req_id];
    for (int j = 0; j < q->n; j++) { /* finished: no blocks held, only the outputs */
        sched_seq *x = &s->seqs[q->first_seq + j];
        free(x->tokens);
        free(x->lp);
        free(x->lpp);
        free(x->ver);
        free(x->top_ids);
        free(x->top_lp);
        x->tokens = NULL;
        x->lp = x->lpp = NULL;
        x->ver = NULL;
        x->top_ids = NULL;
        x->top_lp = NULL;
    }
    q->released = 1;
    return MRL_OK;
}

mrl_status mrl_sched_stop(mrl_sched *s, int req_id, int sample) {
    sched_seq *x = find_seq(s, req_id, sample);
    if (!x) return mrl_set_error(MRL_ERR_INVALID, "sched_stop: no sample %d of request %d", sample, req_id);
    x->stop_flag = 1;
    return MRL_OK;
}

int mrl_sched_has_unfinished(const mrl_sched *s) { return s && s->n_unfinished > 0; }
int mrl_sched_num_unfinished(const mrl_sched *s) { return s ? s->n_unfinished : 0; }

/* ---- state changes ---- */

static void finish_seq(mrl_sched *s, int id, int reason) {
    sched_seq *x = &s->seqs[id];
    if (x->state == SEQ_RUNNING) {
        list_remove(s->running, &s->n_running, id);
        s->seat_count -= 1 + x->pending;
    } else if (x->state == SEQ_WAITING) {
        list_remove(s->waiting, &s->n_waiting, id);
    }
    if (x->kv >= 0) mrl_kv_cache_seq_free(s->kv, x->kv);
    x->kv = -1;
    x->state = SEQ_FINISHED;
    x->finish = reason;
    s->n_unfinished--;
    /* children never forked finish with their parent (with no tokens) */
    for (; x->pending > 0; x->pending--) {
        sched_seq *c = &s->seqs[id + x->group_n - x->pending];
        c->state = SEQ_FINISHED;
        c->finish = reason;
        s->n_unfinished--;
    }
}

/* Free a running sequence's blocks and put it back at the front of the queue. */
static mrl_status preempt(mrl_sched *s, int id) {
    sched_seq *x = &s->seqs[id];
    list_remove(s->running, &s->n_running, id);
    s->seat_count -= 1 + x->pending;
    mrl_kv_cache_seq_free(s->kv, x->kv);
    x->kv = -1;
    x->n_computed = 0;
    x->draft = -1;
    x->state = SEQ_WAITING;
    s->st.preemptions++;
    return waiting_push(s, id, 1);
}

/* ---- schedule ---- */

static mrl_status add_step(mrl_sched *s, int id, int take, int spec) {
    if (grow((void **)&s->step, &s->step_cap, s->n_step + 1, sizeof(step_entry))) return oom("step");
    sched_seq *x = &s->seqs[id];
    s->step[s->n_step++] = (step_entry){id, x->n_computed, take, -1, spec};
    return MRL_OK;
}

/* Give seq `take` more slots, writing them into the batch buffer at `at`. */
static mrl_status give_slots(mrl_sched *s, int id, int take, int at) {
    return mrl_kv_cache_append(s->kv, s->seqs[id].kv, take, s->b_slots + at);
}

static mrl_status build_batch(mrl_sched *s);

mrl_status mrl_sched_schedule(mrl_sched *s, const mrl_sched_batch **batch) {
    if (!s || !batch) return mrl_set_error(MRL_ERR_INVALID, "sched_schedule: NULL argument");
    if (s->planned) return mrl_set_error(MRL_ERR_INVALID, "sched_schedule: the previous step was not updated");
    mrl_status st;
    /* the caller's stop flags first */
    for (int i = 0; i < s->n_seqs; i++) {
        sched_seq *x = &s->seqs[i];
        if (x->stop_flag && (x->state == SEQ_RUNNING || x->state == SEQ_WAITING)) finish_seq(s, i, MRL_FINISH_CALLER);
    }
    s->n_step = 0;
    int budget = s->cfg.max_num_batched_tokens, used = 0, preempted = 0;
    /* 1. running sequences, oldest first */
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        int id = s->running[i];
        sched_seq *x = &s->seqs[id];
        int take = x->n_tokens - x->n_computed;
        int spec = take == 1 && x->draft >= 0 && budget >= 2; /* its draft too (the token after the last) */
        if (spec) take = 2, x->tokens[x->n_tokens] = x->draft;
        if (take > budget) take = budget;
        int self_preempted = 0;
        while (mrl_kv_cache_blocks_needed(s->kv, x->kv, take) > mrl_kv_cache_num_free(s->kv)) {
            int victim = s->running[s->n_running - 1];
            if ((st = preempt(s, victim))) return st;
            preempted = 1;
            if (victim == id) {
                self_preempted = 1;
                break;
            }
        }
        if (self_preempted) break;
        if ((st = give_slots(s, id, take, used)) || (st = add_step(s, id, take, spec))) return st;
        used += take;
        budget -= take;
    }
    /* 2. waiting requests, first come first served, unless we pre-empted */
    while (!preempted && budget > 0 && s->n_waiting > 0) {
        int id = s->waiting[0];
        sched_seq *x = &s->seqs[id];
        if (s->seat_count + 1 + x->pending > s->cfg.max_num_seqs) break;
        int bs = mrl_kv_cache_block_size(s->kv), cached = 0;
        if ((st = mrl_kv_cache_seq_new(s->kv, &x->kv))) return st;
        if (s->reqs[x->req].salt && (st = mrl_kv_cache_seq_salt(s->kv, x->kv, s->reqs[x->req].salt))) return st;
        /* keep at least one token to compute: its logits are needed */
        if ((st = mrl_kv_cache_match_prefix(s->kv, x->kv, x->tokens, x->n_tokens, (x->n_tokens - 1) / bs, &cached)))
            return st;
        x->n_computed = cached;
        int take = x->n_tokens - cached;
        if (take > budget) take = budget;
        if (mrl_kv_cache_blocks_needed(s->kv, x->kv, take) > mrl_kv_cache_num_free(s->kv)) {
            mrl_kv_cache_seq_free(s->kv, x->kv); /* wait for blocks */
            x->kv = -1;
            x->n_computed = 0;
            break;
        }
        s->st.prefix_hit_tokens += cached;
        memmove(s->waiting, s->waiting + 1, (size_t)(--s->n_waiting) * sizeof(int));
        x->state = SEQ_RUNNING;
        s->seat_count += 1 + x->pending;
        if ((st = running_push(s, id)) || (st = give_slots(s, id, take, used)) || (st = add_step(s, id, take, 0)))
            return st;
        used += take;
        budget -= take;
    }
    if ((st = build_batch(s))) return st;
    s->planned = 1;
    s->st.steps++;
    *batch = &s->batch;
    return MRL_OK;
}

static mrl_status build_batch(mrl_sched *s) {
    int n = s->n_step, max_blocks = 1;
    for (int i = 0; i < n; i++) {
        int nb = mrl_kv_cache_seq_blocks(s->kv, s->seqs[s->step[i].seq].kv, NULL);
        if (nb > max_blocks) max_blocks = nb;
    }
    if (grow((void **)&s->b_tables, &s->tables_cap, n * max_blocks, sizeof(int32_t))) return oom("block tables");
    /* per-sequence arrays, n + 1 entries (logits: two rows a sequence with a draft, 2n + 1 for all) */
    int cap = s->seq_arrays_cap;
    if (grow((void **)&s->b_qs, &cap, 2 * n + 1, sizeof(int32_t))) return oom("batch");
    cap = s->seq_arrays_cap;
    if (grow((void **)&s->b_lens, &cap, 2 * n + 1, sizeof(int32_t))) return oom("batch");
    cap = s->seq_arrays_cap;
    if (grow((void **)&s->b_logits, &cap, 2 * n + 1, sizeof(int32_t))) return oom("batch");
    cap = s->seq_arrays_cap;
    if (grow((void **)&s->b_req, &cap, 2 * n + 1, sizeof(int32_t))) return oom("batch");
    cap = s->seq_arrays_cap;
    if (grow((void **)&s->b_sample, &cap, 2 * n + 1, sizeof(int32_t))) return oom("batch");
    s->seq_arrays_cap = cap;
    memset(s->b_tables, 0, (size_t)n * max_blocks * sizeof(int32_t));
    int t = 0, n_logits = 0, n_prefill = 0, n_decode = 0;
    for (int i = 0; i < n; i++) {
        step_entry *e = &s->step[i];
        sched_seq *x = &s->seqs[e->seq];
        s->b_qs[i] = t;
        s->b_req[i] = x->req;
        s->b_sample[i] = x->sample;
        for (int j = 0; j < e->take; j++, t++) {
            int pos = e->start + j;
            s->b_tokens[t] = x->tokens[pos];
            s->b_pos[t] = pos;
            s->b_seq[t] = i;
            if (!e->spec && (pos < x->n_tokens - 1 || e->take > 1 || pos < x->n_prompt)) n_prefill++;
            else n_decode++;
        }
        s->b_lens[i] = e->start + e->take;
        const int32_t *table;
        int nb = mrl_kv_cache_seq_blocks(s->kv, x->kv, &table);
        memcpy(s->b_tables + (int64_t)i * max_blocks, table, (size_t)nb * sizeof(int32_t));
        if (e->spec) { /* the last token's row, then the draft's */
            e->logits_row = n_logits;
            s->b_logits[n_logits++] = t - 2;
            s->b_logits[n_logits++] = t - 1;
        } else if (e->start + e->take == x->n_tokens) {
            e->logits_row = n_logits;
            s->b_logits[n_logits++] = t - 1;
        }
    }
    s->b_qs[n] = t;
    mrl_sched_batch *b = &s->batch;
    b->n_tokens = t;
    b->n_seqs = n;
    b->token_ids = s->b_tokens;
    b->positions = s->b_pos;
    b->seq_index = s->b_seq;
    b->slot_mapping = s->b_slots;
    b->query_start = s->b_qs;
    b->seq_req = s->b_req;
    b->seq_sample = s->b_sample;
    b->seq_lens = s->b_lens;
    b->block_tables = s->b_tables;
    b->max_blocks_per_seq = max_blocks;
    b->n_logits = n_logits;
    b->logits_indices = s->b_logits;
    b->n_prefill_tokens = n_prefill;
    b->n_decode_tokens = n_decode;
    s->st.prefill_tokens += n_prefill;
    s->st.decode_tokens += n_decode;
    return MRL_OK;
}

/* ---- update ---- */

int mrl_sched_request_adapter(const mrl_sched *s, int req_id) {
    return s && req_id >= 0 && req_id < s->n_reqs ? s->reqs[req_id].adapter : 0;
}

/* Fork the unforked children of group parent `id` (after its prompt). */
static mrl_status fork_children(mrl_sched *s, int id) {
    sched_seq *x = &s->seqs[id];
    while (x->pending > 0) {
        int cid = id + x->group_n - x->pending;
        sched_seq *c = &s->seqs[cid];
        mrl_status st = mrl_kv_cache_fork(s->kv, x->kv, &c->kv);
        if (st) return st;
        memcpy(c->tokens, x->tokens, (size_t)x->n_tokens * sizeof(int32_t));
        c->n_tokens = x->n_tokens;
        c->n_computed = x->n_computed;
        c->state = SEQ_RUNNING;
        x->pending--; /* its seat moves from the parent to the child */
        if ((st = running_push(s, cid))) return st;
        s->st.forks++;
    }
    return MRL_OK;
}

/* The top_logprobs of the samples of this step whose request asked for them (top > 0), for
 * the position each one's token goes to next: one call of the op table's top_logprobs (the
 * whole vocabulary at the row's temperature, kernels.h) with the most any of them asked
 * for, each keeping its first `top` (best first: its own most likely tokens). */
static mrl_status step_top_logprobs(mrl_sched *s, const float *const *rows, const mrl_sampling_params *const *params,
                                    const int *who, int n, int V) {
    int m = 0, kmax = 0;
    for (int i = 0; i < n; i++) {
        int top = s->reqs[s->seqs[who[i]].req].top;
        m += top > 0;
        kmax = top > kmax ? top : kmax;
    }
    if (m == 0) return MRL_OK;
    const float **r = malloc(sizeof(*r) * m);
    const mrl_sampling_params **p = malloc(sizeof(*p) * m);
    int32_t *ids = malloc(sizeof(int32_t) * m * kmax);
    float *lps = malloc(sizeof(float) * m * kmax);
    mrl_status st = !r || !p || !ids || !lps ? oom("top_logprobs") : MRL_OK;
    for (int i = 0, j = 0; !st && i < n; i++)
        if (s->reqs[s->seqs[who[i]].req].top > 0) r[j] = rows[i], p[j++] = params[i];
    if (!st) st = (s->k ? s->k : mrl_kernels_cpu_fast())->top_logprobs(r, m, V, p, kmax, ids, lps);
    for (int i = 0, j = 0; !st && i < n; i++) {
        sched_seq *x = &s->seqs[who[i]];
        int top = s->reqs[x->req].top;
        if (top == 0) continue;
        int64_t at = (int64_t)(x->n_tokens - x->n_prompt) * top;
        memcpy(x->top_ids + at, ids + (int64_t)j * kmax, sizeof(int32_t) * top);
        memcpy(x->top_lp + at, lps + (int64_t)j++ * kmax, sizeof(float) * top);
    }
    free(r);
    free(p);
    free(ids);
    free(lps);
    return st;
}

/* Append token tok to sample id with its log-probs and apply the stop conditions. */
static void emit(mrl_sched *s, int id, int32_t tok, float lp, float lpp) {
    sched_seq *x = &s->seqs[id];
    sched_req *q = &s->reqs[x->req];
    int n_out = x->n_tokens - x->n_prompt;
    x->tokens[x->n_tokens++] = tok;
    x->lp[n_out] = lp;
    x->lpp[n_out] = lpp;
    x->ver[n_out] = s->version;
    s->st.generated_tokens++;
    if (in_list(q->eos, q->n_eos, tok)) finish_seq(s, id, MRL_FINISH_EOS);
    else if (in_list(q->stop, q->n_stop, tok)) finish_seq(s, id, MRL_FINISH_STOP);
    else if (n_out + 1 >= q->max_new) finish_seq(s, id, MRL_FINISH_LENGTH);
}

/* A step entry with a draft (rows: its last token's logits, the draft's): the draft verified
 * against the first row with the position's uniform (mrl_sample_verify), the token emitted; when
 * the draft stands, a token from the second row with the next position's uniform. Its K/V then
 * counts the last token's and the accepted draft's; a rejected draft's slot is given back. */
static mrl_status verify(mrl_sched *s, step_entry *e, const float *rows, int V) {
    sched_seq *x = &s->seqs[e->seq];
    sched_req *q = &s->reqs[x->req];
    int32_t d = x->draft, tok;
    float lp, lpp;
    int accepted = 0, n_out = x->n_tokens - x->n_prompt;
    x->draft = -1;
    if (!s->verify_row && !(s->verify_row = malloc(sizeof(float) * (size_t)V))) return oom("verification");
    mrl_status st = mrl_sample_verify(s->k, rows, V, &q->params, mrl_sample_uniform(x->key, n_out), d, s->verify_row,
                                      &tok, &lp, &lpp, &accepted);
    if (st) return st;
    s->st.spec_drafts++;
    s->st.spec_accepted += accepted;
    emit(s, e->seq, tok, lp, lpp);
    int computed = e->start + 1 + (accepted && x->state == SEQ_RUNNING);
    if (computed == e->start + 2) { /* the draft stood: a token from its row */
        int64_t ctr = n_out + 1;
        const float *row1 = rows + V;
        const mrl_sampling_params *pp = &q->params;
        st = mrl_sample_gather(s->k, &row1, 1, V, &pp, &x->key, &ctr, &tok, &lp, &lpp);
        if (st) return st;
        emit(s, e->seq, tok, lp, lpp);
    }
    x->n_computed = computed;
    if (x->kv < 0) return MRL_OK; /* (finished) */
    if ((st = mrl_kv_cache_truncate(s->kv, x->kv, computed))) return st;
    return mrl_kv_cache_commit(s->kv, x->kv, x->tokens, computed);
}

/* Whether sample x may take a draft of its next token: running with its last token to compute,
 * greedy or plain-temperature sampling (the rule's residual is then the model's own distribution
 * without the draft), no top_logprobs, room for the draft. */
static int draft_wanted(const mrl_sched *s, const sched_seq *x) {
    const sched_req *q = &s->reqs[x->req];
    const mrl_sampling_params *p = &q->params;
    int plain = p->temperature < 1e-5f || (p->top_k <= 0 && p->top_p >= 1 && p->min_p <= 0);
    return x->state == SEQ_RUNNING && x->kv >= 0 && plain && q->top == 0 && x->n_computed == x->n_tokens - 1 &&
           x->n_tokens - x->n_prompt < q->max_new;
}

/* The MTP layer's rows of this step (mrl_sched_mtp): each computed row whose next token is known. */
static mrl_status plan_mtp(mrl_sched *s) {
    int rows = 0, seqs = 0, max_blocks = 1;
    for (int i = 0; i < s->n_step; i++) {
        step_entry *e = &s->step[i];
        sched_seq *x = &s->seqs[e->seq];
        if (x->state != SEQ_RUNNING || x->kv < 0) continue;
        rows += e->take, seqs++;
        int nb = mrl_kv_cache_seq_blocks(s->kv, x->kv, NULL);
        if (nb > max_blocks) max_blocks = nb;
    }
    int cap = s->m_rows_cap;
    if (grow((void **)&s->m_tokens, &cap, rows + 1, sizeof(int32_t))) return oom("mtp");
    cap = s->m_rows_cap;
    if (grow((void **)&s->m_pos, &cap, rows + 1, sizeof(int32_t))) return oom("mtp");
    cap = s->m_rows_cap;
    if (grow((void **)&s->m_slots, &cap, rows + 1, sizeof(int32_t))) return oom("mtp");
    cap = s->m_rows_cap;
    if (grow((void **)&s->m_src, &cap, rows + 1, sizeof(int32_t))) return oom("mtp");
    s->m_rows_cap = cap;
    cap = s->m_seqs_cap;
    if (grow((void **)&s->m_qs, &cap, seqs + 1, sizeof(int32_t))) return oom("mtp");
    cap = s->m_seqs_cap;
    if (grow((void **)&s->m_lens, &cap, seqs + 1, sizeof(int32_t))) return oom("mtp");
    cap = s->m_seqs_cap;
    if (grow((void **)&s->m_drow, &cap, seqs + 1, sizeof(int32_t))) return oom("mtp");
    cap = s->m_seqs_cap;
    if (grow((void **)&s->m_dseq, &cap, seqs + 1, sizeof(int32_t))) return oom("mtp");
    s->m_seqs_cap = cap;
    if (grow((void **)&s->m_tables, &s->m_tables_cap, seqs * max_blocks + 1, sizeof(int32_t))) return oom("mtp");
    int t = 0, n = 0, nd = 0;
    for (int i = 0; i < s->n_step; i++) {
        step_entry *e = &s->step[i];
        sched_seq *x = &s->seqs[e->seq];
        if (x->state != SEQ_RUNNING || x->kv < 0) continue;
        int hi = e->start + e->take < x->n_computed ? e->start + e->take : x->n_computed, t0 = t;
        for (int p = e->start; p < hi && p + 1 < x->n_tokens; p++, t++) {
            int row = s->b_qs[i] + (p - e->start);
            s->m_tokens[t] = x->tokens[p + 1], s->m_pos[t] = p, s->m_slots[t] = s->b_slots[row], s->m_src[t] = row;
        }
        if (t == t0) continue;
        s->m_qs[n] = t0;
        s->m_lens[n] = s->m_pos[t - 1] + 1;
        const int32_t *table;
        int nb = mrl_kv_cache_seq_blocks(s->kv, x->kv, &table);
        memset(s->m_tables + (int64_t)n * max_blocks, 0, sizeof(int32_t) * (size_t)max_blocks);
        memcpy(s->m_tables + (int64_t)n * max_blocks, table, sizeof(int32_t) * (size_t)nb);
        n++;
        if (draft_wanted(s, x) && s->m_pos[t - 1] == x->n_tokens - 2) s->m_drow[nd] = t - 1, s->m_dseq[nd++] = e->seq;
    }
    s->m_qs[n] = t;
    mrl_sched_mtp *m = &s->mtp;
    memset(m, 0, sizeof *m);
    m->batch = (mrl_sched_batch){.n_tokens = t, .n_seqs = n, .token_ids = s->m_tokens, .positions = s->m_pos,
                                 .slot_mapping = s->m_slots, .query_start = s->m_qs, .seq_lens = s->m_lens,
                                 .block_tables = s->m_tables, .max_blocks_per_seq = max_blocks};
    m->src_rows = s->m_src;
    m->n_drafts = nd;
    m->draft_rows = s->m_drow;
    m->draft_seqs = s->m_dseq;
    return MRL_OK;
}

void mrl_sched_set_mtp(mrl_sched *s, int on) { s->mtp_on = on; }

const mrl_sched_mtp *mrl_sched_mtp_plan(const mrl_sched *s) { return s->mtp_on ? &s->mtp : NULL; }

void mrl_sched_set_draft(mrl_sched *s, int seq, int32_t token) {
    if (s && seq >= 0 && seq < s->n_seqs && token >= 0 && token < s->cfg.vocab_size) s->seqs[seq].draft = token;
}

mrl_status mrl_sched_update(mrl_sched *s, const float *logits) {
    if (!s) return mrl_set_error(MRL_ERR_INVALID, "sched_update: NULL scheduler");
    if (!s->planned) return mrl_set_error(MRL_ERR_INVALID, "sched_update: no step was scheduled");
    if (s->batch.n_logits > 0 && !logits) return mrl_set_error(MRL_ERR_INVALID, "sched_update: NULL logits");
    int V = s->cfg.vocab_size;
    mrl_status st = MRL_OK;
    /* K/V written: advance, register full blocks, fork groups whose prompt is done */
    int n_samples = 0;
    for (int i = 0; i < s->n_step; i++) {
        step_entry *e = &s->step[i];
        sched_seq *x = &s->seqs[e->seq];
        if (e->spec) continue; /* (its K/V counted once its draft is verified, below) */
        x->n_computed = e->start + e->take;
        if ((st = mrl_kv_cache_commit(s->kv, x->kv, x->tokens, x->n_computed))) break;
        if (e->logits_row >= 0) {
            if (x->pending > 0 && (st = fork_children(s, e->seq))) break;
            n_samples += x->n_tokens == x->n_prompt ? x->group_n : 1;
        }
    }
    /* who samples from which row */
    const float **rows = NULL;
    const mrl_sampling_params **params = NULL;
    uint64_t *keys = NULL;
    int64_t *ctr = NULL;
    int *who = NULL;
    int32_t *tok = NULL;
    float *lp = NULL, *lpp = NULL;
    if (!st && n_samples > 0) {
        rows = malloc(sizeof(*rows) * n_samples);
        params = malloc(sizeof(*params) * n_samples);
        keys = malloc(sizeof(*keys) * n_samples);
        ctr = malloc(sizeof(*ctr) * n_samples);
        who = malloc(sizeof(*who) * n_samples);
        tok = malloc(sizeof(*tok) * n_samples);
        lp = malloc(sizeof(*lp) * n_samples);
        lpp = malloc(sizeof(*lpp) * n_samples);
        if (!rows || !params || !keys || !ctr || !who || !tok || !lp || !lpp) st = oom("sampling");
    }
    int k = 0;
    for (int i = 0; !st && i < s->n_step; i++) {
        step_entry *e = &s->step[i];
        if (e->logits_row < 0 || e->spec) continue;
        sched_seq *x = &s->seqs[e->seq];
        sched_req *q = &s->reqs[x->req];
        /* a group leader's first token: the whole (just forked) group samples */
        int m = x->n_tokens == x->n_prompt ? x->group_n : 1;
        for (int j = 0; j < m; j++) {
            int id = e->seq + j;
            if (s->seqs[id].state != SEQ_RUNNING) continue;
            rows[k] = logits + (int64_t)e->logits_row * V;
            params[k] = &q->params;
            keys[k] = s->seqs[id].key;
            ctr[k] = s->seqs[id].n_tokens - s->seqs[id].n_prompt;
            who[k++] = id;
        }
    }
    if (!st && k > 0) st = mrl_sample_gather(s->k, rows, k, V, params, keys, ctr, tok, lp, lpp);
    if (!st && k > 0) st = step_top_logprobs(s, rows, params, who, k, V);
    for (int i = 0; !st && i < k; i++) emit(s, who[i], tok[i], lp[i], lpp[i]);
    for (int i = 0; !st && i < s->n_step; i++)
        if (s->step[i].spec) st = verify(s, &s->step[i], logits + (int64_t)s->step[i].logits_row * V, V);
    if (!st && s->mtp_on) st = plan_mtp(s);
    free(rows);
    free(params);
    free(keys);
    free(ctr);
    free(who);
    free(tok);
    free(lp);
    free(lpp);
    s->planned = 0;
    s->n_step = 0;
    return st;
}

/* ---- what the model needs per layer ---- */

mrl_status mrl_sched_attn_args(const mrl_sched_batch *b, mrl_kv_cache *kv, int layer, int Hq, const float *q,
                               float *out, mrl_paged_attn *args) {
    if (!b || !kv || !args) return mrl_set_error(MRL_ERR_INVALID, "sched_attn_args: NULL argument");
    const mrl_kv_cache_config *c = mrl_kv_cache_get_config(kv);
    if (layer < 0 || layer >= c->n_layers || Hq < c->n_kv_heads || Hq % c->n_kv_heads)
        return mrl_set_error(MRL_ERR_INVALID, "sched_attn_args: layer %d of %d, Hq=%d with %d kv heads", layer,
                             c->n_layers, Hq, c->n_kv_heads);
    *args = (mrl_paged_attn){.out = out, .q = q, .k_cache = mrl_kv_cache_k(kv, layer),
                             .v_cache = mrl_kv_cache_v(kv, layer), .block_tables = b->block_tables,
                             .seq_lens = b->seq_lens, .query_start = b->query_start, .n_seqs = b->n_seqs,
                             .max_blocks_per_seq = b->max_blocks_per_seq, .block_size = c->block_size, .Hq = Hq,
                             .Hk = c->n_kv_heads, .hd = c->head_dim, .scale = 1.0f / sqrtf((float)c->head_dim),
                             .kv_bf16 = c->bf16};
    return MRL_OK;
}

/* ---- outputs ---- */

mrl_status mrl_sched_output(const mrl_sched *s, int req_id, int sample, const int32_t **tokens,
                            const float **logprobs, const float **logprobs_processed, int *n, int *finish_reason) {
    sched_seq *x = find_seq(s, req_id, sample);
    if (!x) return mrl_set_error(MRL_ERR_INVALID, "sched_output: no sample %d of request %d", sample, req_id);
    int n_out = x->n_tokens > x->n_prompt ? x->n_tokens - x->n_prompt : 0;
    if (tokens) *tokens = x->tokens + x->n_prompt;
    if (logprobs) *logprobs = x->lp;
    if (logprobs_processed) *logprobs_processed = x->lpp;
    if (n) *n = n_out;
    if (finish_reason) *finish_reason = x->finish;
    return MRL_OK;
}

mrl_status mrl_sched_output_top(const mrl_sched *s, int req_id, int sample, const int32_t **ids, const float **lps,
                                int *top) {
    sched_seq *x = find_seq(s, req_id, sample);
    if (!x) return mrl_set_error(MRL_ERR_INVALID, "sched_output: no sample %d of request %d", sample, req_id);
    if (ids) *ids = x->top_ids;
    if (lps) *lps = x->top_lp;
    if (top) *top = s->reqs[x->req].top;
    return MRL_OK;
}

mrl_status mrl_sched_output_versions(const mrl_sched *s, int req_id, int sample, const int64_t **versions) {
    sched_seq *x = find_seq(s, req_id, sample);
    if (!x) return mrl_set_error(MRL_ERR_INVALID, "sched_output: no sample %d of request %d", sample, req_id);
    if (versions) *versions = x->ver;
    return MRL_OK;
}

void mrl_sched_set_version(mrl_sched *s, int64_t version) { s->version = version; }

void mrl_sched_set_kernels(mrl_sched *s, const mrl_kernels *k) { s->k = k; }

void mrl_sched_get_stats(const mrl_sched *s, mrl_sched_stats *out) {
    *out = s->st;
    out->running = s->n_running;
    out->waiting = s->n_waiting;
    out->finished = s->n_seqs - s->n_unfinished;
}

/* Sharded parameters (ZeRO-3, moonrl/model.h): the parameter buffer is a
 * region (core/base/mem.h) holding the rank's shard for the run and the
 * parts of the model in use, gathered into place by the caller's gather
 * functions (core/dist's mrl_dist_param_gather). Pointer arithmetic on the
 * parameters (views, layer tables) stays that of a whole buffer: only
 * memory is missing where nothing is in use. */
#include <string.h>
#include "base/error.h"
#include "base/mem.h"
#include "model_internal.h"

int mrl_model_shard(const mrl_model *m, int64_t *offset, int64_t *count) {
    if (!m || !m->p_region) return 0;
    if (offset) *offset = m->shard_off;
    if (count) *count = m->shard_count;
    return 1;
}

mrl_status mrl_model_set_param_gather(mrl_model *m, mrl_param_gather start, mrl_param_gather wait, void *ctx,
                                      int writer) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_param_gather: NULL model");
    if (!m->p_region) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_param_gather: the parameters are not sharded");
    if (!start != !wait) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_param_gather: start and wait go together");
    m->gather_start = start;
    m->gather_wait = wait;
    m->gather_ctx = ctx;
    m->shard_writer = writer != 0;
    return MRL_OK;
}

/* Bytes the regions hold beyond the shard's own pages: the parts gathered and their bf16 copies. */
static int64_t gathered(const mrl_model *m) {
    int64_t shard_pages = (4 * (m->shard_off + m->shard_count) + 4095) / 4096 - 4 * m->shard_off / 4096;
    return mrl_mem_region_resident(m->p_region) - 4096 * shard_pages + mrl_mem_region_resident(m->w16_region);
}

static void note_gathered(mrl_model *m) {
    int64_t g = gathered(m);
    if (g > m->gathered_peak) m->gathered_peak = g;
}

int64_t mrl_model_gathered_bytes(mrl_model *m, int64_t *peak) {
    if (!m || !m->p_region) {
        if (peak) *peak = 0;
        return 0;
    }
    int64_t now = gathered(m);
    if (peak) *peak = m->gathered_peak;
    m->gathered_peak = now; /* the next peak from here */
    return now;
}

/* pin [lo, hi) and start its gather */
static mrl_status begin(mrl_model *m, int64_t lo, int64_t hi) {
    mrl_status st = mrl_mem_region_pin(m->p_region, 4 * lo, 4 * hi);
    if (st) return mrl_wrap_error(st, "model: parameters [%lld, %lld) gathered into place", (long long)lo, (long long)hi);
    if ((st = m->gather_start(m->gather_ctx, m->params, lo, hi - lo))) mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
    return st;
}

mrl_status mrl_model_use(mrl_model *m, int64_t lo, int64_t hi, int64_t next_lo, int64_t next_hi) {
    if (!m->p_region || hi <= lo) return MRL_OK;
    if (!m->gather_start)
        return mrl_set_error(MRL_ERR_INVALID, "model: the parameters are sharded and nothing gathers them "
                             "(mrl_model_set_param_gather)");
    int ahead = m->ahead_hi > m->ahead_lo && m->ahead_lo == lo && m->ahead_hi == hi;
    mrl_status st = MRL_OK;
    if (!ahead && m->ahead_hi > m->ahead_lo) { /* started ahead for another use: finished and let go */
        st = m->gather_wait(m->gather_ctx, m->params, m->ahead_lo, m->ahead_hi - m->ahead_lo);
        mrl_mem_region_unpin(m->p_region, 4 * m->ahead_lo, 4 * m->ahead_hi);
    }
    m->ahead_lo = m->ahead_hi = 0;
    if (st) return st;
    if (!ahead && (st = begin(m, lo, hi))) return st;
    if (next_hi > next_lo) { /* the next part's gather while this one computes */
        if ((st = begin(m, next_lo, next_hi))) {
            mrl_status w = m->gather_wait(m->gather_ctx, m->params, lo, hi - lo);
            (void)w;
            mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
            return st;
        }
        m->ahead_lo = next_lo, m->ahead_hi = next_hi;
    }
    note_gathered(m);
    if ((st = m->gather_wait(m->gather_ctx, m->params, lo, hi - lo))) {
        mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
        return st;
    }
    if (m->w16_region) { /* the products read bf16 copies: of this part, made now */
        if ((st = mrl_mem_region_pin(m->w16_region, 2 * lo, 2 * hi))) {
            mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
            return mrl_wrap_error(st, "model: bf16 copies of parameters [%lld, %lld)", (long long)lo, (long long)hi);
        }
        mrl_model_bf16_convert_range(m, m->params, m->w16, lo, hi);
        note_gathered(m);
    }
    return MRL_OK;
}

void mrl_model_unuse(mrl_model *m, int64_t lo, int64_t hi) {
    if (!m->p_region || hi <= lo) return;
    mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
    if (m->w16_region) mrl_mem_region_unpin(m->w16_region, 2 * lo, 2 * hi);
}

mrl_status mrl_model_fetch(mrl_model *m, int64_t offset, int64_t count) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_fetch: NULL model");
    if (offset < 0 || count < 0 || offset + count > m->n_params)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_fetch: [%lld, %lld) outside the %lld parameters",
                             (long long)offset, (long long)(offset + count), (long long)m->n_params);
    return mrl_model_use(m, offset, offset + count, 0, 0);
}

void mrl_model_drop(mrl_model *m, int64_t offset, int64_t count) {
    if (m && offset >= 0 && count > 0 && offset + count <= m->n_params) mrl_model_unuse(m, offset, offset + count);
}

mrl_status mrl_model_shard_w16(mrl_model *m) {
    mrl_status st = mrl_mem_region_create(2 * m->n_params, MRL_MEM_PARAMS, &m->w16_region);
    if (st) return st;
    m->w16 = mrl_mem_region_base(m->w16_region);
    return MRL_OK;
}

/* The region in place of the parameter buffer, the shard pinned for the run. */
mrl_status mrl_model_alloc_shard(mrl_model *m, int64_t offset, int64_t count) {
    if (offset < 0 || count <= 0 || offset + count > m->n_params)
        return mrl_set_error(MRL_ERR_INVALID, "model: shard [%lld, %lld) of %lld parameters", (long long)offset,
                             (long long)(offset + count), (long long)m->n_params);
    mrl_status st = mrl_mem_region_create(4 * m->n_params, MRL_MEM_PARAMS, &m->p_region);
    if (!st) st = mrl_mem_region_pin(m->p_region, 4 * offset, 4 * (offset + count));
    if (st) return mrl_wrap_error(st, "model: this rank's %lld parameters", (long long)count);
    m->shard_off = offset;
    m->shard_count = count;
    return mrl_model_point_params(m, mrl_mem_region_base(m->p_region));
}

/* Background work on the loop's thread pool (moonrl/loop.h; C functions:
 * runtime/loop_internal.h): queued by the loop thread, run on a pool
 * thread, waited for on the job's lock and condition. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "runtime/loop_thread.h"
#include "moonrl/fs.h"
#include "base/error.h"

typedef struct write_file_arg {
    char *path;
    void *data;
    size_t bytes;
} write_file_arg;

struct mrl_job {
    uv_work_t work;
    mrl_job_fn fn;
    void *arg;
    write_file_arg *owned; /* freed with the job (mrl_job_write_file) */
    mrl_status status;
    char message[1024];
    uv_mutex_t lock;
    uv_cond_t cond;
    int done;
};

static void job_run(uv_work_t *work) {
    mrl_job *job = work->data;
    mrl_clear_error();
    job->status = job->fn(job->arg);
    snprintf(job->message, sizeof job->message, "%s", mrl_last_error());
}

static void job_finished(uv_work_t *work, int status) {
    mrl_job *job = work->data;
    if (status == UV_ECANCELED) {
        job->status = MRL_ERR_STOPPED;
        snprintf(job->message, sizeof job->message, "job cancelled");
    }
    uv_mutex_lock(&job->lock);
    job->done = 1;
    uv_cond_broadcast(&job->cond);
    uv_mutex_unlock(&job->lock);
}

void mrl_job_queue_on_loop(mrl_job *job) {
    job->work.data = job;
    int rc = uv_queue_work(mrl_uv_loop, &job->work, job_run, job_finished);
    if (rc != 0) {
        job->status = MRL_ERR_INTERNAL;
        snprintf(job->message, sizeof job->message, "cannot queue work: %s", uv_strerror(rc));
        job_finished(&job->work, 0);
    }
}

/* ---------------------------------------------------------------- API */

mrl_status mrl_job_submit(mrl_job_fn fn, void *arg, mrl_job **out) {
    *out = NULL;
    if (!fn) return mrl_set_error(MRL_ERR_INVALID, "job: no function");
    mrl_job *job = calloc(1, sizeof *job);
    if (!job) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    job->fn = fn;
    job->arg = arg;
    uv_mutex_init(&job->lock);
    uv_cond_init(&job->cond);
    mrl_status st = mrl_loop_post(CMD_JOB, job, 0);
    if (st != MRL_OK) {
        uv_mutex_destroy(&job->lock);
        uv_cond_destroy(&job->cond);
        free(job);
        return st;
    }
    *out = job;
    return MRL_OK;
}

static mrl_status write_file_job(void *varg) {
    write_file_arg *a = varg;
    return mrl_fs_write_file(a->path, a->data, a->bytes);
}

mrl_status mrl_job_write_file(const char *path, const void *data, size_t bytes, mrl_job **out) {
    *out = NULL;
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "write_file: empty path");
    write_file_arg *a = calloc(1, sizeof *a);
    if (!a) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    a->path = strdup(path);
    a->data = malloc(bytes ? bytes : 1);
    if (!a->path || !a->data) {
        free(a->path);
        free(a->data);
        free(a);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory copying %zu bytes for %s", bytes, path);
    }
    memcpy(a->data, data, bytes);
    a->bytes = bytes;
    mrl_status st = mrl_job_submit(write_file_job, a, out);
    if (st != MRL_OK) {
        free(a->path);
        free(a->data);
        free(a);
        return st;
    }
    (*out)->owned = a;
    return MRL_OK;
}

int mrl_job_done(mrl_job *job) {
    uv_mutex_lock(&job->lock);
    int done = job->done;
    uv_mutex_unlock(&job->lock);
    return done;
}

mrl_status mrl_job_wait(mrl_job *job) {
    uv_mutex_lock(&job->lock);
    while (!job->done) uv_cond_wait(&job->cond, &job->lock);
    uv_mutex_unlock(&job->lock);
    if (job->status != MRL_OK) mrl_set_error(job->status, "%s", job->message);
    return job->status;
}

void mrl_job_free(mrl_job *job) {
    if (!job) return;
    mrl_job_wait(job);
    if (job->owned) {
        free(job->owned->path);
        free(job->owned->data);
        free(job->owned);
    }
    uv_mutex_destroy(&job->lock);
    uv_cond_destroy(&job->cond);
    free(job);
}

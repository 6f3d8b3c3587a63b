/* Diagnostics that a run writes next to its metrics:
 *  - a timeline of phases in Chrome trace-event JSON (opens in Perfetto and
 *    chrome://tracing), one track per (rank, thread); where CUDA is built
 *    each begin/end pair is also an NVTX range (Nsight Systems);
 *  - TensorBoard event files with scalar summaries. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- Timeline ------------------------------------------------------------- */
/* Start recording (clears what was recorded); `rank` names the process track. */
void mrl_trace_enable(int rank);
void mrl_trace_disable(void);
/* A phase on the calling thread's track: begin/end pairs nest. Names are
 * copied. Cheap no-ops when recording is off. */
void mrl_trace_begin(const char *name);
void mrl_trace_end(const char *name);
/* A span already over, from start_s (mrl_time_now's clock) for dur_s seconds:
 * a "complete" event on the calling thread's track. For spans that overlap
 * rather than nest (the environment steps of concurrent episodes). */
void mrl_trace_complete(const char *name, double start_s, double dur_s);
/* A counter value at this instant (a separate counter track per name). */
void mrl_trace_counter(const char *name, double value);
/* Name the calling thread's track ("trainer", "engine", ...). */
void mrl_trace_thread_name(const char *name);
/* Events recorded so far. */
int64_t mrl_trace_event_count(void);
/* Write everything recorded as Chrome trace-event JSON, atomically: one
 * event per line, times in microseconds since mrl_trace_enable, and
 * "otherData": {"rank", "t0_unix_us"} (the wall clock then), by which the
 * traces of a job's ranks are merged onto one time axis. */
mrl_status mrl_trace_write(const char *path);
/* Also append every event to `path` as it is recorded (what was recorded
 * before first), one write(2) per event, in mrl_trace_write's format but
 * without its closing "]}": a process killed mid-run leaves its timeline up
 * to the kill (moonrl.train.trace.read_events recovers it, dropping a cut last
 * line). Needs recording on; ends at mrl_trace_disable or the next enable. A
 * write that fails later stops the stream with a warning, not the run. */
mrl_status mrl_trace_stream(const char *path);

/* --- TensorBoard ----------------------------------------------------------- */
typedef struct mrl_tb_writer mrl_tb_writer;

/* Create `dir` if needed and open a new event file in it
 * (events.out.tfevents.<time>.<host>.<pid>.<seq>). */
mrl_status mrl_tb_open(const char *dir, mrl_tb_writer **out);
/* Append a scalar summary (tag, value) at a step. */
mrl_status mrl_tb_scalar(mrl_tb_writer *w, const char *tag, double value, int64_t step);
/* Push buffered events to the file (each event is written whole). */
mrl_status mrl_tb_flush(mrl_tb_writer *w);
/* The path of the event file. */
const char *mrl_tb_path(mrl_tb_writer *w);
void mrl_tb_close(mrl_tb_writer *w);

#ifdef __cplusplus
}
#endif

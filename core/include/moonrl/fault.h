/* Fault injection, for the tests that prove recovery by causing the fault.
 * Off unless a caller turns it on (moonrl.train.fault reads MOONRL_FAULT). */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Kill this process with SIGKILL once `bytes` more bytes have been written
 * through the core's file writers (safetensors, atomic files: see
 * core/io/write.h); the write that crosses the budget is cut at the exact
 * byte. bytes < 0 turns it off. */
void mrl_fault_kill_after_bytes(int64_t bytes);
/* Bytes left before the kill (-1: off). */
int64_t mrl_fault_bytes_left(void);
/* Die at once as `kill -9` would: SIGKILL to this process. */
void mrl_fault_kill(void);
/* Send this process a signal (SIGTERM: a pre-emption, SIGINT: Ctrl-C) through
 * kill(2), as another process would; its handler runs as for a real one. */
void mrl_fault_signal(int signum);
/* Be busy for `seconds` (a slow step): sleep, ignoring signals and stops. */
void mrl_fault_busy(double seconds);
/* Crash the way a bug would: SIGSEGV, no clean-up. */
void mrl_fault_crash(void);
/* Hang inside C, away from every safe point (signals still run their
 * handlers, then the wait goes on). */
void mrl_fault_hang(void);
/* A slow generation engine (a straggling rollout worker): every engine step
 * of this process takes `seconds` more (0: off). */
void mrl_fault_slow_engine(double seconds);
/* The extra seconds of each engine step (0 when off). */
double mrl_fault_engine_delay(void);

#ifdef __cplusplus
}
#endif

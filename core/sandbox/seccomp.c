/* The sandbox's seccomp filter (sandbox_internal.h): classic BPF over struct seccomp_data,
 * built here (no libseccomp). Calls untrusted code never needs fail with EPERM (a program that
 * probes them sees an error, not a crash); clone3 fails with ENOSYS so that the C library falls
 * back to clone, whose flags a filter can read: clone with a namespace flag is refused. Another
 * architecture's calls (the x32 ABI on x86-64 included) kill the process. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include "sandbox_internal.h"

#if defined(__x86_64__)
#define SB_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SB_ARCH AUDIT_ARCH_AARCH64
#else
#error "the sandbox's seccomp filter knows x86-64 and aarch64"
#endif

static const int denied[] = {
    SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_kcmp,
    SYS_mount, SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_unshare, SYS_setns,
    SYS_open_by_handle_at, SYS_name_to_handle_at, SYS_fsopen, SYS_fsmount, SYS_fsconfig, SYS_fspick,
    SYS_move_mount, SYS_open_tree, SYS_mount_setattr,
    SYS_init_module, SYS_finit_module, SYS_delete_module, SYS_kexec_load, SYS_kexec_file_load, SYS_reboot,
    SYS_swapon, SYS_swapoff, SYS_acct, SYS_quotactl, SYS_syslog,
    SYS_keyctl, SYS_add_key, SYS_request_key, SYS_bpf, SYS_perf_event_open, SYS_userfaultfd,
    SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register, SYS_fanotify_init,
    SYS_settimeofday, SYS_clock_settime, SYS_clock_adjtime, SYS_adjtimex, SYS_sethostname, SYS_setdomainname,
    SYS_personality, SYS_lookup_dcookie, SYS_vhangup, SYS_pidfd_getfd,
#ifdef SYS_iopl
    SYS_iopl, SYS_ioperm,
#endif
#ifdef SYS_quotactl_fd
    SYS_quotactl_fd,
#endif
};

#define N_DENIED ((int)(sizeof denied / sizeof denied[0]))
#define STMT(code, k) ((struct sock_filter){(unsigned short)(code), 0, 0, (unsigned)(k)})
#define JUMP(code, k, jt, jf) ((struct sock_filter){(unsigned short)(code), (unsigned char)(jt), (unsigned char)(jf), (unsigned)(k)})
#define NS_FLAGS (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP)

int sb_seccomp_filter(struct sock_fprog *prog) {
    int cap = N_DENIED + 16, n = 0;
    struct sock_filter *f = calloc((size_t)cap, sizeof *f);
    if (!f) return -1;
    f[n++] = STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    f[n++] = JUMP(BPF_JMP | BPF_JEQ | BPF_K, SB_ARCH, 1, 0);
    f[n++] = STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    f[n++] = STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
    f[n++] = JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1); /* the x32 ABI */
    f[n++] = STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
#endif
    /* each denied call: a jump to the EPERM return, past the denied calls after it and the 6
     * instructions of clone3 and clone below */
    for (int i = 0; i < N_DENIED; i++)
        f[n++] = JUMP(BPF_JMP | BPF_JEQ | BPF_K, denied[i], (unsigned)(N_DENIED - i - 1 + 6), 0);
    /* clone3: ENOSYS (its flags are in memory the filter cannot read) */
    f[n++] = JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 0, 1);                          /* 1 */
    f[n++] = STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA));  /* 2 */
    /* clone: its flags (the first argument's low word) may not ask for a namespace */
    f[n++] = JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 2);                           /* 3 */
    f[n++] = STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]));   /* 4 */
    f[n++] = JUMP(BPF_JMP | BPF_JSET | BPF_K, NS_FLAGS, 1, 0);                          /* 5 */
    f[n++] = STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);                                  /* 6 */
    f[n++] = STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));    /* the EPERM return */
    prog->len = (unsigned short)n;
    prog->filter = f;
    return 0;
}

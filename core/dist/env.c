/* Where this process sits in the job (the launcher's environment), and
 * finding and loading the MPI plugin. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "dist_internal.h"
#include "base/error.h"

/* 1: set to a whole number in [lo, INT_MAX]; 0: unset or empty; -1: set to
 * something else (the caller says which variable). */
static int env_int(const char *name, int lo, int *out) {
    const char *s = getenv(name);
    if (!s || !*s) return 0;
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > INT_MAX) return -1;
    *out = (int)v;
    return 1;
}

static mrl_status bad_var(const char *name) {
    return mrl_set_error(MRL_ERR_INVALID, "dist: %s=%s is not a valid rank or count", name, getenv(name));
}

/* Tasks on node `node` from Slurm's compressed list, "2(x3),1" = 2,2,2,1;
 * 0 if the list does not say. */
static int slurm_tasks_on(const char *list, int node) {
    const char *p = list;
    while (p && *p) {
        char *end;
        long tasks = strtol(p, &end, 10), reps = 1;
        if (end == p || tasks < 1) return 0;
        p = end;
        if (*p == '(') {
            if (p[1] != 'x') return 0;
            reps = strtol(p + 2, &end, 10);
            if (end == p + 2 || *end != ')' || reps < 1) return 0;
            p = end + 1;
        }
        if (node < reps) return tasks > INT_MAX ? 0 : (int)tasks;
        node -= (int)reps;
        if (*p == ',') p++;
        else if (*p) return 0;
    }
    return 0;
}

mrl_status mrl_dist_env_detect(mrl_dist_env *e) {
    int rank = 0, size = 1, lrank = 0, lsize = 1, r;
    memset(e, 0, sizeof *e);
    if ((r = env_int("OMPI_COMM_WORLD_SIZE", 1, &size)) != 0) {
        /* mpirun (Open MPI, also under Slurm or PMIx: its own variables are the exact ones) */
        if (r < 0) return bad_var("OMPI_COMM_WORLD_SIZE");
        if (env_int("OMPI_COMM_WORLD_RANK", 0, &rank) <= 0) return bad_var("OMPI_COMM_WORLD_RANK");
        if (env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, &lrank) < 0) return bad_var("OMPI_COMM_WORLD_LOCAL_RANK");
        if (env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, &lsize) < 0) return bad_var("OMPI_COMM_WORLD_LOCAL_SIZE");
        if (!getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) lsize = size;
        e->launcher = "openmpi";
    } else if ((r = env_int("PMIX_RANK", 0, &rank)) != 0) {
        /* a PMIx launcher (prterun, srun --mpi=pmix): PMIx itself keeps the
         * size; Slurm's variables say it when it is Slurm, else MPI will */
        if (r < 0) return bad_var("PMIX_RANK");
        size = 0;
        lrank = 0;
        lsize = 0;
        if (env_int("SLURM_STEP_NUM_TASKS", 1, &size) < 0 || (size == 0 && env_int("SLURM_NTASKS", 1, &size) < 0))
            return bad_var("SLURM_NTASKS");
        if (env_int("SLURM_LOCALID", 0, &lrank) > 0) {
            int node = 0;
            const char *list = getenv("SLURM_STEP_TASKS_PER_NODE");
            if (!list) list = getenv("SLURM_TASKS_PER_NODE");
            if (env_int("SLURM_NODEID", 0, &node) > 0 && list) lsize = slurm_tasks_on(list, node);
            if (lsize == 0) lrank = 0; /* unknown: MPI will say */
        }
        e->launcher = "pmix";
    } else if (getenv("SLURM_PROCID") && (getenv("SLURM_STEP_NUM_TASKS") || getenv("SLURM_STEP_ID"))) {
        /* srun. A batch script also has SLURM_PROCID and SLURM_NTASKS (the
         * allocation's), but it is one process: only a step's tasks count. */
        if (env_int("SLURM_PROCID", 0, &rank) <= 0) return bad_var("SLURM_PROCID");
        if ((r = env_int("SLURM_STEP_NUM_TASKS", 1, &size)) < 0) return bad_var("SLURM_STEP_NUM_TASKS");
        if (r == 0 && env_int("SLURM_NTASKS", 1, &size) <= 0) return bad_var("SLURM_NTASKS");
        if (env_int("SLURM_LOCALID", 0, &lrank) < 0) return bad_var("SLURM_LOCALID");
        int node = 0, nodes = 0;
        const char *list = getenv("SLURM_STEP_TASKS_PER_NODE");
        if (!list) list = getenv("SLURM_TASKS_PER_NODE");
        lsize = 0;
        if (env_int("SLURM_NODEID", 0, &node) > 0 && list) lsize = slurm_tasks_on(list, node);
        if (lsize == 0 && env_int("SLURM_STEP_NUM_NODES", 1, &nodes) > 0 && nodes == 1) lsize = size;
        e->launcher = "slurm";
    } else {
        e->launcher = "none";
    }
    if (size > 0 && rank >= size)
        return mrl_set_error(MRL_ERR_INVALID, "dist: rank %d of a world of %d (from %s's environment)", rank, size,
                             e->launcher);
    if (lsize > 0 && lrank >= lsize) lsize = 0; /* inconsistent: ask MPI */
    e->rank = rank;
    e->size = size;
    e->local_rank = lsize > 0 ? lrank : 0;
    e->local_size = lsize;
    return MRL_OK;
}

/* ---------------------------------------------------------- the plugin */

static const char *launcher_name(const char *l) {
    if (!strcmp(l, "openmpi")) return "Open MPI's";
    if (!strcmp(l, "pmix")) return "PMIx's";
    if (!strcmp(l, "slurm")) return "Slurm's";
    return "the";
}

static mrl_status open_plugin(const char *path, const char *why, const mrl_dist_plugin **out) {
    /* RTLD_GLOBAL: Open MPI dlopens its components, which need libmpi's symbols */
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "dist: cannot load the MPI plugin %s (%s): %s", path, why,
                             dlerror());
    mrl_dist_plugin_entry entry;
    *(void **)&entry = dlsym(h, MRL_DIST_PLUGIN_ENTRY);
    const mrl_dist_plugin *be = entry ? entry() : NULL;
    if (!be || be->abi != MRL_DIST_PLUGIN_ABI || be->struct_size != (int)sizeof(mrl_dist_plugin)) {
        /* the handle stays open: closing a library that pulled in libmpi is not safe */
        return mrl_set_error(MRL_ERR_UNSUPPORTED,
                             "dist: %s is not a moonrl MPI plugin of this version (ABI %d wanted, it has %d): "
                             "rebuild it",
                             path, MRL_DIST_PLUGIN_ABI, be ? be->abi : -1);
    }
    *out = be;
    return MRL_OK;
}

mrl_status mrl_dist_load_plugin(const mrl_dist_env *env, const mrl_dist_plugin **out) {
    *out = NULL;
    const char *named = getenv("MOONRL_MPI_PLUGIN");
    if (named && *named) return open_plugin(named, "MOONRL_MPI_PLUGIN", out);
    /* next to libmoonrl.so: installed, both are in libdir; in a build tree,
     * both are in the build directory */
    char path[PATH_MAX + 32] = "";
    Dl_info info;
    if (dladdr((void *)mrl_dist_env_detect, &info) && info.dli_fname && strchr(info.dli_fname, '/')) {
        const char *slash = strrchr(info.dli_fname, '/');
        char dir[PATH_MAX], real[PATH_MAX];
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - info.dli_fname), info.dli_fname);
        /* (a build tree's rpath gives "tests/x/../..": say where that is) */
        snprintf(path, sizeof path, "%s/libmoonrl_mpi.so", realpath(dir, real) ? real : dir);
        if (access(path, F_OK) == 0) return open_plugin(path, "next to libmoonrl", out);
    }
    /* the library search path (LD_LIBRARY_PATH, the executable's rpath) */
    void *h = dlopen("libmoonrl_mpi.so", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!h) h = dlopen("libmoonrl_mpi.so", RTLD_NOW | RTLD_GLOBAL);
    if (h) return open_plugin("libmoonrl_mpi.so", "from the library search path", out);
    char size[32] = "unknown";
    if (env->size > 0) snprintf(size, sizeof size, "%d", env->size);
    return mrl_set_error(MRL_ERR_UNSUPPORTED,
                         "dist: world size %s from %s environment but moonrl was built without MPI (no %s): "
                         "install libopenmpi-dev and rebuild, or set MOONRL_MPI_PLUGIN to libmoonrl_mpi.so",
                         size, launcher_name(env->launcher), path[0] ? path : "libmoonrl_mpi.so");
}

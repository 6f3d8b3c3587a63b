/* The `moonrl` command: an embedded LuaJIT that runs recipes.
 *
 * C does only what Lua cannot do before it starts: initialise the runtime,
 * find moonrl's Lua library (MOONRL_HOME, then an installed tree next to the
 * executable, then the source tree it was built from), make the generated
 * FFI declarations and the embedded default example loadable, and hand the
 * command line to `moonrl.cli.main` (lua/moonrl/cli/main.lua), which does the rest. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include "moonrl/loop.h"
#include "moonrl/runtime.h"
#include "build_info.h"

/* the generated FFI declarations (tools/gen_ffi.py, compiled into libmoonrl) */
const char *mrl_ffi_cdef_lua(size_t *len);
extern const char mrl_default_example[];
extern const size_t mrl_default_example_size;

static int is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* The folder holding lua/, recipes/, plugins/ and examples/. */
static int find_home(char *out, size_t size) {
    const char *env = getenv("MOONRL_HOME");
    char probe[2 * PATH_MAX + 64];
    if (env && env[0]) {
        snprintf(probe, sizeof probe, "%s/lua/moonrl/cli/main.lua", env);
        if (!is_file(probe)) {
            fprintf(stderr, "moonrl: error: MOONRL_HOME=%s holds no lua/moonrl/cli/main.lua\n", env);
            return 0;
        }
        snprintf(out, size, "%s", env);
        return 1;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0; /* exe is now the folder of the executable: PREFIX/bin when installed */
            snprintf(probe, sizeof probe, "%s/../share/moonrl/lua/moonrl/cli/main.lua", exe);
            if (is_file(probe)) {
                snprintf(out, size, "%s/../share/moonrl", exe);
                return 1;
            }
        }
    }
    snprintf(probe, sizeof probe, "%s/lua/moonrl/cli/main.lua", MRL_SOURCE_DIR);
    if (is_file(probe)) {
        snprintf(out, size, "%s", MRL_SOURCE_DIR);
        return 1;
    }
    fprintf(stderr, "moonrl: error: cannot find moonrl's Lua library (looked in $MOONRL_HOME, "
                    "next to the executable and in %s); set MOONRL_HOME\n", MRL_SOURCE_DIR);
    return 0;
}

/* --- stacks on demand ------------------------------------------------------
 * A supervisor that finds the run hung sends SIGUSR1 before it kills it: the
 * main thread writes its C stack into $MOONRL_STACKS_FILE (open, write and
 * backtrace_symbols_fd need no allocation), and asks Lua, through a count
 * hook, for its traceback, which comes when the main thread next runs
 * interpreted Lua code. */
static pthread_t main_thread;
static lua_State *main_L;
static char stacks_file[PATH_MAX];

static void write_str(int fd, const char *s) {
    ssize_t k = write(fd, s, strlen(s));
    (void)k;
}

static void lua_stack_hook(lua_State *L, lua_Debug *ar) {
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    int fd = open(stacks_file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    luaL_traceback(L, L, "Lua stack of the main thread:", 0);
    write_str(fd, lua_tostring(L, -1));
    write_str(fd, "\n");
    lua_pop(L, 1);
    close(fd);
}

static void on_sigusr1(int signum) {
    if (!pthread_equal(pthread_self(), main_thread)) {
        pthread_kill(main_thread, signum); /* the main thread's stack is the one that matters */
        return;
    }
    int fd = open(stacks_file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        void *frames[64];
        int n = backtrace(frames, 64);
        write_str(fd, "C stack of the main thread:\n");
        backtrace_symbols_fd(frames, n, fd);
        close(fd);
    }
    if (main_L) lua_sethook(main_L, lua_stack_hook, LUA_MASKCOUNT, 1);
}

static void install_stack_dump(lua_State *L) {
    const char *path = getenv("MOONRL_STACKS_FILE");
    if (!path || !path[0] || strlen(path) >= sizeof stacks_file) return;
    snprintf(stacks_file, sizeof stacks_file, "%s", path);
    main_thread = pthread_self();
    main_L = L;
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc now, not inside the handler */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigusr1;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
}

static int load_embedded(lua_State *L, const char *code, size_t size, const char *name) {
    if (luaL_loadbuffer(L, code, size, name) != 0) {
        fprintf(stderr, "moonrl: internal error loading %s: %s\n", name, lua_tostring(L, -1));
        return 0;
    }
    return 1;
}

int main(int argc, char **argv) {
    if (mrl_init() != MRL_OK) {
        fprintf(stderr, "moonrl: error: %s\n", mrl_last_error());
        return 2;
    }
    char home[2 * PATH_MAX + 64];
    if (!find_home(home, sizeof home)) return 2;

    lua_State *L = luaL_newstate();
    if (!L) {
        fprintf(stderr, "moonrl: error: cannot create the Lua state (out of memory)\n");
        return 1;
    }
    luaL_openlibs(L);
    install_stack_dump(L);

    /* package.path: moonrl's library and plugins first, then the default */
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/lua/?.lua;%s/lua/?/init.lua;%s/plugins/?.lua;%s", home, home, home,
                    lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);

    /* package.preload for what is built into the binary */
    lua_getfield(L, -1, "preload");
    size_t cdef_len;
    const char *cdef = mrl_ffi_cdef_lua(&cdef_len);
    if (!load_embedded(L, cdef, cdef_len, "=moonrl.cdef")) return 1;
    lua_setfield(L, -2, "moonrl.cdef");
    if (!load_embedded(L, mrl_default_example, mrl_default_example_size, "@examples/default.lua")) return 1;
    lua_setfield(L, -2, "moonrl.default_example");
    lua_pop(L, 2);

    /* MOONRL_HOME as the Lua side sees it, and this executable (a supervisor starts it again) */
    lua_pushstring(L, home);
    lua_setglobal(L, "MOONRL_HOME");
    char exe[PATH_MAX];
    ssize_t exe_len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (exe_len > 0) {
        exe[exe_len] = 0;
        lua_pushstring(L, exe);
        lua_setglobal(L, "MOONRL_EXE");
    }

    /* run moonrl.cli.main.main(argv[1..]) and exit with what it returns */
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonrl.cli.main");
    if (lua_pcall(L, 1, 1, 0) != 0) {
        fprintf(stderr, "moonrl: error loading moonrl.cli.main: %s\n", lua_tostring(L, -1));
        return 1;
    }
    lua_getfield(L, -1, "main");
    lua_newtable(L);
    for (int i = 1; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i);
    }
    int code = 1;
    if (lua_pcall(L, 1, 1, 0) != 0) {
        fprintf(stderr, "moonrl: internal error: %s\n", lua_tostring(L, -1));
    } else {
        code = (int)lua_tointeger(L, -1);
    }
    fflush(stdout);
    lua_close(L);
    mrl_shutdown();
    return code;
}

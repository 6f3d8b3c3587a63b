/* The `moonrl` command: an embedded LuaJIT that runs recipes.
 *
 * C does only what Lua cannot do before it starts: initialise the runtime,
 * find moonrl's Lua library (MOONRL_HOME, then an installed tree next to the
 * executable, then the source tree it was built from), make the generated
 * FFI declarations and the embedded default example loadable, and hand the
 * command line to `moonrl.cli` (lua/moonrl/cli.lua), which does the rest. */
#include <limits.h>
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
        snprintf(probe, sizeof probe, "%s/lua/moonrl/cli.lua", env);
        if (!is_file(probe)) {
            fprintf(stderr, "moonrl: error: MOONRL_HOME=%s holds no lua/moonrl/cli.lua\n", env);
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
            snprintf(probe, sizeof probe, "%s/../share/moonrl/lua/moonrl/cli.lua", exe);
            if (is_file(probe)) {
                snprintf(out, size, "%s/../share/moonrl", exe);
                return 1;
            }
        }
    }
    snprintf(probe, sizeof probe, "%s/lua/moonrl/cli.lua", MRL_SOURCE_DIR);
    if (is_file(probe)) {
        snprintf(out, size, "%s", MRL_SOURCE_DIR);
        return 1;
    }
    fprintf(stderr, "moonrl: error: cannot find moonrl's Lua library (looked in $MOONRL_HOME, "
                    "next to the executable and in %s); set MOONRL_HOME\n", MRL_SOURCE_DIR);
    return 0;
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

    /* MOONRL_HOME as the Lua side sees it */
    lua_pushstring(L, home);
    lua_setglobal(L, "MOONRL_HOME");

    /* run moonrl.cli.main(argv[1..]) and exit with what it returns */
    lua_getglobal(L, "require");
    lua_pushstring(L, "moonrl.cli");
    if (lua_pcall(L, 1, 1, 0) != 0) {
        fprintf(stderr, "moonrl: error loading moonrl.cli: %s\n", lua_tostring(L, -1));
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

/* Internal helpers shared by the safetensors reader and writer. */
#pragma once

/* malloc'd copy of s; NULL when out of memory. */
char *mrl_st_strdup(const char *s);
/* malloc'd "dir/name"; NULL when out of memory. */
char *mrl_st_join(const char *dir, const char *name);

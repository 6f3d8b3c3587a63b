/* Loading and saving Hugging Face model directories (config.json +
 * safetensors). The safetensors reader/writer comes from the optim branch
 * (moonrl/safetensors.h); until it is merged these report
 * MRL_ERR_UNSUPPORTED after reading the config. */
#include <stdio.h>
#include "model_internal.h"

mrl_status mrl_model_load_dir(const char *dir, mrl_model **out) {
    if (!dir || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_dir: NULL argument");
    *out = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    mrl_model_config cfg;
    mrl_status st = mrl_model_config_load(path, &cfg);
    if (st) return st;
    return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: reading safetensors weights is not built in yet", dir);
}

mrl_status mrl_model_save_dir(mrl_model *m, const char *dir) {
    if (!m || !dir) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_save_dir: NULL argument");
    return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: writing safetensors is not built in yet", dir);
}

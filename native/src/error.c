#include "ivshm.h"

#include <string.h>

const char *ivshm_strerror(int err)
{
    switch (err) {
    case 0: return "success";
    case IVSHM_EMAGIC: return "not an ivshm region (bad magic, or never formatted)";
    case IVSHM_EVERSION: return "region layout version not supported";
    case IVSHM_ESIZE: return "region size or geometry is inconsistent";
    case IVSHM_ECORRUPT: return "shared state failed validation (corrupted region)";
    case IVSHM_EPEERDEAD: return "peer left or died";
    case IVSHM_EFULL: return "region is full (registry, window table or heap)";
    default: break;
    }
    if (err < 0 && err > -4096)
        return strerror(-err);
    return "unknown error";
}

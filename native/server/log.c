#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <syslog.h>

int ivs_log_target = IVS_LOG_STDERR;
int ivs_verbose;

static void vlog(int prio, const char *fmt, va_list ap)
{
    if (ivs_log_target == IVS_LOG_QUIET)
        return;
    if (ivs_log_target == IVS_LOG_SYSLOG) {
        vsyslog(prio, fmt, ap);
        return;
    }
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    fprintf(stderr, "ivshmem-server: %s\n", line);
}

void ivs_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(LOG_ERR, fmt, ap);
    va_end(ap);
}

void ivs_log_info(const char *fmt, ...)
{
    if (!ivs_verbose)
        return;
    va_list ap;
    va_start(ap, fmt);
    vlog(LOG_INFO, fmt, ap);
    va_end(ap);
}

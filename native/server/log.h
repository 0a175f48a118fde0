/*
 * The server's log: stderr in the foreground, syslog as a daemon,
 * nothing in the fuzzer. Every other file of the server logs through it.
 */
#ifndef IVS_LOG_H
#define IVS_LOG_H

/* Where log lines go: stderr (foreground), syslog (daemon), nowhere
   (the fuzzer). */
enum { IVS_LOG_STDERR = 0, IVS_LOG_SYSLOG = 1, IVS_LOG_QUIET = 2 };
extern int ivs_log_target;
extern int ivs_verbose;
/* Errors are always logged; info lines only with ivs_verbose. */
void ivs_log_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void ivs_log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif

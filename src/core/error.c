/* Errors: a thread-local message and status, set by tdm_raise where a failure is found. */
#include "core/core.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char err_msg[1024];
static _Thread_local tdm_status err_status = TDM_OK;

static void raise_v(tdm_status status, const char *fmt, va_list ap) {
    vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    err_status = status;
}

int tdm_raise(tdm_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    raise_v(status, fmt, ap);
    va_end(ap);
    return status;
}

void *tdm_raise_null(tdm_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    raise_v(status, fmt, ap);
    va_end(ap);
    return NULL;
}

const char *tdm_last_error(void) {
    return err_msg;
}

tdm_status tdm_last_status(void) {
    return err_status;
}

void tdm_clear_error(void) {
    err_msg[0] = '\0';
    err_status = TDM_OK;
}

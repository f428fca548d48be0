/* A slot for the table of functions a higher layer registers with a lower one
 * (docs/ARCHITECTURE.md, "Layers"): set once, later registrations ignored; read with one
 * atomic load, NULL until set. Private; a header of its own because core.h is also read by
 * the CUDA backend's C++, which cannot parse C11 atomics. */
#ifndef TDM_CORE_HOOK_H
#define TDM_CORE_HOOK_H

#include <stdatomic.h>
#include <stddef.h>

typedef const void *_Atomic tdm_hook;

static inline void tdm_hook_set(tdm_hook *hook, const void *table) {
    const void *none = NULL;
    atomic_compare_exchange_strong(hook, &none, table);
}

static inline const void *tdm_hook_get(tdm_hook *hook) {
    return atomic_load_explicit(hook, memory_order_acquire);
}

#endif

/* Which instructions the array conversions of tandem/half.h use: for tests, which run every
 * level this CPU has against the scalar one, and for reports of what a machine can do. */
#ifndef TDM_CORE_HALF_ISA_H
#define TDM_CORE_HALF_ISA_H

typedef enum {
    TDM_HALF_SCALAR = 0,      /* portable C (which the compiler may vectorise) */
    TDM_HALF_F16C = 1,        /* fp16 with vcvtps2ph / vcvtph2ps */
    TDM_HALF_AVX512_BF16 = 2, /* and bf16 with vcvtne2ps2bf16 */
} tdm_half_level;

/* The best level this CPU (and OS) supports. */
tdm_half_level tdm_half_level_supported(void);
/* Uses at most `cap` from now on, in every thread (the array functions read it on each
 * call); returns the level now in effect: the lower of cap and the supported one. */
tdm_half_level tdm_half_set_max_level(tdm_half_level cap);

#endif

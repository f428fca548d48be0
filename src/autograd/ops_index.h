/* The op helpers moved to autograd/ops.h (one header for every op). This name stays while
 * src/nn/gpt.c, which another change is moving out of nn/, still includes it; remove it once
 * nothing does. */
#ifndef TDM_OPS_INDEX_H
#define TDM_OPS_INDEX_H

#include "autograd/ops.h"

#endif

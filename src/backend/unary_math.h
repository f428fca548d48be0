/* What the CPU and CUDA element-wise kernels share about the unary ops, so that the two
 * backends compute the same function and save the same tensor for its derivative. */
#ifndef TDM_BACKEND_UNARY_MATH_H
#define TDM_BACKEND_UNARY_MATH_H

#include "backend/backend.h"

/* PyTorch's tanh-GELU constants: sqrt(2/pi) and the cubic coefficient. */
#define TDM_GELU_BETA  0.7978845608028654f
#define TDM_GELU_KAPPA 0.044715f

/* Which saved tensor an op's derivative reads: 'x' (the input), 'y' (the output) or 0 (neither).
 * Every op has its case and there is no default: a new op left out here is a -Wswitch warning
 * (an error in scripts/test's builds), not a backward that silently reads the wrong tensor.
 * '?' for a value outside the enum; the kernels refuse such an op before asking. */
static inline char tdm_unary_bwd_needs(tdm_unary_op op) {
    switch (op) {
    case TDM_UN_EXP:
    case TDM_UN_SQRT:
    case TDM_UN_TANH:
    case TDM_UN_SIGMOID:
        return 'y';
    case TDM_UN_LOG:
    case TDM_UN_RELU:
    case TDM_UN_GELU_TANH:
    case TDM_UN_GELU_ERF:
    case TDM_UN_POW_SCALAR:
    case TDM_UN_SOFTSIGN:
        return 'x';
    case TDM_UN_NEG:
    case TDM_UN_ADD_SCALAR:
    case TDM_UN_MUL_SCALAR:
        return 0;
    }
    return '?';
}

#endif

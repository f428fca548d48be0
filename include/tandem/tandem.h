/* Tandem: train neural networks on many devices from C. The umbrella header. */
#ifndef TANDEM_TANDEM_H
#define TANDEM_TANDEM_H

#include "tensor.h"
#include "runtime.h"
#include "half.h"
#include "autograd.h"
#include "autocast.h"
#include "nn.h"
#include "optim.h"
#include "data.h"
#include "transforms.h"
#include "parallel.h"
#include "pipeline.h"
#include "strategy.h"
#include "io.h"
#include "trace.h"
#include "tensorboard.h"
#include "gpt.h"
#include "models.h"

#endif

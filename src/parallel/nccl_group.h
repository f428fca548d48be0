/* The NCCL process group: ranks are GPUs, collectives run on each GPU's communication stream.
 *
 * Two ways to build one (each rank one GPU):
 *   - tdm_nccl_group_new: every rank of an existing group (threads from tdm_spawn, or MPI
 *     processes from tdm_mpi_init) calls it with its own GPU; rank 0 draws the NCCL unique id
 *     and the parent group broadcasts it (over MPI for MPI ranks), then each rank joins.
 *   - tdm_nccl_world_new: one thread creates the communicators of several GPUs of this
 *     process at once (ncclCommInitAll); the rank groups may then be used by other threads.
 * A collective is ordered after the work already queued on the rank's compute stream (an
 * event, no host wait) and runs on the communication stream, so DDP's bucket all-reduces
 * overlap the rest of backward. tdm_work_wait waits for that collective (polling its event,
 * so a dead peer ends in a timeout error instead of a hang) and then returns; kernels queued
 * afterwards see the result.
 *
 * Private (not installed): include/tandem/parallel.h should gain the public entry points. */
#ifndef TDM_PARALLEL_NCCL_GROUP_H
#define TDM_PARALLEL_NCCL_GROUP_H

#include "parallel/group.h"

/* Whether this build has the NCCL group (CMake found NCCL with the CUDA backend). */
bool tdm_nccl_available(void);
/* This rank's NCCL group on dev (a cuda:N device), with parent's rank and size; collective
 * over parent (every rank must call it). NULL and an error naming the cause otherwise. */
tdm_group *tdm_nccl_group_new(tdm_group *parent, tdm_device dev);
/* n ranks, rank r on devs[r] (all cuda:N, distinct), created together by the calling thread.
 * Writes the n groups to out. TDM_OK or an error. */
int tdm_nccl_world_new(int n, const tdm_device *devs, tdm_group **out);
/* Frees one rank's group (after its last collective was waited for). NULL is ignored. */
void tdm_nccl_group_free(tdm_group *g);

#endif

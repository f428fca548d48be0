/* The trainer's checkpoints: the directory held by this run alone, writing one (weights,
 * optimizer, data position, RNG, the epoch's totals summed over the processes, the options
 * that shape the run, the processes and devices that wrote it, the run's identity), --resume
 * from the newest after checking it is this run's (on any processes and devices: the data
 * position is global, and the global batch is an option of the run), and the same check
 * across the processes under mpirun. A sharded run writes a sharded checkpoint, each device
 * of each process its own shard file (save_shards). */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_state.h"

/* The processes of the run and this one's rank: MPI's, or 1 and 0. */
static int procs_of(const trainer *tr) {
    return tr->g ? tdm_group_size(tr->g) : 1;
}

static int rank_of(const trainer *tr) {
    return tr->g ? tdm_group_rank(tr->g) : 0;
}

/* Every process's v[0..n) into all[rank * n + i], exactly: the doubles travel as pairs of
 * 32-bit words. Without MPI, the one process's. what names the collective (messages, the
 * flight recorder). */
int trainer_gather_over_processes(trainer *tr, const double *v, int n, double *all,
                                  const char *what) {
    if (!tr->g) return memcpy(all, v, sizeof(double) * (size_t)n), 0;
    int procs = tdm_group_size(tr->g);
    int32_t mine[2 * TOTALS_CAP];
    if (n > TOTALS_CAP)
        return task_error("gathering over the processes: %d values (at most %d)", n, TOTALS_CAP);
    memcpy(mine, v, sizeof(double) * (size_t)n);
    tdm_tensor *in = tdm_from_data(TDM_SHAPE(2 * n), TDM_I32, tdm_cpu(0), mine);
    tdm_tensor *out = in ? tdm_zeros(TDM_SHAPE(2 * n * procs), TDM_I32, tdm_cpu(0)) : NULL;
    if (out) tdm_collective_label("the trainer's %s", what);
    int rc = out ? tdm_work_wait(tdm_all_gather(tr->g, out, in)) : tdm_last_status();
    if (!rc) rc = tdm_to_host(out, all, sizeof(double) * (size_t)n * (size_t)procs);
    tdm_tensor_free(in);
    tdm_tensor_free(out);
    return rc ? task_error("gathering over the processes: %s", tdm_last_error()) : 0;
}

/* Under MPI, v[0..n) summed over the processes in rank order, in double: every process gets
 * the same bits, and a count stays exact (a float sum was not past 2^24). */
int trainer_sum_over_processes(trainer *tr, double *v, int n, const char *what) {
    int procs = tdm_group_size(tr->g);
    double *all = malloc(sizeof(double) * (size_t)n * (size_t)procs);
    if (!all) return task_error("summing over the processes: out of memory");
    int rc = trainer_gather_over_processes(tr, v, n, all, what);
    for (int i = 0; !rc && i < n; i++) {
        v[i] = 0;
        for (int r = 0; r < procs; r++) v[i] += all[r * n + i];
    }
    free(all);
    return rc;
}

/* "loss correct samples;" for each process: a resumed process continues its own sums, so that
 * the epoch's totals come out bit for bit as the uninterrupted run's (a sum of sums, rounded
 * at other places, did not). Without MPI, the one process's. */
static int rank_totals(trainer *tr, const double *tot, char **out) {
    int procs = procs_of(tr);
    double *all = malloc(sizeof(double) * 3 * (size_t)procs);
    size_t cap = 80 * (size_t)procs + 1, len = 0;
    char *s = malloc(cap);
    int rc = all && s ? 0 : task_error("checkpoint: out of memory");
    if (!rc)
        rc = trainer_gather_over_processes(tr, tot, 3, all, "checkpoint's totals of each rank");
    for (int r = 0; !rc && r < procs; r++)
        len += (size_t)snprintf(s + len, cap - len, "%a %lld %lld;", all[3 * r],
                                (long long)all[3 * r + 1], (long long)all[3 * r + 2]);
    free(all);
    if (rc) free(s), s = NULL;
    *out = s;
    return rc;
}

/* The replicas of this process: DataParallel's devices, or 1 (each writes a shard file). */
static int local_replicas(const trainer *tr) {
    return tdm_strategy_replicas(tr->st);
}

/* After one step of a sharded save, whether every process did it: failed is this process's
 * (its error already reported); the others name the first process that failed and its first
 * file. Every process returns the same: 0, or EXIT_RUNTIME when any failed. */
static int all_succeeded(trainer *tr, bool failed, const char *what, int64_t step) {
    int procs = procs_of(tr), first = -1, n = 0, l = local_replicas(tr);
    double mine = failed, *all = malloc(sizeof(double) * (size_t)procs);
    if (!all || trainer_gather_over_processes(tr, &mine, 1, all, what))
        return free(all), EXIT_RUNTIME;
    for (int r = procs - 1; r >= 0; r--)
        if (all[r] != 0) first = r, n++;
    free(all);
    if (n == 0) return 0;
    if (!failed)
        task_error("checkpoint at step %lld: %d process%s failed (rank %d: %s "
                   "shard-%05d-of-%05d.safetensors); no checkpoint was written, the older ones "
                   "are as they were",
                   (long long)step, n, n == 1 ? "" : "es", first, what, first * l, procs * l);
    return EXIT_RUNTIME;
}

/* The state of replica l of this process (its model and optimizer) in a copy of s. */
static tdm_train_state replica_state(const trainer *tr, const tdm_train_state *s, int l) {
    tdm_train_state r = *s;
    r.model = tdm_strategy_replica(tr->st, l), r.optim = tdm_strategy_optim(tr->st, l);
    return r;
}

/* Every rank's range of the flat buffers into ranges (2 per rank: process p's replica l is
 * rank p * replicas + l, the two-level group's order). */
static int shard_ranges(trainer *tr, const tdm_train_state *s, int64_t *ranges) {
    int procs = procs_of(tr), l = local_replicas(tr), rc = TDM_OK;
    double *mine = malloc(sizeof(double) * 2 * (size_t)l);
    double *all = malloc(sizeof(double) * 2 * (size_t)(procs * l));
    if (!mine || !all) rc = TDM_ERR_NOMEM;
    for (int k = 0; k < l && !rc; k++) {
        int64_t lo = 0, hi = 0;
        rc = tdm_optim_shard_range(replica_state(tr, s, k).optim, &lo, &hi);
        mine[2 * k] = (double)lo, mine[2 * k + 1] = (double)hi; /* exact below 2^53 */
    }
    if (!rc) rc = trainer_gather_over_processes(tr, mine, 2 * l, all, "optimizer shards' ranges");
    for (int i = 0; !rc && i < 2 * procs * l; i++) ranges[i] = (int64_t)all[i];
    free(mine), free(all);
    return rc ? task_error("checkpoint: gathering the ranks' ranges failed") : 0;
}

/* This process's shard files: one per replica. */
static bool write_shards(trainer *tr, const tdm_train_state *s) {
    const char *dir = tr->o->checkpoint_dir;
    int rank = rank_of(tr), l = local_replicas(tr), world = procs_of(tr) * l;
    const char *fail = getenv("TANDEM_TEST_FAIL_SHARD_RANK"); /* tests: one process fails */
    if (fail && atoi(fail) == rank) {
        task_error("checkpoint: injected failure writing this rank's shard");
        return true;
    }
    for (int k = 0; k < l; k++) {
        tdm_train_state r = replica_state(tr, s, k);
        if (tdm_checkpoint_shard_write(dir, &r, rank * l + k, world) != TDM_OK) {
            task_error("checkpoint: %s", tdm_last_error());
            return true;
        }
    }
    return false;
}

/* A sharded run's save: each process writes the shard file of each of its replicas; when all
 * did, rank 0 the layout and training state, and renames the directory into place. Nothing
 * is gathered. Under mpirun every process takes part (collectives between the steps). */
static int save_shards(trainer *tr, const tdm_train_state *s) {
    const char *dir = tr->o->checkpoint_dir;
    int rank = rank_of(tr), world = procs_of(tr) * local_replicas(tr);
    int64_t *ranges = malloc(sizeof(int64_t) * 2 * (size_t)world);
    if (!ranges || shard_ranges(tr, s, ranges)) return free(ranges), EXIT_RUNTIME;
    bool failed = rank == 0 && tdm_checkpoint_shard_begin(dir, s) != TDM_OK;
    if (failed) task_error("checkpoint: %s", tdm_last_error());
    int rc = all_succeeded(tr, failed, "preparing the directory for", s->step);
    if (!rc) rc = all_succeeded(tr, write_shards(tr, s), "writing", s->step);
    if (!rc) {
        failed = rank == 0 &&
                 tdm_checkpoint_shard_finish(dir, s, ranges, world, (int)tr->o->keep) != TDM_OK;
        if (failed) task_error("checkpoint: %s", tdm_last_error());
        rc = all_succeeded(tr, failed, "finishing the checkpoint after", s->step);
    } else if (rank == 0)
        tdm_checkpoint_shard_abort(dir, s->step);
    free(ranges);
    return rc;
}

/* Whether the parameters are sharded (--shard parameters): the replicas hold their shards
 * (with tensor parallelism the checkpoint is gathered whole all the same). */
static bool params_sharded(const trainer *tr) {
    return tdm_strategy_shard(tr->st) == TDM_SHARD_PARAMETERS && !tdm_strategy_holds_parts(tr->st);
}

/* Writes a checkpoint of replica 0 (the replicas are identical) at the current step, with
 * the epoch's running totals (summed over the processes) so that a resumed epoch reports the
 * same loss and accuracy, and the task's own files of the model. A sharded run writes a
 * sharded checkpoint (every replica its shard). */
static int save_checkpoint(trainer *tr) {
    const train_opts *o = tr->o;
    double tot[3] = {tr->loss_sum, (double)tr->correct, (double)tr->samples};
    char *ranks = NULL;
    if (rank_totals(tr, tot, &ranks)) return EXIT_RUNTIME;
    if (tr->g && trainer_sum_over_processes(tr, tot, 3, "checkpoint's totals"))
        return free(ranks), EXIT_RUNTIME;
    tr->last_saved = tr->global_step;
    bool shards = tdm_strategy_state_split(tr->st);
    /* tensor parallelism: the parts made whole in the model and a whole optimizer (every
     * process takes part; process 0's are whole) */
    tdm_optim *whole = tdm_strategy_holds_parts(tr->st) ? tdm_strategy_optim_gather(tr->st) : NULL;
    if (tdm_strategy_holds_parts(tr->st) && !whole)
        return free(ranks), task_error("checkpoint: gathering the parts: %s", tdm_last_error());
    if (tr->silent && !shards) /* rank 0 writes; every rank loads */
        return tdm_optim_free(whole), free(ranks), 0;
    char loss[64], correct[32], samples[32];
    snprintf(loss, sizeof loss, "%a", tot[0]);
    snprintf(correct, sizeof correct, "%lld", (long long)tot[1]);
    snprintf(samples, sizeof samples, "%lld", (long long)tot[2]);
    char id[ID_CAP], layout[32];
    if (train_identity(o, id, sizeof id))
        return tdm_optim_free(whole), free(ranks), task_error("checkpoint: options too long");
    snprintf(layout, sizeof layout, "%dx%d", tr->g ? tdm_group_size(tr->g) : 1, o->n_devs);
    char scale[64] = "", tracker[32] = "";
    tdm_grad_scaler_state gs;
    bool scaled = !tdm_grad_scaler_get_state(tdm_strategy_grad_scaler(tr->st), &gs);
    if (scaled) snprintf(scale, sizeof scale, "%a", (double)gs.scale);
    if (scaled) snprintf(tracker, sizeof tracker, "%d", (int)gs.growth_tracker);
    /* the optional ones last, so that n_meta leaves out those a run has not */
    tdm_meta meta[10] = {{"epoch_loss_sum", loss},
                         {"epoch_correct", correct},
                         {"epoch_images", samples},
                         {"epoch_rank_totals", ranks},
                         {"run.options", id},
                         {"run.layout", layout},
                         {"amp.precision", o->precision},
                         {"class_to_idx", tr->task->class_to_idx},
                         {"amp.scale", scale},
                         {"amp.growth_tracker", tracker}};
    int n_meta = tr->task->class_to_idx ? 8 : 7;
    if (scaled && !tr->task->class_to_idx) meta[7] = meta[8], meta[8] = meta[9];
    if (scaled) n_meta += 2;
    tdm_train_state s = {.model = tr->task->model,
                         .optim = tr->opt,
                         .loader = tr->train_l,
                         .rng = tdm_default_rng(),
                         .step = tr->global_step,
                         .meta = meta,
                         .n_meta = n_meta,
                         .run_id = tr->run_id[0] ? tr->run_id : NULL};
    if (whole) s.optim = whole;
    int rc =
        shards ? save_shards(tr, &s) : tdm_checkpoint_save(o->checkpoint_dir, &s, (int)o->keep);
    tdm_optim_free(whole);
    free(ranks);
    if (shards && rc) return rc; /* reported */
    if (rc != TDM_OK) return task_error("checkpoint: %s", tdm_last_error());
    /* under --shard parameters rank 0 reads the task's files from the shards just written,
     * with no collective (every process decides alike) */
    if (!params_sharded(tr)) return trainer_save_task(tr, o->checkpoint_dir, NULL);
    if (tr->silent || !tr->task->save) return 0;
    char ckpt[4300];
    int64_t step = -1;
    if (tdm_checkpoint_latest(o->checkpoint_dir, ckpt, sizeof ckpt, &step) <= 0 ||
        step != tr->global_step)
        return task_error("checkpoint: step %lld's is not the newest in %s",
                          (long long)tr->global_step, o->checkpoint_dir);
    return trainer_save_task(tr, o->checkpoint_dir, ckpt);
}

/* Under --shard parameters, every parameter whole (whole) or sharded again: collectives. */
static int params_whole(trainer *tr, bool whole) {
    int rc = whole ? tdm_strategy_gather_params(tr->st) : tdm_strategy_release_params(tr->st);
    return rc ? task_error("%s the sharded parameters: %s", whole ? "gathering" : "resharding",
                           tdm_last_error())
              : 0;
}

int trainer_save_checkpoint(trainer *tr) {
    const train_opts *o = tr->o;
    if (!o->checkpoint_dir || tr->last_saved == tr->global_step) return 0;
    return save_checkpoint(tr);
}

int trainer_save_task(trainer *tr, const char *dir, const char *ckpt) {
    if (!tr->task->save) return 0;
    if (ckpt) return tr->silent ? 0 : tr->task->save(tr->task, tr->o, dir, ckpt);
    /* the end's: the trained weights into the model (a checkpoint's gathered them already) */
    if (!dir && tdm_strategy_sync_model(tr->st))
        return task_error("--save: gathering the trained weights: %s", tdm_last_error());
    int rc = params_whole(tr, true);
    if (rc) return rc;
    rc = tr->silent ? 0 : tr->task->save(tr->task, tr->o, dir, NULL);
    int rc2 = params_whole(tr, false);
    return rc ? rc : rc2;
}

/* One process's epoch totals read back, checked (a cross-entropy sum is finite and >= 0,
 * 0 <= correct <= samples <= max, the samples of the epoch's batches done) and kept. key and
 * v: the metadata the values came from, for the message. 0 or EXIT_RUNTIME. */
static int take_totals(trainer *tr, const char *path, const char *key, const char *v, double loss,
                       long long correct, long long samples, int64_t max) {
    if (!(isfinite(loss) && loss >= 0 && correct >= 0 && correct <= samples && samples <= max))
        return task_error("--resume from '%s': train_state.safetensors: user.%s '%.100s' is not "
                          "an epoch's totals (a finite loss sum >= 0, then 0 <= correct <= "
                          "samples <= %lld, the samples of the batches done)",
                          path, key, v, (long long)max);
    tr->resume_loss_sum = loss, tr->resume_correct = correct, tr->resume_samples = samples;
    return 0;
}

/* The epoch's totals of a checkpoint written before they were saved per process (or by
 * another number of processes): rank 0 takes the sums, the others start from 0. Each entry
 * is optional (older checkpoints); one present must be a number. */
static int resume_sums(trainer *tr, const char *path, int64_t max) {
    const char *keys[3] = {"epoch_loss_sum", "epoch_correct", "epoch_images"};
    char v[3][64] = {"0", "0", "0"}, all[200];
    double x[3] = {0};
    for (int i = 0; i < 3; i++) {
        int got = tdm_checkpoint_meta(path, keys[i], v[i], sizeof v[i]);
        char *end = NULL;
        x[i] = got == 1 ? strtod(v[i], &end) : 0;
        if (got < 0) return task_error("--resume from '%s': %s", path, tdm_last_error());
        if (got == 1 && (end == v[i] || *end || (i && x[i] != floor(x[i])) || fabs(x[i]) > 0x1p62))
            return task_error("--resume from '%s': train_state.safetensors: user.%s '%.40s' is "
                              "not %s",
                              path, keys[i], v[i], i ? "a count" : "a number");
    }
    snprintf(all, sizeof all, "%s %s %s", v[0], v[1], v[2]);
    return take_totals(tr, path, "epoch_loss_sum, user.epoch_correct, user.epoch_images", all, x[0],
                       (long long)x[1], (long long)x[2], max);
}

/* The epoch's totals saved with a checkpoint, max being the samples of the epoch's batches
 * done: each process continues its own when the checkpoint holds one per process of this
 * run, so that the totals come out bit for bit; otherwise (a checkpoint from before they were
 * saved, or another number of processes, whose shares of the epoch are other rows) rank 0
 * takes the sums over the saving processes and the others start from 0: the epoch's sum over
 * the processes, which the epoch line and the next checkpoint show, is right again (rounded
 * at other places than a run never resharded). 0 or EXIT_RUNTIME (values that are no
 * totals). */
static int resume_totals(trainer *tr, const char *path, int64_t max) {
    int rank = tr->g ? tdm_group_rank(tr->g) : 0, procs = tr->g ? tdm_group_size(tr->g) : 1;
    char *all = malloc(80 * (size_t)procs + 1);
    if (!all) return task_error("--resume: out of memory");
    int n = 0, got = tdm_checkpoint_meta(path, "epoch_rank_totals", all, 80 * (size_t)procs + 1);
    for (const char *p = all; got == 1 && (p = strchr(p, ';')) != NULL; p++) n++;
    if (got != 1 || n != procs) {
        free(all);
        return rank == 0 ? resume_sums(tr, path, max) : 0;
    }
    const char *mine = all;
    for (int r = 0; r < rank; r++) mine = strchr(mine, ';') + 1;
    double loss = NAN;
    long long correct = -1, samples = -1;
    int end = 0;
    sscanf(mine, "%la %lld %lld;%n", &loss, &correct, &samples, &end);
    int rc = take_totals(tr, path, "epoch_rank_totals", end ? mine : all, end ? loss : NAN, correct,
                         samples, max);
    free(all);
    return rc;
}

/* Whether the checkpoint at path was written by a run of these options (those that shape its
 * results: train_identity); a checkpoint from before they were recorded is taken as it is. */
static int same_run(const train_opts *o, const char *path) {
    char saved[ID_CAP], now[ID_CAP], diff[2048];
    int got = tdm_checkpoint_meta(path, "run.options", saved, sizeof saved);
    if (got < 0) return task_error("--resume from '%s': %s", path, tdm_last_error());
    if (got == 0 || train_identity(o, now, sizeof now)) return 0;
    if (!train_identity_diff(saved, now, "in the checkpoint", "now", diff, sizeof diff)) return 0;
    /* the global batch is what a resume on other devices or processes keeps */
    bool batch = strstr(diff, "--batch-size ") != NULL;
    return train_usage_error("--resume from '%s': the run was started with other options: %s. "
                             "Give the interrupted run's options again (--epochs, --max-steps, "
                             "--lr, --devices, the number of processes, --workers and the "
                             "outputs may change)%s",
                             path, diff,
                             batch ? "; --batch-size is the global batch, over every device and "
                                     "process: give the same on any number of them"
                                   : "");
}

/* How many processes wrote the checkpoint at path, from its per-process totals (up to 1024):
 * for a checkpoint from before "run.layout". 0 when it has none. */
static int processes_of_totals(const char *path) {
    size_t cap = 80 * 1024 + 1; /* rank_totals' 80 bytes each */
    char *totals = malloc(cap);
    int n = 0;
    if (totals && tdm_checkpoint_meta(path, "epoch_rank_totals", totals, cap) == 1)
        for (const char *c = totals; (c = strchr(c, ';')) != NULL; c++) n++;
    free(totals);
    return n;
}

/* The processes and devices per process that wrote the checkpoint at path ("run.layout",
 * "PxD"), and when they are not this run's, a note for the resume line (note_cap bytes). A
 * checkpoint from before the layout (and the loader's global position) was saved holds rank
 * 0's share of the data position, right only on as many processes as wrote it: another count
 * is refused, naming both, where its per-process totals tell the count. 0, EXIT_RUNTIME or
 * EXIT_USAGE. */
static int saved_layout(trainer *tr, const char *path, char *note, size_t note_cap) {
    int procs = tr->g ? tdm_group_size(tr->g) : 1, devs = tr->o->n_devs, p = 0, d = 0;
    char layout[32];
    note[0] = '\0';
    int got = tdm_checkpoint_meta(path, "run.layout", layout, sizeof layout);
    if (got < 0) return task_error("--resume from '%s': %s", path, tdm_last_error());
    int end = 0;
    if (got == 1 && (sscanf(layout, "%dx%d%n", &p, &d, &end) != 2 || layout[end] || p < 1 ||
                     d < 1 || d > TDM_MAX_DEVICES))
        return task_error("--resume from '%s': train_state.safetensors: user.run.layout '%s' is "
                          "not processes x devices per process (e.g. 2x4)",
                          path, layout);
    if (got == 1) {
        if (p != procs || d != devs)
            snprintf(note, note_cap, "; saved on %d process%s x %d device%s, now %d x %d", p,
                     p == 1 ? "" : "es", d, d == 1 ? "" : "s", procs, devs);
        return 0;
    }
    int n = processes_of_totals(path);
    if (n == 0 || n == procs) return 0;
    return train_usage_error("--resume from '%s': this checkpoint was written by %d process%s "
                             "before tandem saved the data position over every process; it "
                             "resumes only on %d (mpirun -np %d), not on %d",
                             path, n, n == 1 ? "" : "es", n, n, procs);
}

/* Under mpirun: every process must have been started with the same options (those that shape
 * the results, and --shard, which every process must take part in); each compares every
 * process's with rank 0's, so all stop with one message. */
int trainer_same_options_everywhere(trainer *tr) {
    int n = tdm_group_size(tr->g);
    char mine[PROCESS_ID_CAP] = "";
    if (train_process_identity(tr->o, mine, sizeof mine))
        return task_error("the options' values are longer than %d bytes in all", PROCESS_ID_CAP);
    /* rows 0 .. n-1 every rank's, row n this one's (characters as i32: no byte dtype) */
    int32_t *all = calloc((size_t)(n + 1) * PROCESS_ID_CAP, sizeof(int32_t));
    int32_t *one = all ? all + (size_t)n * PROCESS_ID_CAP : NULL;
    for (int i = 0; one && mine[i]; i++) one[i] = (unsigned char)mine[i];
    tdm_tensor *in =
        all ? tdm_from_data(TDM_SHAPE(PROCESS_ID_CAP), TDM_I32, tdm_cpu(0), one) : NULL;
    tdm_tensor *out =
        in ? tdm_zeros(TDM_SHAPE((int64_t)n * PROCESS_ID_CAP), TDM_I32, tdm_cpu(0)) : NULL;
    if (out) tdm_collective_label("the trainer's options check");
    int rc = out ? tdm_work_wait(tdm_all_gather(tr->g, out, in)) : tdm_last_status();
    if (!rc) rc = tdm_to_host(out, all, sizeof(int32_t) * (size_t)n * PROCESS_ID_CAP);
    tdm_tensor_free(in);
    tdm_tensor_free(out);
    char first[PROCESS_ID_CAP], other[PROCESS_ID_CAP], diff[4096], a[32], b[32];
    for (int r = 0; !rc && r < n; r++) {
        char *id = r ? other : first;
        for (int i = 0; i < PROCESS_ID_CAP; i++) id[i] = (char)all[(size_t)r * PROCESS_ID_CAP + i];
        id[PROCESS_ID_CAP - 1] = '\0';
        snprintf(a, sizeof a, "on rank 0"), snprintf(b, sizeof b, "on rank %d", r);
        if (r && train_identity_diff(first, other, a, b, diff, sizeof diff)) rc = 1;
    }
    free(all);
    if (rc < 0) return task_error("comparing the processes' options: %s", tdm_last_error());
    return rc ? train_usage_error("the processes were started with different options: %s", diff)
              : 0;
}

/* A fresh run into a directory holding checkpoints: refused (EXIT_USAGE) with what is there and
 * the two ways on, or with --overwrite those checkpoints deleted. */
static int fresh_start(const train_opts *o) {
    const char *dir = o->checkpoint_dir;
    int n = tdm_checkpoint_list(dir, NULL, 0);
    int64_t *steps = n > 0 ? malloc(sizeof *steps * (size_t)n) : NULL;
    if (n > 0 && steps) n = tdm_checkpoint_list(dir, steps, n);
    if (n < 0 || (n > 0 && !steps)) {
        free(steps);
        return task_error("--checkpoint-dir: %s", n < 0 ? tdm_last_error() : "out of memory");
    }
    if (n == 0) return 0;
    if (o->overwrite) {
        free(steps);
        if (tdm_checkpoint_clear(dir)) return task_error("--overwrite: %s", tdm_last_error());
        if (!o->quiet)
            printf("overwrite deleted %d checkpoint%s of an earlier run in %s\n", n,
                   n == 1 ? "" : "s", dir);
        return 0;
    }
    char list[256] = "";
    size_t len = 0;
    for (int i = 0; i < n && len < sizeof list; i++) {
        if (n > 4 && i == 2) { /* the first two, then the last */
            len += (size_t)snprintf(list + len, sizeof list - len, ", ...");
            i = n - 1;
        }
        if (len < sizeof list)
            len += (size_t)snprintf(list + len, sizeof list - len, "%sckpt-%010" PRId64,
                                    i ? ", " : "", steps[i]);
    }
    int64_t newest = steps[n - 1];
    free(steps);
    return train_usage_error("--checkpoint-dir %s already holds %d checkpoint%s of an earlier run "
                             "(%s; the newest at step %lld). Continue that run with --resume "
                             "(and its options), or start over with --overwrite, which deletes "
                             "them, or give another --checkpoint-dir",
                             dir, n, n == 1 ? "" : "s", list, (long long)newest);
}

/* Rank 0's part of trainer_claim_checkpoint_dir. */
static int claim(trainer *tr) {
    const train_opts *o = tr->o;
    if (tdm_checkpoint_dir_check(o->checkpoint_dir))
        return task_error("--checkpoint-dir: %s", tdm_last_error());
    tr->lock = tdm_checkpoint_lock_dir(o->checkpoint_dir, "tandem train");
    if (!tr->lock && tdm_last_status() == TDM_ERR_STATE) { /* another run's */
        fflush(stdout);
        fprintf(stderr,
                "tandem train: %s; nothing was changed there (one run at a time uses a "
                "checkpoint directory)\n",
                tdm_last_error());
        return EXIT_USAGE;
    }
    if (!tr->lock) return task_error("--checkpoint-dir: %s", tdm_last_error());
    return o->resume ? 0 : fresh_start(o);
}

int trainer_claim_checkpoint_dir(trainer *tr) {
    if (!tr->o->checkpoint_dir) return 0;
    double rc = tr->silent ? 0 : claim(tr); /* rank 0 writes the checkpoints */
    if (tr->g && trainer_sum_over_processes(tr, &rc, 1, "checkpoint directory's claim"))
        return EXIT_RUNTIME;
    return (int)rc; /* every process stops with rank 0's status */
}

/* The resumed state checked against this run, after tdm_checkpoint_load checked each field
 * alone: its epoch one of --epochs, its data position the start of an optimizer step, its step
 * count the one that position gives (the epochs before it times the steps of one, and the
 * steps of its own), one optimizer step per step, and the generator seeded as this process's
 * (seed: the trainer never reseeds it). Other values were altered or are not this run's: the
 * run stops before its first step, having written nothing. 0, EXIT_USAGE or EXIT_RUNTIME. */
static int check_resumed(const trainer *tr, const char *path, int64_t epoch, int64_t batch,
                         uint64_t seed) {
    int64_t spe = tr->steps_per_epoch, accum = tr->accum, step = tr->global_step, at = -1;
    int64_t optim = tdm_optim_steps(tr->opt);
    uint64_t loaded = tdm_default_rng()->seed;
    const char *file = "train_state.safetensors";
    if (batch % accum)
        return task_error("--resume from '%s': %s: loader.global_sample %lld is batch %lld of "
                          "epoch %lld, inside an optimizer step of --grad-accum %lld batches",
                          path, file, (long long)tdm_loader_global_samples_done(tr->train_l),
                          (long long)batch, (long long)epoch, (long long)accum);
    bool over = __builtin_mul_overflow(epoch, spe, &at) || at > INT64_MAX - batch / accum;
    if (over || step != at + batch / accum) {
        char is[48] = "past 2^63";
        if (!over) snprintf(is, sizeof is, "%lld", (long long)(at + batch / accum));
        return task_error("--resume from '%s': %s: step %lld, but its data position (loader.epoch "
                          "%lld, step %lld of the %lld of an epoch) is step %s of the run",
                          path, file, (long long)step, (long long)epoch, (long long)(batch / accum),
                          (long long)spe, is);
    }
    if (optim != step)
        return task_error("--resume from '%s': %s: optim.steps %lld, but the run took %lld steps "
                          "(one optimizer step each)",
                          path, file, (long long)optim, (long long)step);
    if (loaded != seed)
        return task_error("--resume from '%s': %s: rng.seed %llu, but the run's generator is "
                          "seeded %llu",
                          path, file, (unsigned long long)loaded, (unsigned long long)seed);
    if (epoch >= tr->o->epochs) /* a finished run continued with fewer --epochs */
        return train_usage_error("--resume from '%s': the checkpoint is in epoch %lld, past "
                                 "--epochs %lld: give --epochs %lld or more to continue it",
                                 path, (long long)epoch + 1, (long long)tr->o->epochs,
                                 (long long)epoch + 1);
    return 0;
}

/* The optimizer state resumed (replica 0's; the replicas loaded the same file): finite, and
 * the second moments, whose square root a step takes, >= 0. A sharded optimizer holds a
 * shard each process would judge alone (and stop alone): not checked. 0 or EXIT_RUNTIME. */
static int check_moments(const trainer *tr, const char *path) {
    const char *names[4];
    tdm_tensor *st[4];
    int n = tdm_strategy_state_split(tr->st) ? 0 : tdm_optim_state(tr->opt, names, st, 4);
    for (int s = 0; s < n; s++) {
        int64_t len = tdm_numel(st[s]), k = 0;
        float *v = malloc(sizeof(float) * (size_t)(len ? len : 1));
        if (!v || tdm_to_host(st[s], v, sizeof(float) * (size_t)len)) {
            free(v);
            return task_error("--resume from '%s': reading the optimizer state back: %s", path,
                              v ? tdm_last_error() : "out of memory");
        }
        bool square = strstr(names[s], "exp_avg_sq") != NULL; /* and max_exp_avg_sq */
        while (k < len && isfinite(v[k]) && (!square || v[k] >= 0)) k++;
        float bad = k < len ? v[k] : 0;
        free(v);
        if (k == len) continue;
        const tdm_paramset *ps = tr->ps;
        int i = 0; /* the parameter of element k (the state is flat, in the paramset's order) */
        while (len == ps->total && i + 1 < ps->n && ps->offsets[i + 1] <= k) i++;
        char at[300];
        if (len == ps->total)
            snprintf(at, sizeof at, "optim.%s.%s holds %g at element %lld", ps->names[i], names[s],
                     (double)bad, (long long)(k - ps->offsets[i]));
        else
            snprintf(at, sizeof at, "the optimizer's %s holds %g at element %lld", names[s],
                     (double)bad, (long long)k);
        return task_error("--resume from '%s': train_state.safetensors: %s (%s)", path, at,
                          square ? "a second moment is finite and >= 0" : "not finite");
    }
    return 0;
}

/* The fp16 loss scaler's state from the checkpoint, when it has one and this run scales:
 * the scale finite and > 0, the growth tracker a whole number >= 0 (tdm_grad_scaler_set_state
 * also holds it below the growth interval). 0 or EXIT_RUNTIME naming the field. */
static int resume_scaler(trainer *tr, const char *path) {
    tdm_grad_scaler *gs = tdm_strategy_grad_scaler(tr->st);
    char scale[64], tracker[32];
    int a = gs ? tdm_checkpoint_meta(path, "amp.scale", scale, sizeof scale) : 0;
    int b = gs ? tdm_checkpoint_meta(path, "amp.growth_tracker", tracker, sizeof tracker) : 0;
    if (a < 0 || b < 0) return task_error("--resume from '%s': %s", path, tdm_last_error());
    if (a == 0 && b == 0) return 0; /* saved without a scaler: this run's starts afresh */
    char *end1 = NULL, *end2 = NULL;
    double v = a == 1 ? strtod(scale, &end1) : NAN;
    long long t = b == 1 ? strtoll(tracker, &end2, 10) : -1;
    bool scale_ok = a == 1 && end1 != scale && !*end1 && isfinite(v) && v > 0 && v <= FLT_MAX;
    bool tracker_ok = b == 1 && end2 != tracker && !*end2 && t >= 0 && t <= INT32_MAX;
    tdm_grad_scaler_state st = {(float)v, (int32_t)t};
    if (!scale_ok || !tracker_ok || tdm_grad_scaler_set_state(gs, &st))
        return task_error(
            "--resume from '%s': the loss scaler's %s '%s' is not %s", path,
            !scale_ok ? "amp.scale" : "amp.growth_tracker",
            !scale_ok ? (a == 1 ? scale : "(missing)") : (b == 1 ? tracker : "(missing)"),
            !scale_ok ? "a finite scale > 0" : "a whole number >= 0 below the growth interval");
    return 0;
}

/* One line when the checkpoint was trained in another precision (none before precisions were
 * recorded: those were fp32). The weights are fp32 masters either way. */
static int note_precision(trainer *tr, const char *path) {
    char saved[16] = "fp32";
    int got = tdm_checkpoint_meta(path, "amp.precision", saved, sizeof saved);
    if (got < 0) return task_error("--resume from '%s': %s", path, tdm_last_error());
    if (strcmp(saved, "fp32") && strcmp(saved, "bf16") && strcmp(saved, "fp16"))
        return task_error("--resume from '%s': amp.precision '%s' is not fp32, bf16 or fp16", path,
                          saved);
    if (strcmp(saved, tr->o->precision) != 0 && !tr->o->quiet && !tr->silent)
        printf("precision the checkpoint was trained in %s, this run goes on in %s (its weights "
               "are fp32 either way)\n",
               saved, tr->o->precision);
    return 0;
}

/* --resume: restores every replica's weights and optimizer from the newest checkpoint, and
 * the data position, RNG, step count and run identity once. A run that starts from the
 * beginning draws a new identity. */
int trainer_resume(trainer *tr) {
    const train_opts *o = tr->o;
    tr->start_epoch = 1;
    if (o->checkpoint_dir && tdm_checkpoint_new_run_id(tr->run_id, sizeof tr->run_id))
        return task_error("run identity: %s", tdm_last_error());
    if (!o->resume) return 0;
    char path[4096];
    int64_t step = 0;
    int found = tdm_checkpoint_latest(o->checkpoint_dir, path, sizeof path, &step);
    if (found < 0) return task_error("--resume: %s", tdm_last_error());
    if (found == 0) {
        if (!o->quiet)
            printf("resume    no checkpoint in %s yet: starting from the beginning\n",
                   o->checkpoint_dir);
        return 0;
    }
    char resharded[96];
    int rc = same_run(o, path);
    if (!rc) rc = saved_layout(tr, path, resharded, sizeof resharded);
    if (rc) return rc;
    /* the resumed run's identity (none when it was written before identities) */
    int got = tdm_checkpoint_run_id(path, tr->run_id, sizeof tr->run_id);
    if (got < 0) return task_error("--resume from '%s': %s", path, tdm_last_error());
    if (got == 0) tr->run_id[0] = '\0';
    /* the runs's shards were made before (shard_optimizer): each takes its part; under
     * --shard parameters a whole model file is read into the model gathered for it */
    bool gather = !tdm_checkpoint_is_sharded(path);
    if (gather && (rc = params_whole(tr, true))) return rc;
    int n = tdm_strategy_replicas(tr->st);
    uint64_t seed = tdm_default_rng()->seed;
    /* tensor parallelism: the whole model and a whole optimizer, then each rank's parts */
    tdm_optim *whole =
        tdm_strategy_holds_parts(tr->st) ? tr->task->optimizer(tr->ps, (void *)o) : NULL;
    if (tdm_strategy_holds_parts(tr->st) && !whole)
        return task_error("--resume: a whole optimizer to read into: %s", tdm_last_error());
    for (int r = 0; r < n && !rc; r++) {
        tdm_train_state s = {.model = tdm_strategy_replica(tr->st, r),
                             .optim = whole ? whole : tdm_strategy_optim(tr->st, r)};
        if (r == 0) s.loader = tr->train_l, s.rng = tdm_default_rng();
        if (tdm_checkpoint_load(path, &s) != TDM_OK)
            rc = task_error("--resume from '%s': %s", path, tdm_last_error());
        if (r == 0) tr->global_step = s.step;
    }
    if (!rc && whole && tdm_strategy_push_whole(tr->st, whole))
        rc = task_error("--resume from '%s': handing the whole model to the parts: %s", path,
                        tdm_last_error());
    tdm_optim_free(whole);
    int rc2 = gather ? params_whole(tr, false) : 0;
    if (rc || rc2) return rc ? rc : rc2;
    int64_t epoch = 0, batch = 0;
    tdm_loader_position(tr->train_l, &epoch, &batch);
    rc = check_resumed(tr, path, epoch, batch, seed);
    if (!rc) rc = check_moments(tr, path);
    char weights[4200]; /* a sharded checkpoint's weights are in its shard files */
    snprintf(weights, sizeof weights, "%s%s", path, gather ? "/model.safetensors" : "");
    if (!rc && !params_sharded(tr)) /* sharded: each process holds a part (see check_moments) */
        rc = task_check_finite(tr->task->model, "--resume from", weights);
    if (!rc) rc = resume_totals(tr, path, batch * tr->o->batch_size);
    if (!rc) rc = resume_scaler(tr, path);
    if (!rc) rc = note_precision(tr, path);
    /* each process read its own totals: every one stops when any refused them */
    double failed = rc;
    if (tr->g && trainer_sum_over_processes(tr, &failed, 1, "resume's check")) return EXIT_RUNTIME;
    if (failed != 0) return rc ? rc : EXIT_RUNTIME;
    tr->start_epoch = (int)epoch + 1;
    tr->resume_step = batch / tr->accum;
    tr->last_saved = tr->global_step;
    if (!o->quiet)
        printf("resume    %s: epoch %d, step %lld of the epoch, %lld steps done%s\n", path,
               tr->start_epoch, (long long)tr->resume_step, (long long)tr->global_step, resharded);
    return 0;
}

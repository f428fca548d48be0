/* `tandem train`: the options (one table drives parsing and --help), their checks, and the
 * run: the task the options name (task.h) trained by the one loop of trainer.c, in one
 * process or, started by mpirun, as one rank of several. */
#include "train.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "paths.h"
#include "sink.h"
#include "task.h"
#include "trainer.h"

/* ---- options ------------------------------------------------------------------------------ */

typedef enum { OPT_STR, OPT_INT, OPT_NUM, OPT_FLAG } opt_kind;

typedef struct {
    const char *name; /* "--epochs" */
    const char *arg;  /* metavariable in help; NULL for a flag */
    opt_kind kind;
    size_t off;    /* field in train_opts */
    double lo, hi; /* accepted range of a number */
    const char *deflt;
    const char *help;
} opt_spec;

#define F(field) offsetof(train_opts, field)
static const opt_spec specs[] = {
    {"--recipe", "fmnist-fast", OPT_STR, F(recipe), 0, 0, "none",
     "A named set of options, printed at the start of the run; options given on the command "
     "line override the recipe's. fmnist-fast: Fashion-MNIST to 92% test accuracy in the "
     "fewest seconds on two CPU cores (RECIPES below lists its options)."},
    {"--data", "fashion-mnist|DIR|cifar10:DIR|cifar100:DIR|FILE", OPT_STR, F(data), 0, 0,
     "fashion-mnist",
     "Training and test data. fashion-mnist reads Debian's dataset-fashion-mnist from "
     "/usr/share/datasets/fashion-mnist. DIR is either a directory holding the four IDX files "
     "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
     "t10k-labels-idx1-ubyte (each raw or with .gz; MNIST works too), or image folders as "
     "torchvision's ImageFolder reads them: DIR/train and DIR/val (or DIR/test), each with one "
     "folder of JPEG and PNG files per class, the classes being the sorted folder names. "
     "cifar10:DIR and cifar100:DIR read CIFAR's binary files (data_batch_1.bin ... "
     "test_batch.bin; train.bin and test.bin, fine labels). For a language model, FILE is an "
     "llm.c token "
     "shard (magic 20240520, u16 tokens) or any other file, whose bytes are the tokens "
     "(vocabulary 256): plain text trains with no tokenizer."},
    /* the names, the default and the text come from the registry (models.h): model_arg,
     * model_help */
    {"--model", "NAME", OPT_STR, F(model), 0, 0, "",
     "The network, with PyTorch's parameter names."},
    {"--image-size", "S", OPT_INT, F(image_size), 8, 4096,
     "the model's own for a model of fixed input (28); else the data's (28 Fashion-MNIST, 32 "
     "CIFAR), 224 for image folders",
     "The side of the square images the model is trained on: the presets of --transform are "
     "sized by it."},
    {"--transform", "STEPS|PRESET", OPT_STR, F(transform), 0, 0,
     "imagenet-train for image folders, cifar-train for CIFAR with a model sized by its data (a "
     "ResNet), none otherwise",
     "The training images' transforms, torchvision's classes in order, comma-separated, e.g. "
     "'RandomResizedCrop(224),RandomHorizontalFlip(),Normalize(imagenet)' (Resize, CenterCrop, "
     "RandomResizedCrop, RandomCrop, RandomHorizontalFlip, ColorJitter, Grayscale, Normalize, "
     "RandomErasing), or a preset: imagenet-train, imagenet-eval, cifar-train, cifar-eval. "
     "Random choices come from (--seed, epoch, sample), whatever the workers and devices. Images "
     "of an image folder differ in size: the steps must end with a crop or a Resize to (h, w)."},
    {"--skip-bad-images", NULL, OPT_FLAG, F(skip_bad), 0, 0, "off",
     "Image folders: skip the files that are not a JPEG or PNG image (empty, another format, "
     "a broken header) and say how many, instead of stopping with the first one's name. A "
     "file whose pixels are corrupt still stops the run, naming it."},
    {"--eval-transform", "STEPS|PRESET", OPT_STR, F(eval_transform), 0, 0,
     "imagenet-eval for image folders, cifar-eval for CIFAR with a model sized by its data (a "
     "ResNet), none otherwise",
     "The test images' transforms, as --transform."},
    {"--layers", "L", OPT_INT, F(layers), 1, 1024, "2", "Language models: transformer blocks."},
    {"--heads", "H", OPT_INT, F(heads), 1, 1024, "4",
     "Language models: attention heads (must divide --channels)."},
    {"--channels", "C", OPT_INT, F(channels), 1, 65536, "128",
     "Language models: width of the model."},
    {"--context", "T", OPT_INT, F(context), 1, 1 << 20, "64 (the file's with --init-from)",
     "Language models: tokens per training window (the longest sequence the model reads)."},
    {"--vocab", "V", OPT_INT, F(vocab), 1, 1 << 20, "256 for text, 50257 for token shards",
     "Language models: vocabulary size (padded to a multiple of 128 in the embedding, as "
     "llm.c does)."},
    {"--save", "FILE", OPT_STR, F(save_path), 0, 0, "none",
     "Language models: write the trained model as an llm.c fp32 model file (readable by llm.c's "
     "train_gpt2.c and by 'tandem sample')."},
    {"--recompute", NULL, OPT_FLAG, F(recompute), 0, 0, "off",
     "Recomputation (torch.utils.checkpoint): each of the model's units runs without keeping "
     "its activations, and again during backward: for a GPT every transformer block, for a "
     "ResNet each stage (layer1 to layer4). Activation memory falls to about one unit's plus "
     "each unit's input, for one more forward pass of compute; the weights are the same bit "
     "for bit (batch norm's running statistics included). Not for the models that have no "
     "such units (those of 1x28x28 images)."},
    {"--clip-grad", "N", OPT_NUM, F(clip), 0, 1e12, "0 (off)",
     "Clip the gradients' global 2-norm to N before each step (torch.nn.utils."
     "clip_grad_norm_; the averaged gradient's, with several devices or processes; with "
     "--model-split the whole model's, joined over the stages)."},
    {"--grad-accum", "N", OPT_INT, F(grad_accum), 1, 4096, "1",
     "Gradient accumulation, one optimizer step per N batches: the gradients of N batches of "
     "--batch-size add up (each loss divided by N; devices and processes exchange them once, "
     "at the last), so the step is that of one batch N times larger in 1/N of the memory. An "
     "epoch's batches beyond a multiple of N are not trained on. Not with --model-split, "
     "whose --micro-batches already accumulate."},
    {"--epochs", "N", OPT_INT, F(epochs), 1, 1e6, "1", "Passes over the training data."},
    {"--batch-size", "B", OPT_INT, F(batch_size), 1, 1 << 20, "64",
     "Global batch size: samples per optimizer step, summed over all devices and processes, "
     "so results do not depend on how the work is spread. The last batch of an epoch may be "
     "smaller."},
    {"--batch-per-device", "B", OPT_INT, F(batch_per_device), 1, 1 << 20, "none",
     "Samples per device per step instead, as PyTorch's batch_size under DDP: the global "
     "batch is B x devices (x processes under mpirun; with --model-split K, B per replica of "
     "the K stages). Not with --batch-size."},
    {"--optimizer", "sgd|adam|adamw", OPT_STR, F(optimizer), 0, 0,
     "sgd (adamw for a language model)",
     "Update rule, with PyTorch's formulas (torch.optim.SGD, Adam, AdamW; Adam's betas 0.9, "
     "0.999 and eps 1e-8)."},
    {"--lr", "LR", OPT_NUM, F(lr), 0, 1e6, "0.1 for sgd, 1e-3 for adam and adamw",
     "Base learning rate (before the schedule)."},
    {"--momentum", "M", OPT_NUM, F(momentum), 0, 0.999999, "0.9",
     "SGD momentum (PyTorch's form: b = M*b + g). sgd only."},
    {"--weight-decay", "WD", OPT_NUM, F(weight_decay), 0, 1e6, "0",
     "L2 penalty added to the gradient (sgd, adam), or decoupled decay (adamw; PyTorch's "
     "AdamW default would be 0.01)."},
    {"--schedule", "constant|step|cosine|linear|onecycle", OPT_STR, F(schedule), 0, 0, "constant",
     "Learning-rate schedule. step: multiply by --gamma every --step-size epochs (StepLR). "
     "cosine: linear warmup over --warmup-steps, then cosine decay to 0 at the last step of "
     "the last epoch (steps = epochs * steps per epoch; --max-steps stops a run without "
     "changing its schedule, and --limit shortens the epochs). linear: the same warmup, then "
     "linear decay to 0 (LinearLR from 1 to 0). onecycle: PyTorch's OneCycleLR with max_lr "
     "--lr over the run's steps: cosine rise from lr/25 over --pct-start of them, then "
     "cosine fall to lr/25/1e4."},
    {"--warmup-steps", "N", OPT_INT, F(warmup_steps), 0, 1e12, "0",
     "Warmup steps of the cosine and linear schedules."},
    {"--pct-start", "P", OPT_NUM, F(pct_start), 0, 1, "0.3",
     "onecycle: the fraction of the steps spent rising to --lr (OneCycleLR's pct_start)."},
    {"--label-smoothing", "E", OPT_NUM, F(label_smoothing), 0, 1, "0",
     "Cross-entropy against (1-E) x the label + E/classes everywhere (PyTorch's "
     "label_smoothing). Image models only."},
    {"--nesterov", NULL, OPT_FLAG, F(nesterov), 0, 0, "off",
     "Nesterov momentum (PyTorch's SGD nesterov=True). sgd with --momentum > 0 only."},
    {"--no-decay-1d", NULL, OPT_FLAG, F(no_decay_1d), 0, 0, "off",
     "--weight-decay on parameters of 2 or more dims only: biases and norms' weights get 0 "
     "(two parameter groups, as a language model always does)."},
    {"--eval-flip", NULL, OPT_FLAG, F(eval_flip), 0, 0, "off",
     "Evaluate on the mean of the model's logits for each test image and its left-right "
     "mirror (test-time augmentation). Image models only."},
    {"--validation", "N", OPT_INT, F(validation), 0, 1e12, "0 (the test set)",
     "Hold out N evenly spaced training samples and evaluate on them instead of the test set, "
     "training on the rest: tune a recipe on these, so that the test set measures it only "
     "once. Image models only."},
    {"--step-size", "E", OPT_INT, F(step_size), 1, 1e6, "1", "Epochs between decays (step)."},
    {"--gamma", "G", OPT_NUM, F(gamma), 0, 1, "0.1", "Decay factor (step)."},
    {"--seed", "S", OPT_INT, F(seed), 0, 9.007199254740992e15, "0",
     "Seed of the weight initialisation and of the data order: the same seed gives the same "
     "run."},
    {"--denormals", "flush|keep", OPT_STR, F(denormals), 0, 0, "flush",
     "flush: floats below 1.2e-38 become 0 (torch.set_flush_denormal(True)); keep: IEEE "
     "arithmetic, PyTorch's default. Each operation on a denormal takes a microcode assist: "
     "SGD's momentum of a parameter whose gradient stays 0 turns denormal after ~800 steps, "
     "and the MLP's epochs then slow down (bench/RESULTS.md measures by how much)."},
    {"--workers", "N", OPT_INT, F(workers), 0, 64, "2 or 0",
     "DataLoader worker threads building batches ahead of the training loop; 0 builds them "
     "on the training thread. The default is 2, or 0 where every core runs a device (--devices "
     "with as many CPU devices as cores) and a batch only copies samples held in memory (no "
     "image to decode, no --transform): a worker could then run only on a device's core."},
    {"--devices", "LIST", OPT_STR, F(devices), 0, 0, "cpu:0",
     "Devices to train on: a list (cpu:0,cpu:1 or cuda:0,cuda:1), cpu:all (one device per "
     "core), cuda:all (every GPU), cuda (the GPU of this process's local rank under mpirun or "
     "srun, cuda:0 otherwise) or a count (2 means cpu:0,cpu:1). With several devices the "
     "model is replicated, each device trains on its share of every global batch, and "
     "gradients are averaged before one update (data parallelism; NCCL between GPUs), so "
     "results match one device. Under mpirun each process uses these devices for its share "
     "of the batch, and gradients are averaged over every device of every process "
     "(mpirun -np <GPUs> ... --devices cuda: one GPU per process)."},
    {"--shard", "none|optimizer|gradients|parameters", OPT_STR, F(shard), 0, 0, "none",
     "optimizer: ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer) over every device of every "
     "process: each keeps the optimizer state (SGD's momentum, Adam's moments) of its shard of "
     "the parameters only, steps that shard and shares it, so the state per device is divided "
     "by their number and the weights are the same, bit for bit. gradients: ZeRO stage 2 "
     "(FSDP's SHARD_GRAD_OP), also the gradients: each device keeps the averaged gradient of "
     "its shard only, a bucket's gradients living only while backward produces and averages "
     "them, so the gradient memory per device is its shard plus a few buckets; the weights "
     "are the same bit for bit, except with --grad-accum, where each batch's average is added "
     "into the shard (equal to float rounding). Under mpirun, or on several GPUs; the CPU "
     "devices of one process already hold the state once. Each device of each process of a "
     "sharded run writes its shard of the checkpoints (tandem export makes them one file), and a "
     "run may resume with or without --shard, on any devices and processes. parameters: ZeRO "
     "stage 3 (FSDP's FULL_SHARD), also the parameters: each device keeps its shard of them, "
     "and the rest of the model only while a unit (a GPT's block, a ResNet's stage, else a "
     "layer) computes, gathered just before its forward and its backward, the next unit's "
     "gather overlapping the current one's compute; the weights are stage 2's bit for bit. "
     "With --precision bf16 under mpirun (DDP) the gathers move the parameters rounded to "
     "bf16, FSDP2's param_dtype: half the bytes, every forward and backward computing with the "
     "rounded values, the shards and checkpoints f32; over several devices of one process "
     "they move f32. "
     "On every kind of device and process; over the CPU devices of one process it replaces "
     "their shared-memory update, so each device holds its shard of the optimizer state too. "
     "With --model-split, optimizer only: the replicas of each pipeline stage share its "
     "state."},
    {"--precision", "fp32|bf16|fp16", OPT_STR, F(precision), 0, 0, "fp32",
     "Mixed precision (PyTorch's autocast, docs/MIXED_PRECISION.md): bf16 or fp16 runs the "
     "matrix products, convolutions and attention of every forward in that dtype with fp32 "
     "sums inside, and the losses in fp32; the weights, their gradients, the optimizer state and "
     "the checkpoints stay fp32. fp16 also scales the loss (GradScaler: steps with an inf or NaN "
     "gradient are skipped and the scale lowered, alike on every device, process and stage) and "
     "needs GPUs: the CPU has no fp16 matrix product here. Lightning's names are taken too: "
     "32-true, bf16-mixed, 16-mixed. A run may "
     "resume in another precision. The header line says whether this machine runs bf16 natively "
     "(AVX512_BF16 or AMX) or emulates it (its products then convert to fp32: no faster than "
     "fp32)."},
    {"--allow-tf32", NULL, OPT_FLAG, F(allow_tf32), 0, 0, "off",
     "GPUs' fp32 matrix products in TF32 on the tensor cores (torch.backends.cuda.matmul."
     "allow_tf32 = True): inputs rounded to 10 mantissa bits, several times fp32's speed on an "
     "Ampere or later GPU, results within about 1e-3 of fp32's. Matmul only (attention and "
     "convolutions stay fp32); no effect on CPU devices or on --precision bf16's products."},
    {"--cuda-graphs", NULL, OPT_FLAG, F(cuda_graphs), 0, 0, "off",
     "Records the step (forward, loss, backward) on one GPU in a CUDA graph after two eager "
     "steps and replays it for every later step of the same batch shape: one launch instead of "
     "hundreds (PyTorch's torch.cuda.graphs). The gradient clipping and the optimizer's update "
     "run after each replay, so schedules work; the losses are the eager run's bit for bit. One "
     "GPU per process (--devices cuda:N), without --grad-accum or --precision fp16 (refused). "
     "A step that cannot be recorded makes the run say why once and step eagerly."},
    {"--reduce-dtype", "fp32|bf16", OPT_STR, F(reduce_dtype), 0, 0, "fp32",
     "The dtype DDP's gradient buckets travel in between devices and processes: fp32, or bf16 "
     "with the sum accumulated in fp32 (PyTorch's bf16_compress_hook: half the traffic, the "
     "average rounded to bf16). Where gradients cross between processes or GPUs: under mpirun "
     "(one device per process, or several), and between GPUs; the CPU devices of one process "
     "average in shared memory (except under --shard parameters) and pipelines' replicas in "
     "fp32: refused there."},
    {"--bucket-cap", "MB", OPT_INT, F(bucket_cap), 1, 1024, "25",
     "Under mpirun with one device per process (DDP): the gradient buckets' size in MiB "
     "(PyTorch's bucket_cap_mb), each averaged over the processes as soon as backward has "
     "filled it. Smaller buckets start communication sooner and, under --shard gradients or "
     "parameters, bound the gradient memory beyond the shard (a few buckets); larger ones "
     "make fewer, larger messages."},
    {"--model-split", "K", OPT_INT, F(model_split), 1, TDM_PIPE_MAX_STAGES, "1 (no split)",
     "Model parallelism: cut the model into K pipeline stages of consecutive layers (balanced "
     "by parameter count), each on its own device of --devices, which must list K devices, or "
     "K x R for R data-parallel replicas of every stage. Each batch flows through the stages "
     "in --micro-batches pieces, so the devices work at once; results match one device. A GPT "
     "is cut as its embeddings, blocks and head, the head's copy of the token embedding "
     "tied to the first stage's (their gradients summed: Megatron-LM's tied embeddings). "
     "Checkpoints hold the whole model and optimizer, so a run resumes on another split or "
     "none. Not with --grad-accum: raise --micro-batches."},
    {"--micro-batches", "M", OPT_INT, F(micro_batches), 1, TDM_PIPE_MAX_MICRO, "4",
     "With --model-split: pieces each batch is cut into."},
    {"--pipeline", "1f1b|gpipe", OPT_STR, F(pipe_schedule), 0, 0, "1f1b",
     "With --model-split: gpipe runs every forward, then every backward (all micro-batches' "
     "activations alive at once); 1f1b alternates them (at most K alive on a stage)."},
    {"--tensor-parallel", "N", OPT_INT, F(tensor_parallel), 1, TDM_MAX_DEVICES, "1 (none)",
     "Tensor parallelism (Megatron-LM's; --tp N for short): every N devices of --devices split "
     "each block of the GPT between them (attention by heads, the MLP's matrices by rows and "
     "columns, the tokens between them by sequence), so each holds 1/N of its weights, "
     "gradients and optimizer state and about 1/N of its activations; the devices, a multiple "
     "of N, form a mesh dp x tp whose rows share each batch as data-parallel replicas. "
     "With --shard optimizer, gradients or parameters each row's devices share their parts' "
     "optimizer state, averaged gradients and the parts themselves (ZeRO stages 1 to 3, "
     "torchtitan's FSDP with TP). Checkpoints hold the whole model and "
     "resume under another N or device count. "
     "With --recompute each device runs its blocks' forwards again in backward, collectives "
     "included. Under mpirun the processes' devices form the mesh (L --devices a process, a "
     "multiple or a divisor of N; device i of process p is rank r = p L + i: dp r / N, tp r "
     "% N). With --model-split K every stage of the "
     "pipeline is split over N devices (3-D parallelism: --devices K x N x replicas; its "
     "blocks, the tokens between them and the vocabulary, as without stages). GPT models "
     "only."},
    {"--device-memory", "SIZE", OPT_STR, F(device_memory), 0, 0, "no cap",
     "Caps what Tandem's allocator holds on each device of --devices at SIZE (bytes, or with "
     "K, M, G or T: powers of 1024, as Slurm's --mem; 4G, 512M, 1.5GiB), as a GPU's memory caps "
     "it: a model or batch too large for such a device then stops with the out-of-memory "
     "error a GPU of that size would give (the device, the request, what tensors hold, the "
     "cap), first giving the cached blocks back as PyTorch does. On a GPU it caps below the "
     "card's own memory."},
    {"--timeout", "SECONDS", OPT_NUM, F(timeout), 0.1, 1e6, "30",
     "Under mpirun: how long a process waits for the others at a collective before it stops "
     "with an error naming the rank it waited for (a process that crashed or hangs). Raise "
     "it when one process can work alone for long between steps."},
    {"--check-replicas", "N", OPT_INT, F(check_replicas), 0, 1e12, "0",
     "Every N optimizer steps, compare every data-parallel replica's weights (each device's, "
     "each process's) with the first's, tensor by tensor through a hash, and stop with an "
     "error naming the first weight that differs and the rank that holds it: replicas start "
     "equal and take one averaged update, so a difference is silent divergence (another "
     "file under the same --data path on one machine, a non-deterministic kernel, a fault). "
     "0: never. Costs one read of the weights and, under mpirun, one small all-gather. Not "
     "with --model-split."},
    {"--debug-dir", "DIR", OPT_STR, F(debug_dir), 0, 0,
     "--checkpoint-dir, else /tmp/tandem-debug-JOB",
     "Under mpirun: where each process writes its flight recorder, flight-rank-R.jsonl (its last "
     "256 collectives: what, where in the code, when, done or not), when its run fails and "
     "whenever it gets SIGUSR1, SIGTERM or SIGINT, also when stuck in a collective. SIGUSR1 "
     "(a launcher's early warning: srun --signal=USR1@120) then stops the run at its next step "
     "with a checkpoint, as SIGTERM does. 'tandem doctor DIR' merges them and "
     "names the first collective the processes disagree on, the one late and the last each "
     "completed."},
    {"--limit", "N", OPT_INT, F(limit), 1, 1e12, "all",
     "Use only the first N training samples (windows of text, for a language model) and the first "
     "N/6 test samples (at least 1): for quick runs and tests. Of gzipped IDX files only those "
     "images are decoded (the rest of the file is not read, nor checked)."},
    {"--log", "FILE", OPT_STR, F(log_path), 0, 0, "none",
     "Write one JSON object per line: a config line, a line per step (epoch, step, loss, lr, "
     "img_s, or tok_s for a language model) and a line per epoch (train_loss; train_acc, test_loss "
     "and "
     "test_acc, null for a language model; seconds, eval_seconds, wall_s (seconds since the "
     "process "
     "started, when the epoch's test accuracy is known), loader_wait_s, ...; under mpirun "
     "rank_seconds and rank_wait_s, each process's training seconds and seconds waiting in "
     "collectives, and straggler, the process whose compute (the difference) is 20% above the "
     "median's, or -1: the one the others wait for, also named on the epoch line; and "
     "peak_bytes, each device's peak of tensor memory during the epoch's training, also "
     "printed on the epoch line)."},
    {"--trace", "FILE.json", OPT_STR, F(trace_path), 0, 0, "none",
     "Write a Chrome trace (open it in Perfetto or chrome://tracing): one track per thread "
     "(the training loop, each device's compute, its communication, the loader's workers) "
     "with the spans of forward, backward, optimizer, each all-reduce and waiting for data. "
     "Written as the run goes: a run killed even with -9 leaves the spans up to its last "
     "progress line."},
    {"--tensorboard", "DIR", OPT_STR, F(tensorboard_dir), 0, 0, "none",
     "Write TensorBoard event files into DIR (created if missing; open with tensorboard "
     "--logdir DIR): train/loss, train/lr and train/img_per_s (tok_per_s for a language model) per "
     "step, "
     "and epoch/train_loss, train_acc, test_loss, test_acc per epoch."},
    {"--plot", "FILE.svg", OPT_STR, F(plot_path), 0, 0, "none",
     "Draw loss and accuracy curves (train and test per epoch, train loss per step) and, in a "
     "third panel, test accuracy against the wall-clock seconds since the process started "
     "(with --plot-compare's runs) into an SVG file, rewritten at every progress line and "
     "after every epoch (for a language model: the loss panel alone)."},
    {"--plot-compare", "FILE[=LABEL],...", OPT_STR, F(plot_compare), 0, 0, "none",
     "With --plot: draw other runs in its wall-clock panel, each in its own colour and "
     "labelled LABEL (default: the file's name), this run being 'tandem'. Each FILE is a --log "
     "of another run, or of any program writing the same epoch lines (bench/torch_recipe.py "
     "does for PyTorch): only lines with \"type\":\"epoch\" are read, their test_acc (a "
     "fraction) and wall_s; lines without both are skipped. A file that cannot be read or "
     "has no such line stops the run before training. At most 6 files."},
    {"--print-every", "N", OPT_INT, F(print_every), 0, 1e12, "0",
     "When stdout is not a terminal, print a progress line every N steps (0: about ten per "
     "epoch) with the mean loss of those steps, the learning rate, ms per step and images "
     "(or tokens) per second. On a terminal a progress bar is redrawn in place instead."},
    {"--quiet", NULL, OPT_FLAG, F(quiet), 0, 0, "off",
     "No banner and no progress; only the per-epoch results and errors."},
    {"--checkpoint-dir", "DIR", OPT_STR, F(checkpoint_dir), 0, 0, "none",
     "Write checkpoints into DIR/ckpt-STEP/: model.safetensors (the weights under PyTorch's "
     "names, loadable with load_state_dict) and train_state.safetensors (optimizer moments, "
     "step counts, data position, RNG state). Each is written atomically, so a crash keeps "
     "the previous one. A final checkpoint is written when the run ends. With several "
     "devices the (identical) replicas are saved once. For a language model, DIR/model.bin is also "
     "written (llm.c's format, for 'tandem sample'). DIR belongs to one run at a time: the run "
     "holds DIR/LOCK (released when it ends, however it ends), another run into DIR is refused "
     "naming the holder, and each checkpoint records its run's identity (kept by --resume). "
     "A new run into a DIR holding checkpoints needs --resume or --overwrite. The lock holds "
     "the directory, not its name: DIR deleted, moved or replaced during the run stops it at "
     "its next checkpoint. What a save killed midway left in DIR is removed by the next run "
     "that holds it."},
    {"--checkpoint-every", "N", OPT_INT, F(checkpoint_every), 0, 1e12, "0",
     "Also write a checkpoint every N optimizer steps (0: only the final one)."},
    {"--keep", "K", OPT_INT, F(keep), 0, 1e6, "3",
     "Keep the newest K checkpoints of this run in the checkpoint directory (0 keeps all); "
     "other runs' checkpoints there are never deleted."},
    {"--resume", NULL, OPT_FLAG, F(resume), 0, 0, "off",
     "Continue from the newest checkpoint in --checkpoint-dir (weights, optimizer, schedule "
     "position, data order and position), giving the same weights as a run never stopped: bit "
     "for bit on the same devices and processes, to float rounding on others (any --devices "
     "and mpirun -np that split the global --batch-size: the run goes on at the same sample of "
     "the same epoch order). Starts from the beginning when there is none yet. The other "
     "options must be those of the interrupted run."},
    {"--overwrite", NULL, OPT_FLAG, F(overwrite), 0, 0, "off",
     "Start over in a --checkpoint-dir that holds checkpoints of an earlier run: they are "
     "deleted (other files stay) once this run holds the directory. Without it such a run is "
     "refused, so that no run loses another's checkpoints. Not with --resume."},
    {"--init-from", "FILE", OPT_STR, F(init_from), 0, 0, "none",
     "Start from the weights in FILE.safetensors (e.g. a PyTorch state_dict of the same "
     "nn.Sequential, or a checkpoint's model.safetensors); every name, shape and dtype must "
     "match. For a language model, FILE is an llm.c model file (its sizes replace --layers and the "
     "like). "
     "Ignored when --resume finds a checkpoint."},
    {"--dry-run", NULL, OPT_FLAG, F(dry_run), 0, 0, "off",
     "Print the memory the run needs on each device (parameters, gradients, optimizer state, "
     "a step's activations, the data's buffers) and stop, before the model is built; exit "
     "status 0. Without it a run that cannot fit in this machine's memory (physical memory, "
     "ulimit -v, the cgroup's memory.max: the least, less a quarter) or in a GPU's (less a "
     "tenth) stops there with these figures and what would make it fit."},
    {"--max-steps", "N", OPT_INT, F(max_steps), 1, 1e12, "none",
     "Stop after N optimizer steps in total, counted across resumes, as if interrupted there "
     "(writing a checkpoint when --checkpoint-dir is set), without evaluating."},
};
#undef F
#define N_SPECS (int)(sizeof specs / sizeof specs[0])

static train_opts opts_defaults(void) {
    return (train_opts){.data = "fashion-mnist",
                        .model = tdm_model_at(0)->name, /* the registry's first */
                        .optimizer = NULL,              /* sgd, or adamw for a language model */
                        .schedule = "constant",
                        .devices = "cpu:0",
                        .timeout = 30,
                        .model_split = 1,
                        .tensor_parallel = 1,
                        .bucket_cap = 25,
                        .micro_batches = 4,
                        .pipe_schedule = "1f1b",
                        .denormals = "flush",
                        .shard = "none",
                        .precision = "fp32",
                        .reduce_dtype = "fp32",
                        .epochs = 1,
                        .batch_size = 0, /* 64 unless --batch-per-device (check_opts) */
                        .workers = -1,   /* 2 or 0 (trainer.c, loader_workers) */
                        .limit = 0,
                        .step_size = 1,
                        .lr = NAN,
                        .momentum = NAN,
                        .pct_start = NAN,
                        .gamma = 0.1,
                        .keep = 3};
}

int train_usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem train: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see 'tandem train --help')\n");
    va_end(ap);
    return EXIT_USAGE;
}

/* Prints text wrapped at 80 columns with the given indent. */
static void wrap(FILE *out, const char *text, int indent) {
    int col = 0;
    const char *p = text;
    while (*p) {
        const char *w = p;
        while (*p && *p != ' ') p++;
        int len = (int)(p - w);
        if (col == 0) {
            col = fprintf(out, "%*s%.*s", indent, "", len, w);
        } else if (col + 1 + len > 80) {
            col = fprintf(out, "\n%*s%.*s", indent, "", len, w) - 1;
        } else {
            col += fprintf(out, " %.*s", len, w);
        }
        while (*p == ' ') p++;
    }
    fputc('\n', out);
}

/* ---- recipes: named sets of options ------------------------------------------------------ */

/* Each recipe is tuned on a validation split of the training set (--validation), never on
 * the test set; bench/RESULTS.md has how, and the runs that measure it. */
static const train_recipe recipes[] = {
    {"fmnist-fast",
     "Fashion-MNIST to 92% test accuracy in the fewest seconds on two CPU cores (issue 20)",
     {"--data",
      "fashion-mnist",
      "--model",
      "cnn-bn",
      "--devices",
      "cpu:0,cpu:1",
      "--epochs",
      "4",
      "--batch-size",
      "256",
      "--optimizer",
      "sgd",
      "--lr",
      "0.2",
      "--momentum",
      "0.9",
      "--nesterov",
      "--weight-decay",
      "5e-4",
      "--no-decay-1d",
      "--schedule",
      "onecycle",
      "--pct-start",
      "0.25",
      "--label-smoothing",
      "0.1",
      "--transform",
      "RandomHorizontalFlip(),Normalize(fmnist)",
      "--eval-transform",
      "Normalize(fmnist)",
      "--eval-flip",
      NULL}},
};
#define N_RECIPES (int)(sizeof recipes / sizeof recipes[0])

const train_recipe *train_recipe_find(const char *name) {
    for (int i = 0; i < N_RECIPES; i++)
        if (strcmp(recipes[i].name, name) == 0) return &recipes[i];
    return NULL;
}

void train_recipe_str(const train_recipe *r, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (const char *const *a = r->args; *a && n < cap; a++) {
        bool quote = strpbrk(*a, "(),") != NULL;
        n += (size_t)snprintf(buf + n, cap - n, "%s%s%s%s", n ? " " : "", quote ? "'" : "", *a,
                              quote ? "'" : "");
    }
}

/* ---- --model: its names, default and text from the registry ----------------------------- */

static bool is_model_spec(const opt_spec *s) {
    return s->off == offsetof(train_opts, model);
}

/* s's metavariable: --model's names from the registry, else the table's. */
static const char *spec_arg(const opt_spec *s, char *buf, size_t cap) {
    return is_model_spec(s) ? tdm_model_list(-1, "|", buf, cap) : s->arg;
}

static const char *spec_default(const opt_spec *s) {
    return is_model_spec(s) ? tdm_model_at(0)->name : s->deflt;
}

/* s's help: the table's, and for --model one sentence per row of the registry. */
static void spec_help(const opt_spec *s, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "%s", s->help);
    for (int i = 0; is_model_spec(s) && i < tdm_model_count() && n < cap; i++) {
        const tdm_model_info *r = tdm_model_at(i);
        n += (size_t)snprintf(buf + n, cap - n, " %s (%s): %s", r->name, r->input, r->help);
    }
}

void train_synopsis(FILE *out) {
    for (int i = 0; i < N_SPECS; i++) {
        char left[160], arg[128];
        const char *a = spec_arg(&specs[i], arg, sizeof arg);
        snprintf(left, sizeof left, "%s%s%s", specs[i].name, a ? " " : "", a ? a : "");
        fprintf(out, "    %-34s default %s\n", left, spec_default(&specs[i]));
    }
}

void train_help(FILE *out) {
    fprintf(out, "NAME\n    tandem train - train an image classifier, or a GPT on text\n\n");
    fprintf(out, "SYNOPSIS\n    tandem train [OPTION]...\n\n");
    fprintf(out, "DESCRIPTION\n");
    wrap(
        out,
        "Trains an image classifier (the models are listed under --model) with cross-entropy loss "
        "on Fashion-MNIST, CIFAR or folders of JPEG and PNG images. Each epoch visits the training "
        "set once in an order shuffled from (--seed, epoch), then evaluates on the test set in "
        "eval mode without gradients, and prints train loss and accuracy, test loss and "
        "accuracy, the epoch's training time, images per second and the time the loop waited "
        "for the data loader. With a language model (a GPT-2) it trains on --data FILE (text as "
        "bytes, "
        "or llm.c token shards) for --epochs passes or --max-steps steps, with no test split; "
        "--save writes the model in llm.c's format for 'tandem sample'. Both run the same "
        "loop: every option works for both, except where its text says otherwise.",
        4);
    fprintf(out, "\nOPTIONS\n");
    for (int i = 0; i < N_SPECS; i++) {
        char arg[128], help[4096]; /* the longest help (--model, --shard) is about 2 KB */
        const char *a = spec_arg(&specs[i], arg, sizeof arg);
        fprintf(out, "    %s%s%s\n", specs[i].name, a ? " " : "", a ? a : "");
        spec_help(&specs[i], help, sizeof help);
        char text[4200];
        snprintf(text, sizeof text, "%s Default: %s.", help, spec_default(&specs[i]));
        wrap(out, text, 8);
    }
    fprintf(out, "    -h, --help\n        Show this help and exit.\n");
    fprintf(out, "\nRECIPES\n");
    for (int i = 0; i < N_RECIPES; i++) {
        char text[1400];
        int n = snprintf(text, sizeof text, "%s. Stands for: ", recipes[i].what);
        train_recipe_str(&recipes[i], text + n, sizeof text - (size_t)n);
        fprintf(out, "    %s\n", recipes[i].name);
        wrap(out, text, 8);
    }
    fprintf(out, "\nOUTPUT\n");
    wrap(out,
         "On a terminal a progress bar shows epoch, step/steps, the epoch's running loss, images "
         "(or tokens) per second and the time left, redrawn in place at most ten times a second. "
         "When stdout is a file or a pipe, plain lines are printed instead (see --print-every).",
         4);
    fprintf(out, "\nSIGNALS\n");
    wrap(out,
         "SIGTERM or SIGINT (Ctrl-C) stops the run after the step in flight: a checkpoint is "
         "written when --checkpoint-dir is set (under mpirun every process stops at the same "
         "step, within 16 steps of the signal), a line says so, and the exit status is 128 + "
         "the signal's number (143, 130). --resume then continues as if never stopped. A second "
         "signal ends the process at once.",
         4);
    fprintf(out, "\nEXIT STATUS\n    0  training finished\n"
                 "    1  a runtime error: unreadable data, a non-finite loss, a file that cannot "
                 "be written\n    2  a usage error: an unknown option, a missing or invalid "
                 "value;\n       a --checkpoint-dir in use by another run, or holding an "
                 "earlier run's\n       checkpoints without --resume or --overwrite; an output "
                 "that is an input\n       (the same file, inside an input directory, or an "
                 "output directory holding\n       an input) or two outputs in one file\n"
                 "    143, 130  stopped by SIGTERM or SIGINT (see SIGNALS)\n");
    fprintf(out, "\nEXAMPLES\n");
    fprintf(out, "    tandem train --model mlp --epochs 3\n");
    fprintf(out, "    tandem train --model cnn --optimizer adam --epochs 2 --plot cnn.svg\n");
    fprintf(out, "    tandem train --model mlp --lr 0.05 --schedule cosine --warmup-steps 100 "
                 "--epochs 5 --log run.jsonl\n");
    fprintf(out, "    tandem train --data ~/mnist --limit 2000 --quiet\n");
    fprintf(out, "    tandem train --data photos --model resnet18 --devices cpu:all   "
                 "(photos/train/CLASS/*.jpg, photos/val/...)\n");
    fprintf(out,
            "    tandem train --data cifar10:cifar-10-batches-bin --model resnet18 --epochs 30 "
            "--schedule cosine\n");
    fprintf(out, "    tandem train --model gpt --data book.txt --layers 2 --heads 4 --channels 128 "
                 "--context 64 --batch-size 8 --save gpt.bin\n");
}

/* Parses a whole-string integer or number within [lo, hi]. */
static int parse_value(const opt_spec *s, const char *v, train_opts *o) {
    char *end;
    errno = 0;
    if (s->kind == OPT_STR) {
        if (!*v) return train_usage_error("%s: empty value", s->name);
        *(const char **)((char *)o + s->off) = v;
        return 0;
    }
    double x = strtod(v, &end);
    bool bad = end == v || *end || errno == ERANGE || !isfinite(x) || x < s->lo || x > s->hi;
    if (s->kind == OPT_INT) {
        long long n = strtoll(v, &end, 10);
        bad = bad || end == v || *end || errno == ERANGE;
        if (bad)
            return train_usage_error("%s: expected an integer in [%.0f, %.0f], got '%s'", s->name,
                                     s->lo, s->hi, v);
        *(int64_t *)((char *)o + s->off) = n;
        return 0;
    }
    if (bad)
        return train_usage_error("%s: expected a number in [%g, %g], got '%s'", s->name, s->lo,
                                 s->hi, v);
    *(double *)((char *)o + s->off) = x;
    return 0;
}

static const opt_spec *find_spec(const char *name, size_t len) {
    if (len == 4 && strncmp(name, "--tp", 4) == 0) name = "--tensor-parallel", len = 17;
    for (int i = 0; i < N_SPECS; i++)
        if (strlen(specs[i].name) == len && strncmp(specs[i].name, name, len) == 0)
            return &specs[i];
    return NULL;
}

/* "4G", "512M", "1.5GiB", "4096": bytes into *out (K, M, G, T: powers of 1024; an "iB" or "B"
 * after them changes nothing). 0, or -1 for anything else, a size below one byte or above
 * 2^62. */
static int parse_size(const char *s, int64_t *out) {
    char *end;
    double v = strtod(s, &end);
    const char *units = "KMGT", *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
    if (end == s || !isfinite(v) || (*end && (!u || !*u))) return -1;
    if (u) {
        v *= pow(1024, (double)(u - units + 1));
        end++;
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'B' || *end == 'b') end++;
    } else if (*end == 'B' || *end == 'b') {
        end++;
    }
    if (*end || v < 1 || v > 4.6e18) return -1;
    *out = (int64_t)v;
    return 0;
}

/* ---- the run's identity: what a resume and every process must share ------------------------ */

/* The options that shape the run's results. The others may differ on --resume (--epochs,
 * --max-steps, --lr, the layout: --devices, --tensor-parallel, --model-split, --micro-batches
 * and --pipeline; --workers, the outputs and the checkpoint cadence) and between the processes
 * of one run only where they describe the process itself. */
static const char *const identity[] = {
    "--data",       "--model",       "--layers",         "--heads",      "--channels",
    "--context",    "--vocab",       "--batch-size",     "--grad-accum", "--clip-grad",
    "--optimizer",  "--momentum",    "--weight-decay",   "--schedule",   "--warmup-steps",
    "--step-size",  "--gamma",       "--seed",           "--denormals",  "--limit",
    "--image-size", "--transform",   "--eval-transform", "--pct-start",  "--label-smoothing",
    "--nesterov",   "--no-decay-1d", "--eval-flip",      "--validation"};

/* One option's value as the options hold it after check_opts, into buf. */
static void format_value(const train_opts *o, const opt_spec *s, char *buf, size_t cap) {
    const char *p = (const char *)o + s->off;
    if (s->kind == OPT_STR)
        snprintf(buf, cap, "%s", *(const char *const *)p ? *(const char *const *)p : "none");
    else if (s->kind == OPT_INT)
        snprintf(buf, cap, "%lld", (long long)*(const int64_t *)p);
    else if (s->kind == OPT_NUM)
        snprintf(buf, cap, "%.9g", *(const double *)p);
    else
        snprintf(buf, cap, "%s", *(const bool *)p ? "on" : "off");
}

/* Appends "name=value;" for each option of names to buf (a string already). */
static int append_values(const train_opts *o, const char *const *names, size_t count, char *buf,
                         size_t cap) {
    size_t n = strlen(buf);
    for (size_t i = 0; i < count; i++) {
        const opt_spec *s = find_spec(names[i], strlen(names[i]));
        char v[512];
        format_value(o, s, v, sizeof v);
        int k = snprintf(buf + n, cap - n, "%s=%s;", s->name, v);
        if (k < 0 || (size_t)k >= cap - n) return -1;
        n += (size_t)k;
    }
    return 0;
}

int train_identity(const train_opts *o, char *buf, size_t cap) {
    buf[0] = '\0';
    return append_values(o, identity, sizeof identity / sizeof identity[0], buf, cap);
}

/* The options that describe one process rather than the run: its outputs, its loader threads,
 * how long it waits for the others. Every other option must be the same in every process of a
 * run: one started with another --lr would diverge silently, one with another --max-steps or
 * --print-every would desynchronise the collectives. Listing the exceptions, not the rules,
 * makes a new option compared until someone decides otherwise. */
static const char *const process_own[] = {
    "--recipe",       "--workers",     "--timeout", "--log",       "--trace",        "--plot",
    "--plot-compare", "--tensorboard", "--quiet",   "--debug-dir", "--device-memory"};

static bool listed(const char *name, const char *const *names, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (!strcmp(names[i], name)) return true;
    return false;
}

/* Whether every process of a run must give option s the same value. */
static bool shared_by_processes(const opt_spec *s) {
    return !listed(s->name, process_own, sizeof process_own / sizeof process_own[0]);
}

int train_process_identity(const train_opts *o, char *buf, size_t cap) {
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
        if (shared_by_processes(&specs[i]) && append_values(o, &specs[i].name, 1, buf, cap))
            return -1;
    return 0;
}

/* The value of option `name` in an identity string, into v (cap bytes); false when absent. */
static bool identity_value(const char *id, const char *name, char *v, size_t cap) {
    size_t len = strlen(name);
    for (const char *p = id; p && *p; p = strchr(p, ';') ? strchr(p, ';') + 1 : NULL) {
        if (strncmp(p, name, len) != 0 || p[len] != '=') continue;
        const char *end = strchr(p, ';');
        snprintf(v, cap, "%.*s", (int)(end ? end - p - (long)len - 1 : (long)strlen(p + len + 1)),
                 p + len + 1);
        return true;
    }
    return false;
}

bool train_identity_diff(const char *a, const char *b, const char *a_name, const char *b_name,
                         char *out, size_t cap) {
    size_t n = 0;
    out[0] = '\0';
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        const char *name = specs[i].name;
        char va[512] = "(unset)", vb[512];
        /* b is this run's: what it does not hold is not compared (an option a checkpoint
         * recorded before it left the identity: the pipeline's layout) */
        if (!identity_value(b, name, vb, sizeof vb)) continue;
        identity_value(a, name, va, sizeof va);
        /* an option newer than a checkpoint, at its default there */
        if (!strcmp(va, "(unset)") &&
            (!strcmp(vb, "none") || !strcmp(vb, "0") || !strcmp(vb, "off")))
            continue;
        if (strcmp(va, vb) == 0) continue;
        int k = snprintf(out + n, cap - n, "%s%s %s %s, %s %s", n ? "; " : "", name, va, a_name, vb,
                         b_name);
        if (k > 0) n += (size_t)k < cap - n ? (size_t)k : cap - n - 1;
    }
    return n > 0;
}

static bool one_of(const char *v, const char *const *choices) {
    for (; *choices; choices++)
        if (strcmp(v, *choices) == 0) return true;
    return false;
}

/* --shard: the ZeRO stages written so far, and not with a pipeline. */
static int check_shard(const train_opts *o) {
    static const char *const kinds[] = {"none", "optimizer", "gradients", "parameters", NULL};
    if (!one_of(o->shard, kinds))
        return train_usage_error(
            "--shard: unknown kind '%s' (expected none, optimizer, gradients or parameters)",
            o->shard);
    if (strcmp(o->shard, "none") != 0 && strcmp(o->shard, "optimizer") != 0 && o->model_split > 1)
        return train_usage_error("--shard %s with --model-split: a pipeline's replicas share "
                                 "their stages' optimizer state (--shard optimizer, ZeRO stage "
                                 "1); their gradients and weights are not sharded yet",
                                 o->shard);
    if (o->check_replicas > 0 && o->model_split > 1)
        return train_usage_error("--check-replicas compares data-parallel replicas; with "
                                 "--model-split the stages hold different weights");
    return 0;
}

/* --pct-start, --label-smoothing, --nesterov and --no-decay-1d: where each applies. */
static int check_training_extras(train_opts *o, bool sgd, bool text) {
    bool onecycle = strcmp(o->schedule, "onecycle") == 0;
    if (!isnan(o->pct_start) && !onecycle)
        return train_usage_error("--pct-start applies to --schedule onecycle only");
    o->pct_start = onecycle ? (isnan(o->pct_start) ? 0.3 : o->pct_start) : 0;
    if (o->label_smoothing > 0 && text)
        return train_usage_error("--label-smoothing: the %s's fused next-token loss "
                                 "(tdm_gpt_loss) has no label smoothing; image models only",
                                 o->model);
    if (o->nesterov && (!sgd || !(o->momentum > 0)))
        return train_usage_error("--nesterov needs --optimizer sgd with --momentum > 0 (as "
                                 "PyTorch's SGD), not %s with momentum %g",
                                 o->optimizer, o->momentum);
    if (o->eval_flip && text)
        return train_usage_error("--eval-flip mirrors test images; --model %s has none", o->model);
    if (o->plot_compare && !o->plot_path)
        return train_usage_error("--plot-compare draws other runs into the chart of --plot; "
                                 "give --plot FILE.svg too");
    if (o->validation && text)
        return train_usage_error("--validation holds out test images; --model %s has no "
                                 "test split",
                                 o->model);
    if (o->no_decay_1d && !(o->weight_decay > 0))
        return train_usage_error("--no-decay-1d chooses where --weight-decay applies; it needs "
                                 "--weight-decay > 0");
    if (o->cuda_graphs && o->grad_accum > 1)
        return train_usage_error("--cuda-graphs records a step of one batch; not with "
                                 "--grad-accum %lld",
                                 (long long)o->grad_accum);
    return 0;
}

/* --precision: Lightning's names made ours; fp16 only on GPUs.
 * --reduce-dtype: fp32 or bf16. */
static int check_precision(train_opts *o) {
    static const char *const names[][2] = {
        {"fp32", "fp32"},       {"32-true", "fp32"}, {"32", "fp32"},       {"bf16", "bf16"},
        {"bf16-mixed", "bf16"}, {"fp16", "fp16"},    {"16-mixed", "fp16"}, {"16", "fp16"}};
    const char *canon = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !canon; i++)
        if (!strcmp(o->precision, names[i][0])) canon = names[i][1];
    if (!canon)
        return train_usage_error("--precision: unknown precision '%s' (expected fp32, bf16 or "
                                 "fp16; or 32-true, bf16-mixed, 16-mixed)",
                                 o->precision);
    o->precision = canon;
    static const char *const reduce[] = {"fp32", "bf16", NULL};
    if (!one_of(o->reduce_dtype, reduce))
        return train_usage_error("--reduce-dtype: unknown dtype '%s' (expected fp32 or bf16)",
                                 o->reduce_dtype);
    /* gradients cross a wire under mpirun and between GPUs; the CPU devices of one process
     * average in shared memory (tdm_dp_set_reduce_dtype), a pipeline's replicas in f32 */
    bool cpus = true;
    for (int i = 0; i < o->n_devs; i++) cpus &= o->devs[i].type == TDM_CPU;
    bool shared = o->n_devs > 1 && cpus && !tdm_mpi_launched() && strcmp(o->shard, "parameters");
    if (strcmp(o->reduce_dtype, "fp32") != 0 && (shared || o->model_split > 1))
        return train_usage_error("--reduce-dtype %s applies where gradients cross between "
                                 "processes or GPUs; %s average in fp32",
                                 o->reduce_dtype,
                                 o->model_split > 1 ? "a pipeline's replicas"
                                                    : "the CPU devices of one process (shared "
                                                      "memory)");
    if (strcmp(canon, "fp16") != 0) return 0;
    for (int i = 0; i < o->n_devs; i++)
        if (o->devs[i].type == TDM_CPU)
            return train_usage_error(
                "--precision fp16 needs a GPU: on a CPU device fp16 matrix products have no "
                "kernel here (oneDNN 2.6.3 has none; docs/MIXED_PRECISION.md, \"Where Tandem "
                "will differ\" 3); use --precision bf16");
    return 0;
}

/* --cuda-graphs: one GPU of one process, and a step it can record (tdm_strategy_set_graphs). */
static int check_cuda_graphs(const train_opts *o) {
    if (!o->cuda_graphs) return 0;
    char d[16];
    if (o->n_devs != 1 || o->devs[0].type != TDM_CUDA || tdm_mpi_launched())
        return train_usage_error("--cuda-graphs records one GPU's step: give --devices cuda:N "
                                 "(one GPU, one process; not %s%s)",
                                 o->n_devs > 1 ? "several devices" : tdm_device_str(o->devs[0], d),
                                 tdm_mpi_launched() ? " under mpirun" : "");
    if (!strcmp(o->precision, "fp16"))
        return train_usage_error("--cuda-graphs with --precision fp16: the loss scale changes "
                                 "between steps, a recorded step would keep one; use bf16");
    return 0;
}

/* --tensor-parallel N: a GPT over a multiple of N devices, and what it does not work with yet. */
static int check_tensor_parallel(const train_opts *o, bool text) {
    int64_t tp = o->tensor_parallel;
    if (tp == 1) return 0;
    if (!text)
        return train_usage_error("--tensor-parallel splits a GPT's blocks; --model %s has no "
                                 "tensor-parallel plan (use --model-split or data parallelism)",
                                 o->model);
    if (tdm_mpi_launched() && o->n_devs % tp && tp % o->n_devs) /* the mesh: join_mpi */
        return train_usage_error("--tensor-parallel %lld under mpirun: each process holds whole "
                                 "tensor-parallel groups or a part of one, so --devices a "
                                 "multiple or a divisor of %lld devices a process (it gives %d)",
                                 (long long)tp, (long long)tp, o->n_devs);
    int64_t k = o->model_split; /* 3-D: every stage of every replica on tp devices */
    if (!tdm_mpi_launched() && o->n_devs % (tp * k))
        return train_usage_error("--tensor-parallel %lld%s needs a multiple of %lld devices, "
                                 "--devices gives %d",
                                 (long long)tp, k > 1 ? " with --model-split" : "",
                                 (long long)(tp * k), o->n_devs);
    for (int i = 0; i < o->n_devs && tdm_mpi_launched(); i++)
        if (o->devs[i].type != TDM_CPU)
            return train_usage_error("--tensor-parallel under mpirun runs on CPU devices for now: "
                                     "the mesh's NCCL groups across processes are not written "
                                     "yet (the GPUs of one process: without mpirun)");
    if (k > 1 && tdm_mpi_launched())
        return train_usage_error("--tensor-parallel with --model-split does not work under "
                                 "mpirun yet");
    return 0;
}

/* Checks choices and combinations once every option is known. */
static int check_opts(train_opts *o) {
    static const char *const optimizers[] = {"sgd", "adam", "adamw", NULL};
    static const char *const schedules[] = {"constant", "step",     "cosine",
                                            "linear",   "onecycle", NULL};
    const tdm_model_info *row = tdm_model_find(o->model);
    if (!row) return train_usage_error("--model: %s", tdm_last_error());
    bool text = row->task == TDM_TASK_TEXT; /* a language model and the text task */
    char names[256];
    if (text && (o->image_size || o->transform || o->eval_transform))
        return train_usage_error("--image-size, --transform and --eval-transform apply to image "
                                 "models, not %s",
                                 o->model);
    if (!o->optimizer) o->optimizer = text ? "adamw" : "sgd";
    if (text && strcmp(o->optimizer, "adamw") != 0)
        return train_usage_error(
            "--model %s trains with adamw (weight decay on matrices only), not %s", o->model,
            o->optimizer);
    if (text && !strcmp(o->data, "fashion-mnist"))
        return train_usage_error("--model %s needs --data FILE (text, or an llm.c token shard)",
                                 o->model);
    if (!text && (o->layers || o->heads || o->channels || o->context || o->vocab || o->save_path))
        return train_usage_error(
            "--layers, --heads, --channels, --context, --vocab and --save apply "
            "to --model %s only",
            tdm_model_list(TDM_TASK_TEXT, " or ", names, sizeof names));
    if (o->recompute && !row->units)
        return train_usage_error("--recompute runs the GPT's blocks or a ResNet's stages again "
                                 "in backward; --model %s has no such units",
                                 o->model);
    if (!o->grad_accum) o->grad_accum = 1;
    if (!one_of(o->optimizer, optimizers))
        return train_usage_error(
            "--optimizer: unknown optimizer '%s' (expected sgd, adam or adamw)", o->optimizer);
    static const char *const denormal_modes[] = {"flush", "keep", NULL};
    if (!one_of(o->denormals, denormal_modes))
        return train_usage_error("--denormals: unknown mode '%s' (expected flush or keep)",
                                 o->denormals);
    if (check_shard(o)) return EXIT_USAGE;
    if (!one_of(o->schedule, schedules))
        return train_usage_error("--schedule: unknown schedule '%s' (expected constant, step, "
                                 "cosine, linear or onecycle)",
                                 o->schedule);
    bool sgd = strcmp(o->optimizer, "sgd") == 0;
    if (!sgd && !isnan(o->momentum))
        return train_usage_error("--momentum applies to sgd only (adam and adamw use betas 0.9, "
                                 "0.999)");
    if (isnan(o->lr)) o->lr = sgd ? 0.1 : text ? 3e-4 : 1e-3;
    if (isnan(o->momentum)) o->momentum = sgd ? 0.9 : 0;
    if (o->warmup_steps > 0 && strcmp(o->schedule, "cosine") && strcmp(o->schedule, "linear"))
        return train_usage_error("--warmup-steps needs --schedule cosine or linear%s",
                                 strcmp(o->schedule, "onecycle") ? ""
                                                                 : " (onecycle rises over "
                                                                   "--pct-start of the steps)");
    if (check_training_extras(o, sgd, text)) return EXIT_USAGE;
    if (!o->checkpoint_dir && (o->resume || o->overwrite || o->checkpoint_every > 0))
        return train_usage_error("%s needs --checkpoint-dir", o->resume ? "--resume"
                                                              : o->overwrite
                                                                  ? "--overwrite"
                                                                  : "--checkpoint-every");
    if (o->resume && o->overwrite)
        return train_usage_error("--resume continues the run in --checkpoint-dir and --overwrite "
                                 "deletes it: not both");
    if (o->device_memory && parse_size(o->device_memory, &o->device_memory_bytes))
        return train_usage_error("--device-memory: '%s' is not a size (bytes, or a number with "
                                 "K, M, G or T: 4G, 512M, 1.5GiB)",
                                 o->device_memory);
    o->n_devs = tdm_devices_parse(o->devices, o->devs, TDM_MAX_DEVICES);
    if (o->n_devs < 0) return train_usage_error("--devices: %s", tdm_last_error());
    if (o->n_devs == 0) return train_usage_error("--devices: no device in '%s'", o->devices);
    if (o->batch_per_device && o->batch_size)
        return train_usage_error("--batch-size (global) and --batch-per-device exclude each other");
    if (check_tensor_parallel(o, text)) return EXIT_USAGE;
    /* under mpirun a tensor-parallel process is part of a row; join_mpi counts the rows */
    bool tp_procs = o->tensor_parallel > 1 && tdm_mpi_launched();
    int64_t stage_devs = o->model_split * o->tensor_parallel; /* a replica's devices */
    int64_t replicas = o->model_split > 1 && o->n_devs % stage_devs == 0 ? o->n_devs / stage_devs
                       : tp_procs && o->n_devs < o->tensor_parallel
                           ? 1                               /* a part of a row */
                           : o->n_devs / o->tensor_parallel; /* a bad split: reported below */
    o->batch_size = o->batch_per_device ? o->batch_per_device * replicas
                    : o->batch_size     ? o->batch_size
                                        : 64;
    int64_t sharing = o->tensor_parallel > 1 ? replicas : o->n_devs; /* under mpirun: join_mpi */
    if (o->batch_size < sharing)
        return train_usage_error("--batch-size %lld is smaller than the %lld %s sharing it",
                                 (long long)o->batch_size, (long long)sharing,
                                 o->tensor_parallel > 1 ? "data-parallel rows" : "devices");
    if (check_precision(o) || check_cuda_graphs(o)) return EXIT_USAGE;
    if (o->model_split > 1) {
        static const char *const pipes[] = {"1f1b", "gpipe", NULL};
        if (!one_of(o->pipe_schedule, pipes))
            return train_usage_error("--pipeline: unknown schedule '%s' (expected 1f1b or gpipe)",
                                     o->pipe_schedule);
        if (o->grad_accum > 1)
            return train_usage_error("--model-split does not work with --grad-accum (its "
                                     "--micro-batches accumulate: raise those)");
        if (o->n_devs % o->model_split)
            return train_usage_error(
                "--model-split %lld needs a multiple of %lld devices, --devices "
                "gives %d",
                (long long)o->model_split, (long long)o->model_split, o->n_devs);
        if (o->micro_batches * replicas > o->batch_size)
            return train_usage_error(
                "--batch-size %lld is too small for %lld micro-batches on each of "
                "%lld replicas",
                (long long)o->batch_size, (long long)o->micro_batches, (long long)replicas);
    }
    return 0;
}

/* Parses argv[first, argc) into o. */
static int parse_list(int argc, const char *const *argv, int first, train_opts *o) {
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) return -1;
        if (strncmp(a, "--", 2) != 0) return train_usage_error("unexpected argument '%s'", a);
        const char *eq = strchr(a, '=');
        const opt_spec *s = find_spec(a, eq ? (size_t)(eq - a) : strlen(a));
        if (!s)
            return train_usage_error("unknown option '%.*s'", eq ? (int)(eq - a) : (int)strlen(a),
                                     a);
        if (s->kind == OPT_FLAG) {
            if (eq) return train_usage_error("%s takes no value", s->name);
            *(bool *)((char *)o + s->off) = true;
            continue;
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        char arg[128];
        if (!v) return train_usage_error("%s needs a value (%s)", s->name, spec_arg(s, arg, 128));
        if (!eq && strncmp(v, "--", 2) == 0)
            return train_usage_error("%s needs a value (%s), got option '%s'", s->name,
                                     spec_arg(s, arg, 128), v);
        int rc = parse_value(s, v, o);
        if (rc) return rc;
    }
    return 0;
}

/* --recipe NAME's options, parsed before the command line's (which override them). */
static int apply_recipe(int argc, char **argv, train_opts *o) {
    const char *name = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--recipe") == 0 && i + 1 < argc) name = argv[i + 1];
        if (strncmp(argv[i], "--recipe=", 9) == 0) name = argv[i] + 9;
    }
    if (!name) return 0;
    const train_recipe *r = train_recipe_find(name);
    if (!r) {
        char known[256] = "";
        for (int i = 0; i < N_RECIPES; i++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                     recipes[i].name);
        return train_usage_error("--recipe: unknown recipe '%s' (known: %s)", name, known);
    }
    int n = 0;
    while (r->args[n]) n++;
    return parse_list(n, r->args, 0, o);
}

int train_parse_args(int argc, char **argv, train_opts *o) {
    *o = opts_defaults();
    int rc = apply_recipe(argc, argv, o);
    if (!rc) rc = parse_list(argc, (const char *const *)argv, 1, o);
    return rc ? rc : check_opts(o);
}

/* ---- the files: no output may be an input (paths.h) ------------------------------------ */

/* What --data reads: the directory of fashion-mnist, of cifar10:DIR, or the DIR or FILE. */
static const char *data_path(const train_opts *o) {
    if (tdm_model_find(o->model)->task == TDM_TASK_TEXT) return o->data; /* checked: a row */
    if (strcmp(o->data, "fashion-mnist") == 0) return TDM_FASHION_MNIST_DIR;
    if (!strncmp(o->data, "cifar10:", 8) || !strncmp(o->data, "cifar100:", 9))
        return strchr(o->data, ':') + 1;
    return o->data;
}

/* Every file the options name, checked together before any work: an output that is an input
 * would destroy it (a --log over the data set), and so would two outputs in one file.
 * Returns 0 or EXIT_USAGE. */
static int check_paths(const train_opts *o) {
    char ckpt[4200] = "", *list = o->plot_compare ? strdup(o->plot_compare) : NULL;
    if (o->resume && tdm_checkpoint_latest(o->checkpoint_dir, ckpt, sizeof ckpt, NULL) != 1)
        ckpt[0] = '\0'; /* none yet (or unreadable: the resume says so) */
    tdm_clear_error();
    path_use fixed[] = {
        {.option = "--data", .path = data_path(o)},
        {.option = "--init-from", .path = o->init_from},
        {.option = "--resume", .path = ckpt[0] ? ckpt : NULL, .may_be_held = true},
        {.option = "--log", .path = o->log_path, .output = true},
        {.option = "--plot", .path = o->plot_path, .output = true},
        {.option = "--trace", .path = o->trace_path, .output = true},
        {.option = "--save", .path = o->save_path, .output = true},
        {.option = "--tensorboard", .path = o->tensorboard_dir, .output = true, .dir = true},
        {.option = "--checkpoint-dir", .path = o->checkpoint_dir, .output = true, .dir = true}};
    /* and one entry per FILE of --plot-compare, of which there are fewer than characters */
    int n = (int)(sizeof fixed / sizeof fixed[0]), cap = n + (list ? (int)strlen(list) : 0);
    path_use *u = malloc(sizeof *u * (size_t)cap);
    if (!u || (o->plot_compare && !list)) {
        free(u), free(list);
        return task_error("checking the files given: out of memory");
    }
    memcpy(u, fixed, sizeof fixed);
    char *save = NULL;
    for (char *item = list ? strtok_r(list, ",", &save) : NULL; item && n < cap;
         item = strtok_r(NULL, ",", &save)) {
        sinks_compare_split(item);
        u[n++] = (path_use){.option = "--plot-compare", .path = item};
    }
    char why[3 * PATH_MAX];
    int rc = paths_check(u, n, why, sizeof why) ? train_usage_error("%s", why) : 0;
    free(u), free(list);
    return rc;
}

/* ---- the run ---------------------------------------------------------------------------- */

/* Started by mpirun: this process is one rank of the world; the global batch is split over
 * the ranks and only rank 0 prints and writes files. */
static int join_mpi(train_opts *o, tdm_group **procs, int *argc, char ***argv) {
    if (!(*procs = tdm_mpi_init(argc, argv))) return task_error("mpi: %s", tdm_last_error());
    int n = tdm_group_size(*procs);
    task_rank = tdm_group_rank(*procs);
    tdm_group_set_timeout(*procs, o->timeout);
    if (o->model_split > 1)
        return train_usage_error("--model-split does not work under mpirun yet");
    int tp = (int)o->tensor_parallel;
    if ((int64_t)n * o->n_devs % tp)
        return train_usage_error("--tensor-parallel %d needs devices a multiple of %d, mpirun "
                                 "started %d process%s of %d",
                                 tp, tp, n, n == 1 ? "" : "es", o->n_devs);
    /* the rows the batch splits into: processes, or with tensor parallelism the mesh's
     * data-parallel rows (a tensor-parallel group's devices are one) */
    int rows = tp > 1 ? n * o->n_devs / tp : n;
    if (o->batch_per_device) o->batch_size *= n / train_procs_per_row(o);
    if (o->batch_size % rows)
        return train_usage_error("--batch-size %lld does not split evenly over %d %s",
                                 (long long)o->batch_size, rows,
                                 tp > 1 ? "data-parallel rows" : "processes");
    if (tp == 1 && o->batch_size / n < o->n_devs)
        return train_usage_error("--batch-size %lld gives each of %d processes fewer rows than "
                                 "its %d devices",
                                 (long long)o->batch_size, n, o->n_devs);
    if (tdm_group_rank(*procs) != 0) o->quiet = true;
    return 0;
}

/* Where --tensor-parallel keeps the whole model, which its devices train the parts of (and
 * a checkpoint's whole optimizer): the first CPU device not in --devices, whose memory
 * --device-memory does not cap, as a GPU run's would be the host's. */
static tdm_device host_device(const train_opts *o) {
    for (int k = 0; k < TDM_MAX_DEVICES; k++) {
        bool used = false;
        for (int i = 0; i < o->n_devs && !used; i++)
            used = tdm_device_equal(o->devs[i], tdm_cpu(k));
        if (!used) return tdm_cpu(k);
    }
    return o->devs[0];
}

int train_main(int argc, char **argv) {
    train_opts o;
    int rc = train_parse_args(argc, argv, &o);
    if (rc < 0) {
        train_help(stdout);
        return EXIT_OK;
    }
    if (rc || (rc = check_paths(&o))) return rc;
    /* before any thread starts: devices, loader workers and GEMM threads inherit it */
    tdm_set_flush_denormal(strcmp(o.denormals, "flush") == 0);
    tdm_set_allow_tf32(o.allow_tf32);
    tdm_group *procs = NULL;
    if (tdm_mpi_launched() && (rc = join_mpi(&o, &procs, &argc, &argv))) return rc;
    for (int i = 0; i < o.n_devs && o.device_memory_bytes; i++)
        if (tdm_device_set_memory_limit(o.devs[i], o.device_memory_bytes))
            return train_usage_error("--device-memory: %s", tdm_last_error());
    task t = {0}; /* task_free is safe on what a failed open leaves */
    rc = task_open(&t, &o, o.tensor_parallel > 1 ? host_device(&o) : o.devs[0]);
    if (!rc) rc = trainer_run(&o, &t, procs);
    task_free(&t);
    bool clean = rc == 0 || rc > 128; /* finished, or stopped by a signal with a checkpoint */
    if (procs && !clean) tdm_group_abort(procs, "its training failed"); /* the others stop too */
    if (procs && clean) tdm_mpi_finalize(); /* after a failure MPI_Finalize could wait forever */
    return rc;
}

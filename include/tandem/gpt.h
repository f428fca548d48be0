/* Tandem GPT-2: the model, its optimizer setup, and llm.c's checkpoint format.
 *
 * The model is a tdm_module tree with nanoGPT's names, so it trains, checkpoints and
 * replicates (DataParallel, DDP) like any other module:
 *
 *   transformer.wte.weight            [Vp, C]  token embedding, also the LM head (tied)
 *   transformer.wpe.weight            [maxT, C]
 *   transformer.h.<l>.ln_1.weight/bias, attn.c_attn.weight [3C, C] / bias [3C],
 *                  attn.c_proj.weight [C, C] / bias, ln_2.weight/bias,
 *                  mlp.c_fc.weight [4C, C] / bias [4C], mlp.c_proj.weight [C, 4C] / bias
 *   transformer.ln_f.weight/bias      [C]
 *
 * Forward (tdm_module_forward or tdm_gpt_forward) takes tokens idx [B, T] (i32/i64, T <=
 * maxT) and returns logits [B, T, V]: pre-LayerNorm blocks x += attn(ln_1(x)); x +=
 * mlp(ln_2(x)) with GELU (tanh form) and causal attention (tdm_causal_attention), then ln_f
 * and x @ wte[:V]^T. The LM head is the embedding tensor itself, used twice: autograd adds
 * both gradients into its one .grad, and checkpoints hold it once (there is no
 * "lm_head.weight"). Rows V..Vp-1 of wte are padding, as in llm.c: never read by the head.
 *
 * Errors follow tensor.h: NULL or a negative tdm_status, and tdm_last_error() says what and
 * where (for files: the path and the cause).
 */
#ifndef TANDEM_GPT_H
#define TANDEM_GPT_H

#include "nn.h"
#include "optim.h"
#include "parallel.h"
#include "pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int layers;       /* L: transformer blocks */
    int heads;        /* NH: attention heads; must divide channels */
    int channels;     /* C: width of the residual stream */
    int context;      /* maxT: longest sequence (rows of the position embedding) */
    int vocab;        /* V: tokens the model predicts */
    int padded_vocab; /* Vp >= V: rows of the token embedding (llm.c pads to a multiple of
                         128); 0 means V */
} tdm_gpt_config;

/* A GPT-2 on dev with GPT-2's initialisation drawn from rng (NULL: the default generator):
 * every Linear and Embedding weight N(0, 0.02), the two residual projections (attn.c_proj,
 * mlp.c_proj) N(0, 0.02 / sqrt(2 * layers)), biases 0, LayerNorms weight 1 and bias 0, and
 * wte's padding rows 0. The caller frees it with tdm_module_free. NULL and TDM_ERR_ARG for a
 * config with a non-positive size, heads not dividing channels, or padded_vocab < vocab. */
tdm_module *tdm_gpt_new(const tdm_gpt_config *cfg, tdm_device dev, tdm_rng *rng);
/* The config of a model made by tdm_gpt_new (or a clone of one), or NULL (no error raised)
 * for any other module. Owned by m. */
const tdm_gpt_config *tdm_gpt_config_of(const tdm_module *m);
/* Logits [B, T, V] for tokens idx [B, T]; the same as tdm_module_forward. TDM_ERR_SHAPE when
 * T exceeds the context; TDM_ERR_ARG naming the token for one outside [0, Vp). */
tdm_tensor *tdm_gpt_forward(tdm_module *m, const tdm_tensor *idx);
/* Mean cross-entropy of logits [B, T, V] against targets [B, T] (i32/i64): a scalar. */
tdm_tensor *tdm_gpt_loss(tdm_tensor *logits, const tdm_tensor *targets);

/* Tensor parallelism (Megatron-LM's plan) over the ranks of tp: every rank builds the same
 * whole GPT (the same config and rng state), then calls this on its copy, which then holds
 * its part: each block's attention split by heads (c_attn column-parallel, each rank keeping
 * the q, k and v rows of heads [r H/n, (r+1) H/n); c_proj row-parallel) and its MLP (c_fc
 * column-parallel, c_proj row-parallel); the embeddings, the layer norms and the tied head
 * stay whole on every rank unless the plan splits them. The ranks then compute the whole
 * model's forward and backward together (tdm_column_linear_from's layers; every rank gets the
 * same loss, and the same logits unless vocab_parallel), each stepping the optimizer of its own
 * parameters. Call before tdm_module_parameters(m). The parameters keep their names (holding
 * parts; tdm_tp_gather_whole makes them whole); a split GPT cannot be cloned or written to
 * llm.c's files. TDM_ERR_ARG when the heads, 4 x channels or (vocab_parallel) padded_vocab do
 * not split over the ranks, TDM_ERR_STATE when m is already listed or split. tp must outlive
 * m. */
typedef struct {
    /* Each rank also keeps only its part [r T/n, (r+1) T/n) of the tokens between the split
     * layers (the layer norms and residual adds work on 1/n of the activations; T must split
     * over the ranks); the layer norms' and the row-parallel biases' gradients, each rank's
     * tokens' part, are summed over tp in backward, so every rank ends with the whole ones. */
    bool sequence_parallel;
    /* wte split by rows over the ranks (padded_vocab must split), the token lookup summed
     * (tdm_tp_embedding) and the tied head giving each rank its columns of the logits, [B, T,
     * Vp/n] (the padding's at -1e30), never gathered: the loss is then tdm_gpt_loss_of's */
    bool vocab_parallel;
} tdm_gpt_tp_plan;
/* plan NULL: neither. */
int tdm_gpt_parallelize(tdm_module *m, tdm_group *tp, const tdm_gpt_tp_plan *plan);
/* The mean cross-entropy of m's logits against targets: tdm_gpt_loss, or for a GPT (or a
 * pipeline's last stage of one, tdm_gpt_parallelize_stage's) split with vocab_parallel
 * tdm_tp_cross_entropy over the ranks' columns (the same scalar everywhere). */
tdm_tensor *tdm_gpt_loss_of(tdm_module *m, tdm_tensor *logits, const tdm_tensor *targets);
/* The whole logits [B, T, V] from m's: for a GPT split with vocab_parallel every rank's
 * columns gathered and the padding cut off (a collective over tp: every rank calls it; the
 * same tensor on each), else logits itself. For evaluation and sampling; training takes the
 * loss from the parts (tdm_gpt_loss_of). NULL and an error for a module that is not a GPT or a
 * failed gather. */
tdm_tensor *tdm_gpt_whole_logits(tdm_module *m, tdm_tensor *logits);

/* The GPT as a Sequential of L + 2 layers a pipeline can cut into stages (tdm_pipe_new,
 * tdm_strategy_pipeline_view): its embeddings (wte, wpe: tokens [B, T] in, [B, T, C] out), its
 * L blocks, and its head (ln_f, and a copy of wte: the tied LM head, [B, T, V] out), copies of
 * gpt's layers on its device that compute its logits bit for bit. *tie receives the tie of
 * the two copies of wte (layer 0's wte.weight, layer L + 1's), to hand to tdm_pipe_opts.ties:
 * the pipeline then sums their gradients and they stay equal. The caller frees the result.
 * NULL and TDM_ERR_ARG for a module that is not a GPT, an error from cloning a layer (a GPT
 * split by tdm_gpt_parallelize cannot be). */
tdm_module *tdm_gpt_pipeline_model(const tdm_module *gpt, tdm_pipe_tie *tie);
/* Tensor parallelism inside a pipeline stage (3-D parallelism: tdm_pipe_opts.tp): splits the
 * blocks of stage, a Sequential of layers of tdm_gpt_pipeline_model's (a pipeline's stage
 * module), over tp as tdm_gpt_parallelize splits a GPT's (attention by heads, the MLP column
 * then row), the embeddings and the head staying whole on every rank. With
 * plan->sequence_parallel (plan may be NULL: none) each rank also keeps its part of the
 * tokens between the split layers, the stages handing those parts on (each window's T must
 * split over the ranks); with vocab_parallel the embeddings' wte and the head's copy are split
 * by rows, the last stage giving each rank its columns of the logits (its loss:
 * tdm_gpt_loss_of(stage, ...)). A collective over tp; call before
 * tdm_module_parameters(stage). TDM_ERR_ARG for heads that do not split or not a Sequential,
 * TDM_ERR_SHAPE for a padded_vocab that does not (vocab_parallel), TDM_ERR_STATE for a stage
 * already listed or split. */
int tdm_gpt_parallelize_stage(tdm_module *stage, tdm_group *tp, const tdm_gpt_tp_plan *plan);
/* gpt's parameters from seq, a Sequential tdm_gpt_pipeline_model made from it (or from a GPT of
 * the same config): the embeddings' copy of wte, wpe, the blocks, ln_f. TDM_ERR_ARG for
 * modules that do not match, TDM_ERR_SHAPE naming a layer of another shape. */
int tdm_gpt_from_pipeline_model(tdm_module *gpt, const tdm_module *seq);
/* The reverse: seq's parameters (both copies of wte) from gpt's, e.g. a checkpoint read into
 * gpt handed to a pipeline (tdm_strategy_pipeline_view). Same errors. */
int tdm_gpt_to_pipeline_model(tdm_module *seq, const tdm_module *gpt);

/* AdamW over ps with o's hyper-parameters, except that weight decay applies only to
 * parameters of 2 or more dims (matrices and embeddings; not biases or LayerNorm), as llm.c
 * and nanoGPT do: two parameter groups, through tdm_optim_set_weight_decays. Works for any
 * parameter set; freed with tdm_optim_free. NULL and an error as tdm_adamw_new. */
tdm_optim *tdm_gpt_adamw_new(tdm_paramset *ps, const tdm_adam_opts *o);

/* ---- llm.c's parameter layout and checkpoint files ---------------------------------------
 *
 * llm.c keeps all parameters in one float array, each kind stacked over the layers: wte
 * [Vp, C], wpe [maxT, C], ln1w [L, C], ln1b [L, C], qkvw [L, 3C, C], qkvb [L, 3C], attprojw
 * [L, C, C], attprojb [L, C], ln2w [L, C], ln2b [L, C], fcw [L, 4C, C], fcb [L, 4C], fcprojw
 * [L, C, 4C], fcprojb [L, C], lnfw [C], lnfb [C]. Its fp32 checkpoint (train_gpt2.c's
 * gpt2_build_from_checkpoint, version 3) is a header of 256 little-endian int32: magic
 * 20240326, version 3, maxT, V, L, NH, C, Vp, the rest 0; then that array as little-endian
 * f32, nothing after it. Its bf16 checkpoint (train_gpt2.cu's, version 5) is the same with
 * version 5 and the array as little-endian bf16. */

/* Number of floats in llm.c's array for cfg (0 for an invalid config, or one whose count
 * does not fit in 64 bits). */
int64_t tdm_gpt_llmc_numel(const tdm_gpt_config *cfg);
/* Copies m's parameters (grads: their gradients, 0 where none yet) into out in llm.c's order.
 * n must be tdm_gpt_llmc_numel(config), else TDM_ERR_ARG. */
int tdm_gpt_export_llmc(tdm_module *m, bool grads, float *out, int64_t n);
/* Sets m's parameters from in, n floats in llm.c's order (n checked as above). */
int tdm_gpt_import_llmc(tdm_module *m, const float *in, int64_t n);
/* m's parameter tensors in llm.c's order (wte, wpe, each kind over the layers, lnf): writes at
 * most cap into out (may be NULL) and returns how many there are, or a negative status when m
 * is not a GPT. */
int tdm_gpt_llmc_tensors(tdm_module *m, tdm_tensor **out, int cap);
/* Writes m as an llm.c fp32 checkpoint (version 3), atomically (see io.h). TDM_ERR_ARG when m
 * is not a GPT, TDM_ERR_IO naming path when it cannot be written. */
int tdm_gpt_save_llmc(const char *path, tdm_module *m);
/* tdm_gpt_save_llmc in dtype dt: TDM_F32 writes version 3, TDM_BF16 llm.c's bf16 file
 * (version 5, train_gpt2.cu's: the same header and order, each parameter rounded to bf16 to
 * nearest even, as PyTorch's .to(torch.bfloat16)). TDM_ERR_DTYPE naming dt for any other
 * dtype; otherwise errors as tdm_gpt_save_llmc's. */
int tdm_gpt_save_llmc_as(const char *path, tdm_module *m, tdm_dtype dt);
/* tdm_gpt_save_llmc with the parameters read from sharded checkpoint directory ckpt, which
 * holds m's parameters (tdm_checkpoint_read_params), one tensor at a time: for a model whose
 * parameters are sharded over ranks (ZeRO stage 3), written without gathering it. Needs
 * memory for m's largest parameter only. Errors as tdm_gpt_save_llmc's, and
 * tdm_checkpoint_read_params's naming the checkpoint. */
int tdm_gpt_save_llmc_from(const char *path, tdm_module *m, const char *ckpt);
/* Reads an llm.c checkpoint, fp32 (version 3) or bf16 (version 5, widened exactly to the f32
 * model), into a new GPT on dev (the caller frees it). Everything is checked before the
 * parameters are allocated: TDM_ERR_IO when path cannot be read; TDM_ERR_FORMAT naming path
 * and the cause for a wrong magic, a version other than 3 or 5, a non-positive or
 * inconsistent size in the header (with its byte offset), or a file whose size is not 1024 +
 * 4 (version 3) or 2 (version 5) bytes a parameter (truncated, or trailing bytes).
 * cfg (may be NULL) receives the header's config. */
tdm_module *tdm_gpt_load_llmc(const char *path, tdm_device dev, tdm_gpt_config *cfg);
/* The config of the llm.c model file at path into *cfg, its header and size checked as
 * tdm_gpt_load_llmc checks them, without reading the parameters: what a model will need
 * before it is loaded. TDM_OK, or the error tdm_gpt_load_llmc would give for the file. */
int tdm_gpt_llmc_config(const char *path, tdm_gpt_config *cfg);

#ifdef __cplusplus
}
#endif
#endif

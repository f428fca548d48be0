/* `tandem sample`: text from a GPT checkpoint (llm.c's model file, as `tandem train --model gpt
 * --save` and llm.c write it).
 *
 * Each new token is drawn from softmax(logits / temperature) over the top-k logits (all when
 * k is 0) of the last position, with a Philox uniform keyed by (seed, token index): the same
 * seed and prompt give the same text. The model reads at most its context's last tokens.
 * Tokens are bytes when the vocabulary is 256 (what training on a text file gives); for a
 * larger vocabulary they are printed as numbers (Tandem has no GPT-2 tokenizer). */
#include "sample.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/tandem.h"
#include "train.h"

typedef struct {
    const char *model, *prompt;
    long tokens, top_k;
    double temperature;
    unsigned long long seed;
} sample_opts;

void sample_help(FILE *out) {
    char lm[128]; /* the language models of the registry, whose llm.c files this reads */
    tdm_model_list(TDM_TASK_TEXT, "|", lm, sizeof lm);
    fprintf(out,
            "NAME\n    tandem sample - generate text with a trained GPT\n\n"
            "SYNOPSIS\n    tandem sample --model FILE [OPTION]...\n\n"
            "OPTIONS\n"
            "    --model FILE|DIR\n        An llm.c model file (tandem train --model %s --save "
            "FILE, or llm.c's\n        gpt2_*.bin), or a --checkpoint-dir holding model.bin.\n"
            "    --prompt TEXT\n        The text to continue (its bytes are the first tokens). "
            "Default: a newline.\n"
            "    --tokens N\n        Tokens to generate. Default: 256.\n"
            "    --temperature T\n        Divides the logits before the softmax (> 0; lower is "
            "more conservative).\n        Default: 1.\n"
            "    --top-k K\n        Sample among the K most likely tokens only (0: all). "
            "Default: 0.\n"
            "    --seed S\n        The same seed, model and prompt give the same text. "
            "Default: 0.\n"
            "    -h, --help\n        Show this help and exit.\n\n"
            "EXAMPLE\n"
            "    tandem train --model %s --data book.txt --save gpt.bin\n"
            "    tandem sample --model gpt.bin --prompt 'Once upon' --tokens 200 --top-k 40\n",
            lm, lm);
}

static int usage(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "tandem sample: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, " (see 'tandem sample --help')\n");
    return EXIT_USAGE;
}

/* Parses argv into o; returns 0, -1 for --help, or EXIT_USAGE. */
static int parse(int argc, char **argv, sample_opts *o) {
    *o = (sample_opts){.prompt = "\n", .tokens = 256, .temperature = 1.0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return -1;
        static const char *const known[] = {"--model", "--prompt", "--tokens",
                                            "--top-k", "--seed",   "--temperature"};
        bool ok = false;
        for (int k = 0; k < 6; k++) ok = ok || !strcmp(a, known[k]);
        if (!ok) return usage("unknown option '%s'%s", a, "");
        if (!v) return usage("%s needs a value%s", a, "");
        i++;
        char *end = NULL;
        errno = 0;
        if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--prompt"))
            o->prompt = v;
        else if (!strcmp(a, "--tokens"))
            o->tokens = strtol(v, &end, 10);
        else if (!strcmp(a, "--top-k"))
            o->top_k = strtol(v, &end, 10);
        else if (!strcmp(a, "--seed"))
            o->seed = strtoull(v, &end, 10);
        else
            o->temperature = strtod(v, &end);
        if (end && (end == v || *end || errno)) return usage("%s: '%s' is not a number", a, v);
    }
    if (!o->model) return usage("--model FILE is required%s%s", "", "");
    if (o->tokens < 1 || o->tokens > 1000000)
        return usage("--tokens must be in [1, 1e6]%s%s", "", "");
    if (o->top_k < 0) return usage("--top-k must be >= 0%s%s", "", "");
    if (!(o->temperature > 0) || !isfinite(o->temperature))
        return usage("--temperature must be positive%s%s", "", "");
    return 0;
}

/* Draws a token from logits [V] (modified in place) with temperature and top-k. */
static int draw(float *logits, int V, const sample_opts *o, uint64_t index) {
    if (o->top_k > 0 && o->top_k < V) { /* keep the k largest: threshold at the k-th value */
        float *sorted = malloc(sizeof(float) * (size_t)V);
        memcpy(sorted, logits, sizeof(float) * (size_t)V);
        for (long k = 0; k < o->top_k; k++) { /* partial selection: k is small */
            long best = k;
            for (int j = (int)k + 1; j < V; j++) best = sorted[j] > sorted[best] ? j : best;
            float t = sorted[k];
            sorted[k] = sorted[best], sorted[best] = t;
        }
        float cut = sorted[o->top_k - 1];
        free(sorted);
        for (int j = 0; j < V; j++)
            if (logits[j] < cut) logits[j] = -INFINITY;
    }
    float mx = -INFINITY;
    for (int j = 0; j < V; j++) mx = logits[j] > mx ? logits[j] : mx;
    double sum = 0;
    for (int j = 0; j < V; j++) sum += (logits[j] = expf((logits[j] - mx) / (float)o->temperature));
    uint32_t r[4];
    tdm_philox(o->seed, index, 0, r);
    double u = tdm_u32_to_unit(r[0]) * sum, acc = 0;
    for (int j = 0; j < V; j++)
        if ((acc += logits[j]) > u && logits[j] > 0) return j;
    for (int j = V - 1; j > 0; j--)
        if (logits[j] > 0) return j;
    return 0;
}

/* The last position's logits for the tokens so far (the last `context` of them). */
static int next_logits(tdm_module *m, const int64_t *toks, long n, int ctx, float *out, int V) {
    long start = n > ctx ? n - ctx : 0;
    tdm_scope_begin();
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(1, n - start), TDM_I64, tdm_cpu(0), toks + start);
    tdm_tensor *logits = tdm_gpt_forward(m, x);
    tdm_tensor *last = logits ? tdm_slice(logits, 1, -1, n - start, 1) : NULL;
    int rc = last ? tdm_to_host(last, out, sizeof(float) * (size_t)V) : -1;
    tdm_scope_end();
    return rc;
}

static tdm_module *load(const char *path, tdm_gpt_config *cfg) {
    struct stat st;
    char buf[4200];
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(buf, sizeof buf, "%s/model.bin", path);
        path = buf;
    }
    return tdm_gpt_load_llmc(path, tdm_cpu(0), cfg);
}

int sample_main(int argc, char **argv) {
    sample_opts o;
    int rc = parse(argc, argv, &o);
    if (rc < 0) {
        sample_help(stdout);
        return EXIT_OK;
    }
    if (rc) return rc;
    tdm_gpt_config cfg;
    tdm_module *m = load(o.model, &cfg);
    if (!m) {
        fprintf(stderr, "tandem sample: error: %s\n", tdm_last_error());
        return EXIT_RUNTIME;
    }
    long np = (long)strlen(o.prompt), n = 0;
    int64_t *toks = malloc(sizeof(int64_t) * (size_t)(np + o.tokens + 1));
    float *logits = malloc(sizeof(float) * (size_t)cfg.vocab);
    for (long i = 0; i < np; i++) toks[n++] = (unsigned char)o.prompt[i];
    if (n == 0) toks[n++] = '\n';
    for (long i = 0; i < n; i++)
        if (toks[i] >= cfg.vocab) {
            fprintf(stderr,
                    "tandem sample: error: prompt byte %lld is not below the model's "
                    "vocabulary of %d\n",
                    (long long)toks[i], cfg.vocab);
            rc = EXIT_RUNTIME;
        }
    bool bytes = cfg.vocab <= 256;
    if (!rc && bytes) fwrite(o.prompt, 1, (size_t)np, stdout);
    bool prev = tdm_set_grad_enabled(false);
    for (long i = 0; !rc && i < o.tokens; i++) {
        if (next_logits(m, toks, n, cfg.context, logits, cfg.vocab)) {
            fprintf(stderr, "tandem sample: error: %s\n", tdm_last_error());
            rc = EXIT_RUNTIME;
            break;
        }
        int t = draw(logits, cfg.vocab, &o, (uint64_t)i);
        toks[n++] = t;
        if (bytes)
            putchar(t);
        else
            printf("%d ", t);
    }
    tdm_set_grad_enabled(prev);
    if (!rc) putchar('\n');
    fflush(stdout);
    free(toks);
    free(logits);
    tdm_module_free(m);
    return rc;
}

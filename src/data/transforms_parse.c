/* Transforms as text: torchvision's class names and arguments read from the command line
 * (tdm_transform_parse), the presets, and the text of a transform (tdm_transform_str), which
 * tdm_transform_parse reads back to the same steps.
 *
 *   transform := preset | step { "," step }
 *   step      := Name "(" [ arg { "," arg } ] ")"
 *   arg       := [ keyword "=" ] value
 *   value     := number | name | "(" [ number { "," number } [ "," ] ] ")"   ([ ] as well)
 *
 * Arguments are torchvision's, in its order, positional or by keyword; spaces anywhere. */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/transforms_internal.h"

/* ---- the tables ----------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    float mean[3], std[3];
} tf_norm_set;

static const tf_norm_set norm_sets[] = {
    {"imagenet", {0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}},
    {"cifar10", {0.4914f, 0.4822f, 0.4465f}, {0.2470f, 0.2435f, 0.2616f}},
    /* one grey channel; the same on each channel of a grey image copied to RGB */
    {"fmnist", {0.2860f, 0.2860f, 0.2860f}, {0.3530f, 0.3530f, 0.3530f}},
};
#define N_NORM_SETS (int)(sizeof norm_sets / sizeof norm_sets[0])

const char *tdm_tf_norm_set_name(const float mean[3], const float std[3]) {
    for (int i = 0; i < N_NORM_SETS; i++)
        if (!memcmp(mean, norm_sets[i].mean, sizeof norm_sets[i].mean) &&
            !memcmp(std, norm_sets[i].std, sizeof norm_sets[i].std))
            return norm_sets[i].name;
    return NULL;
}

/* Each step's arguments in torchvision's positional order. */
typedef struct {
    const char *name;
    tdm_transform_kind kind;
    const char *args[5];
} tf_syntax;

static const tf_syntax syntax[] = {
    {"Resize", TDM_TF_RESIZE, {"size"}},
    {"CenterCrop", TDM_TF_CENTER_CROP, {"size"}},
    {"RandomResizedCrop", TDM_TF_RANDOM_RESIZED_CROP, {"size", "scale", "ratio"}},
    {"RandomCrop", TDM_TF_RANDOM_CROP, {"size", "padding"}},
    {"RandomHorizontalFlip", TDM_TF_RANDOM_HFLIP, {"p"}},
    {"ColorJitter", TDM_TF_COLOR_JITTER, {"brightness", "contrast", "saturation", "hue"}},
    {"Grayscale", TDM_TF_GRAYSCALE, {"num_output_channels"}},
    {"Normalize", TDM_TF_NORMALIZE, {"mean", "std"}},
    {"RandomErasing", TDM_TF_RANDOM_ERASING, {"p", "scale", "ratio", "value"}},
};
#define N_SYNTAX (int)(sizeof syntax / sizeof syntax[0])
#define KNOWN_STEPS                                                                                \
    "Resize, CenterCrop, RandomResizedCrop, RandomCrop, RandomHorizontalFlip, ColorJitter, "       \
    "Grayscale, Normalize, RandomErasing"

const char *const tdm_transform_presets[] = {
    "imagenet-train: RandomResizedCrop(S), RandomHorizontalFlip(), Normalize(imagenet)",
    "imagenet-eval: Resize(S * 256 / 224), CenterCrop(S), Normalize(imagenet)",
    "cifar-train: RandomCrop(S, padding=4), RandomHorizontalFlip(), Normalize(cifar10)",
    "cifar-eval: Normalize(cifar10)",
    "none: no steps (the images must already be one size)",
    NULL,
};

/* ---- reading -------------------------------------------------------------------------------- */

typedef struct {
    const char *text, *p;
} tf_parser;

/* TDM_ERR_ARG: what was expected at `at`, with the text around it. */
static int perr(const tf_parser *ps, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int perr(const tf_parser *ps, const char *at, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return tdm_raise(TDM_ERR_ARG, "transform_parse: %s at character %d of \"%s\" (at \"%.24s\")",
                     what, (int)(at - ps->text) + 1, ps->text, at);
}

static void skip_space(tf_parser *ps) {
    while (isspace((unsigned char)*ps->p)) ps->p++;
}

/* An identifier at the cursor into buf (empty when there is none). */
static void read_name(tf_parser *ps, char *buf, size_t cap) {
    size_t n = 0;
    while (isalnum((unsigned char)*ps->p) || *ps->p == '_') {
        if (n + 1 < cap) buf[n++] = *ps->p;
        ps->p++;
    }
    buf[n] = 0;
}

/* One argument's value: numbers (a tuple of n, or one with tuple false) or a name. */
typedef struct {
    const char *at;
    bool tuple;
    int n;
    double v[3];
    char name[32];
} tf_value;

static int read_number(tf_parser *ps, double *v) {
    char *end;
    *v = strtod(ps->p, &end);
    if (end == ps->p || !isfinite(*v)) return perr(ps, ps->p, "expected a number");
    ps->p = end;
    return TDM_OK;
}

static int read_tuple(tf_parser *ps, tf_value *v) {
    char close = *ps->p == '(' ? ')' : ']';
    ps->p++;
    v->tuple = true;
    for (skip_space(ps); *ps->p != close; skip_space(ps)) {
        if (v->n == 3) return perr(ps, ps->p, "expected at most 3 numbers in a tuple");
        int st = read_number(ps, &v->v[v->n++]);
        if (st) return st;
        skip_space(ps);
        if (*ps->p == ',')
            ps->p++;
        else if (*ps->p != close)
            return perr(ps, ps->p, "expected ',' or '%c'", close);
    }
    ps->p++;
    return TDM_OK;
}

static int read_value(tf_parser *ps, tf_value *v) {
    skip_space(ps);
    memset(v, 0, sizeof *v);
    v->at = ps->p;
    if (*ps->p == '(' || *ps->p == '[') return read_tuple(ps, v);
    if (isalpha((unsigned char)*ps->p)) {
        read_name(ps, v->name, sizeof v->name);
        return TDM_OK;
    }
    v->n = 1;
    return read_number(ps, &v->v[0]);
}

/* ---- arguments into a step ------------------------------------------------------------------ */

static bool is_int(double x, double lo) {
    return x == floor(x) && x >= lo && x < 9.0e15;
}

/* size: an int (Resize: the short side; the crops: a square) or (h, w) */
static int set_size(const tf_parser *ps, const tf_value *v, tdm_transform_step *s) {
    if (v->name[0] || v->n < 1 || v->n > 2 || !is_int(v->v[0], 1) ||
        (v->n == 2 && !is_int(v->v[1], 1)))
        return perr(ps, v->at, "expected a size: an integer >= 1 or (h, w)");
    s->size[0] = (int64_t)v->v[0];
    s->size[1] = v->n == 2 ? (int64_t)v->v[1] : (s->kind == TDM_TF_RESIZE ? 0 : s->size[0]);
    return TDM_OK;
}

/* a number: one value, not a tuple or a name, at least lo */
static int get_number(const tf_parser *ps, const tf_value *v, const char *arg, double lo, double hi,
                      float *out) {
    if (v->name[0] || v->tuple || v->n != 1 || v->v[0] < lo || v->v[0] > hi)
        return perr(ps, v->at, "expected a number in [%g, %g] for %s", lo, hi, arg);
    *out = (float)v->v[0];
    return TDM_OK;
}

static int get_pair(const tf_parser *ps, const tf_value *v, const char *arg, float out[2]) {
    if (!v->tuple || v->n != 2 || !(v->v[0] <= v->v[1]) || v->v[0] < 0)
        return perr(ps, v->at, "expected (lo, hi) with 0 <= lo <= hi for %s", arg);
    out[0] = (float)v->v[0], out[1] = (float)v->v[1];
    return TDM_OK;
}

/* mean or std: one value (every channel) or three; std > 0 */
static int get_channels(const tf_parser *ps, const tf_value *v, bool is_std, float out[3]) {
    if (v->name[0] || (v->n != 1 && v->n != 3))
        return perr(ps, v->at, "expected %s as one number or three", is_std ? "std" : "mean");
    for (int k = 0; k < 3; k++) {
        out[k] = (float)v->v[v->n == 1 ? 0 : k];
        if (is_std && !(out[k] > 0.0f)) return perr(ps, v->at, "expected std > 0");
    }
    return TDM_OK;
}

static int set_mean(const tf_parser *ps, const tf_value *v, tdm_transform_step *s, bool *has_std) {
    if (!v->name[0]) return get_channels(ps, v, false, s->mean);
    for (int i = 0; i < N_NORM_SETS; i++)
        if (!strcmp(v->name, norm_sets[i].name)) {
            memcpy(s->mean, norm_sets[i].mean, sizeof s->mean);
            memcpy(s->std, norm_sets[i].std, sizeof s->std);
            *has_std = true;
            return TDM_OK;
        }
    return perr(ps, v->at, "expected mean numbers or imagenet, cifar10 or fmnist");
}

/* Sets argument `arg` of s. has_std: Normalize's std was given (by a named set, too). */
static int set_arg(const tf_parser *ps, const char *arg, const tf_value *v, tdm_transform_step *s,
                   bool *has_std) {
    if (!strcmp(arg, "size")) return set_size(ps, v, s);
    if (!strcmp(arg, "padding")) {
        if (v->name[0] || v->tuple || !is_int(v->v[0], 0))
            return perr(ps, v->at, "expected padding as an integer >= 0");
        s->padding = (int64_t)v->v[0];
        return TDM_OK;
    }
    if (!strcmp(arg, "p")) return get_number(ps, v, arg, 0, 1, &s->p);
    if (!strcmp(arg, "scale")) return get_pair(ps, v, arg, s->scale);
    if (!strcmp(arg, "ratio")) return get_pair(ps, v, arg, s->ratio);
    if (!strcmp(arg, "brightness")) return get_number(ps, v, arg, 0, 1e30, &s->brightness);
    if (!strcmp(arg, "contrast")) return get_number(ps, v, arg, 0, 1e30, &s->contrast);
    if (!strcmp(arg, "saturation")) return get_number(ps, v, arg, 0, 1e30, &s->saturation);
    if (!strcmp(arg, "hue")) {
        float hue = 0.0f;
        int st = get_number(ps, v, arg, 0, 0.5, &hue);
        if (st == TDM_OK && hue != 0.0f)
            return perr(ps, v->at, "hue is not supported (brightness, contrast, saturation are)");
        return st;
    }
    if (!strcmp(arg, "num_output_channels")) {
        if (v->name[0] || v->tuple || (v->v[0] != 1 && v->v[0] != 3))
            return perr(ps, v->at, "expected num_output_channels 1 or 3");
        s->channels = (int)v->v[0];
        return TDM_OK;
    }
    if (!strcmp(arg, "mean")) return set_mean(ps, v, s, has_std);
    if (!strcmp(arg, "std")) {
        *has_std = true;
        return get_channels(ps, v, true, s->std);
    }
    return get_number(ps, v, arg, -1e30, 1e30, &s->value); /* RandomErasing's value */
}

/* ---- steps ---------------------------------------------------------------------------------- */

static const tf_syntax *find_syntax(const char *name) {
    for (int i = 0; i < N_SYNTAX; i++)
        if (!strcmp(name, syntax[i].name)) return &syntax[i];
    return NULL;
}

static int arg_index(const tf_syntax *sy, const char *arg) {
    for (int k = 0; k < 5 && sy->args[k]; k++)
        if (!strcmp(sy->args[k], arg)) return k;
    return -1;
}

/* One argument of the step, at the cursor: by keyword or at position *pos. */
static int read_arg(tf_parser *ps, const tf_syntax *sy, int *pos, unsigned *given,
                    tdm_transform_step *s, bool *has_std) {
    skip_space(ps);
    const char *at = ps->p;
    char key[32];
    read_name(ps, key, sizeof key);
    skip_space(ps);
    int k;
    if (key[0] && *ps->p == '=') {
        ps->p++;
        if ((k = arg_index(sy, key)) < 0)
            return perr(ps, at, "%s has no argument %s", sy->name, key);
    } else {
        ps->p = at; /* not a keyword: a positional value */
        if (*pos >= 5 || !sy->args[*pos])
            return perr(ps, at, "%s takes at most %d arguments", sy->name, *pos);
        k = (*pos)++;
    }
    if (*given & (1u << k)) return perr(ps, at, "%s is given twice", sy->args[k]);
    *given |= 1u << k;
    tf_value v;
    int st = read_value(ps, &v);
    return st ? st : set_arg(ps, sy->args[k], &v, s, has_std);
}

static int read_step(tf_parser *ps, tdm_transform_step *s) {
    skip_space(ps);
    const char *at = ps->p;
    char name[48];
    read_name(ps, name, sizeof name);
    const tf_syntax *sy = find_syntax(name);
    if (!sy && !strcmp(name, "ToTensor"))
        return perr(ps, at, "images are tensors in [0, 1] already: leave ToTensor() out");
    if (!sy)
        return perr(ps, at, "expected a step (" KNOWN_STEPS ") or a preset name, not \"%s\"", name);
    *s = tdm_transform_defaults(sy->kind);
    skip_space(ps);
    if (*ps->p != '(') return perr(ps, ps->p, "expected '(' after %s", name);
    ps->p++;
    int pos = 0;
    unsigned given = 0;
    bool has_std = false;
    for (skip_space(ps); *ps->p != ')'; skip_space(ps)) {
        int st = read_arg(ps, sy, &pos, &given, s, &has_std);
        if (st) return st;
        skip_space(ps);
        if (*ps->p == ',')
            ps->p++;
        else if (*ps->p != ')')
            return perr(ps, ps->p, "expected ',' or ')' in %s(...)", name);
    }
    if ((sy->kind <= TDM_TF_RANDOM_CROP) && !(given & 1))
        return perr(ps, ps->p, "%s needs a size", name);
    if (sy->kind == TDM_TF_NORMALIZE && (!(given & 1) || !has_std))
        return perr(ps, ps->p, "Normalize needs mean and std, or imagenet, cifar10 or fmnist");
    ps->p++;
    return TDM_OK;
}

/* A preset's steps as text, S being image_size. */
static int preset_text(tf_parser *ps, int i, int64_t S, char *buf, size_t cap) {
    long long s = (long long)S;
    bool sized = i <= 2;
    if (sized && S < 1)
        return perr(ps, ps->text, "the preset needs an image size >= 1 (got %lld)", s);
    switch (i) {
    case 0:
        snprintf(buf, cap, "RandomResizedCrop(%lld),RandomHorizontalFlip(),Normalize(imagenet)", s);
        break;
    case 1:
        snprintf(buf, cap, "Resize(%lld),CenterCrop(%lld),Normalize(imagenet)", s * 256 / 224, s);
        break;
    case 2:
        snprintf(buf, cap, "RandomCrop(%lld,padding=4),RandomHorizontalFlip(),Normalize(cifar10)",
                 s);
        break;
    case 3:
        snprintf(buf, cap, "Normalize(cifar10)");
        break;
    default:
        buf[0] = 0;
    }
    return TDM_OK;
}

/* The preset named text (spaces around allowed), or -1. */
static int preset_index(const char *text) {
    while (isspace((unsigned char)*text)) text++;
    size_t n = strlen(text);
    while (n > 0 && isspace((unsigned char)text[n - 1])) n--;
    for (int i = 0; tdm_transform_presets[i]; i++) {
        const char *colon = strchr(tdm_transform_presets[i], ':');
        if ((size_t)(colon - tdm_transform_presets[i]) == n &&
            !strncmp(text, tdm_transform_presets[i], n))
            return i;
    }
    return -1;
}

static tdm_transform *parse_steps(tf_parser *ps) {
    tdm_transform_step steps[TDM_TF_MAX_STEPS];
    int n = 0;
    skip_space(ps);
    if (!*ps->p) {
        perr(ps, ps->p, "expected steps or a preset (none: no steps)");
        return NULL;
    }
    while (*ps->p) {
        if (n == TDM_TF_MAX_STEPS) {
            perr(ps, ps->p, "expected at most %d steps", TDM_TF_MAX_STEPS);
            return NULL;
        }
        if (read_step(ps, &steps[n++])) return NULL;
        skip_space(ps);
        if (*ps->p == ',') {
            ps->p++;
            skip_space(ps);
            if (!*ps->p) break; /* a trailing comma, as Python allows in a list */
        } else if (*ps->p) {
            perr(ps, ps->p, "expected ',' between steps");
            return NULL;
        }
    }
    return tdm_transform_new(n, steps);
}

tdm_transform *tdm_transform_parse(const char *text, int64_t image_size) {
    if (!text) return tdm_raise_null(TDM_ERR_ARG, "transform_parse: no text");
    tf_parser ps = {text, text};
    int preset = preset_index(text);
    if (preset < 0) return parse_steps(&ps);
    char buf[160];
    if (preset_text(&ps, preset, image_size, buf, sizeof buf)) return NULL;
    if (!buf[0]) return tdm_transform_new(0, NULL);
    tf_parser expanded = {buf, buf};
    return parse_steps(&expanded);
}

/* ---- text of a transform -------------------------------------------------------------------- */

typedef struct {
    char *buf;
    size_t cap, len;
} tf_out;

static void emit(tf_out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(tf_out *o, const char *fmt, ...) {
    if (o->len + 1 >= o->cap) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    if (n > 0) o->len = o->len + (size_t)n < o->cap ? o->len + (size_t)n : o->cap - 1;
}

/* The shortest text that reads back as v, Python's way (1.0, not 1). */
static void emit_float(tf_out *o, float v) {
    char t[32];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(t, sizeof t, "%.*g", prec, (double)v);
        if (strtof(t, NULL) == v) break;
    }
    emit(o, "%s%s", t, strpbrk(t, ".e") ? "" : ".0");
}

static void emit_pair(tf_out *o, const char *arg, const float v[2]) {
    emit(o, ", %s=(", arg);
    emit_float(o, v[0]);
    emit(o, ", ");
    emit_float(o, v[1]);
    emit(o, ")");
}

static void emit_channels(tf_out *o, const float v[3]) {
    emit(o, "(");
    emit_float(o, v[0]);
    if (v[1] == v[0] && v[2] == v[0]) {
        emit(o, ",)");
        return;
    }
    for (int k = 1; k < 3; k++) emit(o, ", "), emit_float(o, v[k]);
    emit(o, ")");
}

static void emit_size(tf_out *o, const tdm_transform_step *s) {
    if (s->size[1] == 0 || (s->kind != TDM_TF_RESIZE && s->size[0] == s->size[1]))
        emit(o, "%lld", (long long)s->size[0]);
    else
        emit(o, "(%lld, %lld)", (long long)s->size[0], (long long)s->size[1]);
}

static void emit_step(tf_out *o, const tdm_transform_step *s) {
    emit(o, "%s(", tdm_tf_kind_name(s->kind));
    switch (s->kind) {
    case TDM_TF_RESIZE:
    case TDM_TF_CENTER_CROP:
        emit_size(o, s);
        break;
    case TDM_TF_RANDOM_RESIZED_CROP:
        emit_size(o, s);
        emit_pair(o, "scale", s->scale);
        emit_pair(o, "ratio", s->ratio);
        break;
    case TDM_TF_RANDOM_CROP:
        emit_size(o, s);
        if (s->padding) emit(o, ", padding=%lld", (long long)s->padding);
        break;
    case TDM_TF_RANDOM_HFLIP:
        emit(o, "p="), emit_float(o, s->p);
        break;
    case TDM_TF_COLOR_JITTER: {
        const float v[3] = {s->brightness, s->contrast, s->saturation};
        const char *sep = "";
        for (int k = 0; k < 3; k++) {
            if (v[k] == 0.0f) continue;
            emit(o, "%s%s=", sep, syntax[5].args[k]), emit_float(o, v[k]);
            sep = ", ";
        }
        break;
    }
    case TDM_TF_GRAYSCALE:
        emit(o, "num_output_channels=%d", s->channels);
        break;
    case TDM_TF_NORMALIZE: {
        const char *set = tdm_tf_norm_set_name(s->mean, s->std);
        if (set) {
            emit(o, "%s", set);
            break;
        }
        emit(o, "mean="), emit_channels(o, s->mean);
        emit(o, ", std="), emit_channels(o, s->std);
        break;
    }
    case TDM_TF_RANDOM_ERASING:
        emit(o, "p="), emit_float(o, s->p);
        emit_pair(o, "scale", s->scale);
        emit_pair(o, "ratio", s->ratio);
        emit(o, ", value="), emit_float(o, s->value);
        break;
    default:
        break;
    }
    emit(o, ")");
}

const char *tdm_transform_str(const tdm_transform *tf, char *buf, size_t cap) {
    if (!buf || cap == 0) return buf;
    tf_out o = {buf, cap, 0};
    buf[0] = 0;
    if (!tf) return buf;
    if (tf->n == 0) emit(&o, "none");
    for (int i = 0; i < tf->n; i++) {
        if (i) emit(&o, ", ");
        emit_step(&o, &tf->steps[i]);
    }
    return buf;
}

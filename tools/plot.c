/* Hand-written SVG training curves. Layout: a title line, then three panels side by side,
 *
 *   [ loss: per-step train (faint), train and test per epoch ]  [ accuracy: train, test ]
 *   [ test accuracy against wall-clock seconds: this run ("tandem") and --plot-compare's ]
 *
 * x in epochs (a step s of the run sits at s / steps_per_epoch), or in the third panel in
 * seconds since each process started; y with "nice" ticks (1, 2 or 5 times a power of ten).
 * Per-step losses are averaged into at most MAX_POINTS bins, so the file stays small on long
 * runs. Runs are compared by time because epochs of different programs cost different time:
 * time to accuracy is what a user waits for. */
#include "plot.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define HEIGHT     440
#define PANEL_W    500
#define WIDTH      (3 * PANEL_W)
#define MARGIN_L   64
#define MARGIN_R   24
#define MARGIN_T   78
#define MARGIN_B   52
#define MAX_POINTS 400 /* about one per pixel of the panel */

#define COLOR_TRAIN "#1f77b4"
#define COLOR_TEST  "#ff7f0e"

/* The other runs of the wall-time panel, after this run's COLOR_TEST. */
static const char *const compare_colors[PLOT_MAX_COMPARE] = {"#2ca02c", "#9467bd", "#d62728",
                                                             "#8c564b", "#e377c2", "#17becf"};

typedef struct {
    double x0, x1, y0, y1; /* data range */
    double px, py, pw, ph; /* plot area in pixels */
} frame;

static double sx(const frame *f, double x) {
    return f->px + (x - f->x0) / (f->x1 - f->x0) * f->pw;
}
static double sy(const frame *f, double y) {
    return f->py + f->ph - (y - f->y0) / (f->y1 - f->y0) * f->ph;
}

/* A tick spacing of 1, 2 or 5 times a power of ten giving about `want` intervals. */
static double nice_step(double range, int want) {
    if (!(range > 0)) return 1;
    double raw = range / want, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

/* Writes text with &, <, > and " escaped (titles carry user paths and option values; a
 * --plot-compare label also goes into an attribute). */
static void put_escaped(FILE *f, const char *s) {
    for (; s && *s; s++) {
        if (*s == '&')
            fputs("&amp;", f);
        else if (*s == '"')
            fputs("&quot;", f);
        else if (*s == '<')
            fputs("&lt;", f);
        else if (*s == '>')
            fputs("&gt;", f);
        else
            fputc(*s, f);
    }
}

/* Grid, ticks, tick labels and axis titles. pct: y labels as percentages. */
static void axes(FILE *f, const frame *fr, const char *xlabel, const char *ylabel, bool pct,
                 double xstep, double ystep) {
    fprintf(f, "<g font-size=\"12\" fill=\"#444\">\n");
    for (double y = ceil(fr->y0 / ystep - 1e-9) * ystep; y <= fr->y1 + 1e-9 * ystep; y += ystep) {
        double Y = sy(fr, y);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n",
                fr->px, Y, fr->px + fr->pw, Y);
        if (pct)
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g%%</text>\n", fr->px - 8,
                    Y + 4, round(y * 1000) / 10 + 0.0);
        else
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n", fr->px - 8,
                    Y + 4, round(y / ystep) * ystep + 0.0); /* + 0.0: no "-0" */
    }
    for (double x = fr->x0; x <= fr->x1 + 1e-9; x += xstep) {
        double X = sx(fr, x);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n",
                X, fr->py, X, fr->py + fr->ph);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>\n", X,
                fr->py + fr->ph, X, fr->py + fr->ph + 5);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", X,
                fr->py + fr->ph + 19, x);
    }
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#444\"/>\n",
            fr->px, fr->py, fr->pw, fr->ph);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"13\">%s</text>\n",
            fr->px + fr->pw / 2, fr->py + fr->ph + 40, xlabel);
    fprintf(f,
            "<text transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\" "
            "font-size=\"13\">%s</text>\n",
            fr->px - 48, fr->py + fr->ph / 2, ylabel);
    fprintf(f, "</g>\n");
}

/* One series per epoch (value picked by `field`), as a line with a dot per epoch so a single
 * epoch still shows. Non-finite values are skipped. */
static void epoch_series(FILE *f, const frame *fr, const plot_data *d, size_t field,
                         const char *color, const char *cls) {
    fprintf(f,
            "<g class=\"%s\">\n<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2.2\" "
            "points=\"",
            cls, color);
    for (int i = 0; i < d->n_epochs; i++) {
        double v = *(const double *)((const char *)&d->epochs[i] + field);
        if (isfinite(v)) fprintf(f, "%.1f,%.1f ", sx(fr, d->epochs[i].epoch), sy(fr, v));
    }
    fprintf(f, "\"/>\n");
    for (int i = 0; i < d->n_epochs; i++) {
        double v = *(const double *)((const char *)&d->epochs[i] + field);
        if (isfinite(v))
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
                    sx(fr, d->epochs[i].epoch), sy(fr, v), color);
    }
    fprintf(f, "</g>\n");
}

/* The per-step line is faint behind the epoch lines, and the whole story without them. */
static double step_opacity(const plot_data *d) {
    return d->loss_only ? 1.0 : 0.3;
}

/* Per-step train loss, averaged into bins of `bin` steps, clipped to the frame. */
static void step_series(FILE *f, const frame *fr, const plot_data *d) {
    int64_t bin = (d->n_steps + MAX_POINTS - 1) / MAX_POINTS;
    if (bin < 1) bin = 1;
    fprintf(f,
            "<polyline class=\"train-step\" fill=\"none\" stroke=\"%s\" stroke-opacity=\"%.1f\" "
            "stroke-width=\"1\" points=\"",
            COLOR_TRAIN, step_opacity(d));
    for (int64_t s = 0; s < d->n_steps; s += bin) {
        double sum = 0;
        int64_t k = 0;
        for (int64_t j = s; j < s + bin && j < d->n_steps; j++)
            if (isfinite(d->step_loss[j])) sum += d->step_loss[j], k++;
        if (!k) continue;
        double y = fmin(sum / (double)k, fr->y1);
        double x = (double)(s + (bin + 1) / 2) / (double)d->steps_per_epoch;
        fprintf(f, "%.1f,%.1f ", sx(fr, x), sy(fr, y));
    }
    fprintf(f, "\"/>\n");
}

/* How wide a legend box must be for its longest label (about 7 pixels a character). */
static double legend_width(int n, const char *const *labels) {
    size_t longest = 0;
    for (int i = 0; i < n; i++)
        if (strlen(labels[i]) > longest) longest = strlen(labels[i]);
    return fmax(132, 44 + 7 * (double)longest);
}

/* Legend entries at (x, y) going down, in a box legend_width wide. */
static void legend(FILE *f, double x, double y, int n, const char *const *labels,
                   const char *const *colors, const double *opacity) {
    fprintf(f,
            "<g font-size=\"12\" fill=\"#222\">\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.0f\" "
            "height=\"%d\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n",
            x, y, legend_width(n, labels), 8 + 18 * n);
    for (int i = 0; i < n; i++) {
        double Y = y + 16 + 18 * i;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-opacity=\"%.2f\" stroke-width=\"2.2\"/>\n",
                x + 8, Y - 4, x + 30, Y - 4, colors[i], opacity[i]);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">", x + 36, Y);
        put_escaped(f, labels[i]); /* --plot-compare's labels are the user's */
        fprintf(f, "</text>\n");
    }
    fprintf(f, "</g>\n");
}

/* Whole epochs for runs of 2 to 10 epochs; nice fractions or multiples otherwise. */
static double x_step(double epochs) {
    if (epochs < 2) return nice_step(epochs, 5);
    return epochs <= 10 ? 1 : ceil(nice_step(epochs, 8));
}

static void loss_panel(FILE *f, const plot_data *d, double left) {
    double hi = 0;
    for (int64_t i = 0; i < d->n_steps; i++)
        if (isfinite(d->step_loss[i])) hi = fmax(hi, d->step_loss[i]);
    for (int i = 0; i < d->n_epochs; i++) {
        if (isfinite(d->epochs[i].train_loss)) hi = fmax(hi, d->epochs[i].train_loss);
        if (isfinite(d->epochs[i].test_loss)) hi = fmax(hi, d->epochs[i].test_loss);
    }
    if (!(hi > 0)) hi = 1;
    double ystep = nice_step(hi, 5);
    frame fr = {0,
                d->total_epochs,
                0,
                ceil(hi / ystep) * ystep,
                left + MARGIN_L,
                MARGIN_T,
                PANEL_W - MARGIN_L - MARGIN_R,
                HEIGHT - MARGIN_T - MARGIN_B};
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">Loss</text>\n",
            fr.px, MARGIN_T - 10);
    axes(f, &fr, "epoch", d->loss_label ? d->loss_label : "cross-entropy loss", false,
         x_step(d->total_epochs), ystep);
    step_series(f, &fr, d);
    epoch_series(f, &fr, d, offsetof(epoch_stats, train_loss), COLOR_TRAIN, "train");
    epoch_series(f, &fr, d, offsetof(epoch_stats, test_loss), COLOR_TEST, "test");
    const char *labels[] = {"train (per step)", "train", "test"};
    const char *colors[] = {COLOR_TRAIN, COLOR_TRAIN, COLOR_TEST};
    const double opacity[] = {step_opacity(d), 1, 1};
    int n = d->n_epochs ? 3 : 1;
    legend(f, fr.px + fr.pw - legend_width(n, labels) - 8, fr.py + 8, n, labels, colors, opacity);
}

/* An accuracy axis up to 100% from a little below the lowest value lo, on a tick. */
static double accuracy_axis(double lo, double *ystep) {
    *ystep = nice_step(fmax(1 - lo, 0.05), 5);
    return fmax(0, floor((lo - *ystep / 2) / *ystep) * *ystep);
}

static void accuracy_panel(FILE *f, const plot_data *d, double left) {
    double lo = 1;
    for (int i = 0; i < d->n_epochs; i++) {
        if (isfinite(d->epochs[i].train_acc)) lo = fmin(lo, d->epochs[i].train_acc);
        if (isfinite(d->epochs[i].test_acc)) lo = fmin(lo, d->epochs[i].test_acc);
    }
    double ystep, y0 = accuracy_axis(lo, &ystep);
    frame fr = {0,
                d->total_epochs,
                y0,
                1,
                left + MARGIN_L,
                MARGIN_T,
                PANEL_W - MARGIN_L - MARGIN_R,
                HEIGHT - MARGIN_T - MARGIN_B};
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">Accuracy</text>\n",
            fr.px, MARGIN_T - 10);
    axes(f, &fr, "epoch", "accuracy", true, x_step(d->total_epochs), ystep);
    epoch_series(f, &fr, d, offsetof(epoch_stats, train_acc), COLOR_TRAIN, "train");
    epoch_series(f, &fr, d, offsetof(epoch_stats, test_acc), COLOR_TEST, "test");
    const char *labels[] = {"train", "test"};
    const char *colors[] = {COLOR_TRAIN, COLOR_TEST};
    const double opacity[] = {1, 1};
    /* accuracy rises to the top right, so the legend goes bottom right */
    legend(f, fr.px + fr.pw - legend_width(2, labels) - 8, fr.py + fr.ph - 52, 2, labels, colors,
           opacity);
}

/* One run's test accuracy against wall time: a line with a dot per point, in a group that
 * names the run (data-label) and its point count (data-points), which tests read. */
static void wall_series(FILE *f, const frame *fr, const char *label, const double *wall_s,
                        const double *acc, size_t stride, int n, const char *color) {
    int shown = 0;
    for (int i = 0; i < n; i++) {
        double w = *(const double *)((const char *)wall_s + i * stride);
        shown += isfinite(w) && isfinite(*(const double *)((const char *)acc + i * stride));
    }
    fprintf(f, "<g class=\"wall\" data-label=\"");
    put_escaped(f, label);
    fprintf(f,
            "\" data-points=\"%d\">\n<polyline fill=\"none\" stroke=\"%s\" "
            "stroke-width=\"2.2\" points=\"",
            shown, color);
    for (int pass = 0; pass < 2; pass++) { /* the line, then its dots above it */
        for (int i = 0; i < n; i++) {
            double w = *(const double *)((const char *)wall_s + i * stride);
            double a = *(const double *)((const char *)acc + i * stride);
            if (!isfinite(w) || !isfinite(a)) continue;
            if (pass == 0)
                fprintf(f, "%.1f,%.1f ", sx(fr, w), sy(fr, a));
            else
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n", sx(fr, w),
                        sy(fr, a), color);
        }
        if (pass == 0) fprintf(f, "\"/>\n");
    }
    fprintf(f, "</g>\n");
}

/* The latest second and the lowest accuracy of every run in the wall-time panel. */
static void wall_extent(const plot_data *d, double *t_max, double *lo) {
    *t_max = 0, *lo = 1;
    for (int i = 0; i < d->n_epochs; i++)
        if (isfinite(d->epochs[i].wall_s) && isfinite(d->epochs[i].test_acc))
            *t_max = fmax(*t_max, d->epochs[i].wall_s), *lo = fmin(*lo, d->epochs[i].test_acc);
    for (int c = 0; c < d->n_compare; c++)
        for (int i = 0; i < d->compare[c].n; i++)
            if (isfinite(d->compare[c].wall_s[i]) && isfinite(d->compare[c].acc[i]))
                *t_max = fmax(*t_max, d->compare[c].wall_s[i]),
                *lo = fmin(*lo, d->compare[c].acc[i]);
}

static void wall_panel(FILE *f, const plot_data *d, double left) {
    double t_max, lo;
    wall_extent(d, &t_max, &lo);
    double xstep = nice_step(t_max > 0 ? t_max : 1, 6), ystep, y0 = accuracy_axis(lo, &ystep);
    frame fr = {0,
                ceil(fmax(t_max, 1e-9) / xstep) * xstep,
                y0,
                1,
                left + MARGIN_L,
                MARGIN_T,
                PANEL_W - MARGIN_L - MARGIN_R,
                HEIGHT - MARGIN_T - MARGIN_B};
    fprintf(f,
            "<text x=\"%.1f\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">Test accuracy "
            "vs wall-clock time</text>\n",
            fr.px, MARGIN_T - 10);
    axes(f, &fr, "seconds since the process started", "test accuracy", true, xstep, ystep);
    const char *labels[1 + PLOT_MAX_COMPARE] = {"tandem"};
    const char *colors[1 + PLOT_MAX_COMPARE] = {COLOR_TEST};
    const double opacity[1 + PLOT_MAX_COMPARE] = {1, 1, 1, 1, 1, 1, 1};
    int n = d->n_compare < PLOT_MAX_COMPARE ? d->n_compare : PLOT_MAX_COMPARE;
    for (int c = 0; c < n; c++) {
        const plot_curve *k = &d->compare[c];
        labels[1 + c] = k->label, colors[1 + c] = compare_colors[c];
        wall_series(f, &fr, k->label, k->wall_s, k->acc, sizeof(double), k->n, colors[1 + c]);
    }
    /* this run's last, on top: the others are its reference */
    const epoch_stats *e = d->n_epochs ? d->epochs : NULL;
    wall_series(f, &fr, "tandem", e ? &e->wall_s : NULL, e ? &e->test_acc : NULL,
                sizeof(epoch_stats), d->n_epochs, COLOR_TEST);
    double w = legend_width(1 + n, labels);
    legend(f, fr.px + fr.pw - w - 8, fr.py + fr.ph - 16 - 18 * (1 + n), 1 + n, labels, colors,
           opacity);
}

int plot_write_svg(const char *path, const plot_data *d) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    int width = d->loss_only ? PANEL_W : WIDTH;
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" font-family=\"Helvetica, Arial, sans-serif\">\n",
            width, HEIGHT, width, HEIGHT);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    /* a long title (a recipe's optimizer line) is squeezed into the width rather than cut
     * off at both edges: bold 18 px text takes about 10 px a character */
    char fit[64] = "";
    if ((int)strlen(d->title) * 10 > width - 40)
        snprintf(fit, sizeof fit, " textLength=\"%d\" lengthAdjust=\"spacingAndGlyphs\"",
                 width - 40);
    fprintf(f,
            "<text x=\"%d\" y=\"28\" font-size=\"18\" font-weight=\"bold\" "
            "text-anchor=\"middle\"%s>",
            width / 2, fit);
    put_escaped(f, d->title);
    fprintf(f,
            "</text>\n<text x=\"%d\" y=\"48\" font-size=\"13\" fill=\"#555\" "
            "text-anchor=\"middle\">",
            width / 2);
    put_escaped(f, d->subtitle);
    fprintf(f, "</text>\n");
    loss_panel(f, d, 0);
    if (!d->loss_only) {
        accuracy_panel(f, d, PANEL_W);
        wall_panel(f, d, 2 * PANEL_W);
    }
    fprintf(f, "</svg>\n");
    int bad = ferror(f);
    bad |= fclose(f);
    return bad ? -1 : 0;
}

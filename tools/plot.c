/* Hand-written SVG training curves. Layout: a title line, then two panels side by side,
 *
 *   [ loss: per-step train (faint), train and test per epoch ]  [ accuracy: train, test ]
 *
 * x in epochs (a step s of the run sits at s / steps_per_epoch), y with "nice" ticks
 * (1, 2 or 5 times a power of ten). Per-step losses are averaged into at most MAX_POINTS bins,
 * so the file stays small on long runs. */
#include "plot.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#define WIDTH      1000
#define HEIGHT     440
#define PANEL_W    500
#define MARGIN_L   64
#define MARGIN_R   24
#define MARGIN_T   78
#define MARGIN_B   52
#define MAX_POINTS 400 /* about one per pixel of the panel */

#define COLOR_TRAIN "#1f77b4"
#define COLOR_TEST  "#ff7f0e"

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

/* Writes text with &, <, > escaped (titles carry user paths and option values). */
static void put_escaped(FILE *f, const char *s) {
    for (; s && *s; s++) {
        if (*s == '&')
            fputs("&amp;", f);
        else if (*s == '<')
            fputs("&lt;", f);
        else if (*s == '>')
            fputs("&gt;", f);
        else
            fputc(*s, f);
    }
}

/* Grid, ticks, tick labels and axis titles. pct: y labels as percentages. */
static void axes(FILE *f, const frame *fr, const char *ylabel, bool pct, double xstep,
                 double ystep) {
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
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"13\">epoch</text>\n",
            fr->px + fr->pw / 2, fr->py + fr->ph + 40);
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

/* Legend entries at (x, y) going down; a NULL dash draws a solid line. */
static void legend(FILE *f, double x, double y, int n, const char *const *labels,
                   const char *const *colors, const double *opacity) {
    fprintf(f,
            "<g font-size=\"12\" fill=\"#222\">\n<rect x=\"%.1f\" y=\"%.1f\" width=\"132\" "
            "height=\"%d\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n",
            x, y, 8 + 18 * n);
    for (int i = 0; i < n; i++) {
        double Y = y + 16 + 18 * i;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-opacity=\"%.2f\" stroke-width=\"2.2\"/>\n",
                x + 8, Y - 4, x + 30, Y - 4, colors[i], opacity[i]);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n", x + 36, Y, labels[i]);
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
    axes(f, &fr, d->loss_label ? d->loss_label : "cross-entropy loss", false,
         x_step(d->total_epochs), ystep);
    step_series(f, &fr, d);
    epoch_series(f, &fr, d, offsetof(epoch_stats, train_loss), COLOR_TRAIN, "train");
    epoch_series(f, &fr, d, offsetof(epoch_stats, test_loss), COLOR_TEST, "test");
    const char *labels[] = {"train (per step)", "train", "test"};
    const char *colors[] = {COLOR_TRAIN, COLOR_TRAIN, COLOR_TEST};
    const double opacity[] = {step_opacity(d), 1, 1};
    legend(f, fr.px + fr.pw - 140, fr.py + 8, d->n_epochs ? 3 : 1, labels, colors, opacity);
}

static void accuracy_panel(FILE *f, const plot_data *d, double left) {
    double lo = 1;
    for (int i = 0; i < d->n_epochs; i++) {
        if (isfinite(d->epochs[i].train_acc)) lo = fmin(lo, d->epochs[i].train_acc);
        if (isfinite(d->epochs[i].test_acc)) lo = fmin(lo, d->epochs[i].test_acc);
    }
    /* start the axis a little below the lowest value, on a tick */
    double ystep = nice_step(fmax(1 - lo, 0.05), 5);
    double y0 = fmax(0, floor((lo - ystep / 2) / ystep) * ystep);
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
    axes(f, &fr, "accuracy", true, x_step(d->total_epochs), ystep);
    epoch_series(f, &fr, d, offsetof(epoch_stats, train_acc), COLOR_TRAIN, "train");
    epoch_series(f, &fr, d, offsetof(epoch_stats, test_acc), COLOR_TEST, "test");
    const char *labels[] = {"train", "test"};
    const char *colors[] = {COLOR_TRAIN, COLOR_TEST};
    const double opacity[] = {1, 1};
    /* accuracy rises to the top right, so the legend goes bottom right */
    legend(f, fr.px + fr.pw - 140, fr.py + fr.ph - 52, 2, labels, colors, opacity);
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
    fprintf(f,
            "<text x=\"%d\" y=\"28\" font-size=\"18\" font-weight=\"bold\" "
            "text-anchor=\"middle\">",
            width / 2);
    put_escaped(f, d->title);
    fprintf(f,
            "</text>\n<text x=\"%d\" y=\"48\" font-size=\"13\" fill=\"#555\" "
            "text-anchor=\"middle\">",
            width / 2);
    put_escaped(f, d->subtitle);
    fprintf(f, "</text>\n");
    loss_panel(f, d, 0);
    if (!d->loss_only) accuracy_panel(f, d, PANEL_W);
    fprintf(f, "</svg>\n");
    int bad = ferror(f);
    bad |= fclose(f);
    return bad ? -1 : 0;
}

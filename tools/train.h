/* `tandem train`: option parsing, help and the training loop. */
#ifndef TANDEM_TOOLS_TRAIN_H
#define TANDEM_TOOLS_TRAIN_H

#include <stdio.h>

/* Exit statuses of every subcommand. */
enum { EXIT_OK = 0, EXIT_RUNTIME = 1, EXIT_USAGE = 2 };

/* Runs `tandem train` with argv[0] == "train". Returns an exit status. */
int train_main(int argc, char **argv);
/* The man-page style help of `tandem train`. */
void train_help(FILE *out);
/* One line per option ("  --epochs N  ..."), for the top-level help. */
void train_synopsis(FILE *out);

#endif

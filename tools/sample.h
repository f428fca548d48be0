/* `tandem sample`: generate text from a GPT checkpoint. */
#ifndef TANDEM_TOOLS_SAMPLE_H
#define TANDEM_TOOLS_SAMPLE_H

#include <stdio.h>

/* Runs `tandem sample` with argv[0] == "sample". Returns an exit status. */
int sample_main(int argc, char **argv);
/* The man-page style help of `tandem sample`. */
void sample_help(FILE *out);

#endif

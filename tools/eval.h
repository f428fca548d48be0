/* `tandem eval`: loss and accuracy of saved weights on the test split. */
#ifndef TANDEM_TOOLS_EVAL_H
#define TANDEM_TOOLS_EVAL_H

#include <stdio.h>

/* Runs `tandem eval` with argv[0] == "eval". Returns an exit status. */
int eval_main(int argc, char **argv);
void eval_help(FILE *out);

#endif

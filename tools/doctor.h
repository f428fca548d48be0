/* `tandem doctor`: merges the flight recorders of a run's processes (trainer_debug.h). */
#ifndef TANDEM_TOOLS_DOCTOR_H
#define TANDEM_TOOLS_DOCTOR_H

#include <stdio.h>

/* Runs `tandem doctor DIR` with argv[0] == "doctor". Returns an exit status: EXIT_OK,
 * EXIT_USAGE, or EXIT_RUNTIME naming an unreadable or malformed file. */
int doctor_main(int argc, char **argv);
/* Its help. */
void doctor_help(FILE *out);

#endif

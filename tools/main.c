/* The `tandem` command: dispatches to a subcommand.
 *
 *   tandem train [OPTION]...   train a model (see train.c)
 *   tandem eval --weights F    test loss and accuracy of saved weights (see eval.c)
 *   tandem sample --model F    text from a trained GPT (see sample.c)
 *   tandem devices             list the devices this machine and build offer
 *   tandem doctor DIR          what a run's flight recorders say of a hang (see doctor.c)
 *   tandem help [COMMAND]      help on tandem or on one command
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "doctor.h"
#include "eval.h"
#include "progress.h"
#include "sample.h"
#include "tandem/tandem.h"
#include "train.h"

#define TANDEM_VERSION "0.1.0"

/* The models of the registry (models.h), one line each. */
static void models(FILE *out) {
    for (int i = 0; i < tdm_model_count(); i++) {
        const tdm_model_info *r = tdm_model_at(i);
        fprintf(out, "    %-10s %s, on %s\n", r->name,
                r->task == TDM_TASK_TEXT ? "language model" : "image classifier", r->input);
    }
}

static void help(FILE *out) {
    char images[256];
    tdm_model_list(TDM_TASK_IMAGE, "|", images, sizeof images);
    fprintf(out,
            "NAME\n"
            "    tandem - train neural networks from the command line\n\n"
            "SYNOPSIS\n"
            "    tandem train [OPTION]...\n"
            "    tandem eval --weights FILE [--model %s] [OPTION]...\n"
            "    tandem sample --model FILE [OPTION]...\n"
            "    tandem export [--dtype f32|bf16|f16] CKPT_DIR OUT.safetensors "
            "[STATE_OUT.safetensors]\n"
            "    tandem devices\n"
            "    tandem doctor DIR\n"
            "    tandem help [COMMAND]\n"
            "    tandem --version\n\n"
            "COMMANDS\n"
            "    train      Train an image classifier on Fashion-MNIST, CIFAR or image folders\n"
            "               and report loss and accuracy per epoch, or a language model on a\n"
            "               text file or llm.c token shards (MODELS below). 'tandem train\n"
            "               --help' describes every option.\n"
            "    sample     Generate text with a trained GPT. 'tandem sample --help'.\n"
            "    eval       Test loss and accuracy of saved weights (a checkpoint's\n"
            "               model.safetensors, or PyTorch's). 'tandem eval --help' for options.\n"
            "    export     Write a checkpoint's whole model (a sharded run's too) as one\n"
            "               model.safetensors (PyTorch: load_file + load_state_dict), and with\n"
            "               STATE_OUT its training state with the optimizer's moments, as an\n"
            "               unsharded run writes them. --dtype bf16 or f16 writes the model's\n"
            "               float tensors in that dtype (rounded to nearest even, as PyTorch's\n"
            "               .to()); the state stays f32. Default f32.\n"
            "    devices    List the devices training can use.\n"
            "    doctor     Read the flight recorders a run under mpirun wrote (--debug-dir) and\n"
            "               name the collective the processes disagree on, the one late and the\n"
            "               last each completed. 'tandem doctor --help'.\n"
            "    help       Show this help, or 'tandem help train' for one command.\n\n"
            "MODELS (--model; 'tandem train --help' describes each)\n",
            images);
    models(out);
    fprintf(out, "\nTRAIN OPTIONS (defaults)\n");
    train_synopsis(out);
    fprintf(out, "\nEXIT STATUS\n"
                 "    0 success, 1 runtime error, 2 usage error.\n\n"
                 "EXAMPLES\n"
                 "    tandem train --model mlp --epochs 3\n"
                 "    tandem train --model cnn --optimizer adam --epochs 2 --plot cnn.svg\n"
                 "    tandem train --model gpt --data book.txt --save gpt.bin\n"
                 "    tandem sample --model gpt.bin --prompt 'Once' --top-k 40\n"
                 "    tandem devices\n");
}

/* tandem export [--dtype f32|bf16|f16] CKPT_DIR OUT [STATE_OUT]: a checkpoint (sharded or
 * not) made whole, the model in the dtype asked (Hugging Face's files are often bf16). */
static int export_main(int argc, char **argv) {
    static const char usage[] = "usage: tandem export [--dtype f32|bf16|f16] CKPT_DIR "
                                "OUT.safetensors [STATE_OUT.safetensors]\n";
    tdm_dtype dt = TDM_F32;
    const char *dtype = NULL;
    if (argc > 1 && strncmp(argv[1], "--dtype", 7) == 0) {
        if (argv[1][7] == '=')
            dtype = argv[1] + 8, argc -= 1, argv += 1;
        else if (argv[1][7] == '\0' && argc > 2)
            dtype = argv[2], argc -= 2, argv += 2;
        else if (argv[1][7] == '\0') {
            fprintf(stderr, "tandem export: --dtype needs a value (f32, bf16 or f16)\n%s", usage);
            return EXIT_USAGE;
        }
    }
    if (dtype) {
        if (strcmp(dtype, "bf16") == 0)
            dt = TDM_BF16;
        else if (strcmp(dtype, "f16") == 0)
            dt = TDM_F16;
        else if (strcmp(dtype, "f32") != 0) {
            fprintf(stderr, "tandem export: --dtype '%s': expected f32, bf16 or f16\n%s", dtype,
                    usage);
            return EXIT_USAGE;
        }
    }
    if (argc < 3 || argc > 4 || argv[1][0] == '-') {
        fputs(usage, stderr);
        return EXIT_USAGE;
    }
    if (tdm_checkpoint_export_as(argv[1], argv[2], argc > 3 ? argv[3] : NULL, dt) != TDM_OK) {
        fprintf(stderr, "tandem export: error: %s\n", tdm_last_error());
        return EXIT_RUNTIME;
    }
    return EXIT_OK;
}

/* One CPU device per core this process may use (each with its own thread and memory pool
 * when training on several), the memory they share and the GEMM they run; then the GPUs. */
static int devices(void) {
    int n = tdm_device_count(TDM_CPU);
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    double gib = pages > 0 && page > 0 ? (double)pages * (double)page / (1 << 30) : 0;
    char gemm[128], gpu[256], how[128], bf16[160];
    tdm_gemm_describe(gemm, sizeof gemm);
    bool native = progress_bf16_native(how, sizeof how);
    snprintf(bf16, sizeof bf16, "bf16 %s (%s)", native ? "native" : "emulated", how);
    printf("DEVICE   KIND  DETAILS\n");
    for (int i = 0; i < n; i++)
        printf("cpu:%-4d cpu   core %d, shares %.1f GiB of memory, %s, %s\n", i, i, gib, gemm,
               bf16);
    int gpus = tdm_device_count(TDM_CUDA);
    for (int i = 0; i < gpus; i++)
        if (tdm_device_describe(tdm_cuda(i), gpu, sizeof gpu) == TDM_OK)
            printf("cuda:%-3d cuda  %s\n", i, gpu);
    if (gpus == 0) {
        /* the reason: no CUDA in this build, no driver, or no GPU */
        tdm_device_describe(tdm_cuda(0), gpu, sizeof gpu);
        printf("cuda     -     none: %s\n", tdm_last_error());
    }
    const char *warn = tdm_gemm_warning();
    if (warn) printf("\nwarning: %s\n", warn);
    printf("\nTrain on several with --devices cpu:0,cpu:1 (or cpu:all, or a count)%s.\n",
           gpus > 1 ? ", or cuda:all" : "");
    return EXIT_OK;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        help(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "train") == 0) return train_main(argc - 1, argv + 1);
    if (strcmp(cmd, "eval") == 0) return eval_main(argc - 1, argv + 1);
    if (strcmp(cmd, "sample") == 0) return sample_main(argc - 1, argv + 1);
    if (strcmp(cmd, "export") == 0) return export_main(argc - 1, argv + 1);
    if (strcmp(cmd, "doctor") == 0) return doctor_main(argc - 1, argv + 1);
    if (strcmp(cmd, "devices") == 0) {
        if (argc > 2) {
            fprintf(stderr, "tandem devices: unexpected argument '%s'\n", argv[2]);
            return EXIT_USAGE;
        }
        return devices();
    }
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        if (argc > 2 && strcmp(argv[2], "train") == 0) {
            train_help(stdout);
            return EXIT_OK;
        }
        if (argc > 2 && strcmp(argv[2], "eval") == 0) {
            eval_help(stdout);
            return EXIT_OK;
        }
        if (argc > 2 && strcmp(argv[2], "sample") == 0) {
            sample_help(stdout);
            return EXIT_OK;
        }
        if (argc > 2 && strcmp(argv[2], "doctor") == 0) {
            doctor_help(stdout);
            return EXIT_OK;
        }
        if (argc > 2 && strcmp(argv[2], "devices") != 0) {
            fprintf(stderr,
                    "tandem help: unknown command '%s' (commands: train, eval, sample, devices, "
                    "doctor)\n",
                    argv[2]);
            return EXIT_USAGE;
        }
        help(stdout);
        return EXIT_OK;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("tandem %s\n", TANDEM_VERSION);
        return EXIT_OK;
    }
    fprintf(stderr,
            "tandem: unknown command '%s' (commands: train, eval, sample, devices, doctor, help; "
            "see "
            "'tandem --help')\n",
            cmd);
    return EXIT_USAGE;
}

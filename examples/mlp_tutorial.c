/* PyTorch's "Quickstart" tutorial (pytorch.org/tutorials/beginner/basics/quickstart_tutorial),
 * translated line for line to Tandem: a DataLoader over Fashion-MNIST, a three-layer MLP,
 * cross-entropy, SGD with lr 1e-3, and the tutorial's train() and test() functions with its
 * printing.
 *
 *   mlp_tutorial [LIMIT] [EPOCHS]   (LIMIT: first N training samples and N/6 test samples,
 *                                    0 = all; EPOCHS default 5, as in the tutorial)
 *
 * The Python it mirrors is quoted in the comments. */
#include <stdio.h>
#include <stdlib.h>

#include "tandem/tandem.h"

#define BATCH_SIZE 64

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if (!(x)) {                                                                                \
            fprintf(stderr, "error: %s\n", tdm_last_error());                                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* class NeuralNetwork(nn.Module):
 *     self.flatten = nn.Flatten()
 *     self.linear_relu_stack = nn.Sequential(nn.Linear(28*28, 512), nn.ReLU(),
 *                                            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
 * Tandem names its children like the Sequential it is: "1.weight" instead of
 * "linear_relu_stack.0.weight". */
static tdm_module *neural_network(tdm_device dev) {
    tdm_module *layers[6] = {
        tdm_flatten_new(1, -1), tdm_linear_new(28 * 28, 512, true, dev, NULL),
        tdm_relu_new(),         tdm_linear_new(512, 512, true, dev, NULL),
        tdm_relu_new(),         tdm_linear_new(512, 10, true, dev, NULL),
    };
    for (int i = 0; i < 6; i++) TRY(layers[i]);
    return tdm_sequential_new(6, layers);
}

/* print(model) */
static void print_model(const tdm_module *m) {
    printf("NeuralNetwork(\n");
    for (int i = 0; i < m->n_children; i++) {
        const tdm_module *c = m->children[i];
        char shape[96] = "";
        if (c->n_params) tdm_shape_str(tdm_shape_of(c->params[0]), shape);
        printf("  (%s): %s%s%s\n", m->child_names[i], c->ops->kind, *shape ? " weight " : "",
               shape);
    }
    printf(")\n");
}

/* def train(dataloader, model, loss_fn, optimizer): */
static void train(tdm_loader *dataloader, int64_t size, tdm_module *model, tdm_optim *optimizer,
                  int64_t epoch) {
    tdm_module_train(model, true); /* model.train() */
    TRY(tdm_loader_start_epoch(dataloader, epoch) == TDM_OK);
    tdm_batch b;
    int r;
    while ((r = tdm_loader_next(dataloader, &b)) == 1) { /* for batch, (X, y) in ... */
        tdm_scope_begin();
        tdm_tensor *pred = tdm_module_forward(model, b.x);     /* pred = model(X) */
        tdm_tensor *loss = tdm_cross_entropy(pred, b.y, NULL); /* loss = loss_fn(pred, y) */
        TRY(loss && tdm_backward(loss) == TDM_OK);             /* loss.backward() */
        TRY(tdm_optim_step(optimizer) == TDM_OK);              /* optimizer.step() */
        TRY(tdm_optim_zero_grad(optimizer) == TDM_OK);         /* optimizer.zero_grad() */
        if (b.index % 100 == 0) {
            int64_t current = (b.index + 1) * b.size;
            printf("loss: %7f  [%5lld/%5lld]\n", tdm_item(loss), (long long)current,
                   (long long)size);
        }
        tdm_scope_end();
    }
    TRY(r == 0);
}

/* def test(dataloader, model, loss_fn): */
static void test(tdm_loader *dataloader, int64_t size, tdm_module *model) {
    int64_t num_batches = tdm_loader_batches(dataloader);
    tdm_module_train(model, false); /* model.eval() */
    double test_loss = 0, correct = 0;
    bool prev = tdm_set_grad_enabled(false); /* with torch.no_grad(): */
    TRY(tdm_loader_start_epoch(dataloader, 0) == TDM_OK);
    tdm_batch b;
    int r;
    int64_t p[BATCH_SIZE], y[BATCH_SIZE];
    while ((r = tdm_loader_next(dataloader, &b)) == 1) {
        tdm_scope_begin();
        tdm_tensor *pred = tdm_module_forward(model, b.x), *argmax = NULL;
        test_loss += tdm_item(tdm_cross_entropy(pred, b.y, NULL));
        /* correct += (pred.argmax(1) == y).type(torch.float).sum().item() */
        TRY(tdm_max(pred, 1, false, &argmax));
        TRY(tdm_to_host(argmax, p, sizeof(int64_t) * (size_t)b.size) == TDM_OK);
        TRY(tdm_to_host(b.y, y, sizeof(int64_t) * (size_t)b.size) == TDM_OK);
        for (int64_t i = 0; i < b.size; i++) correct += p[i] == y[i];
        tdm_scope_end();
    }
    TRY(r == 0);
    tdm_set_grad_enabled(prev);
    test_loss /= (double)num_batches;
    correct /= (double)size;
    printf("Test Error: \n Accuracy: %0.1f%%, Avg loss: %8f \n\n", 100 * correct, test_loss);
}

int main(int argc, char **argv) {
    int64_t limit = argc > 1 ? atoll(argv[1]) : 0;
    int epochs = argc > 2 ? atoi(argv[2]) : 5;
    /* training_data = datasets.FashionMNIST(root="data", train=True, ...) */
    tdm_dataset *training_data = tdm_fashion_mnist(NULL, true);
    tdm_dataset *test_data = tdm_fashion_mnist(NULL, false);
    TRY(training_data && test_data);
    if (limit > 0) { /* a prefix of each split, for a quick run */
        if (training_data->n > limit) training_data->n = limit;
        if (test_data->n > (limit + 5) / 6) test_data->n = (limit + 5) / 6;
    }

    /* batch_size = 64; train_dataloader = DataLoader(training_data, batch_size=batch_size) */
    tdm_loader_opts o = tdm_loader_defaults(BATCH_SIZE);
    tdm_loader *train_dataloader = tdm_loader_new(training_data, &o);
    tdm_loader *test_dataloader = tdm_loader_new(test_data, &o);
    TRY(train_dataloader && test_dataloader);

    tdm_batch b;
    TRY(tdm_loader_start_epoch(test_dataloader, 0) == TDM_OK);
    TRY(tdm_loader_next(test_dataloader, &b) == 1);
    char sx[96], sy[96];
    printf("Shape of X [N, C, H, W]: %s\n", tdm_shape_str(tdm_shape_of(b.x), sx));
    printf("Shape of y: %s %s\n", tdm_shape_str(tdm_shape_of(b.y), sy), tdm_dtype_name(b.y->dtype));

    tdm_device device = tdm_cpu(0);
    char dn[16];
    printf("Using %s device\n", tdm_device_str(device, dn));
    tdm_module *model = neural_network(device); /* model = NeuralNetwork() */
    TRY(model);
    print_model(model);

    /* loss_fn = nn.CrossEntropyLoss(); optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) */
    tdm_paramset *params = tdm_module_parameters(model);
    TRY(params);
    tdm_sgd_opts so = tdm_sgd_defaults(1e-3f);
    tdm_optim *optimizer = tdm_sgd_new(params, &so);
    TRY(optimizer);

    for (int t = 0; t < epochs; t++) {
        printf("Epoch %d\n-------------------------------\n", t + 1);
        train(train_dataloader, training_data->n, model, optimizer, t);
        test(test_dataloader, test_data->n, model);
    }
    printf("Done!\n");

    tdm_optim_free(optimizer);
    tdm_module_free(model);
    tdm_loader_free(train_dataloader);
    tdm_loader_free(test_dataloader);
    tdm_dataset_free(training_data);
    tdm_dataset_free(test_data);
    return 0;
}

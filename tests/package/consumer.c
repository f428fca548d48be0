/* Builds against an installed Tandem (find_package or pkg-config) and runs one step of
 * autograd: the check that the installed package is complete. */
#include <stdio.h>
#include <tandem/tandem.h>

int main(void) {
    tdm_tensor *w = tdm_full(TDM_SHAPE(2), 3.0f, TDM_F32, tdm_cpu(0));
    tdm_requires_grad_(w, true);
    tdm_scope_begin();
    int rc = tdm_backward(tdm_sum_all(tdm_mul(w, w)));
    tdm_scope_end();
    float g[2] = {0};
    tdm_to_host(w->grad, g, sizeof g);
    tdm_tensor_free(w);
    if (rc != 0 || g[0] != 6.0f) {
        fprintf(stderr, "consumer: wrong gradient %g (%s)\n", g[0], tdm_last_error());
        return 1;
    }
    printf("consumer: ok\n");
    return 0;
}

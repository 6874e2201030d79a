/* The engine's C kernels for the CPU, built by cpu_build.py as one library: the GGUF block matmuls (cpu_gguf.c),
 * the per-token ops (cpu_layers.c) and the whole decoder layer (cpu_decode.c) share one team of threads
 * (cpu_pool.c), and the layer inlines the others' static functions.
 */
#include "cpu_pool.c"
#include "cpu_gguf.c"
#include "cpu_layers.c"
#include "cpu_decode.c"

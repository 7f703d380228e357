/* The C ABI of megamoe: what bindings (the Python package loads it with ctypes) call.
 *
 * Why C: a plain C surface lets Python reach the library without compiling anything against PyTorch
 * or the Python headers, so the C++ core stays framework-free and one build of libmegamoe serves any
 * Python or torch version. Only fixed-width types and opaque handles cross it; nothing throws.
 *
 * Errors: every call returns an int32 status (MEGAMOE_OK or one of the codes below, the same numbers as
 * megamoe::StatusCode); on failure megamoe_last_error() holds the message for the calling thread until
 * its next megamoe call (at most MEGAMOE_LAST_ERROR_CAPACITY - 1 bytes; longer messages are truncated).
 *
 * Streams: a virtual-rank group runs each rank on a stream of its own (the ranks must run at the same
 * time: they meet at device barriers). The forward/backward calls take the caller's stream (torch's
 * current stream, as void* so this header needs no CUDA headers) and join it both ways with events: the
 * ranks' work starts after everything already enqueued on the caller's stream, and work enqueued on the
 * caller's stream afterwards waits for every rank. The call does not synchronise the host, and under
 * CUDA stream capture the fork/join becomes part of the captured graph. Because the ranks must be
 * enqueued together, one call takes every rank's arguments (an array of num_ranks).
 *
 * Process groups (megamoe_pgroup): one process per GPU, each holding one rank. Rank 0 creates a bootstrap
 * id, the caller sends its bytes to every rank (torch.distributed, MPI, a file), and every rank then calls
 * megamoe_pgroup_create with it: a collective that returns once all num_ranks processes have joined and
 * agreed, or fails on every rank: the ranks compare their configs, options and workspace layouts (the
 * message names the field that differs), a rank whose own setup fails tells the others why, and a rank
 * that never joins is a MEGAMOE_TIMEOUT after options->wait_timeout_seconds. megamoe_pgroup_destroy is a
 * collective too: a peer may still be writing into this rank's workspace, so the memory is freed once
 * every rank has destroyed its handle (each waits up to the timeout for the others; past it the
 * workspace stays allocated until the process exits and stderr says so). Forward/backward take this
 * rank's arguments only and join the caller's stream with the rank's stream as above; every rank must
 * make the same sequence of calls, since ranks meet at device barriers. A virtual-rank call checks every
 * rank's arguments before it enqueues anything for any rank. */
#ifndef MEGAMOE_MEGAMOE_H_
#define MEGAMOE_MEGAMOE_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature or a struct below changes; bindings refuse a library of another version.
 * Functions and structs added without changing existing ones keep the version: a binding finds out that
 * a library lacks them by their symbols (the Python binding checks every one it declares). */
#define MEGAMOE_ABI_VERSION 5

#define MEGAMOE_OK 0
#define MEGAMOE_INVALID_ARGUMENT 1
#define MEGAMOE_CAPACITY_EXCEEDED 2
#define MEGAMOE_TIMEOUT 3
#define MEGAMOE_CUDA_ERROR 4
#define MEGAMOE_NOT_SUPPORTED 5
#define MEGAMOE_INTERNAL 6

#define MEGAMOE_LAST_ERROR_CAPACITY 1024

#define MEGAMOE_PRECISION_BF16 0
#define MEGAMOE_PRECISION_FP8_BLOCKWISE 1

/* megamoe::LayerConfig. */
typedef struct megamoe_config {
  int64_t hidden;
  int64_t intermediate;
  int64_t num_experts;
  int64_t top_k;
  int64_t num_ranks;
  int64_t max_tokens_per_rank;
  int32_t precision; /* MEGAMOE_PRECISION_* */
  int32_t reserved;  /* 0 */
} megamoe_config;

/* megamoe::LayerOptions; megamoe_default_options() fills the library's defaults. */
typedef struct megamoe_options {
  int64_t expert_row_capacity; /* 0 = worst case */
  double wait_timeout_seconds;
  int32_t forward_path;        /* MEGAMOE_FORWARD_MODULAR or MEGAMOE_FORWARD_FUSED */
  int32_t recompute_h;         /* 0: the forward keeps h for the backward; 1: the backward recomputes it */
  int32_t backward_path;       /* MEGAMOE_BACKWARD_MODULAR or MEGAMOE_BACKWARD_FUSED */
  int32_t reserved;            /* 0 */
} megamoe_options;

#define MEGAMOE_FORWARD_MODULAR 0
#define MEGAMOE_FORWARD_FUSED 1
#define MEGAMOE_BACKWARD_MODULAR 0
#define MEGAMOE_BACKWARD_FUSED 1

/* One rank's forward (shapes in docs/MODEL.md): device pointers, bf16 unless stated. */
typedef struct megamoe_forward_args {
  int64_t num_tokens;          /* T, 0 <= T <= max_tokens_per_rank */
  const void* x;               /* [T, H] */
  const void* topk_idx;        /* [T, K] global expert ids, -1 = masked; int64, or int32 (below) */
  int32_t topk_idx_is_int32;   /* 0: int64, 1: int32 */
  int32_t reserved;            /* 0 */
  const float* topk_weights;   /* [T, K] fp32 */
  const void* w13;             /* [E_local, 2I, H] */
  const void* w2;              /* [E_local, H, I] */
  void* out;                   /* [T, H] */
  uint64_t weights_version;    /* fp8-blockwise: 0 = quantize w13 / w2 on every call; a repeated nonzero value
                                  with the same pointers promises unchanged weights (their quantized copies
                                  are reused). Added in ABI version 3. */
  /* fp8-blockwise, optional (all four or none; added in ABI version 4): the weights already quantized, e4m3
   * codes [E_local, 2I, H] and [E_local, H, I] with fp32 scales [E_local * 2I / 128, H / 128] and
   * [E_local * H / 128, I / 128] (128 x 128 blocks, row-major; ForwardArgs in megamoe/layer.hpp). With them
   * w13 and w2 are not read and may be NULL, and weights_version is not used. */
  const void* w13_fp8;
  const float* w13_scales;
  const void* w2_fp8;
  const float* w2_scales;
} megamoe_forward_args;

/* One rank's backward; uses the routing of the latest forward of the same group. */
typedef struct megamoe_backward_args {
  const void* d_out;              /* [T, H] */
  void* d_x;                      /* [T, H] */
  float* d_topk_weights;          /* [T, K] fp32 */
  float* d_w13;                   /* [E_local, 2I, H] fp32 */
  float* d_w2;                    /* [E_local, H, I] fp32 */
  int32_t accumulate_weight_grads; /* 1: add into the weight gradients */
  int32_t reserved;                /* 0 */
  /* Since ABI version 5: or the weight gradients in bf16 (either precision), each value rounded once; exactly one
     of the pairs d_w13 / d_w2 and d_w13_bf16 / d_w2_bf16 is given (BackwardArgs in layer.hpp). */
  void* d_w13_bf16;               /* [E_local, 2I, H] bf16 */
  void* d_w2_bf16;                /* [E_local, H, I] bf16 */
} megamoe_backward_args;

typedef struct megamoe_vgroup megamoe_vgroup; /* R virtual ranks on one GPU */

int32_t megamoe_abi_version(void);
/* 1 when the library was built with CUDA (the GPU layer exists), 0 otherwise. */
int32_t megamoe_built_with_cuda(void);
/* 1 when the library carries its own C++ runtime (MEGAMOE_PRIVATE_CXX_RUNTIME, as the Python package builds
   it), 0 when it shares the process's: inside a PyTorch process the latter has crashed (two runtimes mixed). */
int32_t megamoe_private_cxx_runtime(void);
/* The calling thread's message for its latest failed call ("" after a success); never NULL. */
const char* megamoe_last_error(void);
/* "ok", "invalid argument", ...; never NULL. */
const char* megamoe_status_name(int32_t code);

int32_t megamoe_default_options(megamoe_options* options);
int32_t megamoe_validate_config(const megamoe_config* config);
/* Symmetric workspace bytes per rank. options may be NULL (defaults). Needs a CUDA build. */
int32_t megamoe_workspace_bytes(const megamoe_config* config, const megamoe_options* options, int64_t* bytes);

/* On the current CUDA device; config->num_ranks virtual ranks. options may be NULL (defaults).
 * *group is NULL on failure. */
int32_t megamoe_vgroup_create(const megamoe_config* config, const megamoe_options* options,
                              megamoe_vgroup** group);
/* Once per handle; NULL is fine. Waits for the group's work first. Calls on a destroyed handle are
 * undefined; the library tags live handles and reports (or, for destroy, ignores) a dead one where it
 * still can, as a diagnostic only. */
void megamoe_vgroup_destroy(megamoe_vgroup* group);
int32_t megamoe_vgroup_num_ranks(const megamoe_vgroup* group, int32_t* num_ranks);
/* Rows each rank can receive per call (the options' capacity after defaults). */
int32_t megamoe_vgroup_expert_row_capacity(const megamoe_vgroup* group, int64_t* rows);

/* args: num_ranks entries, rank r at args[r]. stream: the caller's cudaStream_t (NULL = legacy default
 * stream), joined with the ranks' streams as described at the top. */
int32_t megamoe_vgroup_forward(megamoe_vgroup* group, const megamoe_forward_args* args, void* stream);
int32_t megamoe_vgroup_backward(megamoe_vgroup* group, const megamoe_backward_args* args, void* stream);
/* Waits for every rank, then returns (and clears) the first error recorded on the device by any rank. */
int32_t megamoe_vgroup_synchronize_and_check(megamoe_vgroup* group);

/* ---- process groups: one rank per process (see the top); additions to ABI version 1 ---- */

#define MEGAMOE_BOOTSTRAP_ID_BYTES 128

/* Opaque bytes (an NCCL unique id) that rank 0 creates and every rank passes to megamoe_pgroup_create. */
typedef struct megamoe_bootstrap_id {
  char bytes[MEGAMOE_BOOTSTRAP_ID_BYTES];
} megamoe_bootstrap_id;

typedef struct megamoe_pgroup megamoe_pgroup; /* this process's rank of a group of config->num_ranks */

/* On rank 0 only. Needs a CUDA build with NCCL (MEGAMOE_NOT_SUPPORTED otherwise). */
int32_t megamoe_create_bootstrap_id(megamoe_bootstrap_id* id);
/* Collective over the config->num_ranks processes (see the top), rank in [0, num_ranks), on the current
 * CUDA device; allocates this rank's symmetric workspace and maps every peer's. options may be NULL
 * (defaults). *group is NULL on failure. */
int32_t megamoe_pgroup_create(const megamoe_config* config, const megamoe_options* options, int32_t rank,
                              const megamoe_bootstrap_id* id, megamoe_pgroup** group);
/* Once per handle; NULL is fine. Waits for this rank's work first. Same diagnostics as vgroup_destroy. */
void megamoe_pgroup_destroy(megamoe_pgroup* group);
int32_t megamoe_pgroup_rank(const megamoe_pgroup* group, int32_t* rank);
int32_t megamoe_pgroup_num_ranks(const megamoe_pgroup* group, int32_t* num_ranks);
int32_t megamoe_pgroup_expert_row_capacity(const megamoe_pgroup* group, int64_t* rows);
/* args: this rank's arguments (one struct). stream: the caller's cudaStream_t, joined as described at the top. */
int32_t megamoe_pgroup_forward(megamoe_pgroup* group, const megamoe_forward_args* args, void* stream);
int32_t megamoe_pgroup_backward(megamoe_pgroup* group, const megamoe_backward_args* args, void* stream);
/* Waits for this rank's work, then returns (and clears) the first error this rank recorded on the device. */
int32_t megamoe_pgroup_synchronize_and_check(megamoe_pgroup* group);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MEGAMOE_MEGAMOE_H_ */

/* certkv C API.
 *
 * Opaque handles with create/free pairs; every fallible call returns a certkv_status, and on
 * failure certkv_last_error() gives a one-line message naming the file, flag or value at fault.
 * Thread safety: a model may be shared by many sessions and threads (it is read-only after
 * load); a session or sampler is used by one thread at a time. certkv_last_error is per thread.
 */
#ifndef CERTKV_CERTKV_H_
#define CERTKV_CERTKV_H_

#include <stddef.h>
#include <stdint.h>

#include "certkv/certkv_export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum certkv_status {
  CERTKV_OK = 0,
  CERTKV_ERR_INVALID_ARGUMENT = 1,
  CERTKV_ERR_NOT_FOUND = 2,
  CERTKV_ERR_CORRUPT = 3,
  CERTKV_ERR_UNSUPPORTED = 4,
  CERTKV_ERR_OUT_OF_MEMORY = 5,
  CERTKV_ERR_OUT_OF_RANGE = 6,
  CERTKV_ERR_IO = 7,
  CERTKV_ERR_INTERNAL = 8
} certkv_status;

/* Static string for a status ("ok", "not found", ...). */
CERTKV_API const char* certkv_status_string(certkv_status status);
/* Message of the last failed call on this thread ("" if none). Valid until the next call. */
CERTKV_API const char* certkv_last_error(void);

/* ---- Models ------------------------------------------------------------------------------ */

typedef struct certkv_model certkv_model;

typedef struct certkv_model_info {
  const char* architecture; /* "llama", "qwen2", "qwen3"; owned by the model */
  const char* name;         /* owned by the model */
  const char* rope_layout;  /* "interleaved" or "half-split" */
  const char* weight_type;  /* type of most weight matrices, e.g. "Q4_1" */
  int32_t n_layers;
  int32_t dim;
  int32_t n_heads;
  int32_t n_kv_heads;
  int32_t head_dim;
  int32_t ffn_dim;
  int32_t n_vocab;
  int64_t context_length;
  float rope_theta;
  uint64_t weight_bytes;
} certkv_model_info;

/* Loads a GGUF file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json). */
CERTKV_API certkv_status certkv_model_load(const char* path, certkv_model** out);
/* Loads a llama2.c legacy checkpoint and its tokenizer.bin. */
CERTKV_API certkv_status certkv_model_load_llama2c(const char* checkpoint_path,
                                                   const char* tokenizer_path, certkv_model** out);
CERTKV_API void certkv_model_free(certkv_model* model);
CERTKV_API certkv_status certkv_model_get_info(const certkv_model* model, certkv_model_info* info);

/* add_special: add BOS when the model's vocabulary asks for it (tokenizer.ggml.add_bos_token).
 * parse_special: control-token text such as "<|im_start|>" becomes that token.
 * tokens: [capacity]. On success *n_tokens is the count written. If capacity is too small,
 * returns CERTKV_ERR_OUT_OF_RANGE with *n_tokens set to the count needed. */
CERTKV_API certkv_status certkv_tokenize(const certkv_model* model, const char* text,
                                         size_t text_bytes, int add_special, int parse_special,
                                         int32_t* tokens, int32_t capacity, int32_t* n_tokens);
/* Bytes of one token (no NUL added). buf: [capacity]; *n_bytes as for certkv_tokenize. */
CERTKV_API certkv_status certkv_token_to_piece(const certkv_model* model, int32_t token, char* buf,
                                               size_t capacity, size_t* n_bytes);
/* The text of tokens[0, n_tokens): their pieces in order, less the one space a SentencePiece
 * model prepends to the start of each stretch of text (so the text certkv_tokenize read comes back);
 * control and unknown tokens (e.g. "<|im_end|>") give their text when render_special, else nothing.
 * buf: [capacity] (no NUL added); *n_bytes as for certkv_tokenize. A token outside the vocabulary:
 * CERTKV_ERR_INVALID_ARGUMENT naming its index. */
CERTKV_API certkv_status certkv_detokenize(const certkv_model* model, const int32_t* tokens,
                                           size_t n_tokens, int render_special, char* buf,
                                           size_t capacity, size_t* n_bytes);
/* 1 if the token ends a generation (end of sequence / end of turn), else 0. */
CERTKV_API int certkv_token_is_end(const certkv_model* model, int32_t token);

typedef struct certkv_chat_message {
  const char* role; /* "system", "user", "assistant" */
  const char* content;
} certkv_chat_message;

/* Formats messages with the model's chat template (NUL-terminated into buf[capacity]);
 * *n_bytes excludes the NUL; too small a buffer: CERTKV_ERR_OUT_OF_RANGE, *n_bytes = needed. */
CERTKV_API certkv_status certkv_apply_chat_template(const certkv_model* model,
                                                    const certkv_chat_message* messages,
                                                    size_t n_messages, int add_generation_prompt,
                                                    char* buf, size_t capacity, size_t* n_bytes);
/* The tokens of a chat prompt: the chat template's text with its special tokens parsed and each
 * message's role and content tokenized as plain text (the text of a turn marker such as
 * "<|im_start|>" inside a message stays text, so a message cannot open a turn of its own), with
 * BOS when the model asks for it. Tokenizing certkv_apply_chat_template's text with
 * parse_special gives the same tokens unless a message holds such text. tokens: [capacity];
 * *n_tokens as for certkv_tokenize. */
CERTKV_API certkv_status certkv_tokenize_chat(const certkv_model* model, const certkv_chat_message* messages,
                                              size_t n_messages, int add_generation_prompt, int32_t* tokens,
                                              int32_t capacity, int32_t* n_tokens);

/* ---- Sessions (one sequence with its own paged KV cache) ---------------------------------- */

typedef struct certkv_session certkv_session;

typedef struct certkv_session_params {
  int64_t context_tokens;        /* 0: the model's context length */
  int32_t n_threads;             /* >= 1 */
  int32_t block_tokens;          /* tokens per KV page, default 16 */
  int32_t prefill_chunk_tokens;  /* default 512 */
  const char* kv;                /* KV storage scheme: "bf16" (raw pages) or "gaac" (full blocks
                                    in lossless GAAC slots; same logits bit for bit);
                                    "fp8-e4m3-pages" / "fp8-e5m2-pages" (every page raw FP8,
                                    values rounded at write); "gaac-e4m3" / "gaac-e5m2" (FP8
                                    pages, full blocks in GAAC slots; same logits as
                                    fp8-*-pages); lossy schemes with the meter (bf16 tails, full
                                    blocks quantized, exact blocks kept in a backing store):
                                    "fp8-e4m3", "fp8-e5m2" (raw casts), "fp8-e4m3-scaled",
                                    "rtn8", "rtn4", "kivi2" (Tier A witness), "dither8"
                                    (certified INT8, Tier B) */
  int capture_queries;           /* keep post-RoPE queries of the last position (for dump-kv) */
  const char* activations;       /* weight-product arithmetic: "int8" (activations quantized per
                                    32-block as llama.cpp does; default) or "f32" (exact fp32) */
  const char* gaac_calibration;  /* kv "gaac*": path of the model's GAAC calibration file
                                    (safetensors, certkv-gaac-calibration/1) of the scheme's
                                    element (bf16, e4m3, e5m2); null: the model calibrates itself
                                    on a built-in public-domain text (one prefill of up to 4,096
                                    tokens) and caches the result beside the model file (or in
                                    $CERTKV_CACHE_DIR). Lossy schemes:
                                    optional, a bf16 calibration: the backing store keeps its
                                    exact blocks GAAC-coded. Ignored otherwise. Loaded once per
                                    model and path. */
  int32_t outlier_pairs;         /* dither8: RoPE pairs per (layer, kv_head) kept exact; -1:
                                    default (4) */
  int32_t recent_window_tokens;  /* lossy schemes: newest tokens kept bf16; -1: scheme default
                                    (kivi2 128, others 0); a multiple of block_tokens */
  int meter;                     /* lossy schemes: meter every decode step (default 1) */
  double meter_delta;            /* request failure budget of the Tier B certificate, (0, 1);
                                    default 1e-2 */
  double meter_tau;              /* coverage threshold and gate threshold, > 0 (default 0.2;
                                    >= 1 ranks risk instead of certifying) */
  int gate;                      /* repair from the exact backing store when a meter exceeds
                                    tau (default 0) */
  int64_t meter_planned_steps;   /* T of delta_loc = delta / (layers * heads * T); 0: context */
  int64_t meter_sample_every;    /* telemetry keeps every k-th cell (default 1) */
  double sparse_p;               /* 0 (default): dense decode; in (0, 1]: sparse decode, each
                                    (layer, query head, step) attends the fewest indexed tokens
                                    holding estimated attention mass sparse_p plus the window */
  int32_t sparse_window;         /* newest tokens always attended exactly; -1: 128 (or the
                                    context when shorter); at most the context */
  int32_t sparse_dense_layers;   /* first layers decoded densely; -1: 2 */
  const char* sparse_rotation;   /* the key index's rotation: "haar" (default, null) or
                                    "hadamard" (randomized Hadamard, power-of-two head_dim) */
  const char* device;            /* where decode attention runs: "cpu" (default, null) or
                                    "cuda" (a CUDA device holds its own copy of the KV cache,
                                    encoded there; kv "bf16", "gaac", "gaac-e5m2", or the
                                    lossy "fp8-e4m3", "fp8-e5m2", "dither8" with the meter
                                    computed there in the same pass; sparse decode with kv
                                    "bf16"; no gate; CERTKV_ERR_UNSUPPORTED without a CUDA build
                                    or device). The forward pass and prefill stay on the CPU. */
  double sparse_deviations;      /* the Top-p set widened per token: a token the threshold left
                                    out is also attended when its estimated logit plus this many
                                    standard deviations of its estimate reaches the threshold
                                    (0, the default: no widening; 1.5 lifts recall at p 0.9,
                                    docs/sparse.md); finite, >= 0 */
  const char* witness;           /* Tier A lossy schemes (fp8-e4m3, fp8-e5m2, fp8-e4m3-scaled,
                                    rtn8, rtn4, kivi2): how K pages store the meter's witness:
                                    "fp16" (the default, null; 32 bytes per token and KV head),
                                    "u8" (codes against each page's largest band norm: 16 bytes +
                                    2 per page, the meter about 1% looser, docs/meter.md section
                                    7) or, for fp8-e4m3 only, "exponent" (no bytes: each code
                                    bounds its own rounding; blocks whose cast saturates stay
                                    exact; CPU decode only). Must be null for the other schemes */
} certkv_session_params;

CERTKV_API certkv_session_params certkv_session_default_params(void);
CERTKV_API certkv_status certkv_session_create(const certkv_model* model,
                                               const certkv_session_params* params,
                                               certkv_session** out);
CERTKV_API void certkv_session_free(certkv_session* session);

/* Progress of a long prefill, called after each chunk: tokens done and in all. */
typedef void (*certkv_progress_fn)(void* user, int64_t done_tokens, int64_t total_tokens);

/* Appends tokens to the session's sequence.
 * tokens: [n_tokens]; logits: [n_vocab] of the last token, or NULL; all_logits: [n_tokens][n_vocab]
 * or NULL. progress may be NULL. */
CERTKV_API certkv_status certkv_session_prefill(certkv_session* session, const int32_t* tokens,
                                                int32_t n_tokens, float* logits, float* all_logits,
                                                certkv_progress_fn progress, void* progress_user);
/* One token; logits: [n_vocab]. */
CERTKV_API certkv_status certkv_session_decode(certkv_session* session, int32_t token,
                                               float* logits);
CERTKV_API certkv_status certkv_session_reset(certkv_session* session);
CERTKV_API int64_t certkv_session_n_past(const certkv_session* session);

/* Pages of one storage class of the KV cache. */
typedef struct certkv_kv_class_stats {
  const char* storage;            /* "bf16" / "fp8" (raw pages), "gaac" / "gaac-fp8" (GAAC
                                    slots), "lossy" / "dither8" (lossy pages); static string */
  uint64_t pages_in_use;
  uint64_t bytes_from_allocator;  /* chunks the class's pools obtained */
  uint64_t page_bytes_in_use;     /* pages in use times their stride */
} certkv_kv_class_stats;

#define CERTKV_MAX_KV_CLASSES 8

typedef struct certkv_kv_stats {
  int64_t n_tokens;                /* tokens in the cache */
  uint64_t kv_bytes;               /* bytes obtained from the allocator for KV pages and tables */
  uint64_t kv_bytes_in_use;        /* pages in use plus block tables */
  uint64_t kv_bytes_bf16;          /* a contiguous BF16 cache of the same tokens */
  uint64_t pages_in_use;
  uint64_t pages_free;
  uint64_t backing_bytes;          /* lossy schemes: the exact backing store the gate repairs
                                      from (host memory, not part of kv_bytes) */
  uint64_t exact_fallback_blocks;  /* lossy schemes: blocks kept exact (non-finite values) */
  int32_t n_classes;               /* entries of by_class: the classes the cache has pools for */
  certkv_kv_class_stats by_class[CERTKV_MAX_KV_CLASSES];
} certkv_kv_stats;

CERTKV_API certkv_status certkv_session_kv_stats(const certkv_session* session,
                                                 certkv_kv_stats* stats);

/* Reads cached K (kv = 0) or V (kv = 1) of one layer and kv_head for positions [begin, end).
 * out: [end - begin][head_dim] bf16 bit patterns (lossy pages: their reconstruction rounded to
 * bf16). */
CERTKV_API certkv_status certkv_session_read_kv(const certkv_session* session, int32_t layer,
                                                int32_t kv, int32_t kv_head, int64_t begin,
                                                int64_t end, uint16_t* out);
/* As certkv_session_read_kv, in float: exact = 0 gives what attention reads (a lossy page's
 * reconstruction), exact = 1 the exact values (lossy pages from the backing store).
 * out: [end - begin][head_dim] float. */
CERTKV_API certkv_status certkv_session_read_kv_f32(const certkv_session* session, int32_t layer,
                                                    int32_t kv, int32_t kv_head, int64_t begin,
                                                    int64_t end, int exact, float* out);

/* ---- The meter (lossy schemes) ------------------------------------------------------------- */

/* Telemetry of the per-(layer, query head, step) meter over the decode steps so far. */
typedef struct certkv_meter_stats {
  int metered;               /* 1 when the session's scheme is lossy and the meter is on */
  const char* tier;          /* "A" (witness bound, any query), "B" (dither8 certificate, valid
                                for non-adaptive queries), or "none"; static string */
  int certified;             /* tau < 1: coverage counts certified cells; 0: risk-ranked */
  double tau;
  double delta_loc;          /* per-cell failure probability of Tier B */
  int64_t cells;             /* cells recorded (every sample_every-th) */
  double coverage;           /* fraction of recorded cells with meter <= tau */
  double max;                /* largest meter */
  double p50, p99;           /* quantiles (relative error <= 0.4%) */
  int64_t overflow;          /* cells whose A overflowed (meter 1) */
  int64_t repairs;           /* pages the gate paged in */
  uint64_t pagein_bytes;     /* their bytes */
  uint64_t exact_fallback_blocks;  /* blocks kept exact (non-finite values or scale overflow) */
} certkv_meter_stats;

CERTKV_API certkv_status certkv_session_meter_stats(const certkv_session* session,
                                                    certkv_meter_stats* stats);
CERTKV_API certkv_status certkv_session_meter_reset(certkv_session* session);

/* Audit: when enabled, every metered step also computes the true total variation between the
 * exact attention (keys from the backing store) and the compressed one, per (layer, query head),
 * and checks meter >= TV. Cells are counted from the call on. */
typedef struct certkv_audit_stats {
  int64_t cells;
  int64_t violations;        /* cells with meter < TV - 1e-9 */
  double coverage;           /* fraction of cells with meter <= tau */
  double max_meter, max_tv;
  double tightness_q01, tightness_q10, tightness_q50, tightness_q90, tightness_q99;
                             /* quantiles of meter / TV over cells with TV > 1e-12, meter < 1 */
  double worst_margin;       /* max over cells of TV - meter (negative: no violation) */
} certkv_audit_stats;

/* dump_cells > 0 keeps that many sampled cells (and the cells of largest TV and meter) with
 * their query and keys for certkv_session_audit_dump. */
CERTKV_API certkv_status certkv_session_audit_enable(certkv_session* session, int32_t dump_cells,
                                                     uint64_t seed);
CERTKV_API certkv_status certkv_session_audit_stats(const certkv_session* session,
                                                    certkv_audit_stats* stats);
/* Per-layer audit: n_layers entries of (cells, violations, coverage). */
CERTKV_API certkv_status certkv_session_audit_layer(const certkv_session* session, int32_t layer,
                                                    int64_t* cells, int64_t* violations,
                                                    double* coverage);
/* Writes the kept cells to a safetensors file: cell{i}.q [head_dim] f32, cell{i}.k [S][head_dim]
 * f32 (exact), cell{i}.k_hat [S][head_dim] f32 (what attention read), cell{i}.scale [1] f32,
 * cell{i}.meter [1] f64; metadata names each cell's layer, head, step and the scheme. */
CERTKV_API certkv_status certkv_session_audit_dump(const certkv_session* session, const char* path);

/* ---- The device route ---------------------------------------------------------------------- */

/* The device route (params.device "cuda"): what ran there and what its KV cache holds. */
typedef struct certkv_device_stats {
  int on_device;                 /* 1 when decode attention runs on a CUDA device */
  int64_t attention_calls;       /* (step, layer) attentions run there */
  double attention_seconds;      /* their host wall time, copies and launches included */
  double write_seconds;          /* appending K/V rows and encoding finalized blocks there */
  int64_t gaac_slots;            /* GAAC slots in use on the device */
  int64_t raw_pages;             /* raw pages (bf16 pages, tails, blocks that did not fit) */
  int64_t blocks_not_fitting;    /* GAAC blocks kept raw */
  uint64_t kv_bytes_in_use;      /* device pages in use plus block tables */
  uint64_t kv_bytes_reserved;    /* device memory held for the KV cache */
  int64_t lossy_pages_in_use;    /* lossy schemes: lossy pages on the device */
  int64_t pages_kept_exact;      /* lossy schemes: pages the encoder refused, kept exact bf16 */
  int64_t sparse_calls;          /* of attention_calls, sparse decode (kv bf16 with sparse_p) */
} certkv_device_stats;

CERTKV_API certkv_status certkv_session_device_stats(const certkv_session* session,
                                                     certkv_device_stats* stats);

/* ---- Sparse decode ------------------------------------------------------------------------- */

/* Counters of sparse decode since the session began (or certkv_session_sparse_reset). A cell is
 * one (layer, query head, step) of a sparse layer; budget = attended tokens / context tokens. */
typedef struct certkv_sparse_stats {
  int sparse;                    /* 1 when the session decodes sparsely */
  double p;
  int32_t window_tokens, dense_layers;
  int64_t steps;                 /* decode steps with sparse layers */
  int64_t cells;
  double mean_budget;            /* mean over sparse cells (1 when there is none) */
  double mean_budget_all_layers; /* counting the dense layers' cells as budget 1 */
  uint64_t index_bytes;          /* the key index: pages of records, centroids, rotations */
  int64_t indexed_tokens;        /* tokens in the index (per (layer, kv_head)) */
  double index_build_seconds;    /* centroids and records, at prefill and in lazy updates */
  int64_t index_appended_tokens; /* tokens indexed (per (layer, kv_head)) since the start */
  double deviations;             /* certkv_session_params.sparse_deviations */
  double widened_fraction;       /* tokens the widening added over every sparse cell / their
                                    context tokens (the widening's share of the budget) */
} certkv_sparse_stats;

CERTKV_API certkv_status certkv_session_sparse_stats(const certkv_session* session,
                                                     certkv_sparse_stats* stats);
/* Per layer: sparse cells and their mean budget (0 cells for the dense layers). */
CERTKV_API certkv_status certkv_session_sparse_layer(const certkv_session* session, int32_t layer,
                                                     int64_t* cells, double* mean_budget);
CERTKV_API certkv_status certkv_session_sparse_reset(certkv_session* session);

/* Sparse audit: when enabled, every sparse (layer, query head, step) also computes exact
 * attention over every token beside the sparse one: recall (the exact attention mass of the
 * attended set), the estimator's error on every indexed token, and the recall of fixed top-k
 * (on estimated and on true logits) and of Quest-style page selection at the same mean budget. */
typedef struct certkv_sparse_audit_stats {
  int64_t cells;
  double mean_budget, mean_recall;
  double recall_q01, recall_q10, recall_q50, min_recall;
  double budget_q50, budget_q90, max_budget;
  int64_t estimator_samples;     /* indexed tokens scored */
  double estimator_bias, estimator_rms;  /* of estimated - true logit */
  double estimator_abs_q50, estimator_abs_q90, estimator_abs_q99;
  double normalized_rms_sqrt_d;  /* rms of the cosine estimate's error times sqrt(head_dim) */
  /* The baselines at mean_budget: fixed top-k of the estimated logits, of the true logits
   * (oracle), and Quest page selection (budget: what they actually attended). */
  double topk_estimated_budget, topk_estimated_recall;
  double topk_oracle_budget, topk_oracle_recall;
  double quest_budget, quest_recall;
} certkv_sparse_audit_stats;

/* dump_cells > 0 keeps that many sampled cells for certkv_session_sparse_audit_dump. */
CERTKV_API certkv_status certkv_session_sparse_audit_enable(certkv_session* session,
                                                            int32_t dump_cells, uint64_t seed);
CERTKV_API certkv_status certkv_session_sparse_audit_stats(const certkv_session* session,
                                                           certkv_sparse_audit_stats* stats);
CERTKV_API certkv_status certkv_session_sparse_audit_layer(const certkv_session* session,
                                                           int32_t layer, int64_t* cells,
                                                           double* mean_budget, double* mean_recall,
                                                           double* min_recall);
/* Audits another Top-p rule on the same cells: each cell's indexed prefix is also selected at mass
 * p, widened by `deviations` estimator deviations (as certkv_session_params.sparse_p and
 * sparse_deviations select), and that set plus the window is set beside exact attention. The
 * decode follows the session's own rule. Call after certkv_session_sparse_audit_enable and before
 * the first decode step; *rule gets the rule's index (0, 1, ... in the order added).
 * CERTKV_ERR_INVALID_ARGUMENT for p outside (0, 1], deviations negative or not finite, or a call
 * after cells were audited. */
CERTKV_API certkv_status certkv_session_sparse_audit_add_rule(certkv_session* session, double p,
                                                              double deviations, int32_t* rule);
/* A rule's means over the audited cells of `layer` (-1: every layer): cells, budget, recall,
 * and over every layer the 10% quantile of recall (0 for one layer). */
CERTKV_API certkv_status certkv_session_sparse_audit_rule(const certkv_session* session, int32_t rule,
                                                          int32_t layer, int64_t* cells,
                                                          double* mean_budget, double* mean_recall,
                                                          double* recall_q10);
/* Writes the kept cells to a safetensors file: cell{i}.q [head_dim] f32 (post-RoPE query),
 * cell{i}.k [S][head_dim] f32 (exact keys), cell{i}.scale [1] f32, cell{i}.attended [n] i32
 * (every token the sparse step attended: selected, then the window); metadata names each
 * cell's layer, head, step, n_indexed and recall (exact attention mass of the attended set). */
CERTKV_API certkv_status certkv_session_sparse_audit_dump(const certkv_session* session,
                                                          const char* path);

/* Post-RoPE queries of the last position. out: [n_heads][head_dim] float.
 * REQUIRES: the session was created with capture_queries. */
CERTKV_API certkv_status certkv_session_last_queries(const certkv_session* session, int32_t layer,
                                                     float* out);

/* ---- Sampling ------------------------------------------------------------------------------ */

typedef struct certkv_sampler certkv_sampler;

typedef struct certkv_sampler_params {
  float temperature; /* below 1e-6 (0 included): greedy */
  int32_t top_k;     /* 0: off */
  float top_p;       /* (0, 1] */
  uint64_t seed;
} certkv_sampler_params;

CERTKV_API certkv_sampler_params certkv_sampler_default_params(void);
CERTKV_API certkv_status certkv_sampler_create(const certkv_sampler_params* params,
                                               certkv_sampler** out);
CERTKV_API void certkv_sampler_free(certkv_sampler* sampler);
/* logits: [n_vocab] */
CERTKV_API certkv_status certkv_sampler_sample(certkv_sampler* sampler, const float* logits,
                                               int32_t n_vocab, int32_t* token);

/* ---- Generation -------------------------------------------------------------------------- */

/* Called once per generated token with its bytes. Return non-zero to stop. */
typedef int (*certkv_token_fn)(void* user, int32_t token, const char* piece, size_t n_bytes);

typedef struct certkv_generate_params {
  int32_t max_new_tokens;
  int stop_at_end;               /* stop at an end-of-generation token (default 1) */
  certkv_sampler_params sampler;
  certkv_progress_fn progress;   /* prefill progress, may be NULL */
  void* progress_user;
} certkv_generate_params;

typedef struct certkv_generate_result {
  int32_t prompt_tokens;
  int32_t generated_tokens;
  double prefill_seconds;
  int32_t decode_steps;   /* forward passes of one token after the prompt */
  double decode_seconds;  /* those decode steps with their sampling */
} certkv_generate_result;

CERTKV_API certkv_generate_params certkv_generate_default_params(void);
/* Prefills prompt tokens (tokens: [n_tokens]) and generates up to max_new_tokens. The first
 * generated token comes from the prefill logits; decode_seconds covers the remaining ones. */
CERTKV_API certkv_status certkv_generate(certkv_session* session, const int32_t* tokens,
                                         int32_t n_tokens, const certkv_generate_params* params,
                                         certkv_token_fn on_token, void* user,
                                         certkv_generate_result* result);

/* Peak resident set size of this process, bytes (0 where unknown). */
CERTKV_API uint64_t certkv_peak_rss_bytes(void);

/* ---- KV schemes ---------------------------------------------------------------------------- */

/* One entry of the scheme table: what certkv_session_params.kv accepts and what each scheme is. */
typedef struct certkv_kv_scheme_info {
  const char* name;        /* static string */
  const char* summary;     /* one line; static string */
  const char* meter_tier;  /* "none", "A" (witness bound, any query), "B" (dither8 certificate,
                              non-adaptive queries); static string */
  int lossless;            /* every bf16 bit written is read back (bf16, gaac) */
  int needs_calibration;   /* GAAC-coded: a calibration file, or the model calibrates itself */
  int lossy;               /* quantized pages with an exact backing store and the meter */
  int cuda_route;          /* served by the CUDA device route (params.device "cuda") */
  int batch_invariant;     /* a sequence's logits do not depend on the other sequences */
  int32_t default_window_tokens; /* lossy: newest tokens kept bf16 by default */
} certkv_kv_scheme_info;

CERTKV_API int32_t certkv_kv_scheme_count(void);
/* index in [0, certkv_kv_scheme_count()). */
CERTKV_API certkv_status certkv_kv_scheme_get(int32_t index, certkv_kv_scheme_info* info);

/* "0.1.0": the library's version. */
CERTKV_API const char* certkv_version(void);

/* ---- The engine (many sequences, continuous batching over one page pool) ----------------- */

/* Requests go to a scheduler that runs one batched forward step at a time: every decoding
 * request's next token, then chunks of the prompts being prefilled, within step_tokens. Whole
 * prompt blocks are shared between requests that begin alike; when the pool runs out, the newest
 * request is preempted (swapped to host memory, or recomputed later). A request's logits are
 * those of running it alone (batch invariance; docs/engine.md). */
typedef struct certkv_engine certkv_engine;

typedef struct certkv_engine_params {
  certkv_session_params session; /* per sequence: context_tokens (the most tokens of one
                                    request), threads, kv scheme, meter, gate, sparse; device
                                    "cpu" (null) or "cuda": the engine's CUDA backend, the
                                    whole forward pass and the page pool on the device
                                    (docs/cuda.md; schemes of the table's cuda_route, no gate) */
  int32_t max_sequences;         /* requests running at once (default 8) */
  int64_t step_tokens;           /* the most tokens one step runs (default 512) */
  uint64_t pool_bytes;           /* KV pool in bytes over every layer and head. On the CPU:
                                    bytes of raw pages of the scheme's tail class (bf16, or fp8
                                    for the fp8-page schemes); on the cuda device: bytes of each
                                    class's own pages (whole blocks at the scheme's coded page
                                    size), so compressed schemes hold more. 0: room for
                                    max_sequences whole contexts. Must hold one context */
  int prefix_sharing;            /* default 1 */
  int32_t meter_recent_steps;    /* metered schemes: the meter of this many recent decode steps
                                    is kept for live views (certkv_engine_recent_meters); in
                                    [0, 4096], default 64; 0: none */
  const char* preemption;        /* when the pool runs out, the newest request's KV is "swap"ped
                                    to host memory (GAAC-coded where the scheme can) or freed and
                                    "recompute"d later; NULL: the engine's default (swap) */
} certkv_engine_params;

CERTKV_API certkv_engine_params certkv_engine_default_params(void);
CERTKV_API certkv_status certkv_engine_create(const certkv_model* model,
                                              const certkv_engine_params* params,
                                              certkv_engine** out);
CERTKV_API void certkv_engine_free(certkv_engine* engine);

typedef struct certkv_request_params {
  const int32_t* prompt;         /* [n_prompt] tokens (BOS included where the model wants it) */
  int32_t n_prompt;
  int32_t max_tokens;            /* >= 1; prompt + max_tokens must fit the context */
  certkv_sampler_params sampler;
  const char* const* stop;       /* [n_stop] stop strings, or NULL */
  int32_t n_stop;
  int ignore_end;                /* keep generating past end-of-generation tokens */
  int32_t logprobs;              /* -1 (default): none; 0 to CERTKV_MAX_TOP_LOGPROBS: each generated
                                    token's log-probability and that many most likely alternatives
                                    (certkv_engine_logprobs) */
  int prompt_logprobs;           /* also the prompt's tokens after the first (max(logprobs, 0)
                                    alternatives); the prompt is then computed whole, never taken
                                    from the prefix cache */
} certkv_request_params;

/* Start from these (a zeroed struct asks for logprobs 0: each token's log-probability). */
CERTKV_API certkv_request_params certkv_request_default_params(void);
/* Queues a request; *id names it. A bad request (too long for the context: OUT_OF_RANGE; empty,
 * a token outside the vocabulary, bad sampling: INVALID_ARGUMENT) fails alone. */
CERTKV_API certkv_status certkv_engine_submit(certkv_engine* engine,
                                              const certkv_request_params* params, int64_t* id);

/* Called after each generated token with the text it completed (possibly none yet: bytes held
 * back until a UTF-8 character or a stop string is decided; token -1: the held-back text at the
 * end). Return non-zero to cancel that request. */
typedef int (*certkv_engine_token_fn)(void* user, int64_t request, int32_t token, const char* text,
                                      size_t n_bytes);

/* One batched step; *active (may be NULL) is 1 while requests remain. */
CERTKV_API certkv_status certkv_engine_step(certkv_engine* engine, certkv_engine_token_fn on_token,
                                            void* user, int* active);
/* Steps until no request remains. */
CERTKV_API certkv_status certkv_engine_run(certkv_engine* engine, certkv_engine_token_fn on_token,
                                           void* user);
/* Frees the request's pages at once; it finishes as "cancelled". */
CERTKV_API certkv_status certkv_engine_cancel(certkv_engine* engine, int64_t id);

/* Pages of one storage class referenced by a request's sequence (shared pages in full). */
typedef struct certkv_class_bytes {
  const char* storage;           /* static string */
  uint64_t bytes;
} certkv_class_bytes;

typedef struct certkv_request_result {
  int finished;                  /* 0 while waiting or running */
  const char* finish_reason;     /* "length", "stop", "end", "cancelled", "error", "none"; static */
  const char* text;              /* generated text (valid UTF-8), NUL-terminated; owned by the
                                    engine until certkv_engine_release */
  size_t text_bytes;
  int32_t prompt_tokens;
  int32_t generated_tokens;
  int32_t shared_prompt_tokens;  /* taken from the prefix cache */
  int32_t preemptions;
  double ttft_ms;                /* submit to first token */
  double itl_ms_mean;            /* between tokens */
  /* The certificate of its attention (lossy schemes): over its decode steps. */
  int metered;
  double meter_max, meter_p99, coverage;
  int64_t gate_repairs;
  double sparse_budget;          /* mean fraction of the context attended (1: dense) */
  int32_t n_classes;
  certkv_class_bytes kv_bytes[CERTKV_MAX_KV_CLASSES];
  int64_t meter_cells;           /* (layer, query head, step) cells behind meter_p99 and coverage
                                    (every meter_sample_every-th); 0 when not metered */
  double sparse_estimated_mass;  /* sparse decode: the mean over its sparse cells that scored
                                    indexed tokens of the key index's estimated softmax mass of
                                    the Top-p selection within the indexed tokens (>= sparse_p by
                                    construction; a recall proxy, not the recall an audit
                                    measures); 0 with no such cell */
  int64_t sparse_indexed_cells;  /* those cells */
  const char* error;             /* finish_reason "error": why (a failed forward step: the
                                    requests of that step end with it, the others go on);
                                    "" otherwise; owned by the engine until certkv_engine_release */
} certkv_request_result;

CERTKV_API certkv_status certkv_engine_result(const certkv_engine* engine, int64_t id,
                                              certkv_request_result* result);

/* The certificate of one layer of a request: its meter over the request's decode steps. */
typedef struct certkv_layer_meter {
  double meter_max, meter_p99, coverage;
  int64_t cells;                 /* (query head, step) cells of the layer (every
                                    meter_sample_every-th) */
  int64_t gate_repairs;          /* pages the gate paged in for the layer */
} certkv_layer_meter;

/* Per layer, the meter of a request (metered schemes). out: [capacity], layer i at out[i];
 * *n set to the count: the model's layers, 0 when the request is not metered (OUT_OF_RANGE,
 * with *n the count needed, when capacity is short). */
CERTKV_API certkv_status certkv_engine_result_layers(const certkv_engine* engine, int64_t id,
                                                     certkv_layer_meter* out, size_t capacity,
                                                     size_t* n);
#define CERTKV_MAX_TOP_LOGPROBS 20

/* A token's log-probability under the model's distribution at its position: the log-softmax of
 * the raw logits (before the sampler's temperature and truncation), and the most likely tokens'
 * (most likely first, lower id first on ties). */
typedef struct certkv_token_logprob {
  int32_t token;
  float logprob;
  int32_t n_top;
  int32_t top_tokens[CERTKV_MAX_TOP_LOGPROBS];
  float top_logprobs[CERTKV_MAX_TOP_LOGPROBS];
} certkv_token_logprob;

/* A request's log-probabilities (certkv_request_params.logprobs, .prompt_logprobs): of its
 * generated tokens (prompt 0: entry i for generated token i, each recorded before the token's
 * callback), or of its prompt (prompt 1: entry i for prompt token i + 1). Writes entries
 * [first, first + capacity) that exist, sets *n to the count there is in all; first past it:
 * INVALID_ARGUMENT. */
CERTKV_API certkv_status certkv_engine_logprobs(const certkv_engine* engine, int64_t id, int prompt,
                                                size_t first, certkv_token_logprob* out, size_t capacity,
                                                size_t* n);
/* Inter-token latencies of a request, ms. out: [capacity]; *n set to the count (OUT_OF_RANGE,
 * with *n the count needed, when capacity is short). */
CERTKV_API certkv_status certkv_engine_itl(const certkv_engine* engine, int64_t id, double* out,
                                           size_t capacity, size_t* n);
/* Forgets a finished request. */
CERTKV_API certkv_status certkv_engine_release(certkv_engine* engine, int64_t id);

typedef struct certkv_engine_stats {
  int64_t steps, prefill_tokens, decode_tokens;
  double prefill_seconds, decode_seconds;
  int64_t preemptions, shared_blocks, evicted_prefixes, cached_prefixes;
  int64_t running, waiting;
  uint64_t pool_pages_in_use, pool_capacity_pages, peak_pages_in_use;
  int32_t n_classes;
  certkv_class_bytes peak_bytes[CERTKV_MAX_KV_CLASSES]; /* per class, the most in use */
  int32_t n_classes_in_use;      /* entries of in_use */
  certkv_kv_class_stats in_use[CERTKV_MAX_KV_CLASSES]; /* per class now: pages in use, their
                                    bytes, the bytes its pools obtained */
  uint64_t page_bytes_as_bf16;   /* the pages in use were each a raw bf16 page (block_tokens x
                                    head_dim x 2 bytes): a compression ratio's reference */
  int64_t last_metered_step;     /* the newest step certkv_engine_recent_meters holds; 0: none */
  /* Preemption: swaps out and in, host bytes written by swaps out (and the pool page bytes they
   * freed), host bytes held at most, seconds in swapping; tokens recomputed and their seconds. */
  int64_t swap_outs, swap_ins;
  uint64_t swapped_out_host_bytes, swapped_out_pool_bytes, host_bytes_peak;
  double swap_seconds;
  int64_t recomputed_tokens;
  double recompute_seconds;
  uint64_t live_pages_in_use;    /* of pool_pages_in_use, the pages the running requests hold (a
                                    page they share counted once); the rest are held by cached
                                    prefixes alone (evictable) */
} certkv_engine_stats;

CERTKV_API certkv_status certkv_engine_get_stats(const certkv_engine* engine,
                                                 certkv_engine_stats* stats);

/* ---- Safetensors files --------------------------------------------------------------------- */

/* One tensor to write; its bytes are borrowed for the call. */
typedef struct certkv_tensor_view {
  const char* name;
  const char* dtype;        /* "BF16", "F16", "F32", "I32", "U8", ... (safetensors dtype names) */
  const int64_t* shape;     /* [n_dims], row-major, outermost first */
  int32_t n_dims;           /* 0..8 */
  const void* data;         /* [n_bytes] */
  size_t n_bytes;           /* the product of shape times the dtype's size */
} certkv_tensor_view;

typedef struct certkv_metadata_entry {
  const char* key;
  const char* value;
} certkv_metadata_entry;

/* Writes tensors (data laid out in the given order) and metadata (the "__metadata__" object of
 * string values) to a safetensors file at path, replacing it. INVALID_ARGUMENT for a null
 * argument, an unknown dtype, a repeated name or key, or n_bytes that do not match the shape;
 * IO (naming the path) when the file cannot be written. */
CERTKV_API certkv_status certkv_safetensors_write(const char* path,
                                                  const certkv_tensor_view* tensors,
                                                  size_t n_tensors,
                                                  const certkv_metadata_entry* metadata,
                                                  size_t n_metadata);

/* ---- Evaluation: teacher-forced quality ---------------------------------------------------- */

/* One position's next-token distributions compared, reference (exact KV) against test. */
typedef struct certkv_position_quality {
  double kl;            /* KL(softmax(ref) || softmax(test)) in nats, >= 0 */
  int top1_agree;       /* argmax(ref) == argmax(test), ties to the lowest index */
  double top5_overlap;  /* |top5(ref) & top5(test)| / min(5, n_vocab), in [0, 1] */
} certkv_position_quality;

/* ref, test: [n_vocab] logits. INVALID_ARGUMENT for a null pointer, n_vocab < 1 or a non-finite
 * logit (the message names "ref" or "test" and the index). */
CERTKV_API certkv_status certkv_compare_logits(const float* ref, const float* test, int32_t n_vocab,
                                               certkv_position_quality* out);

typedef struct certkv_quality_summary {
  int64_t n_positions;
  double mean_kl, max_kl;
  double p99_kl;        /* linear interpolation between order statistics (numpy's default) */
  double top1;          /* fraction of positions whose top-1 agrees */
  double top5;          /* mean top-5 overlap */
} certkv_quality_summary;

/* positions: [n] (n may be 0: every field 0). INVALID_ARGUMENT for a value no comparison gives
 * (negative or non-finite kl, overlap outside [0, 1]). */
CERTKV_API certkv_status certkv_quality_summarize(const certkv_position_quality* positions,
                                                  size_t n, certkv_quality_summary* out);

/* ---- Evaluation: needle tasks ------------------------------------------------------------- */

/* A haystack (noise sentences or corpus text) with needle sentences "One of the special magic
 * numbers for <key> is: <7-digit number>." and a question asking for them (docs/meter.md). */
typedef struct certkv_needle_task certkv_needle_task;

typedef struct certkv_needle_params {
  const char* variant;              /* "single" (default, null), "multi-key", "multi-value",
                                       "multi-query" */
  const char* const* corpus_paths;  /* [n_corpus_paths] text files of the haystack; none: noise */
  size_t n_corpus_paths;
  int64_t target_tokens;            /* the prompt has at most this many tokens, >= 90% of it */
  uint64_t seed;
} certkv_needle_params;

/* Tokens of a text as the model will see it (wrapping included). Returns the count, or a
 * negative value on failure. */
typedef int64_t (*certkv_count_tokens_fn)(void* user, const char* text, size_t n_bytes);

CERTKV_API certkv_needle_params certkv_needle_default_params(void);
/* INVALID_ARGUMENT naming the variant when it is not one of the four. */
CERTKV_API certkv_status certkv_needle_check_variant(const char* variant);
/* INVALID_ARGUMENT for an unknown variant, a null count_tokens, a target too small to hold the
 * needles and the question (the message names the tokens they need) or one that cannot be
 * filled; NOT_FOUND / IO naming a corpus file that cannot be read. */
CERTKV_API certkv_status certkv_needle_task_create(const certkv_needle_params* params,
                                                   certkv_count_tokens_fn count_tokens, void* user,
                                                   certkv_needle_task** out);
CERTKV_API void certkv_needle_task_free(certkv_needle_task* task);

/* Strings owned by the task. */
typedef struct certkv_needle_task_info {
  const char* context;        /* the haystack with the needles in it */
  const char* question;
  const char* answer_prefix;  /* the reply starts with it */
  const char* first_answer;   /* the first number asked for */
  int32_t n_answers;
  double depth;               /* realized depth of the first asked needle, [0, 1] */
  int64_t prompt_tokens;
} certkv_needle_task_info;

CERTKV_API certkv_status certkv_needle_task_get_info(const certkv_needle_task* task,
                                                     certkv_needle_task_info* info);
/* generated: [n_bytes]. *exact_match: every answer appears as a whole number; *recall: the
 * fraction that does (either pointer may be NULL). */
CERTKV_API certkv_status certkv_needle_score(const certkv_needle_task* task, const char* generated,
                                             size_t n_bytes, int* exact_match, double* recall);

/* ---- GAAC on KV dumps ---------------------------------------------------------------------- */

/* Calibrates GAAC on KV dumps (certkv dump-kv; docs/format/kv_dump.md) or loads a saved
 * calibration, then encodes every (layer, K/V, kv_head) page of another dump, decodes it, checks
 * it bit for bit and tallies the stored size, the mode mix and the codec speed (docs/gaac.md). */
typedef struct certkv_gaac_measure_params {
  const char* codec;             /* "gaac" (default, null), "gaac-e4m3", "gaac-e5m2" (the KV
                                    cast to FP8 first) */
  const char* calibration;       /* comma list of KV dumps, or one saved calibration file */
  const char* in;                /* the KV dump to encode; NULL: calibrate only */
  const char* save_calibration;  /* write the calibration there; NULL: nowhere */
  int32_t block_tokens;          /* default 16 */
  int32_t passes;                /* timed encode/decode passes, the fastest counts (default 3) */
  int32_t segment_tokens;        /* position segment of the drift breakdown (default 1024) */
  int verify_ref;                /* also run the _ref encoder and decoder on every page */
} certkv_gaac_measure_params;

/* The figures of a set of pages. */
typedef struct certkv_gaac_tally {
  double ratio;                  /* bf16 bytes / stored bytes (slots, raw fallbacks and tail,
                                    block-table entries, bases) */
  double ratio_vs_fp8;           /* FP8 codecs: FP8 bytes / stored bytes (else 0) */
  double bits_per_element;
  double content_ratio;          /* complete pages at their exact encoded size (the seed's) */
  double mode_fraction_3bit, mode_fraction_4bit, mode_fraction_raw;  /* of the groups */
  double raw_block_fraction;     /* pages kept raw (escapes past the slot) */
  double exponent_entropy_bits;  /* empirical entropy of the exponents, bits per element */
  double escape_bytes_per_page;
  double encode_gbps, decode_gbps;  /* one core, element bytes per second / 1e9 */
  uint64_t bf16_bytes, element_bytes, stored_bytes, pages, raw_pages;
  uint64_t failed_pages;         /* pages that did not round-trip (or _ref disagreed) */
} certkv_gaac_tally;

typedef struct certkv_gaac_report certkv_gaac_report;

typedef struct certkv_gaac_report_info {
  const char* codec;             /* strings owned by the report */
  const char* element;           /* "bf16", "e4m3", "e5m2" */
  const char* kernel;            /* the encoder/decoder measured */
  const char* calibration;       /* "2 KV dumps (2048 tokens)" or "calibration file PATH" */
  double calibrate_seconds;
  int encoded;                   /* 0: calibrated only (no in) */
  const char* in;
  int32_t n_layers, n_kv_heads, head_dim;
  int64_t n_tokens;
  int32_t block_tokens, segment_tokens, n_segments;
  int ref_cross_checked;
  int verify_ok;                 /* every page round-tripped */
  const char* first_failure;     /* "" when verify_ok */
  certkv_gaac_tally total, k, v;
} certkv_gaac_report_info;

typedef struct certkv_gaac_layer_report {
  int32_t layer;
  certkv_gaac_tally k, v;        /* without speeds */
  uint64_t k_escape_capacity_bytes, v_escape_capacity_bytes;
} certkv_gaac_layer_report;

/* INVALID_ARGUMENT for an unknown codec, no calibration, neither in nor save_calibration, a
 * calibration of another model shape or element, a file that is neither a KV dump nor a
 * calibration; CORRUPT / NOT_FOUND / IO naming the file; UNSUPPORTED for a head_dim GAAC does
 * not tile. Pages that fail to round-trip are reported (verify_ok 0), not an error. */
CERTKV_API certkv_gaac_measure_params certkv_gaac_measure_default_params(void);
CERTKV_API certkv_status certkv_gaac_measure(const certkv_gaac_measure_params* params,
                                             certkv_gaac_report** out);
CERTKV_API void certkv_gaac_report_free(certkv_gaac_report* report);
CERTKV_API certkv_status certkv_gaac_report_get_info(const certkv_gaac_report* report,
                                                     certkv_gaac_report_info* info);
/* index in [0, n_layers): the dump's layers ascending. */
CERTKV_API certkv_status certkv_gaac_report_layer(const certkv_gaac_report* report, int32_t index,
                                                  certkv_gaac_layer_report* out);
/* index in [0, n_segments): tokens [index * segment_tokens, ...); k, v without speeds. */
CERTKV_API certkv_status certkv_gaac_report_segment(const certkv_gaac_report* report, int32_t index,
                                                    certkv_gaac_tally* k, certkv_gaac_tally* v);
/* One decode step of certkv_engine_recent_meters. */
typedef struct certkv_meter_step {
  int64_t step;                  /* its number: the engine's forward steps (steps that ran
                                    tokens) so far, 1-based */
  int64_t cells;                 /* metered (layer, query head) cells in it, over its requests */
} certkv_meter_step;

/* The meter of the engine's recent decode steps, for live views (a dashboard's heatmap): the
 * last meter_recent_steps steps that metered a decode row (certkv_engine_params). Per step and
 * (layer, query head), the largest meter over the step's requests, before any gate repair (an
 * overflowed cell reads 1); NaN where no request was metered.
 * Returns the steps numbered above after_step (0: all kept), oldest first: steps: [capacity],
 * meters: [capacity][n_layers][n_heads] (step i at meters + i * n_layers * n_heads; either may be
 * NULL when capacity is 0). *n is set to their count (OUT_OF_RANGE, with *n the count needed, when
 * capacity is short); *n_layers and *n_heads (each may be NULL) to the shape. A scheme that is not
 * metered, or meter_recent_steps 0, keeps none: *n = 0. after_step < 0: INVALID_ARGUMENT. */
CERTKV_API certkv_status certkv_engine_recent_meters(const certkv_engine* engine,
                                                     int64_t after_step, certkv_meter_step* steps,
                                                     float* meters, size_t capacity, size_t* n,
                                                     int32_t* n_layers, int32_t* n_heads);

/* ---- GAAC pages ---------------------------------------------------------------------------- */

/* GAAC (docs/gaac.md) on the rows of one (layer, K/V, kv_head) stream, a page at a time: a page
 * is block_tokens rows of head_dim elements, token-major, coded into a slot of fixed size. */
typedef struct certkv_gaac_page_codec {
  const char* element;            /* "bf16" (rows of bf16 bit patterns, uint16), "e4m3" or
                                     "e5m2" (FP8 bytes, uint8) */
  int32_t block_tokens;           /* rows per page, >= 1 */
  int32_t head_dim;               /* a multiple of 8 that GAAC tiles (64, 128, 256, ...) */
  const uint8_t* b3;              /* [head_dim] 3-bit window bases, b3 + 8 <= 2^exponent_bits */
  const uint8_t* b4;              /* [head_dim] 4-bit window bases, b4 + 16 <= 2^exponent_bits */
  uint64_t escape_capacity_bytes; /* escape bytes a slot holds beyond its fixed part */
} certkv_gaac_page_codec;

/* Calibrates GAAC on rows: [n_tokens][head_dim] elements of `element` (uint16 bf16 bits or FP8
 * bytes) of one stream, in token order; its complete pages of block_tokens rows size the escape
 * capacity, a partial last page feeds only the exponent histograms. b3, b4: [head_dim] get the
 * bases; *escape_capacity_bytes the capacity: together a certkv_gaac_page_codec.
 * INVALID_ARGUMENT naming the value for an unknown element, a head_dim GAAC does not tile,
 * block_tokens < 1 or n_tokens outside [1, 2^31). */
CERTKV_API certkv_status certkv_gaac_calibrate(const char* element, int32_t block_tokens,
                                               int32_t head_dim, const void* rows, int64_t n_tokens,
                                               uint8_t* b3, uint8_t* b4,
                                               uint64_t* escape_capacity_bytes);
/* The slot size of the codec's pages (fixed part plus escape capacity). */
CERTKV_API certkv_status certkv_gaac_slot_bytes(const certkv_gaac_page_codec* codec,
                                                size_t* slot_bytes);
/* Encodes one page: page [block_tokens][head_dim] elements; slot: [slot_bytes] bytes. *used_bytes
 * is the bytes written, or 0 when the page's escapes exceed the capacity (the page does not fit:
 * keep it raw; the slot's contents are then unspecified). INVALID_ARGUMENT for bases out of
 * range. */
CERTKV_API certkv_status certkv_gaac_encode_page(const certkv_gaac_page_codec* codec,
                                                 const void* page, uint8_t* slot,
                                                 size_t* used_bytes);
/* Decodes one page: slot: [slot_bytes] bytes as certkv_gaac_encode_page wrote them; out:
 * [block_tokens][head_dim] elements. CORRUPT naming the group for a slot the format rejects. */
CERTKV_API certkv_status certkv_gaac_decode_page(const certkv_gaac_page_codec* codec,
                                                 const uint8_t* slot, size_t slot_bytes, void* out);
/* Encodes n_pages pages held in CUDA device memory on the device current at the call, enqueued
 * on cuda_stream (a cudaStream_t; null: the legacy default stream): pages device
 * [n_pages][block_tokens][head_dim] elements; slots device [n_pages][slot_bytes]; used_bytes
 * device [n_pages]: the bytes written, or UINT32_MAX when the page does not fit (the slot then
 * unspecified). The slots are certkv_gaac_encode_page's, byte for byte. Nothing waits for the
 * device. INVALID_ARGUMENT for bases out of range or memory that is not the current device's;
 * UNSUPPORTED in a build without the CUDA backend or on a machine without a device. */
CERTKV_API certkv_status certkv_gaac_encode_pages_device(const certkv_gaac_page_codec* codec,
                                                         const void* pages, int64_t n_pages,
                                                         uint8_t* slots, uint32_t* used_bytes,
                                                         void* cuda_stream);

/* ---- Lossy pages --------------------------------------------------------------------------- */

/* The page codecs of the lossy schemes (docs/format/: fp8, rtn, kivi2, dither8) a page at a time,
 * for front ends that hold KV rows themselves: a page is block_tokens rows of head_dim bf16 values
 * of one (layer, K/V, kv_head) stream, token-major, coded into page_bytes bytes with the meter's
 * side data (the Tier A witness of K pages, rho of V pages, dither8's scales). The bytes and the
 * reconstruction are those a KV store's pages of the same rows hold and attention reads. */
typedef struct certkv_lossy_page_codec {
  const char* kv;                 /* a lossy scheme: fp8-e4m3, fp8-e5m2, fp8-e4m3-scaled, rtn8,
                                     rtn4, kivi2 or dither8 */
  int key;                        /* 1: K pages (the witness; dither8's dither and outlier pairs);
                                     0: V pages */
  int32_t block_tokens;           /* rows per page, in [1, 4096] */
  int32_t head_dim;               /* a multiple of 32, at most 256 */
  const char* rope_layout;        /* the RoPE pairs (witness bands, outlier pairs): "interleaved"
                                     (null) or "half-split" */
  const char* witness;            /* Tier A K pages: "fp16" (null), "u8" or (fp8-e4m3) "exponent" */
  int32_t layer, kv_head;         /* dither8: the stream the dither is keyed by (a store's layer
                                     and kv head); ignored by the other schemes */
  int32_t n_outlier_pairs;        /* dither8 K pages: RoPE pairs kept exact; 0 otherwise */
  const uint16_t* outlier_pairs;  /* [n_outlier_pairs] increasing pair indices */
} certkv_lossy_page_codec;

/* The bytes of one page. INVALID_ARGUMENT or UNSUPPORTED naming the field for an unknown or
 * lossless scheme, a head_dim or block_tokens the pages do not serve, a witness the scheme does
 * not take, outlier pairs on a page that has none or out of range. */
CERTKV_API certkv_status certkv_lossy_page_bytes(const certkv_lossy_page_codec* codec, size_t* page_bytes);
/* Encodes one page: rows [block_tokens][head_dim] bf16 bit patterns; page: [page_bytes]. block:
 * the page's position in its sequence / block_tokens (dither8's counter). *encoded is 0 when the
 * encoder refuses the block (a value not finite, a scale past fp16: keep it exact), the page then
 * unspecified. */
CERTKV_API certkv_status certkv_lossy_encode_page(const certkv_lossy_page_codec* codec, uint32_t block,
                                                  const uint16_t* rows, uint8_t* page, int* encoded);
/* The reconstruction attention reads of a page: out [block_tokens][head_dim] float. Any bytes
 * decode (a page's side data that is not a valid bound reads as +inf in the meter, not here). */
CERTKV_API certkv_status certkv_lossy_decode_page(const certkv_lossy_page_codec* codec, uint32_t block,
                                                  const uint8_t* page, float* out);
/* Encodes n_pages pages held in CUDA device memory (as certkv_gaac_encode_pages_device: the
 * current device, cuda_stream, nothing waits): pages device [n_pages][block_tokens][head_dim]
 * bf16 bit patterns, page i the block first_block + i; out device [n_pages][page_bytes], each
 * certkv_lossy_encode_page's page byte for byte; encoded device [n_pages] uint8: 1 written, 0
 * refused as certkv_lossy_encode_page refuses. The device encodes fp8-e4m3, fp8-e5m2 and dither8
 * (UNSUPPORTED naming the scheme otherwise, and without the CUDA backend or a device). */
CERTKV_API certkv_status certkv_lossy_encode_pages_device(const certkv_lossy_page_codec* codec,
                                                          uint32_t first_block, const uint16_t* pages,
                                                          int64_t n_pages, uint8_t* out,
                                                          uint8_t* encoded, void* cuda_stream);

/* ---- The meter of one attention row ------------------------------------------------------- */

/* The meter (docs/meter.md) of one query against n_tokens keys, in double, as the engine's
 * reference computes it: p~ = softmax(sm_scale q . k_hat_t), c_t the tier's bound on the logit
 * error, A = sum_t p~_t e^{c_t}, meter = min(1, (A^2 - 1) / 2) (Theorem 1), and the true total
 * variation against the exact keys for comparison. */
typedef struct certkv_meter_row {
  double meter;   /* min(1, (A^2 - 1) / 2): the bound on tv */
  double log_a;   /* log A (+inf when A overflowed) */
  double tv;      /* the true total variation between softmax(sm_scale q . k) and p~ */
  double max_bound; /* max_t c_t */
} certkv_meter_row;

/* Tier A (Theorem 2): c_t = |sm_scale| sum_b ||q_b|| w_{t,b}, w_{t,b} the norm of the key residual
 * k_hat_t - k_t over band b of RoPE frequency pairs (computed here in double, rounded up to
 * float as a stored witness is). q: [head_dim]; k, k_hat: [n_tokens][head_dim] (exact and stored
 * keys); rope_layout: "interleaved" (pairs (2j, 2j+1)) or "half-split" (j, j + head_dim / 2);
 * bounds: [n_tokens] gets c_t, or NULL. INVALID_ARGUMENT for an odd head_dim, n_tokens < 1, an
 * unknown layout or a non-finite input. */
CERTKV_API certkv_status certkv_meter_tier_a(const float* q, const float* k, const float* k_hat,
                                             int64_t n_tokens, int32_t head_dim,
                                             const char* rope_layout, double sm_scale,
                                             double* bounds, certkv_meter_row* out);
/* Tier B (Lemma 2, dither8): c_t = sqrt(2 sigma_t^2 log(2 n_tokens / delta_loc)) + the dither
 * grid's slack, sigma_t^2 = sm_scale^2 sum_c q_c^2 s_{c,t}^2 / 12 over the channels outside the
 * outlier pairs, s_{c,t} the scale of channel c's group of 32 at token t. scales:
 * [n_tokens][head_dim / 32]; outlier_pairs: [n_outlier_pairs] increasing RoPE pair indices (may
 * be NULL when 0); delta_loc in (0, 1); the rest as certkv_meter_tier_a. head_dim: a multiple of
 * 32, at most 256. */
CERTKV_API certkv_status certkv_meter_tier_b(const float* q, const float* k, const float* k_hat,
                                             const float* scales, int64_t n_tokens,
                                             int32_t head_dim, const char* rope_layout,
                                             const uint16_t* outlier_pairs,
                                             int32_t n_outlier_pairs, double sm_scale,
                                             double delta_loc, double* bounds,
                                             certkv_meter_row* out);

/* ---- KV stores: the paged KV cache without a model ---------------------------------------- */

/* A KV store keeps the K and V rows that a front end computes itself (a PyTorch model, say) in
 * certkv's pages of one KV scheme, and runs certkv's decode attention over them with the meter:
 * the cache layer (page pools, block tables, fill-then-finalize, the codecs) behind the scheme
 * table, without the model. It holds n_sequences sequences (0, 1, ...; a batch's rows) and, per
 * layer, one paged cache: each layer is appended on its own, as a model's attention layers
 * produce their rows one after another. A layer's rows are appended, read and attended in
 * positions [0, length(seq, layer)).
 * Thread safety: one thread at a time per store. */
typedef struct certkv_kv_store certkv_kv_store;

typedef struct certkv_kv_store_params {
  const char* kv;                /* a scheme of certkv_kv_scheme_get (null: "bf16"), as
                                    certkv_session_params.kv */
  int32_t n_layers;              /* >= 1 */
  int32_t n_heads;               /* query heads of certkv_kv_store_attend: a multiple of
                                    n_kv_heads */
  int32_t n_kv_heads;            /* >= 1 */
  int32_t head_dim;              /* a multiple of 8, at most 256 (lossy schemes: of 32) */
  int32_t block_tokens;          /* tokens per page (default 16) */
  int32_t n_sequences;           /* sequences held (default 1) */
  int64_t max_tokens;            /* capacity of each layer, all sequences together, in tokens;
                                    a sequence's partial last block takes a whole page
                                    (default 4096 per sequence) */
  const char* rope_layout;       /* which channels are RoPE pairs (the witness bands, dither8's
                                    outlier pairs): "interleaved" (null; GGUF Llama) or
                                    "half-split" (Hugging Face) */
  double sm_scale;               /* softmax scale of attend; 0: 1/sqrt(head_dim) */
  int32_t outlier_pairs;         /* dither8: RoPE pairs per (layer, kv_head) kept exact, chosen
                                    from the first rows of the layer; -1: default (4) */
  int32_t recent_window_tokens;  /* lossy schemes: newest tokens kept bf16; -1: scheme default */
  const char* witness;           /* Tier A lossy schemes: "fp16" (null), "u8" or (fp8-e4m3 only)
                                    "exponent"; null for others */
  const char* gaac_calibration;  /* gaac schemes: a calibration file of the scheme's element and
                                    this shape (certkv-gaac-calibration/1); null: each layer is
                                    calibrated on its first append (its rows of every sequence
                                    appended there: a prompt, best as long as deployment).
                                    Lossy schemes: optional (the backing store's blocks
                                    GAAC-coded). Must be null for the other schemes */
  double meter_delta;            /* Tier B request failure budget, (0, 1) (default 1e-2) */
  double meter_tau;              /* coverage threshold, > 0 (default 0.2) */
  int64_t meter_planned_steps;   /* T of delta_loc = delta / (n_layers n_heads T); 0: max_tokens */
  int32_t n_threads;             /* threads of attend, >= 1 (default 1) */
  const char* device;            /* where the pages live: "cpu" (null) or "cuda" (the memory of the
                                    CUDA device current at create; a build with the CUDA
                                    backend). A cuda store takes device rows and queries
                                    (certkv_kv_store_append_device, _attend_device); kv a scheme
                                    the table marks cuda_route, block_tokens 16, head_dim 64 or
                                    128, at most 8 query heads per KV head, no recent window */
  void* cuda_stream;             /* device "cuda": the cudaStream_t on which every call enqueues
                                    its work, in call order (null: the legacy default stream) */
  int gate;                      /* lossy schemes on device "cpu": 1 repairs each decode step of
                                    certkv_kv_store_attend whose meter exceeds meter_tau from the
                                    exact backing store (docs/meter.md, "The gate"); default 0 */
  double sparse_p;               /* 0 (default) dense decode; in (0, 1]: a decode step of a
                                    layer past sparse_dense_layers attends the fewest indexed
                                    tokens holding estimated mass sparse_p, plus the tokens not
                                    indexed (docs/sparse.md, "The KV store"); not with the gate;
                                    head_dim 32, 64, 96, 128 or 256; on device "cuda" kv bf16 and
                                    max_tokens below 2^24 */
  int32_t sparse_window;         /* newest tokens never indexed (always attended); -1: 128 */
  int32_t sparse_dense_layers;   /* first layers decoded densely, in [0, n_layers]; -1: 2 (or
                                    n_layers when fewer) */
  double sparse_deviations;      /* the Top-p set widened per token by this many deviations of
                                    its estimate (certkv_session_params.sparse_deviations) */
  const char* sparse_rotation;   /* the key index's rotation: "haar" (null) or "hadamard" */
} certkv_kv_store_params;

/* The meter of one (layer, query head) of a decode step (docs/meter.md): meter >= the total
 * variation between the attention over the stored keys and over the exact keys, and
 * output_bound >= || attention output - exact attention output ||. 0 for lossless schemes. */
typedef struct certkv_head_meter {
  double meter;         /* min(1, (A^2 - 1) / 2) (Theorem 1) */
  double log_a;         /* log A (+inf when a bound overflowed: meter 1) */
  double value_rho;     /* sum_t p~_t rho_t: the value pages' share */
  double v_norm_max;    /* an upper bound of max_t ||v_t|| */
  double output_bound;  /* 2 meter v_norm_max + value_rho */
} certkv_head_meter;

CERTKV_API certkv_kv_store_params certkv_kv_store_default_params(void);
/* INVALID_ARGUMENT naming the field for an unknown scheme or layout, a non-positive dimension,
 * n_heads not a multiple of n_kv_heads, a witness or calibration the scheme does not take, the
 * gate with a lossless scheme; UNSUPPORTED for a head_dim the scheme's pages do not serve, the
 * gate on device "cuda" (its pages have no backing store); NOT_FOUND / CORRUPT for a calibration
 * file. */
CERTKV_API certkv_status certkv_kv_store_create(const certkv_kv_store_params* params,
                                                certkv_kv_store** out);
CERTKV_API void certkv_kv_store_free(certkv_kv_store* store);

/* Appends n_tokens rows to (seq, layer) at positions [length, length + n_tokens): complete
 * blocks are encoded once (fill-then-finalize, as a session's cache does); values are rounded to
 * bf16 (nearest even; NaN quieted) and, for the fp8 schemes, to FP8.
 * k, v: [n_kv_heads][n_tokens][head_dim], bf16 bit patterns (_bf16) or float (_f32).
 * OUT_OF_MEMORY when the layer's capacity (max_tokens) is reached, nothing then appended. */
CERTKV_API certkv_status certkv_kv_store_append_bf16(certkv_kv_store* store, int32_t seq,
                                                     int32_t layer, const uint16_t* k,
                                                     const uint16_t* v, int64_t n_tokens);
CERTKV_API certkv_status certkv_kv_store_append_f32(certkv_kv_store* store, int32_t seq,
                                                    int32_t layer, const float* k, const float* v,
                                                    int64_t n_tokens);
/* Positions stored in (seq, layer). */
CERTKV_API certkv_status certkv_kv_store_length(const certkv_kv_store* store, int32_t seq,
                                                int32_t layer, int64_t* n_tokens);
/* K (kv = 0) or V (kv = 1) of (seq, layer) at positions [begin, end): exact = 0 what attention
 * reads (a lossy page's reconstruction), 1 the exact values (a lossy page from the backing
 * store). out: [n_kv_heads][end - begin][head_dim] float, host memory. A store of device "cuda"
 * decodes its pages on the host (it waits for the store's stream) and refuses exact = 1 for a
 * lossy scheme (CERTKV_ERR_UNSUPPORTED: the device keeps no exact values of lossy pages). */
CERTKV_API certkv_status certkv_kv_store_read(const certkv_kv_store* store, int32_t seq,
                                              int32_t layer, int32_t kv, int64_t begin, int64_t end,
                                              int exact, float* out);
/* Attention of n_queries query positions, the last n_queries of (seq, layer) (query i at
 * position length - n_queries + i attends to positions [0, length - n_queries + i], causal),
 * over the stored pages: certkv's decode attention for one query (with the meter of every head),
 * its prefill attention for several. q: [n_queries][n_heads][head_dim] float (after RoPE);
 * out: [n_queries][n_heads][head_dim] float; meters: [n_heads] or NULL, only with n_queries 1
 * (a lossy scheme's decode step is metered and recorded in certkv_kv_store_meter_stats whether
 * meters is given or not; a prefill is not metered, as in a session). With params.gate, a decode
 * step whose meter exceeds meter_tau on some head has the lossy blocks with the largest share of
 * its bound replaced in seq's tables by their exact values and is attended again (at most 8
 * rounds): out and meters are the last round's; meter_stats records the first round's meters
 * (coverage before repair) and counts the pages repaired. OUT_OF_MEMORY when a repair finds no
 * free raw page (the blocks repaired before stay repaired). */
CERTKV_API certkv_status certkv_kv_store_attend(certkv_kv_store* store, int32_t seq,
                                                int32_t layer, const float* q, int32_t n_queries,
                                                float* out, certkv_head_meter* meters);
/* A store of device "cuda" (its K, V, queries and outputs in device memory; certkv_kv_store_append_*
 * and certkv_kv_store_attend above refuse it with CERTKV_ERR_UNSUPPORTED, and these refuse a "cpu" store with
 * CERTKV_ERR_INVALID_ARGUMENT). Work is enqueued on the store's cuda_stream and not waited for,
 * except where said: pointers must stay valid until the stream has run it, and must be memory of
 * the store's device (CERTKV_ERR_INVALID_ARGUMENT otherwise, before any launch). Every call runs
 * on the device current at create, the caller's current device restored after it.
 *
 * append_device: rows of n_seqs distinct sequences to `layer`, in one launch per call: seqs[i]
 * gets n_tokens[i] >= 1 rows at positions [length, length + n_tokens[i]). k, v: device memory,
 * [sum of n_tokens][n_kv_heads][head_dim] float (the rows of seqs[0] first), rounded as
 * certkv_kv_store_append_f32 rounds them. seqs, n_tokens: host arrays. Complete blocks are
 * encoded on the device; a GAAC scheme without a calibration file brings the first 8,192 rows
 * of the layer's first append to the host to calibrate the layer on them (that call waits). OUT_OF_MEMORY when the
 * layer's capacity (max_tokens over its sequences) would be passed: nothing appended. */
CERTKV_API certkv_status certkv_kv_store_append_device(certkv_kv_store* store, int32_t layer,
                                                       const int32_t* seqs, const int64_t* n_tokens,
                                                       int32_t n_seqs, const float* k,
                                                       const float* v);
/* attend_device: one decode step of n_seqs distinct sequences of `layer`, one launch: the query
 * of seqs[i] (at its last position) attends to every position of seqs[i]. q, out: device memory,
 * [n_seqs][n_heads][head_dim] float; meters: device memory, [n_seqs][n_heads] float, each head's
 * meter (as certkv_head_meter.meter; 0 for a lossless scheme), or NULL. A lossy scheme's meters
 * are recorded in certkv_kv_store_meter_stats whether meters is given or not; meter_stats and
 * kv_stats wait for the stream. */
CERTKV_API certkv_status certkv_kv_store_attend_device(certkv_kv_store* store, int32_t layer,
                                                       const int32_t* seqs, int32_t n_seqs,
                                                       const float* q, float* out, float* meters);
/* note_queries_device: a prompt's queries, for a front end that attends prompts itself (as
 * certkv.transformers does on CUDA, through SDPA): rows of n_seqs distinct sequences of `layer`,
 * n_tokens[i] >= 1 of seqs[i], at most the positions it holds of the layer; q: device memory,
 * [sum of n_tokens][n_heads][head_dim] float (the rows of seqs[0] first). In a store with sparse
 * decode they make the query centroid of the sequence's key index in that layer, as the queries
 * of the prefills certkv_kv_store_attend attends on a cpu store do: when the sequence's first
 * sparse step sets its centroids, c_q is the mean of the queries noted (over the tokens and each
 * KV head's group of query heads, summed in double in the cpu store's order: the same bits), or
 * that step's query when none were. Nothing is noted for a dense layer, a store without sparse
 * decode, or a sequence whose centroids are set. Waits for the stream. */
CERTKV_API certkv_status certkv_kv_store_note_queries_device(certkv_kv_store* store, int32_t layer,
                                                             const int32_t* seqs, const int64_t* n_tokens,
                                                             int32_t n_seqs, const float* q);
/* Planned decode steps, which a stream capture can hold: a CUDA graph of a whole model's decode
 * step (every layer's append and attention) replays as the next step of the same sequences.
 *   plan_device: the next `steps` positions of each of n_seqs distinct sequences (each holding
 *     >= 1 position of every layer) get their pages in every layer, and the steps' state goes to
 *     the device. Waits for the store's stream. *recapture (or NULL) is 1 when a graph captured
 *     under the previous plan would read memory this plan moved or sized otherwise (a pool that
 *     grew, another number of sequences or steps, a context past the previous rounding: an eighth
 *     of a power of two): capture again; else 0.
 *   append_planned_device: one row of each planned sequence (in plan order) for `layer`, k, v
 *     device [n_seqs][n_kv_heads][head_dim] float, at the position the device holds for it.
 *   attend_planned_device: decode attention of the planned sequences of `layer` (after that
 *     layer's append_planned), q, out device [n_seqs][n_heads][head_dim] float, meters device
 *     [n_seqs][n_heads] float or NULL.
 *     Both enqueue on `stream` (a cudaStream_t; NULL: the store's) and launch kernels only (no copy
 *     from the host, no wait, no allocation), reading each sequence's position from the device,
 *     so they may run under a stream capture. A row past the planned steps is not written.
 *   finish_planned_device: waits for `stream` (NULL: none but the store's), then takes the rows
 *     the steps wrote as appended, encodes the blocks they completed (until then attention reads
 *     them exact, from their raw pages, and the meter counts them so), records the meter of every
 *     planned step attended (meter_stats), and gives back the pages no row reached.
 *     OUT_OF_RANGE when a replay ran past the plan (what was written is kept).
 * While a plan is open the store refuses append_device, attend_device, note_queries_device, crop,
 * reorder and select (INVALID_ARGUMENT), and length and read give it as it was at the plan. A
 * store with sparse decode refuses plans (UNSUPPORTED), and so does a dither8 store while a layer
 * has not yet written a whole block (its outlier pairs are still being chosen). Replay a captured
 * graph only between a plan that succeeded and its finish: after finish, or after a plan that
 * failed, the pointers it captured may no longer be the store's memory. */
CERTKV_API certkv_status certkv_kv_store_plan_device(certkv_kv_store* store, const int32_t* seqs, int32_t n_seqs,
                                                     int64_t steps, int32_t* recapture);
CERTKV_API certkv_status certkv_kv_store_append_planned_device(certkv_kv_store* store, int32_t layer,
                                                               const float* k, const float* v, void* stream);
CERTKV_API certkv_status certkv_kv_store_attend_planned_device(certkv_kv_store* store, int32_t layer,
                                                               const float* q, float* out, float* meters,
                                                               void* stream);
CERTKV_API certkv_status certkv_kv_store_finish_planned_device(certkv_kv_store* store, void* stream);
/* *open = 1 while a plan is open (from a plan_device that succeeded to the finish that took its
 * steps, which closes it even when it then reports a failure), else 0; a cpu store: 0. */
CERTKV_API certkv_status certkv_kv_store_planned_device(const certkv_kv_store* store, int32_t* open);
/* Keeps the first n_tokens positions of seq in every layer. REQUIRES: n_tokens <= the length of
 * every layer. A store of device "cuda" refuses (CERTKV_ERR_UNSUPPORTED, the store unchanged) an
 * n_tokens that ends inside a block some layer keeps as a lossy page (fp8-e4m3, fp8-e5m2,
 * dither8: the device keeps no exact values of it); a multiple of 16 is always served. */
CERTKV_API certkv_status certkv_kv_store_crop(certkv_kv_store* store, int32_t seq, int64_t n_tokens);
/* Sequence i becomes what sequence src[i] was, for every i in [0, n_sequences) (beam search):
 * pages are shared by reference count, not copied. src: [n_sequences], each in range. */
CERTKV_API certkv_status certkv_kv_store_reorder(certkv_kv_store* store, const int32_t* src);
/* The store holds n sequences from here on: sequence i is what sequence src[i] was, for every i
 * in [0, n) (a batch grown or narrowed: several samples of one prompt, beam expansion, a batch's
 * finished rows dropped); pages are shared by reference count, not copied, and a sequence no
 * entry names is freed. certkv_kv_store_reorder is the case n = n_sequences. REQUIRES: n >= 1,
 * src: [n], each in [0, n_sequences) (CERTKV_ERR_INVALID_ARGUMENT, CERTKV_ERR_OUT_OF_RANGE; the
 * store unchanged). A cuda store copies a partial last block's raw pages on its stream. */
CERTKV_API certkv_status certkv_kv_store_select(certkv_kv_store* store, const int32_t* src, int32_t n);
/* The meter of the decode steps attended so far (certkv_meter_stats, as a session's), and the
 * KV pages of every layer by storage class (certkv_kv_stats: n_tokens the positions of layer 0
 * over the sequences, kv_bytes_bf16 a contiguous bf16 cache of every layer's positions). */
CERTKV_API certkv_status certkv_kv_store_meter_stats(const certkv_kv_store* store,
                                                     certkv_meter_stats* stats);
CERTKV_API certkv_status certkv_kv_store_kv_stats(const certkv_kv_store* store,
                                                  certkv_kv_stats* stats);
/* Sparse decode since create (certkv_sparse_stats as a session's; sparse 0 and the rest zero for
 * a dense store): steps counts the sparse decode steps of (sequence, layer), cells their (step,
 * query head) cells; indexed_tokens and index_bytes sum over every (layer, sequence) index. */
CERTKV_API certkv_status certkv_kv_store_sparse_stats(const certkv_kv_store* store,
                                                      certkv_sparse_stats* stats);

/* ---- The RaBitQ key index and Top-p selection on arrays ----------------------------------- */

/* One (layer, kv_head) of the sparse tier's key index (docs/sparse.md; record layout:
 * docs/format/rabitq_index.md): the prefill centroids and the rotation P. The arrays are
 * borrowed for the call. */
typedef struct certkv_rabitq_head {
  int32_t head_dim;         /* 32, 64, 96, 128 or 256 */
  const float* c_q;         /* [head_dim] centroid of the queries, finite */
  const float* c_k;         /* [head_dim] centroid of the keys, finite */
  const char* rotation;     /* "haar" or "hadamard" (randomized Hadamard; head_dim a power of 2) */
  uint64_t rotation_seed;   /* P is a pure function of (rotation, head_dim, rotation_seed) */
} certkv_rabitq_head;

/* Bytes of one key's record at head_dim (24 at 64, 32 at 128). INVALID_ARGUMENT for a head_dim
 * the index does not serve. */
CERTKV_API certkv_status certkv_rabitq_record_bytes(int32_t head_dim, size_t* record_bytes);
/* One record per key. k: [n_tokens][head_dim] finite floats; records: [n_tokens][record_bytes]
 * as docs/format/rabitq_index.md lays them out. INVALID_ARGUMENT naming the argument for a null
 * pointer, n_tokens < 0, a bad head, or a non-finite key. */
CERTKV_API certkv_status certkv_rabitq_encode_keys(const certkv_rabitq_head* head, const float* k,
                                                   int64_t n_tokens, void* records);
/* The estimated <q, k_t> of every record (Eq. 6 over the binary x 4-bit product by popcounts,
 * Eq. 17-20), the query quantized with randomized rounding drawn from rounding_seed.
 * records: [n_tokens][record_bytes] from certkv_rabitq_encode_keys with the same head; q:
 * [head_dim] finite; scores: [n_tokens]; scores_ref: [n_tokens] the float reference estimate of
 * the same quantized query (index::rabitq_estimate_scores_ref), or NULL. INVALID_ARGUMENT as
 * certkv_rabitq_encode_keys, and for a record the encoder could not have written (alpha outside
 * (0, 1], a norm or <c_q, k> not finite, a code bit past head_dim, a wrong popcount), naming the
 * record and the field. */
CERTKV_API certkv_status certkv_rabitq_estimate_scores(const certkv_rabitq_head* head,
                                                       const void* records, int64_t n_tokens,
                                                       const float* q, uint64_t rounding_seed,
                                                       float* scores, float* scores_ref);

/* Top-p selection on logits quantized to 1/256 logit (docs/sparse.md, "Top-p on quantized
 * logits"): the threshold bucket B is the first bucket below the largest logit whose upper set
 * certainly holds softmax mass p, and every token of bucket B is taken. */
typedef struct certkv_top_p_selection {
  float threshold;      /* theta: the selected tokens are those with logits[t] >= theta */
  int32_t bucket;       /* B: the selected tokens are those with floor(256 (l_max - l_t)) <= B */
  int64_t n_selected;   /* tokens with mask[t] == 1 */
  double mass;          /* a lower bound on the selected set's softmax mass, >= p */
  int64_t n_boundary;   /* tokens of bucket B */
} certkv_top_p_selection;

/* logits: [n] finite; mask: [n] gets 1 for a selected token, 0 otherwise. INVALID_ARGUMENT
 * naming the argument for n < 1, a null pointer, a non-finite logit, or p outside (0, 1]. */
CERTKV_API certkv_status certkv_top_p_select(const float* logits, int64_t n, double p, uint8_t* mask,
                                             certkv_top_p_selection* out);

/* ---- Reading safetensors files (KV dumps: docs/format/kv_dump.md) ------------------------- */

typedef struct certkv_safetensors certkv_safetensors;

/* Maps and parses a safetensors file, checking every offset and size against the file.
 * NOT_FOUND for a missing file, IO for an unreadable one, CORRUPT (naming the file and what is
 * wrong) for malformed contents, UNSUPPORTED for an unknown dtype. */
CERTKV_API certkv_status certkv_safetensors_open(const char* path, certkv_safetensors** out);
CERTKV_API void certkv_safetensors_free(certkv_safetensors* file);
/* The number of tensors and of metadata entries. */
CERTKV_API certkv_status certkv_safetensors_count(const certkv_safetensors* file, size_t* n_tensors,
                                                  size_t* n_metadata);
/* Tensor `index` in [0, n_tensors), in the header's order. Its name, dtype, shape and data point
 * into the file and stay valid until certkv_safetensors_free; the data may be unaligned.
 * OUT_OF_RANGE for an index past the count. */
CERTKV_API certkv_status certkv_safetensors_tensor(const certkv_safetensors* file, size_t index,
                                                   certkv_tensor_view* out);
/* Metadata entry `index` in [0, n_metadata), keys in ascending order; the strings stay valid
 * until certkv_safetensors_free. OUT_OF_RANGE for an index past the count. */
CERTKV_API certkv_status certkv_safetensors_metadata(const certkv_safetensors* file, size_t index,
                                                     certkv_metadata_entry* out);

#ifdef __cplusplus
}
#endif

#endif /* CERTKV_CERTKV_H_ */

#!/usr/bin/env python3
"""Decode attention of the peers that issue 6 compares certkv with: torch SDPA and FlashInfer.

One query token per sequence against a KV cache made of real tokens tiled to each context. Writes
JSON lines, one per (peer, shape, batch, ctx), after a first {"kind": "env"} line. A failing peer
is recorded as {"peer": ..., "error": ...} and the run goes on. Device setup: bench/peers_setup.sh.

usage: decode_peers.py --kv KV.safetensors --out peers.jsonl [--contexts 8192,32768,65536,131072]
                       [--batches 1,8] [--shapes 32x8,28x4] [--peers NAME,...] [--reps 7]
                       [--timing graph|eager] [--dry-run]

--kv holds k, v: BF16 [8][N][128] (KV heads, N real tokens in position order, head_dim) and
q: F32 [8][7][128] (7 query vectors per KV head); metadata `source` is copied to the env line.
--dry-run runs on the CPU with tiny contexts: the tiling, the paged layout (checked through a
torch emulation of the paged kernel, scales included), the references and the JSON; no timing.
"""
import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

HEAD_DIM = 128
PAGE_TOKENS = 16
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
# shape name -> (KV heads used, query heads per KV head); query head h reads KV head h // group.
SHAPES = {"32x8": (8, 4), "28x4": (4, 7)}
L2_ROTATION_BYTES = 256 << 20  # >= 4x the H200's 60 MB L2: no call finds its KV in L2
MEMORY_CAP_BYTES = 60 * 10**9
MIN_CALLS = 50
WARMUP_CALLS = 10
COPY_BYTES = 2 << 30
REL_ERR_WARN = 2e-2
# The CUDA-core decode kernel of FlashInfer 0.6.9 instantiates these GQA group sizes only
# (DISPATCH_GQA_GROUP_SIZE); other groups run its tensor-core (prefill) kernel.
FI_DECODE_GROUPS = {1, 2, 3, 4, 8}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

SDPA_PEERS = {"sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
              "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH"}
# peer -> (KV dtype, tensor cores forced)
FI_PEERS = {"flashinfer_bf16": (torch.bfloat16, False), "flashinfer_bf16_tc": (torch.bfloat16, True),
            "flashinfer_fp8": (torch.float8_e4m3fn, False), "flashinfer_fp8_tc": (torch.float8_e4m3fn, True),
            "flashinfer_fp8_e5m2": (torch.float8_e5m2, False)}
ALL_PEERS = list(SDPA_PEERS) + list(FI_PEERS)
FI_BUILD_ERRORS = {}  # (kernel, KV dtype) -> why its JIT build failed, so later cells do not rebuild


class SkipPeer(Exception):
    """A peer that would repeat another's kernel for this cell."""


def fi_kernel(kv_dtype, force_tc, group):
    """The FlashInfer module a peer runs: ("decode" | "prefill", KV dtype)."""
    return ("prefill" if force_tc or group not in FI_DECODE_GROUPS else "decode", kv_dtype)


def log(msg):
    print(msg, flush=True)


def csv(text, cast=str):
    return [cast(x) for x in text.split(",") if x]


def load_input(path):
    """Returns k, v: [8][N][128] bf16, q: [8][7][128] f32, and the metadata `source`."""
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        missing = {"k", "v", "q"} - set(f.keys())
        if missing:
            sys.exit(f"decode_peers: {path} lacks tensor(s) {sorted(missing)}")
        k, v, q = (f.get_tensor(name) for name in ("k", "v", "q"))
    for name, t, dtype, lead in (("k", k, torch.bfloat16, None), ("v", v, torch.bfloat16, None),
                                 ("q", q, torch.float32, 7)):
        if t.dtype != dtype or t.dim() != 3 or t.shape[0] != 8 or t.shape[2] != HEAD_DIM or \
                (lead is not None and t.shape[1] != lead):
            want = f"[8][{lead or 'N'}][{HEAD_DIM}] {dtype}"
            sys.exit(f"decode_peers: tensor {name} is {list(t.shape)} {t.dtype}, expected {want}")
    if k.shape != v.shape or k.shape[1] == 0:
        sys.exit(f"decode_peers: k {list(k.shape)} and v {list(v.shape)} must match, N >= 1")
    return k, v, q, meta.get("source", "")


def tile_tokens(x, n_kv, ctx):
    """x: [8][N][D] -> [ctx][n_kv][D] (NHD): the N tokens repeated in position order up to ctx."""
    idx = torch.arange(ctx, device=x.device) % x.shape[1]
    return x[:n_kv].index_select(1, idx).transpose(0, 1).contiguous()


def attention_ref(q, k, v, group, k_scale=1.0, v_scale=1.0):
    """Float32 attention of one sequence. q: [Hq][D], k, v: [ctx][n_kv][D] -> [Hq][D]."""
    n_kv = k.shape[1]
    qg = q.float().view(n_kv, group, HEAD_DIM)
    s = torch.einsum("hgd,thd->hgt", qg, k.float()) * (SM_SCALE * k_scale)
    o = torch.einsum("hgt,thd->hgd", torch.softmax(s, dim=-1), v.float()) * v_scale
    return o.reshape(n_kv * group, HEAD_DIM)


def rel_err(out, ref):
    """Largest ||out_b - ref|| / ||ref|| over the first and last sequence. out: [B][Hq][D]."""
    return max((out[b].float() - ref).norm().item() / ref.norm().item() for b in {0, out.shape[0] - 1})


class Cell:
    """One (shape, batch, ctx): the tiled KV of one sequence, its query and its reference."""

    def __init__(self, k_src, v_src, q_src, shape, batch, ctx, device):
        self.shape, self.batch, self.ctx = shape, batch, ctx
        self.n_kv, self.group = SHAPES[shape]
        self.n_q = self.n_kv * self.group
        self.k = tile_tokens(k_src.to(device), self.n_kv, ctx)  # [ctx][n_kv][D] bf16
        self.v = tile_tokens(v_src.to(device), self.n_kv, ctx)
        self.q = q_src[:self.n_kv, :self.group].reshape(self.n_q, HEAD_DIM).to(device, torch.bfloat16)
        self.ref = attention_ref(self.q, self.k, self.v, self.group)

    def kv_bytes_bf16(self):
        return self.batch * self.ctx * self.n_kv * HEAD_DIM * 2 * 2

    def queries(self):
        """[B][Hq][D] bf16, the same query for every sequence, a fresh buffer."""
        return self.q.unsqueeze(0).expand(self.batch, -1, -1).contiguous()


def n_sets_for(kv_bytes):
    n = max(1, math.ceil(L2_ROTATION_BYTES / kv_bytes))
    if n * kv_bytes > MEMORY_CAP_BYTES:
        n = max(1, MEMORY_CAP_BYTES // kv_bytes)
        log(f"  memory cap: {n} set(s) of {kv_bytes / 1e9:.2f} GB instead of the L2 rotation target")
    return n


# ---- peers: each setup returns (call(set_index) -> out [B][Hq][D], kv_bytes of one set, info) ----

def sdpa_setup(cell, peer, n_sets, dry_run, peers=()):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPA_PEERS[peer]
    sets = []
    for _ in range(n_sets):
        k = torch.empty(cell.batch, cell.n_kv, cell.ctx, HEAD_DIM, dtype=torch.bfloat16, device=cell.k.device)
        v = torch.empty_like(k)
        for b in range(cell.batch):  # distinct copies, not views of one buffer
            k[b].copy_(cell.k.transpose(0, 1))
            v[b].copy_(cell.v.transpose(0, 1))
        sets.append((cell.queries().unsqueeze(2), k, v))
    info = {}
    if backend is None:
        try:
            q, k, v = sets[0]
            choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=SM_SCALE, enable_gqa=True)
            info["backend"] = next(b.name for b in SDPBackend.__members__.values() if int(b.value) == choice)
        except Exception as e:  # private API: the backend stays unrecorded
            info["backend"] = f"unknown ({type(e).__name__})"

    def call(i):
        q, k, v = sets[i]
        ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, scale=SM_SCALE, enable_gqa=True)
        return out.view(cell.batch, cell.n_q, HEAD_DIM)

    return call, 2 * sets[0][1].numel() * 2, info


def to_pages(x, n_pages_seq):
    """[ctx][n_kv][D] -> [n_pages_seq][PAGE_TOKENS][n_kv][D], the last page zero-padded."""
    pad = n_pages_seq * PAGE_TOKENS - x.shape[0]
    return F.pad(x, (0, 0, 0, 0, 0, pad)).view(n_pages_seq, PAGE_TOKENS, *x.shape[1:])


def paged_emulation(cell, kv, indptr, indices, last_page_len, k_scale, v_scale):
    """What the paged decode kernel computes, in torch: gathers each sequence's tokens through
    indptr / indices / last_page_len, so a wrong layout or scale shows in rel_err (dry run)."""
    outs = []
    for b in range(cell.batch):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        n_tok = (len(pages) - 1) * PAGE_TOKENS + int(last_page_len[b])
        k = kv[pages, 0].reshape(-1, cell.n_kv, HEAD_DIM)[:n_tok]
        v = kv[pages, 1].reshape(-1, cell.n_kv, HEAD_DIM)[:n_tok]
        outs.append(attention_ref(cell.q, k, v, cell.group, k_scale or 1.0, v_scale or 1.0))
    return torch.stack(outs).to(torch.bfloat16)


def flashinfer_setup(cell, peer, n_sets, dry_run, peers=()):
    kv_dtype, force_tc = FI_PEERS[peer]
    kernel = fi_kernel(kv_dtype, force_tc, cell.group)
    tensor_cores = kernel[0] == "prefill"
    info = {"variant": "tensor_cores" if tensor_cores else "cuda_cores", "page_tokens": PAGE_TOKENS,
            "layout": "NHD"}
    # For a group the decode kernel lacks, X_tc and X are one kernel: timed once, under X when
    # both are asked for (under X_tc when only it is).
    if peer.endswith("_tc") and cell.group not in FI_DECODE_GROUPS and peer[:-3] in peers:
        raise SkipPeer(f"same kernel as {peer[:-3]} for group {cell.group}")
    if kernel in FI_BUILD_ERRORS:
        raise RuntimeError(f"JIT build of {kernel[0]} {kv_dtype} failed: {FI_BUILD_ERRORS[kernel]}")
    k_scale = v_scale = None
    k, v = cell.k, cell.v
    if kv_dtype != torch.bfloat16:  # per-tensor scale: x = x_fp8 * scale
        k_scale = cell.k.float().abs().max().item() / FP8_MAX[kv_dtype]
        v_scale = cell.v.float().abs().max().item() / FP8_MAX[kv_dtype]
        k = (cell.k.float() / k_scale).to(kv_dtype)
        v = (cell.v.float() / v_scale).to(kv_dtype)
        info.update(k_scale=k_scale, v_scale=v_scale, kv_dtype=str(kv_dtype).replace("torch.", ""))
        info["ref_dequant"] = attention_ref(cell.q, k.float() * k_scale, v.float() * v_scale, cell.group)
    n_pages_seq = math.ceil(cell.ctx / PAGE_TOKENS)
    k_pages, v_pages = to_pages(k, n_pages_seq), to_pages(v, n_pages_seq)
    dev = cell.k.device
    sets = []
    for _ in range(n_sets):
        kv = torch.empty(cell.batch * n_pages_seq, 2, PAGE_TOKENS, cell.n_kv, HEAD_DIM, dtype=kv_dtype, device=dev)
        for b in range(cell.batch):  # sequence b owns pages [b * n_pages_seq, (b + 1) * n_pages_seq)
            kv[b * n_pages_seq:(b + 1) * n_pages_seq, 0].copy_(k_pages)
            kv[b * n_pages_seq:(b + 1) * n_pages_seq, 1].copy_(v_pages)
        sets.append((cell.queries(), kv))
    del k, v, k_pages, v_pages
    indptr = torch.arange(cell.batch + 1, dtype=torch.int32, device=dev) * n_pages_seq
    indices = torch.arange(cell.batch * n_pages_seq, dtype=torch.int32, device=dev)
    last_page_len = torch.full((cell.batch,), cell.ctx - (n_pages_seq - 1) * PAGE_TOKENS, dtype=torch.int32,
                               device=dev)
    kv_bytes = sets[0][1].numel() * sets[0][1].element_size()
    if dry_run:
        return (lambda i: paged_emulation(cell, sets[i][1], indptr, indices, last_page_len, k_scale, v_scale),
                kv_bytes, info)
    import flashinfer
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    t0 = time.time()
    wrapper.plan(indptr, indices, last_page_len, cell.n_q, cell.n_kv, HEAD_DIM, PAGE_TOKENS,
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype, sm_scale=SM_SCALE)
    info["plan_s"] = round(time.time() - t0, 3)

    def call(i):
        q, kv = sets[i]
        return wrapper.run(q, kv, k_scale=k_scale, v_scale=v_scale)

    return call, kv_bytes, info


def prebuild_flashinfer(peers, shapes):
    """JIT-compiles, in parallel, the FlashInfer modules that plan() would build one by one."""
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    kernels = {fi_kernel(*FI_PEERS[peer], SHAPES[shape][1]) for peer in peers for shape in shapes}

    def build(kernel):
        # the arguments plan() passes: q, kv, o, index dtypes, head dims, no RoPE, no window, no soft cap
        args = (torch.bfloat16, kernel[1], torch.bfloat16, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False)
        t0 = time.time()
        try:
            if kernel[0] == "prefill":
                gen_batch_prefill_module("fa2", *args, False).build(verbose=False)  # no fp16 QK reduction
            else:
                gen_batch_decode_module(*args).build(verbose=False)
            return f"  jit {kernel[0]} {kernel[1]}: {time.time() - t0:.0f} s"
        except Exception as e:
            FI_BUILD_ERRORS[kernel] = str(e)[-2000:]
            return f"  jit {kernel[0]} {kernel[1]}: FAILED after {time.time() - t0:.0f} s: {str(e)[-2000:]}"

    log(f"flashinfer: compiling {len(kernels)} module(s) in parallel")
    with ThreadPoolExecutor(max(1, len(kernels))) as pool:
        for line in pool.map(build, sorted(kernels, key=str)):
            log(line)


# ---- timing ----

def time_calls(call, n_sets, reps, timing):
    """Median / min / max microseconds per call over reps repetitions of `calls` calls cycling the sets."""
    calls = n_sets * math.ceil(MIN_CALLS / n_sets)
    for i in range(max(WARMUP_CALLS, n_sets)):
        call(i % n_sets)
    torch.cuda.synchronize()

    def eager():
        return [call(i % n_sets) for i in range(calls)]

    run, mode = eager, "eager"
    if timing == "graph":
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = eager()
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            diff = rel_err(outs[-1], call((calls - 1) % n_sets)[0].float())
            if not diff <= 1e-3:  # NaN too: the kernel did not run inside the graph
                raise RuntimeError(f"graph output differs from an eager call by {diff:.3g}")
            run, mode = graph.replay, "graph"
        except Exception as e:
            log(f"  CUDA graph timing refused ({type(e).__name__}: {str(e)[:200]}); timing eager launches")
        torch.cuda.synchronize()
    samples = [ms * 1e3 / calls for ms in event_ms(run, reps)]
    return statistics.median(samples), min(samples), max(samples), mode, calls


def event_ms(fn, reps):
    """Milliseconds of each of reps runs of fn, between CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def copy_bandwidth_tb_s(reps=10):
    """Device-to-device copy of 2 GiB: (bytes read + written) / time, median of reps."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    event_ms(lambda: dst.copy_(src), 3)  # warm-up
    return statistics.median(2 * COPY_BYTES / (ms * 1e-3) / 1e12 for ms in event_ms(lambda: dst.copy_(src), reps))


# ---- driver ----

def run_peer(cell, peer, args, copy_tb_s):
    row = {"peer": peer, "shape": cell.shape, "batch": cell.batch, "ctx": cell.ctx}
    setup = sdpa_setup if peer in SDPA_PEERS else flashinfer_setup
    fp8 = peer in FI_PEERS and FI_PEERS[peer][0] != torch.bfloat16
    n_sets = 1 if args.dry_run else n_sets_for(cell.kv_bytes_bf16() // (2 if fp8 else 1))
    call, kv_bytes, info = setup(cell, peer, n_sets, args.dry_run, csv(args.peers))
    ref_dequant = info.pop("ref_dequant", None)
    out = call(0)
    row.update(info)
    row["rel_err"] = rel_err(out, cell.ref)
    if ref_dequant is not None:
        row["rel_err_dequant"] = rel_err(out, ref_dequant)
    row.update(kv_bytes=kv_bytes, n_sets=n_sets, copy_tb_s=copy_tb_s)
    if args.dry_run:
        row.update(us=None, timing="dry-run")
    else:
        us, us_min, us_max, mode, calls = time_calls(call, n_sets, args.reps, args.timing)
        tb_s = kv_bytes / us / 1e6
        row.update(us=us, us_min=us_min, us_max=us_max, tb_s=tb_s, pct_copy=100 * tb_s / copy_tb_s,
                   timing=mode, calls=calls)
    own = row.get("rel_err_dequant", row["rel_err"])
    if own > REL_ERR_WARN:
        log(f"  WARNING {peer} {cell.shape} b{cell.batch} ctx {cell.ctx}: rel_err {own:.3g} > {REL_ERR_WARN}")
    return row


def env_line(args, source, n_tokens):
    env = {"kind": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "source": source,
           "n_tokens": n_tokens, "dry_run": args.dry_run, "timing": args.timing, "reps": args.reps}
    try:
        import flashinfer
        env["flashinfer"] = flashinfer.__version__
    except Exception as e:
        env["flashinfer"] = f"unavailable: {type(e).__name__}: {e}"
    if not args.dry_run:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None), copy_tb_s=copy_bandwidth_tb_s())
    return env


def print_table(rows):
    """rel_err: against the bf16 reference; own_err: fp8 peers against their dequantized KV."""
    log("\npeer                 shape batch     ctx        us    TB/s  %copy   rel_err   own_err")
    for r in rows:
        key = f"{r['peer']:20} {r['shape']:5} {r['batch']:5} {r['ctx']:7}"
        if "error" in r:
            log(f"{key}  ERROR {r['error'][:70]}")
            continue
        timed = r.get("us") is not None
        us = f"{r['us']:8.1f} {r['tb_s']:7.3f} {r['pct_copy']:5.1f}%" if timed else f"{'-':>8} {'-':>7} {'-':>6}"
        own = f"{r['rel_err_dequant']:.2e}" if "rel_err_dequant" in r else "-"
        log(f"{key}  {us}  {r['rel_err']:.2e}  {own:>8}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", help="default 8192,32768,65536,131072 (dry run: 40,100)")
    ap.add_argument("--batches", help="default 1,8 (dry run: 1,3)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--peers", default=",".join(ALL_PEERS), help=f"any of {','.join(ALL_PEERS)}")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="graph: time a CUDA graph of the calls (GPU time, no Python launch cost)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    contexts = csv(args.contexts or ("40,100" if args.dry_run else "8192,32768,65536,131072"), int)
    batches = csv(args.batches or ("1,3" if args.dry_run else "1,8"), int)
    shapes, peers = csv(args.shapes), csv(args.peers)
    bad = [s for s in shapes if s not in SHAPES] + [p for p in peers if p not in ALL_PEERS]
    if bad or args.reps < 5 or min(contexts) < 1 or min(batches) < 1:
        sys.exit(f"decode_peers: unknown shape/peer {bad} or reps < 5 or a context/batch < 1")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("decode_peers: no CUDA device (use --dry-run on a CPU)")
    device = "cpu" if args.dry_run else "cuda"

    k_src, v_src, q_src, source = load_input(args.kv)
    log(f"input: {k_src.shape[1]} real tokens, source {source!r}")
    env = env_line(args, source, k_src.shape[1])
    log(json.dumps(env))
    fi_peers = [p for p in peers if p in FI_PEERS]
    fi_error = None
    if fi_peers and not args.dry_run:
        if env["flashinfer"].startswith("unavailable"):
            fi_error = env["flashinfer"]
            log(f"flashinfer peers will be recorded as errors: {fi_error}")
        else:
            prebuild_flashinfer(fi_peers, shapes)

    rows, traced = [], set()
    with open(args.out, "w") as out:
        out.write(json.dumps(env) + "\n")
        for shape, ctx, batch in ((s, c, b) for s in shapes for c in contexts for b in batches):
            log(f"cell {shape} batch {batch} ctx {ctx}")
            cell = cell_error = None
            try:
                cell = Cell(k_src, v_src, q_src, shape, batch, ctx, device)
            except Exception as e:
                cell_error = f"cell setup: {type(e).__name__}: {e}"
            for peer in peers:
                t0 = time.time()
                try:
                    if cell_error or (fi_error and peer in FI_PEERS):
                        raise RuntimeError(cell_error or fi_error)
                    row = run_peer(cell, peer, args, env.get("copy_tb_s"))
                except SkipPeer as e:
                    log(f"  {peer}: skipped ({e})")
                    continue
                except Exception as e:
                    row = {"peer": peer, "shape": shape, "batch": batch, "ctx": ctx,
                           "error": f"{type(e).__name__}: {e}"[:2000]}
                    log(f"  {peer}: ERROR {row['error'][:300]}")
                    if peer not in traced:  # one traceback per peer is enough
                        traced.add(peer)
                        traceback.print_exc(limit=4)
                else:
                    us = "dry" if row["us"] is None else f"{row['us']:.1f} us {row['pct_copy']:.0f}% copy"
                    log(f"  {peer}: {us} rel_err {row['rel_err']:.2e} ({time.time() - t0:.1f} s)")
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                if device == "cuda":
                    torch.cuda.empty_cache()
            del cell
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

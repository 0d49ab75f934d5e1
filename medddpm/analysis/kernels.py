"""Which kernels a training step ran, in which pass, and for how long: the kernel table of a torch.profiler
(Kineto) trace, its categories and readable names.

A trace becomes one row per (kernel, pass, operator that launched it): device time, launches, share of the
profiled time, a category and whether the name says tensor cores. Passes come from the `record_function`
ranges "forward", "backward" and "optimizer" that `Engine._step` opens; a kernel belongs to the range its
*launch* (the CPU-side runtime call, linked to the kernel by its CUPTI correlation id) falls in, by time, on any
thread: autograd launches backward kernels from its own device thread, so nesting under the range's operator
tree would miss them. Kernels replayed by a CUDA graph carry the correlation id of their `cudaGraphLaunch` and
get the pass "graph". On a CPU there are no kernels: the rows are aten operators with their self CPU time,
attributed the same way.

Pure functions of names and of the exported trace (plain JSON), which tests feed with hand-made traces:
`kernel_rows_from_trace` (GPU), `op_rows_from_trace` (CPU), `categorize`, `short_name`. The profiling pass
that makes the trace is `medddpm.train.profiling.profile_kernels`.
"""

from __future__ import annotations

import re

import pandas as pd

CATEGORIES = ("convolution", "gemm", "attention", "elementwise", "normalization", "reduction", "layout", "fused",
              "memcpy", "optimizer", "other")
PASSES = ("forward", "backward", "optimizer")
COLUMNS = ("kernel", "short_name", "category", "pass", "op", "calls", "total_us", "micro_steps", "share", "tensor_cores",
           "device_type")

# ------------------------------------------------------------------------------------ categories

# First match wins, and the order carries meaning. Rules search the whole name, template arguments
# included, because PyTorch's generic launchers (elementwise_kernel<..., direct_copy_kernel_cuda...>)
# say what they do only there.
#  1 memcpy        before all: "Memcpy HtoD (Pageable -> Device)" holds words of other rules.
#  2 fused         Inductor's Triton kernels are named after what they fuse ("triton_per_fused_native_
#                  group_norm_silu_0"): a fused kernel is fused, whatever it contains.
#  3 optimizer     multi_tensor_apply / foreach / fused Adam, before elementwise (which they are too).
#  4 attention     before gemm and convolution: cutlass fmha and cuDNN's SDPA kernels say cutlass/cudnn.
#  5 normalization before elementwise and reduction: GroupNorm runs partly through elementwise_kernel
#                  and Welford reductions whose template arguments name GroupNorm.
#  6 layout        before convolution: cuDNN's nchwToNhwcKernel and tensorTransformGeneric say cudnn.
#                  Holds copies, and so also dtype casts, which PyTorch runs through the same copy
#                  kernels (direct_copy_kernel_cuda, bfloat16_copy_kernel_cuda).
#  7 convolution   before gemm: implicit-GEMM convolutions say gemm ("implicit_convolve_sgemm"). Any
#                  other cuDNN kernel (workspace init, wgrad reduction helpers) counts here too.
#  8 gemm
#  9 reduction     softmax counts as a reduction (row max and sum dominate it).
# 10 elementwise   pointwise math, random numbers, index/arange/scatter-gather, fills.
# 11 other
_ATEN_GEMM = "mm|bmm|addmm|addbmm|baddbmm|matmul|einsum|linear|dot|mv|addmv"
_ATEN_REDUCE = "sum|mean|max|min|amax|amin|argmax|argmin|norm|linalg_vector_norm|prod|std|var|std_mean|var_mean|" \
               "logsumexp|cumsum|mse_loss|l1_loss|all|any"
_ATEN_LAYOUT = "copy_|clone|contiguous|to|_to_copy|permute|transpose|t|view|_unsafe_view|reshape|_reshape_alias|" \
               "as_strided|as_strided_|expand|squeeze|unsqueeze|slice|select|narrow|split|chunk|cat|stack|flatten|" \
               "unflatten|constant_pad_nd|pad"
_RULES = [(category, re.compile(pattern, re.IGNORECASE)) for category, pattern in [
    ("memcpy", r"^(memcpy|memset)"),
    ("fused", r"^triton_"),
    ("optimizer", r"multi_tensor_apply|foreach|fused_?adam"),
    ("attention", r"flash|fmha|mem_eff|efficient_attention|attention|sdpa"),
    ("normalization", r"group_?norm|layer_?norm|batch_?norm|instance_?norm|rms_?norm|rowwisemoments|fusedparams|"
                      r"internalgradients|gammabeta|\bbn_[fb]w"),
    ("layout", r"nchw_?to|to_?nchw|nhwc_?to|to_?nhwc|tensortransform|(?<!conv_)transpose|permute|(?<![a-z])pad|"
               rf"padding|copy|im2col|col2im|vol2col|col2vol|aten::({_ATEN_LAYOUT})(_backward)?$"),
    ("convolution", r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_gemm|cudnn"),
    ("gemm", rf"gemm|gemv|nvjet|cublas|cutlass|splitkreduce|aten::({_ATEN_GEMM})$"),
    ("reduction", rf"reduce|softmax|aten::({_ATEN_REDUCE})$"),
    ("elementwise", r"elementwise|distribution|index|arange|scatter|gather|fill|random|normal|uniform|where|upsample|"
                    r"aten::(add|sub|mul|div|neg|abs|exp|log|sqrt|rsqrt|pow|silu|sigmoid|tanh|gelu|relu|threshold|"
                    r"clamp|lerp|addcmul|addcdiv|zero|ones|zeros|full|rand|randn|randint|cos|sin|maximum|minimum|"
                    r"eq|ne|lt|le|gt|ge|isneginf|isinf|isnan|sign|sgn|reciprocal|mse_loss|l1_loss)_?(_backward)?$"),
]]


def categorize(name: str) -> str:
    """One of CATEGORIES for a kernel (or aten operator) name; rule order above."""
    return next((category for category, rule in _RULES if rule.search(name)), "other")


# Hopper warpgroup MMA, Ampere-style mma names, and the data types that only tensor cores compute
# in a conv/GEMM kernel (TF32 and 16/8-bit inputs; strict FP32 "f32f32_f32f32" runs on the FMA pipes).
_TENSOR_CORE = re.compile(r"gmma|hmma|imma|tensorop|s16816|s1688|h16816|h1688|i8816|tf32|bf16|f16|fp16|e4m3|e5m2|fp8",
                          re.IGNORECASE)


def uses_tensor_cores(name: str) -> bool:
    """Whether the kernel's name says it runs on tensor cores. A name heuristic only: Nsight Compute's
    tensor-pipe counters (sm__pipe_tensor_*) are the authority. Triton kernels never say (False)."""
    category = categorize(name)
    if category == "attention":
        # flash kernels always use mma; cutlass fmha in f32 is SIMT; cuDNN's SDPA is 16-bit only.
        return bool(re.search(r"flash|sdpa", name, re.IGNORECASE) or
                    re.search(r"fmha", name, re.IGNORECASE) and re.search(r"f16", name, re.IGNORECASE))
    if category not in ("convolution", "gemm"):
        return False
    # cuBLAS's nvjet kernels ("nvjet_sm90_tst_...") are tensor-core kernels, but for the FP32 "sss"
    # family (its TF32 variant says tf32).
    return bool(_TENSOR_CORE.search(name) or
                re.search(r"nvjet", name, re.IGNORECASE) and not re.search(r"nvjet(_sm\d+)?_sss", name, re.IGNORECASE))


# ------------------------------------------------------------------------------------ short names

# Generic launchers whose own name says little: the label leads with what they run (from the
# template arguments); cutlass's Kernel/Kernel2 wrappers are dropped altogether.
_LAUNCHERS = {"elementwise_kernel", "vectorized_elementwise_kernel", "unrolled_elementwise_kernel", "reduce_kernel",
              "multi_tensor_apply_kernel", "distribution_elementwise_grid_stride_kernel",
              "elementwise_kernel_with_index"}
_WRAPPERS = {"Kernel", "Kernel2"}
_HINT = re.compile(r"\b(?!(?:A|B)?(?:Unary|Binary)Functor\b)"  # PyTorch's wrappers around the real functor
                   r"([A-Za-z_]\w*?(?:Functor\w*|_functor|_kernel_cuda|_kernel_impl|_kernel|_cuda_out|ImplInternal|Ops)"
                   r"|cutlass\w+)\b")
MAX_LABEL = 60


def _strip_groups(text: str, open_: str, close: str) -> tuple[str, str]:
    """Remove balanced open_..close groups (a stray closer is kept out); return the rest and the
    first top-level group's contents."""
    out, first, depth, start = [], None, 0, 0
    for i, ch in enumerate(text):
        if ch == open_:
            if depth == 0:
                start = i + 1
            depth += 1
        elif ch == close and depth:
            depth -= 1
            if depth == 0 and first is None:
                first = text[start:i]
        elif depth == 0 and ch != close:
            out.append(ch)
    return "".join(out), first or ""


def short_name(name: str) -> str:
    """A readable label: no return type, template arguments, argument lists or namespaces, at most
    MAX_LABEL characters; generic launchers are named after what they run, then themselves."""
    if re.match(r"(memcpy|memset)", name, re.IGNORECASE):
        label = name
    else:
        # Anonymous namespaces come as "(anonymous namespace)", "<unnamed>" or, from ncu, "unnamed>".
        bare, template = _strip_groups(re.sub(r"<?unnamed>", "", name.removeprefix("void ").strip()), "<", ">")
        bare, _ = _strip_groups(bare, "(", ")")
        parts = bare.split()[-1].split("::") if bare.strip() else [name]
        label = "::".join(parts[-2:]) if parts[-1] == "kernel" else parts[-1]  # cuBLAS: gemvx::kernel
        hint = _HINT.search(template)
        if hint and label in _LAUNCHERS | _WRAPPERS:
            label = hint.group(1) if label in _WRAPPERS else f"{hint.group(1)} [{label}]"
    return label if len(label) <= MAX_LABEL else label[:MAX_LABEL - 3] + "..."


# ------------------------------------------------------------------------------------ trace parsing


def _events(trace: dict) -> pd.DataFrame:
    """Complete ('X') events of a Kineto trace, with the fields used here."""
    rows = [(e.get("cat", "").lower(), e.get("name", ""), float(e["ts"]), float(e.get("dur", 0.0)),
             str(e.get("tid", "")), (e.get("args") or {}).get("correlation"))
            for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    return pd.DataFrame(rows, columns=["cat", "name", "ts", "dur", "tid", "correlation"])


def _passes(events: pd.DataFrame, ts: pd.Series) -> pd.Series:
    """The pass whose CPU range contains each time stamp, on any thread; innermost wins."""
    ranges = events[(events.cat == "user_annotation") & events.name.isin(PASSES)].sort_values("ts")
    out = pd.Series("other", index=ts.index, dtype=object)
    for r in ranges.itertuples():  # a few ranges per step; later-starting (inner) ones overwrite
        out[(ts >= r.ts) & (ts <= r.ts + r.dur)] = r.name
    return out


def _launching_ops(events: pd.DataFrame, ts: pd.Series, tid: pd.Series) -> pd.Series:
    """For each (time stamp, thread): the outermost aten operator open there (the one the code called:
    aten::convolution_backward, not the aten::copy_ it ran inside), else the innermost other CPU range
    (an Inductor graph call, an autograd node), else ''. Nesting is by time, on one thread."""
    ops = events[events.cat.isin(("cpu_op", "user_annotation")) & ~events.name.isin(PASSES)]
    out = pd.Series("", index=ts.index, dtype=object)
    probes = pd.DataFrame({"ts": ts, "tid": tid}).dropna().sort_values("ts", kind="stable")
    for t, at in probes.groupby(probes.tid.astype(str)):
        own = ops[ops.tid == t].sort_values(["ts", "dur"], ascending=[True, False])  # a parent before its child
        starts, ends, names = own.ts.to_numpy(), (own.ts + own.dur).to_numpy(), own.name.to_numpy()
        stack: list[int] = []  # the ranges open at the last time seen, outermost first
        i = 0
        for idx, when in zip(at.index, at.ts.to_numpy()):
            while i < len(starts) and starts[i] <= when:
                while stack and ends[stack[-1]] < starts[i]:
                    stack.pop()
                stack.append(i)
                i += 1
            while stack and ends[stack[-1]] < when:
                stack.pop()
            aten = [names[j] for j in stack if names[j].startswith("aten::")]
            out[idx] = aten[0] if aten else (names[stack[-1]] if stack else "")
    return out


def _rows(df: pd.DataFrame, *, steps: int, device_type: str) -> pd.DataFrame:
    """Aggregate (name, pass, op, us) records into the documented table, largest first."""
    if df.empty:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in
                             zip(COLUMNS, [str, str, str, str, str, "int64", "float64", "int64", "float64", bool, str])})
    g = (df.groupby(["kernel", "pass", "op"], sort=False).us.agg(calls="size", total_us="sum").reset_index()
         .sort_values(["total_us", "kernel", "pass", "op"], ascending=[False, True, True, True], ignore_index=True))
    total = g.total_us.sum()
    names = g.kernel
    return pd.DataFrame({
        "kernel": names.astype(str),
        "short_name": names.map(short_name).astype(str),
        "category": names.map(categorize).astype(str),
        "pass": g["pass"].astype(str),
        "op": g["op"].astype(str),
        "calls": g.calls.astype("int64"),
        "total_us": g.total_us.astype("float64"),
        "micro_steps": pd.Series(steps, index=g.index, dtype="int64"),
        "share": (g.total_us / total if total > 0 else g.total_us * 0.0).astype("float64"),
        # CPU operator names may say "flash" but run no tensor cores.
        "tensor_cores": (names.map(uses_tensor_cores) & (device_type == "cuda")).astype(bool),
        "device_type": pd.Series(device_type, index=g.index, dtype=str),
    })


_GPU_CATS = ("kernel", "cuda_kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def kernel_rows_from_trace(trace: dict, *, steps: int) -> pd.DataFrame:
    """Rows per (kernel, pass) from a Kineto trace with GPU activity (kernels, memcpy, memset)."""
    ev = _events(trace)
    gpu = ev[ev.cat.isin(_GPU_CATS)]
    launches = ev[ev.cat.isin(_LAUNCH_CATS) & ev.correlation.notna()].drop_duplicates("correlation")
    launch = gpu[["correlation"]].merge(launches[["correlation", "name", "ts", "tid"]], on="correlation", how="left")
    launch.index = gpu.index
    passes = _passes(ev, launch.ts)  # no launch record (before the profiler started): "other"
    replayed = launch.name.fillna("").str.contains("GraphLaunch")
    passes[replayed] = "graph"
    ops = _launching_ops(ev, launch.ts, launch.tid)
    ops[replayed] = ""  # a graph replay: the operators ran at capture, not here
    return _rows(pd.DataFrame({"kernel": gpu.name, "pass": passes, "op": ops, "us": gpu.dur}), steps=steps,
                 device_type="cuda")


def _self_times(ops: pd.DataFrame) -> pd.Series:
    """Duration minus the durations of direct children (nesting by time on one thread)."""
    order = ops.sort_values(["tid", "ts", "dur"], ascending=[True, True, False])
    tids, starts, durs = order.tid.to_numpy(), order.ts.to_numpy(), order.dur.to_numpy()
    self_us = durs.copy()
    stack: list[tuple[float, int]] = []  # (end, position) of the open ancestors on this thread
    for i, (tid, ts, dur) in enumerate(zip(tids, starts, durs)):
        if i and tid != tids[i - 1]:
            stack.clear()
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if stack:
            self_us[stack[-1][1]] -= dur
        stack.append((ts + dur, i))
    return pd.Series(self_us, index=order.index).clip(lower=0.0).reindex(ops.index)


def op_rows_from_trace(trace: dict, *, steps: int) -> pd.DataFrame:
    """Rows per (aten operator, pass) with self CPU time, from a CPU-only Kineto trace. Annotations
    and autograd nodes count as parents (their time is not an operator's) but are not rows."""
    ev = _events(trace)
    cpu = ev[ev.cat.isin(("cpu_op", "user_annotation"))]
    self_us = _self_times(cpu)
    aten = cpu.name.str.startswith("aten::") & (cpu.cat == "cpu_op") & (self_us > 0)
    ops = cpu[aten]
    return _rows(pd.DataFrame({"kernel": ops.name, "pass": _passes(ev, ops.ts), "op": _launching_ops(ev, ops.ts, ops.tid),
                               "us": self_us[aten]}), steps=steps, device_type="cpu")

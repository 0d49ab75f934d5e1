"""Kernel names across the two profilers: which of torch.profiler's kernels an Nsight Compute kernel is.

Kernel names differ between the two profilers (pairs seen on the H200 are in
tests/fixtures/ncu/kernel-names-h200.json). torch.profiler (Kineto) reports the GNU-demangled name,
``void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>,
std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)``; ncu's
demangler gives ``void at::vectorized_elementwise_kernel<4, at::CUDAFunctor_add<float>,
std::array<char *, 3>>(int, T2, T3)``: namespaces shortened or dropped, ``<unnamed>`` for
``(anonymous namespace)``, literals without suffixes, ``0/1`` for ``false/true``, parameters as
template names, ``[lambda() (instance 1)]`` for ``{lambda()#1}``. Neither an exact match nor ncu's
``function`` base (``vectorized_elementwise_kernel``, shared by hundreds of launches) selects well,
so names are matched by their *token skeleton*: the function name and the words and numbers of its
template arguments, without namespaces, qualifiers, booleans, literal suffixes or parameter lists,
the first `SKELETON_TOKENS` of them (a distinctive prefix). A name matches when the skeleton's
tokens appear in it in order: `kernel_regex` (ncu's name filter, with ``--kernel-name-base demangled``) and
`match_kernel` (ncu's table back to the profiler's). cuDNN's generated convolution kernels are matched by
family (``xmma_fprop``/``dgrad``/``wgrad``, `conv_direction`): its autotuner may pick other algorithms under ncu.
"""

from __future__ import annotations

import functools
import re

SKELETON_TOKENS = 10  # enough to tell instantiations apart, short enough to survive truncated names

_ANON = re.compile(r"\(anonymous namespace\)::|<?unnamed>::")
_QUALIFIER = re.compile(r"\b[A-Za-z_]\w*::")
_PARENS = re.compile(r"\([^()]*\)")
_CUDNN_FAMILY = re.compile(r"sm\d+_xmma_(fprop|dgrad|wgrad)_")
# A convolution kernel's direction, from the words its name carries: cuDNN's xmma families
# (`sm90_xmma_dgrad_...`), CUTLASS (`..._s1688fprop_...`, `..._s1688wgrad_...`) and its legacy engines
# (`implicit_convolve_sgemm` forward; `convolveNd_dgrad_float_engine`, `dgrad_alg1_nd_float_engine`;
# `wgrad_alg0_engine`, `convolveNd_wgrad_engine`, `reduce_wgrad_nchw_helper`). The gradient words are
# tried first: a legacy backward engine's name also holds "convolve", so that word never decides.
_CONV_BACKWARD = {"dgrad": re.compile(r"dgrad|[Cc]onv\w*_?(bwd|backward)_?data"),
                  "wgrad": re.compile(r"wgrad|[Cc]onv\w*_?(bwd|backward)_?(filter|weight)")}
_CONV_FORWARD = re.compile(r"fprop|(implicit|explicit)_convolve|[Cc]onv\w*_?(fwd|forward)|convNd_grouped_direct")
# Never a convolution: cuDNN's helpers around one (split-K reductions, layout and type conversions, workspace
# set-up), which carry its direction's word in some names (`reduce_wgrad_nchw_helper`) but not its work, and
# its fused attention (`cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...`).
_NOT_CONV = re.compile(r"helper|reduce_|[Ww]orkspace|To(Nhwc|Nchw)|convert|sdpa|flash|fmha|attention")
_TOKEN = re.compile(r"(\d+)[uUlL]*|([A-Za-z_]\w*)")
# Words the two demanglers write differently: GNU "float const" vs ncu "const float"; GNU
# "false, true" vs ncu "0, 1" (seen for cuDNN's nchwToNhwcKernel on the H200).
_UNSTABLE = {"const", "volatile", "true", "false"}


def conv_direction(name: str) -> str | None:
    """"fprop", "dgrad" or "wgrad" for a convolution kernel named as cuDNN, CUTLASS or their legacy engines
    name them; None for any other kernel, cuDNN's helpers and attention included."""
    if _NOT_CONV.search(name):
        return None
    for direction, words in _CONV_BACKWARD.items():
        if words.search(name):
            return direction
    return "fprop" if _CONV_FORWARD.search(name) else None


def _head(name: str) -> str:
    """The name up to its parameter list: the first '(' outside template brackets."""
    name = _ANON.sub("", name)
    depth = 0
    for i, ch in enumerate(name):
        if ch in "<[{":
            depth += 1
        elif ch in ">]}":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


@functools.lru_cache(maxsize=65536)  # a page matches the same few hundred names thousands of times
def _skeleton(name: str, tokens: int) -> tuple[str, ...]:
    head = _QUALIFIER.sub("", _head(name))  # before the groups go: `f(T&)::{lambda()#1}` keeps `f`
    while (shorter := _PARENS.sub("", head)) != head:
        head = shorter
    head = head.strip().removeprefix("void ")  # the return type (kernels return void)
    words = [num or word for num, word in _TOKEN.findall(head)]
    return tuple(w for w in words if w not in _UNSTABLE)[:tokens]


def skeleton(name: str, *, tokens: int = SKELETON_TOKENS) -> list[str]:
    """Function name, then the words and numbers of its template arguments (see the module doc).

    Parenthesised groups inside the template arguments go too: they are parameter lists of nested
    functions and lambdas, which ncu prints with template parameter names (T1, T2) instead of types.
    """
    return list(_skeleton(name, tokens))


@functools.lru_cache(maxsize=65536)
def _skeleton_pattern(name: str) -> str:
    # cuDNN's autotuner (benchmark=True) picks other algorithms under ncu, whose launches time
    # differently (H200, opt1 size 32: the profiler saw sm90_xmma_fprop_..., ncu ran sm80_xmma_fprop_...;
    # at 128^3 no xmma kernel ran under ncu at all), so its convolutions are matched by direction only
    # (`match_kernel` decides with `conv_direction`; this pattern is for ncu's name filter).
    if family := _CUDNN_FAMILY.match(name):
        return _CONV_BACKWARD[family.group(1)].pattern if family.group(1) != "fprop" else _CONV_FORWARD.pattern
    # Word characters only, so escaping is a formality; \b and .* work in ncu's regex engine.
    # Numbers may keep their suffix ("3ul"), so the regex also matches the profiler's own spelling.
    return ".*".join(rf"\b{re.escape(t)}{'[uUlL]*' if t.isdigit() else ''}\b" for t in skeleton(name))


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


@functools.lru_cache(maxsize=262144)
def _matches(profiler_name: str, ncu_name: str) -> bool:
    """Whether ncu's kernel can be the profiler's: a cuDNN convolution family by direction (never a kernel of
    another direction), anything else by its token skeleton."""
    if family := _CUDNN_FAMILY.match(profiler_name):
        return conv_direction(ncu_name) == family.group(1)
    return bool((p := _skeleton_pattern(profiler_name)) and _compiled(p).search(ncu_name))


def kernel_regex(names: list[str]) -> str:
    """One regex matching each name (and ncu's demangling of it) by its token skeleton."""
    patterns = sorted({p for p in map(_skeleton_pattern, names) if p})
    if not patterns:
        raise ValueError("no kernel names to match")
    return "|".join(f"({p})" for p in patterns)


def match_kernel(ncu_name: str, profiler_names: list[str]) -> list[str]:
    """The profiler's names for an ncu kernel: the same string, else the most specific skeleton matches.

    Exact first (the names agree when both come from one demangler); otherwise every profiler name
    whose token skeleton appears, in order, in the ncu name is a candidate, and those with the
    longest skeleton win. Several winners are indistinguishable by name (a cuDNN family, or
    instantiations differing after the skeleton): their shares add up.
    """
    if ncu_name in profiler_names:
        return [ncu_name]
    hits = [(len(skeleton(n)), n) for n in profiler_names if _matches(n, ncu_name)]
    best = max((k for k, _ in hits), default=0)
    return [n for k, n in hits if k == best]

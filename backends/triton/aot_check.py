"""Compile the Triton kernels for NVIDIA GPU targets ahead of time, without a GPU.

``python -m attnplug.backends.triton.aot_check [--arch 80,90] [--full] [--json]``

Triton's compiler runs on the CPU down to a cubin (``ptxas`` ships with the triton
wheel), so a machine without a GPU can still check that every kernel variant the
launchers pick is valid compiled Triton (the interpreter is more permissive: it does not
type-check loop-carried values, dot shapes or layouts) and see its resource use. Each
variant is compiled with the specialisation a launch would get (16-byte aligned pointers,
strides divisible by 16) and its registers, stack (spill) bytes and shared memory are
read back with ``cuobjdump -res-usage``.

Needs a process in compiled mode: run it without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from attnplug.backends.triton.attention import REDUCE_ELEMENTS_PER_PROGRAM, choose_tiles, lower_arguments
from attnplug.backends.triton.constants import FP8_E4M3_MIN_SM
from attnplug.backends.triton.runtime import interpreting, kernel_module

_TL_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
             torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_INT_TYPES = {torch.int32: "i32", torch.int64: "i64"}


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation: the kernel, its pointer element types and constexprs."""

    name: str
    kernel: str
    pointer_types: dict
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2


@dataclass
class CompileReport:
    """What compiling one variant for one architecture gave."""

    variant: str
    arch: int
    ok: bool
    registers: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0
    error: str = ""


def attention_variant(dtype: torch.dtype, head_size: int, group: int, max_query_len: int, *,
                      window: int = 0, soft_cap: bool = False, segments: int = 1, lse: bool = False,
                      causal: bool = True, sinks: bool = False, kv_dtype: torch.dtype | None = None,
                      sm: int = 90) -> Variant:
    """The ``paged_attention_kernel`` variant ``paged_attention`` launches for these inputs on a GPU
    of compute capability ``sm`` (``lse``: storing the log-sum-exp, as cascade attention's passes
    do; ``kv_dtype``: an fp8 cache, dequantised in the kernel): the launcher's own
    :func:`~attnplug.backends.triton.attention.lower_arguments` on ``meta`` tensors gives the
    constexprs, the launch options and each pointer's element type (with one segment the
    partials are ``output`` itself, and an absent optional tensor its stand-in), so this
    compiles exactly the specialisation a launch gets."""
    meta, kv_heads = torch.device("meta"), 8
    heads, tokens = group * kv_heads, max(1, max_query_len)
    query = torch.empty(tokens, heads, head_size, dtype=dtype, device=meta)
    kv = torch.empty(4, 2, 16, kv_heads, head_size, dtype=kv_dtype or dtype, device=meta)
    i32 = dict(dtype=torch.int32, device=meta)
    launch = lower_arguments(
        query, kv[:, 0], kv[:, 1], torch.empty_like(query), torch.empty(2, **i32), torch.empty(1, **i32),
        torch.empty(1, 4, **i32), num_reqs=1, max_query_len=max_query_len, scale=1.0, causal=causal,
        sliding_window=window or None, logits_soft_cap=30.0 if soft_cap else None, num_kv_splits=segments,
        tiles=choose_tiles(max_query_len, group, head_size, dtype, interpreter=False, sm=sm), visited_tiles=None,
        lse=torch.empty(tokens, heads, dtype=torch.float32, device=meta) if lse else None,
        sinks=torch.empty(heads, dtype=torch.float32, device=meta) if sinks else None,
        k_scale=None, v_scale=None, alibi_slopes=None)
    names = [n for n in kernel_module("attention_kernels").paged_attention_kernel.arg_names
             if n not in launch.constants]
    ptrs = {n: _TL_TYPES.get(a.dtype) or _INT_TYPES[a.dtype] for n, a in zip(names, launch.args) if n.endswith("_ptr")}
    ce = {k: v for k, v in launch.constants.items() if k not in ("num_warps", "num_stages")}
    t, kind = _TL_TYPES[dtype], "decode" if max_query_len == 1 else "prefill"
    extra = (f" window={window}" if window else "") + (" softcap" if soft_cap else "") + \
        (f" splits={segments}" if segments > 1 else "") + (" lse" if lse else "") + ("" if causal else " non-causal") \
        + (" sinks" if sinks else "") + (f" kv={_TL_TYPES[kv_dtype]}" if kv_dtype is not None else "")
    return Variant(f"attention {t} d={head_size} group={group} {kind}{extra} (m={ce['BLOCK_M']} n={ce['TILE_N']})",
                   "paged_attention_kernel", ptrs, ce, launch.constants["num_warps"], launch.constants["num_stages"])


def support_variants(dtype: torch.dtype = torch.float16, head_size: int = 128, num_heads: int = 32,
                     segments: int = 16, sm: int = 90) -> list[Variant]:
    """The reduce, KV-write and slot-mapping kernels as their launchers specialise them (no
    ``fp8_e4m3`` KV write below :data:`FP8_E4M3_MIN_SM`, where the backend refuses that cache)."""
    t = _TL_TYPES[dtype]
    padded = 1 << (head_size - 1).bit_length()
    heads_per_program = max(1, min(num_heads, REDUCE_ELEMENTS_PER_PROGRAM // (padded * segments)))
    return [
        Variant(f"reduce {t} d={head_size} splits={segments}", "reduce_segments_kernel",
                dict(output_ptr=t, part_acc_ptr="fp32", part_max_ptr="fp32", part_sum_ptr="fp32",
                     query_start_loc_ptr="i32"),
                dict(HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded, NUM_SEGMENTS=segments,
                     HEADS_PER_PROGRAM=heads_per_program)),
        *(Variant(f"write_kv_cache {t} d={head_size}" + (f" cache={_TL_TYPES[c]}" if c != dtype else ""),
                  "write_kv_cache_kernel",
                  dict(key_ptr=t, value_ptr=t, key_cache_ptr=_TL_TYPES[c], value_cache_ptr=_TL_TYPES[c],
                       slot_mapping_ptr="i64", k_scale_ptr="fp32", v_scale_ptr="fp32"),
                  dict(NUM_KV_HEADS=8, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded,
                       ROWS_PER_PROGRAM=max(1, 2048 // padded), BLOCK_SIZE=16, KV_FP8=c != dtype,
                       FP8_MAX=448.0 if c != dtype else 0.0, FP8_MANTISSA=3, FP8_MIN_EXP=-6,
                       ROUND_ON_GRID=False))
          for c in ((dtype, torch.float8_e4m3fn) if sm >= FP8_E4M3_MIN_SM else (dtype,))),
        Variant("slot_mapping", "slot_mapping_kernel",
                dict(query_start_loc_ptr="i32", positions_ptr="i64", block_table_ptr="i32", slot_mapping_ptr="i64"),
                dict(BLOCK_SIZE=16, PAD_SLOT=-1, TOKENS_PER_ITER=256)),
    ]


def variants(full: bool = False, sm: int = 90) -> list[Variant]:
    """The quick set (one of each path), or every combination of dtype, head size and path,
    with the tiles ``choose_tiles`` picks for compute capability ``sm``."""
    def att(*args, **kw) -> Variant:
        return attention_variant(*args, sm=sm, **kw)
    e4m3 = sm >= FP8_E4M3_MIN_SM
    if not full:
        return [att(torch.float16, 128, 4, 1), att(torch.bfloat16, 128, 4, 512),
                att(torch.float32, 64, 4, 512), att(torch.float16, 128, 4, 1, segments=16),
                att(torch.bfloat16, 128, 4, 512, lse=True, causal=False),  # cascade prefix pass
                att(torch.float16, 128, 4, 1, lse=True),  # a decode step's suffix pass
                *([att(torch.bfloat16, 128, 4, 1, kv_dtype=torch.float8_e4m3fn)] if e4m3 else []),  # fp8 cache
                att(torch.float16, 128, 4, 512, kv_dtype=torch.float8_e5m2),
                *support_variants(sm=sm)]
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_size in (64, 128, 256):
            for group in (1, 4, 8):
                for q in (1, 512):
                    out.append(att(dtype, head_size, group, q))
            out.append(att(dtype, head_size, 4, 512, window=1024, soft_cap=True))
            out.append(att(dtype, head_size, 8, 1, segments=16))
            out.append(att(dtype, head_size, 8, 512, lse=True, causal=False))
            out.append(att(dtype, head_size, 8, 128, window=128, sinks=True))  # gpt-oss sliding
            out += support_variants(dtype, head_size, sm=sm)[:-1]
    return out + support_variants(sm=sm)[-1:]


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if not m:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource line: {text[:200]!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def compile_variant(v: Variant, arch: int) -> CompileReport:
    """Compile ``v`` for ``sm_<arch>``; never raises (the error goes to the report)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = "attention_kernels" if v.kernel in ("paged_attention_kernel", "reduce_segments_kernel") else "cache_kernels"
    fn = getattr(kernel_module(module), v.kernel)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in v.constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + v.pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "soft_cap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn, signature=signature, constexprs=dict(v.constexprs), attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=v.num_warps, num_stages=v.num_stages))
        regs, stack, _ = _resource_usage(k.asm["cubin"])
        return CompileReport(v.name, arch, True, regs, stack, int(k.metadata.shared))
    except Exception as exc:  # report, keep going
        return CompileReport(v.name, arch, False, error=f"{type(exc).__name__}: {str(exc)[:500]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnplug.backends.triton.aot_check", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="80,90", help="comma-separated SM versions (default 80,90)")
    p.add_argument("--full", action="store_true", help="every dtype x head size x path (slow)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = p.parse_args(argv)
    if interpreting():
        print("aot_check compiles for GPUs: run it without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    reports = [compile_variant(v, int(a)) for a in args.arch.split(",") for v in variants(args.full, sm=int(a))]
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        for r in reports:
            state = (f"regs {r.registers:3d}  stack {r.stack_bytes:5d} B  shared {r.shared_bytes:6d} B" if r.ok
                     else f"FAILED {r.error}")
            print(f"sm_{r.arch}  {r.variant:60s} {state}")
    return 0 if all(r.ok and r.stack_bytes == 0 for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())

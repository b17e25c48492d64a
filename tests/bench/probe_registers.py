"""Probe: registers and spills of the strict kernels, compiled for Hopper on any host.

Triton compiles a kernel ahead of time for a named target without a GPU; ``ptxas -v`` on the
PTX then reports what a launch would get: registers a thread, bytes spilled to local memory,
and whether tensor-core instructions had to be serialised. A kernel that spills, or holds
per-element addresses in registers, is slow whatever its arithmetic, so this is the first
check of a kernel change, before any device time. Compiled here: strict attention at its two
settings (a decode step's, a prefill's) and the strict product at its tile configurations
(bf16, plain and grouped). Run: ``python -m tests.bench.probe_registers`` (needs Triton and
its bundled ``ptxas``; no GPU).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

import torch

from libalign.strict import attention, tensorcore


def _ptxas() -> str:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return bundled if os.path.exists(bundled) else "ptxas"


def report(fn, types: dict[str, str], constexprs: dict, aligned: tuple[str, ...], warps: int,
           stages: int) -> str:
    """``ptxas -v``'s register, spill and serialisation lines for ``fn`` compiled for sm_90a
    with argument ``types``, ``constexprs`` and 16-byte ``aligned`` arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types[n] for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)
    serial = "wgmma serialised" if "serialized" in err else ""
    return (f"{regs.group(1) if regs else '?':>4} registers, "
            f"{spill.group(1) if spill else '?':>5} / {spill.group(2) if spill else '?':>5} "
            f"bytes spilled (stores / loads) {serial}")


def main() -> None:
    d = 128
    att = dict(q_ptr="*bf16", k_desc=f"tensordesc<bf16[1,1,{attention._ATT_BLOCK},{d}]>",
               v_desc=f"tensordesc<bf16[1,1,{attention._ATT_BLOCK},{d}]>", bits_ptr="*i64", first_ptr="*i32",
               hi_ptr="*i32", count_ptr="*i32", Tq="i32", Tk="i32", HKV="i32", REP="i32",
               HM="i32", scaling="fp32", W="i32", s_qb="i32", s_qh="i32", s_qt="i32",
               ws_m_ptr="*fp32", ws_l_ptr="*fp32", R="i32", HQ="i32")
    aligned = ("q_ptr", "bits_ptr", "first_ptr", "hi_ptr", "count_ptr", "ws_m_ptr", "ws_l_ptr",
               "s_qb", "s_qh", "s_qt")
    print("strict attention, head dimension 128 (sm_90a):")
    for label, (warps, stages, chunk, rows, serial) in (
            ("decode step", attention.ATTENTION_CONFIG),
            ("prefill", attention.ATTENTION_CONFIG_LARGE)):
        types = dict(att, o_desc=f"tensordesc<bf16[1,{rows},{d}]>",
                     ws_desc=f"tensordesc<fp32[1,1,{rows},{d}]>")
        consts = dict(D=d, BLOCK=attention._ATT_BLOCK, SCAN=512, CHUNK=chunk, BLOCK_Q=rows,
                      SERIAL=serial, LATE_FIRST=serial, DEPENDENT=True)
        print(f"  {label:12} {warps} warps, {rows} rows: "
              f"{report(attention._attention_kernel, types, consts, aligned, warps, stages)}")
    mm = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16", adec_ptr="*fp32",
              wdec_ptr="*fp32", counts_ptr="*i32", E="i32", M="i32", N="i32", K="i32", s_am="i32",
              s_be="i32", s_bn="i32", s_cm="i32", s_cn="i32", s_de="i32")
    aligned = (*(n for n, t in mm.items() if t.startswith("*")), "s_am", "s_be", "s_bn", "s_cm",
               "N", "K")
    print("strict product, bf16 (sm_90a):")
    for label, cfg in (("large", tensorcore.CONFIGS), ("small", tensorcore.SMALL_CONFIGS),
                       ("few", tensorcore.FEW_ROWS_CONFIGS), ("skinny", tensorcore.SKINNY_CONFIGS),
                       ("wide", tensorcore.WIDE_CONFIGS)):
        bm, bn, bk, warps, stages = cfg[torch.bfloat16]
        for grouped in (False, True):
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUPED=grouped, E_P2=128, HAS_BIAS=False,
                          SCALED=grouped, IEEE=False, s_ak=1, s_bk=1)
            print(f"  {label:6} {bm}x{bn}x{bk} {'grouped' if grouped else 'plain  '}: "
                  f"{report(tensorcore._matmul_kernel, mm, consts, aligned, warps, stages)}")


if __name__ == "__main__":
    main()

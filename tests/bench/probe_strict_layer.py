"""Probe: where one Qwen3-30B-A3B-shaped layer forward spends its time, normal against strict.

The layer of ``bench strict``'s layer table (embedding, one decoder layer, final norm; 4 x 512
tokens), on each path, in each mode:

* ``wall ms``: one forward to its synchronisation; ``host ms``: the same forward until it
  returns, before the synchronisation (the host's part, where nothing inside waits on the
  device);
* from ``torch.profiler`` over 3 forwards, per forward: the kernels' summed device time, the
  number of kernel launches, and the calls that make the host wait (synchronisations and
  device-to-host copies);
* ``host ms by module``: each module's host time (from its forward's entry to its return,
  nothing synchronised), the mean of 5 forwards;
* the profiler's 20 most expensive host ops (self CPU time) of the strict forward, and a
  ``cProfile`` of it (the Python functions the host time is spent in, by cumulative time).

Run: ``python -m tests.bench.probe_strict_layer [--paths bf16 nvfp4_minite]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libalign import models
from libalign.models import strict

from .measure import profiled

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
         "cudaEventSynchronize")


def _times(fn, repeats: int = 5) -> tuple[float, float]:
    walls, hosts = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        h = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        hosts.append(h - t)
    return statistics.median(walls) * 1e3, statistics.median(hosts) * 1e3


def _module_host_ms(model, fn, repeats: int = 5) -> dict[str, float]:
    """Host ms per forward from each named module's forward entry to its return, the mean of
    ``repeats`` forwards (inclusive of the modules it calls; nothing synchronised)."""
    spans: dict[str, list[float]] = {}
    starts: dict[str, float] = {}
    handles = []
    for name, module in model.named_modules():
        if not name or name.count(".") > 4:
            continue

        def pre(_m, _a, name=name):
            starts[name] = time.perf_counter()

        def post(_m, _a, _o, name=name):
            spans.setdefault(name, []).append(time.perf_counter() - starts[name])

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        for _ in range(repeats):
            fn()
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    return {n: sum(v) * 1e3 / repeats for n, v in spans.items()}


def _profile(fn, n: int = 3):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA) / n
    launches = sum(e.count for e in events if e.key in LAUNCHES) / n
    waits = {e.key: e.count / n for e in events if e.key in WAITS}
    return prof, kernel_us / 1e3, launches, waits


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", nargs="+", default=["bf16", "nvfp4_minite"])
    args = p.parse_args(argv)
    cfg = models.qwen3_30b_a3b_shaped_config(num_layers=1, vocab_size=4096)
    model = models.build_model(cfg, seed=0, device=torch.device("cuda"))
    ids = torch.randint(0, 4096, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'path':14} {'mode':7} {'wall ms':>8} {'host ms':>8} {'kernel ms':>10} "
          f"{'launches':>9}  waits")
    keep: dict = {}
    by_module: dict[tuple[str, bool], dict[str, float]] = {}
    with torch.no_grad():
        for path in args.paths:
            models.set_path(model, path)
            for on in (False, True):
                with strict.use_strict(model, on, "device"):
                    fn = lambda: model.model(input_ids=ids)  # noqa: E731
                    for _ in range(3):
                        fn()
                    wall, host = _times(fn)
                    prof, kernel, launches, waits = _profile(fn)
                    mode = "strict" if on else "normal"
                    print(f"{path:14} {mode:7} {wall:8.2f} {host:8.2f} {kernel:10.2f} "
                          f"{launches:9.0f}  {waits}")
                    by_module[(path, on)] = _module_host_ms(model, fn)
                    if on and path == args.paths[0]:
                        keep["prof"] = prof
                        keep["cprofile"] = profiled(fn, 3)
    models.reset_paths(model)
    for path in args.paths:
        normal, strict_ms = by_module[(path, False)], by_module[(path, True)]
        print(f"\nhost ms by module, {path} (entry to return, mean of 5 forwards)")
        print(f"{'module':48} {'normal':>8} {'strict':>8}")
        for name in normal:
            print(f"{name:48} {normal[name]:8.3f} {strict_ms.get(name, float('nan')):8.3f}")
    if "prof" in keep:
        print(f"\nstrict {args.paths[0]} forward, host ops by self CPU time (3 forwards):")
        print(keep["prof"].key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                                max_name_column_width=60))
        print(f"\ncProfile, 3 strict {args.paths[0]} forwards (tottime, s):")
        stats = keep["cprofile"]
        stats.sort_stats("tottime").print_stats(25)
        print(f"\ncProfile, 3 strict {args.paths[0]} forwards, libalign and the model's code "
              f"by cumulative time:")
        stats.sort_stats("cumulative").print_stats("libalign|modeling_qwen3_moe|masking_utils", 40)


if __name__ == "__main__":
    main()

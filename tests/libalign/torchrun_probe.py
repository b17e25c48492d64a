"""Run by torchrun in tests: join the group from the environment, check it, print one line."""

import os

import torch
import torch.distributed as dist

from libalign.models.megatron_parallel import NO_MULTICAST_ENV, process_group

if __name__ == "__main__":
    with process_group(backend="gloo") as info:
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        env_ok = all(os.environ.get(k) == v for k, v in NO_MULTICAST_ENV.items())
        print(f"probe rank={info.rank} world={info.world_size} ep={info.ep_rank}/{info.ep_size} "
              f"sum={t.item():g} env={env_ok}", flush=True)

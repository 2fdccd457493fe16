"""Test-only: the gather/scatter a mixture-of-experts model needs under data parallelism,
which vLLM 0.32's CPU communicator lacks (``CpuCommunicator.all_gatherv`` and
``reduce_scatterv`` raise NotImplementedError in ``base_device_communicator.py``; MoE under
``-dp > 1`` falls back to all-gather/reduce-scatter dispatch, ``all2all.py``). On this
PYTHONPATH every process of a server (front end, engine cores, workers) gets them, written
with plain gloo collectives on the group's device group, for mp and keepalive alike: the
tests compare the two executors on top of the same stand-in, they do not test it.
(benchmarks/moe_dp_probe.py shows vLLM failing without it.)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGET = "vllm.distributed.device_communicators.cpu_communicator"


def _patch(module) -> None:
    import torch
    import torch.distributed as dist

    cls = module.CpuCommunicator

    def all_gatherv(self, input_, dim=0, sizes=None):
        if dim != 0:
            raise NotImplementedError("all_gatherv along dim != 0")

        def one(t):
            if self.world_size == 1:
                return t
            counts = sizes if sizes is not None else [t.shape[0]] * self.world_size
            padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded, group=self.device_group)
            return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)], dim=0)

        if isinstance(input_, (list, tuple)):
            return [one(t) for t in input_]
        return one(input_)

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        if self.world_size == 1:
            return input_
        dim = dim % input_.dim()
        x = input_.movedim(dim, 0).contiguous().clone()
        dist.all_reduce(x, group=self.device_group)
        counts = sizes if sizes is not None else [x.shape[0] // self.world_size] * self.world_size
        start = sum(counts[: self.rank_in_group])
        return x[start: start + counts[self.rank_in_group]].movedim(0, dim).contiguous()

    def reduce_scatterv_into_output(self, input_, output, dim=-1, sizes=None):
        output.copy_(reduce_scatterv(self, input_, dim, sizes))
        return output

    cls.all_gatherv = all_gatherv
    cls.reduce_scatterv = reduce_scatterv
    cls.reduce_scatterv_into_output = reduce_scatterv_into_output


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())

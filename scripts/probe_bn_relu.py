"""Host time of a training BatchNorm1d -> ReLU pair on a conv's output (fp16 [N, C] features,
fp32 parameters), forward and backward, against candidates for one autograd node: what a
SparseSequential training block could save (issue #20: host-bound training steps).

Rows per variant: us per (forward + backward) call in a loop with no sync inside (host-bound:
N small), and with a sync after each call (latency). Variants:
  torch-modules   nn.BatchNorm1d then nn.ReLU (what OpenPCDet's post_act_block runs)
  torch-functional F.batch_norm then torch.relu, no modules
  flexplan-bn-fn  flexplan's single-process BatchNorm Function (nn.sync_batchnorm, group None)
                  then torch.relu

Usage (GPU): python3 scripts/probe_bn_relu.py [--rows 20000] [--channels 32] [--calls 400]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from flexplan.nn.sync_batchnorm import _SyncBatchNormFunction


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    dev = torch.device("cuda")
    bn = torch.nn.BatchNorm1d(args.channels, eps=1e-3, momentum=0.01).to(dev)
    relu = torch.nn.ReLU()
    x = torch.randn(args.rows, args.channels, device=dev, dtype=torch.float16, requires_grad=True)
    grad = torch.randn_like(x)

    def torch_modules():
        return relu(bn(x))

    def torch_functional():
        bn.num_batches_tracked.add_(1)
        return torch.relu(F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                       True, 0.01, 1e-3))

    def flexplan_fn():
        return torch.relu(_SyncBatchNormFunction.apply(
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked,
            1e-3, 0.01, None))

    for name, fn in (("torch-modules", torch_modules), ("torch-functional", torch_functional),
                     ("flexplan-bn-fn", flexplan_fn)):
        for _ in range(20):
            fn().backward(grad)
        torch.cuda.synchronize()
        for synced in (False, True):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn().backward(grad)
                if synced:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            us = (time.perf_counter() - start) / args.calls * 1e6
            print(f"{name:18s} {'synced' if synced else 'loop':6s} {us:7.1f} us per fwd+bwd")
        # forward alone
        start = time.perf_counter()
        with torch.no_grad():
            pass
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print(f"{name:18s} fwd    {(time.perf_counter() - start) / args.calls * 1e6:7.1f} us "
              "per forward (graph built, not run back)")


if __name__ == "__main__":
    main()

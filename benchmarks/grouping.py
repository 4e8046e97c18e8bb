"""Which 512 values should form a block? Token-grouped vs channel-grouped, for K and for V.

Measures the compressible-block fraction of both groupings on synthetic KV with key outlier
channels, rope and token-varying values (zipfusion.analysis.synthetic.realistic_pages). The
result chose the format's layout: K channel-grouped, V token-grouped (docs/format.md).

    PYTHONPATH=src python benchmarks/grouping.py [--pages 2000]
"""

import argparse

import torch

from zipfusion.analysis.synthetic import realistic_pages


def compressible(blocks: torch.Tensor) -> float:
    e = (blocks.contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF
    b = e.amin(-1) & ~1
    return float((e.amax(-1) <= b + 15).float().mean())


def token_grouped(x):      # [P, 16, H, D] -> [P, H, nb, 512]: 512/D tokens x D channels
    P, T, H, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(P, H, -1, 512)


def channel_grouped(x):    # [P, 16, H, D] -> [P, H, nb, 512]: 16 tokens x 32 channels
    P, T, H, D = x.shape
    return x.reshape(P, T, H, D // 32, 32).permute(0, 2, 3, 1, 4).reshape(P, H, -1, 512)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    pages = realistic_pages(args.pages, args.heads, args.head_dim, seed=0, zero_fraction=0)
    print(f"{args.pages} pages, {args.heads} KV heads x {args.head_dim}: compressible blocks")
    print(f"{'':4}{'token-grouped':>15}{'channel-grouped':>17}")
    for name, role in (("K", 0), ("V", 1)):
        x = pages[:, role]
        print(f"{name:4}{compressible(token_grouped(x)):>15.1%}{compressible(channel_grouped(x)):>17.1%}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Sums up the "TILECLK" records of a MEGAMOE_TILE_CLOCKS build (src/device/tile_clocks.cuh): per engine
configuration and problem (form, activation, tile width, cluster, TMA store, gathered A, N, K), the cycles a
consumer warpgroup spends per tile before the tile's first stage is waited for, waiting for it, in the main loop
and in the epilogue, the main loop's cycles per K stage, and each part's share of the warpgroup's time.

  tile_clocks.py FILE     FILE: a program's output holding the records (bench_layer's, say)
"""
import collections
import sys

KEY = ("form", "act", "BN", "cl", "tma", "gA", "N", "K")
PARTS = ("top", "wait", "loop", "epi")


def parse(lines):
    """{configuration key: [record dict, ...]} from the TILECLK lines among `lines`."""
    groups = collections.defaultdict(list)
    for line in lines:
        if not line.startswith("TILECLK ") or "dropped=" in line:
            continue
        fields = dict(kv.split("=", 1) for kv in line.split()[1:])
        groups[tuple(fields[k] for k in KEY)].append({k: int(v) for k, v in fields.items()})
    return groups


def summary(groups):
    """Rows (key, records, per-tile cycles of each part, loop cycles per stage, each part's share of the total)."""
    rows = []
    for key, records in sorted(groups.items(), key=lambda item: tuple(int(v) for v in item[0])):
        tiles = sum(r["tiles"] for r in records)
        if tiles == 0:
            continue
        stages = sum(r["kstages"] for r in records)
        total = sum(r["total"] for r in records)
        per_tile = {p: sum(r[p] for r in records) / tiles for p in PARTS}
        share = {p: sum(r[p] for r in records) / total if total else 0.0 for p in PARTS}
        loop_per_stage = sum(r["loop"] for r in records) / stages if stages else 0.0
        rows.append((key, len(records), per_tile, loop_per_stage, share))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(__doc__)
    with open(argv[0], errors="replace") as f:
        lines = f.readlines()
    dropped = [line.strip() for line in lines if line.startswith("TILECLK dropped=")]
    rows = summary(parse(lines))
    if not rows:
        print("no TILECLK records: a build without MEGAMOE_TILE_CLOCKS=1, a program that did not exit normally, or"
              " records the process could not read (its stderr says so)")
        return 1
    print(f"{' '.join(KEY):<34} {'records':>7} | cycles per tile: " + " ".join(f"{p:>8}" for p in PARTS)
          + " | per stage | share %: " + " ".join(f"{p:>5}" for p in PARTS))
    for key, n, per_tile, per_stage, share in rows:
        print(f"{' '.join(key):<34} {n:>7} | {'':>17}" + " ".join(f"{per_tile[p]:8.0f}" for p in PARTS)
              + f" | {per_stage:9.0f} | {'':>9}" + " ".join(f"{100 * share[p]:5.1f}" for p in PARTS))
    for d in dropped:
        print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())

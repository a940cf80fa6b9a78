"""What authenticating KV costs: the codec's per-batch MAC next to the per-block CRC32 it rides on.

    python evaluations/bench/mac.py [--mb 256] [--batch-blocks 64] [--repeats 5]

The MAC (codec.batch_mac: keyed BLAKE2b over request id, block positions, hashes and CRCs) is
computed once per batch whatever its size, so its cost per GB shrinks with the batch; the CRC
reads every byte. For contrast, a keyed BLAKE2b over every byte (what MACing the data itself
would cost). Shares are of the time the same bytes take on a line of each rate. Medians of
interleaved repeats (timings on shared machines are noisy: compare the columns of one run).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import numpy as np

from pdd_serve.engine.kv import KVBlocks, KVLayout, bytes_checksum
from pdd_serve.transport.codec import batch_mac, decode, encode

# The default CPU model's KV (4 layers, 2 KB per token, float32): 32 KiB blocks
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16)
KEY = "bench-graph-key"
LINES_BPS = {"flight_loopback_1GBps": 8e9, "wan_10gbit": 1e10, "wan_100gbit": 1e11}


def _batches(total_bytes: int, batch_blocks: int) -> list[KVBlocks]:
    rng = np.random.default_rng(0)
    n = max(1, total_bytes // (LAYOUT.block_bytes * batch_blocks))
    data = rng.standard_normal((batch_blocks, *LAYOUT.block_shape)).astype(np.float32)
    hashes = [int(h) for h in rng.integers(1, 2**63, batch_blocks)]
    one = KVBlocks(LAYOUT, 0, data, hashes)
    return [one] * n  # the same bytes n times: the cost is per byte and per batch, not per value


def _time(fn, runs: list[KVBlocks]) -> float:
    t = time.perf_counter()
    for r in runs:
        fn(r)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="KV bytes per measurement")
    ap.add_argument("--batch-blocks", type=int, default=64, help="blocks per Flight batch (flight.batch_blocks)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    runs = _batches(a.mb << 20, a.batch_blocks)
    nbytes = sum(r.nbytes for r in runs)
    width = LAYOUT.block_bytes
    ntok = np.full(a.batch_blocks, LAYOUT.block_size, dtype=np.int32)
    hashes = np.asarray(runs[0].hashes, dtype=np.uint64)
    crcs = np.asarray(runs[0].checksums, dtype=np.uint32)
    plain, keyed = encode("r", runs[0]), encode("r", runs[0], KEY)

    def crc(r: KVBlocks) -> None:
        view = memoryview(r.data).cast("B")
        for i in range(r.num_blocks):
            bytes_checksum(view[i * width:(i + 1) * width])

    def full_bytes_mac(r: KVBlocks) -> None:
        hashlib.blake2b(memoryview(r.data).cast("B"), key=b"k" * 32, digest_size=32).digest()

    cases = {
        "crc32_per_block": crc,
        "mac_per_batch": lambda r: batch_mac(KEY, "r", 0, ntok, hashes, crcs),
        "blake2b_keyed_all_bytes": full_bytes_mac,
        "encode": lambda r: encode("r", r),
        "encode_mac": lambda r: encode("r", r, KEY),
        "decode_crc": lambda r: decode(plain, LAYOUT, "r"),
        "decode_crc_mac": lambda r: decode(keyed, LAYOUT, "r", mac_key=KEY),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.repeats):  # interleaved: every case sees the same machine load
        for k, fn in cases.items():
            times[k].append(_time(fn, runs))
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    s_per_gb = {k: v / gb for k, v in med.items()}

    print(f"{gb:.2f} GB of KV in {len(runs)} batches of {a.batch_blocks} x {width >> 10} KiB blocks, "
          f"medians of {a.repeats}")
    print(f"{'case':<26}{'ms per GB':>11}{'GB/s':>9}{'us per batch':>14}")
    for k in cases:
        print(f"{k:<26}{s_per_gb[k] * 1e3:>11.2f}{1 / s_per_gb[k]:>9.1f}{med[k] / len(runs) * 1e6:>14.1f}")
    # what the MAC adds: one batch_mac at the sender and one at the receiver (the encode/decode
    # rows above show it inside the codec, but their difference is below this machine's noise)
    mac_added = 2 * med["mac_per_batch"]
    share = {line: (mac_added / gb) / (8e9 / bps) for line, bps in LINES_BPS.items()}  # s/GB over s/GB
    print(f"MAC on both ends: {mac_added / gb * 1e3:.3f} ms per GB ({mac_added / len(runs) * 1e6:.1f} us per "
          f"batch), {med['mac_per_batch'] / med['crc32_per_block']:.1%} of one end's CRC")
    for line, v in share.items():
        print(f"  share of the transfer time on {line}: {v:.3%}")
    print(json.dumps({
        "batch_bytes": runs[0].nbytes, "crc_ms_per_gb": round(s_per_gb["crc32_per_block"] * 1e3, 3),
        "mac_ms_per_gb": round(s_per_gb["mac_per_batch"] * 1e3, 4),
        "mac_us_per_batch": round(med["mac_per_batch"] / len(runs) * 1e6, 2),
        "mac_vs_crc": round(med["mac_per_batch"] / med["crc32_per_block"], 5),
        "all_bytes_mac_vs_crc": round(med["blake2b_keyed_all_bytes"] / med["crc32_per_block"], 2),
        "mac_added_ms_per_gb": round(mac_added / gb * 1e3, 4),
        **{f"mac_share_{k}": round(v, 6) for k, v in share.items()},
    }))


if __name__ == "__main__":
    main()

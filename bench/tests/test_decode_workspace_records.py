"""memory.vae_decode's workspace term against the records it stands on: in every fresh-process run of
``bench.conv_workspace`` the fast engine needed the convolution's output plus its workspace free, so the
workspace lies between (largest slow free - output) and (smallest fast free - output).  The term must fall in
that interval for each convolution the records hold, and the convolution must be the one the term names."""
import json
from pathlib import Path

import pytest

from wan_sage.memory import vae_decode

RECORDS = sorted((Path(__file__).resolve().parents[1] / "records" / "decode-room").glob("conv-workspace-*.jsonl"))
GiB = 1 << 30


def _bounds():
    rows = [json.loads(line) for f in RECORDS for line in f.read_text().splitlines() if line.strip()]
    by_conv = {}
    for r in rows:
        by_conv.setdefault((tuple(r["input"]), tuple(r["weight"])), []).append(r)
    out = {}
    for (x, w), rs in by_conv.items():
        fast_ms = min(r["ms"] for r in rs)
        slow = [r["free_gib"] for r in rs if r["ms"] > 2 * fast_ms]
        fast = [r["free_gib"] for r in rs if r["ms"] <= 1.2 * fast_ms]
        out[(x, w)] = (max(slow) - rs[0]["output_gib"], min(fast) - rs[0]["output_gib"])
    return out


def test_the_records_hold_three_resolutions_with_both_engines():
    assert RECORDS
    assert len(_bounds()) >= 3


@pytest.mark.parametrize("conv", sorted(_bounds()) if RECORDS else [])
def test_the_workspace_term_lies_in_what_the_fast_engine_needed(conv):
    x, w = conv
    lo, hi = _bounds()[conv]
    h, wd = x[3] - 2, x[4] - 2
    latent = (1, 16, 21, h // vae_decode.LAST_STAGE_SCALE, wd // vae_decode.LAST_STAGE_SCALE)
    assert (x[1], x[2], w[0]) == (vae_decode.WAN_VAES[16][3], vae_decode.CHUNK_FRAMES_OUT + vae_decode.CACHE_FRAMES,
                                  vae_decode.WAN_VAES[16][3])
    term = vae_decode.conv_workspace_bytes(latent) / GiB
    assert lo <= term <= hi, (conv, lo, term, hi)

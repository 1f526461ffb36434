"""The figures docs/replay.md quotes for its two worked examples are the ones a user gets.

The forward example is what ``flashattn-teach replay forward --seed 0 --batch 1 --seq-len 6 --head-dim 4 --dtype float64
--block-m 2 --block-n 2`` replays: ``torch.manual_seed(0)``, then q, k, v of shape ``(1, 6, 4)``. The decode
example is ``replay decode --seed 0 --cache-len 5 --new-kv 2 --new-queries 2 --num-splits 3 --block-n 2
--head-dim 4 --dtype float64``: ``manual_seed(0)``, then q ``(1, 1, 2, 4)``, the caches ``(1, 1, 9, 4)`` and the
new k, v ``(1, 1, 2, 4)``. Every figure is recomputed here with plain torch ops, by the equations, not by the
library; a figure that is float64 round-off is the one the command prints, so those two are the library's.
A figure is right when it is the computed value rounded to the digits the doc prints.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach import cli

ROOT = Path(__file__).resolve().parents[2]
REPLAY_DOC = ROOT / "docs" / "replay.md"
FORWARD = "--seed 0 --batch 1 --seq-len 6 --head-dim 4 --dtype float64 --block-m 2 --block-n 2 --query-block 0"


def doc_text() -> str:
    return REPLAY_DOC.read_text(encoding="utf-8")


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def as_printed(quoted: str, value: float) -> str:
    """``value`` with as many significant digits as ``quoted`` shows (``0.1745``: 4, ``2.2e-16``: 2)."""
    mantissa = quoted.split("e")[0].lstrip("-").replace(".", "").lstrip("0")
    return f"{value:.{max(len(mantissa), 1)}g}"


def g4(x: float) -> str:
    return f"{x:.4g}"


def mismatches(pairs: list[tuple[str, float]]) -> list[str]:
    return [
        f"doc {quoted}, computed {as_printed(quoted, value)}"
        for quoted, value in pairs
        if as_printed(quoted, value) != quoted
    ]


# ---- the forward example ----------------------------------------------------------------------------------------


def teaching_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    return q[0], k[0], v[0]


def running_statistics(sink: float | None = None) -> list[dict[str, torch.Tensor]]:
    """Rows 0-1 after each of the three key tiles of width 2: the running max, denominator and the output so
    far, by FlashAttention-2's equations, with an optional sink (a key of score ``sink`` and value zero)."""
    q, k, v = teaching_example()
    S = q[:2] @ k.T / math.sqrt(4)  # (2, 4) @ (4, 6) -> (2, 6)
    states = []
    for t in (1, 2, 3):
        seen = S[:, : 2 * t]
        m = seen.max(dim=1).values
        if sink is not None:
            m = torch.maximum(m, torch.tensor(sink, dtype=m.dtype))
        P = torch.exp(seen - m[:, None])
        l = P.sum(dim=1) + (torch.exp(sink - m) if sink is not None else 0)  # the paper's l_i
        states.append({"m": m, "l": l, "O": P @ v[: 2 * t] / l[:, None], "S": S[:, 2 * t - 2 : 2 * t]})
    return states


def printed_forward_error(tmp_path: Path) -> float:
    """The last update's ``max |acc / l_i - O|``, as ``flashattn-teach replay forward --format json`` prints it."""
    out = tmp_path / "replay.json"
    assert cli.main(["replay", "forward", *FORWARD.split(), "--format", "json", "--out", str(out)]) == 0
    cases = json.loads(out.read_text(encoding="utf-8"))["cases"]
    printed = [m["value"] for m in cases[-1]["metrics"] if m["label"].startswith("Max difference from final")]
    assert len(printed) == 1 and printed[0] < 1e-15, printed
    return float(printed[0])


def forward_error_figures(text: str, last_printed: float) -> list[tuple[str, float]]:
    quoted = re.search(r"falls from (\S+) to (\S+) and then to (\S+) \(float64 round-off\)", flat(text))
    assert quoted, "docs/replay.md no longer quotes the partial output's error"
    q, k, v = teaching_example()
    dense = torch.softmax(q[:2] @ k.T / 2, dim=-1) @ v  # rows 0-1 over all six keys
    errors = [(state["O"] - dense).abs().max().item() for state in running_statistics()[:2]]
    return list(zip(quoted.groups(), [*errors, last_printed], strict=True))


def sink_figures(text: str) -> list[tuple[str, float]]:
    quoted = re.search(
        r"row 0 has share (\S+), (\S+) and (\S+) after its three tiles \(row 1: (\S+), (\S+), ([^)]+)\)", flat(text)
    )
    assert quoted, "docs/replay.md no longer quotes the sink shares"
    states = running_statistics(sink=1.0)
    shares = [math.exp(1.0 - s["m"][row].item()) / s["l"][row].item() for row in (0, 1) for s in states]
    return list(zip(quoted.groups(), shares, strict=True))


def test_the_partial_outputs_errors_are_the_quoted_ones(tmp_path: Path) -> None:
    assert not mismatches(forward_error_figures(doc_text(), printed_forward_error(tmp_path)))


def test_the_sink_shares_are_the_quoted_ones() -> None:
    assert not mismatches(sink_figures(doc_text()))


def test_the_equations_numbers_of_row_0_are_the_quoted_ones() -> None:
    first, second, third = running_statistics()
    m1, m2, m3 = (state["m"][0].item() for state in (first, second, third))
    l1, l2, l3 = (state["l"][0].item() for state in (first, second, third))
    alpha = math.exp(m1 - m2)
    S2 = second["S"][0].tolist()
    P2 = [math.exp(s - m2) for s in S2]
    lines = [
        f"max(−∞, {g4(m1)}) = {g4(m1)}",
        f"0 · 0 + {g4(l1)} = {g4(l1)}",
        f"max({g4(m1)}, {g4(m2)}) = {g4(m2)}",
        f"exp({g4(m1)} − {g4(m2)}) = {g4(alpha)}",
        f"exp([{g4(S2[0])}, {g4(S2[1])}] − {g4(m2)}) = [{g4(P2[0])}, {g4(P2[1])}]",
        f"{g4(alpha)} · {g4(l1)} + {g4(sum(P2))} = {g4(l2)}",
        f"lse_i = m_i + log(l_i) = {g4(m3)} + log({g4(l3)}) = {g4(m3 + math.log(l3))}",
        f"from {g4(m1)} to {g4(m2)}, and what was accumulated is rescaled by {g4(alpha)}",
    ]
    missing = [line for line in lines if line not in flat(doc_text())]
    assert not missing, f"docs/replay.md's equations differ from the teaching example's: {missing}"


# ---- the decode example -----------------------------------------------------------------------------------------


def decode_step() -> dict[str, list[float]]:
    """One decode step by hand: 5 cached keys, 2 new ones written at 5 and 6, 2 queries at positions 5 and 6
    (causal, bottom-right), three split-KV ranges [0, 3), [3, 6), [6, 7), merged in order."""
    torch.manual_seed(0)
    q, k_cache, v_cache, k_new, v_new = (
        torch.randn(shape, dtype=torch.float64) for shape in [(2, 4), (9, 4), (9, 4), (2, 4), (2, 4)]
    )
    K = torch.cat([k_cache[:5], k_new])  # (7, 4): the valid keys after the write
    V = torch.cat([v_cache[:5], v_new])
    S = q @ K.T / 2  # (2, 4) @ (4, 7) -> (2, 7), scale 1/sqrt(4)
    S = S.masked_fill(torch.arange(7)[None, :] > torch.tensor([[5], [6]]), -math.inf)  # query i sees j <= 5 + i
    dense = torch.softmax(S, dim=-1) @ V
    partials = []
    for lo, hi in ((0, 3), (3, 6), (6, 7)):
        lse = torch.logsumexp(S[:, lo:hi], dim=-1)  # -inf for a row that sees none of the range's keys
        P = torch.exp(S[:, lo:hi] - torch.where(lse.isinf(), 0.0, lse)[:, None])
        partials.append((P @ V[lo:hi], lse))
    (O0, lse0), (O1, lse1), (_, lse2) = partials
    lse01 = torch.logaddexp(lse0, lse1)
    w_a, w_b = torch.exp(lse0 - lse01), torch.exp(lse1 - lse01)
    lse = torch.logaddexp(lse01, lse2)
    return {
        "partial errors": [(O - dense).abs().max().item() for O, _ in partials],
        "lse": [lse0[0].item(), lse1[0].item(), lse01[0].item()],
        "weights": [w_a[0].item(), w_b[0].item()],
        "merged error": [(w_a[:, None] * O0 + w_b[:, None] * O1 - dense).abs().max().item()],
        "last weight": [torch.exp(lse2 - lse)[1].item()],
    }


def printed_decode_error() -> float:
    """The merged output's error after the last merge, as the replay records it (float64 round-off)."""
    from flashattn_teach.replay import replay_decode

    torch.manual_seed(0)
    q, k_cache, v_cache, k, v = (
        torch.randn(shape, dtype=torch.float64)
        for shape in [(1, 1, 2, 4), (1, 1, 9, 4), (1, 1, 9, 4), (1, 1, 2, 4), (1, 1, 2, 4)]
    )
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, causal=True, num_splits=3, block_n=2)
    return float(r.merges[-1].max_diff)


def decode_figures(text: str, last_printed: float) -> list[tuple[str, float]]:
    step = flat(text)
    partial = re.search(r"largest difference from the dense float64 output (\S+), (\S+) and ([^)]+)\)", step)
    lse = re.search(r"\(`lse` (\S+) and (\S+) give ([^)]+)\)", step)
    weights = re.search(r"weights `exp\(lse_a - lse\) = (\S+)` and `exp\(lse_b - lse\) = ([^`]+)`", step)
    merged = re.search(r"and the error falls to (\S+)\. The second merge", step)
    last = re.search(r"query 1's weight (\S+); the error falls to (\S+), float64 round-off", step)
    assert partial and lse and weights and merged and last, "docs/replay.md's decode example changed its wording"
    computed = decode_step()
    return list(
        zip(
            [*partial.groups(), *lse.groups(), *weights.groups(), *merged.groups(), *last.groups()],
            [
                *computed["partial errors"],
                *computed["lse"],
                *computed["weights"],
                *computed["merged error"],
                *computed["last weight"],
                last_printed,
            ],
            strict=True,
        )
    )


def test_the_decode_steps_figures_are_the_quoted_ones() -> None:
    assert not mismatches(decode_figures(doc_text(), printed_decode_error()))


# ---- the checks catch a wrong figure ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "right,wrong",
    [("and then to 2.2e-16", "and then to 4.4e-16"), ("0.7935, 0.3233", "0.7935, 0.3234"), ("0.1745;", "0.1746;")],
)
def test_a_changed_figure_is_caught(right: str, wrong: str, tmp_path: Path) -> None:
    # The negative control: the same checks, on the doc with one figure changed by one unit of its last digit.
    text = doc_text()
    assert right in text
    changed = text.replace(right, wrong)
    found = (
        mismatches(forward_error_figures(changed, 2.220446049250313e-16))
        + mismatches(sink_figures(changed))
        + mismatches(decode_figures(changed, 5.551115123125783e-16))
    )
    assert len(found) == 1 and wrong.split()[-1].rstrip(";").split(", ")[-1] in found[0], found


# ---- explain's lines, quoted in docs/usage.md and docs/serving.md ------------------------------------------------


def quoted_explain(doc: str, start: str) -> str:
    """The part after the ``...`` of the code span in ``doc`` that holds ``start``."""
    text = flat((ROOT / "docs" / doc).read_text(encoding="utf-8"))
    span = re.search(r"`([^`]*" + re.escape(start) + r"[^`]*)`", text)
    assert span, f"docs/{doc} no longer quotes explain's {start!r}"
    return re.split(r"\.\.\.;? ", span.group(1), maxsplit=1)[1]


def test_explain_of_a_left_padded_causal_batch_is_the_quoted_line() -> None:
    # usage.md: B=2, H=8, N=2048, D=64, a Hugging Face causal mask with 600 padded positions in element 1.
    B, H, N, D = 2, 8, 2048, 64
    q = k = v = torch.zeros(B, H, N, D)
    real = torch.ones(B, N, dtype=torch.bool)
    real[1, :600] = False
    mask = (torch.ones(N, N, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]  # (B, 1, N, N)
    quoted = quoted_explain("usage.md", "attn_mask read tile by tile")
    assert quoted in str(fa.explain(q, k, v, attn_mask=mask))


def test_explain_with_kvcache_of_the_decode_step_is_the_quoted_line() -> None:
    # serving.md: B=2, H_q=8, H_kv=2, cache_seqlens=[37, 20], one new key and query, num_splits=3, on the CPU.
    q, k_new = torch.zeros(2, 8, 1, 64), torch.zeros(2, 2, 1, 64)
    k_cache, v_cache = torch.zeros(2, 2, 64, 64), torch.zeros(2, 2, 64, 64)
    lengths = torch.tensor([37, 20], dtype=torch.int32)
    quoted = quoted_explain("serving.md", "key ranges per batch element")
    line = fa.explain_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=lengths, num_splits=3)
    assert quoted in str(line)


# ---- memory, step by step (docs/replay.md) ----------------------------------------------------------------------


def schedule_bytes() -> dict[str, list[int]]:
    """Bytes by the rules docs/replay.md states (every load reaches HBM): N = 6, D = 4, float64 matrices (8 B),
    statistics ``m, l, lse`` in float32 (4 B), 2 x 2 tiles, so 3 query blocks and 3 key blocks."""
    N, D, e, s, Br, Bc = 6, 4, 8, 4, 2, 2
    T_r, T_c = N // Br, N // Bc
    matrix, block_q, block_k = N * D * e, Br * D * e, Bc * D * e  # a whole Q (or O), Q_i (or O_i), K_j
    stats = Br * D * e + 2 * Br * s  # O_i, l_i, m_i
    scores = N * N * e
    return {
        "on chip": [block_q + 2 * block_k + Br * D * e + Br * Bc * e + 2 * Br * s],  # Q_i K_j V_j acc S_ij m_i l_i
        "block 0 reads": [block_q + t * 2 * block_k for t in (1, 2, 3)],  # Q_0 once, then K_j and V_j per update
        "block 0 writes": [block_q + Br * s],  # O_0 and lse_0
        "query-major": [matrix + 2 * T_r * matrix + matrix + N * s],  # Q once, K and V per query block, O, lse
        "key-major": [(matrix + 2 * N * s) + 2 * matrix + T_r * T_c * (block_q + 2 * stats)],  # init, K, V, tiles
        "standard": [3 * matrix + 4 * scores + matrix, 4 * scores],  # Q, K, V read; S, P written and read; O
    }


def test_the_memory_figures_are_the_byte_counts_of_the_schedules() -> None:
    section = flat(doc_text().split("## Memory, step by step", 1)[1].split("\n## ", 1)[0])
    patterns = {
        "on chip": r"one tile update holds (\d+) bytes on chip",
        "block 0 reads": r"three updates have read (\d+), (\d+) and (\d+) B",
        "block 0 writes": r"`lse_0` \((\d+) B\)",
        "query-major": r"query-major schedule moves (\d+) B",
        "key-major": r"key-major order moves (\d+) B",
        "standard": r"standard attention (\d+) B, (\d+) of them",
    }
    computed = schedule_bytes()
    for what, pattern in patterns.items():
        match = re.search(pattern, section)
        assert match, f"docs/replay.md no longer quotes the {what} bytes"
        assert [int(g) for g in match.groups()] == computed[what], what


def test_the_memory_rules_are_the_replays() -> None:
    # The rules above are the replay's: its Memory panel's totals at the end of each schedule.
    from flashattn_teach.replay import replay
    from flashattn_teach.replay.memory import closed_form, dense_traffic

    q, k, v = (t[None] for t in teaching_example())
    r = replay(q, k, v, block_m=2, block_n=2)
    forms = {
        order: closed_form(replay(q, k, v, block_m=2, block_n=2, order=order)) for order in ("query_major", "key_major")
    }
    totals = {order: t.total_bytes for order, t in forms.items() if t is not None}
    computed = schedule_bytes()
    assert totals == {"query_major": computed["query-major"][0], "key_major": computed["key-major"][0]}
    assert dense_traffic(r).total_bytes == computed["standard"][0]

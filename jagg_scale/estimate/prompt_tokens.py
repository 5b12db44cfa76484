"""The text tokens of a transformer pass of a family whose prompts run at their encoded length (Qwen-Image: a pass
carries its rows' longest prompt, models/qwenimage.py), from the encoded lengths of a prompt set recorded in its shape
file (`text_tokens.encoded`: [[length, prompts], ...], shapes/README.md says how they were measured).

    longest(encoded, cap)                          the longest prompt the set holds: every pass at most this (memory)
    expected_longest(encoded, cap, rows, distinct) a pass's longest on average, over `distinct` prompts (step time)
    distinct_prompts(rows, prompts, group)         prompts among `rows` rows drawn from a step's prompts x group

A pass's rows are drawn at random from the step's rows (train/rows.py shuffles them), `group` rows per prompt, so they
hold fewer prompts than rows; the expected longest of d prompts drawn from the set is sum_L L (F(L)^d - F(L-1)^d),
F the set's distribution, taken at the expected d (an approximation: exact for d fixed).
"""

from __future__ import annotations

import math

__all__ = ["distinct_prompts", "expected_longest", "longest"]


def _capped(encoded: list, cap: int) -> list[tuple[int, int]]:
    """(tokens, prompts) by length, each prompt at most `cap` tokens (model.max_sequence_length cuts the rest)."""
    out: dict[int, int] = {}
    for length, count in encoded:
        out[min(int(length), cap)] = out.get(min(int(length), cap), 0) + int(count)
    return sorted(out.items())


def longest(encoded: list, cap: int) -> int:
    return _capped(encoded, cap)[-1][0]


def expected_longest(encoded: list, cap: int, rows: int, distinct: float | None = None) -> float:
    """The expected longest prompt of a pass of `rows` rows holding `distinct` prompts (default: all different)."""
    d = rows if distinct is None else distinct
    table = _capped(encoded, cap)
    total, below, out = sum(n for _, n in table), 0, 0.0
    for length, n in table:
        out += length * (((below + n) / total) ** d - (below / total) ** d)
        below += n
    return out


def distinct_prompts(rows: int, prompts: int, group: int) -> float:
    """E[the prompts among `rows` rows drawn without replacement from `prompts` x `group` rows]: each prompt is
    missed with probability C(N - group, rows) / C(N, rows)."""
    n = prompts * group
    rows = min(rows, n)
    missed = math.exp(math.lgamma(n - group + 1) - math.lgamma(n - group - rows + 1) - math.lgamma(n + 1)
                      + math.lgamma(n - rows + 1)) if rows <= n - group else 0.0
    return prompts * (1 - missed)

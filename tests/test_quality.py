"""Degeneration and distinct-n measures on crafted token sequences."""

from cactus_edge.quality import distinct_ngram_ratio, is_degenerate, repeated_span


def test_a_span_repeated_three_times_in_a_row_is_found():
    loop = list(range(100, 110))  # 10 tokens
    tokens = list(range(40)) + loop * 3 + [7]
    assert repeated_span(tokens) == 10
    assert repeated_span(list(range(40)) + loop * 2 + [7]) == 0  # twice is not a loop
    assert repeated_span(list(range(40)) + loop[:7] * 3) == 0  # 7-token spans are too short


def test_a_short_period_repeated_often_counts_through_its_multiples():
    # "a b a b a b ..." has period 2, so spans of 8 (four periods) repeat too.
    assert repeated_span([1, 2] * 20) == 8


def test_degeneration_looks_at_the_final_quarter_only():
    loop = list(range(200, 209)) * 3  # 27 tokens
    early = loop + list(range(1000, 1173))  # the loop, then 173 fresh tokens: 200 in all
    late = list(range(1000, 1173)) + loop
    assert not is_degenerate(early) and is_degenerate(late)
    assert not is_degenerate([]) and not is_degenerate([1, 2, 3])


def test_distinct_ngrams():
    assert distinct_ngram_ratio(list(range(10))) == 1.0
    assert distinct_ngram_ratio([5] * 10) == 1 / 7
    assert distinct_ngram_ratio([1, 2, 3]) is None

"""rl2gem.evaluation's statistics on evaluation records."""

import pytest

from rl2gem.evaluation import EpisodeRecord, paired_comparison, summarize


def test_paired_comparison_counts_discordant_items_and_gives_the_exact_sign_test():
    def evaluation(solved, em=True):
        return [
            EpisodeRecord(i, 7, i, float(s), 2, bool(s), True, False, 0, None, 0, [], {"em": float(s)} if em else {})
            for i, s in enumerate(solved)
        ]

    # 34 gained, 5 lost, 61 unchanged: p = 2 * sum_{k<=5} C(39, k) / 2^39 (by hand: 2 * 667928 / 2^39)
    before = evaluation([0] * 34 + [1] * 5 + [1] * 30 + [0] * 31)
    after = evaluation([1] * 34 + [0] * 5 + [1] * 30 + [0] * 31)
    gained, lost, p = paired_comparison(before, after)
    assert (gained, lost) == (34, 5) and p == pytest.approx(2 * 667928 / 2**39)
    assert paired_comparison(evaluation([0, 0, 0]), evaluation([1, 1, 1], em=False)) == (3, 0, 0.25)
    assert paired_comparison(evaluation([1, 0]), evaluation([1, 0])) == (0, 0, 1.0)  # nothing changed
    with pytest.raises(ValueError, match="not on the same items"):
        paired_comparison(evaluation([1, 0]), evaluation([1]))


def test_paired_comparison_takes_an_item_s_responses_as_its_solve_rate():
    """Four responses per item: item 0 goes from 3 of 4 solved to 1 of 4 (lost), item 1 from 1 to
    2 (gained), item 2 stays at 2. Keyed by item, only each item's last response counted before
    (2 gained, 0 lost for a mean that fell from 0.5 to 0.42)."""

    def evaluation(per_item):
        return [
            EpisodeRecord(4 * i + j, 7, i, float(s), 1, bool(s), True, False, 0, None, 0, [], {"em": float(s)})
            for i, outcomes in enumerate(per_item)
            for j, s in enumerate(outcomes)
        ]

    before = evaluation([[1, 1, 1, 0], [0, 0, 1, 0], [1, 1, 0, 0]])
    after = evaluation([[0, 0, 0, 1], [1, 0, 1, 0], [0, 0, 1, 1]])
    assert paired_comparison(before, after) == (1, 1, 1.0)


def test_format_followed_counts_an_episode_that_did_not_report_it_as_not_followed():
    """Where the env reports ``format_ok``, an episode whose last step did not (a rejected empty
    answer, a truncation) did not follow the format: 1 of 4 here, not 1 of the 2 that reported it.
    An env that never reports it gets n/a."""

    def record(format_ok):
        return EpisodeRecord(0, 0, None, 0.0, 1, False, True, False, 0, format_ok, 5)

    def followed(records):
        return next(line.split()[-1] for line in summarize(records, 1.0).splitlines() if "format followed" in line)

    assert followed([record(True), record(False), record(None), record(None)]) == "0.250"
    assert followed([record(None)]) == "n/a"

import pytest

from rl2gem.rewards.qa import exact_match, normalize_answer, token_f1


@pytest.mark.parametrize(
    "text, normal",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   Apple, a day ", "apple day"),
        ("U.S.A.", "usa"),
        ("Théâtre", "théâtre"),
    ],
)
def test_squad_normalisation(text, normal):
    assert normalize_answer(text) == normal


def test_exact_match_takes_the_best_gold():
    assert exact_match("the united states", ["USA", "United States"]) == 1.0
    assert exact_match("United States of America", ["United States"]) == 0.0
    assert exact_match("Paris", "paris.") == 1.0


def test_token_f1_by_hand():
    # pred {new, york, city}, gold {new, york}: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("New York City", "new york") == pytest.approx(0.8)
    assert token_f1("York", ["New York", "York"]) == 1.0
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("the", "Paris") == 0.0


def test_a_gold_answer_of_one_article_keeps_it():
    """The blood type "A" is all article: SQuAD's normalisation would leave it empty, and an
    empty or filler answer ("the", "?") would match it with full marks. Its articles stay, on
    both sides, so only "A" (any case or punctuation) matches."""
    for answer in ("A", "a.", " A "):
        assert exact_match(answer, "A") == 1.0 and token_f1(answer, "A") == 1.0
    for answer in ("", "the", "?", "O", "an"):
        assert exact_match(answer, "A") == 0.0 and token_f1(answer, "A") == 0.0
    assert exact_match("the A", ["A"]) == 0.0 and token_f1("the A", "A") == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [
        ("\u201cParis\u201d", "Paris"),  # curly quotes
        ("Paris\u2019", "Paris"),
        ("Zu\u0308rich", "Z\u00fcrich"),  # u + combining diaeresis against the precomposed letter
        ("\uff30\uff21\uff32\uff29\uff33", "Paris"),  # full-width letters
        ("Lyndon B. Johnson \u2014 the 36th", "Lyndon B Johnson 36th"),  # an em dash
        ("\u00bfMadrid?", "Madrid"),
    ],
)
def test_unicode_forms_and_punctuation_normalise_like_ascii(prediction, gold):
    assert exact_match(prediction, gold) == 1.0 and token_f1(prediction, gold) == 1.0


def test_ascii_punctuation_and_symbols_are_squads():
    # SQuAD removes string.punctuation, symbols included ($, +); Unicode symbols stay (not P*)
    assert normalize_answer("$5 + 3%") == "5 3"
    assert normalize_answer("\u00a35") == "\u00a35" and normalize_answer("x\u00b2") == "x2"  # NFKC: ² is 2


def test_numeric_gold_answers_are_compared_as_text():
    assert exact_match("1984", 1984) == 1.0 and exact_match("It was 1984.", [1983, 1984]) == 0.0
    assert token_f1("in 1984", 1984) == pytest.approx(2 / 3)
    with pytest.raises(TypeError, match="a gold answer must be text or a number, got NoneType"):
        exact_match("x", [None])
    with pytest.raises(TypeError, match="got NoneType"):
        token_f1("x", None)

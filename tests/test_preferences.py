"""rl2gem.data.load_preferences: RL2's RM / DPO rows from files, and clear errors for bad rows."""

import json

import pytest

from rl2gem.data import DataUnavailable, load_preferences


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_and_messages_rows_with_string_and_multi_turn_responses(tmp_path):
    rows = [
        {"prompt": "The capital of China is", "chosen": "Beijing.", "rejected": "Shanghai."},
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            "chosen": [
                {"role": "assistant", "content": "<search>2+2</search>"},
                {"role": "user", "content": "<information>4</information>"},
                {"role": "assistant", "content": "4"},
            ],
            "rejected": "5",
            "ref_chosen_logps": -3.5,
            "ref_rejected_logps": -2.0,
        },
    ]
    first, second = load_preferences(write_jsonl(tmp_path / "p.jsonl", rows))
    assert first.prompt == [{"role": "user", "content": "The capital of China is"}]
    assert first.chosen == [{"role": "assistant", "content": "Beijing."}]
    assert first.rejected == [{"role": "assistant", "content": "Shanghai."}]
    assert [m["role"] for m in second.prompt] == ["system", "user"]
    assert [m["content"] for m in second.chosen] == ["<search>2+2</search>", "<information>4</information>", "4"]
    assert second.extra == {"ref_chosen_logps": -3.5, "ref_rejected_logps": -2.0}


def test_csv_cells_holding_message_lists_are_parsed(tmp_path):
    path = tmp_path / "p.csv"
    messages = json.dumps([{"role": "user", "content": "hi, there"}]).replace('"', '""')
    path.write_text(f'messages,chosen,rejected\n"{messages}",Hello!,Go away.\n')
    (pair,) = load_preferences(str(path))
    assert pair.prompt == [{"role": "user", "content": "hi, there"}]
    assert pair.chosen[0]["content"] == "Hello!" and pair.rejected[0]["content"] == "Go away."


def test_a_reply_that_looks_like_a_list_stays_text(tmp_path):
    (pair,) = load_preferences(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": "[3]", "rejected": "[]"}]))
    assert pair.chosen == [{"role": "assistant", "content": "[3]"}] and pair.rejected[0]["content"] == "[]"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x", "chosen": "a"}, r"missing \['rejected'\]"),
        ({"prompt": "x", "chosen": 2, "rejected": "b"}, r"'chosen': messages must be a non-empty list, got 2"),
        (
            {"prompt": "x", "chosen": "a", "rejected": "b", "ref_chosen_logps": "abc", "ref_rejected_logps": -1.0},
            r"'ref_chosen_logps' must be a number \(a sequence log-prob\), got 'abc'",
        ),
        ({"chosen": "a", "rejected": "b"}, r"missing \['prompt'\]"),
        ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "start with an assistant"),
        (
            {"messages": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
            "ends with an assistant",
        ),
        (
            {"prompt": "x", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}, {"role": "critic"}]},
            "role 'critic'",
        ),
    ],
)
def test_bad_rows_name_the_row_and_the_problem(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataUnavailable, match=message) as info:
        load_preferences(path)
    assert "row 1" in str(info.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_file_mixing_reply_strings_and_message_lists_keeps_every_value(tmp_path, suffix):
    """collect pairs=true writes one-turn replies as strings and multi-turn ones as lists: datasets'
    JSON reader fell back to pandas on the mix and read the reply "50" as the number 50."""
    multi = [{"role": "assistant", "content": "<search>x</search>"}, {"role": "user", "content": "ok"}]
    multi += [{"role": "assistant", "content": "49"}]
    rows = [
        {"prompt": "Guess.", "chosen": "50", "rejected": multi},
        {"prompt": "Guess again.", "chosen": multi, "rejected": "50"},
    ]
    path = tmp_path / f"pairs{suffix}"
    path.write_text(json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows))
    first, second = load_preferences(str(path))
    assert first.chosen == [{"role": "assistant", "content": "50"}] and first.rejected == multi
    assert second.chosen == multi and second.rejected == [{"role": "assistant", "content": "50"}]

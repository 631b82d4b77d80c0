"""load_conversations: RL2's SFT data formats from every file type load_table reads."""

import csv
import json

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pytest

from rl2gem.data import DataUnavailable, load_conversations

SYSTEM = {"role": "system", "content": "You are helpful."}
ROWS = [
    {"prompt": "What is the capital of France?", "response": "Paris."},
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Find the capital of Peru."},
            {"role": "assistant", "content": "<search>Peru capital</search>"},
            {"role": "tool", "content": "<information>Lima is the capital of Peru.</information>", "name": "search"},
            {"role": "assistant", "content": "<answer>Lima</answer>"},
        ]
    },
]
EXPECTED = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    ROWS[1]["messages"],
    ROWS[2]["messages"],
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_all_formats(folder):
    """The same rows as .json, .jsonl, .csv (messages as JSON cells), .parquet and both Arrow IPC forms."""
    jsonl = write_jsonl(folder / "rows.jsonl", ROWS)
    (folder / "rows.json").write_text(json.dumps(ROWS), encoding="utf-8")
    with open(folder / "rows.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "response", "messages"])
        writer.writeheader()
        for row in ROWS:
            writer.writerow({**row, "messages": json.dumps(row["messages"])} if "messages" in row else row)
    table = datasets.load_dataset("json", data_files=str(jsonl), split="train")
    table.to_parquet(str(folder / "rows.parquet"))
    arrow = table.data.table
    with pa.OSFile(str(folder / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, arrow.schema) as writer:
        writer.write_table(arrow)  # the IPC stream form (what Dataset.save_to_disk writes)
    with pa.OSFile(str(folder / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, arrow.schema) as writer:
        writer.write_table(arrow)  # the IPC file form
    return ["rows.json", "rows.jsonl", "rows.csv", "rows.parquet", "stream.arrow", "file.arrow"]


def test_every_file_format_gives_the_same_conversations(tmp_path):
    names = write_all_formats(tmp_path)
    for name in names:
        assert load_conversations(str(tmp_path / name)) == EXPECTED, name


def test_split_mapping_picks_the_file_of_the_split(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:1])
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[1:])
    files = {"train": str(train), "test": str(test)}
    assert load_conversations(files) == EXPECTED[:1]
    assert load_conversations(files, split="test") == EXPECTED[1:]
    with pytest.raises(DataUnavailable, match="no file for split 'validation'"):
        load_conversations(files, split="validation")


def test_prompt_given_as_messages_is_kept(tmp_path):
    prompt = [SYSTEM, {"role": "user", "content": "Name a prime."}]
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": prompt, "response": "7"}])
    assert load_conversations(str(path)) == [[*prompt, {"role": "assistant", "content": "7"}]]


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"question": "2+2?", "answer": "4"}, r"row 1 .*unknown row shape"),
        ({"prompt": "2+2?"}, r"row 1 .*unknown row shape"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
            r"row 1 .*role 'robot'",
        ),
        ({"messages": [SYSTEM, {"role": "user", "content": "hi"}]}, r"row 1 .*no assistant turn"),
        ({"messages": []}, r"row 1 .*non-empty list"),
        (
            {"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "2+2?"}]},
            r"row 1 .*starts with an assistant turn",
        ),
        ({"prompt": "2+2?", "response": 4}, r"row 1 .*'response' must be a string, got int"),
        ({"prompt": "2+2?", "response": ""}, r"row 1 .*'response' is empty"),
        (  # OpenAI's function-calling shape: the call would be dropped, the model trained to stop at once
            {
                "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather"}}]},
                    {"role": "tool", "content": "18C"},
                    {"role": "assistant", "content": "18C and sunny."},
                ]
            },
            r"row 1 .*message 1: an assistant turn is trained on its 'content' only, and this one also has \['tool_calls'\]",
        ),
    ],
)
def test_bad_rows_are_named(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], bad_row])
    with pytest.raises(DataUnavailable, match=message):
        load_conversations(str(path))


def test_csv_cell_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('messages\n"[{""role"": ""user""}, oops"\n', encoding="utf-8")
    with pytest.raises(DataUnavailable, match=r"row 0 .*not JSON"):
        load_conversations(str(path))


def test_csv_cells_stay_text(tmp_path):
    # pandas would read 4 and 0.5 as numbers and NA / null as missing values; a messages cell and a
    # prompt cell may hold JSON message lists; an empty cell is a missing key (rows of mixed shapes)
    path = tmp_path / "rows.csv"
    prompt = [SYSTEM, {"role": "user", "content": "Name a prime."}]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "response", "messages"])
        writer.writeheader()
        writer.writerow({"prompt": "What is 2+2?", "response": "4"})
        writer.writerow({"prompt": "1/2 as a decimal?", "response": "0.5"})
        writer.writerow({"prompt": "Symbol of sodium, upper case?", "response": "NA"})
        writer.writerow({"prompt": "SQL's missing value?", "response": "null"})
        writer.writerow({"prompt": json.dumps(prompt), "response": "7"})
        writer.writerow({"messages": json.dumps(EXPECTED[0])})
    replies = [conversation[-1]["content"] for conversation in load_conversations(str(path))]
    assert replies == ["4", "0.5", "NA", "null", "7", "Paris."]
    assert load_conversations(str(path))[4] == [*prompt, {"role": "assistant", "content": "7"}]


@pytest.mark.parametrize(
    ("text", "message"), [("", "the data file is empty"), ('{"prompt": "a",\n', "could not read it as json")]
)
def test_unreadable_files_are_named(tmp_path, text, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataUnavailable, match=f"rows.jsonl: {message}"):
        load_conversations(str(path))


def test_files_without_rows_and_an_empty_csv_response_are_named(tmp_path):
    import pyarrow
    import pyarrow.parquet

    header_only = tmp_path / "header.csv"
    header_only.write_text("prompt,response\n", encoding="utf-8")
    with pytest.raises(DataUnavailable, match="header.csv: the data file has no rows"):
        load_conversations(str(header_only))
    empty = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"prompt": pyarrow.array([], pyarrow.string())}), empty)
    with pytest.raises(DataUnavailable, match="empty.parquet: the data file has no rows"):
        load_conversations(str(empty))
    blank = tmp_path / "blank.csv"
    blank.write_text('prompt,response\n"2+2?",4\n"3+3?",\n', encoding="utf-8")
    with pytest.raises(DataUnavailable, match=r"row 1 .*'response' is empty"):  # was: unknown row shape
        load_conversations(str(blank))


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(DataUnavailable, match="not found"):
        load_conversations(str(tmp_path / "absent.jsonl"))
    odd = tmp_path / "rows.txt"
    odd.write_text("x", encoding="utf-8")
    with pytest.raises(DataUnavailable, match="unknown data file type"):
        load_conversations(str(odd))


def test_unreachable_hub_dataset(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read once at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataUnavailable, match="rl2gem-no-such-owner/no-such-sft-data"):
        load_conversations("rl2gem-no-such-owner/no-such-sft-data")


def test_json_lines_with_a_line_separator_in_a_string_and_a_byte_order_mark(tmp_path):
    """json.dumps(ensure_ascii=False), as collect writes rows, leaves U+2028 raw in a string: a
    reader that split lines on it could not read the file; a BOM is not part of the JSON."""
    row = {"messages": [{"role": "user", "content": "a\u2028b\x85c"}, {"role": "assistant", "content": "ok"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n" + json.dumps(row, ensure_ascii=False) + "\n")
    assert load_conversations(str(path)) == [row["messages"]] * 2
    with_bom = tmp_path / "bom.json"
    with_bom.write_bytes(b"\xef\xbb\xbf" + json.dumps([row]).encode())
    assert load_conversations(str(with_bom)) == [row["messages"]]

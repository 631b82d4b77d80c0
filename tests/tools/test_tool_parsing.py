"""Tool-call parsing and the tools prompt."""

import json

from rl2gem.tools import FunctionTool, parse_tool_calls, tools_prompt


def test_hermes_blocks_in_order_with_text_around():
    text = (
        'I will compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": "Paris"}}</tool_call> done'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("python", {"code": "print(1)"}, None),
        ("search", {"query": "Paris"}, None),
    ]


def test_unterminated_block_and_string_arguments_and_list_body():
    (c,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}')
    assert (c.name, c.arguments, c.error) == ("f", {"x": 2}, None)
    calls = parse_tool_calls(
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"y": 1}}]</tool_call>'
    )
    assert [(c.name, c.arguments) for c in calls] == [("a", {}), ("b", {"y": 1})]


def test_malformed_calls_are_reported_not_raised():
    bad = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call><tool_call></tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": [1]}</tool_call>'
    )
    assert len(bad) == 4 and all(c.error for c in bad)
    assert "not valid JSON" in bad[0].error and "empty" in bad[1].error
    assert '"name"' in bad[2].error and bad[3].name == "g" and "object" in bad[3].error


def test_fenced_json_fallback_only_for_call_shaped_objects():
    text = 'Let me call it:\n```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)] == [("add", {"a": 1, "b": 2})]
    listed = (
        '```\n[{"name": "a", "arguments": {}}, {"type": "function", "function": {"name": "b", "arguments": {}}}]\n```'
    )
    assert [c.name for c in parse_tool_calls(listed)] == ["a", "b"]
    assert parse_tool_calls('```json\n{"answer": 42}\n```') == []
    assert parse_tool_calls("The answer is \\boxed{42}.") == []
    # tagged blocks win over fences
    assert [c.name for c in parse_tool_calls(text + '<tool_call>{"name": "t", "arguments": {}}</tool_call>')] == ["t"]


def test_tools_prompt_lists_every_schema_and_the_format():
    def add(a: int, b: int = 0) -> int:
        """Add two numbers."""
        return a + b

    tool = FunctionTool(add, instructions="Prefer add for sums.")
    text = tools_prompt([tool])
    body = text.split("<tools>\n")[1].split("\n</tools>")[0]
    (line,) = body.splitlines()
    assert json.loads(line)["function"]["name"] == "add"
    assert "<tool_call>" in text and "Prefer add for sums." in text
    # the example in the prompt is itself a parseable call
    assert parse_tool_calls(text.split("</tools>")[1])[0].name == "add"


def test_replies_python_cannot_read_as_json_are_reported_not_raised():
    """An integer of more than 4300 digits raised ValueError and nesting past the recursion limit
    RecursionError, through env.step: one model reply ended the rollout (and the training step)."""
    from rl2gem.tools.base import openai_call_arguments

    huge = "9" * 5000
    deep = "[" * 2000 + "]" * 2000
    cases = {
        f'<tool_call>{{"name": "f", "arguments": {{"n": {huge}}}}}</tool_call>': "not readable as JSON",
        f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>': "nested too deeply",
        f'<tool_call>{{"name": "f", "arguments": "{{\\"n\\": {huge}}}"}}</tool_call>': "arguments of f are not readable",
    }
    for text, problem in cases.items():
        (call,) = parse_tool_calls(text)
        assert call.error and problem in call.error, call.error
    assert parse_tool_calls(f"```json\n{deep}\n```") == []  # a fenced block that is no call is prose
    assert parse_tool_calls("```json\n" + "[" * 800 + "]" * 800 + "\n```") == []
    assert openai_call_arguments([{"function": {"name": "f", "arguments": f'{{"n": {huge}}}'}}])[0][0] == "f"
